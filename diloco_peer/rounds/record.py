"""What one outer round produces: its inner steps' numbers and the record the event log keeps.

``outer_rounds.OuterRounds`` fills these in; the daemon hands each ``RoundRecord`` to the event log, whose
``round`` events the metrics, the reports and the benchmarks read.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class InnerResult:
    """What a round's inner steps did."""

    steps: int
    tokens: int
    compute_seconds: float
    train_loss: float
    """Mean training loss over the round's steps."""
    late_seconds: float = 0.0
    """Seconds cut from the round's training: we began it after the round's first peer (``Pace.late``)."""
    budget_seconds: float | None = None
    """Rounds bounded by time: the seconds of training the round was planned for (``Pace.budget``); None: H steps."""


@dataclass
class RoundRecord:
    """One finished round: the ``round`` event of the event log (metrics and reports read it)."""

    peer: str
    round: int
    epoch: int
    outcome: str
    """``averaged`` with a group; ``partial``: averaged, but a reducer failed mid-round and part of our vector kept
    its own values (rechecked once the others have stepped, ``Healing.recheck_after_round``: it syncs only if its
    state is not the one most of the round's peers hold); ``failed``: a group was expected or formed and its average
    was not had, or was refused; ``solo``: nobody to average with (``outcome.decide``)."""
    group_size: int
    group_epochs: list[int]
    ready_peers: int
    alive_peers: int
    expected_peers: int
    """The live peers the round gate counted, less those too slow to wait for (``Pace.too_slow``): the group it
    expected, unless it left stragglers behind."""
    wait_seconds: float
    allreduce_seconds: float
    transfer_seconds: float
    bytes_sent: int
    bytes_received: int
    bytes_relayed: int
    values_not_averaged: int
    error: str
    tokens: int
    compute_seconds: float
    train_loss: float
    eval_loss: float | None
    """The outer weights' loss over the eval windows after the round; None (absent from the event): not evaluated,
    since the peer handed its pseudo-gradient in (``averaging/hand_in.py``) and stepped with its group's average (or
    took the swarm's state): its outer weights are those peers', bit for bit, and they evaluate them on the same
    windows."""
    inner_lr: float
    outer_lr: float
    inner_step: int
    param_sha256: str
    inner_steps: int = 0
    """Inner steps this peer trained in the round."""
    round_seconds: float = 0.0
    overlap_wait_seconds: float | None = None
    """Overlapped rounds: how long the end of the round waited for the exchange launched a round earlier."""
    arrived_step: int | None = None
    """Overlapped, ``outer.apply_on_arrival``: the inner step of the next round at which this round's average
    reached the replica (``arrival.py``); None (absent from the event): at the end of that round."""
    density: float | None = None
    """``topk``: the density this peer asked its group to send at, fitted to its link (``link_fit.py``); None (absent
    from the event): another codec."""
    late_seconds: float | None = None
    """Seconds cut from this round's training because this peer began it after the round's first peer
    (``Pace.late``); None (absent from the event): no cut."""
    budget_seconds: float | None = None
    """Rounds bounded by time: the seconds of training this peer planned for the round (the swarm's period less its
    own other work, ``Pace.budget``), before any cut; None (absent from the event): H steps, not a time."""
    first_contribution_seconds: float | None = None
    """Set on the first round this peer averaged with others: seconds from process start."""

    def fields(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None}
