"""Run a real swarm on an emulated slow network and measure it: what the network benchmarks share.

    with SlowNetwork(peers=3, mbit=20) as net:
        stats = run_swarm(net, ["outer.overlap=eager", "averaging.compression=int8"], rounds=6, workdir=Path("w"))
        stats["utilization"], stats["bytes_per_token"], stats["ddp_bytes_per_token"]

A bootstrap node and peer 0 share namespace 0; peer i runs ``diloco-peer join`` in namespace i, listening on
its namespace's address, so every byte between peers crosses the shaped veth links. Each peer runs until
``run.max_rounds``; its JSONL event log is the measurement (nothing is timed from outside).

Definitions (per peer, over the rounds after the first ``skip``, which include start-up and the
first-round gate that waits for every peer):
- utilization = time in inner steps / wall time of those rounds (``compute_seconds`` / ``round_seconds``
  of the round events; a round's wall time includes the wait for peers, matchmaking, the all-reduce (in
  blocking mode), the outer step and the eval of the outer weights);
- bytes per token = all-reduce payload bytes sent + received (protobuf messages, counted as they cross
  the wire) / tokens trained;
- DDP bytes per token = what data-parallel training moves per peer for the same tokens: a ring
  all-reduce of the fp32 gradient every inner step sends and receives 2 (K-1)/K x 4 bytes per parameter,
  for ``batch_size x seq_len`` tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from diloco_peer.tools.netbed import SlowNetwork

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "diloco_peer"]
BASE = ["checkpoint.dir=''", "data.max_bytes=1_000_000", "run.threads=1", "averaging.heartbeat=1.0",
        "data.eval_batches=1"]
"""Every bench peer: no checkpoints (disk is not what we measure), a small corpus (fast start), one thread
each (peers share this machine's cores), one eval batch (the eval is not what we measure either)."""


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_swarm(net: SlowNetwork, overrides: list[str], rounds: int, workdir: Path, skip: int = 1,
              timeout: float = 600) -> dict:
    """Run ``net.peers`` peers for ``rounds`` outer rounds with ``overrides`` (``key=value``); measure them."""
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    address_file = workdir / "bootstrap.addr"
    address_file.unlink(missing_ok=True)
    procs = []
    try:
        boot_log = open(workdir / "bootstrap.log", "w")
        procs.append(net.run(0, [*CLI, "bootstrap", "--listen", f"/ip4/{net.address(0)}/tcp/0",
                                 "--address-file", str(address_file)], stdout=boot_log, stderr=boot_log, env=env))
        deadline = time.monotonic() + 60
        while not address_file.exists() or not address_file.read_text().strip():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bootstrap node did not start: see {workdir / 'bootstrap.log'}")
            time.sleep(0.2)
        bootstrap = address_file.read_text().strip()
        sets = [*BASE, f"run.max_rounds={rounds}", f"run.log_dir='{workdir}'", f"averaging.min_peers={net.peers}",
                *overrides]
        for i in range(net.peers):
            argv = [*CLI, "join", bootstrap, "--name", f"peer-{i}",
                    "--set", f"swarm.host_maddrs=['/ip4/{net.address(i)}/tcp/0']"]
            for item in sets:
                argv += ["--set", item]
            log = open(workdir / f"peer-{i}.log", "w")
            procs.append(net.run(i, argv, stdout=log, stderr=log, env=env))
        for i, proc in enumerate(procs[1:]):
            code = proc.wait(timeout=timeout)
            if code != 0:
                tail = (workdir / f"peer-{i}.log").read_text()[-2000:]
                raise RuntimeError(f"peer-{i} exited with {code}:\n{tail}")
    finally:
        stop(procs)
    return measure(workdir, net.peers, skip)


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM each of ``procs`` still running, then wait for each (30 s at most, then SIGKILL)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_for(what: str, condition, procs: list[subprocess.Popen], timeout: float) -> None:
    """Poll ``condition()`` until true; raise if ``timeout`` seconds pass or one of ``procs`` exits first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout:g}s (or a process exited)")
        time.sleep(0.5)


def measure(workdir: Path, peers: int, skip: int = 1) -> dict:
    """The figures of a finished run, from its event logs (see the module docstring)."""
    per_peer = []
    for i in range(peers):
        events = _events(workdir / f"peer-{i}.jsonl")
        start = next(e for e in events if e["event"] == "start")
        rounds = [e for e in events if e["event"] == "round"][skip:]
        if not rounds:
            raise RuntimeError(f"peer-{i} finished no round after the first {skip}: see {workdir}")
        steps = sum(e["steps"] for e in events if e["event"] == "progress")
        tokens = sum(e["tokens"] for e in events if e["event"] == "progress")
        per_peer.append({
            "compute": sum(r["compute_seconds"] for r in rounds),
            "wall": sum(r["round_seconds"] for r in rounds),
            "bytes": sum(r["bytes_sent"] + r["bytes_received"] for r in rounds),
            "round_tokens": sum(r["tokens"] for r in rounds),
            "parameters": start["parameters"],
            "tokens_per_step": tokens / max(steps, 1),
            "averaged": sum(r["outcome"] == "averaged" for r in rounds),
            "rounds": len(rounds),
            "transfer": [(max(r["bytes_sent"], r["bytes_received"]), r["transfer_seconds"]) for r in rounds
                         if r["outcome"] == "averaged" and r.get("transfer_seconds")],
            "overlap_wait": sum(r.get("overlap_wait_seconds", 0.0) for r in rounds),
            "eval_loss": rounds[-1]["eval_loss"],
        })
    parameters, k = per_peer[0]["parameters"], peers
    tokens_per_step = statistics.mean(p["tokens_per_step"] for p in per_peer)
    ddp_bytes_per_token = 2 * (2 * (k - 1) / k * 4 * parameters) / tokens_per_step
    bytes_per_token = sum(p["bytes"] for p in per_peer) / sum(p["round_tokens"] for p in per_peer)
    transfers = [t for p in per_peer for t in p["transfer"]]
    return {
        "utilization": statistics.mean(p["compute"] / p["wall"] for p in per_peer),
        "utilization_min": min(p["compute"] / p["wall"] for p in per_peer),
        "seconds_per_round": statistics.mean(p["wall"] / p["rounds"] for p in per_peer),
        "compute_seconds_per_round": statistics.mean(p["compute"] / p["rounds"] for p in per_peer),
        "overlap_wait_per_round": statistics.mean(p["overlap_wait"] / p["rounds"] for p in per_peer),
        "bytes_per_peer_round": statistics.mean(p["bytes"] / p["rounds"] for p in per_peer),
        "bytes_per_token": bytes_per_token,
        "ddp_bytes_per_token": ddp_bytes_per_token,
        "allreduce_bytes_per_second": (sum(b for b, _ in transfers) / sum(s for _, s in transfers)
                                       if transfers else 0.0),
        "averaged_fraction": sum(p["averaged"] for p in per_peer) / sum(p["rounds"] for p in per_peer),
        "eval_loss": statistics.mean(p["eval_loss"] for p in per_peer),
        "tokens": sum(p["round_tokens"] for p in per_peer),
        "rounds": per_peer[0]["rounds"],
        "parameters": parameters,
    }


def raw_tcp_bytes_per_second(net: SlowNetwork, src: int, dst: int, megabytes: float = 4.0) -> float:
    """One TCP stream from peer ``src`` to peer ``dst`` over the shaped link: bytes/s as the receiver sees them."""
    size = int(megabytes * 1e6)
    server = ("import socket, sys, time\n"
              f"s = socket.socket(); s.bind(('{net.address(dst)}', 45999)); s.listen(1)\n"
              "print('ready', flush=True)\n"
              "c, _ = s.accept(); n = 0; t0 = None\n"
              "while True:\n"
              "    d = c.recv(1 << 20)\n"
              "    if not d: break\n"
              "    t0 = t0 or time.perf_counter(); n += len(d)\n"
              "print(n / (time.perf_counter() - t0))\n")
    receiver = net.run(dst, [sys.executable, "-c", server], stdout=subprocess.PIPE, text=True)
    try:
        assert receiver.stdout.readline().strip() == "ready"
        client = f"import socket; s = socket.create_connection(('{net.address(dst)}', 45999)); " \
                 f"s.sendall(b'x' * {size}); s.close()"
        subprocess.run(net.command(src, [sys.executable, "-c", client]), check=True, timeout=300)
        return float(receiver.communicate(timeout=60)[0].strip())
    finally:
        if receiver.poll() is None:
            receiver.kill()
