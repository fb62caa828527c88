"""The round's all-reduce on a real hivemind swarm on loopback (DHT + averager processes, no mocks).

Checks the two things the daemon relies on: the result is the token-weighted mean, and every member of
the group gets the very same bytes (hivemind's stock delta-based result does not guarantee that).
"""

import asyncio

import pytest
import torch
from hivemind.dht import DHT

from diloco_peer.averaging_round import RoundAverager
from diloco_peer.config import AveragingConfig

SHAPES = [torch.Size([257, 31]), torch.Size([1000]), torch.Size([3, 5, 7])]
CFG = AveragingConfig(matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=30.0)


@pytest.fixture
def dhts():
    started = []

    def make(count: int) -> list[DHT]:
        root = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        started.append(root)
        addrs = [str(a) for a in root.get_visible_maddrs()]
        for _ in range(count):
            started.append(DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addrs))
        return started[1:]

    yield make
    for dht in started:
        dht.shutdown()


def _pseudo_gradients(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # magnitudes spread over orders of magnitude: where mine + (avg - mine) != avg in floating point
    return [torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-4, 3, shape, generator=gen) for shape in SHAPES]


async def _average_all(averagers, inputs, weights, epoch=0):
    return await asyncio.gather(*(a.average(x, weight=w, epoch=epoch) for a, x, w in zip(averagers, inputs, weights)))


@pytest.mark.parametrize("compression", ["none", "fp16"])
def test_weighted_mean_and_bit_identical_results(dhts, compression):
    cfg = CFG.model_copy(update={"compression": compression})
    averagers = [RoundAverager(dht, SHAPES, "test-run", cfg) for dht in dhts(3)]
    try:
        inputs = [_pseudo_gradients(seed) for seed in range(3)]
        weights = [1000, 2000, 3000]  # tokens behind each pseudo-gradient
        results = asyncio.run(_average_all(averagers, inputs, weights, epoch=4))
    finally:
        for a in averagers:
            a.shutdown()

    assert all(r.ok and r.group_size == 3 for r in results), [r.error for r in results]
    assert all(sorted(r.group_epochs) == [4, 4, 4] for r in results)
    total = sum(weights)
    for i, shape in enumerate(SHAPES):
        expected = sum(w * x[i].double() for w, x in zip(weights, inputs)) / total
        got = results[0].averaged[i]
        assert got.shape == shape
        if compression == "none":
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
        else:  # fp16 rounds each sent input and the result: relative error 2^-11 each, plus subnormals
            magnitude = sum(w * x[i].double().abs() for w, x in zip(weights, inputs)) / total
            assert ((got.double() - expected).abs() <= 2 * 2**-11 * (magnitude + expected.abs()) + 1e-7).all()
        assert not torch.equal(got, inputs[0][i]), "the averaged values must differ from the local ones"
        for other in results[1:]:
            assert torch.equal(other.averaged[i], got), "group members must end with bit-identical averages"
    numel = sum(s.numel() for s in SHAPES)
    for r in results:
        # each peer sends 2/3 of its values to the other reducers and answers 2 senders for its 1/3 share
        assert r.bytes_sent > numel * (2 if compression == "fp16" else 4) and r.bytes_received > 0
        assert r.values_not_averaged == 0


def test_alone_returns_failure_without_raising(dhts):
    (dht,) = dhts(1)
    averager = RoundAverager(dht, SHAPES, "lonely-run", CFG)
    try:
        result = asyncio.run(averager.average(_pseudo_gradients(0), weight=100, epoch=0))
    finally:
        averager.shutdown()
    assert not result.ok
    assert result.averaged is None and result.error
    assert result.seconds < CFG.matchmaking_time * 3 + 10
