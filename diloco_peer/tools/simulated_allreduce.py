"""A group's all-reduce in one process, as the swarm's reducers compute it: what ``diloco-peer simulate`` averages.

The pseudo-gradients are cut into the parts hivemind's all-reduce sends (``TensorPartContainer``, with
``averaging.part_size_bytes`` and the wire codec's size estimate), replica j reduces the j-th of K equal spans
(the group's order taken as the replicas' order, bandwidths equal), and each part is averaged by
``robust_aggregation.aggregate``, the function the swarm's reducers call, with ``averaging.aggregation``,
``max_update_ratio``, ``max_weight_ratio`` and ``min_cosine``: in ``mean`` mode the token-weighted mean (summed in
sender order), in ``robust`` mode the cosine filter against the coordinate-wise median, clipping to the median norm
and weight. Every contribution the swarm's checks would refuse (a reducer refusing a part, a member refusing a
reducer's average with ``check_average``, a member refusing the whole update with ``refuse_update``) is counted:
in a swarm each one is an offense against an honest peer (two within ``ban_seconds`` ban it) and a round with
values left un-averaged. The averages are applied regardless (a refused sender is left out of the rest of that
reducer's parts).
"""

from __future__ import annotations

import torch
from hivemind.averaging.partition import TensorPartContainer

from ..averaging.averager import wire_compression
from ..averaging.compression import Codec
from ..averaging.robust_aggregation import BadContribution, Limits, aggregate, check_average, refuse_update, vector_norm
from ..config import AveragingConfig


def allreduce_bytes(replicas: int, payload: int) -> int:
    """Bytes one of ``replicas`` peers sends and receives in a butterfly all-reduce of ``payload`` bytes."""
    return 0 if replicas == 1 else round(2 * 2 * (replicas - 1) / replicas * payload)


def roundtrip_all(codec, tensors):
    """``tensors`` encoded and decoded by ``codec``, as they arrive; and their encoded size in bytes."""
    out = []
    total = 0
    for t in tensors:
        restored, size = codec.roundtrip(t)
        out.append(restored)
        total += size
    return out, total


def reducer_spans(tensors: list[torch.Tensor], reducers: int, codec: Codec,
                  part_size_bytes: int) -> list[tuple[torch.Tensor]]:
    """``tensors`` cut into the parts the swarm's all-reduce sends, per reducer (equal shares, in order)."""
    container = TensorPartContainer(tensors, [1.0] * reducers, wire_compression(codec), part_size_bytes)
    return [container.get_raw_input_parts(j) for j in range(reducers)]


def _refuses(average: torch.Tensor, mine: torch.Tensor, limits: Limits) -> bool:
    """Whether a member holding ``mine`` refuses a reducer's ``average`` of that part (``check_average``)."""
    try:
        check_average(average, mine, limits)
    except BadContribution:
        return True
    return False


def group_average(own: list[list[torch.Tensor]], sent: list[list[torch.Tensor]], weights: list[int], wire: Codec,
                  cfg: AveragingConfig) -> tuple[list[torch.Tensor], int]:
    """The group's average as the swarm's reducers compute it, part by part (see the module docstring), after
    crossing the wire back; and the number of contributions the swarm's checks would have refused.

    :param own: each replica's pseudo-gradient as its averager holds it (what its checks compare with)
    :param sent: each replica's pseudo-gradient as the reducers receive it (through the codec)
    """
    limits = Limits.of(cfg)
    k = len(sent)
    sent_spans = [reducer_spans(s, k, wire, cfg.part_size_bytes) for s in sent]
    own_spans = [reducer_spans(o, k, wire, cfg.part_size_bytes) for o in own]
    averaged = []
    refused = 0
    for j in range(k):  # replica j reduces span j: its own part is the reference of the checks
        dropped: set[int] = set()  # a refused sender is out of the rest of this reducer's parts (ban_sender)
        for p in range(len(sent_spans[j][j])):
            parts = {s: (sent_spans[s][j][p], float(weights[s])) for s in range(k) if s not in dropped}
            result, bad = aggregate(parts, j, limits)
            dropped |= {s for s, _ in bad}
            result, _ = wire.roundtrip(result)  # the reducer's reply crosses the wire
            members = [(own_spans[m][j][p], limits.for_member(weights, weights[m])) for m in range(k) if m != j]
            refused += len(bad) + sum(_refuses(result, mine, checks) for mine, checks in members)
            averaged.append(result.flatten())
    flat = torch.cat(averaged)
    average = [t.view_as(s) for t, s in zip(flat.split([s.numel() for s in sent[0]]), sent[0])]
    refused += sum(bool(refuse_update(average, vector_norm(o), cfg.max_update_ratio)) for o in own)
    return average, refused
