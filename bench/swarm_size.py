"""Dozens of volunteers: rounds of N tiny peers on this machine, and the round gate's DHT reads at hundreds of peers.

    .venv/bin/python bench/swarm_size.py --peers 4,8,16,32 --rounds 4           # the swarms: ~30 min
    .venv/bin/python bench/swarm_size.py --peers 0 --publishers 4,32,100,300    # the DHT cost alone: ~5 min
    .venv/bin/python bench/swarm_size.py --peers 0 --publishers 0 --idle 4,8,16  # a waiting peer's CPU: ~8 min

**Swarms** (``--peers``): a bootstrap node and N ``diloco-peer join`` processes on loopback (tiny-cpu, H=20, one
thread each, the first round waiting for all N), ``--rounds`` rounds. Per round, from the peers' event logs: the
round's seconds (median over peers), its parts (the gate's wait; matchmaking: the all-reduce's seconds less its
transfer; the transfer), the fraction of peers that averaged, whether all replicas hold the same weights after it;
and the peers' memory: each peer's process tree (peer, DHT and averager processes, p2pd, reaper) summed as PSS
(``scale.py``'s sampler), its peak, per peer.

**The round gate at hundreds of peers** (``--publishers``): N progress records published under one run by DHT
nodes of this process (``--nodes`` of them, N / nodes signers each, ``ManySigners``: what a reader pays depends on the
records under the key, not on who stores them), and a gate that reads them as a waiting peer does
(``SwarmProgress.swarm_records``) for ``--gate-seconds``, polling as ``SwarmProgress.poll_interval`` says. Per N: the
bytes one read returns, its seconds, the reads of one gate's wait, and so the bytes one peer reads in a round's gate.

**A waiting peer's CPU** (``--idle``): N peers (as ``--peers`` starts them, from a zygote) at their first round's
gate, which waits for N + 1; once they have waited ``--idle-settle`` seconds, each process's CPU time over
``--idle-seconds``, as a share of one core, by role (``scale.tree``: the peer, its DHT and averager processes, p2pd,
the reaper), the median over the peers. What dozens of peers on one machine pay before any of them trains.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import pickle
import shutil
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, save  # noqa: E402
from scale import Sampler, tree  # noqa: E402

from hivemind.dht import DHT  # noqa: E402
from hivemind.dht.crypto import RSASignatureValidator  # noqa: E402
from hivemind.dht.schema import SchemaValidator  # noqa: E402
from hivemind.dht.validation import DHTRecord  # noqa: E402
from hivemind.utils import get_dht_time  # noqa: E402
from hivemind.utils.crypto import RSAPrivateKey  # noqa: E402

from diloco_peer.swarm.progress_record import ProgressRecord, ProgressSchema  # noqa: E402
from diloco_peer.swarm.progress_store import ExpirationCap, fetch_progress_entries  # noqa: E402
from diloco_peer.tools.local_swarm import LocalSwarm  # noqa: E402
from diloco_peer.tools.zygote import Zygote  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETS = ["outer.inner_steps=20", "run.threads=1", "checkpoint.dir=''", "data.max_bytes=1_000_000",
        "averaging.heartbeat=2.0", "data.eval_batches=1"]
"""Every peer: tiny-cpu at H=20 (the issue's setting), one thread, no checkpoints, a small corpus, one eval batch."""


def swarm(workdir: Path, peers: int, rounds: int) -> dict:
    """N peers for ``rounds`` rounds; what their logs and the memory sampler say (see the module docstring)."""
    shutil.rmtree(workdir, ignore_errors=True)  # event logs are appended to: a run again would read the last one's
    workdir.mkdir(parents=True)
    sets = [*SETS, f"run.max_rounds={rounds}", f"averaging.min_peers={peers}"]
    sampler = Sampler(2.0, float("inf"), lambda total: None)
    names = [f"p{i}" for i in range(peers)]
    started = time.monotonic()
    with LocalSwarm(workdir, sets=sets, env={"PYTHONPATH": str(ROOT)}) as local:
        local.start_bootstrap("--report-every", "30")
        for name in names:
            sampler.pids[name] = local.start_peer(name).pid
        sampler.start()
        local.wait_for(f"{rounds} rounds of {peers} peers", lambda: all(p.poll() is not None
                                                                      for p in local.peers.values()),
                       timeout=600 + 60 * rounds * peers / 4)
        sampler.stop()
        logs = {name: local.events(name, "round") for name in names}
    by_round: dict[int, list[dict]] = {}
    for events in logs.values():
        for e in events:
            by_round.setdefault(e["round"], []).append(e)
    table = []
    for rnd in sorted(by_round):
        rows = by_round[rnd]
        table.append({
            "round": rnd, "peers": len(rows),
            "averaged": sum(r["outcome"] == "averaged" for r in rows) / peers,
            "groups": sorted({r["group_size"] for r in rows}),
            "identical": len({r["param_sha256"] for r in rows}) == 1 and len(rows) == peers,
            "seconds": statistics.median(r["round_seconds"] for r in rows),
            "gate": statistics.median(r["wait_seconds"] for r in rows),
            "matchmaking": statistics.median(r["allreduce_seconds"] - r["transfer_seconds"] for r in rows),
            "transfer": statistics.median(r["transfer_seconds"] for r in rows),
        })
    peaks = [sampler.peak(name)["pss"] for name in names]
    return {"peers": peers, "rounds": table, "pss_per_peer": statistics.median(peaks), "pss_max": max(peaks),
            "wall": time.monotonic() - started}


def idle_cost(workdir: Path, peers: int, settle: float, seconds: float) -> dict:
    """N peers waiting at their first gate: each role's share of a core (see the module docstring)."""
    import psutil

    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    sets = [*SETS, f"averaging.min_peers={peers + 1}", "averaging.first_round_timeout=3600"]
    with Zygote.start() as zygote, LocalSwarm(workdir, sets=sets, zygote=zygote) as local:
        local.start_bootstrap("--report-every", "600")
        names = [f"p{i}" for i in range(peers)]
        for name in names:
            local.start_peer(name)
        local.wait_for(f"{peers} peers at their first gate", lambda: all(  # (the first round trains H steps)
            sum(e["steps"] for e in local.events(name, "progress")) >= 20 for name in names), timeout=120 + 10 * peers)
        time.sleep(settle)
        processes = {name: tree(local.peers[name].pid) for name in names}

        def cpu() -> dict[int, float]:
            times = {}
            for pid in {pid for found in processes.values() for _, pid in found}:
                with contextlib.suppress(psutil.Error):
                    used = psutil.Process(pid).cpu_times()
                    times[pid] = used.user + used.system
            return times

        before, started = cpu(), time.monotonic()
        time.sleep(seconds)
        after, elapsed = cpu(), time.monotonic() - started
    shares: dict[str, list[float]] = {}
    for found in processes.values():
        per_role: dict[str, float] = {}
        for role, pid in found:
            if pid in before and pid in after:
                per_role[role] = per_role.get(role, 0.0) + (after[pid] - before[pid]) / elapsed
        for role, share in per_role.items():
            shares.setdefault(role, []).append(share)
        shares.setdefault("all", []).append(sum(per_role.values()))
    medians = {role: statistics.median(values) for role, values in shares.items()}
    return {"peers": peers, "seconds": seconds, "core_share": medians}


class ManySigners(RSASignatureValidator):
    """Signs each record with the key its subkey names, out of many: one DHT node stands for many publishers (a DHT
    node keeps one ``RSASignatureValidator``, so one ``SwarmProgress`` per node could publish only one record)."""

    def __init__(self, keys: list[RSAPrivateKey]):
        super().__init__(keys[0])
        self.keys = {RSASignatureValidator(key).local_public_key: key for key in keys}

    def sign_value(self, record: DHTRecord) -> bytes:
        for marker, key in self.keys.items():
            if marker in record.subkey:
                signature = key.sign(self._serialize_record(record))
                return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)
        return record.value

    def merge_with(self, other) -> bool:
        return isinstance(other, RSASignatureValidator)


async def _publish(dht, node, run_id: str, count: int, first: int) -> int:
    """In a DHT node's own process (``DHT.run_coroutine``): make ``count`` keys, and store one progress record per
    key as its publisher would; how many were stored. The keys are made there, not sent: a validator holding
    dozens of keys, sent through the DHT's pipe, broke it (hivemind reads that pipe a message at a time)."""
    keys = [RSAPrivateKey() for _ in range(count)]
    node.protocol.record_validator.extend([SchemaValidator(ProgressSchema, prefix=run_id), ExpirationCap(),
                                           ManySigners(keys)])
    stored = 0
    for i, key in enumerate(keys):
        record = ProgressRecord(peer_id=f"peer-{first + i:04d}", epoch=3, round=3, inner_step=60, tokens=61440,
                                ready=False, joined=True, state_hash="h" * 64, time=time.time(), step_seconds=0.1,
                                work_seconds=0.2)
        stored += bool(await node.store(f"{run_id}_progress", record.dict(), get_dht_time() + 600,
                                        subkey=RSASignatureValidator(key).local_public_key))
    return stored


async def gate_cost(publishers: int, nodes: int, seconds: float) -> dict:
    """N records under one run, published by ``nodes`` DHT nodes; a gate's reads of them for ``seconds``."""
    from diloco_peer.swarm.progress import SwarmProgress

    root = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    initial = [str(a) for a in root.get_visible_maddrs()]
    dhts = [root] + [DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial)
                     for _ in range(nodes - 1)]
    run_id = f"size{publishers}"
    try:
        share = -(-publishers // (nodes - 1))  # the last node is the reader's
        stored = 0
        for n, dht in enumerate(dhts[:-1]):
            count = min(share, publishers - n * share)
            if count > 0:
                stored += await asyncio.to_thread(dht.run_coroutine, partial(_publish, run_id=run_id, count=count,
                                                                            first=n * share))
        reader = SwarmProgress(dhts[-1], run_id, "gate", heartbeat=60.0)
        await reader.publish(epoch=3, round=3, ready=True, joined=True, state_hash="h" * 64)
        sizes, latencies, found, started = [], [], 0, time.monotonic()
        while time.monotonic() - started < seconds:
            before = time.monotonic()
            entries = await fetch_progress_entries(reader.dht, run_id)
            latencies.append(time.monotonic() - before)
            sizes.append(len(pickle.dumps({k: v for k, v in entries.items()})))
            found = max(found, len(entries))
            await asyncio.sleep(reader.poll_interval(found, time.monotonic() - started))
        return {"publishers": publishers, "stored": stored, "records_read": found, "reads": len(sizes),
                "bytes_per_read": statistics.median(sizes), "read_seconds": statistics.median(latencies),
                "bytes_per_gate": sum(sizes), "gate_seconds": seconds}
    finally:
        for dht in dhts:
            dht.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="4,8,16,32", help="comma-separated swarm sizes (0: none)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--publishers", default="4,32,100,300", help="comma-separated record counts (0: none)")
    parser.add_argument("--nodes", type=int, default=8, help="DHT nodes that publish the records")
    parser.add_argument("--gate-seconds", type=float, default=10.0, help="how long the measured gate waits")
    parser.add_argument("--idle", default="0", help="comma-separated swarm sizes whose waiting peers' CPU to "
                        "measure (0: none)")
    parser.add_argument("--idle-settle", type=float, default=20.0, help="seconds the peers wait before it")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="seconds it is measured over")
    parser.add_argument("--workdir", default="runs/bench-swarm-size")
    args = parser.parse_args()
    figures, out = [], {"swarms": [], "gates": [], "idle": []}
    for n in [int(v) for v in args.peers.split(",") if int(v)]:
        result = swarm(Path(args.workdir) / f"n{n}", n, args.rounds)
        out["swarms"].append(result)
        print(f"\n{n} peers, {result['wall']:.0f}s, PSS per peer {result['pss_per_peer'] / 1e6:.0f} MB "
              f"(max {result['pss_max'] / 1e6:.0f} MB)")
        print(f"{'round':>5} {'averaged':>8} {'groups':>10} {'identical':>9} {'round s':>8} {'gate s':>7} "
              f"{'match s':>8} {'transfer s':>10}")
        for r in result["rounds"]:
            print(f"{r['round']:>5} {r['averaged']:>8.0%} {'/'.join(map(str, r['groups'])):>10} "
                  f"{'yes' if r['identical'] else 'NO':>9} {r['seconds']:>8.2f} {r['gate']:>7.2f} "
                  f"{r['matchmaking']:>8.2f} {r['transfer']:>10.2f}", flush=True)
        later = [r for r in result["rounds"] if r["round"] > 1]
        figures.append(figure("swarm_size", sum(r["averaged"] for r in later) / max(len(later), 1), 1.0, peers=n,
                              rounds=args.rounds, identical=all(r["identical"] for r in result["rounds"]),
                              seconds_per_round=statistics.median(r["seconds"] for r in result["rounds"]),
                              pss_per_peer=result["pss_per_peer"]))
    for n in [int(v) for v in args.publishers.split(",") if int(v)]:
        result = asyncio.run(gate_cost(n, min(args.nodes, n), args.gate_seconds))
        out["gates"].append(result)
        print(f"{n:>4} publishers: a read returns {result['records_read']} records, "
              f"{result['bytes_per_read'] / 1e3:.1f} kB in {result['read_seconds'] * 1e3:.0f} ms; a "
              f"{args.gate_seconds:g} s gate reads {result['reads']} times, {result['bytes_per_gate'] / 1e3:.0f} kB",
              flush=True)
    for n in [int(v) for v in args.idle.split(",") if int(v)]:
        result = idle_cost(Path(args.workdir) / f"idle{n}", n, args.idle_settle, args.idle_seconds)
        out["idle"].append(result)
        shares = result["core_share"]
        print(f"{n:>3} waiting peers, % of a core each (median): " + ", ".join(
            f"{role} {share:.2%}" for role, share in sorted(shares.items(), key=lambda kv: -kv[1])), flush=True)
        figures.append(figure("idle_peer_core_share", shares["all"], 1.0, peers=n, per_peer=shares))  # of a core
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    (Path(args.workdir) / "swarm_size.json").write_text(json.dumps(out, indent=1))
    save(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
