"""Checkpoints: exact resume, atomic writes that survive SIGKILL, pruning, refusal of foreign checkpoints."""

import random
import signal
import sys
import textwrap
import time

import pytest
import torch
from conftest import SESSION_ENVIRONMENT, wait_until
from helpers import TRAIN_SETS, state_hash, trainer_and_outer

from diloco_peer.config import CheckpointConfig, load_config
from diloco_peer.state.checkpoint import CheckpointError, CheckpointManager, capture, load_file, restore
from diloco_peer.training.model import param_sha256


def _train_rounds(trainer, outer, rounds):
    for _ in range(rounds):
        trainer.train_steps(3)
        outer.step(outer.pseudo_gradient())


def test_resume_restores_weights_optimizers_epoch_and_schedule_exactly(tmp_path):
    cfg = load_config(None, TRAIN_SETS)
    trainer, outer = trainer_and_outer(cfg)
    _train_rounds(trainer, outer, 2)
    saved_hash = state_hash(trainer, outer)
    manager = CheckpointManager(CheckpointConfig(dir=str(tmp_path)), "alice", cfg.fingerprint())
    manager.save(capture(trainer, outer, cfg.fingerprint())).result()

    fresh_trainer, fresh_outer = trainer_and_outer(cfg)
    assert state_hash(fresh_trainer, fresh_outer) != saved_hash
    state = CheckpointManager(CheckpointConfig(dir=str(tmp_path)), "alice", cfg.fingerprint()).load_latest()
    restore(state, fresh_trainer, fresh_outer)
    assert state_hash(fresh_trainer, fresh_outer) == saved_hash
    assert (fresh_outer.epoch, fresh_trainer.step) == (2, 6)

    # and training goes on exactly as it would have without the interruption
    _train_rounds(trainer, outer, 1)
    _train_rounds(fresh_trainer, fresh_outer, 1)
    assert param_sha256(fresh_outer.params) == param_sha256(outer.params)


def test_keeps_the_last_k_and_writes_in_the_background(tmp_path):
    cfg = load_config(None, TRAIN_SETS)
    trainer, outer = trainer_and_outer(cfg)
    manager = CheckpointManager(CheckpointConfig(dir=str(tmp_path), keep=2, every_rounds=2), "bob", cfg.fingerprint())
    written = []
    for epoch in range(1, 7):
        outer.epoch = epoch
        if manager.due(epoch):
            manager.save(capture(trainer, outer, cfg.fingerprint()), lambda p, s, n: written.append((p.name, n)))
    manager.close()
    assert [name for name, _ in written] == ["epoch-000002.pt", "epoch-000004.pt", "epoch-000006.pt"]
    assert all(size > 1_000_000 for _, size in written)  # 0.36M fp32 params, momentum, AdamW state
    assert [p.name for p in manager.files()] == ["epoch-000006.pt", "epoch-000004.pt"]
    assert manager.load_latest().epoch == 6


def test_refuses_a_checkpoint_of_another_model_with_a_one_line_error(tmp_path):
    cfg = load_config(None, TRAIN_SETS)
    trainer, outer = trainer_and_outer(cfg)
    CheckpointManager(CheckpointConfig(dir=str(tmp_path)), "carol", cfg.fingerprint()).save(
        capture(trainer, outer, cfg.fingerprint())).result()
    other = load_config(None, [*TRAIN_SETS, "model.hidden_size=64"])
    with pytest.raises(CheckpointError) as err:
        CheckpointManager(CheckpointConfig(dir=str(tmp_path)), "carol", other.fingerprint()).load_latest()
    message = str(err.value)
    assert "another model or run" in message and "checkpoint.dir" in message and "\n" not in message


def test_garbage_and_pickles_are_refused(tmp_path):
    bad = tmp_path / "epoch-000001.pt"
    bad.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_file(bad, "x")

    marker = tmp_path / "pickle-code-ran"

    class Evil:
        def __reduce__(self):  # unpickling calls open(marker, "w"): the file appears iff the payload runs
            return (open, (str(marker), "w"))

    torch.save({"format_version": 1, "payload": Evil()}, bad)
    torch.load(bad, weights_only=False)  # the payload is live: a pickle-based loader would run it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(CheckpointError, match="cannot be read") as err:  # weights_only: no pickled code runs
        load_file(bad, "x")
    assert not marker.exists() and "\n" not in str(err.value)


WRITER = textwrap.dedent("""
    import sys, torch
    from diloco_peer.state.checkpoint import CheckpointManager, PeerState
    from diloco_peer.config import CheckpointConfig
    manager = CheckpointManager(CheckpointConfig(dir=sys.argv[1], keep=2), "victim", "fp")
    epoch = (manager.load_latest() or PeerState("fp", 0, 0, [], [], {}, torch.zeros(1))).epoch
    print("ready", flush=True)
    while True:
        epoch += 1
        params = [torch.full((1_000_000,), float(epoch)) for _ in range(4)]  # 16 MB: writes take a while
        manager.save(PeerState("fp", epoch, epoch * 10, params, params, {}, torch.zeros(1))).result()
""")


@pytest.mark.light
@pytest.mark.slow
def test_sigkill_during_writes_always_leaves_a_loadable_checkpoint(tmp_path, zygote):
    rng = random.Random(1234)
    previous_epoch = 0
    writer, checkpoints = tmp_path / "writer.py", tmp_path / "checkpoints"
    writer.write_text(WRITER)
    for attempt in range(8):
        # forked from the tests' zygote, torch imported already: 8 fresh interpreters were most of this test's time
        out = tmp_path / f"writer-{attempt}.out"
        with open(out, "w") as stdout:
            proc = zygote.spawn([sys.executable, str(writer), str(checkpoints)], stdout, SESSION_ENVIRONMENT, tmp_path)
        wait_until(lambda out=out, proc=proc: out.read_text() or proc.poll() is not None, "the writer's ready",
                   timeout=60)
        assert out.read_text().strip() == "ready", out.read_text()
        time.sleep(rng.uniform(0.05, 0.6))  # seeded: lands before, during or between writes
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        manager = CheckpointManager(CheckpointConfig(dir=str(checkpoints), keep=2), "victim", "fp")
        assert not list(manager.dir.glob("*.tmp")), "a half-written file survived the restart"
        state = manager.load_latest()
        if state is None:
            assert previous_epoch == 0
            continue
        # the newest file is complete: every tensor holds its epoch, nothing torn
        assert state.epoch >= previous_epoch and state.inner_step == state.epoch * 10
        assert all(bool((t == state.epoch).all()) for t in state.outer_params + state.momentum)
        for path in manager.files():
            assert load_file(path, "fp").epoch <= state.epoch
        previous_epoch = state.epoch
    assert previous_epoch >= 3, "the writer never got far enough for the test to mean anything"
