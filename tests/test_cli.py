"""The command line against real subprocesses: bad input gets one line and a non-zero exit; the
bootstrap prints a pasteable join line and keeps its identity across restarts."""

import fcntl
import json
import os
import pty
import re
import socket
import struct
import subprocess
import termios
import time

import pytest
from conftest import FAST, diloco_cmd, p2pd_pids, wait_for_line

from diloco_peer.events import EventLog

PEER_ID = "12D3KooWHQEFuYFG1pGNfSsfDsM5nCiACFRgDLDg5faqtUaKTuzT"
GOOD_ADDR = f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}"


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(diloco_cmd(*args), capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "args, code, must_contain",
    [
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
        (["demo", "--metrics-port-base", "65530", "--peers", "8"], 2, "--metrics-port-base 65530"),
    ],
)
def test_bad_input_one_line_error(args, code, must_contain):
    result = run_cli(*args)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("diloco-peer: error: ") and must_contain in lines[0]


def test_unknown_command_is_usage_error():
    result = run_cli("frobnicate")
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_unreachable_bootstrap_names_the_address():
    before = p2pd_pids()
    result = run_cli("join", GOOD_ADDR, "--set", "swarm.startup_timeout=10", "--set", "swarm.join_timeout=0")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and GOOD_ADDR in lines[0] and "could not reach" in lines[0]
    assert p2pd_pids() <= before, "a failed start must not leave a p2pd daemon behind"


def test_bootstrap_prints_join_line_and_keeps_identity(local_swarm):
    key = local_swarm.workdir / "keys" / "boot.key"
    made = run_cli("keygen", str(key))
    assert made.returncode == 0, made.stderr
    assert key.stat().st_mode & 0o777 == 0o600
    assert run_cli("keygen", str(key)).returncode == 2  # never overwrites an identity by accident
    peer_ids = [re.search(r"peer id (\w+)", made.stdout).group(1)]
    address_file = local_swarm.workdir / "shared" / "bootstrap.addr"  # what compose's peers read
    for attempt in range(2):
        proc = local_swarm.spawn(["bootstrap", "--identity", str(key), "--listen", "/ip4/127.0.0.1/tcp/0",
                                  "--address-file", str(address_file)], f"boot{attempt}.log")
        line = wait_for_line(local_swarm.workdir / f"boot{attempt}.log", "diloco-peer join ", proc)
        match = re.fullmatch(r"diloco-peer join (/ip4/127\.0\.0\.1/tcp/\d+/p2p/(\w+))", line)
        assert match, line
        assert address_file.read_text() == match.group(1) + "\n"
        peer_ids.append(match.group(2))
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    assert peer_ids[0] == peer_ids[1] == peer_ids[2]  # keygen's peer id, kept across restarts


def test_unreachable_bootstrap_is_retried_with_backoff_then_given_up():
    started = time.monotonic()
    result = run_cli("join", GOOD_ADDR, "--set", "swarm.join_timeout=5")
    assert result.returncode == 1
    assert len(re.findall(r"retrying in \d+s", result.stdout)) >= 2, result.stdout
    assert "gave up after swarm.join_timeout=5s" in result.stderr and GOOD_ADDR in result.stderr
    assert 5 <= time.monotonic() - started < 50


def test_a_peer_started_before_its_bootstrap_joins_once_it_is_up(local_swarm):
    """Bootstrap down at start: the peer keeps retrying and trains as soon as the bootstrap comes up."""
    key = local_swarm.workdir / "boot.key"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    listen = ["bootstrap", "--identity", str(key), "--listen", f"/ip4/127.0.0.1/tcp/{port}"]
    boot = local_swarm.spawn(listen, "boot0.log")  # first run: creates the identity, tells us the address
    address = wait_for_line(local_swarm.workdir / "boot0.log", "diloco-peer join ", boot).split()[2]
    boot.terminate()
    assert boot.wait(timeout=20) == 0

    local_swarm.address = address
    peer = local_swarm.start_peer("early", "swarm.join_timeout=120", "averaging.min_peers=1", "run.max_rounds=1")
    deadline = time.monotonic() + 60
    while "retrying in" not in (local_swarm.workdir / "early.log").read_text():
        assert time.monotonic() < deadline and peer.poll() is None
        time.sleep(0.2)
    boot = local_swarm.spawn(listen, "boot1.log")
    assert peer.wait(timeout=120) == 0, (local_swarm.workdir / "early.log").read_text()
    rounds = [json.loads(line) for line in (local_swarm.workdir / "early.jsonl").read_text().splitlines()]
    assert [e["round"] for e in rounds if e["event"] == "round"] == [1]


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
    assert set(runs) == {"single", "kx_batch-k2", "diloco-k2-int8-blocking"}
    assert runs["kx_batch-k2"]["tokens"][-1] == runs["diloco-k2-int8-blocking"]["tokens"][-1] == 2 * 2 * 5 * 8 * 128
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
