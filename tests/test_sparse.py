"""The sparse codec (``averaging.compression = "topk"``): what it keeps, its bytes on the wire, the checks of a sender's
bytes, its parts in an all-reduce, its error feedback, robust aggregation over it, and its density fitted to the link.
That a swarm computes with it exactly what the simulator computes: ``test_simulate.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import FAST
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionInfo
from hivemind.utils.serializer import MSGPackSerializer

from diloco_peer.averaging import link_fit, sparse
from diloco_peer.averaging.averager import wire_compression
from diloco_peer.averaging.compression import ErrorFeedback, TopKCodec, deserialize, get_codec
from diloco_peer.averaging.link_fit import LinkFit
from diloco_peer.averaging.membership import Membership
from diloco_peer.averaging.robust_aggregation import BanList
from diloco_peer.config import ConfigError, load_config
from diloco_peer.swarm.admission import Admission
from diloco_peer.tools.fragment_rounds import run_streaming
from diloco_peer.tools.simulate import run_diloco

CHUNK = sparse.CHUNK


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    return list(t.flatten().split(CHUNK))


@pytest.mark.parametrize("bits", [2, 4])
def test_keeps_the_largest_share_of_every_chunk_and_encodes_its_own_output_to_itself(bits):
    x = torch.randn(3 * CHUNK + 100, generator=torch.Generator().manual_seed(bits))
    codec = TopKCodec(0.05, bits)
    y, size = codec.roundtrip(x)
    for xc, yc in zip(_chunks(x), _chunks(y)):
        kept = yc != 0
        assert int(kept.sum()) == sparse.kept_per_chunk(xc.numel(), 0.05)
        assert set(kept.nonzero().flatten().tolist()) == set(xc.abs().topk(int(kept.sum())).indices.tolist())
        assert torch.equal(yc[kept].sign(), xc[kept].sign())
        largest = xc.abs().max()
        if bits == 2:  # a sign and one of two magnitudes, both within the kept values' range
            magnitudes = yc[kept].abs().unique()
            assert len(magnitudes) <= 2
            assert magnitudes.min() >= xc[kept].abs().min() and magnitudes.max() <= largest
        else:  # 8 steps up to the largest: at most one step off (the smallest are raised to the first)
            assert torch.isclose(yc.abs().max(), largest)
            assert ((yc[kept] - xc[kept]).abs() <= largest / 8 + 1e-6).all()
    again, _ = codec.roundtrip(y)
    assert torch.equal(again, y)  # bit for bit: the swarm encodes what error feedback already encoded
    assert size == sparse.nbytes(x.numel(), int((y != 0).sum()), bits)
    assert size < x.numel() * 4 / 25  # 5% of the values, 12 + 2 or 4 bits each, plus the chunks' scales
    zeros, zero_size = codec.roundtrip(torch.zeros(5))
    assert torch.equal(zeros, torch.zeros(5)) and zero_size == sparse.nbytes(5, 0, bits)


@pytest.mark.parametrize("bits", [2, 4])
def test_the_wire_carries_exactly_what_the_codec_computes_and_refuses_bytes_that_do_not_fit(bits):
    x = torch.randn(2 * CHUNK + 7, generator=torch.Generator().manual_seed(0))
    codec = TopKCodec(0.05, bits)
    message = wire_compression(codec).compress(x, CompressionInfo.from_tensor(x))
    assert len(message.buffer) == codec.encode(x).nbytes
    assert torch.equal(deserialize(message), codec.roundtrip(x)[0])  # read by its code alone, any density

    def tampered(change) -> bytes:
        buffer = bytearray(message.buffer)
        change(buffer)
        bad = type(message)()
        bad.CopyFrom(message)
        bad.buffer = bytes(buffer)
        return bad

    scales = 3 * sparse.scales_per_chunk(bits) * 4
    counts = [int.from_bytes(message.buffer[scales + 2 * c:scales + 2 * c + 2], "little") for c in range(3)]

    def count(chunk: int, value: int):
        return lambda b: b.__setitem__(slice(scales + 2 * chunk, scales + 2 * chunk + 2), value.to_bytes(2, "little"))

    def last_place_past_the_end(b: bytearray):  # the last chunk holds 7 values: a place of 4095 is past its end
        start = scales + 6 + 3 * ((sum(counts) - 1) // 2)
        b[start:start + 3] = b"\xff\xff\xff"

    for change, complaint in [(lambda b: b.pop(), "must be"), (count(0, CHUNK + 1), "more values"),
                              (count(0, counts[0] + 8), "must be"), (last_place_past_the_end, "past its chunk")]:
        with pytest.raises(ValueError, match=complaint):
            deserialize(tampered(change))


def test_an_all_reduce_cuts_its_parts_at_whole_chunks():
    """Error feedback encodes whole tensors; hivemind's all-reduce encodes parts of them: the same chunks."""
    tensors = [torch.randn(20 * CHUNK + 5), torch.randn(17), torch.randn(9 * CHUNK)]
    codec = TopKCodec(0.02, 2)
    container = TensorPartContainer(tensors, [1.0, 1.0, 1.0], wire_compression(codec), part_size_bytes=4096)
    parts = [part for peer in range(3) for part in container.get_raw_input_parts(peer)]
    assert len(parts) > len(tensors)  # the test's point: tensors cut into several parts
    for part in parts:
        tensor = next(t for t in tensors if t.untyped_storage().data_ptr() == part.untyped_storage().data_ptr())
        assert (part.storage_offset() - tensor.storage_offset()) % CHUNK == 0
    by_parts = torch.cat([codec.roundtrip(part)[0] for part in parts])
    assert torch.equal(by_parts, torch.cat([codec.roundtrip(t)[0] for t in tensors]))


def test_error_feedback_decays_and_takes_back_what_the_replies_dropped():
    codec = TopKCodec(0.05, 2)
    fb = ErrorFeedback(codec, decay=0.5)
    x = torch.randn(CHUNK, generator=torch.Generator().manual_seed(1))
    [sent], _ = fb.roundtrip([x])
    assert torch.allclose(fb.residuals[0] + sent, x)
    average = sent.clone()
    dropped = sent.nonzero().flatten()[::2]  # the replies kept half of our places
    average[dropped] = 0
    fb.settle([average])
    assert torch.allclose(fb.residuals[0] + torch.where(average != 0, sent, 0.0), x)  # nothing lost
    before = fb.residuals[0].clone()
    y = torch.randn(CHUNK, generator=torch.Generator().manual_seed(2))
    [sent_next], _ = fb.roundtrip([y])
    assert torch.equal(sent_next, codec.roundtrip(y + 0.5 * before)[0])
    fb.undo()  # that round failed: the residual is what it was before it
    assert torch.equal(fb.residuals[0], before)


def test_topk_turns_error_feedback_on_and_refuses_a_config_that_turns_it_off():
    assert load_config(None, ["averaging.compression='topk'"]).averaging.error_feedback
    with pytest.raises(ConfigError, match="needs error_feedback=true"):
        load_config(None, ["averaging.compression='topk'", "averaging.error_feedback=false"])
    with pytest.raises(ValueError, match="rounds by fragments do not model"):  # (they carry no error feedback)
        run_streaming(load_config(None, FAST), 2, 1, 2, "topk")


def test_robust_aggregation_refuses_no_honest_sparse_part():
    """Robust mode's checks on sparse parts, whose places differ from member to member: a coordinate-wise median of
    mostly zeros, norms of a few values. Three honest replicas, two short rounds: nothing refused, the loss falls."""
    cfg = load_config(None, [*FAST, "data.max_bytes=100_000", "outer.inner_steps=5", "averaging.compression='topk'",
                             "averaging.aggregation='robust'", "averaging.topk_density=0.05"])
    run = run_diloco(cfg, 3, 2, codec="topk")
    assert run.refused == 0
    assert run.eval_loss[-1] < run.eval_loss[0]


def test_a_peer_lowers_its_density_until_its_exchange_fits_its_share_of_the_round():
    fit = LinkFit(most=0.02, share=0.1)
    assert fit.observe(100.0, 0.02, 4.0) == "" and fit.density == 0.02  # the first round: no round length yet
    # a 10 s round, 1 s for the exchange; 4 s at 2%: a quarter of that density fits
    assert "2.000% -> 0.500%" in fit.observe(110.0, 0.02, 4.0) and fit.density == pytest.approx(0.005)
    fit.observe(120.0, 0.005, 0.125)  # room for 8x as much: at most twice the last pick
    assert fit.density == pytest.approx(0.01)
    fit.observe(130.0, 0.01, 0.1)
    assert fit.density == 0.02  # never above topk_density
    fit.observe(140.0, 0.02, 1000.0)
    assert fit.density == 0.02 * link_fit.LEAST  # a link that fits nothing still sends something
    off = LinkFit(most=0.02, share=0.0)
    off.observe(100.0, 0.02, 50.0)
    off.observe(110.0, 0.02, 50.0)
    assert off.density == 0.02


def test_a_group_encodes_at_the_lowest_density_its_members_asked_for():
    """Every member computes the group's compression from the same gathered picks (a reducer and its senders must
    agree); a pick that is no density counts as the most, and none goes below the floor."""
    serializer = MSGPackSerializer

    def gathered(**fields) -> bytes:  # hivemind's gather tuple around our fields (``RoundAverager.average``)
        return serializer.dumps([None, AveragingMode.NODE.value, serializer.dumps(fields)])

    members = Membership(Admission(), BanList(2, 60.0), "run_progress", serializer)
    ours = wire_compression(TopKCodec(0.02, 4))
    group = SimpleNamespace(gathered=(gathered(density=0.02), gathered(density=0.005), gathered(density="lots"),
                                      gathered(tokens=5), b"not msgpack"))
    chosen = members.compression(group, ours)
    assert (chosen.codec.density, chosen.codec.bits) == (0.005, 4)
    assert members.compression(SimpleNamespace(gathered=(gathered(density=1e-9),)), ours).codec.density == \
        0.02 * link_fit.LEAST
    int8 = wire_compression(get_codec("int8"))
    assert members.compression(group, int8) is int8
