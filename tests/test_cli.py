"""The command line against real subprocesses: bad input gets one line and a non-zero exit; the
bootstrap prints a pasteable join line and keeps its identity across restarts."""

import re
import subprocess

import pytest
from conftest import diloco_cmd, p2pd_pids, wait_for_line

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
    result = run_cli("join", GOOD_ADDR, "--set", "swarm.startup_timeout=10")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and GOOD_ADDR in lines[0] and "could not reach" in lines[0]
    assert p2pd_pids() <= before, "a failed start must not leave a p2pd daemon behind"


def test_bootstrap_prints_join_line_and_keeps_identity(local_swarm):
    key = local_swarm.workdir / "boot.key"
    peer_ids = []
    for attempt in range(2):
        proc = local_swarm.spawn(["bootstrap", "--identity", str(key), "--listen", "/ip4/127.0.0.1/tcp/0"],
                                 f"boot{attempt}.log")
        line = wait_for_line(local_swarm.workdir / f"boot{attempt}.log", "diloco-peer join ", proc)
        match = re.fullmatch(r"diloco-peer join (/ip4/127\.0\.0\.1/tcp/\d+/p2p/(\w+))", line)
        assert match, line
        peer_ids.append(match.group(2))
        proc.terminate()
        assert proc.wait(timeout=20) == 0
    assert key.exists() and peer_ids[0] == peer_ids[1]
