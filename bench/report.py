"""Render bench/results.json as the tables of BENCHMARKS.md (between its ``<!-- results.json -->`` markers).

    .venv/bin/python bench/report.py            # rewrite that section of BENCHMARKS.md
    .venv/bin/python bench/report.py --print    # print the tables only

One table per figure name, newest record per configuration, with the settings that tell them apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from results import key  # noqa: E402

BEGIN, END = "<!-- results.json -->", "<!-- /results.json -->"

TABLES = {
    # name: (title, what value and baseline are, the settings shown as columns)
    "utilization": ("Compute utilization on a slow link (`bench/utilization.py`)",
                    "time in inner steps / wall time; baseline: blocking fp32 in the same run",
                    ["overlap", "codec", "mbit", "H", "peers", "seconds_per_round", "averaged_fraction", "quick"]),
    "bytes_per_token_vs_ddp": ("Bytes per trained token vs DDP (`bench/bytes_per_token.py`)",
                               "value: DDP's bytes per token; baseline: the swarm's; ratio: how many times fewer",
                               ["codec", "density", "exchange_share", "H", "overlap", "peers", "mbit",
                                "bytes_per_peer_round", "eval_loss", "averaged_fraction", "quick"]),
    "allreduce_efficiency": ("All-reduce throughput vs raw TCP (`bench/allreduce_efficiency.py`)",
                             "bytes/s per peer in the all-reduce proper; baseline: one TCP stream on the same link; "
                             "of_mesh: the same rate / a raw TCP full mesh's (every peer sending to all at once)",
                             ["codec", "mbit", "parameters", "of_mesh", "quick"]),
    "daemon_overhead": ("Inner-loop throughput in the daemon vs a bare loop (`bench/daemon_overhead.py`)",
                        "tokens/s; baseline: a bare PyTorch loop on the same model and data",
                        ["threads", "steps", "batch", "mode", "ratios"]),
    "vs_hivemind_optimizer": ("Against hivemind.Optimizer (`bench/vs_hivemind_optimizer.py`)",
                              "utilization; baseline: hivemind.Optimizer in local-updates mode, same model and link",
                              ["link_mbit", "H", "codec", "overlap", "hivemind_averaging", "seconds_per_round.ours",
                               "seconds_per_round.hivemind", "mode"]),
    "gpu": ("GPU (`bench/gpu.py`)", "see the benchmark's docstring", ["config", "device", "metric"]),
    "stream_ends": ("Streams cut short by p2pd's reset race (`bench/stream_ends.py`)",
                    "streams that lost their last messages when the caller hangs up first (ours); baseline: when "
                    "the handler does (hivemind's way), in the same run, under CPU load",
                    ["streams", "messages", "message_bytes", "read_delay_s", "quick"]),
}


def _fmt(v) -> str:
    if isinstance(v, list):
        return ", ".join(_fmt(x) for x in v)
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    return "" if v is None else str(v)


def _setting(settings: dict, column: str):
    """A settings value by column name; ``a.b`` reads key ``b`` of the dict under ``a``."""
    value = settings
    for name in column.split("."):
        value = value.get(name) if isinstance(value, dict) else None
    return value


def render(records: list[dict]) -> str:
    newest = {key(r): r for r in records}  # later records replace earlier ones of the same configuration
    out = []
    for name, (title, meaning, columns) in TABLES.items():
        rows = [r for (n, _), r in newest.items() if n == name]
        if not rows:
            continue
        out += [f"### {title}", "", f"{meaning}.", "",
                "| " + " | ".join(["value", "baseline", "ratio", *columns, "measured"]) + " |",
                "|" + "---|" * (len(columns) + 4)]
        for r in rows:
            cells = [_fmt(r["value"]), _fmt(r["baseline"]), _fmt(r["ratio"]),
                     *(_fmt(_setting(r["settings"], c)) for c in columns), r["settings"].get("measured_at", "")]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the tables instead of updating BENCHMARKS.md")
    parser.add_argument("--results", default=str(HERE / "results.json"))
    args = parser.parse_args()
    path = Path(args.results)
    if not path.exists():
        print(f"error: {path} does not exist: run `make bench` first", file=sys.stderr)
        return 2
    tables = render(json.loads(path.read_text()))
    if args.print:
        print(tables)
        return 0
    doc = HERE.parent / "BENCHMARKS.md"
    text = doc.read_text()
    if BEGIN not in text or END not in text:
        print(f"error: {doc} has no {BEGIN} ... {END} section to fill", file=sys.stderr)
        return 2
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    doc.write_text(f"{head}{BEGIN}\n{tables}\n{END}{tail}")
    print(f"updated {doc} from {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
