"""``bench/results.json``: every benchmark's measured figures, one record each.

    {"name": "utilization", "value": 0.991, "baseline": 0.62, "ratio": 1.6, "settings": {...}}

``value`` is what was measured, ``baseline`` what it is compared with in the same run (its meaning is in
the benchmark's docstring), ``ratio`` = value / baseline, ``settings`` says how (codec, overlap, link,
model, quick or full, when) and carries a few measured side facts (``MEASURED``: time per round, eval
loss, ...). A benchmark replaces the records it measured (same name and same settings, side facts
apart) and leaves the others alone, so ``make bench`` can run them one by one.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results.json"
MEASURED = {"measured_at", "seconds_per_round", "averaged_fraction", "eval_loss", "ratios", "median_pair_ratio",
            "allreduce_seconds", "compute_seconds", "mesh_bytes_per_second", "of_mesh", "per_peer", "identical",
            "pss_per_peer", "bytes_per_peer_round"}
"""Settings keys that are measured in the run, not chosen: they do not tell configurations apart."""


def figure(name: str, value: float, baseline: float, **settings) -> dict:
    """One measured figure; ``ratio`` is computed here so that it always matches value and baseline."""
    settings["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    ratio = value / baseline if baseline else float("inf")
    return {"name": name, "value": value, "baseline": baseline, "ratio": round(ratio, 4), "settings": settings}


def key(record: dict) -> tuple:
    """What identifies a record's configuration: its name and its chosen settings."""
    settings = {k: v for k, v in record["settings"].items() if k not in MEASURED}
    return record["name"], json.dumps(settings, sort_keys=True)


def save(figures: list[dict], path: Path = RESULTS) -> None:
    """Merge ``figures`` into ``path`` (atomically: a crash leaves the old file whole)."""
    records = json.loads(path.read_text()) if path.exists() else []
    new_keys = {key(f) for f in figures}
    records = [r for r in records if key(r) not in new_keys] + figures
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    os.replace(tmp, path)


def study_arguments(parser, out: Path, codecs: str) -> None:
    """The arguments every simulator study shares (``overlap_quality.py``, ``robust_quality.py``): K, H, T, the
    warm start, the codecs, ``--set`` overrides and the JSON file the runs are appended to."""
    parser.add_argument("--replicas", type=int, default=4, help="K (default 4)")
    parser.add_argument("--H", type=int, default=10, help="inner steps per round (default 10)")
    parser.add_argument("--steps", type=int, default=300, help="T, inner steps per run (default 300: 30 rounds)")
    parser.add_argument("--pretrain", type=int, default=300, help="steps of the shared warm start (default 300)")
    parser.add_argument("--codecs", default=codecs, help=f"comma-separated (default {codecs})")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=str(out))


def append_runs(runs: list[dict], out: str | Path) -> None:
    """Add a study's runs to the JSON list in ``out`` (earlier runs are kept: studies accumulate)."""
    out = Path(out)
    previous = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(previous + runs, indent=1))
    print(f"appended {len(runs)} runs to {out}")
