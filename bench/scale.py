"""Benchmark: a real swarm of big peers on this machine's CPU: memory per parameter, all-reduce and state-sync
throughput, checkpoint write and load time, rounds averaged.

    nice -n 5 .venv/bin/python bench/scale.py --quick                       # 19M-parameter peers (~3 min)
    nice -n 5 .venv/bin/python bench/scale.py --model llama-150m --peers 2 --rounds 3   # (~10 min)
    nice -n 5 .venv/bin/python bench/scale.py --model tiny --peers 3

A bootstrap node and ``--peers`` peers run ``diloco-peer join`` on loopback (byte vocabulary, 64-token
sequences, batch 1, H = ``--inner-steps``: rounds are mostly all-reduce, outer step and checkpoint, where
the memory goes). The phases (``--phases`` picks which follow the first):

1. **train**: the peers average ``--rounds`` rounds, writing a checkpoint after every round;
2. **join**: a late joiner downloads the swarm's state (state sync) and averages a round with the others. If a
   further peer would not fit under ``--max-total-gb``, the last peer leaves first (with a checkpoint);
3. **restore**: that peer comes back from its checkpoint (the joiner leaves first, for the same reason).

Memory is each peer's process tree (the peer, its DHT and averager processes, p2pd, the reaper) summed as PSS
(``/proc/PID/smaps_rollup``: a page shared by N processes counts 1/N in each, so shared memory counts once),
sampled every ``--sample`` seconds; the figure is the peak over time, per parameter. Everything else comes from
the peers' event logs: all-reduce rate = bytes a peer sent or received (the larger) / seconds of the all-reduce
proper, state-sync rate = bytes downloaded / seconds of the sync, checkpoint seconds as the writer and the
resume timed them.

Safety: the run refuses to start with less than ``--min-available-gb`` available, and kills the swarm when all
of its processes together pass ``--max-total-gb``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, save  # noqa: E402

from diloco_peer.config import load_config  # noqa: E402
from diloco_peer.tools.local_swarm import LocalSwarm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SMALL = ['data.source="stdlib"', 'data.tokenizer="bytes"', "model.vocab_size=256", "data.seq_len=64",
         "model.max_seq_len=64", "inner.batch_size=1", "inner.grad_accum=1", "data.eval_batches=1",
         "data.max_bytes=2_000_000", "data.num_shards=4", "run.threads=1", "averaging.heartbeat=2.0",
         "averaging.matchmaking_time=4.0", "averaging.request_timeout=2.0", "averaging.sync_timeout=120.0",
         "inner.warmup_steps=2"]
"""Every peer: byte-level text of the standard library (no download), short sequences, one thread each."""
MODELS = {
    "tiny": ("tiny-cpu", []),
    "mid": ("llama-150m", ["model.hidden_size=512", "model.num_layers=6", "model.num_heads=8", "model.num_kv_heads=8",
                           "model.ffn_hidden_size=1376"]),
    "llama-150m": ("llama-150m", []),
    "llama-1b": ("llama-1b", []),
}
GB = 1e9


def smaps(pid: int) -> dict[str, int]:
    """Rss and Pss (total, anonymous, file, shared memory) of one process, in bytes (empty if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return {}
    fields = (line.partition(":") for line in text.splitlines()[1:])
    return {key: int(rest.split()[0]) * 1024 for key, _, rest in fields
            if key in ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")}


def tree(pid: int) -> list[tuple[str, int]]:
    """(role, pid) of a peer's processes: the peer, the reaper, its forks (the DHT, then the averager), p2pd."""
    try:
        root = psutil.Process(pid)
        children = sorted(root.children(recursive=True), key=lambda c: c.create_time())
    except psutil.Error:
        return []
    found, forks = [("peer", pid)], 0
    for child in children:
        try:
            name, cmdline = child.name(), " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "p2pd" in name:
            found.append(("p2pd", child.pid))
        elif "reaper" in cmdline:
            found.append(("reaper", child.pid))
        elif not name.startswith("python"):
            found.append((name, child.pid))
        else:  # forks of the peer, in order: its DHT, then its averager
            found.append((["dht", "averager"][forks] if forks < 2 else f"fork{forks}", child.pid))
            forks += 1
    return found


class Sampler(threading.Thread):
    """Samples the PSS of every peer's process tree; keeps each peer's peak and what it was made of.

    :param interval: seconds between samples
    :param max_total: bytes all trees together may hold: past it, ``on_excess`` is called (once)
    """

    def __init__(self, interval: float, max_total: float, on_excess):
        super().__init__(daemon=True)
        self.interval, self.max_total, self.on_excess = interval, max_total, on_excess
        self.pids: dict[str, int] = {}
        self.peaks: dict[str, dict] = {}
        self.total_peak = 0
        self.phase = "start"
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            total = 0
            for name, pid in list(self.pids.items()):
                parts = [(role, smaps(p)) for role, p in tree(pid)]
                pss = sum(m.get("Pss", 0) for _, m in parts)
                total += pss
                key = f"{name}/{self.phase}"
                if pss > self.peaks.get(key, {}).get("pss", 0):
                    self.peaks[key] = {"pss": pss, "processes": {role: m for role, m in parts if m}}
            self.total_peak = max(self.total_peak, total)
            if total > self.max_total:
                self.on_excess(total)
                return

    def stop(self) -> None:
        self._stop.set()

    def peak(self, name: str) -> dict:
        """The highest sample of peer ``name`` over all phases."""
        mine = [v for k, v in self.peaks.items() if k.startswith(f"{name}/")]
        return max(mine, key=lambda v: v["pss"]) if mine else {"pss": 0, "processes": {}}


def local_swarm(workdir: Path, sets: list[str]) -> LocalSwarm:
    """A swarm whose peers get ``sets``, every process niced, as the module docstring's commands run this script."""
    # this checkout first, then whatever the caller's PYTHONPATH holds (packages installed with --target)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return LocalSwarm(workdir, sets=sets, env={"PYTHONPATH": path}, wrap=["nice", "-n", "5"])


def start_peer(swarm: LocalSwarm, name: str, config: str) -> int:
    """``diloco-peer join`` as ``name`` with ``config`` and the swarm's sets; its pid."""
    return swarm.start_peer(name, args=["--config", config]).pid


def stop(swarm: LocalSwarm, name: str, timeout: float = 180) -> None:
    """SIGTERM: the peer leaves after its inner step, with a checkpoint; wait for it to exit."""
    proc = swarm.peers[name]
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=timeout)


def _rounds(swarm: LocalSwarm, name: str) -> list[dict]:
    return swarm.events(name, "round")


def _back(swarm: LocalSwarm, name: str, rounds: int) -> bool:
    """Has peer ``name`` resumed from its checkpoint, and then trained a round or synced to the swarm's state?"""
    starts = swarm.events(name, "start")
    return bool(starts and starts[-1].get("resumed_from")) and (
        len(_rounds(swarm, name)) > rounds or any(e["ok"] for e in swarm.events(name, "sync")))


def run(args, workdir: Path, sampler: Sampler, ran: dict) -> None:
    """The three phases (see the module docstring); ``ran`` gets the swarm and the peers of each phase (also of a
    run that failed halfway, for the figures of what did run)."""
    config, model_sets = MODELS[args.model]
    sets = [*SMALL, *model_sets, f"outer.inner_steps={args.inner_steps}", f"averaging.min_peers={args.peers}",
            f"run.log_dir={json.dumps(str(workdir))}", f"checkpoint.dir={json.dumps(str(workdir / 'checkpoints'))}",
            "checkpoint.keep=1", f"averaging.compression={json.dumps(args.compression)}", *args.set]
    swarm = local_swarm(workdir, sets)
    phases = ran["phases"] = {}
    ran["swarm"], ran["peers"] = swarm, []
    try:
        swarm.start_bootstrap("--run-id", load_config(config, sets).run.run_id)  # (it shows that run's progress)
        peers = [f"peer-{i}" for i in range(args.peers)]
        sampler.phase = "train"
        for name in peers:
            sampler.pids[name] = start_peer(swarm, name, config)
        ran["peers"] = [*peers, f"peer-{args.peers}"]
        swarm.wait_for(f"{args.rounds} rounds on every peer",
                       lambda: all(len(_rounds(swarm, n)) >= args.rounds for n in peers), args.timeout)
        phases["train"] = list(peers)

        # the late joiner: alongside the others if it fits, else in the place of the last peer
        joiner, left = f"peer-{args.peers}", None
        per_peer = max(sampler.peak(n)["pss"] for n in peers)
        join, restore = "join" in args.phases, "restore" in args.phases
        if (join or restore) and (per_peer * (args.peers + 1) > args.max_total_gb * GB or not join):
            left = peers[-1]
            sampler.phase = "leave"
            stop(swarm, left)
            sampler.pids.pop(left)
        others = [n for n in peers if n != left]
        if others and join:  # (a lone peer that left has nobody to download a state from)
            sampler.phase = "join"
            target = {n: len(_rounds(swarm, n)) for n in others}
            sampler.pids[joiner] = start_peer(swarm, joiner, config)
            swarm.wait_for("the joiner's state sync", lambda: any(e["ok"] for e in swarm.events(joiner, "sync")),
                           args.timeout)
            swarm.wait_for("a round of the joiner with the others",
                           lambda: any(r["outcome"] == "averaged" for r in _rounds(swarm, joiner))
                           and all(len(_rounds(swarm, n)) > target[n] for n in others), args.timeout)
            phases["join"] = [*others, joiner]
        if left is not None and restore:  # the peer that left comes back from its checkpoint
            if joiner in sampler.pids:
                sampler.phase = "leave"
                stop(swarm, joiner)
                sampler.pids.pop(joiner)
            sampler.phase = "restore"
            target = {n: len(_rounds(swarm, n)) for n in others}
            sampler.pids[left] = start_peer(swarm, left, config)
            # back in the swarm: a round of its own, or (with H this small, a swarm can step on faster than a peer
            # restored from an older epoch downloads it) a state sync and a round of the others meanwhile
            swarm.wait_for("the restored peer back in the swarm", lambda: _back(swarm, left, args.rounds)
                           and all(len(_rounds(swarm, n)) > target[n] for n in others), args.timeout)
            phases["restore"] = [*others, left]
        sampler.phase = "stop"
        for name in list(sampler.pids):
            stop(swarm, name)
    finally:
        sampler.stop()
        swarm.kill()  # at once: the run may have ended at the memory limit
        swarm.reap()


def measure(swarm: LocalSwarm, peers: list[str], sampler: Sampler) -> dict:
    """The figures of a finished run: memory from the sampler, the rest from the event logs."""
    starts = {n: swarm.events(n, "start") for n in peers}
    parameters = next((e["parameters"] for s in starts.values() for e in s), 0)
    if not parameters:
        return {"parameters": 0, "bytes_per_param": 0.0, "memory": {}}
    rounds = [r for n in peers for r in _rounds(swarm, n)]
    averaged = [r for r in rounds if r["outcome"] == "averaged" and r.get("transfer_seconds")]
    syncs = [e for n in peers for e in swarm.events(n, "sync") if e["ok"] and e["bytes"]]
    checkpoints = [e for n in peers for e in swarm.events(n, "checkpoint")]
    resumes = [e for s in starts.values() for e in s if e.get("resumed_from")]
    memory = {}
    for name in [n for n in peers if sampler.peak(n)["pss"]]:
        peak = sampler.peak(name)
        phase = next((k.split("/")[1] for k, v in sampler.peaks.items() if v is peak), "")
        by_phase = {k.split("/")[1]: round(v["pss"] / parameters, 2) for k, v in sampler.peaks.items()
                    if k.startswith(f"{name}/")}
        processes = {role: {k: round(v / GB, 3) for k, v in m.items()} for role, m in peak["processes"].items()}
        memory[name] = {"peak_pss_gb": peak["pss"] / GB, "bytes_per_param": peak["pss"] / parameters,
                        "phase": phase, "bytes_per_param_by_phase": by_phase, "processes": processes}
    return {
        "parameters": parameters,
        "bytes_per_param": max(m["bytes_per_param"] for m in memory.values()),
        "memory": memory,
        "rounds": len(rounds), "rounds_averaged": len([r for r in rounds if r["outcome"] == "averaged"]),
        "allreduce_mb_per_s": (sum(max(r["bytes_sent"], r["bytes_received"]) for r in averaged) / 1e6
                               / sum(r["transfer_seconds"] for r in averaged)) if averaged else 0.0,
        "allreduce_seconds": (sum(r["allreduce_seconds"] for r in averaged) / len(averaged)) if averaged else 0.0,
        "sync_mb_per_s": (sum(e["bytes"] for e in syncs) / 1e6 / sum(e["seconds"] for e in syncs)) if syncs else 0.0,
        "sync_seconds": [round(e["seconds"], 2) for e in syncs],
        "checkpoint_write_seconds": (sum(e["seconds"] for e in checkpoints) / len(checkpoints)) if checkpoints else 0,
        "checkpoint_mb": (checkpoints[-1]["bytes"] / 1e6) if checkpoints else 0,
        "checkpoint_load_seconds": [round(e.get("resume_seconds", float("nan")), 2) for e in resumes],
        "compute_seconds_per_round": sum(r["compute_seconds"] for r in rounds) / max(len(rounds), 1),
        "total_peak_gb": sampler.total_peak / GB,
    }


def report(result: dict) -> None:
    """The run in a few lines: memory per peer (and per process at its peak), then the rates and times."""
    params = result["parameters"]
    print(f"{result['model']}: {params / 1e6:.1f}M parameters, {result['peers']} peers, H={result['inner_steps']}, "
          f"{result['compression']}; phases {result.get('phases')}; details in {result['workdir']}/result.json")
    for name, m in result["memory"].items():
        parts = ", ".join(f"{role} {v['Pss'] * 1e9 / params:.1f}" for role, v in m["processes"].items())
        print(f"  {name}: peak PSS {m['peak_pss_gb']:.2f} GB = {m['bytes_per_param']:.1f} B/param "
              f"(in phase {m['phase']}; per process, B/param: {parts}); by phase {m['bytes_per_param_by_phase']}")
    if "rounds" in result:
        print(f"  rounds {result['rounds']} ({result['rounds_averaged']} averaged), all-reduce "
              f"{result['allreduce_mb_per_s']:.1f} MB/s ({result['allreduce_seconds']:.1f} s per averaged round), "
              f"state sync {result['sync_mb_per_s']:.1f} MB/s {result['sync_seconds']} s, checkpoint "
              f"{result['checkpoint_mb']:.0f} MB written in {result['checkpoint_write_seconds']:.2f} s, "
              f"loaded in {result['checkpoint_load_seconds']} s; all at most {result['total_peak_gb']:.2f} GB")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="llama-150m",
                        help="tiny (0.4M), mid (19M, what --quick runs), llama-150m (151M with a byte vocabulary) "
                             "or llama-1b (0.97B with a byte vocabulary: a GPU machine's memory)")
    parser.add_argument("--peers", type=int, default=2, help="peers that train together, e.g. 2")
    parser.add_argument("--rounds", type=int, default=3, help="rounds every peer averages before the joiner, e.g. 3")
    parser.add_argument("--quick", action="store_true", help="--model mid --rounds 2")
    parser.add_argument("--inner-steps", type=int, default=2, help="H, inner steps per round, e.g. 2")
    parser.add_argument("--compression", default="fp16", help="averaging.compression, e.g. fp16")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--sample", type=float, default=0.2, help="seconds between memory samples, e.g. 0.2")
    parser.add_argument("--max-total-gb", type=float, default=13.0,
                        help="all the swarm's processes together may hold this much (PSS); past it, all are killed")
    parser.add_argument("--min-available-gb", type=float, default=8.0, help="refuse to start with less available")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each phase may take, e.g. 900")
    parser.add_argument("--phases", default="join,restore", type=lambda text: text.split(","),
                        help="after train: join,restore (default); restore (the last peer leaves with a checkpoint "
                             "and comes back from it: a GPU machine's 1B peers, whose join never ends with rounds "
                             "shorter than a state download); join; or none")
    parser.add_argument("--workdir", default="", help="where logs, events and checkpoints go (default: a temp dir)")
    parser.add_argument("--no-save", action="store_true", help="do not write bench/results.json")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="keep the peers' checkpoints and spill files in the workdir (removed by default: 7-15 "
                             "GB a run at llama-150m; logs, events and result.json stay)")
    args = parser.parse_args()
    if args.quick:
        args.model, args.rounds = "mid", 2
    available = psutil.virtual_memory().available
    if available < args.min_available_gb * GB:
        print(f"only {available / GB:.1f} GB available (< --min-available-gb {args.min_available_gb:g}): not starting")
        return 1
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    excess = []

    def on_excess(total: float) -> None:
        excess.append(total)
        print(f"the swarm holds {total / GB:.1f} GB (> --max-total-gb {args.max_total_gb:g}): killing it", flush=True)
        os.kill(os.getpid(), signal.SIGINT)

    sampler = Sampler(args.sample, args.max_total_gb * GB, on_excess)
    sampler.start()
    started = time.monotonic()
    error, ran = "", {}
    try:
        run(args, workdir, sampler, ran)
    except (KeyboardInterrupt, RuntimeError) as e:
        error = "memory limit" if excess else f"{type(e).__name__}: {e}"
    result = measure(ran["swarm"], ran["peers"], sampler)
    result.update(model=args.model, peers=args.peers, inner_steps=args.inner_steps, compression=args.compression,
                  phases=ran["phases"], wall_seconds=time.monotonic() - started, workdir=str(workdir), error=error)
    (workdir / "result.json").write_text(json.dumps(result, indent=1))
    report(result)
    if not args.keep_checkpoints:  # (their times are in the events; the files only fill the disk)
        for heavy in [workdir / "checkpoints", *workdir.glob("*.serving")]:
            shutil.rmtree(heavy, ignore_errors=True)
    if error:
        print(f"incomplete run: {error}")
        return 1
    if not args.no_save:
        # value: the peak bytes per parameter of the worst peer; baseline: the bound (32 on a CPU peer);
        # the rates and times are in the printout and in the run's result.json
        save([figure("scale_bytes_per_param", round(result["bytes_per_param"], 2), 32.0, model=args.model,
                     peers=args.peers, compression=args.compression, inner_steps=args.inner_steps)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
