"""Data at any size: a peer's start-up time and memory on a ~10 GB prepared dataset vs a 10 MB one.

    .venv/bin/python bench/data_startup.py               # 10 GB vs 10 MB, 5 alternating runs each (~3 min)
    .venv/bin/python bench/data_startup.py --gb 1        # quicker: 1 GB vs 10 MB
    .venv/bin/python bench/data_startup.py --keep        # keep the generated datasets (default: deleted)

What is measured is the ``Corpus`` of ``data.source = "shards"`` (the token shards, read in place, that
``diloco-peer prepare`` writes), as a peer builds it at start-up. The datasets are random uint16 ids (vocab
32000, llama-150m's), written with prepare's own ``ShardWriter`` into files of 100M tokens (200 MB) plus a
1M-token eval split and a manifest, the format ``prepare`` writes; generating them skips tokenization,
which costs hours for 10 GB of text and has nothing to do with start-up.

Each run is a fresh process (``--child``): it imports torch and the package, notes its RSS, then times
``Corpus(...)`` (start-up), draws 200 training batches of 8 x 1025 tokens and the eval batches (16 x 8
windows), and reports the RSS growth over the baseline and the peak RSS (``ru_maxrss``). The two datasets are
measured alternately (big, small, big, ...) so that the shared machine's drifts hit both; medians are
printed, with the ratio big / small. The files are in the page cache after generation (warm): start-up reads
no data either way, only the windows sampled are touched.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from diloco_peer.training.token_shards import FORMAT, VERSION, ShardWriter  # noqa: E402

VOCAB = 32_000
SHARD_TOKENS = 100_000_000
EVAL_TOKENS = 1_000_000
SEQ_LEN = 1024
CHUNK = 1 << 24  # tokens generated and written at a time (32 MB)


def generate(directory: Path, tokens: int, seed: int) -> None:
    """Random uint16 ids written as prepared shards (eval split first, then training files) + manifest."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    manifest = {"format": FORMAT, "version": VERSION, "eval": None, "train": [], "complete": False,
                "settings": {"generated": "random uint16 ids (bench/data_startup.py)", "shard_tokens": SHARD_TOKENS,
                             "eval_tokens": EVAL_TOKENS},
                "tokenizer": "random", "vocab_size": VOCAB, "eos_id": None, "dtype": "uint16"}
    writer = ShardWriter(directory, manifest, np.dtype(np.uint16))
    rng = np.random.default_rng(seed)
    done = 0
    while done < tokens:
        count = min(CHUNK, tokens - done)
        writer.feed(rng.integers(0, VOCAB, count, dtype=np.uint16), {"unit": 0, "pos": [0, done, 1]}, 0)
        done += count
    writer.finish({"unit": 0, "pos": [0, done, 1], "skip": 0})


def child(directory: str) -> None:
    """One measurement, in its own process: prints one JSON line."""
    import psutil
    import torch

    from diloco_peer.config import load_config
    from diloco_peer.training.data import Corpus

    cfg = load_config("llama-150m", ["data.source=shards", f"data.shards_dir={json.dumps(directory)}",
                                     "data.num_shards=64", f"data.seq_len={SEQ_LEN}"])
    process = psutil.Process()
    baseline = process.memory_info().rss
    start = time.perf_counter()
    corpus = Corpus(cfg.data, 7, cfg.model.vocab_size)
    startup = time.perf_counter() - start
    after_start = process.memory_info().rss
    start = time.perf_counter()
    for _ in range(200):
        batch = corpus.train_batch(8)
    sampling = (time.perf_counter() - start) / 200
    evals = corpus.eval_batches(8)
    assert batch.shape == (8, SEQ_LEN + 1) and len(evals) == cfg.data.eval_batches and torch.all(batch < VOCAB)
    print(json.dumps({"startup_s": startup, "rss_growth_start_mb": (after_start - baseline) / 2**20,
                      "rss_growth_mb": (process.memory_info().rss - baseline) / 2**20,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "baseline_rss_mb": baseline / 2**20, "batch_ms": sampling * 1000,
                      "files": len(corpus.shards.files), "blocks_of_this_shard": corpus.shards.num_blocks}))


def measure(directory: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(directory)], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=10.0, help="size of the big dataset in GB (default 10)")
    parser.add_argument("--small-mb", type=float, default=10.0, help="size of the small one in MB (default 10)")
    parser.add_argument("--runs", type=int, default=5, help="alternating measurements of each (default 5)")
    parser.add_argument("--dir", default="/tmp/diloco-data-bench", help="where to generate the datasets")
    parser.add_argument("--keep", action="store_true", help="keep the generated datasets")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    sizes = {"big": int(args.gb * 1e9) // 2, "small": int(args.small_mb * 1e6) // 2}  # uint16: 2 bytes per token
    root = Path(args.dir)
    try:
        for name, tokens in sizes.items():
            start = time.perf_counter()
            generate(root / name, tokens, seed=len(name))
            size = sum(p.stat().st_size for p in (root / name).iterdir())
            print(f"generated {name}: {tokens:,} tokens, {size / 1e9:.3f} GB in {time.perf_counter() - start:.0f} s")
        runs = {name: [] for name in sizes}
        for _ in range(args.runs):
            for name in sizes:
                runs[name].append(measure(root / name))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    print(f"{'dataset':>8} {'tokens':>15} {'files':>6} {'start-up ms':>12} {'RSS +MB start':>14} "
          f"{'RSS +MB 200 batches':>20} {'peak RSS MB':>12} {'batch ms':>9}")
    for name, m in medians.items():
        print(f"{name:>8} {sizes[name]:>15,} {m['files']:>6.0f} {m['startup_s'] * 1000:>12.2f} "
              f"{m['rss_growth_start_mb']:>14.2f} {m['rss_growth_mb']:>20.2f} {m['peak_rss_mb']:>12.1f} "
              f"{m['batch_ms']:>9.3f}")
    big, small = medians["big"], medians["small"]
    print(f"big / small: start-up {big['startup_s'] / small['startup_s']:.2f}x, peak RSS "
          f"{big['peak_rss_mb'] / small['peak_rss_mb']:.3f}x, RSS growth {big['rss_growth_mb']:.1f} vs "
          f"{small['rss_growth_mb']:.1f} MB ({args.runs} runs each, medians)")
    print(json.dumps({"sizes_tokens": sizes, "medians": medians, "runs": runs}))


if __name__ == "__main__":
    main()
