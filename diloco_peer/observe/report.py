"""Reading peers' event logs back: the demo's summary (JSON + table) and the plots (``diloco-peer plot``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .events import read_events

ROUND_FIELDS = ("round", "group_size", "outcome", "allreduce_seconds", "bytes_sent", "bytes_received")


def summarize(logs: dict[str, Path], wall_seconds: float, exit_codes: dict[str, int | None],
              finishers: list[str] | None = None) -> dict:
    """The demo's summary (the output contract of ``--summary-json``) from the peers' event logs.

    ``finishers`` are the peers expected to train to the end (all, unless a churn schedule removed some):
    ``rounds_completed`` and ``replicas_identical`` are about them."""
    finishers = list(logs) if finishers is None else finishers
    starts = {}
    rounds = []
    last_hash = {}
    for name, path in logs.items():
        for event in read_events(path):
            if event["event"] == "start":
                starts[name] = event
            elif event["event"] == "round":
                rounds.append({"peer": name, **{k: event[k] for k in ROUND_FIELDS},
                               **{k: event[k] for k in ("train_loss", "tokens", "compute_seconds",
                                                        "values_not_averaged", "error", "param_sha256")},
                               "eval_loss": event.get("eval_loss"),  # (None: handed in, not evaluated)
                               "inner_steps": event.get("inner_steps", 0)})
                last_hash[name] = (event["round"], event["param_sha256"])
    per_peer = Counter(r["peer"] for r in rounds)
    final_round = max((r["round"] for r in rounds), default=0)
    final_evals = [r["eval_loss"] for r in rounds if r["round"] == final_round and r["eval_loss"] is not None]
    hashes = {name: h for name, (_, h) in last_hash.items() if name in finishers}
    same_round = len({rnd for name, (rnd, _) in last_hash.items() if name in finishers}) == 1
    return {
        "peers": [
            {"name": name, "peer_id": starts.get(name, {}).get("peer_id"), "shard": starts.get(name, {}).get("shard"),
             "exit_code": exit_codes.get(name), "rounds": per_peer.get(name, 0)}
            for name in logs
        ],
        "rounds_completed": min((last_hash.get(name, (0, ""))[0] for name in finishers), default=0),
        "rounds": rounds,
        "outcomes": dict(Counter(r["outcome"] for r in rounds)),
        "eval_loss_first": next(iter(starts.values()))["eval_loss"] if starts else None,
        "eval_loss_last": sum(final_evals) / len(final_evals) if final_evals else None,
        "tokens_total": sum(r["tokens"] for r in rounds),
        "wall_seconds": wall_seconds,
        "compute_seconds": sum(r["compute_seconds"] for r in rounds),
        "param_sha256": hashes,
        "replicas_identical": bool(hashes) and same_round and len(set(hashes.values())) == 1
        and len(hashes) == len(finishers),
    }


def format_table(summary: dict) -> str:
    """One line per outer round: how many peers averaged, group sizes, inner steps (fewest-most: rounds bounded by
    time give a slower peer fewer), eval loss, time, traffic, identity."""
    by_round: dict[int, list[dict]] = {}
    for r in summary["rounds"]:
        by_round.setdefault(r["round"], []).append(r)
    lines = [f"{'round':>5} {'averaged':>9} {'groups':>8} {'steps':>7} {'eval loss':>9} {'all-reduce s':>12} "
             f"{'MB/peer':>8} {'identical':>9}"]
    for rnd in sorted(by_round):
        rows = by_round[rnd]
        averaged = sum(r["outcome"] == "averaged" for r in rows)
        groups = "/".join(str(g) for g in sorted({r["group_size"] for r in rows}))
        fewest, most = min(r.get("inner_steps", 0) for r in rows), max(r.get("inner_steps", 0) for r in rows)
        steps = f"{most}" if fewest == most else f"{fewest}-{most}"
        evals = [r["eval_loss"] for r in rows if r["eval_loss"] is not None]
        eval_loss = sum(evals) / len(evals) if evals else float("nan")
        seconds = max(r["allreduce_seconds"] for r in rows)
        mb = sum(r["bytes_sent"] + r["bytes_received"] for r in rows) / len(rows) / 1e6
        identical = "yes" if len({r["param_sha256"] for r in rows}) == 1 else "NO"
        lines.append(f"{rnd:>5} {averaged:>5}/{len(rows):<3} {groups:>8} {steps:>7} {eval_loss:>9.4f} {seconds:>12.2f} "
                     f"{mb:>8.2f} {identical:>9}")
    s = summary
    first = s["eval_loss_first"]
    last = s["eval_loss_last"]
    lines.append(
        f"{len(s['peers'])} peers, {s['rounds_completed']} rounds, outcomes {s['outcomes']}, "
        f"eval loss {first:.4f} -> {last:.4f}, {s['tokens_total']:,} tokens, "
        f"{s['wall_seconds']:.0f}s wall ({s['compute_seconds']:.0f}s compute summed over peers), "
        f"replicas identical: {s['replicas_identical']}" if first is not None and last is not None
        else f"{len(s['peers'])} peers, no completed round"
    )
    return "\n".join(lines)


def plot_losses(logs: dict[str, Path], png: Path) -> Path:
    """Three panels into one PNG: train loss vs tokens, eval loss vs outer round (per peer), and each
    peer's inner-step throughput (tokens/s) over wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_eval, ax_speed) = plt.subplots(1, 3, figsize=(15, 4))
    t0 = min((e["time"] for path in logs.values() for e in read_events(path)), default=0.0)
    for name, path in logs.items():
        tokens = 0
        train_x = []
        train_y = []
        eval_x = []
        eval_y = []
        speed_x = []
        speed_y = []
        for event in read_events(path):
            if event["event"] == "start":
                eval_x.append(event.get("epoch", 0))
                eval_y.append(event["eval_loss"])
            elif event["event"] == "progress":
                tokens += event["tokens"]
                train_x.append(tokens)
                train_y.append(event["loss"])
                speed_x.append(event["time"] - t0)
                speed_y.append(event["tokens_per_second"])
            elif event["event"] == "round" and event.get("eval_loss") is not None:
                eval_x.append(event["round"])
                eval_y.append(event["eval_loss"])
        ax_train.plot(train_x, train_y, label=name, linewidth=1)
        ax_eval.plot(eval_x, eval_y, marker="o", label=name, linewidth=1)
        ax_speed.plot(speed_x, speed_y, label=name, linewidth=1)
    ax_train.set(xlabel="tokens processed by the peer", ylabel="train loss", title="inner steps")
    ax_eval.set(xlabel="outer round", ylabel="eval loss (held-out)", title="after each outer step")
    ax_speed.set(xlabel="seconds since the first event", ylabel="tokens/s", title="inner-step throughput")
    for ax in (ax_train, ax_eval, ax_speed):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, png)


def save_figure(fig, png: Path) -> Path:
    """Lay out a matplotlib figure, write it (creating the folder) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def find_logs(paths: list[str]) -> dict[str, Path]:
    """Event logs named by the arguments: ``.jsonl`` files, or every ``*.jsonl`` in a directory."""
    logs = {}
    for arg in paths:
        path = Path(arg)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"))
            if not found:
                raise FileNotFoundError(f"no event logs (*.jsonl) in {path}: give a peer's runs/ directory or files")
            logs.update({p.stem: p for p in found})
        elif path.is_file():
            logs[path.stem] = path
        else:
            raise FileNotFoundError(f"{path} does not exist: give event logs (runs/<peer>.jsonl) or their directory")
    return logs
