"""Per-peer Prometheus metrics: fed by the event log, named by Prometheus' conventions, served over HTTP."""

import socket
import subprocess

import pytest
from conftest import diloco_cmd, require_tool
from helpers import GOOD_ADDR
from prometheus_client.parser import text_string_to_metric_families

from diloco_peer.observe.metrics import PeerMetrics
from diloco_peer.swarm.progress_record import PeerStats

START = {"event": "start", "time": 100.0, "peer": "p0", "peer_id": "12D3KooWtest", "fingerprint": "abc", "epoch": 0,
         "eval_loss": 5.2}
PROGRESS = {"event": "progress", "time": 101.0, "peer": "p0", "epoch": 0, "inner_step": 5, "steps": 5,
            "seconds": 0.5, "loss": 4.0, "lr": 1e-3, "tokens": 5120, "tokens_per_second": 10240.0}
ROUND = {"event": "round", "time": 103.0, "peer": "p0", "round": 1, "epoch": 0, "outcome": "averaged",
         "group_size": 3, "wait_seconds": 0.25, "allreduce_seconds": 1.5, "bytes_sent": 1000, "bytes_received": 3000,
         "bytes_relayed": 2500, "values_not_averaged": 0, "train_loss": 3.9, "eval_loss": 3.5, "inner_lr": 9e-4,
         "outer_lr": 0.7}


def _value(metrics, metric, /, **labels):
    return metrics.registry.get_sample_value(metric, labels)


def test_a_partial_round_is_counted_as_its_own_outcome():
    """Averaged, but a reducer failed mid-round: some values kept their own (the peer then re-syncs)."""
    m = PeerMetrics()
    m.observe({**ROUND, "outcome": "partial", "values_not_averaged": 4096})
    assert _value(m, "diloco_outer_rounds_total", outcome="partial") == 1
    assert _value(m, "diloco_outer_rounds_total", outcome="averaged") == 0
    assert _value(m, "diloco_values_not_averaged_total") == 4096
    assert _value(m, "diloco_allreduce_duration_seconds_count") == 1


def test_a_round_handed_in_keeps_the_last_eval_loss():
    """A peer that handed its pseudo-gradient in does not evaluate (its group does, on the same weights): its round
    event has no eval loss, and the gauge and the loss its record publishes stay at the last one measured."""
    m = PeerMetrics()
    m.observe(ROUND)
    handed_in = {key: value for key, value in ROUND.items() if key != "eval_loss"}
    m.observe({**handed_in, "round": 2, "train_loss": 3.7, "time": 110.0})
    assert _value(m, "diloco_eval_loss") == 3.5 and _value(m, "diloco_outer_rounds_total", outcome="averaged") == 2
    assert m.swarm_stats()["eval_loss"] == 3.5 and m.swarm_stats()["train_loss"] == 3.7


def test_events_drive_the_metrics():
    m = PeerMetrics()
    assert _value(m, "diloco_outer_rounds_total", outcome="solo") == 0  # labelled counters exist from the start
    for event in ({"event": "reachability", "time": 99.0, "mode": "relayed", "detail": "", "relays": 2},
                  START, PROGRESS, PROGRESS, ROUND,
                  {**ROUND, "round": 2, "outcome": "solo", "group_size": 1, "allreduce_seconds": 0.0, "bytes_sent": 0,
                   "bytes_relayed": 0, "bytes_received": 0, "time": 110.0},
                  {"event": "sync", "time": 111.0, "ok": True, "epoch": 5, "seconds": 0.4, "bytes": 2_000_000},
                  {"event": "sync", "time": 112.0, "ok": False, "epoch": 5, "seconds": 5.0, "bytes": 0},
                  {"event": "serve", "time": 113.0, "epoch": 5, "bytes": 2_500_000},
                  {"event": "checkpoint", "time": 114.0, "epoch": 5, "seconds": 0.08, "bytes": 6_000_000},
                  {"event": "handed_in", "time": 114.5, "peer": "p0", "epoch": 5, "proxy": "12D3KooWfast",
                   "seconds": 0.3},
                  {"event": "no-such-event", "time": 115.0}):
        m.observe(event)
    assert _value(m, "diloco_tokens_total") == 10240 and _value(m, "diloco_inner_steps_total") == 10
    assert _value(m, "diloco_outer_rounds_total", outcome="averaged") == 1
    assert _value(m, "diloco_outer_rounds_total", outcome="solo") == 1
    assert _value(m, "diloco_outer_rounds_total", outcome="failed") == 0
    assert _value(m, "diloco_outer_rounds_total", outcome="partial") == 0
    assert _value(m, "diloco_outer_epoch") == 5  # the sync moved us to epoch 5
    assert _value(m, "diloco_eval_loss") == 3.5 and _value(m, "diloco_train_loss") == 4.0
    assert _value(m, "diloco_group_size") == 1 and _value(m, "diloco_outer_learning_rate") == 0.7
    assert _value(m, "diloco_allreduce_duration_seconds_count") == 1  # solo rounds have no all-reduce
    assert _value(m, "diloco_allreduce_duration_seconds_bucket", le="2.5") == 1
    assert _value(m, "diloco_allreduce_duration_seconds_bucket", le="1.0") == 0
    assert _value(m, "diloco_sent_bytes_total", kind="pseudo_gradient") == 1000
    assert _value(m, "diloco_received_bytes_total", kind="pseudo_gradient") == 3000
    assert _value(m, "diloco_received_bytes_total", kind="state_sync") == 2_000_000
    assert _value(m, "diloco_sent_bytes_total", kind="state_sync") == 2_500_000
    assert _value(m, "diloco_phase_seconds_total", phase="compute") == 1.0
    assert _value(m, "diloco_phase_seconds_total", phase="waiting") == 0.5
    assert _value(m, "diloco_phase_seconds_total", phase="communication") == pytest.approx(1.5 + 0.4 + 5.0)
    assert _value(m, "diloco_state_syncs_total", result="ok") == _value(m, "diloco_state_syncs_total",
                                                                        result="failed") == 1
    assert _value(m, "diloco_checkpoint_duration_seconds_count") == 1
    assert _value(m, "diloco_hand_ins_total") == 1
    assert _value(m, "diloco_last_outer_step_timestamp_seconds") == 110.0
    assert _value(m, "diloco_peer_info", peer_id="12D3KooWtest", name="p0", fingerprint="abc") == 1
    assert m.status == {"status": "training", "epoch": 5, "last_outer_step": 110.0}
    assert _value(m, "diloco_reachability", mode="relayed") == 1 and _value(m, "diloco_relays_held") == 2
    assert _value(m, "diloco_reachability", mode="direct") == 0
    assert _value(m, "diloco_reachability", mode="outbound-only") == 0
    assert _value(m, "diloco_relayed_bytes_total") == 2500
    assert m.swarm_stats() == {"name": "p0", "state": "training", "reach": "relayed", "tokens_per_second": 10240.0,
                               "train_loss": 3.9,
                               "eval_loss": 3.5, "rounds_averaged": 1, "rounds_solo": 1, "rounds_failed": 0,
                               "rounds_partial": 0}
    m.observe({"event": "stop", "time": 120.0})
    assert _value(m, "diloco_peer_up") == 0 and m.status["status"] == "leaving"
    assert m.swarm_stats()["state"] == "leaving"
    # a diverged replica's losses go to the record as unknown: its schema refuses NaN (a peer crashed on it)
    m._last.update(train_loss=float("nan"), eval_loss=float("inf"))
    stats = m.swarm_stats()
    assert stats["train_loss"] is None and stats["eval_loss"] is None
    PeerStats(**stats)


def test_a_topk_round_says_the_density_its_peer_asked_for():
    m = PeerMetrics()
    m.observe(ROUND)
    assert _value(m, "diloco_topk_density") == 0  # (another codec: never set)
    m.observe({**ROUND, "round": 2, "density": 0.0125})
    assert _value(m, "diloco_topk_density") == 0.0125


def test_overlapped_rounds_count_only_the_wait_as_communication_time():
    m = PeerMetrics()
    for event in (START, PROGRESS, {**ROUND, "overlap_wait_seconds": 0.125}):
        m.observe(event)
    # the gate and the all-reduce (0.25 s + 1.5 s) ran while training went on: not time lost
    assert _value(m, "diloco_phase_seconds_total", phase="communication") == 0.125
    assert _value(m, "diloco_phase_seconds_total", phase="waiting") == 0
    assert _value(m, "diloco_allreduce_duration_seconds_count") == 1


def test_metric_names_follow_prometheus_conventions():
    m = PeerMetrics()
    for event in (START, PROGRESS, ROUND):
        m.observe(event)
    text = m.exposition().decode()
    families = list(text_string_to_metric_families(text))
    ours = [f for f in families if f.name.startswith("diloco_")]
    assert len(ours) >= 20 and len(ours) == len(families)  # one prefix, nothing else in the registry
    for family in ours:
        assert ":" not in family.name and family.documentation, family.name
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples), family.name
        labels = {k for s in family.samples for k in s.labels}
        assert "peer_id" not in labels or family.name == "diloco_peer_info", family.name  # high cardinality: info only
    require_tool("promtool", "prometheus")
    lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr


# A running peer's /healthz and /metrics over HTTP, and its server gone after it left: in
# test_dashboards.py's real swarm, which serves the dashboards' Prometheus too (one swarm for both).


def test_a_busy_metrics_port_is_a_one_line_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            diloco_cmd("join", GOOD_ADDR, "--set", f"metrics.port={port}", "--set", "swarm.join_timeout=0"),
            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and f"metrics.port={port}" in errors[0] and "pick a free port" in errors[0], errors
