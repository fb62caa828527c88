"""The swarm as a whole, read from the DHT: nobody has to scrape the volunteers.

Every peer's signed progress record (``swarm/progress.py``) carries a small ``PeerStats`` block (name, state,
throughput, losses, round counts), refreshed with each heartbeat. This module turns the live records into

- Prometheus gauges on the bootstrap node (``diloco-peer bootstrap --metrics-port 9100``): peers alive
  and by state, the swarm's epoch, tokens/s, mean losses, joins and leaves;
- the table of ``diloco-peer status <bootstrap>``, for people without Grafana.

Volunteers behind NAT cannot be scraped by a central Prometheus, but they can always write to the DHT;
this is the pattern of hivemind's training monitor. A record with a forged signature or a wrong shape is
rejected by the DHT's validators before it gets here.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, generate_latest

from .. import __version__
from ..state.target import swarm_target
from ..swarm.quorum import quorum_epoch
from ..swarm.progress_record import ProgressRecord
from ..swarm.reachability import MODES

STATES = ("joining", "training", "waiting", "averaging", "leaving")


def peer_state(record: ProgressRecord) -> str:
    """``waiting`` is a peer done with its inner steps, at the round gate; the rest the peer says itself."""
    said = record.stats.state if record.stats is not None else "training"
    return "waiting" if record.ready and said == "training" else said


@dataclass
class SwarmSummary:
    peers: int = 0
    by_state: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATES, 0))
    epoch: int = 0
    """The swarm's outer epoch by quorum (as state sync picks it: one peer claiming a later one does not move
    it), i.e. rounds completed."""
    tokens: int = 0
    tokens_per_second: float = 0.0
    train_loss: float | None = None
    eval_loss: float | None = None
    rows: list[dict] = field(default_factory=list)


def summarize(records: list[ProgressRecord], now: float | None = None) -> SwarmSummary:
    now = time.time() if now is None else now
    summary = SwarmSummary(peers=len(records))
    target = swarm_target(records)
    summary.epoch = target.epoch if target is not None else quorum_epoch(records) or 0
    for r in sorted(records, key=lambda r: (r.stats.name if r.stats else "", r.peer_id)):
        state = peer_state(r)
        summary.by_state[state] += 1
        summary.tokens += r.tokens
        s = r.stats
        summary.rows.append({
            "name": s.name if s else "", "peer_id": r.peer_id, "state": state, "epoch": r.epoch,
            "reach": s.reach if s else "unknown",
            "tokens_per_second": s.tokens_per_second if s else 0.0, "train_loss": s.train_loss if s else None,
            "eval_loss": s.eval_loss if s else None, "rounds_averaged": s.rounds_averaged if s else 0,
            "rounds_solo": s.rounds_solo if s else 0, "rounds_failed": s.rounds_failed if s else 0,
            "rounds_partial": s.rounds_partial if s else 0,
            "seen_seconds_ago": max(0.0, now - r.time),
        })
    training = [row for row in summary.rows if row["state"] != "leaving"]
    summary.tokens_per_second = sum(row["tokens_per_second"] for row in training)
    for key in ("train_loss", "eval_loss"):
        values = [row[key] for row in training if row[key] is not None]
        setattr(summary, key, statistics.fmean(values) if values else None)
    return summary


class SwarmMonitor:
    """Swarm-wide Prometheus gauges, refreshed by ``update`` from the live records."""

    def __init__(self, run_id: str):
        r = self.registry = CollectorRegistry()
        Info("diloco_build", "Version of diloco-peer", registry=r).info({"version": __version__})
        Info("diloco_swarm", "The run this node watches", registry=r).info({"run_id": run_id})
        self.peers = Gauge("diloco_swarm_peers", "Peers with a live progress record", registry=r)
        self.by_state = Gauge("diloco_swarm_peers_by_state", "Live peers by state", ["state"], registry=r)
        self.epoch = Gauge("diloco_swarm_epoch", "The swarm's outer epoch (rounds completed)", registry=r)
        self.tokens = Gauge("diloco_swarm_tokens", "Tokens trained by the live peers", registry=r)
        self.tps = Gauge("diloco_swarm_tokens_per_second", "Inner-step throughput of all live peers", registry=r)
        self.train_loss = Gauge("diloco_swarm_train_loss", "Mean training loss over live peers", registry=r)
        self.eval_loss = Gauge("diloco_swarm_eval_loss", "Mean eval loss over live peers", registry=r)
        self.joins = Counter("diloco_swarm_joins", "Peers that appeared in the swarm", registry=r)
        self.leaves = Counter("diloco_swarm_leaves", "Peers that left or vanished", registry=r)
        self.updated = Gauge("diloco_swarm_last_update_timestamp_seconds", "When the records were last read",
                             registry=r)
        for state in STATES:
            self.by_state.labels(state)
        self.by_reach = Gauge("diloco_swarm_peers_by_reachability", "Live peers by how others reach them: direct, "
                              "relayed, outbound-only, unknown (older peers)", ["mode"], registry=r)
        self.status = {"status": "serving", "epoch": 0, "peers": 0}
        """What ``/healthz`` reports (see ``metrics.MetricsServer``)."""
        self._known: set[str] | None = None

    def update(self, records: list[ProgressRecord]) -> SwarmSummary:
        summary = summarize(records)
        self.peers.set(summary.peers)
        for state, n in summary.by_state.items():
            self.by_state.labels(state).set(n)
        for mode in (*MODES, "unknown"):
            self.by_reach.labels(mode).set(sum(row["reach"] == mode for row in summary.rows))
        self.epoch.set(summary.epoch)
        self.tokens.set(summary.tokens)
        self.tps.set(summary.tokens_per_second)
        for gauge, value in ((self.train_loss, summary.train_loss), (self.eval_loss, summary.eval_loss)):
            gauge.set(value if value is not None else float("nan"))
        ids = {r.peer_id for r in records}
        if self._known is not None:  # the first look is a census, not a wave of joins
            self.joins.inc(len(ids - self._known))
            self.leaves.inc(len(self._known - ids))
        self._known = ids
        self.updated.set(time.time())
        self.status.update(epoch=summary.epoch, peers=summary.peers)
        return summary

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_status(summary: SwarmSummary, run_id: str) -> str:
    """The swarm as a table: one line per peer, then the totals."""
    states = ", ".join(f"{n} {s}" for s, n in summary.by_state.items() if n)
    lines = [f"run '{run_id}': {summary.peers} peers ({states or 'none'}), epoch {summary.epoch}, "
             f"{summary.tokens_per_second:,.0f} tok/s, mean eval loss {_fmt(summary.eval_loss, '.4f')}"]
    if summary.rows:
        lines.append(f"{'peer':<16} {'id':<10} {'state':<10} {'reach':<13} {'epoch':>6} {'tok/s':>9} {'train':>7} "
                     f"{'eval':>7} {'avg/part/solo/fail':>18} {'seen':>6}")
        for row in summary.rows:
            rounds = f"{row['rounds_averaged']}/{row['rounds_partial']}/{row['rounds_solo']}/{row['rounds_failed']}"
            lines.append(f"{row['name'][:16]:<16} {row['peer_id'][-8:]:<10} {row['state']:<10} {row['reach']:<13} "
                         f"{row['epoch']:>6} "
                         f"{row['tokens_per_second']:>9,.0f} {_fmt(row['train_loss'], '7.3f'):>7} "
                         f"{_fmt(row['eval_loss'], '7.3f'):>7} {rounds:>18} {row['seen_seconds_ago']:>5.0f}s")
    return "\n".join(lines)


def status_json(summary: SwarmSummary, run_id: str) -> str:
    return json.dumps({"run_id": run_id, **asdict(summary)}, indent=2)
