"""The round's all-reduce on a real hivemind swarm on loopback (DHT + averager processes, no mocks).

Checks the two things the daemon relies on: the result is the token-weighted mean, and every member of
the group gets the very same bytes (hivemind's stock delta-based result does not guarantee that).
"""

import asyncio
import os
import signal
import time
import types

import pytest
import torch

from diloco_peer.averaging import allreduce as allreduce_module
from diloco_peer.averaging.allreduce import ExactAllReduceRunner
from diloco_peer.averaging.averager import RoundAverager
from diloco_peer.averaging.member_silence import SILENT_AFTER
from diloco_peer.averaging.compression import BLOCK
from diloco_peer.config import AveragingConfig
from diloco_peer.config.faults import Faults
from diloco_peer.training.outer_optimizer import flat_tensors

SHAPES = [torch.Size([257, 31]), torch.Size([1000]), torch.Size([3, 5, 7])]
# the plain token-weighted mean, whose arithmetic the tests check (robust mode clips to the median norm)
CFG = AveragingConfig(matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=30.0, aggregation="mean")


def _pseudo_gradients(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # magnitudes spread over orders of magnitude: where mine + (avg - mine) != avg in floating point
    return [torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-4, 3, shape, generator=gen) for shape in SHAPES]


async def _average_all(averagers, inputs, weights, epoch=0, expected=None):
    return await asyncio.gather(*(a.average(x, weight=w, epoch=epoch, expected=expected)
                                  for a, x, w in zip(averagers, inputs, weights)))


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Each value's block's largest magnitude (the quantization step of int8/int4 scales with it)."""
    flat = x.double().flatten()
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % BLOCK)).view(-1, BLOCK)
    return padded.abs().amax(dim=1).repeat_interleave(BLOCK)[: flat.numel()].view(x.shape)


LEVELS = {"int8": 127, "int4": 7}
BYTES_PER_VALUE = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1, "int4": 0.5}


@pytest.mark.light
@pytest.mark.parametrize("compression", ["none", "fp16", "bf16", "int8", "int4"])
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
        elif compression in ("fp16", "bf16"):  # rounds each input and the result: relative error 2^-11 / 2^-8
            eps = 2**-11 if compression == "fp16" else 2**-8
            magnitude = sum(w * x[i].double().abs() for w, x in zip(weights, inputs)) / total
            assert ((got.double() - expected).abs() <= 2 * eps * (magnitude + expected.abs()) + 1e-7).all()
        else:  # half a quantization step of each input's block, and of the average's block (the reply)
            step = 1 / (2 * LEVELS[compression])
            bound = sum(w * _block_absmax(x[i]) for w, x in zip(weights, inputs)) / total * step
            bound = bound + _block_absmax(expected) * step * 1.01
            error = (got.double() - expected).abs()
            assert (error <= bound * (1 + 1e-5) + 1e-12).all(), float((error - bound).max())
            assert error.max() > 0, "a lossy codec that loses nothing did not run"
        assert not torch.equal(got, inputs[0][i]), "the averaged values must differ from the local ones"
        for other in results[1:]:
            assert torch.equal(other.averaged[i], got), "group members must end with bit-identical averages"
    numel = sum(s.numel() for s in SHAPES)
    # every reducer gets its share from the 2 other members and answers both: 4 values cross the wire per
    # value of the model (shares may be uneven: a tensor is never split between reducers); the real
    # protobuf bytes must show the codec's size
    nominal = 4 * numel * BYTES_PER_VALUE[compression]
    sent, received = sum(r.bytes_sent for r in results), sum(r.bytes_received for r in results)
    assert sent == received and nominal < sent < nominal * 1.1, (sent, received, nominal)
    for r in results:
        assert r.values_not_averaged == 0
        assert 0 < r.transfer_seconds < r.seconds  # the all-reduce proper is timed apart from matchmaking


@pytest.mark.light
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


async def _staggered(averagers, inputs, expected, gaps, epoch):
    """Each averager's round with its own ``expected`` count, started ``gaps`` seconds after the one before."""
    rounds = []
    for averager, x, count, gap in zip(averagers, inputs, expected, gaps):
        await asyncio.sleep(gap)
        rounds.append(asyncio.create_task(averager.average(x, weight=1, epoch=epoch, expected=count)))
    return await asyncio.gather(*rounds)


def test_a_complete_group_starts_at_once_and_the_window_waits_for_missing_peers(dhts):
    # the round gate counted 3 peers ready: when all 3 are in, the all-reduce starts then, not at the end of the
    # 5 s matchmaking window; when one of them never comes, the 2 others average at the end of the window. Complete
    # by the largest count among its members: the gates' counts differ on a loaded machine, a's missed c's record
    # (2), b's did not (3); a leads (it came first, its window ends first), and b's count keeps its group open for
    # c, a second later (a's own count formed the group at b and turned c away: a 12-peer round in CI)
    cfg = CFG.model_copy(update={"matchmaking_time": 5.0})
    averagers = [RoundAverager(dht, SHAPES, "test-run", cfg) for dht in dhts(3)]
    try:
        inputs = [_pseudo_gradients(seed) for seed in range(3)]
        complete = asyncio.run(_average_all(averagers, inputs, [1, 1, 1], epoch=0, expected=3))
        averages = [t.clone() for t in complete[0].averaged] if complete[0].ok else []  # the next round reuses them
        partial = asyncio.run(_average_all(averagers[:2], inputs[:2], [1, 1], epoch=1, expected=3))
        partial_averages = [t.clone() for t in partial[0].averaged] if partial[0].ok else []
        counted = asyncio.run(_staggered(averagers, inputs, expected=(2, 3, 3), gaps=(0.0, 0.3, 1.0), epoch=2))
    finally:
        for a in averagers:
            a.shutdown()

    assert all(r.ok and r.group_size == 3 for r in complete), [r.error for r in complete]
    assert max(r.seconds for r in complete) < 2.0, [r.seconds for r in complete]
    assert all(r.ok and r.group_size == 2 for r in partial), [r.error for r in partial]
    assert all(cfg.matchmaking_time - 1.0 < r.seconds < cfg.matchmaking_time + 3.0 for r in partial), \
        [r.seconds for r in partial]
    for got, members in ((averages, inputs), (partial_averages, inputs[:2])):
        for i in range(len(SHAPES)):
            mean = sum(x[i].double() for x in members) / len(members)
            torch.testing.assert_close(got[i].double(), mean, rtol=1e-5, atol=1e-6)
    assert [(r.ok, r.group_size) for r in counted] == [(True, 3)] * 3, [r.error for r in counted]
    assert counted[0].seconds < cfg.matchmaking_time, counted[0].seconds  # complete at c: not the window's end


@pytest.mark.light
def test_a_lent_buffer_still_holds_what_we_sent_after_the_round(dhts):
    """Blocking rounds on a CPU lend the replica's memory (``PeerConfig.lends_replica``): the pseudo-gradient is
    sent from it. The average goes to the averager's own buffer, never over what we sent: a round that fails or
    whose average we refuse falls back on a solo step with our own pseudo-gradient, which must still be ours
    (written in place, a forked client's refused NaN average went into its solo step, test_bad_peers.py)."""
    nodes = dhts(3)
    lent = [flat_tensors(SHAPES, shared=True) for _ in nodes]
    averagers = [RoundAverager(dht, SHAPES, "lent-run", CFG, inputs=buffer) for dht, buffer in zip(nodes, lent)]
    weights = [1000, 2000, 3000]
    try:
        inputs = [_pseudo_gradients(seed) for seed in range(3)]
        for buffer, x in zip(lent, inputs):
            for target, source in zip(buffer, x):
                target.copy_(source)  # as OuterOptimizer.pseudo_gradient writes it
        results = asyncio.run(_average_all(averagers, lent, weights))
        assert all(r.ok and r.group_size == 3 and r.values_not_averaged == 0 for r in results), results
        for result, buffer, x in zip(results, lent, inputs):
            assert all(torch.equal(a, b) for a, b in zip(buffer, x))  # what we sent, untouched
            assert not any(a.data_ptr() == b.data_ptr() for a, b in zip(result.averaged, buffer))
            assert result.sent_norm == pytest.approx(float(torch.cat([t.flatten() for t in x]).double().norm()))
        for i in range(len(SHAPES)):
            expected = sum(w * x[i].double() for w, x in zip(weights, inputs)) / sum(weights)
            torch.testing.assert_close(results[0].averaged[i].double(), expected, rtol=1e-5, atol=1e-6)
    finally:
        for a in averagers:
            a.shutdown()


@pytest.mark.light
def test_in_place_the_average_is_written_over_what_was_sent(dhts):
    """Blocking rounds on a GPU (``PeerConfig.averages_in_place``): one buffer per round, the pseudo-gradient sent and
    then its average (4 bytes per parameter less than two). The members still get the very same bytes, and a failed
    round gives that whole buffer back (the caller computes its pseudo-gradient again from the replica)."""
    nodes = dhts(3)
    averagers = [RoundAverager(dht, SHAPES, "in-place-run", CFG, in_place=True) for dht in nodes]
    weights = [1000, 2000, 3000]
    try:
        inputs = [_pseudo_gradients(seed) for seed in range(3)]
        for averager, x in zip(averagers, inputs):
            for target, source in zip(averager.inputs, x):
                target.copy_(source)  # as OuterOptimizer.pseudo_gradient writes it
        results = asyncio.run(_average_all(averagers, [a.inputs for a in averagers], weights))
        assert all(r.ok and r.group_size == 3 and r.values_not_averaged == 0 for r in results), results
        for result, averager, x in zip(results, averagers, inputs):
            assert [a.data_ptr() for a in result.averaged] == [b.data_ptr() for b in averager.inputs]
            assert not all(torch.equal(a, b) for a, b in zip(averager.inputs, x))  # what was sent is gone
            assert result.sent_norm == pytest.approx(float(torch.cat([t.flatten() for t in x]).double().norm()))
        for i in range(len(SHAPES)):
            expected = sum(w * x[i].double() for w, x in zip(weights, inputs)) / sum(weights)
            torch.testing.assert_close(results[0].averaged[i].double(), expected, rtol=1e-5, atol=1e-6)
            assert all(torch.equal(r.averaged[i], results[0].averaged[i]) for r in results[1:])
        averagers[0].round_failed()  # (as after a refused average)
        assert sum(int(t.count_nonzero()) for t in averagers[0].inputs) < 2 * 4096 // 4
        with pytest.raises(ValueError, match="lent one"):
            RoundAverager(nodes[0], SHAPES, "in-place-run", CFG, inputs=flat_tensors(SHAPES, shared=True),
                          in_place=True)
    finally:
        for a in averagers:
            a.shutdown()


def test_a_member_that_leaves_mid_allreduce_lets_it_end_before_stopping(dhts):
    """A leaving peer whose all-reduce is exchanging tensors (overlapped rounds: the last round's, its task
    cancelled as the daemon stops) waits for it to end before it stops its averager process: the group keeps its
    part, and the one that stays averages the whole vector."""
    shapes = [torch.Size([4_000_000])] * 4  # 64 MB: the exchange lasts long enough to stop in the middle of it
    leaving, staying = (RoundAverager(dht, shapes, "test-run", CFG) for dht in dhts(2))

    async def scenario():
        gen = torch.Generator().manual_seed(0)
        grads = [[torch.randn(shape, generator=gen) for shape in shapes] for _ in range(2)]
        stay = asyncio.create_task(staying.average(grads[1], weight=1, epoch=0, expected=2))
        leave = asyncio.create_task(leaving.average(grads[0], weight=1, epoch=0, expected=2))
        while not leaving.exchanging:
            assert not leave.done(), leave.result()
            await asyncio.sleep(0.005)
        leave.cancel()
        waited = await leaving.finish_allreduce(timeout=60)
        leaving.shutdown()
        return waited, await stay

    try:
        waited, result = asyncio.run(scenario())
    finally:
        staying.shutdown()
        leaving.shutdown()
    assert result.ok and result.group_size == 2 and result.values_not_averaged == 0, result
    assert waited > 0.05 and not leaving.exchanging


def test_a_member_that_goes_silent_mid_allreduce_is_dropped_within_seconds(dhts):
    """A member whose averager stops as the all-reduce begins (``freeze_in_allreduce``: it sent nothing, answers
    nobody) keeps its connections up and says nothing. hivemind alone waited its reducer timeout
    (45 s with a 60 s ``allreduce_timeout``); asked whether it is still there and silent, it is dropped within
    ``SILENT_AFTER + PROBE_TIMEOUT`` (6.5 s). The two others end the round with the mean of their two parts, the
    same bytes, but where the silent member was their reducer (hivemind's split of the vector may give it none):
    there each keeps its own values (the daemon then checks its state against the swarm's)."""
    cfg = CFG.model_copy(update={"allreduce_timeout": 60.0})
    averagers = [RoundAverager(dht, SHAPES, "test-run", cfg, faults=Faults(freeze_in_allreduce=1) if i == 2
                               else Faults()) for i, dht in enumerate(dhts(3))]
    frozen = averagers[2].averager

    inputs = [_pseudo_gradients(seed) for seed in range(3)]

    async def scenario():
        rounds = [asyncio.create_task(a.average(x, weight=1, epoch=0, expected=3))
                  for a, x in zip(averagers, inputs)]
        results = await asyncio.gather(*rounds[:2])
        os.kill(frozen.pid, signal.SIGKILL)  # the survivors are done with it
        rounds[2].cancel()
        return results

    try:
        results = asyncio.run(scenario())
    finally:
        os.kill(frozen.pid, signal.SIGKILL)
        for a in averagers:
            a.shutdown()
    assert all(r.ok and r.group_size == 3 for r in results), results
    assert all(SILENT_AFTER < r.seconds < 15 for r in results), [r.seconds for r in results]  # hivemind: 45 s
    differ = 0
    for i, (a, b) in enumerate(zip(results[0].averaged, results[1].averaged)):
        apart = a != b
        assert torch.equal(a[apart], inputs[0][i][apart]) and torch.equal(b[apart], inputs[1][i][apart]), i
        mean = (inputs[0][i].double() + inputs[1][i].double()) / 2
        torch.testing.assert_close(a[~apart].double(), mean[~apart], rtol=1e-5, atol=1e-6)
        differ += int(apart.sum())
    assert differ <= results[0].values_not_averaged == results[1].values_not_averaged


@pytest.mark.light
def test_members_news_still_there_is_answered_and_the_last_peer_ready_heard(dhts):
    """The two questions between members' averagers (``member_news.py``): a live averager answers "still there?"
    (an error would count as an answer too, so a handler that failed to register would hide every silent member);
    and the round's last peer, telling a waiting one through its ``expect_group``, sets that one's ``nudged``."""
    from hivemind.proto import averaging_pb2

    from diloco_peer.averaging.pseudo_gradient_averager import PseudoGradientAverager

    near, far = dhts(2)
    waiting, last = RoundAverager(near, SHAPES, "test-run", CFG), RoundAverager(far, SHAPES, "test-run", CFG)

    async def ask():
        p2p = await far.replicate_p2p()
        stub = PseudoGradientAverager.get_stub(p2p, near.peer_id, namespace="test-run_outer")
        return await asyncio.wait_for(stub.rpc_still_there(averaging_pb2.DownloadRequest()), 10)

    try:
        answer = asyncio.run(ask())
        assert not waiting.nudged.is_set()
        last.averager.expect_group(None, None, [near.peer_id.to_base58()])
        heard = waiting.nudged.wait(timeout=10)
    finally:
        waiting.shutdown()
        last.shutdown()
    assert isinstance(answer, averaging_pb2.DownloadRequest)
    assert heard and not last.nudged.is_set()


def _runner_losing(connected: list[list[str]], active: set[str], reduces: bool = True):
    """An ``ExactAllReduceRunner`` as far as ``_drop_if_gone`` and ``_ban_sender`` see it (no group, no processes):
    senders us, x and y; our p2pd lists ``connected[i]`` at its i-th call (the last one from then on)."""
    runner = ExactAllReduceRunner.__new__(ExactAllReduceRunner)
    calls = []

    async def list_peers():
        calls.append(time.monotonic())
        return [types.SimpleNamespace(peer_id=p) for p in connected[min(len(calls), len(connected)) - 1]]

    failed = []
    runner.sender_peer_ids, runner.active_senders, runner.banned_senders = ["us", "x", "y"], set(active), set()
    runner.banlock, runner.all_senders_started = asyncio.Lock(), asyncio.Event()
    runner.tensor_part_reducer = types.SimpleNamespace(on_sender_failed=failed.append)
    runner.parts_for_local_averaging = (torch.zeros(3),) if reduces else ()
    runner._p2p = types.SimpleNamespace(list_peers=list_peers)
    return runner, calls, failed


@pytest.mark.parametrize("case", ["gone at once", "gone after a while", "stays connected", "starts sending",
                                  "we reduce nothing"])
def test_a_reducer_we_lost_that_never_sent_to_us_is_dropped_as_a_sender_once_its_connection_goes(monkeypatch, case):
    """A member that crashed mid all-reduce before it sent us anything (``crash_in_allreduce``) used to hold the
    round for hivemind's ``sender_timeout`` (30 s by default); dropped once its p2pd connection goes, the wait for
    missing senders ends at once. One still connected, or that starts to send, keeps its place."""
    monkeypatch.setattr(allreduce_module, "GONE_WITHIN", 0.3)
    connected = {"gone at once": [["y"]], "gone after a while": [["x", "y"]] * 2 + [["y"]],
                 "stays connected": [["x", "y"]], "starts sending": [["x", "y"]], "we reduce nothing": [["y"]]}[case]
    runner, calls, failed = _runner_losing(connected, {"us", "y"}, reduces=case != "we reduce nothing")

    async def scenario() -> float:
        started = time.monotonic()
        if case == "starts sending":
            asyncio.get_running_loop().call_later(0.1, runner.active_senders.add, "x")
        await runner._drop_if_gone("x")
        return time.monotonic() - started

    took = asyncio.run(scenario())
    dropped = case.startswith("gone")
    assert (runner.banned_senders == {"x"}) == dropped and (failed == [1]) == dropped, (runner.banned_senders, failed)
    assert runner.all_senders_started.is_set() == dropped  # hivemind's wait for missing senders ends with the drop
    assert took < {"stays connected": 0.6, "we reduce nothing": 0.05}.get(case, 0.3), took
    assert (not calls) == (case == "we reduce nothing"), calls
