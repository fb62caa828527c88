"""Benchmark 1: compute utilization of a swarm on a slow link, blocking vs overlapped rounds, per codec.

    sudo .venv/bin/python bench/utilization.py --quick     # blocking fp32 vs overlapped int8 (~2.5 min)
    sudo .venv/bin/python bench/utilization.py             # both modes x none/fp16/int8/int4 (~15 min)

Three peers, each in its own network namespace, every link shaped to ``--mbit`` (20 Mbit/s up and down
by default, a modest home connection) with ``tc tbf`` (see netbed.py). The model (the tiny CPU config)
is small enough that 3 peers train on this machine's 2 cores, and its fp32 pseudo-gradient (1.4 MB)
takes a noticeable share of a round on that link. Utilization = time in inner steps / wall time, per
peer, over the rounds after the first (definitions in swarm_bench.py). Every configuration runs in the
same invocation, one after the other on the same network, so the ratios compare like with like.

Writes one ``utilization`` figure per configuration to bench/results.json: value = its utilization,
baseline = blocking fp32's utilization measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from results import figure, save  # noqa: E402
from swarm_bench import run_swarm  # noqa: E402

from diloco_peer.tools.netbed import SlowNetwork, available  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="blocking fp32 and overlapped int8 only, fewer rounds")
    parser.add_argument("--mbit", type=float, default=20.0, help="link rate of every peer, up and down (default 20)")
    parser.add_argument("--peers", type=int, default=3)
    parser.add_argument("--H", type=int, default=60, help="inner steps per round (default 60)")
    parser.add_argument("--rounds", type=int, default=None, help="outer rounds per configuration (default 8; quick 4)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if why := available():
        print(f"error: this benchmark needs network namespaces: {why} (run it as root)", file=sys.stderr)
        return 2
    rounds = args.rounds or (4 if args.quick else 8)
    if args.quick:
        plan = [("blocking", "none"), ("eager", "int8")]
    else:
        plan = [(mode, codec) for mode in ("blocking", "eager") for codec in ("none", "fp16", "int8", "int4")]
    common = [f"outer.inner_steps={args.H}", "averaging.ready_timeout=10.0", *args.overrides]
    print(f"{args.peers} peers, {args.mbit:g} Mbit/s links (tbf), H={args.H}, {rounds} rounds per configuration, "
          f"overrides {args.overrides or 'none'}", flush=True)
    results = {}
    with SlowNetwork(args.peers, args.mbit) as net, tempfile.TemporaryDirectory() as tmp:
        for mode, codec in plan:
            workdir = Path(tmp) / f"{mode}-{codec}"
            results[mode, codec] = stats = run_swarm(
                net, [*common, f"outer.overlap={mode}", f"averaging.compression={codec}"], rounds, workdir)
            print(f"  {mode:8} {codec:5}: utilization {stats['utilization']:.3f} "
                  f"({stats['seconds_per_round']:.2f} s/round)", flush=True)
    baseline = results["blocking", "none"]["utilization"]
    print(f"\n{'overlap':9}{'codec':6}{'util':>7}{'min':>7}{'vs blocking fp32':>18}{'s/round':>9}{'compute s':>10}"
          f"{'waited s':>9}{'MB/peer/round':>14}{'averaged':>9}")
    figures = []
    for (mode, codec), s in results.items():
        print(f"{mode:9}{codec:6}{s['utilization']:7.3f}{s['utilization_min']:7.3f}"
              f"{s['utilization'] / baseline:17.2f}x{s['seconds_per_round']:9.2f}{s['compute_seconds_per_round']:10.2f}"
              f"{s['overlap_wait_per_round']:9.2f}{s['bytes_per_peer_round'] / 1e6:14.2f}{s['averaged_fraction']:9.0%}")
        figures.append(figure("utilization", round(s["utilization"], 4), round(baseline, 4), overlap=mode, codec=codec,
                              mbit=args.mbit, peers=args.peers, H=args.H, rounds=rounds, quick=args.quick,
                              parameters=s["parameters"], averaged_fraction=round(s["averaged_fraction"], 3),
                              seconds_per_round=round(s["seconds_per_round"], 3)))
    save(figures)
    print("\n(waited s: in overlapped mode, how long a round's end waited for the previous round's average)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
