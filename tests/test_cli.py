"""The command line against real subprocesses: bad input gets one line and a non-zero exit; the
bootstrap prints a pasteable join line and keeps its identity across restarts. And in-process, fuzzed:
any argv ends in a documented exit code, with one line on stderr for an error and never a traceback."""

import argparse
import contextlib
import fcntl
import io
import json
import os
import pty
import re
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
import types
from pathlib import Path

import pytest
from conftest import FAST, diloco_cmd, orphaned_p2pd_pids, wait_for_line
from helpers import GOOD_ADDR, PEER_ID, run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diloco_peer import cli
from diloco_peer.config import PeerConfig
from diloco_peer.observe.events import EventLog

BAD_INPUTS = [
        (["join", "not-an-address"], 2, "not-an-address"),
        (["join", "/ip4/1.2.3.4/tcp/31337"], 2, "missing /p2p/"),
        (["join", "/ip4/999.1.1.1/tcp/1/p2p/" + PEER_ID], 2, "999.1.1.1"),
        (["join", GOOD_ADDR, "--set", "inner.lrr=1"], 2, "inner.lrr"),
        (["join", GOOD_ADDR, "--set", 'inner.lr="fast"'], 2, "fast"),
        (["join", GOOD_ADDR, "--set", "outer.nesterov=maybe"], 2, "outer.nesterov"),
        (["join", GOOD_ADDR, "--set", "nonsense"], 2, "section.key=value"),
        (["join", GOOD_ADDR, "--config", "no-such-config"], 2, "tiny-cpu"),
        (["demo", "--peers", "0"], 2, "--peers"),
        (["demo", "--set", "model.hidden_size=65"], 2, "hidden_size"),
        (["demo", "--churn", "kill:1@round2,explode"], 2, "explode"),
        (["demo", "--peers", "2", "--churn", "kill:2@round1"], 2, "leaves no peer"),
        (["simulate", "--replicas", "0"], 2, "--replicas"),
        (["simulate", "--set", "outer.lr=-1"], 2, "outer.lr"),
        (["plot", "/no/such/runs"], 2, "/no/such/runs"),
        (["bootstrap", "--metrics-port", "70000"], 2, "--metrics-port 70000"),
        (["status", "not-an-address"], 2, "not-an-address"),
        (["keygen", "/tmp"], 2, "is a directory"),
        (["keygen", "--secret", "/proc/nope/swarm.secret"], 2, "cannot write it (No such file or directory)"),
        (["demo", "--metrics-port-base", "65530", "--peers", "8"], 2, "--metrics-port-base 65530"),
        (["join", GOOD_ADDR, "--config", "/no/such/dir/peer.toml"], 2, "'/no/such/dir/peer.toml' not found"),
        (["join", GOOD_ADDR, "--name", "../../etc/x"], 2, "'../../etc/x' is not a name"),
        (["bootstrap", "--report-every", "nan"], 2, "'nan' is not a number of seconds > 0"),
        (["join"], 2, "BOOTSTRAP_MULTIADDR (see diloco-peer join --help)"),
        (["join", GOOD_ADDR, "--set", 'data.source="shards"', "--set", 'data.shards_dir="/no/such/shards"'], 2,
         "data.shards_dir '/no/such/shards' holds no manifest.json"),
]


@pytest.mark.parametrize("args, code, must_contain", BAD_INPUTS)
def test_bad_input_one_line_error(args, code, must_contain):
    result = run_cli(*args)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("diloco-peer: error: ") and must_contain in lines[0]


def test_bad_input_is_refused_before_torch_or_hivemind_is_imported():
    """A typo costs a fraction of a second, not the ~3 s of importing torch and hivemind: every command line
    is checked before the heavy imports."""
    script = ("import json, sys\n"
              "from diloco_peer.cli import main\n"
              "for args in json.loads(sys.argv[1]):\n"
              "    assert main(args) == 2, args\n"
              "    heavy = [m for m in ('torch', 'hivemind') if m in sys.modules]\n"
              "    assert not heavy, f'diloco-peer {\" \".join(args)} imported {heavy} before refusing it'\n")
    light = [args for args, _, _ in BAD_INPUTS if "--secret" not in args]  # admission.py's classes need hivemind
    result = subprocess.run([sys.executable, "-c", script, json.dumps(light)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]


def test_unknown_command_is_usage_error():
    result = run_cli("frobnicate")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("diloco-peer: error: argument COMMAND: invalid choice: 'frobnicate'")


@pytest.mark.parametrize("variable, value", [
    ("DILOCO_PEER_FAULT", "crash_in_allreduce:soon"),  # ours: a typo used to inject no fault, silently
    ("HIVEMIND_LOGLEVEL", "loud"),  # hivemind's, read at its import: a traceback from inside hivemind
    ("HIVEMIND_DHT_NUM_WORKERS", "many"),
])
def test_bad_environment_variable_is_a_one_line_usage_error(variable, value):
    result = subprocess.run(diloco_cmd("join", GOOD_ADDR), capture_output=True, text=True, timeout=60,
                            env={**os.environ, variable: value})
    assert result.returncode == cli.EXIT_USAGE, result.stderr
    assert result.stderr == (f"diloco-peer: error: bad environment variable {variable}={value!r}: expected "
                             f"{cli_expected(variable)}; fix it or unset it (unset {variable})\n")


def cli_expected(variable: str) -> str:
    from diloco_peer.config.environment import ENVIRONMENT

    return ENVIRONMENT[variable][1]


@pytest.mark.slow
@pytest.mark.light
def test_status_of_an_unreachable_swarm_exits_3_at_once():
    before = orphaned_p2pd_pids()
    result = run_cli("status", GOOD_ADDR, "--wait", "1")
    assert result.returncode == cli.EXIT_UNREACHABLE, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco-peer: error: could not reach") and GOOD_ADDR in lines[0]
    assert orphaned_p2pd_pids() <= before, "a failed status must not leave a p2pd daemon behind"


class _Payload:
    """Unpickling it creates the file ``path``: a checkpoint carrying it shows whether pickled code runs."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


@pytest.mark.light
@pytest.mark.slow
def test_a_checkpoint_carrying_pickled_code_is_refused_and_the_code_never_runs(local_swarm):
    import torch

    marker = local_swarm.workdir / "pickle-code-ran"
    checkpoints = local_swarm.workdir / "checkpoints"
    (checkpoints / "mallory").mkdir(parents=True)
    torch.save({"format_version": 1, "payload": _Payload(marker)}, checkpoints / "mallory" / "epoch-000009.pt")
    local_swarm.start_bootstrap()
    sets = [*FAST, f"checkpoint.dir={json.dumps(str(checkpoints))}",
            f"run.log_dir={json.dumps(str(local_swarm.workdir))}"]
    result = run_cli("join", local_swarm.address, "--name", "mallory", *[a for s in sets for a in ("--set", s)],
                     timeout=120)
    assert result.returncode == cli.EXIT_USAGE, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "epoch-000009.pt cannot be read" in lines[0] and "delete it" in lines[0], lines
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.light
def test_unreachable_bootstrap_is_retried_with_backoff_then_given_up_in_one_line_naming_it():
    """Every try fails the same way (join_timeout=0 stops after the first: the admission test's outsider), and no
    failed try leaves a p2pd daemon behind."""
    before = orphaned_p2pd_pids()  # (other tests' daemons may start meanwhile: only one left behind counts)
    started = time.monotonic()
    # 12 s: room for two retries (after 2 s and 4 s) even where starting the DHT takes seconds (a loaded machine)
    result = run_cli("join", GOOD_ADDR, "--set", "swarm.startup_timeout=10", "--set", "swarm.join_timeout=12")
    assert result.returncode == cli.EXIT_UNREACHABLE
    assert len(re.findall(r"retrying in \d+s", result.stdout)) >= 2, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and GOOD_ADDR in lines[0] and "could not reach" in lines[0], lines
    assert "gave up after swarm.join_timeout=12s" in lines[0]
    assert 12 <= time.monotonic() - started < 60
    assert orphaned_p2pd_pids() <= before, "a failed start must not leave a p2pd daemon behind"


@pytest.mark.light
def test_a_bootstrap_keeps_its_identity_and_a_peer_started_before_it_joins_once_it_is_up(local_swarm):
    """keygen makes an identity (and never overwrites one); a bootstrap started with it prints a pasteable join line
    and writes its address for compose's peers. A peer started while it is down keeps retrying, and trains as soon as
    the bootstrap is back: same identity, same port, the same address."""
    key = local_swarm.workdir / "keys" / "boot.key"
    made = run_cli("keygen", str(key))
    assert made.returncode == 0, made.stderr
    assert key.stat().st_mode & 0o777 == 0o600
    assert run_cli("keygen", str(key)).returncode == 2  # never overwrites an identity by accident
    peer_ids = [re.search(r"peer id (\w+)", made.stdout).group(1)]
    address_file = local_swarm.workdir / "shared" / "bootstrap.addr"  # what compose's peers read
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def boot(attempt: int) -> tuple[subprocess.Popen, str]:
        proc = local_swarm.spawn(["bootstrap", "--identity", str(key), "--listen", f"/ip4/127.0.0.1/tcp/{port}",
                                  "--address-file", str(address_file)], f"boot{attempt}.log")
        line = wait_for_line(local_swarm.workdir / f"boot{attempt}.log", "diloco-peer join ", proc)
        match = re.fullmatch(rf"diloco-peer join (/ip4/127\.0\.0\.1/tcp/{port}/p2p/(\w+))", line)
        assert match, line
        assert address_file.read_text() == match.group(1) + "\n"
        peer_ids.append(match.group(2))
        return proc, match.group(1)

    first, address = boot(0)
    first.terminate()
    assert first.wait(timeout=20) == 0
    local_swarm.address = address  # bootstrap down at the peer's start: it keeps retrying
    peer = local_swarm.start_peer("early", "swarm.join_timeout=120", "averaging.min_peers=1", "run.max_rounds=1")
    deadline = time.monotonic() + 60
    while "retrying in" not in (local_swarm.workdir / "early.log").read_text():
        assert time.monotonic() < deadline and peer.poll() is None
        time.sleep(0.2)
    second, again = boot(1)
    assert again == address
    assert peer_ids[0] == peer_ids[1] == peer_ids[2]  # keygen's peer id, kept across restarts
    assert peer.wait(timeout=120) == 0, (local_swarm.workdir / "early.log").read_text()
    rounds = [json.loads(line) for line in (local_swarm.workdir / "early.jsonl").read_text().splitlines()]
    assert [e["round"] for e in rounds if e["event"] == "round"] == [1]
    second.terminate()
    assert second.wait(timeout=20) == 0


def test_simulate_writes_results_and_plot(tmp_path):
    result = run_cli("simulate", "--replicas", "2", "--rounds", "2", "--out", str(tmp_path), "--codec", "int8",
                     "--pretrain", "20", "--set", "outer.inner_steps=5", "--set", "data.max_bytes=200_000",
                     "--set", "run.threads=1", timeout=300)
    assert result.returncode == 0, result.stderr
    saved = json.loads((tmp_path / "simulate.json").read_text())
    runs = {r["name"]: r for r in saved["runs"]}
    # every run starts from the same pretrained weights (from scratch the eval loss is ~5.2, ln 256 = 5.5)
    assert saved["pretrain"] == 20 and len({r["eval_loss"][0] for r in runs.values()}) == 1
    assert runs["single"]["eval_loss"][0] < 4.0
    diloco = "diloco-k2-int8-blocking-robust"  # robust aggregation, the default, names itself
    assert set(runs) == {"single", "kx_batch-k2", diloco}
    assert runs["kx_batch-k2"]["tokens"][-1] == runs[diloco]["tokens"][-1] == 2 * 2 * 5 * 8 * 128
    assert all(r["final_eval_loss"] < r["eval_loss"][0] for r in runs.values())
    assert (tmp_path / "eval_loss.png").stat().st_size > 10_000 and "vs Kx-batch" in result.stdout


def test_plot_turns_event_logs_into_a_png(tmp_path):
    log = EventLog(tmp_path / "p0.jsonl")
    log.write("start", peer="p0", eval_loss=5.2, epoch=0)
    for i in range(1, 7):
        log.write("progress", peer="p0", epoch=(i - 1) // 3, inner_step=i, steps=1, seconds=0.1, loss=5.0 - i / 3,
                  lr=1e-3, tokens=1024, tokens_per_second=9000.0 + i)
        if i % 3 == 0:
            log.write("round", peer="p0", round=i // 3, eval_loss=5.0 - i / 3)
    log.close()
    result = run_cli("plot", str(tmp_path), "--out", str(tmp_path / "plots" / "run.png"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "plots" / "run.png").stat().st_size > 10_000 and "1 peers: p0" in result.stdout


@pytest.mark.light
@pytest.mark.slow
def test_join_on_a_terminal_shows_a_live_status_bar(local_swarm):
    local_swarm.start_bootstrap()
    cmd = diloco_cmd("join", local_swarm.address, "--name", "tty")
    for item in [*FAST, "outer.inner_steps=20", "averaging.min_peers=1", "run.max_rounds=2",
                 f"run.log_dir={json.dumps(str(local_swarm.workdir))}"]:
        cmd += ["--set", item]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a terminal has a width
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=local_swarm.workdir,
                            start_new_session=True)
    local_swarm.procs.append(proc)
    os.close(slave)
    output = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal closed: the peer exited
            break
        if not chunk:
            break
        output += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, output.decode(errors="replace")[-3000:]
    text = output.decode(errors="replace")
    # the bar redraws in place (carriage returns) with the round, steps, loss and throughput...
    assert "\r" in text and re.search(r"round 1: +\d+%.*\d+/20", text), text[-3000:]
    assert "tok/s" in text and "loss " in text
    # ...and the round's log line still prints, above it
    assert re.search(r"round 1: solo with group of 1", text) and re.search(r"round 2: solo", text), text[-3000:]


@pytest.mark.light
def test_a_sigkilled_bootstrap_leaves_no_orphans(local_swarm):
    psutil = pytest.importorskip("psutil")
    local_swarm.start_bootstrap()
    boot = local_swarm.procs[0]
    children = [c for c in psutil.Process(boot.pid).children(recursive=True) if c.name() != "python3"
                or "reaper" not in " ".join(c.cmdline())]
    assert any("p2pd" in c.name() for c in children), children
    boot.kill()
    boot.wait()
    deadline = time.monotonic() + 10
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        assert time.monotonic() < deadline, [c for c in children if c.is_running()]
        time.sleep(0.2)


# --- in-process fuzzing of the whole command line

def test_exit_codes_are_distinct_and_listed_in_help(capsys):
    codes = [cli.EXIT_OK, cli.EXIT_RUNTIME, cli.EXIT_USAGE, cli.EXIT_UNREACHABLE, cli.EXIT_INTERRUPTED]
    assert len(set(codes)) == len(codes)
    assert cli.main(["--help"]) == cli.EXIT_OK
    shown = re.findall(r"^  (\d+) ", capsys.readouterr().out.split("exit codes:")[1], re.MULTILINE)
    assert sorted(map(int, shown)) == sorted(codes)


PEER_IDS = [PEER_ID, "QmSq4MCMhk63DNKQPagY7AFijPRZm61djFttAMRReaxVgs"]
GOOD_ADDRS = [GOOD_ADDR, f"/ip6/::1/tcp/31337/p2p/{PEER_IDS[1]}", f"/dns4/boot.example.org/udp/1/quic/p2p/{PEER_ID}"]


def _mutated(text: str, at: int, junk: str, cut: int) -> str:
    at %= len(text) + 1
    return text[:at] + junk + text[at + cut:]


MULTIADDRS = st.one_of(
    st.sampled_from(GOOD_ADDRS + ["/ip4/0.0.0.0/tcp/0", "/ip4/1.2.3.4/tcp/31337", "/ip4/999.1.1.1/tcp/1", ""]),
    st.builds(_mutated, st.sampled_from(GOOD_ADDRS), st.integers(0, 80), st.text(max_size=6), st.integers(0, 8)),
    st.text(max_size=40),
)


def _safe(text: str) -> bool:
    """Paths the fuzzer may pass: relative to its scratch directory, which it must not leave."""
    return not text.startswith(("/", "~")) and ".." not in text


GARBAGE = st.one_of(
    st.sampled_from(["", "-", "--", "-1", "0", "nan", "inf", "-inf", "1e999", "1" * 5000, "\x00", "--set", "x" * 300]),
    st.text(max_size=20).filter(_safe),
)
NUMBERS = st.one_of(st.integers(-5, 70_000).map(str), st.floats().map(str), st.integers().map(str), GARBAGE)
NAMES = st.one_of(st.sampled_from(["diloco-tiny", "run.2", "peer_0", "a" * 64, "a" * 65, ".hidden", "a b"]), GARBAGE)
CONFIG_KEYS = [f"{section}.{key}" for section, field in PeerConfig.model_fields.items()
               for key in field.annotation.model_fields]
SETS = st.one_of(
    st.builds(lambda key, value: f"{key}={value}", st.sampled_from(CONFIG_KEYS),
              st.one_of(NUMBERS, st.sampled_from(['"x"', "[]", "true", '"/ip4/0.0.0.0/tcp/0"']))),
    st.sampled_from(["outer.inner_steps=5", "data.source=files", 'data.paths=["missing.txt"]',
                     'run.log_dir="logs/a"', 'checkpoint.dir=""', 'swarm.identity_path="garbage.key"',
                     'swarm.host_maddrs=["nonsense"]', 'run.log_dir="a_file"']),
    GARBAGE,
)
# the scratch directory holds these (see cli_sandbox); every other path the fuzzer writes is relative to it
PATHS = st.one_of(st.sampled_from(["new/dir/f", "a_dir", "a_file", "garbage.key", "good.key", "empty_dir",
                                   "logs/bad.jsonl", "logs/good.jsonl", "logs", "/proc/nope/x", "x" * 5000, ""]),
                  GARBAGE)
VALUES = {
    "bootstrap": MULTIADDRS, "listen": MULTIADDRS, "announce": MULTIADDRS, "initial_peer": MULTIADDRS,
    "overrides": SETS, "run_id": NAMES, "name": NAMES,
    "config": st.one_of(st.sampled_from(["tiny-cpu", "llama-1b", "no-such", "a_file", "/no/such.toml"]), GARBAGE),
    "churn": st.one_of(st.sampled_from(["kill:1@round2", "join:1@round1,term:1@round2", "kill:9@round1"]), GARBAGE),
    "metrics_host": st.one_of(st.sampled_from(["127.0.0.1", "0.0.0.0", "no such host"]), GARBAGE),
}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _values_for(action: argparse.Action) -> st.SearchStrategy:
    if action.dest in VALUES:
        return VALUES[action.dest]
    if action.choices:
        return st.one_of(st.sampled_from(list(action.choices)), GARBAGE)
    if action.type is not None:  # the numbers: int, float and cli's bounded types
        return NUMBERS
    return PATHS


@st.composite
def argvs(draw) -> list[str]:
    """An argv of a real command, its real flags (and a few unknown ones), with good, odd and bad values."""
    command, parser = draw(st.sampled_from(sorted(_subparsers().items())))
    argv = draw(st.lists(st.sampled_from(["-v", "--verbose"]), max_size=1)) + [command]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings:  # a positional: mostly given, sometimes several, sometimes missing
            argv += draw(st.lists(_values_for(action), min_size=0 if draw(st.booleans()) else 1, max_size=2))
        elif draw(st.integers(0, 2)) == 0:
            flag = draw(st.sampled_from(action.option_strings))
            for _ in range(draw(st.integers(1, 2)) if isinstance(action, argparse._AppendAction) else 1):
                argv += [flag] if action.nargs == 0 else [flag, draw(_values_for(action))]
    if draw(st.integers(0, 9)) == 0:
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--no-such-flag", "--help", "-x"])))
    return argv


async def _started(*args, **kwargs) -> int:
    return cli.EXIT_OK


class _StartedDaemon:
    def __init__(self, cfg, bootstrap, name, owns_process=False, adopt=None):
        pass

    async def run(self) -> int:
        return cli.EXIT_OK


@pytest.fixture(scope="module")
def cli_sandbox(tmp_path_factory) -> Path:
    """The fuzzer's scratch directory: a file, directories, a key file and a garbage one, logs good and bad."""
    root = tmp_path_factory.mktemp("cli-fuzz")
    (root / "a_dir").mkdir()
    (root / "empty_dir").mkdir()
    (root / "a_file").write_text("[inner]\nlr = 1e-3\n")
    (root / "garbage.key").write_bytes(b"not a key")
    from diloco_peer.swarm.addresses import generate_identity

    generate_identity(str(root / "good.key"))
    (root / "logs").mkdir()
    (root / "logs" / "bad.jsonl").write_text("this is not JSON\n")
    log = EventLog(root / "logs" / "good.jsonl")
    log.write("start", peer="p0", eval_loss=5.0, epoch=0)
    log.close()
    return root


@pytest.fixture
def commands_stopped_at_the_network(monkeypatch, cli_sandbox):
    """main() validates for real; what would start a DHT, a swarm or training returns 0 instead."""
    import diloco_peer.bootstrap_node
    import diloco_peer.observe.report
    import diloco_peer.tools.demo
    import diloco_peer.tools.simulate
    from diloco_peer.observe.events import read_events

    monkeypatch.setitem(sys.modules, "diloco_peer.daemon", types.SimpleNamespace(PeerDaemon=_StartedDaemon))
    monkeypatch.setattr(diloco_peer.bootstrap_node, "run_bootstrap", _started)
    monkeypatch.setattr(diloco_peer.bootstrap_node, "run_status", _started)
    monkeypatch.setattr(diloco_peer.tools.demo, "run_demo", lambda args: cli.EXIT_OK)
    monkeypatch.setattr(diloco_peer.tools.simulate, "run_simulate", lambda args, cfg: cli.EXIT_OK)
    # the plot reads every event (a bad log fails as it would), then draws nothing
    monkeypatch.setattr(diloco_peer.observe.report, "plot_losses",
                        lambda logs, png: [list(read_events(p)) for p in logs.values()] and png)
    monkeypatch.chdir(cli_sandbox)
    # main() sets HIVEMIND_LOGLEVEL (DEBUG with -v) for hivemind to read: undone after the test, or the peers
    # that later tests start would inherit it and log hivemind's debug lines
    monkeypatch.setenv("HIVEMIND_LOGLEVEL", "WARNING")


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(argv=argvs())
def test_fuzzed_command_lines_exit_with_a_documented_code_and_one_line(commands_stopped_at_the_network, argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    # only validation runs, so: valid (0, or --help), or bad input (2)
    assert code in (cli.EXIT_OK, cli.EXIT_USAGE), (code, err.getvalue())
    if code == cli.EXIT_OK:
        assert err.getvalue() == "", err.getvalue()
    else:
        lines = err.getvalue().split("\n")
        assert len(lines) == 2 and lines[1] == "" and lines[0].startswith("diloco-peer: error: "), err.getvalue()
        assert "Traceback" not in lines[0]


def test_two_processes_with_one_identity_the_second_fails_fast(local_swarm):
    """One identity, one process: while a bootstrap runs, a second bootstrap, a join and a relaying join with its
    key stop at once (the key file's lock); a copy of the key, as on another machine, is found by hivemind's
    check on the DHT. The first keeps serving, and once it is SIGKILLed its identity is free again."""
    key = local_swarm.workdir / "keys" / "one.key"  # created on first use, by the first bootstrap
    address = local_swarm.start_bootstrap("--identity", str(key))
    first = local_swarm.procs[-1]
    join = ["join", address, "--reachability", "direct", "--set", 'checkpoint.dir=""',
            "--set", f"run.log_dir={json.dumps(str(local_swarm.workdir))}"]

    def in_use(path: Path) -> tuple[int, list[str]]:
        return cli.EXIT_RUNTIME, [f"diloco-peer: error: identity {path} is already used by another running peer: "
                                  f"give each process its own --identity file"]

    for second in (["bootstrap", "--identity", str(key), "--listen", "/ip4/127.0.0.1/tcp/0"],
                   [*join, "--identity", str(key)], [*join, "--identity", str(key), "--relay"]):
        started = time.monotonic()
        result = run_cli(*second)
        assert (result.returncode, result.stderr.strip().splitlines()) == in_use(key), result
        assert time.monotonic() - started < 5, (second, time.monotonic() - started)
    copy = local_swarm.workdir / "copy.key"
    copy.write_bytes(key.read_bytes())
    result = run_cli(*join, "--identity", str(copy))
    assert (result.returncode, result.stderr.strip().splitlines()) == in_use(copy), result

    assert first.poll() is None
    socket.create_connection(("127.0.0.1", int(address.split("/tcp/")[1].split("/")[0])), timeout=5).close()
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    again = local_swarm.start_bootstrap("--identity", str(key), log_name="again.log")
    assert again.rsplit("/p2p/", 1)[1] == address.rsplit("/p2p/", 1)[1]
