"""Robust aggregation: what a peer checks before another peer's numbers touch its weights.

hivemind's all-reduce trusts the data path: a reducer adds whatever a sender streams, with whatever weight
the sender claims, and a member applies whatever its reducers send back. A swarm open to strangers meets
broken hardware, buggy forks and attackers, so here every number is checked where it enters:

- **as a reducer**, each incoming part of a pseudo-gradient (``CheckedPartReducer``): exact shape, float32,
  finite, a sane weight (finite, positive, at most ``max_weight_ratio`` times the group's median member's tokens;
  ours in a pair), and a norm at most ``max_update_ratio`` times the median part's (ours in a pair: ``_references``).
  In ``robust`` mode, once a part is in from every sender,
  parts pointing against the group (groups of 3+, parts of ``MIN_DIRECTION_VALUES`` or more: cosine with the
  coordinate-wise median below ``min_cosine`` beyond noise, ``below``) are dropped and the rest are clipped to the
  median norm and averaged with weights clipped to the median weight, so that no single member can move the average
  far, whatever it sends;
- **as a member**, each averaged part a reducer sends back (``check_average``): shape, finite, norm against
  our own part; in robust mode its direction too (parts of ``MIN_DIRECTION_VALUES`` or more);
- **after the round**, the whole average (``refuse_update``), the last line of defence.

A violating sender is dropped from the round (hivemind's own mechanism for a failed sender: the others
average without it), a violating reducer's parts are not used (we keep our own values there and re-sync
after the round); both are reported as offenses, and ``BanList`` bans a repeat offender for a while. The
arithmetic of an honest round is unchanged (the weighted mean, summed in sender order, so it is the same
bytes on every run).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.averaging.partition import TensorPartReducer

OFFENSE_KINDS = ("malformed", "shape", "non_finite", "weight", "norm", "direction", "unadmitted", "state")
"""Labels of ``diloco_rejected_contributions_total``: why a peer's contribution was refused (``state``: a
state download that failed its checks, see ``state_sync.py``)."""


class BadContribution(Exception):
    """A peer's part or average failed a check; ``kind`` is one of ``OFFENSE_KINDS``. ``counts``: whether it counts
    towards a ban (a direction refusal above ``Limits.ban_cosine`` does not: see ``_direction``)."""

    def __init__(self, kind: str, detail: str, counts: bool = True):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail
        self.counts = counts


@dataclass(frozen=True)
class Limits:
    """The checks' bounds, from the ``[averaging]`` section (plain numbers: they cross into the averager
    process)."""

    max_update_ratio: float = 10.0
    max_weight_ratio: float = 10.0
    robust: bool = False
    min_cosine: float = -0.3
    ban_cosine: float = -0.5

    @classmethod
    def of(cls, cfg) -> Limits:
        """The bounds an ``[averaging]`` section (``AveragingConfig``) sets: one place, so that the swarm's
        averager and ``diloco-peer simulate`` check with the same numbers."""
        return cls(max_update_ratio=cfg.max_update_ratio, max_weight_ratio=cfg.max_weight_ratio,
                   robust=cfg.aggregation == "robust", min_cosine=cfg.min_cosine, ban_cosine=cfg.ban_cosine)

    def for_member(self, weights: list[float], ours: float) -> Limits:
        """The limits a member weighing ``ours`` (its tokens) checks averages with, in a group weighing ``weights``:
        a light member (``is_light``) refuses an average by direction only where it points clearly against its own
        part (below ``ban_cosine``, as a sign flip does). Its part says little of the average's direction, which the
        heavier parts set: an honest average can point away from the part of a peer that trained far fewer steps
        than the others in a round bounded by time, and ``min_cosine`` alone would refuse it (BENCHMARKS.md,
        "Unequal volunteers"). And its norm check allows the average to be as many times longer as the median part
        weighs more than its own: a pseudo-gradient grows with the steps behind it, and a peer of one step in a group
        of twenty-step peers refused their honest average as too long, and banned one of them."""
        if not is_light(ours, weights):
            return self
        heavier = statistics.median_low(weights) / max(ours, 1e-12)
        return dataclasses.replace(self, min_cosine=min(self.min_cosine, self.ban_cosine),
                                   max_update_ratio=self.max_update_ratio * heavier)


LIGHT = 0.5
"""A contribution weighing less than this share of the group's median one (its tokens: a slow volunteer's in a round
bounded by time) is *light*: judged by direction, and judging averages by direction, against ``ban_cosine`` only."""


def is_light(weight: float, weights: list[float]) -> bool:
    """Whether a contribution of ``weight`` is light in a group whose contributions weigh ``weights`` (``LIGHT``)."""
    return bool(weights) and weight < LIGHT * statistics.median_low(weights)


MIN_DIRECTION_VALUES = 1024
"""Robust mode checks the direction of parts this long or longer only. The direction of a few dozen values is
noise: in a clean K=8 run (bench/robust_quality.py) honest 96-value RMSNorm weights had cosines of -0.02 to
-0.12 with the group's median and were refused as offenses. Shorter parts are still clipped to the median
norm and weight, which bounds what any one member moves them by (SECURITY.md)."""


NOISE_SIGMAS = 3.0
"""A cosine is below a bound only where it is below it by more than this many times the spread of the cosine of two
unrelated vectors of its length (1 / sqrt(values)). An honest part that carries no signal in a span (a peer whose
steps there were mostly noise) is orthogonal to the group's median, not against it, and its cosine scatters around
zero by that spread: dropped at ``min_cosine`` 0, it was lost to the average, and its peer then refused that
span's average in turn (it points away from a part left out of it) and ended its round partial (BENCHMARKS.md,
"Many peers"). A sign flip, or a part clearly against the group, is many spreads below."""


def below(cosine: float, bound: float, values: int) -> bool:
    """Whether ``cosine``, between vectors of ``values`` values, is below ``bound`` beyond noise (``NOISE_SIGMAS``)."""
    return cosine < bound - NOISE_SIGMAS / math.sqrt(max(values, 1))


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


SORTING_NETWORK_MAX = 32
"""``coordinate_median`` sorts by a network of element-wise min/max up to this many parts: k (k - 1) / 2
comparators, each two passes over the part, faster than ``torch.median(dim=0)``'s per-column sort at every count
measured (BENCHMARKS.md, "Robust aggregation: what it costs and what it stops", "What it costs in time")."""


def coordinate_median(parts: list[torch.Tensor]) -> torch.Tensor:
    """The coordinate-wise median of equally shaped ``parts`` (the lower of the two middle values for an even
    count): the values of ``torch.stack(parts).median(dim=0)`` (a zero's sign may differ, which no cosine sees),
    sorted by an odd-even transposition network of ``torch.minimum``/``torch.maximum`` instead of a sort per
    column. It runs on a reducer's event loop for every part of every round, and with torch's sort the median was
    most of what robust aggregation cost a loopback exchange (``bench/round_latency.py``; measured:
    BENCHMARKS.md, "Robust aggregation: what it costs and what it stops", "What it costs in time")."""
    if len(parts) > SORTING_NETWORK_MAX:
        return torch.stack(parts).median(dim=0).values
    rows = list(parts)
    for phase in range(len(rows)):  # after k phases of compare-exchanges of neighbours, every column is sorted
        for i in range(phase % 2, len(rows) - 1, 2):
            rows[i], rows[i + 1] = torch.minimum(rows[i], rows[i + 1]), torch.maximum(rows[i], rows[i + 1])
    return rows[(len(rows) - 1) // 2]


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in floating-point ``t``: its minimum and maximum are finite (a NaN anywhere makes both
    NaN). One pass and no temporary, where ``torch.isfinite(t).all()`` first writes a bool per value: a state
    sync's checks became many times faster (measured: BENCHMARKS.md, "Where a state sync's time goes")."""
    if t.numel() == 0:
        return True
    low, high = torch.aminmax(t.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _direction(what: str, cosine: float, limits: Limits) -> BadContribution:
    """A reducer's direction refusal. The cosine is a judgment, not a proof: an honest peer whose part is off for a
    while (seen slightly below zero after a relay loss) is refused but not counted towards a ban unless it points
    clearly against the group (below ``ban_cosine``, where sign flips were measured: BENCHMARKS.md, "Robust
    aggregation: what it costs and what it stops"). A refused part never reaches the average either way."""
    counts = cosine < limits.ban_cosine
    note = "" if counts else f"; not counted towards a ban (averaging.ban_cosine={limits.ban_cosine:g})"
    return BadContribution("direction", f"{what} {cosine:.2f} (averaging.min_cosine={limits.min_cosine:g}){note}",
                           counts=counts)


def check_arrival(part: torch.Tensor, shape: torch.Size, weight: float, limits: Limits) -> None:
    """Checks that need nothing but the part itself; raises ``BadContribution``."""
    if part.shape != shape:
        raise BadContribution("shape", f"part of shape {tuple(part.shape)}, expected {tuple(shape)}")
    if part.dtype != torch.float32:
        raise BadContribution("shape", f"part of dtype {part.dtype}, expected float32")
    if not all_finite(part):
        raise BadContribution("non_finite", f"{int((~torch.isfinite(part)).sum())} non-finite values")
    if not (weight == weight and 0 < weight < float("inf")):
        raise BadContribution("weight", f"weight {weight!r} (must be finite and positive)")


def aggregate(parts: dict[int, tuple[torch.Tensor, float]], own: int | None,
              limits: Limits) -> tuple[torch.Tensor, list[tuple[int, BadContribution]]]:
    """Average one part's contributions ``{sender: (part, weight)}``; ``own`` is our sender index.

    Our own part is the reference of a pair's ratio checks, and is never refused as an offense. In a group of three
    or more it is judged by direction like any other, and left out of the average where it points against the
    group: every other reducer leaves it out of theirs, and a span's average must not depend on who reduces it (a
    peer whose part went off, or a fork that flips its own, kept its part in its own span alone).

    Returns the average and the other senders refused, with why. Contributions are summed in sender order, in float64.
    """
    refused: list[tuple[int, BadContribution]] = []
    norms = {s: _norm(p) for s, (p, _) in parts.items()}
    if own is not None and own in parts:
        weight_ref, norm_ref, whose = _references(parts, norms, own)
        for s, (p, w) in parts.items():
            if s == own:
                continue
            if limits.max_weight_ratio and w > limits.max_weight_ratio * weight_ref:
                refused.append((s, BadContribution("weight", f"weight {w:g} is {w / max(weight_ref, 1e-12):.0f}x "
                                                             f"{whose} (averaging.max_weight_ratio="
                                                             f"{limits.max_weight_ratio:g})")))
            elif limits.max_update_ratio and norms[s] > limits.max_update_ratio * max(norm_ref, 1e-12):
                why = (f"part norm {norms[s]:.3g} is {norms[s] / max(norm_ref, 1e-12):.0f}x {whose} "
                       f"(averaging.max_update_ratio={limits.max_update_ratio:g})")
                refused.append((s, BadContribution("norm", why)))
    kept = {s: pw for s, pw in parts.items() if s not in {r for r, _ in refused}}
    if limits.robust and own in kept and len(kept) >= 3 and parts[own][0].numel() >= MIN_DIRECTION_VALUES:
        # the direction to agree with: the coordinate-wise median of all parts (a minority cannot move it). Not
        # with two senders: then it would be our own part, and two honest parts of a slice of the model can
        # point apart (measured: an honest pair refused each other at min_cosine 0); nor can two tell who is off
        reference = coordinate_median([p for p, _ in kept.values()]).double().flatten()
        weights = [w for _, w in kept.values()]
        against = set()
        for s, (p, w) in kept.items():
            cosine = float(torch.nn.functional.cosine_similarity(p.double().flatten(), reference, dim=0))
            # a light part (a slow volunteer's few steps: noisy) is refused for a clear sign flip only; what it
            # moves the average by is bounded by its weight, and its norm is clipped to the median's below
            if below(cosine, limits.ban_cosine if is_light(w, weights) else limits.min_cosine, p.numel()):
                against.add(s)
                if s != own:
                    refused.append((s, _direction("cosine with the group's median", cosine, limits)))
        if against >= set(kept):  # nothing agrees with the median (no honest group does that): ours, as before
            against.discard(own)
        kept = {s: pw for s, pw in kept.items() if s not in against}
    if limits.robust and len(kept) >= 2:
        median_norm = float(torch.tensor([norms[s] for s in kept], dtype=torch.float64).quantile(0.5))
        median_weight = float(torch.tensor([w for _, w in kept.values()], dtype=torch.float64).quantile(0.5))
        kept = {s: (p * min(1.0, median_norm / max(norms[s], 1e-30)) if norms[s] > median_norm else p,
                    min(w, median_weight)) for s, (p, w) in kept.items()}
    return weighted_mean(kept, like=next(iter(parts.values()))[0]), refused


def weighted_mean(parts: dict[int, tuple[torch.Tensor, float]], like: torch.Tensor) -> torch.Tensor:
    """The mean of ``{sender: (part, weight)}`` weighted, summed in sender order in float64, returned as ``like``.

    In float64 a float32 value times a token count is exact, and the mean rounds to the same float32 whatever the
    senders' order (two always, more all but always). The group's order is its leader's shuffle: summed in float32
    (where ``add_`` fuses the second product into its sum, not the first) a span's average differed in its last bits
    with it, which a few rounds of AdamW and int8 rounding magnify (the simulator takes the replicas' order)."""
    total = torch.zeros_like(like, dtype=torch.float64)
    denominator = 0.0
    for s in sorted(parts):
        p, w = parts[s]
        total.add_(p.double(), alpha=w)
        denominator += w
    return total.div_(denominator).to(like.dtype)


def _references(parts: dict[int, tuple[torch.Tensor, float]], norms: dict[int, float],
                own: int) -> tuple[float, float, str]:
    """What a reducer's ratio checks compare a sender's weight and norm with, and whose they are: in a pair, our own
    part's; in a group of three or more, the group's median part's (ours included, the lower median: a minority
    cannot raise it). A reducer that trained far fewer steps than the others (a slow volunteer, rounds bounded by
    time) would otherwise refuse every honest part as too heavy or too long (BENCHMARKS.md, "Unequal volunteers")."""
    if len(parts) < 3:
        return parts[own][1], norms[own], "ours"
    weights = [w for _, w in parts.values()]
    return statistics.median_low(weights), statistics.median_low(norms.values()), "the group's median"


def check_average(averaged: torch.Tensor, own_part: torch.Tensor, limits: Limits) -> None:
    """Check an averaged part a reducer sent back against the part we sent it; raises ``BadContribution``."""
    check_arrival(averaged, own_part.shape, 1.0, limits)
    norm, own_norm = _norm(averaged), _norm(own_part)
    # a weighted mean is never longer than its longest input, and every input passed the reducer's norm check
    if limits.max_update_ratio and norm > limits.max_update_ratio * max(own_norm, 1e-12):
        raise BadContribution("norm", f"averaged part norm {norm:.3g} is {norm / max(own_norm, 1e-12):.0f}x ours "
                                      f"(averaging.max_update_ratio={limits.max_update_ratio:g})")
    if limits.robust and own_norm > 0 and norm > 0 and own_part.numel() >= MIN_DIRECTION_VALUES:
        cosine = float(torch.nn.functional.cosine_similarity(averaged.double().flatten(),
                                                             own_part.double().flatten(), dim=0))
        if below(cosine, limits.min_cosine, own_part.numel()):  # counted as ``_direction`` says, if the others agree
            raise _direction("averaged part's cosine with ours", cosine, limits)  # (``settle_disputes``)


def _outcome_seen(task: asyncio.Future) -> None:
    """Marks a shielded accumulation's outcome as read: its caller may be gone (asyncio would log it as lost)."""
    if not task.cancelled():
        task.exception()


class CheckedPartReducer(TensorPartReducer):
    """hivemind's reducer, but each part is checked on arrival and averaged by ``aggregate`` once complete.

    :param own: our index among the senders (None if we send nothing): our part is never refused as an offense
      (``aggregate``)
    :param on_refused: called with (sender index, ``BadContribution``) for every refused contribution; the
      caller drops that sender from the rest of the round
    """

    def __init__(self, part_shapes, num_senders: int, *, own: int | None, limits: Limits,
                 on_refused: Callable[[int, BadContribution], None]):
        self.own = own
        self.limits = limits
        self.on_refused = on_refused
        self.contributions: dict[int, dict[int, tuple[torch.Tensor, float]]] = {}
        super().__init__(part_shapes, num_senders)

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        if 0 <= part_index < self.num_parts and sender_index != self.own:
            check_arrival(tensor_part, self.part_shapes[part_index], weight, self.limits)
        self.contributions.setdefault(part_index, {})[sender_index] = (tensor_part, weight)
        # hivemind's accumulate_part awaits the part's future, which every sender of the part shares: a sender whose
        # stream went away (a crashed or departing member) is cancelled, and with it that future, for everyone. The
        # other members of the part then got nothing and the reducer broke (InvalidStateError at its next sender
        # failure), so the whole span went un-averaged for everyone instead of without that one sender.
        accumulating = asyncio.ensure_future(super().accumulate_part(sender_index, part_index, tensor_part, weight))
        accumulating.add_done_callback(_outcome_seen)
        return await asyncio.shield(accumulating)

    def check_current_part_finished(self):
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        index = self.current_part_index
        parts = {s: pw for s, pw in self.contributions.pop(index, {}).items() if index < self.sender_failed_after[s]}
        result, refused = aggregate(parts, self.own, self.limits) if parts else (self.accumulator, [])
        self.current_part_future.set_result(result)
        self.reset_accumulators()
        for sender, problem in refused:
            self.on_refused(sender, problem)


class BanList:
    """Offenses per peer; a peer with ``ban_after`` offenses within ``ban_seconds`` is banned that long.

    Lives in the averager process, where it is enforced: a banned peer cannot join our group, cannot be in a
    group we average in, and cannot download our state.
    """

    def __init__(self, ban_after: int, ban_seconds: float, clock=time.monotonic):
        self.ban_after = ban_after
        self.ban_seconds = ban_seconds
        self.clock = clock
        self.offenses: dict[str, list[float]] = {}
        self.banned_until: dict[str, float] = {}

    def record(self, peer: str) -> bool:
        """Count an offense of ``peer``; True if it is banned from now on (and was not before)."""
        now = self.clock()
        recent = [t for t in self.offenses.get(peer, []) if now - t < self.ban_seconds] + [now]
        self.offenses[peer] = recent
        if len(recent) >= self.ban_after and not self.is_banned(peer):
            self.banned_until[peer] = now + self.ban_seconds
            return True
        return False

    def banned(self) -> set[str]:
        """The peers banned now."""
        return {peer for peer in list(self.banned_until) if self.is_banned(peer)}

    def is_banned(self, peer: str) -> bool:
        until = self.banned_until.get(peer)
        if until is None:
            return False
        if self.clock() >= until:
            del self.banned_until[peer]
            self.offenses.pop(peer, None)
            return False
        return True


def vector_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of a list of tensors taken as one vector, in float64 (no fp32 copy of the model is made)."""
    return float(torch.sqrt(sum(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2 for t in tensors)))


def refuse_update(update: list[torch.Tensor], own_norm: float, max_ratio: float) -> str:
    """Why an averaged pseudo-gradient must not be applied ("" if it may): a peer that sent NaNs or a
    huge vector (broken hardware, a buggy fork, an attacker) must not poison our weights. ``own_norm``: the
    ``vector_norm`` of the pseudo-gradient we sent (``RoundResult.sent_norm``)."""
    bad = sum(int((~torch.isfinite(t)).sum()) for t in update if not all_finite(t))  # (counted only where there)
    if bad:
        return f"{bad} non-finite values"
    norm = vector_norm(update)
    if max_ratio and norm > max_ratio * max(own_norm, 1e-12):
        return f"norm {norm:.3g} is {norm / max(own_norm, 1e-12):.0f}x ours (averaging.max_update_ratio={max_ratio:g})"
    return ""
