"""Prometheus metrics of one peer, on ``/metrics``, with ``/healthz`` beside them.

    diloco-peer join <bootstrap> --set metrics.port=9101     # then: curl localhost:9101/metrics

The metrics are fed by the peer's event log (``events.py``): every event the daemon writes (``start``,
``progress``, ``round``, ``sync``, ``serve``, ``checkpoint``, ``stop``) updates them, so the JSONL log and
the metrics can never disagree, and the training loop has no metrics code in it.

Names follow Prometheus' conventions: one ``diloco_`` prefix, base units (seconds, bytes), ``_total`` on
counters, labels of low cardinality only (the peer id is a label of ``diloco_peer_info`` alone).
Labelled counters start at 0, so that ``rate()`` sees their first increment. Useful expressions:

- compute utilization: ``rate(diloco_phase_seconds_total{phase="compute"}[5m])`` (seconds per second);
- stalled peers: ``time() - diloco_last_outer_step_timestamp_seconds > 600``;
- swarm throughput: ``sum(rate(diloco_tokens_total[5m]))``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from .. import __version__
from ..averaging.robust_aggregation import OFFENSE_KINDS
from ..swarm.progress_record import MAX_LOSS
from ..config import ConfigError, MetricsConfig
from ..swarm.reachability import MODES

if TYPE_CHECKING:
    from .monitor import SwarmMonitor

logger = logging.getLogger(__name__)

ROUND_OUTCOMES = ("averaged", "partial", "solo", "failed")
ROUNDS_HELP = ("Outer rounds by outcome: averaged with a group, partial (averaged, but a reducer failed: some values "
               "were not; rechecked against the others' state), solo (nobody else ready), failed (the all-reduce "
               "broke or its average was refused)")
TRAFFIC_KINDS = ("pseudo_gradient", "state_sync")
PHASES = ("compute", "communication", "waiting")
ALLREDUCE_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
SYNC_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)


class PeerMetrics:
    """The metrics of one peer in their own registry (several peers may live in one test process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        Info("diloco_build", "Version of diloco-peer", registry=r).info({"version": __version__})
        self.peer = Info("diloco_peer", "Who this peer is: peer id, name, config fingerprint", registry=r)
        self.tokens = Counter("diloco_tokens", "Training tokens processed by inner steps", registry=r)
        self.inner_steps = Counter("diloco_inner_steps", "Inner optimizer steps taken", registry=r)
        self.rounds = Counter("diloco_outer_rounds", ROUNDS_HELP, ["outcome"], registry=r)
        self.epoch = Gauge("diloco_outer_epoch", "Outer epoch of this peer's weights", registry=r)
        self.train_loss = Gauge("diloco_train_loss", "Mean training loss of the last inner steps", registry=r)
        self.eval_loss = Gauge("diloco_eval_loss", "Held-out loss of the outer weights after the last round",
                               registry=r)
        self.inner_lr = Gauge("diloco_inner_learning_rate", "Current inner (AdamW) learning rate", registry=r)
        self.outer_lr = Gauge("diloco_outer_learning_rate", "Outer (Nesterov SGD) learning rate", registry=r)
        self.group_size = Gauge("diloco_group_size", "Peers in the last round's all-reduce group (1: solo)",
                                registry=r)
        self.round_steps = Gauge("diloco_round_inner_steps", "Inner steps this peer trained in its last round (rounds "
                                 "bounded by time: fewer than H on a slower device)", registry=r)
        self.density = Gauge("diloco_topk_density", "topk: the share of each chunk this peer asked its group to send "
                             "in its last round, fitted to its link", registry=r)
        self.allreduce = Histogram("diloco_allreduce_duration_seconds", "Matchmaking + all-reduce of a round",
                                   buckets=ALLREDUCE_BUCKETS, registry=r)
        self.not_averaged = Counter("diloco_values_not_averaged", "Pseudo-gradient values a failed reducer left "
                                    "un-averaged (the peer re-syncs after such a round)", registry=r)
        self.sent = Counter("diloco_sent_bytes", "Payload bytes sent, by kind", ["kind"], registry=r)
        self.received = Counter("diloco_received_bytes", "Payload bytes received, by kind", ["kind"], registry=r)
        self.phase = Counter("diloco_phase_seconds", "Wall time by phase: compute (inner steps), communication "
                             "(all-reduce, state sync), waiting (for peers at the round gate)", ["phase"], registry=r)
        self.syncs = Counter("diloco_state_syncs", "State downloads from peers, by result", ["result"], registry=r)
        self.sync_duration = Histogram("diloco_state_sync_duration_seconds", "Duration of a state download",
                                       buckets=SYNC_BUCKETS, registry=r)
        self.checkpoint_duration = Histogram("diloco_checkpoint_duration_seconds", "Time to write a checkpoint",
                                             buckets=CHECKPOINT_BUCKETS, registry=r)
        self.last_checkpoint = Gauge("diloco_last_checkpoint_timestamp_seconds", "When the newest checkpoint was "
                                     "written (unix time)", registry=r)
        self.last_outer_step = Gauge("diloco_last_outer_step_timestamp_seconds", "When the last outer step was "
                                     "taken (unix time); for stall alerts", registry=r)
        self.up = Gauge("diloco_peer_up", "1 while the peer trains, 0 once it is leaving", registry=r)
        self.rejected = Counter("diloco_rejected_contributions", "Contributions of other peers refused, by why: "
                                "malformed, shape, non_finite, weight, norm, direction, unadmitted, state",
                                ["kind"], registry=r)
        self.bans = Counter("diloco_peer_bans", "Peers banned for repeated offenses", registry=r)
        self.hand_ins = Counter("diloco_hand_ins", "Rounds this peer handed its pseudo-gradient in to a faster peer "
                                "instead of joining the all-reduce (too slow for it: averaging/hand_in.py)", registry=r)
        self.reachability = Gauge("diloco_reachability", "1 for how other peers reach this one now: direct, relayed "
                                  "(through a relay), outbound-only (not at all; client mode)", ["mode"], registry=r)
        self.relays = Gauge("diloco_relays_held", "Relays that carry this peer now (relayed mode)", registry=r)
        self.relayed = Counter("diloco_relayed_bytes", "All-reduce payload bytes exchanged with peers over relayed "
                               "connections (sent + received)", registry=r)
        self.status = {"status": "joining", "epoch": 0, "last_outer_step": None}
        """What ``/healthz`` reports; "training" between the ``start`` and ``stop`` events."""
        self.name = ""
        self.state = "joining"
        self.tokens_per_second = 0.0
        self._last = {"train_loss": None, "eval_loss": None}
        self._rounds = dict.fromkeys(ROUND_OUTCOMES, 0)
        self.reach = "unknown"
        self._zero_labelled_counters()

    def _zero_labelled_counters(self) -> None:
        """Every label of every labelled counter exists from the start, at 0: ``rate()`` sees the first increment."""
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome)
        for kind in TRAFFIC_KINDS:
            self.sent.labels(kind)
            self.received.labels(kind)
        for phase in PHASES:
            self.phase.labels(phase)
        for result in ("ok", "failed"):
            self.syncs.labels(result)
        for kind in OFFENSE_KINDS:
            self.rejected.labels(kind)

    def observe(self, event: dict) -> None:
        """Update the metrics from one event-log entry (unknown events are ignored)."""
        handler = getattr(self, f"_on_{event.get('event')}", None)
        if handler is not None:
            handler(event)

    def swarm_stats(self) -> dict:
        """The ``PeerStats`` fields the progress record carries to the swarm monitor. A loss the record's schema
        cannot carry (NaN, inf: a replica that diverged) goes as unknown: publishing the record must not fail."""
        losses = {k: v if v is not None and math.isfinite(v) and 0 <= v <= MAX_LOSS else None
                  for k, v in self._last.items()}
        return {"name": self.name, "state": self.state, "reach": self.reach,
                "tokens_per_second": float(self.tokens_per_second),
                **losses, **{f"rounds_{outcome}": n for outcome, n in self._rounds.items()}}

    def _on_reachability(self, e: dict) -> None:
        for mode in MODES:
            self.reachability.labels(mode).set(1 if mode == e["mode"] else 0)
        self.relays.set(e["relays"])
        self.reach = e["mode"]

    def _on_start(self, e: dict) -> None:
        self.peer.info({"peer_id": e["peer_id"], "name": e["peer"], "fingerprint": e["fingerprint"]})
        self.epoch.set(e["epoch"])
        self.eval_loss.set(e["eval_loss"])
        self.up.set(1)
        self.status.update(status="training", epoch=e["epoch"])
        self.name = e["peer"]
        self.state = "training"
        self._last["eval_loss"] = e["eval_loss"]

    def _on_progress(self, e: dict) -> None:
        self.tokens.inc(e["tokens"])
        self.inner_steps.inc(e["steps"])
        self.phase.labels("compute").inc(e["seconds"])
        self.train_loss.set(e["loss"])
        self.inner_lr.set(e["lr"])
        self.state = "training"
        self.tokens_per_second = e["tokens_per_second"]
        self._last["train_loss"] = e["loss"]

    def _on_averaging(self, e: dict) -> None:
        self.state = "averaging"

    def _on_round(self, e: dict) -> None:
        self.rounds.labels(e["outcome"]).inc()
        self._rounds[e["outcome"]] += 1
        self.state = "training"
        self._last["train_loss"] = e["train_loss"]
        if e.get("eval_loss") is not None:  # (absent: the peer handed in, its group evaluated: the last one stands)
            self._last["eval_loss"] = e["eval_loss"]
            self.eval_loss.set(e["eval_loss"])
        self.epoch.set(e["round"])
        self.outer_lr.set(e["outer_lr"])
        self.inner_lr.set(e["inner_lr"])
        self.group_size.set(e["group_size"])
        self.round_steps.set(e.get("inner_steps", 0))
        if "density" in e:
            self.density.set(e["density"])
        if e["outcome"] != "solo":
            self.allreduce.observe(e["allreduce_seconds"])
        self.not_averaged.inc(e["values_not_averaged"])
        self.sent.labels("pseudo_gradient").inc(e["bytes_sent"])
        self.received.labels("pseudo_gradient").inc(e["bytes_received"])
        self.relayed.inc(e.get("bytes_relayed", 0))
        if "overlap_wait_seconds" in e:
            # overlapped rounds: the gate and the all-reduce ran while the next round trained; training only
            # stood still while the round's end waited for that average
            self.phase.labels("communication").inc(e["overlap_wait_seconds"])
        else:
            self.phase.labels("communication").inc(e["allreduce_seconds"])
            self.phase.labels("waiting").inc(e["wait_seconds"])
        self.last_outer_step.set(e["time"])
        self.status.update(epoch=e["round"], last_outer_step=e["time"])

    def _on_sync(self, e: dict) -> None:
        self.syncs.labels("ok" if e["ok"] else "failed").inc()
        self.sync_duration.observe(e["seconds"])
        self.received.labels("state_sync").inc(e["bytes"])
        self.phase.labels("communication").inc(e["seconds"])
        if e["ok"]:
            self.epoch.set(e["epoch"])
            self.status.update(epoch=e["epoch"])

    def _on_serve(self, e: dict) -> None:
        self.sent.labels("state_sync").inc(e["bytes"])

    def _on_checkpoint(self, e: dict) -> None:
        self.checkpoint_duration.observe(e["seconds"])
        self.last_checkpoint.set(e["time"])

    def _on_offense(self, e: dict) -> None:
        self.rejected.labels(e["kind"]).inc()
        if e["banned"]:
            self.bans.inc()

    def _on_handed_in(self, e: dict) -> None:
        self.hand_ins.inc()

    def _on_stop(self, e: dict) -> None:
        self.up.set(0)
        self.status.update(status="leaving")
        self.state = "leaving"

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class MetricsServer:
    """Serves ``/metrics`` (Prometheus text format) and ``/healthz`` from a background thread, for a peer
    (``PeerMetrics``) or a bootstrap node (``monitor.SwarmMonitor``, healthy while it serves).

    ``/healthz`` answers 200 with a small JSON status while the peer trains (between its ``start`` and
    ``stop`` events) and 503 while it is still joining or already leaving, so that an orchestrator
    (compose healthcheck, Kubernetes probe) can tell a peer that works from one that does not yet.
    """

    HEALTHY = ("training", "serving")

    def __init__(self, source: PeerMetrics | SwarmMonitor, cfg: MetricsConfig):
        self.source = source
        handler = _handler_for(source)
        try:
            self.httpd = ThreadingHTTPServer((cfg.host, cfg.port), handler)
        except OSError as e:
            raise ConfigError(f"metrics.port={cfg.port} on {cfg.host} cannot be used ({e.strerror}): pick a free "
                              f"port, or 0 to serve no metrics") from None
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()
        logger.info(f"metrics on http://{cfg.host}:{self.port}/metrics (health: /healthz)")

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _handler_for(source: PeerMetrics | SwarmMonitor):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's naming)
            path = self.path.split("?")[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, source.exposition())
            elif path == "/healthz":
                status = {**source.status, "time": time.time()}
                code = 200 if status["status"] in MetricsServer.HEALTHY else 503
                self._send(code, "application/json", json.dumps(status).encode())
            else:
                self._send(404, "text/plain", b"not found: try /metrics or /healthz\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # scrapes every few seconds would flood the peer's log
            pass

    return Handler
