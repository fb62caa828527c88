"""Benchmark 6 (needs a GPU): the 150M config on one GPU, and the all-reduce's share of a round on real links.

    .venv/bin/python bench/gpu.py                  # llama-150m offline (bytes, stdlib text), 3 rounds of H=100
    .venv/bin/python bench/gpu.py --quick          # 2 rounds of H=50
    .venv/bin/python bench/gpu.py --allow-cpu --config tiny-cpu    # a dry run of this script on a CPU

One real peer (``diloco-peer demo --peers 1``: a bootstrap node and one daemon) trains the 150M Llama of
OpenDiLoCo (``configs/llama-150m.toml`` with the offline data and byte vocabulary, so nothing downloads)
on the GPU. From its event log: inner-loop tokens/s, and utilization = time in inner steps / wall time of
a round (alone, a round has no network time: this is the daemon's own cost per round).

The all-reduce share is extrapolated from measured bytes: the model's real pseudo-gradient messages
(every parameter tensor encoded by the wire codec into hivemind's protobuf, ``ByteSize()``) times the
butterfly all-reduce's 2 (K-1)/K through each peer's uplink, over 1 Gbit/s and 100 Mbit/s, against the
compute time of a round at the paper's H=500 with the config's own batch (its tokens per inner step at the
measured tokens/s: a ``--set inner.grad_accum=1`` that shortens this run's steps does not shorten that round).
Blocking mode pays that time each round; overlapped mode hides it when it is shorter than a round. Writes
``gpu`` figures.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hivemind.compression import CompressionInfo  # noqa: E402
from results import figure, save  # noqa: E402
from swarm_bench import measure  # noqa: E402

from diloco_peer.averaging.averager import wire_compression  # noqa: E402
from diloco_peer.averaging.compression import get_codec  # noqa: E402
from diloco_peer.config import load_config  # noqa: E402
from diloco_peer.tools.local_swarm import diloco_command  # noqa: E402
from diloco_peer.training.model import build_model  # noqa: E402

OFFLINE = ["data.source='stdlib'", "data.tokenizer='bytes'", "model.vocab_size=256", "checkpoint.dir=''"]


def wire_bytes(cfg, codec: str) -> int:
    """Protobuf bytes of one whole pseudo-gradient encoded with ``codec`` (random values, real shapes)."""
    compression, total = wire_compression(get_codec(codec)), 0
    for p in build_model(cfg.model, 0).parameters():
        x = torch.randn(p.shape)
        total += compression.compress(x, CompressionInfo.from_tensor(x)).ByteSize()
    return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of H=50")
    parser.add_argument("--config", default="llama-150m")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="run without a GPU, to check the script (a dry run: records nothing)")
    parser.add_argument("--peers", type=int, default=8, help="K for the extrapolated all-reduce (default 8)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        print("gpu benchmark: skipped, no CUDA GPU on this machine (--allow-cpu runs it anyway)")
        return 0
    H, rounds = (50, 2) if args.quick else (100, 3)
    sets = [*OFFLINE, f"outer.inner_steps={H}", "averaging.min_peers=1", "data.max_bytes=20_000_000",
            *args.overrides]
    cfg = load_config(args.config, sets)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = diloco_command("demo", "--peers", "1", "--rounds", str(rounds + 1), "--out", tmp, "--config", args.config)
        for item in sets:
            cmd += ["--set", item]
        print(f"{args.config} on {device}: {rounds + 1} rounds of H={H} (the first is not counted)", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        s = measure(Path(tmp), 1)
    tokens_per_second = s["tokens"] / (s["compute_seconds_per_round"] * s["rounds"])
    return report(args, cfg, device, s, tokens_per_second)


def report(args, cfg, device: str, s: dict, tokens_per_second: float) -> int:
    """Print and (on a GPU) save the figures of a run: ``s`` as ``swarm_bench.measure`` returns it."""
    shipped = load_config(args.config, OFFLINE).inner  # the config's batch, whatever this run's --set said
    step_tokens = shipped.batch_size * shipped.grad_accum * cfg.data.seq_len
    round_500 = 500 * step_tokens / tokens_per_second  # compute time of a round at the paper's H
    print(f"\ntokens/s {tokens_per_second:,.0f} | utilization {s['utilization']:.4f} | compute per round at H=500 "
          f"({step_tokens:,} tokens per inner step): {round_500:.1f} s | {s['parameters'] / 1e6:.1f}M parameters")
    figures = [
        figure("gpu", round(tokens_per_second, 1), 0.0, config=args.config, device=device, metric="tokens_per_second"),
        figure("gpu", round(s["utilization"], 4), 1.0, config=args.config, device=device, metric="utilization"),
    ]
    print(f"\n{'codec':6}{'MB on the wire':>15}{'link':>10}{'all-reduce s':>13}{'share (blocking, H=500)':>25}")
    for codec in ("fp16", "int8", "int4"):
        size = wire_bytes(cfg, codec)
        uplink = 2 * (args.peers - 1) / args.peers * size
        for mbit in (1000, 100):
            seconds = uplink * 8 / (mbit * 1e6)
            share = seconds / (seconds + round_500)
            print(f"{codec:6}{size / 1e6:15.1f}{mbit:>6} Mbit{seconds:13.1f}{share:25.3f}")
            figures.append(figure("gpu", round(share, 4), 1.0, config=args.config, device=device,
                                  metric=f"allreduce_share_{codec}_{mbit}mbit_K{args.peers}_H500",
                                  allreduce_seconds=round(seconds, 2), compute_seconds=round(round_500, 2)))
    if device != "cpu":
        save(figures)
    else:
        print("\n(a dry run on the CPU: nothing written to bench/results.json)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
