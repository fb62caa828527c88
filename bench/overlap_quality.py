"""Does overlapping a round with the next one cost model quality? Blocking vs eager vs delayed, 30+ rounds.

    .venv/bin/python bench/overlap_quality.py --replicas 4 --H 10 --steps 300 --codecs int8     # ~5 min
    .venv/bin/python bench/overlap_quality.py --replicas 8 --H 10 --steps 300 --codecs int8     # ~10 min
    .venv/bin/python bench/overlap_quality.py --replicas 4 --H 25 --steps 750 --codecs int8     # ~12 min
    .venv/bin/python bench/overlap_quality.py --modes eager --arrival 0.1,0.25,0.5              # ~5 min
    .venv/bin/python bench/overlap_quality.py --modes blocking,eager --arrival 0.5 --fragments 1,5

Every run is ``diloco-peer simulate``'s engine (``tools/simulate.run_diloco``, which a test proves computes
what a real swarm computes, eager mode included), K replicas of the tiny config from the same pretrained
start (``--pretrain`` steps of one replica, as the DiLoCo paper starts from a pretrained model), T inner
steps in rounds of H, one torch thread. Each overlap mode runs with the config it would have in a swarm
(``outer.overlap`` set, so its default outer lr: 0.7 blocking, 0.35 overlapped) plus ``--set``; ``--modes``
picks them, e.g. ``--modes delayed --set outer.lr=0.7`` for the one-step delay at blocking's lr.
``--arrival`` runs each overlapped mode once per fraction f: the previous round's average reaches the replicas
after d = round(f * H) inner steps (``outer.apply_on_arrival`` in a swarm); without it, at the round's end.
``--fragments P`` syncs by P staggered fragments (Streaming DiLoCo, ``tools/fragment_rounds.py``, a study of what
the swarm does not do yet): f stays the time the exchange of *all* parameters takes on the link, so a fragment's
average arrives after round(f * H / P) inner steps. Blocking runs once per P too (P = 1: ``run_diloco``).

Prints eval loss and perplexity per run and each one's perplexity against blocking with the same codec, and
appends the runs to ``--out`` (a JSON list; the study tables of BENCHMARKS.md come from it).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from results import append_runs, study_arguments  # noqa: E402

from diloco_peer.config import load_config  # noqa: E402
from diloco_peer.tools.fragment_rounds import run_streaming  # noqa: E402
from diloco_peer.tools.simulate import pretrain, run_diloco  # noqa: E402


def _label(run: dict) -> str:
    """A run's mode, fragments and arrival in a few words, e.g. ``eager P=5 arrival 1/10``."""
    fragments = f" P={run['fragments']}" if "fragments" in run else ""
    at = f" arrival {run['arrived_step']}/{run['H']}" if "arrived_step" in run else ""
    return f"{run['overlap']}{fragments}{at}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_arguments(parser, Path(__file__).resolve().parent / "overlap_quality.json", codecs="int8")
    parser.add_argument("--modes", default="blocking,eager,delayed", help="comma-separated overlap modes")
    parser.add_argument("--fragments", default="1", help="comma-separated fragment counts P (default 1: all "
                        "parameters in one all-reduce, as the swarm syncs)")
    parser.add_argument("--arrival", default="", help="comma-separated fractions of H at which an overlapped "
                        "round's average reaches the replicas, e.g. 0.1,0.25,0.5 (default: the round's end)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = [f"outer.inner_steps={args.H}", f"inner.total_steps={args.steps}", "run.threads=1", *args.overrides]
    init = pretrain(load_config(None, base), args.pretrain) if args.pretrain else None
    runs = []
    arrivals = [float(f) for f in args.arrival.split(",") if f] or [None]
    plan = [(codec, p, mode, fraction) for codec in args.codecs.split(",")
            for p in [int(p) for p in args.fragments.split(",")] for mode in args.modes.split(",")
            for fraction in (arrivals if mode != "blocking" else [None])]
    for codec, fragments, mode, fraction in plan:
        cfg = load_config(None, [f"outer.overlap={mode}", *base])
        step = None if fraction is None else round(fraction * args.H / fragments)
        started = time.perf_counter()
        if fragments == 1:
            run = run_diloco(cfg, args.replicas, args.steps // args.H, codec, mode, init=init, arrival=step)
        else:
            run = run_streaming(cfg, args.replicas, args.steps // args.H, fragments, codec, mode, init=init,
                                arrival=step)
        runs.append({"replicas": args.replicas, "H": args.H, "steps": args.steps, "pretrain": args.pretrain,
                     "codec": codec, "overlap": mode, "outer_lr": cfg.outer.lr,
                     "outer_momentum": cfg.outer.momentum, "overrides": args.overrides,
                     **({} if fragments == 1 else {"fragments": fragments}),
                     **({} if step is None else {"arrival": fraction, "arrived_step": step}),
                     "final_eval_loss": run.eval_loss[-1], "eval_loss": run.eval_loss,
                     "seconds": round(time.perf_counter() - started, 1)})
        print(f"K={args.replicas} H={args.H} {codec:5} {_label(runs[-1]):28} lr {cfg.outer.lr:<5} eval loss "
              f"{run.eval_loss[-1]:.4f} (ppl {math.exp(run.eval_loss[-1]):.3f}) in {runs[-1]['seconds']:.0f}s",
              flush=True)
    for r in runs:  # against blocking with all parameters in one all-reduce, the same codec
        ref = next((b for b in runs if b["codec"] == r["codec"] and b["overlap"] == "blocking"
                    and "fragments" not in b), None)
        if ref is not None and r is not ref:
            gap = math.exp(r["final_eval_loss"] - ref["final_eval_loss"]) - 1
            print(f"  {r['codec']} {_label(r)} lr {r['outer_lr']}: {gap * 100:+.1f}% ppl vs blocking")
    append_runs(runs, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
