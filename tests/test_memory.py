"""Memory: no extra copy of the model where state stands still. Checkpoints written from the live state (training
waits only for what it is about to change, or drops the checkpoint), round buffers that give their memory back,
pseudo-gradients written in place, a donor that steps during a download still serves one whole state."""

import asyncio
import logging
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import TRAIN_SETS, state_hash, trainer_and_outer

from diloco_peer.averaging import state_transfer
from diloco_peer.config import CheckpointConfig, load_config
from diloco_peer.rounds.exchange import RoundExchange
from diloco_peer.state import checkpoint
from diloco_peer.state.checkpoint import CheckpointManager, capture, restore
from diloco_peer.training.outer_optimizer import flat_tensors, release_pages
from diloco_peer.training.trainer import ComputeThread


def _busy_writer(manager: CheckpointManager, seconds: float) -> None:
    """The writer thread is still at an earlier checkpoint for ``seconds`` (a slow disk)."""
    done = threading.Event()
    manager._pending = manager._executor.submit(done.wait)
    threading.Timer(seconds, done.set).start()


def _round(trainer, outer) -> None:
    trainer.train_steps(1)
    outer.step(outer.pseudo_gradient())


def test_a_checkpoint_holds_the_state_at_capture_while_training_goes_on(tmp_path):
    cfg = load_config(None, TRAIN_SETS)
    trainer, outer = trainer_and_outer(cfg)
    _round(trainer, outer)
    captured = state_hash(trainer, outer)
    manager = CheckpointManager(CheckpointConfig(dir=str(tmp_path)), "alice", cfg.fingerprint())
    _busy_writer(manager, 0.5)
    state = capture(trainer, outer, cfg.fingerprint())
    assert state.outer_params[0].data_ptr() == outer.params[0].data_ptr()  # the live tensors, not a copy
    written = manager.save(state)
    trainer.optimizer.step()  # the next inner step waits until the writer is past the AdamW state
    assert state.snapshot.waited > 0.3
    _round(trainer, outer)
    written.result()
    assert state_hash(trainer, outer) != captured

    fresh_trainer, fresh_outer = trainer_and_outer(cfg)
    loaded = manager.load_latest()
    assert loaded.mapped  # memory-mapped: read as it is copied in, page by page given back
    restore(loaded, fresh_trainer, fresh_outer)
    assert state_hash(fresh_trainer, fresh_outer) == captured


def test_training_that_cannot_wait_drops_the_checkpoint_and_keeps_the_last(tmp_path, monkeypatch):
    cfg = load_config(None, TRAIN_SETS)
    trainer, outer = trainer_and_outer(cfg)
    manager = CheckpointManager(CheckpointConfig(dir=str(tmp_path), keep=2), "bob", cfg.fingerprint())
    outer.epoch = 1
    manager.save(capture(trainer, outer, cfg.fingerprint())).result()
    monkeypatch.setattr(checkpoint, "CHANGE_WAIT", 0.2)
    _busy_writer(manager, 1.0)
    outer.epoch = 2
    dropped = manager.save(capture(trainer, outer, cfg.fingerprint()))
    started = time.perf_counter()
    trainer.optimizer.step()  # an inner step: it waits 0.2 s, not for the writer
    assert time.perf_counter() - started < 0.9
    assert isinstance(dropped.exception(timeout=10), checkpoint._Abandoned)
    assert [p.name for p in manager.files()] == ["epoch-000001.pt"] and not list(manager.dir.glob("*.tmp"))
    started = time.perf_counter()
    trainer.optimizer.step()  # the hooks are gone with the dropped write: no more waiting
    assert time.perf_counter() - started < 0.1
    manager.close()


def _shared_memory_bytes() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss_Shmem:"):
            return int(line.split()[1]) * 1024
    return 0


def test_round_buffers_give_their_memory_back():
    before = _shared_memory_bytes()
    buffers = flat_tensors([torch.Size([1024, 1024])] * 8, shared=True)  # 32 MB
    assert _shared_memory_bytes() - before < 1e6  # untouched: nothing yet
    for b in buffers:
        b.fill_(1.0)
    assert _shared_memory_bytes() - before > 30e6
    assert release_pages(buffers)
    assert _shared_memory_bytes() - before < 1e6
    buffers[0].fill_(2.0)  # and they can be written again
    assert float(buffers[0].sum()) == 2.0 * 1024 * 1024
    assert not release_pages([torch.ones(4)])  # private memory is never given back behind the allocator's back


@pytest.mark.light
def test_a_failed_rounds_average_gives_its_memory_back_and_our_pseudo_gradient_stays(peers):
    """After a failed round a peer downloads the swarm's state, or (none to be had) steps alone with its own
    pseudo-gradient: the average is never read again, and its buffer goes back before the download."""
    averager = peers().averager
    sent, average = averager.inputs, averager._outputs
    for buffer in (*sent, *average):
        buffer.fill_(1.0)
    averager.release_average()
    assert all(float(t.sum()) == t.numel() for t in sent)  # kept whole for a solo step
    # released: zeros, but for a few values at the ends that share a page with memory around the buffer
    assert sum(int(t.count_nonzero()) for t in average) < 2 * 4096 // 4 < sum(t.numel() for t in average) / 100
    averager.release()  # once consumed, the sent buffer goes back too
    assert sum(int(t.count_nonzero()) for t in sent) < 2 * 4096 // 4


def test_a_pseudo_gradient_written_in_place_is_the_same():
    cfg = load_config(None, TRAIN_SETS)
    trainer, outer = trainer_and_outer(cfg)
    trainer.train_steps(2)
    expected = outer.pseudo_gradient()
    outer.pseudo_gradient_buffers = flat_tensors([p.shape for p in outer.params], shared=True)
    got = outer.pseudo_gradient()
    assert all(g is b for g, b in zip(got, outer.pseudo_gradient_buffers))
    assert all(torch.equal(g, e) for g, e in zip(got, expected))


@pytest.mark.parametrize("in_place", [True, False], ids=["average-written-over-it", "kept"])
def test_a_solo_step_takes_our_own_pseudo_gradient_even_where_the_average_was_written_over_it(in_place):
    """A GPU peer's blocking round writes the average over the pseudo-gradient it sent (``averages_in_place``); a
    round that then fails, or whose average it refuses, steps alone with its pseudo-gradient computed again from
    the replica, untouched until the outer step: bit for bit the one it sent."""
    cfg = load_config(None, TRAIN_SETS)
    trainer, outer = trainer_and_outer(cfg)
    trainer.train_steps(2)
    outer.pseudo_gradient_buffers = flat_tensors([p.shape for p in outer.params], shared=True)
    sent = outer.pseudo_gradient()
    expected = [t.clone() for t in sent]
    for t in sent:
        t.fill_(float("nan"))  # the average (here a refused one) arrived in the same buffer
    compute = ComputeThread(1)
    exchange = RoundExchange(cfg.averaging, 0, None, "p", outer=outer, averager=SimpleNamespace(in_place=in_place),
                             progress=None, sync=None, healing=None, events=None, compute=compute,
                             should_stop=lambda: False)
    exchange.sent = sent
    try:
        own = asyncio.run(exchange.own_pseudo_gradient())
    finally:
        compute.close()
    if in_place:
        assert all(torch.equal(a, b) for a, b in zip(own, expected))
    else:  # (a lent or separate buffer is never written over: what was sent is what steps)
        assert own is sent


@pytest.mark.parametrize("sent_first, spill, shared", [(0, False, True), (1, False, True), (0, True, True),
                                                       (0, True, False)],
                         ids=["before-the-first-tensor", "after-one-tensor", "before-the-first-tensor-to-a-file",
                              "momentum-off-the-host-to-a-file"])
@pytest.mark.light
def test_a_donor_stepping_during_a_download_serves_the_state_it_started_with(peers, sent_first, spill, shared,
                                                                             tmp_path, monkeypatch):
    """The copy of the unread rest is in memory, or (a state over ``serve_copy_in_memory_mb``) in a file read back
    a tensor at a time, removed when the download ends. A momentum the averager process cannot read where it lies
    (a GPU peer's; here one outside shared memory) is served from a copy written to a file for the download,
    which the step leaves alone, and which goes when the download ends."""
    donor, newcomer = peers(shared=shared), peers()
    donor.advance(2)
    target = donor.target()
    averager = donor.averager.averager
    provide = averager.state_provider
    spilled = []
    if spill:
        (tmp_path / "serve-1-2-3.bin").write_bytes(b"left by a killed process")
        (tmp_path / "download-1-2.bin").write_bytes(b"left by a process killed while downloading")
        (tmp_path / "round-1-2.bin").write_bytes(b"a round kept by a process killed while serving")
        (tmp_path / "replay-1-2.bin").write_bytes(b"a state computed from logged rounds by a process killed then")
        averager.served.spill_to(tmp_path, 0)
        assert not list(tmp_path.iterdir())
        write = state_transfer.SpilledTensors.write
        monkeypatch.setattr(state_transfer.SpilledTensors, "write",
                            lambda path, tensors: spilled.append(write(path, tensors)) or spilled[-1])

    def step_once_sent(slot: int) -> None:  # the donor's outer step, once ``sent_first`` tensors went out
        deadline = time.monotonic() + 5
        while int(averager.serving[slot, 1]) < sent_first and time.monotonic() < deadline:
            time.sleep(0.0005)
        donor.advance(1)

    steps = []

    def provide_and_step():
        answer = provide()  # registers this download, with the live tensors
        stepping = threading.Thread(target=step_once_sent, args=(averager.served.opened[0],))
        steps.append(stepping)
        stepping.start()
        if not sent_first:
            stepping.join()  # stepped before the averager process saw a tensor: all of it comes from the copy
        return answer

    averager.state_provider = provide_and_step
    result = asyncio.run(newcomer.sync.sync(target))
    assert result.ok, result.error  # the hash the donor published for epoch 2 holds for what it sent
    assert newcomer.sync.state_hash == target.state_hash and newcomer.outer.epoch == 2
    steps[0].join(timeout=10)  # (the step sets the epoch before the hash: polling the epoch read the old hash)
    assert donor.outer.epoch == 3 and donor.sync.state_hash != target.state_hash
    n = len(donor.outer.params)
    if spill:  # the unread weights and momentum; or the momentum's copy for the download, then the unread weights
        logged = [s for s in spilled if s.path.name.startswith("round-")]
        spilled = [s for s in spilled if not s.path.name.startswith("round-")]
        assert [len(s) for s in logged] == [n]  # and the step's update, kept for a peer that is behind (round_log)
        assert [len(s) for s in spilled] == ([2 * n] if shared else [n, n])
        deadline = time.monotonic() + 5
        while any(s.path.exists() for s in spilled) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(s.path.exists() for s in spilled), "the file of the download's copy outlived the download"


@pytest.mark.light
def test_a_long_state_download_says_how_far_it_is(peers, monkeypatch, capfd):
    monkeypatch.setattr(state_transfer, "PROGRESS_EVERY", 0.0)  # before the averager processes fork
    handler = logging.StreamHandler(sys.stderr)  # (the daemon configures logging; a test process does not)
    monkeypatch.setattr(state_transfer.logger, "handlers", [handler])
    monkeypatch.setattr(state_transfer.logger, "level", logging.INFO)
    monkeypatch.setattr(state_transfer.logger, "_cache", {})  # (what an earlier test's log call found it enabled for)
    donor, newcomer = peers(), peers()
    donor.advance(1)
    result = asyncio.run(newcomer.sync.sync(donor.target()))
    assert result.ok, result.error
    total = 2 * sum(p.numel() * 4 for p in donor.outer.params) / 1e6
    err = capfd.readouterr().err
    assert f"state download from {donor.id[-8:]}: " in err and f" of {total:,.0f} MB (" in err, err[-2000:]


def test_a_served_copy_goes_to_a_file_read_back_a_tensor_at_a_time_or_stays_in_memory_if_it_cannot(tmp_path):
    served = state_transfer.ServedStates(SimpleNamespace(serving=state_transfer.serving_table()))
    tensors = [torch.arange(6.0).view(2, 3), torch.ones(4, dtype=torch.bfloat16), torch.empty(0)]
    size = sum(t.numel() * t.element_size() for t in tensors)
    spilled = served._spill(tensors, size, tmp_path / "made-when-needed" / "serve.bin")
    assert len(spilled) == 3 and spilled.path.stat().st_size == 6 * 4 + 4 * 2
    assert all(spilled[i].dtype == t.dtype and torch.equal(spilled[i], t) for i, t in enumerate(tensors))
    spilled.remove()
    assert not spilled.path.exists()
    not_a_directory = tmp_path / "a-file"
    not_a_directory.write_text("")
    assert served._spill(tensors, size, not_a_directory / "serve.bin") is None  # freeze then copies them in memory
