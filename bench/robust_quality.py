"""What does robust aggregation cost on a clean swarm (no attacker)? ``mean`` vs ``robust``, 30 rounds, same start.

    nice -n 5 .venv/bin/python bench/robust_quality.py --replicas 4 --codecs int8,none --seeds 0,1   # ~40 min
    nice -n 5 .venv/bin/python bench/robust_quality.py --replicas 8 --codecs int8,none --seeds 0,1   # ~80 min

Every run is ``diloco-peer simulate``'s engine (``tools/simulate.run_diloco``), which averages each part of the
pseudo-gradient with ``robust_aggregation.aggregate``, the function the swarm's reducers call, and counts what
the swarm's checks would refuse (``refused``: in a swarm, offenses against honest peers). K replicas of the tiny
config from one pretrained start (``--pretrain`` steps of one replica, data seed 0), T inner steps in rounds of
H, blocking rounds, one torch thread. For each data seed (``data.seed``: the replicas' batch order, so seeds
show how far two equally good runs land apart) and codec, the same run with ``averaging.aggregation=mean``
and ``=robust``; the gap is robust's final eval loss against mean's, in percent.

Prints one line per run and the gaps, and appends each run to ``--out`` as it ends (a JSON list; BENCHMARKS.md's
table comes from it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from results import study_arguments  # noqa: E402

from diloco_peer.config import load_config  # noqa: E402
from diloco_peer.tools.simulate import pretrain, run_diloco  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    study_arguments(parser, Path(__file__).resolve().parent / "robust_quality.json", codecs="int8,none")
    parser.add_argument("--seeds", default="0", help="comma-separated data seeds (default 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = [f"outer.inner_steps={args.H}", f"inner.total_steps={args.steps}", "run.threads=1", *args.overrides]
    init = pretrain(load_config(None, base), args.pretrain) if args.pretrain else None
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.exists() else []
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for codec in args.codecs.split(","):
            for aggregation in ("mean", "robust"):
                cfg = load_config(None, [*base, f"data.seed={seed}", f"averaging.aggregation={aggregation}"])
                started = time.perf_counter()
                run = run_diloco(cfg, args.replicas, args.steps // args.H, codec, "blocking", init=init)
                runs.append({"replicas": args.replicas, "H": args.H, "steps": args.steps, "pretrain": args.pretrain,
                             "seed": seed, "codec": codec, "aggregation": aggregation, "overrides": args.overrides,
                             "final_eval_loss": run.eval_loss[-1], "eval_loss": run.eval_loss,
                             "refused": run.refused, "seconds": round(time.perf_counter() - started, 1)})
                print(f"K={args.replicas} H={args.H} seed {seed} {codec:5} {aggregation:6} eval loss "
                      f"{run.eval_loss[-1]:.4f} refused {run.refused} in {runs[-1]['seconds']:.0f}s", flush=True)
                out.write_text(json.dumps(previous + runs, indent=1))  # after every run: a long study keeps its part
    for r in runs:
        if r["aggregation"] == "robust":
            ref = next(b for b in runs if (b["seed"], b["codec"], b["aggregation"]) == (r["seed"], r["codec"], "mean"))
            gap = r["final_eval_loss"] / ref["final_eval_loss"] - 1
            print(f"  seed {r['seed']} {r['codec']}: robust {gap * 100:+.2f}% eval loss vs mean")
    print(f"appended {len(runs)} runs to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
