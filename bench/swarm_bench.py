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
import statistics
import subprocess
import sys
from pathlib import Path

from diloco_peer.tools.local_swarm import LocalSwarm
from diloco_peer.tools.netbed import SlowNetwork

ROOT = Path(__file__).resolve().parent.parent
BASE = ["checkpoint.dir=''", "data.max_bytes=1_000_000", "run.threads=1", "averaging.heartbeat=1.0",
        "data.eval_batches=1"]
"""Every bench peer: no checkpoints (disk is not what we measure), a small corpus (fast start), one thread
each (peers share this machine's cores), one eval batch (the eval is not what we measure either)."""
FAST = ["outer.inner_steps=10", "run.threads=1", "averaging.heartbeat=1.0", "averaging.matchmaking_time=2.0",
        "averaging.request_timeout=1.0", "data.max_bytes=1_000_000"]
"""The tests' swarms (``tests/conftest.py`` FAST): tiny-cpu, H=10, one thread, short timeouts. For the benches of
what a test shows, on loopback (``dead_member.py``, ``sign_flip.py``, ``soak.py``)."""


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def slow_swarm(net: SlowNetwork, workdir: Path, sets: list[str], wrap: list[str] = ()) -> LocalSwarm:
    """A ``LocalSwarm`` in ``workdir`` whose peers get ``sets`` (this checkout's code; every process under ``wrap``),
    its bootstrap node started in namespace 0: ``start_peer(net, swarm, i, ...)`` starts peer i in namespace i."""
    workdir.mkdir(parents=True, exist_ok=True)
    swarm = LocalSwarm(workdir, sets=sets, env={"PYTHONPATH": str(ROOT)}, wrap=wrap)
    try:
        swarm.start_bootstrap(listen=f"/ip4/{net.address(0)}/tcp/0", netns=net.ns(0))
    except BaseException:
        swarm.reap()
        raise
    return swarm


def start_peer(net: SlowNetwork, swarm: LocalSwarm, i: int, *sets: str, name: str = "", args: list[str] = ()):
    """``diloco-peer join`` in namespace ``i`` as ``name`` (default ``peer-i``), listening on that namespace's
    address; its process."""
    listen = f"swarm.host_maddrs=['/ip4/{net.address(i)}/tcp/0']"
    return swarm.start_peer(name or f"peer-{i}", listen, *sets, netns=net.ns(i), args=args)


def run_swarm(net: SlowNetwork, overrides: list[str], rounds: int, workdir: Path, skip: int = 1,
              timeout: float = 600) -> dict:
    """Run ``net.peers`` peers for ``rounds`` outer rounds with ``overrides`` (``key=value``); measure them."""
    sets = [*BASE, f"run.max_rounds={rounds}", f"averaging.min_peers={net.peers}", *overrides]
    with slow_swarm(net, workdir, sets) as swarm:
        for i in range(net.peers):
            start_peer(net, swarm, i)
        swarm.wait_for("the peers' last round", lambda: all(p.poll() is not None for p in swarm.peers.values()),
                       timeout)
    return measure(workdir, net.peers, skip)


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
            # (a round handed in has no eval loss: its group evaluated the same weights)
            "eval_loss": next(r["eval_loss"] for r in reversed(rounds) if "eval_loss" in r),
            "densities": [r.get("density") for r in rounds],
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
        "densities": [p["densities"] for p in per_peer],
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
