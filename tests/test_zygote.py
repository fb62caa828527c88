"""The zygote (``tools/zygote.py``): a ``diloco-peer`` command forked from it runs as the same command started fresh
would (its arguments, streams, directory, environment, session; signals and exit status as ``Popen`` reports them),
and ``LocalSwarm`` forks only what the zygote can serve."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
import pytest
from conftest import SESSION_ENVIRONMENT, require_namespaces, wait_for_line

from diloco_peer.config.faults import FAULT_ENV
from diloco_peer.tools.local_swarm import LocalSwarm, diloco_command
from diloco_peer.tools.zygote import Forked, Zygote


def forked(zygote, tmp_path, *args: str, env: dict | None = None, log: str = "out.log", cmd=None,
           netns: str = "", cgroup="") -> Forked:
    with (tmp_path / log).open("a") as out:
        return zygote.spawn(cmd or diloco_command(*args), stdout=out, env={**os.environ, **(env or {})},
                            cwd=tmp_path, netns=netns, cgroup=cgroup)


def test_a_forked_command_has_its_arguments_output_directory_and_environment(tmp_path, zygote):
    keygen = forked(zygote, tmp_path, "keygen", "peer.key")  # relative: written into its working directory
    assert keygen.wait(timeout=60) == 0 and (tmp_path / "peer.key").stat().st_mode & 0o777 == 0o600
    assert "peer id" in (tmp_path / "out.log").read_text()

    bad = forked(zygote, tmp_path, "join", "not-an-address", log="bad.log")
    assert bad.wait(timeout=60) == 2
    assert (tmp_path / "bad.log").read_text().startswith("diloco-peer: error: bad bootstrap address 'not-an-address'")

    fault = forked(zygote, tmp_path, "keygen", "other.key", env={FAULT_ENV: "no_such_fault"}, log="env.log")
    assert fault.wait(timeout=60) == 2  # its environment, checked as the command starts
    assert FAULT_ENV in (tmp_path / "env.log").read_text() and not (tmp_path / "other.key").exists()
    assert fault.args == diloco_command("keygen", "other.key")


@pytest.mark.slow
@pytest.mark.light
def test_a_forked_process_leads_its_session_and_is_signalled_and_reaped_as_popen_says(tmp_path, zygote):
    codes = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        log = f"bootstrap-{sig.name}.log"
        proc = forked(zygote, tmp_path, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", log=log)
        wait_for_line(tmp_path / log, "diloco-peer join ", proc)
        assert os.getsid(proc.pid) == proc.pid and psutil.Process(proc.pid).ppid() == zygote.proc.pid
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        proc.send_signal(sig)
        codes[sig] = proc.wait(timeout=60)
        proc.kill()  # exited: no signal goes to its pid any more
    assert codes == {signal.SIGTERM: 0, signal.SIGKILL: -signal.SIGKILL}


def test_a_local_swarm_forks_what_the_zygote_serves_and_starts_the_rest_fresh(tmp_path, zygote):
    with LocalSwarm(tmp_path, zygote=zygote) as swarm:
        served = swarm.spawn(["--version"], "served.log")
        wrapped = swarm.spawn(["--version"], "wrapped.log", wrap=["nice", "-n", "1"])
        level = zygote.env["HIVEMIND_LOGLEVEL"]  # (hivemind's, as the zygote imported it)
        other_logging = swarm.spawn(["--version"], "logging.log",
                                    env={"HIVEMIND_LOGLEVEL": "ERROR" if level != "ERROR" else "INFO"})
        verbose = swarm.spawn(["-v", "--version"], "verbose.log")  # (-v: hivemind's log level as it is imported)
        for proc in (served, wrapped, other_logging, verbose):
            assert proc.wait(timeout=60) == 0
    assert isinstance(served, Forked)
    assert all(isinstance(proc, subprocess.Popen) for proc in (wrapped, other_logging, verbose))
    assert all(swarm.log(name).read_text().startswith("diloco-peer ") for name in ("served", "wrapped", "logging"))
    # where unset, the level is the one the CLI sets before it imports hivemind
    unset = {k: v for k, v in os.environ.items() if k != "HIVEMIND_LOGLEVEL"}
    assert zygote.forks(diloco_command("--version"), unset) == (level == "WARNING")
    # torch's cache directory, which torch sets itself once something has compiled, is no difference
    assert zygote.forks(diloco_command("--version"), {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})


def test_a_script_runs_as_its_own_main_in_the_network_namespace_it_is_given(tmp_path, zygote):
    require_namespaces()
    script = tmp_path / "links.py"
    script.write_text("import sys\n"
                      "lines = open('/proc/self/net/dev').readlines()[2:]\n"
                      "print(__name__, sys.argv[1:], sorted(line.split(':')[0].strip() for line in lines))\n")
    name = f"zygote-test-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        proc = forked(zygote, tmp_path, cmd=[sys.executable, str(script), "a", "b"], netns=name)
        assert proc.wait(timeout=60) == 0
    finally:
        subprocess.run(["ip", "netns", "del", name], check=True)
    assert (tmp_path / "out.log").read_text() == "__main__ ['a', 'b'] ['lo']\n"  # a new namespace: loopback only


def test_a_forked_command_enters_its_cgroup_before_it_runs(tmp_path, zygote):
    """A slower volunteer forked from the zygote (a stand-in cgroup directory: the real one needs root): the child
    writes its own pid to ``cgroup.procs`` before the command's first line runs, so that every process it starts
    is in the group too, and its start costs the imports it no longer does at the group's pace."""
    group = tmp_path / "slowpeer"
    group.mkdir()
    (group / "cgroup.procs").touch()
    script = tmp_path / "where.py"
    script.write_text(f"import os\nprint(open({str(group / 'cgroup.procs')!r}).read() == str(os.getpid()))\n")
    proc = forked(zygote, tmp_path, cmd=[sys.executable, str(script)], cgroup=group)
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "out.log").read_text() == "True\n" and int((group / "cgroup.procs").read_text()) == proc.pid


def test_a_command_killed_holding_hivemind_s_locks_never_hangs_the_next_ones(tmp_path):
    """hivemind makes process-shared locks as it is imported, and every ``MPFuture`` takes one as it is made: a
    command SIGKILLed while it held it (or stopped: a test suspends a DHT process) must not hang the commands
    forked after it, as a fresh process's own import would not. (It did: in a suite's run every test after a
    SIGKILL test failed, its peers' DHTs hung in their first call.) A zygote of its own: one whose lock is lost
    hangs every command it forks after."""
    holder, maker = tmp_path / "hold.py", tmp_path / "make.py"
    holder.write_text("import time\nfrom hivemind.utils.mpfuture import SharedBytes\n"
                      "from hivemind.utils.asyncio import _AsyncContextWrapper\n"
                      "SharedBytes._lock.acquire()\n_AsyncContextWrapper.EXECUTOR_LOCK.acquire()\n"
                      "print('holding', flush=True)\ntime.sleep(120)\n")
    maker.write_text("from hivemind.utils.mpfuture import MPFuture\nfrom hivemind.utils.asyncio import "
                     "_AsyncContextWrapper\nfuture = MPFuture()\nfuture.set_result(7)\n"
                     "print(future.result(), _AsyncContextWrapper.get_process_wide_executor() is not None)\n")
    with Zygote.start(env=SESSION_ENVIRONMENT) as own:
        held = forked(own, tmp_path, cmd=[sys.executable, str(holder)], log="hold.log")
        wait_for_line(tmp_path / "hold.log", "holding", held)
        held.send_signal(signal.SIGKILL)
        assert held.wait(timeout=60) == -signal.SIGKILL
        made = forked(own, tmp_path, cmd=[sys.executable, str(maker)], log="make.log")
        try:
            assert made.wait(timeout=20) == 0, (tmp_path / "make.log").read_text()
        finally:
            made.kill()
    assert (tmp_path / "make.log").read_text() == "7 True\n"
