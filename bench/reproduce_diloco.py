"""The DiLoCo table, reproduced small: no replica vs Kx batch (what DDP computes) vs DiLoCo with K replicas.

    .venv/bin/python bench/reproduce_diloco.py            # full: T=300 inner steps, K = 4 and 8 (~20 min on 2 cores)
    .venv/bin/python bench/reproduce_diloco.py --quick    # T=100, K = 4 (~2 min)
    .venv/bin/python bench/reproduce_diloco.py --pretrain 300 --out bench/reproduce_diloco_pretrained.json

The DiLoCo paper (Douillard et al. 2023, table 2; OpenDiLoCo reproduces it) trains a 150M Llama on C4
with H=500: no replica ppl 16.17, data-parallel with 8x batch 13.68, DiLoCo with 8 replicas 13.73,
while communicating ~500x less. Here: the tiny config (0.36M params, bytes of the Python standard
library's source), every run with the same number T of inner steps; Kx batch and DiLoCo-K process the
same tokens (equal compute), the single replica 1/K of them. DiLoCo runs use blocking fp32, blocking
int8 and overlapped ("delayed") int8 pseudo-gradients. All numbers come from ``diloco-peer simulate``'s
engine (``diloco_peer/simulate.py``), which a test proves computes what a real swarm computes.

Prints one table (eval perplexity, its gap to Kx batch, bytes per replica, and the byte ratio against
DDP) and writes ``bench/reproduce_diloco.json``. ``--pretrain N`` starts every run (baselines included)
from one replica trained N steps, as the paper starts from a model pretrained 24k steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from diloco_peer.config import load_config  # noqa: E402
from diloco_peer.tools.simulate import format_table, plot_runs, pretrain, run_baseline, run_diloco  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=100 inner steps, K=4 only (about 2 minutes)")
    parser.add_argument("--steps", type=int, default=None, help="T, inner steps per run (default 300; quick 100)")
    parser.add_argument("--H", type=int, default=None, help="inner steps per outer round (default 50; quick 25)")
    parser.add_argument("--pretrain", type=int, default=0, metavar="STEPS",
                        help="start every run from one replica trained STEPS steps, as the paper does (default 0)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. --set outer.lr=0.5")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "reproduce_diloco.json"))
    args = parser.parse_args()
    steps = args.steps or (100 if args.quick else 300)
    H = args.H or (25 if args.quick else 50)
    ks = [4] if args.quick else [4, 8]
    rounds = steps // H
    torch.set_num_threads(2)
    cfg = load_config(None, [f"outer.inner_steps={H}", f"inner.total_steps={steps}", "run.threads=2",
                             *args.overrides])
    print(f"T={steps} inner steps, H={H} ({rounds} rounds), K in {ks}, model tiny-cpu, pretrain {args.pretrain}; "
          f"overrides {args.overrides or 'none'}", flush=True)
    started = time.perf_counter()
    init = pretrain(cfg, args.pretrain) if args.pretrain else None
    runs = [run_baseline(cfg, "single", 1, rounds, init=init)]
    for k in ks:
        runs.append(run_baseline(cfg, "kx_batch", k, rounds, init=init))
        for codec, overlap in (("none", "blocking"), ("int8", "blocking"), ("int8", "delayed")):
            runs.append(run_diloco(cfg, k, rounds, codec, overlap, init=init))
            print(f"  {runs[-1].name}: ppl {runs[-1].final_ppl:.3f} ({runs[-1].seconds:.0f}s)", flush=True)
    print(format_table(runs))
    ddp = {r.replicas: r.bytes_per_replica for r in runs if r.kind == "kx_batch"}
    for r in runs:
        if r.kind == "diloco":
            print(f"{r.name}: {ddp[r.replicas] / r.bytes_per_replica:,.0f}x fewer bytes than DDP (Kx batch)")
    record = {"command": " ".join(["bench/reproduce_diloco.py", *sys.argv[1:]]), "steps": steps, "H": H,
              "pretrain": args.pretrain,
              "seconds": time.perf_counter() - started, "runs": [r.to_dict() for r in runs]}
    Path(args.out).write_text(json.dumps(record, indent=2))
    plot_runs(runs, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} ({record['seconds']:.0f}s)")


if __name__ == "__main__":
    main()
