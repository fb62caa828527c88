"""Reading the peers' event logs back (``observe/report.py``): the demo's summary, its table and the loss plots."""

from diloco_peer.observe.events import EventLog
from diloco_peer.observe.report import format_table, plot_losses, summarize

ROUND = {"event": "round", "round": 1, "group_size": 2, "outcome": "averaged", "allreduce_seconds": 0.2,
         "bytes_sent": 1000, "bytes_received": 1000, "train_loss": 3.9, "tokens": 2048, "compute_seconds": 1.0,
         "values_not_averaged": 0, "error": "", "param_sha256": "ab", "inner_steps": 2}


def _log(path, *events):
    log = EventLog(path)  # (as a peer writes its events)
    for e in events:
        log.write(e["event"], peer=path.stem, **{k: v for k, v in e.items() if k != "event"})
    log.close()
    return path


def test_a_peer_that_handed_in_counts_in_every_figure_but_the_eval_loss(tmp_path):
    """A round a peer handed in has no eval loss (its group evaluates the same weights): the summary, the table and
    the plot take the eval loss from the peers that have one, and the rest from everyone."""
    start = {"event": "start", "peer_id": "12D3KooW", "shard": 0, "eval_loss": 5.0, "epoch": 0}
    logs = {"fast": _log(tmp_path / "fast.jsonl", start, {**ROUND, "eval_loss": 3.5},
                         {**ROUND, "round": 2, "eval_loss": 3.0, "param_sha256": "cd"}),
            "slow": _log(tmp_path / "slow.jsonl", start, ROUND, {**ROUND, "round": 2, "param_sha256": "cd"})}
    summary = summarize(logs, wall_seconds=10.0, exit_codes={"fast": 0, "slow": 0})
    assert summary["eval_loss_last"] == 3.0 and summary["tokens_total"] == 4 * 2048
    assert [r["eval_loss"] for r in summary["rounds"] if r["peer"] == "slow"] == [None, None]
    table = format_table(summary).splitlines()
    assert len(table) >= 3 and "3.5000" in table[1] and "3.0000" in table[2], table
    assert plot_losses(logs, tmp_path / "plot.png").stat().st_size > 1000
    alone = summarize({"slow": logs["slow"]}, wall_seconds=10.0, exit_codes={"slow": 0})
    assert alone["eval_loss_last"] is None and "nan" in format_table(alone).splitlines()[1]
