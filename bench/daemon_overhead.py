"""Daemon overhead: inner-step throughput inside the daemon vs a bare torch loop on the same model and data
in the same run (target >= 0.97).

    .venv/bin/python bench/daemon_overhead.py --quick    # H=50, 3 rounds, 3 repetitions of each (~1.5 min)
    .venv/bin/python bench/daemon_overhead.py            # H=100, 4 rounds, 5 repetitions (~4 min)
    .venv/bin/python bench/daemon_overhead.py --set model.hidden_size=192 --set model.ffn_hidden_size=512

A (daemon): a real ``diloco-peer join`` process, alone with a local bootstrap node (``averaging.min_peers=1``,
so every round is a solo outer step: averaging costs nothing and only the daemon's own machinery is
measured). It runs its H inner steps in chunks of H/5 (``OuterRounds._inner_steps``): each chunk hops to a
worker thread, runs ``Trainer.train_steps``, then writes a ``progress`` event, while the event loop beats
heartbeats and the DHT, averager and p2pd processes live beside it. Trainer's own timer would miss the
hops and the event writing, so the daemon's tokens/s is wall clock: within one round, the tokens of chunks
2..5 over the time between the first and the last ``progress`` event (each event is stamped right after its
chunk). The first round is left out (start-up, first-touch allocations), as is each round's first chunk
(it starts after the previous outer step and eval, which are not inner-loop time).

B (bare): a fresh process with the same config: the same model (same seed), the same AdamW (decayed and
undecayed parameter groups, betas, weight decay, gradient clipping), the same batch size, sequence length,
thread count, shard and batch sampler, so the very same batches in the same order. It runs the first round's
H steps untimed, then times (rounds - 1) x H steps with a wall clock. No swarm, no threads, no events.

A and B alternate (A B A B ...) so that drifts of the machine hit both; the figure is the median of the
per-pair ratios daemon / bare. The bootstrap node runs during both A and B. Writes the figure
``daemon_overhead`` (value = daemon tokens/s, baseline = bare tokens/s, of the median pair, so that the ratio
is the median ratio; every pair's ratio is in settings) to bench/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from results import figure, save  # noqa: E402

from diloco_peer.observe.events import read_events  # noqa: E402
from diloco_peer.rounds.outer_rounds import PROGRESS_EVENTS_PER_ROUND  # noqa: E402
from diloco_peer.swarm.addresses import SwarmError  # noqa: E402
from diloco_peer.tools.local_swarm import LocalSwarm  # noqa: E402

CHUNKS = PROGRESS_EVENTS_PER_ROUND  # the daemon writes one progress event per H/CHUNKS steps


def settings_list(args: argparse.Namespace, rounds: int) -> list[str]:
    """The --set overrides both sides share; the user's come last and win."""
    return [f"run.threads={args.threads}", f"outer.inner_steps={args.H}", f"run.max_rounds={rounds}",
            "data.shard=0", "data.num_shards=8", "averaging.min_peers=1", *args.overrides]


def bare(args: argparse.Namespace) -> None:
    """B: the plain loop (runs in its own process, prints one JSON line)."""
    import torch

    from diloco_peer.config import load_config
    from diloco_peer.training.data import Corpus
    from diloco_peer.training.model import build_model

    cfg = load_config(None, settings_list(args, args.rounds))
    torch.set_num_threads(cfg.run.threads)
    corpus = Corpus(cfg.data, cfg.data.shard, cfg.model.vocab_size)
    model = build_model(cfg.model, cfg.run.seed)
    inner = cfg.inner
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": inner.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=inner.lr, betas=tuple(inner.betas))
    model.train()

    def steps(n: int) -> int:
        tokens = 0
        for _ in range(n):
            for _ in range(inner.grad_accum):
                batch = corpus.train_batch(inner.batch_size)
                loss = model(batch[:, :-1], batch[:, 1:]) / inner.grad_accum
                loss.backward()
                tokens += batch[:, :-1].numel()
            if inner.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), inner.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return tokens

    steps(cfg.outer.inner_steps)  # the round the daemon side leaves out, and the same batches
    started = time.perf_counter()
    tokens = steps((args.rounds - 1) * cfg.outer.inner_steps)
    seconds = time.perf_counter() - started
    print(json.dumps({"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds}))


def run_bare(args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--bare", "--H", str(args.H), "--rounds", str(args.rounds),
           "--threads", str(args.threads)] + [x for item in args.overrides for x in ("--set", item)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode:
        sys.exit(f"daemon_overhead: the bare loop failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def daemon_throughput(log: Path) -> dict:
    """Wall-clock tokens/s of the daemon's inner phases from its progress events (see the docstring)."""
    by_epoch: dict[int, list[dict]] = {}
    for event in read_events(log):
        if event["event"] == "progress":
            by_epoch.setdefault(event["epoch"], []).append(event)
    tokens = seconds = timer = 0.0
    for epoch, events in sorted(by_epoch.items()):
        if epoch == 0 or len(events) < 2:
            continue
        tokens += sum(e["tokens"] for e in events[1:])
        seconds += events[-1]["time"] - events[0]["time"]
        timer += sum(e["seconds"] for e in events[1:])
    if not seconds:
        sys.exit(f"daemon_overhead: no measurable progress events in {log}")
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "timer_tokens_per_second": tokens / timer}


def run_daemon(args: argparse.Namespace, swarm: LocalSwarm, rep: int) -> dict:
    """A: one daemon run, as peer ``daemon-REP`` (fresh: no checkpoint to resume from); its throughput."""
    name = f"daemon-{rep}"
    sets = settings_list(args, args.rounds) + ["run.run_id=bench-overhead",
                                                f"checkpoint.dir={json.dumps(str(swarm.workdir / name))}"]
    code = swarm.start_peer(name, *sets).wait(timeout=900)
    if code:
        sys.exit(f"daemon_overhead: the daemon exited with code {code}; see {swarm.log(name)}")
    return daemon_throughput(swarm.workdir / f"{name}.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H=50, 3 rounds, 3 repetitions (~1.5 min)")
    parser.add_argument("--H", type=int, default=None, help="inner steps per round (default 100; quick 50)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per daemon run, the first unmeasured "
                        "(default 4; quick 3)")
    parser.add_argument("--repetitions", type=int, default=None, help="A/B pairs (default 5; quick 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for both sides, e.g. --set model.hidden_size=192")
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)  # internal: run side B and exit
    args = parser.parse_args()
    args.H = args.H or (50 if args.quick else 100)
    args.rounds = args.rounds or (3 if args.quick else 4)
    reps = args.repetitions or (3 if args.quick else 5)
    if args.bare:
        return bare(args)
    if args.rounds < 2 or args.H < 2 * CHUNKS:
        sys.exit("daemon_overhead: need --rounds >= 2 (the first is not measured) and --H >= 10 (5 chunks)")

    from diloco_peer.config import ConfigError, load_config

    try:
        cfg = load_config(None, settings_list(args, args.rounds))
    except ConfigError as e:
        sys.exit(f"daemon_overhead: {e}")
    print(f"daemon vs bare loop: H={args.H}, {args.rounds} rounds per daemon run (first not measured), "
          f"{reps} A/B pairs, {args.threads} threads, batch {cfg.inner.batch_size}x{cfg.data.seq_len}, "
          f"overrides {args.overrides or 'none'}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("daemon_overhead: terminated"))  # unwind: stop the bootstrap
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlp-overhead-") as tmp, LocalSwarm(Path(tmp)) as swarm:
        try:
            swarm.start_bootstrap("--run-id", "bench-overhead", "--report-every", "600")
        except SwarmError as e:
            sys.exit(f"daemon_overhead: {e}")
        for rep in range(reps):
            a, b = run_daemon(args, swarm, rep), run_bare(args)
            rows.append((a, b))
            ratio = a["tokens_per_second"] / b["tokens_per_second"]
            print(f"pair {rep + 1}/{reps}: daemon {a['tokens_per_second']:,.0f} tok/s, bare "
                  f"{b['tokens_per_second']:,.0f} tok/s, ratio {ratio:.3f}", flush=True)

    ratios = [a["tokens_per_second"] / b["tokens_per_second"] for a, b in rows]
    print(f"\n{'pair':>4} {'daemon tok/s':>13} {'(trainer timer)':>15} {'bare tok/s':>11} {'daemon/bare':>11}")
    for i, ((a, b), ratio) in enumerate(zip(rows, ratios), 1):
        print(f"{i:>4} {a['tokens_per_second']:>13,.0f} {a['timer_tokens_per_second']:>15,.0f} "
              f"{b['tokens_per_second']:>11,.0f} {ratio:>11.3f}")
    # the figure is the median pair (by ratio), so that its value / baseline is the median ratio itself
    median_ratio = statistics.median_low(ratios)
    a, b = rows[ratios.index(median_ratio)]
    daemon_tps, bare_tps = a["tokens_per_second"], b["tokens_per_second"]
    print(f"{'med':>4} {daemon_tps:>13,.0f} {a['timer_tokens_per_second']:>15,.0f} {bare_tps:>11,.0f} "
          f"{median_ratio:>11.3f}  (the median pair)")
    verdict = "meets" if median_ratio >= 0.97 else "MISSES"
    print(f"\nmedian daemon/bare ratio {median_ratio:.3f} ({min(ratios):.3f}..{max(ratios):.3f}): {verdict} the "
          f"target >= 0.97")
    model = cfg.model.model_dump(include={"hidden_size", "num_layers", "ffn_hidden_size", "vocab_size"})
    save([figure("daemon_overhead", round(daemon_tps, 1), round(bare_tps, 1), model=model,
                 threads=args.threads, steps=(args.rounds - 1) * args.H, H=args.H,
                 batch=f"{cfg.inner.batch_size}x{cfg.data.seq_len}", mode="quick" if args.quick else "full",
                 repetitions=reps, ratios=[round(r, 4) for r in ratios])])
    print("wrote figure daemon_overhead to bench/results.json")


if __name__ == "__main__":
    main()
