"""Unequal volunteers in a real swarm: does a slow peer add its work without slowing the others?

    sudo .venv/bin/python bench/unequal.py                                  # both spreads, both round lengths
    .venv/bin/python bench/unequal.py --spreads full,full,full,0.15 --lengths time --rounds 10
    .venv/bin/python bench/unequal.py --spreads full,full,full,0.15 --lengths time --rounds 10 --repeat 3

Four ``diloco-peer join`` processes on loopback (tiny-cpu, H=20, one thread each) and a bootstrap node. A spread
gives each peer's cpu share: ``full`` (no limit: the fast peers share this machine's cores) or a share of one core
(a cpu cgroup, ``tools/cpu_quota.py``: 0.15 is what the issue measured, 10.8 s for 20 inner steps where three fast
peers took 1.9 s). Each spread runs once per round length, after its fast peers alone (where there are two or
more: one alone averages nothing), side by side in one process, so that the machine's mood is the same for all.
Per run, from the peers' event logs, over the rounds after the first (start-up, and the first round's H steps
before anything is measured):

- averaged tokens/s: tokens of every peer's averaged rounds / the wall time those rounds took (first to last end);
- per peer: its idle fraction (the gate's wait for the others / its round time), also over the settled rounds only
  (from round ``SETTLED_FROM`` on), its inner steps a round, and the tokens it averaged / the tokens it trained.

Then the swarm's averaged tokens/s with the slow peers against the fast peers' alone (the issue's goal: at least
0.9), and whether every round's replicas were identical. Records go to ``bench/results.json`` (``unequal``).

``--repeat N``: each spread's runs N times, alternating (the fast peers alone, the swarm, the fast peers alone...):
each ratio is of two runs minutes apart, and this machine's speed drifts between runs as much as the goal's margin
(two identical runs read 0.89x and 0.97x, nearly all of it in the fast peers alone). It prints every ratio and their
median; ``bench/results.json`` keeps the repetition of the median ratio, with all the ratios.

``--floor``: also the fast peers alone beside a busy loop held to each slow peer's share (no slow peer in the swarm):
what the slow peers' CPU alone leaves the fast ones on this machine, the most the swarm could reach with them.

``--apart``: also the fast peers beside the throttled peers, each of those in a run of its own (the same processes
in the same cgroups, DHT clients of the same DHT, training alone the whole time, in none of the fast peers' rounds):
what the slow peers' presence on this machine costs the fast ones, their averaging left out: whether the busy loop of
``--floor`` stands for them (BENCHMARKS.md, "Unequal volunteers").
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from results import figure, save  # noqa: E402

from diloco_peer.tools.cpu_quota import available, cpu_quota  # noqa: E402
from diloco_peer.tools.local_swarm import LocalSwarm  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SETS = ["outer.inner_steps=20", "run.threads=1", "checkpoint.dir=''", "data.max_bytes=1_000_000"]
"""Every peer: tiny-cpu at H=20 (the issue's setting), one thread (four peers share two cores), no checkpoints, a
small corpus; everything else is tiny-cpu's default: no tuning flags. (Until 2026-12-01 a heartbeat of 1 s too, and
one eval batch, against tiny-cpu's 2 s and 4: twice the DHT stores, and a quarter of the eval, of the throttled
peer's share. ``--set data.eval_batches=1`` gives the old runs' eval.)"""
SETTLED_FROM = 4
"""The first round a run's settled idle counts: round 1 trains H steps with nothing measured, and in rounds 2-3 a slow
peer's pace and its first hand-in are still being measured (that hand-in comes late: its work so far had none)."""


def run(workdir: Path, shares: list[str], length: str, rounds: int, extra: list[str], burn: list[str] = (),
        slow_sets: list[str] = (), apart: bool = False) -> dict:
    """A swarm of ``len(shares)`` peers for ``rounds`` rounds; its measurements (see the module docstring). ``burn``:
    a busy loop beside it for each share given (``--floor``); ``slow_sets``: overrides for the throttled peers only
    (``--slow-set``); ``apart``: the throttled peers each in a run of its own, the measurements the fast peers'
    (``--apart``)."""
    shutil.rmtree(workdir, ignore_errors=True)  # event logs are appended to: a run again would read the last one's
    workdir.mkdir(parents=True)
    names = [f"p{i}" for i in range(len(shares))]
    with contextlib.ExitStack() as stack:
        for i, share in enumerate(burn):
            stack.enter_context(busy_loop(f"unequal-burn{i}", float(share)))
        # the first round waits for every peer (a throttled one takes a while to start): the rounds measured are
        # the swarm's steady state, all of it in
        sets = [*SETS, f"outer.round_length={length}", f"run.max_rounds={rounds}", f"averaging.min_peers={len(shares)}",
                *extra]
        swarm = stack.enter_context(LocalSwarm(workdir, sets=sets, env={"PYTHONPATH": str(ROOT)}))
        swarm.start_bootstrap("--report-every", "10")
        # the throttled peers first, the others once those have joined: at 0.15 of a core a peer takes ~40 s from its
        # start to its first step, and started last it missed the fast peers' first round, synced, and made their
        # second a start-up round too (measured as the swarm's steady state)
        throttled = [(name, share) for name, share in zip(names, shares) if share != "full"]
        measured = [(name, share) for name, share in zip(names, shares) if not apart or share == "full"]
        for name, share in throttled:
            group = stack.enter_context(cpu_quota(f"unequal-{name}", float(share)))
            # apart: alone in a run of its own, training until the fast peers are done (the reap below ends it), a DHT
            # client (in the swarm it stops serving the others' DHT requests once it hands in: ``swarm/dht_role.py``)
            alone = [f"run.run_id=unequal-apart-{name}", "averaging.min_peers=1", "run.max_rounds=0",
                     "swarm.reachability=outbound-only"] if apart else []
            swarm.start_peer(name, *slow_sets, *alone, cgroup=group)
        swarm.wait_for("the throttled peers to join", lambda: all(swarm.events(name, "start") for name, _ in throttled),
                       timeout=300)
        for name, share in zip(names, shares):
            if share == "full":
                swarm.start_peer(name, *([f"averaging.min_peers={len(measured)}"] if apart else []))
        # (a peer at 0.06 of a core takes minutes to start and, with a fixed H, ~30 s a round)
        swarm.wait_for(f"{rounds} rounds of every peer", lambda: all(swarm.peers[name].poll() is not None
                                                                      for name, _ in measured),
                       timeout=300 + 90 * rounds)
        swarm.reap()
        logs = {name: swarm.events(name, "round") for name, _ in measured}
    return measure(logs, [share for _, share in measured])


@contextlib.contextmanager
def busy_loop(name: str, cores: float):
    """A process that only burns CPU, held to ``cores`` of one core (a cgroup), until the block ends."""
    with cpu_quota(name, cores) as group:
        proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            (group / "cgroup.procs").write_text(str(proc.pid))
            yield
        finally:
            proc.kill()
            proc.wait()


def idle(events: list[dict]) -> float:
    """The share of these rounds' time that the gate waited for the others."""
    return sum(e["wait_seconds"] for e in events) / max(sum(e["round_seconds"] for e in events), 1e-9)


def measure(logs: dict[str, list[dict]], shares: list[str]) -> dict:
    """What a run's round events say (rounds after the first)."""
    later = {name: [e for e in events if e["round"] > 1] for name, events in logs.items()}
    ends = [e["time"] for events in later.values() for e in events]
    starts = [e["time"] for events in logs.values() for e in events if e["round"] == 1]
    wall = max(ends) - max(starts) if ends and starts else float("nan")
    averaged = sum(e["tokens"] for events in later.values() for e in events if e["outcome"] == "averaged")
    peers = {}
    for (name, events), share in zip(later.items(), shares):
        trained = sum(e["tokens"] for e in events)
        peers[name] = {
            "share": share, "rounds": len(events),
            "idle": idle(events),
            "idle_settled": idle([e for e in events if e["round"] >= SETTLED_FROM]),
            "steps": statistics.median(e.get("inner_steps", 0) for e in events) if events else 0,
            "averaged_of_trained": sum(e["tokens"] for e in events if e["outcome"] == "averaged") / max(trained, 1),
        }
    hashes = {}
    for events in logs.values():
        for e in events:
            hashes.setdefault(e["round"], set()).add(e["param_sha256"])
    return {"tokens_per_second": averaged / wall if wall > 0 else 0.0, "wall": wall, "peers": peers,
            "identical": all(len(h) == 1 for h in hashes.values())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spreads", nargs="+", default=["full,full,full,0.15", "full,0.3,0.15,0.06"],
                        help="each: comma-separated cpu shares, 'full' or a share of one core")
    parser.add_argument("--lengths", default="steps,time", help="comma-separated outer.round_length values")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--workdir", default="runs/bench-unequal")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every peer of every run (e.g. outer.overlap=eager)")
    parser.add_argument("--slow-set", action="append", default=[], metavar="KEY=VALUE",
                        help="each round length again, with this override for the throttled peers only "
                             "(e.g. swarm.reachability=outbound-only)")
    parser.add_argument("--floor", action="store_true",
                        help="also the fast peers beside busy loops of the slow peers' shares (the CPU's floor)")
    parser.add_argument("--apart", action="store_true",
                        help="also the fast peers beside the throttled peers, each of those in a run of its own")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each spread's runs this many times, alternating (the fast peers alone, then the "
                             "swarm, again), and report each ratio and their median")
    args = parser.parse_args()
    why = available() or ("" if args.repeat >= 1 else f"--repeat {args.repeat}: give 1 or more")
    if why:
        print(f"bench/unequal.py: {why}", file=sys.stderr)
        return 2
    figures = []
    for spread in args.spreads:
        repetitions = [spread_runs(args, spread, i if args.repeat > 1 else None) for i in range(args.repeat)]
        figures += repetitions[0] if args.repeat == 1 else medians(spread, repetitions, args.repeat)
    save(figures)
    return 0


def spread_runs(args, spread: str, repetition: int | None) -> list[dict]:
    """One spread's runs (the fast peers alone, the floor and apart if asked, each round length): their figures.
    ``repetition``: which of ``--repeat``'s (None: the only one), in the workdirs' names and the output."""
    shares = spread.split(",")
    fast = [s for s in shares if s == "full"]
    tag = spread.replace(",", "-") + (f"-{repetition}" if repetition is not None else "")
    said = f" (repetition {repetition + 1} of {args.repeat})" if repetition is not None else ""
    figures = []
    # the baseline: the fast peers alone, where they are two or more (one alone averages nothing)
    alone = run(Path(args.workdir) / f"{tag}-fast", fast, "time", args.rounds, args.set) if len(fast) > 1 else None
    if args.floor and alone:
        slow = [s for s in shares if s != "full"]
        floor = run(Path(args.workdir) / f"{tag}-floor", fast, "time", args.rounds, args.set, burn=slow)
        ratio = floor["tokens_per_second"] / max(alone["tokens_per_second"], 1e-9)
        print(f"\n{spread}{said}: the fast peers beside busy loops of {','.join(slow)} of a core, no slow peer: "
              f"{floor['tokens_per_second']:,.0f} tokens/s, {ratio:.2f}x of alone "
              f"({alone['tokens_per_second']:,.0f}): the most the slow peers' CPU leaves them", flush=True)
        figures.append(figure("unequal_floor", floor["tokens_per_second"], alone["tokens_per_second"],
                              spread=spread, rounds=args.rounds, sets=args.set))
    if args.apart and alone:
        apart = run(Path(args.workdir) / f"{tag}-apart", shares, "time", args.rounds, args.set, apart=True)
        ratio = apart["tokens_per_second"] / max(alone["tokens_per_second"], 1e-9)
        print(f"\n{spread}{said}: the fast peers beside the throttled peers, each in a run of its own: "
              f"{apart['tokens_per_second']:,.0f} tokens/s, {ratio:.2f}x of alone "
              f"({alone['tokens_per_second']:,.0f}): what the slow peers' presence on this machine leaves them",
              flush=True)
        figures.append(figure("unequal_apart", apart["tokens_per_second"], alone["tokens_per_second"],
                              spread=spread, rounds=args.rounds, sets=args.set))
    variants = [(length, slow_sets) for length in args.lengths.split(",")
                for slow_sets in ([[], args.slow_set] if args.slow_set else [[]])]
    for length, slow_sets in variants:
        started = time.monotonic()
        every = run(Path(args.workdir) / f"{tag}-{length}{'-slow-set' if slow_sets else ''}", shares, length,
                    args.rounds, args.set, slow_sets=slow_sets)
        ratio = every["tokens_per_second"] / max(alone["tokens_per_second"], 1e-9) if alone else 0.0
        versus = f", the fast peers alone {alone['tokens_per_second']:,.0f} ({ratio:.2f}x)" if alone else ""
        given = "".join(f" {item}" for item in args.set) + "".join(f" slow:{item}" for item in slow_sets)
        print(f"\n{spread} round_length={length}{given}{said}: averaged {every['tokens_per_second']:,.0f} tokens/s"
              f"{versus}; identical every round: {every['identical']} ({time.monotonic() - started:.0f}s)")
        for name, peer in every["peers"].items():
            print(f"  {name} cpu {peer['share']:>5}: {peer['steps']:>4} steps a round, idle {peer['idle']:.0%} "
                  f"({peer['idle_settled']:.0%} from round {SETTLED_FROM}), averaged "
                  f"{peer['averaged_of_trained']:.0%} of its tokens", flush=True)
        figures.append(figure("unequal", every["tokens_per_second"],
                              alone["tokens_per_second"] if alone else every["tokens_per_second"], spread=spread,
                              round_length=length, rounds=args.rounds, sets=args.set, slow_sets=slow_sets,
                              per_peer=every["peers"],
                              identical=every["identical"]))
    return figures


def medians(spread: str, repetitions: list[list[dict]], repeat: int) -> list[dict]:
    """``--repeat``: per figure (the same name and settings in every repetition), the repetition whose ratio is the
    median (the lower of the two middle ones where they are even) is kept, with every repetition's ratio (``ratios``);
    printed: every ratio and their median. Each ratio is of adjacent runs, whatever this machine's speed did between
    repetitions."""
    figures = []
    for same in zip(*repetitions):
        ratios = [f["ratio"] for f in same]
        middle = sorted(same, key=lambda f: f["ratio"])[(len(same) - 1) // 2]
        identical = all(f["settings"].get("identical", True) for f in same)
        print(f"\n{spread} {same[0]['name']} {' '.join(same[0]['settings'].get('sets', []))}: ratios "
              f"{', '.join(f'{r:.2f}x' for r in ratios)}; median {statistics.median(ratios):.2f}x (kept: "
              f"{middle['ratio']:.2f}x); identical every round in every repetition: {identical}", flush=True)
        figures.append({**middle, "settings": {**middle["settings"], "repeat": repeat, "ratios": ratios,
                                               "identical": identical}})
    return figures

if __name__ == "__main__":
    sys.exit(main())
