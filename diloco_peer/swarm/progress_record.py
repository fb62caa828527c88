"""One peer's progress record: what it publishes under ``{run_id}_progress`` (``progress.py``), its schema, and the
stats the swarm monitor shows. Every field is checked on store and on read: the DHT is shared with strangers."""

from __future__ import annotations

from hivemind.dht.schema import BytesWithPublicKey
from pydantic.v1 import BaseModel, StrictBool, StrictFloat, StrictStr, confloat, conint, constr

MAX_SECONDS = 86400.0
"""The longest step or round a progress record may say a peer takes (a day)."""
MAX_LOSS = 1e6
"""The largest loss a progress record carries (a larger or non-finite one is sent as unknown)."""


class PeerStats(BaseModel):
    """What the swarm monitor (bootstrap node, ``diloco-peer status``) shows of a peer; no scraping needed."""

    name: constr(max_length=64, strict=True)
    state: constr(regex=r"^(joining|training|averaging|leaving)$", strict=True)
    reach: constr(regex=r"^(direct|relayed|outbound-only|unknown)$", strict=True) = "unknown"
    tokens_per_second: confloat(ge=0, le=1e12, strict=True)
    train_loss: confloat(ge=0, le=MAX_LOSS, strict=True) | None
    eval_loss: confloat(ge=0, le=MAX_LOSS, strict=True) | None
    rounds_averaged: conint(ge=0, strict=True)
    rounds_solo: conint(ge=0, strict=True)
    rounds_failed: conint(ge=0, strict=True)
    rounds_partial: conint(ge=0, strict=True) = 0  # a default: records of peers that predate it stay valid


class ProgressRecord(BaseModel):  # pydantic v1: hivemind's SchemaValidator speaks v1
    peer_id: StrictStr
    epoch: conint(ge=0, strict=True)
    inner_step: conint(ge=0, strict=True)
    tokens: conint(ge=0, strict=True)
    ready: StrictBool
    """True once the peer finished the inner steps of ``epoch`` and waits for the round."""
    round: conint(ge=0, strict=True) = 0
    """The round this peer trains now: its pseudo-gradient will be averaged under this epoch. Equal to
    ``epoch`` in blocking mode (more while it syncs towards a later epoch: the round it trains next); in
    overlapped mode one more once the peer sent ``epoch``'s."""
    state_hash: StrictStr = ""
    """sha256 of the peer's outer weights at ``epoch``: peers that agree hold the same bytes."""
    joined: StrictBool = True
    """False from start until the peer has synced to the swarm's state (or found nothing to sync): until then
    its epoch says nothing about the swarm's progress and it does not vote (see ``quorum_epoch``)."""
    time: StrictFloat
    step_seconds: confloat(gt=0, le=MAX_SECONDS, strict=True) | None = None
    """Seconds this peer takes per inner step, lately (None until it trained a round): rounds bounded by time take
    the swarm's pace from these (``rounds/pace.py``)."""
    work_seconds: confloat(ge=0, le=MAX_SECONDS, strict=True) | None = None
    """Seconds of each round this peer spends neither training nor waiting for others (its outer step, eval,
    records), lately."""
    training_round: conint(ge=0, strict=True) | None = None
    """The round whose inner steps this peer trains now or trained last, counted as the inner LR schedule counts it
    (its steps are ``training_round * H`` on): the same number for every peer of a round, in either schedule."""
    round_started: confloat(ge=0, strict=True) | None = None
    """When this peer's round ``training_round`` began (wall clock, as ``time``): where its last all-reduce ended
    (blocking rounds), else where its inner steps began. A peer that began later than the round's first cuts its
    training by as much, so that it reaches the gate with the others (``Pace.late``)."""
    hands_to: constr(max_length=64, strict=True) = ""
    """The peer (base58) this one handed its pseudo-gradient of ``epoch`` in to, once ready, instead of joining the
    all-reduce (a peer too slow for it: ``averaging/hand_in.py``); "" if it averages as a member. No gate counts it in
    the group it expects."""
    stats: PeerStats | None = None
    """Loss, throughput and round counts for the swarm monitor, refreshed with every publication."""


class ProgressSchema(BaseModel):
    progress: dict[BytesWithPublicKey, ProgressRecord | None]
