"""State sync: choosing the swarm's state, downloading it from real peers, refusing bad or stale donors."""

import asyncio
import gc
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from conftest import wait_until
from helpers import SYNC_SETS, SyncPeer
from hivemind.compression import NoCompression

from diloco_peer.averaging import round_log, state_files, state_transfer
from diloco_peer.config import load_config
from diloco_peer.config.faults import FAULT_ENV, NO_FAULTS, Faults
from diloco_peer.state import state_sync
from diloco_peer.state.state_sync import FALLING_BEHIND
from diloco_peer.state.target import Target, swarm_target
from diloco_peer.swarm.progress_store import add_progress_validators, fetch_progress
from diloco_peer.swarm.progress_record import ProgressRecord
from diloco_peer.training.model import param_sha256, state_digest


def _record(peer, epoch, state_hash, joined=True):
    return ProgressRecord(peer_id=peer, epoch=epoch, inner_step=0, tokens=0, ready=False, state_hash=state_hash,
                          joined=joined, time=time.time())


def _swarm(*epochs, liar_epoch=None):
    """Honest peers at ``epochs`` (peers at one epoch averaged together: one hash per epoch), plus a liar."""
    records = [_record(f"p{i}", e, f"h{e}") for i, e in enumerate(epochs)]
    return records + ([_record("liar", liar_epoch, "0" * 64)] if liar_epoch is not None else [])


def test_target_is_the_quorum_epoch_and_the_majority_hash():
    assert swarm_target([]) is None
    records = [_record("a", 3, "h1"), _record("b", 3, "h2"), _record("c", 3, "h2"), _record("d", 2, "h0"),
               _record("e", 1, "")]
    assert swarm_target(records) == Target(3, "h2", ["b", "c"])
    # a tie is broken the same way on every peer: the smallest hash
    assert swarm_target([_record("a", 5, "ff"), _record("b", 5, "0a")]) == Target(5, "0a", ["b"])
    # quorum 0 is the maximum any peer claims (the rule before quorums)
    assert swarm_target([_record("a", 4, "x"), _record("b", 9, "y")], quorum=0).epoch == 9


@pytest.mark.parametrize("honest, expected", [
    ((5,), 5),  # a swarm of 2
    ((5, 5), 5), ((5, 4), 5), ((4, 4), 4),  # of 3, also while a round ends (one peer has stepped)
    ((0, 0), 0),  # the first round of a new swarm
    ((7, 7, 7, 7), 7), ((8, 8, 7, 7), 8), ((8, 7, 7, 7), 7),  # of 5
])
def test_a_lone_liar_is_never_followed(honest, expected):
    target = swarm_target(_swarm(*honest, liar_epoch=1000))
    assert target.epoch == expected and target.state_hash == f"h{expected}" and "liar" not in target.holders
    # nor when it claims the honest epoch with a hash of its own, against peers that averaged together
    if honest.count(expected) > 1:
        assert swarm_target(_swarm(*honest, liar_epoch=expected)).state_hash == f"h{expected}"


@pytest.mark.parametrize("epochs, expected", [
    ((6, 6), 6), ((6, 5), 5),  # 2 peers: both must have stepped
    ((6, 6, 5), 6), ((6, 5, 5), 5),  # 3: two of them
    ((6, 6, 6, 5, 5), 6), ((6, 6, 5, 5, 5), 5),  # 5: three of them
    ((9, 9, 9, 3), 9),  # a straggler (or a peer restarted from an old checkpoint) catches up with the majority
])
def test_a_majority_that_advanced_is_followed(epochs, expected):
    target = swarm_target(_swarm(*epochs))
    assert target.epoch == expected and target.holders == [f"p{i}" for i, e in enumerate(epochs) if e == expected]


def test_peers_that_have_not_joined_do_not_vote():
    """Newcomers (and restarted peers) know nothing of the swarm's progress: they must not outvote it."""
    established = [_record("a", 5, "h5"), _record("b", 5, "h5")]
    newcomers = [_record(f"new{i}", 0, "h0", joined=False) for i in range(3)]
    assert swarm_target(established + newcomers) == Target(5, "h5", ["a", "b"])
    # had they voted, three newcomers at epoch 0 would have split the swarm
    assert swarm_target(established + [r.copy(update={"joined": True}) for r in newcomers]).epoch == 0
    # a lone founder is followed by newcomers; so is the swarm by a peer restarted from an old checkpoint
    assert swarm_target([_record("founder", 9, "h9")] + newcomers).holders == ["founder"]
    assert swarm_target([_record("a", 10, "h10"), _record("restarted", 8, "h8", joined=False)]).epoch == 10
    # while nobody has joined (a swarm starting), everybody votes
    assert swarm_target(newcomers + [_record("liar", 1000, "0" * 64, joined=False)]).epoch == 0


@pytest.mark.light
def test_newcomer_downloads_weights_momentum_and_epoch(peers):
    donor, newcomer = peers(), peers()
    donor.advance(3)
    result = asyncio.run(newcomer.sync.sync(donor.target()))
    assert result.ok, result.error
    assert (result.epoch, newcomer.outer.epoch, result.donor) == (3, 3, donor.id)
    assert param_sha256(newcomer.outer.params) == param_sha256(donor.outer.params)
    assert newcomer.sync.state_hash == donor.sync.state_hash == newcomer.sync._own_hash()
    assert param_sha256(newcomer.outer.momentum_buffers()) == param_sha256(donor.outer.momentum_buffers())
    assert param_sha256(newcomer.outer.model.parameters()) == param_sha256(donor.outer.params)  # the replica too
    payload = 2 * sum(p.numel() * 4 for p in donor.outer.params)
    assert payload <= result.bytes < payload * 1.05 and donor.served == [(3, payload)]
    # where the time went (a 1B joiner spent ~30 s between its download and the next step, untold): every stage
    # timed, the donor's logged rounds asked for first (3 behind: within averaging.log_rounds; it had none)
    assert list(result.stages) == ["rounds", "download", "check", "load"], result
    assert all(t >= 0 for t in result.stages.values()), result
    assert sum(result.stages.values()) <= result.seconds + 0.01, result
    # after the same outer step with the same update, both stay bit-identical (momentum came along)
    update = [torch.randn_like(p) for p in donor.outer.params]
    donor.outer.step(update)
    newcomer.outer.step(update)
    assert param_sha256(newcomer.outer.params) == param_sha256(donor.outer.params)


@pytest.mark.light
def test_a_peer_that_only_ever_syncs_says_why_it_does_not_catch_up(peers, caplog):
    """A joiner whose download outlasts the swarm's rounds arrives one epoch late each time and downloads again (on
    an H200: 13 downloads in 200 s and no round). After ``FALLING_BEHIND`` syncs with no round of its own between
    them it says why, once; a round of its own starts the count again."""
    donor, newcomer = peers(), peers()
    for _ in range(FALLING_BEHIND + 1):
        donor.advance(1)
        assert asyncio.run(newcomer.sync.sync(donor.target())).ok
    warned = [r.getMessage() for r in caplog.records if "syncs in a row" in r.getMessage()]
    assert len(warned) == 1 and f"from epoch 1 to {FALLING_BEHIND}" in warned[0], warned
    assert "outer.inner_steps" in warned[0] and len(newcomer.sync.behind) == FALLING_BEHIND + 1
    newcomer.advance(1)
    assert newcomer.sync.behind == []


def _fp16_rounds(*peers_, rounds=1):
    """``rounds`` outer steps with the same update on every peer, of fp16 values (as a swarm averaging in fp16)."""
    for _ in range(rounds):
        update = [(torch.randn_like(p) * 0.01).half().float() for p in peers_[0].outer.params]
        for peer in peers_:
            with peer.sync.lock:
                peer.outer.step(update)
                peer.sync.after_outer_step()


@pytest.mark.light
def test_a_peer_rounds_behind_catches_up_with_their_logged_updates_not_the_state(peers, tmp_path, monkeypatch):
    """A joiner whose download outlasted rounds downloaded the state again, and again (``FALLING_BEHIND``): the
    donor now logs the rounds that end while someone downloads, and a peer a few rounds behind computes the
    swarm's state from its own and those updates, bit-identical (its hash is the published one), for fewer bytes:
    fp16 averages travel as fp16 (3 rounds: 6 bytes per parameter, the state is 8), fp32 ones as fp32 (1 round).
    The state it computes waits for its check in a file of its spill directory, not beside ours in memory."""
    donor, newcomer = peers(), peers()
    newcomer.averager.averager.served.spill_to(tmp_path / "joiner", 2**30)
    made, create = [], state_files.SpilledTensors.create
    monkeypatch.setattr(state_files.SpilledTensors, "create",
                        lambda path, shapes: made.append((path, weakref.ref(staged := create(path, shapes)))) or staged)
    numel = sum(p.numel() for p in donor.outer.params)
    donor.advance(1)
    assert asyncio.run(newcomer.sync.sync(donor.target())).rounds == 0  # a download: the donor logs what follows
    _fp16_rounds(donor, rounds=3)
    result = asyncio.run(newcomer.sync.sync(donor.target()))
    assert result.ok and result.rounds == 3 and len(donor.served) == 1 and list(result.stages) == ["rounds"], result
    assert 6 * numel <= result.bytes < 6.3 * numel, (result.bytes, numel)
    assert newcomer.outer.epoch == 4 and newcomer.sync.state_hash == donor.sync.state_hash == newcomer.sync._own_hash()
    assert param_sha256(newcomer.outer.momentum_buffers()) == param_sha256(donor.outer.momentum_buffers())
    assert param_sha256(newcomer.outer.model.parameters()) == param_sha256(donor.outer.params)
    replayed = [(path, ref) for path, ref in made if path.name.startswith("replay-")]
    assert [path.parent for path, _ in replayed] == [tmp_path / "joiner"], made
    gc.collect()
    assert replayed[0][1]() is None and not replayed[0][0].exists(), "the replay's file outlived its state"
    donor.averager.averager.served.spill_to(tmp_path, 0)  # a big state: the log goes to files
    donor.advance(1)  # fp32: one round is half the state
    assert [p.name.split("-")[2] for p in tmp_path.glob("round-*.bin")] == ["5"]  # (round-PID-EPOCH-N.bin)
    result = asyncio.run(newcomer.sync.sync(donor.target()))
    assert result.ok and result.rounds == 1 and 4 * numel <= result.bytes < 4.2 * numel, result
    assert newcomer.sync.state_hash == donor.sync.state_hash == newcomer.sync._own_hash()
    donor.sync.log.remove_files()  # (as the daemon does when it leaves)
    assert not list(tmp_path.glob("round-*.bin"))
    donor.advance(2)  # two fp32 rounds weigh as much as the state: it is downloaded instead
    result = asyncio.run(newcomer.sync.sync(donor.target()))
    assert result.ok and result.rounds == 0 and len(donor.served) == 2, result
    assert list(result.stages) == ["rounds", "download", "check", "load"], result  # (the rounds asked for first)
    assert newcomer.sync.state_hash == donor.sync.state_hash


@pytest.mark.light
def test_rounds_are_logged_only_for_a_peer_likely_behind_and_never_replayed_onto_another_state(peers, monkeypatch,
                                                                                               caplog):
    """Nothing is logged without a download in flight or begun within two rounds (at least ``MIN_WINDOW``), and
    a log is dropped once nobody downloads; a peer whose state is not the one the logged rounds start from (here:
    a step of its own) downloads the state."""
    caplog.set_level("INFO", logger=round_log.__name__)
    donor, newcomer, other = peers(), peers(), peers()
    donor.advance(1)
    assert asyncio.run(newcomer.sync.sync(donor.target())).ok and asyncio.run(other.sync.sync(donor.target())).ok
    other.advance(1)  # its own step: the log of the donor's next round does not start from its state
    _fp16_rounds(donor)
    assert donor.sync.log.logged == 1
    result = asyncio.run(other.sync.sync(donor.target()))
    assert result.ok and result.rounds == 0 and len(donor.served) == 3, result  # the state, downloaded
    later = time.time() + round_log.MIN_WINDOW + 1  # no download since: after a round that long (the download
    clock = SimpleNamespace(time=lambda: later, perf_counter=time.perf_counter)  # began within two), not logged
    monkeypatch.setattr(round_log, "time", clock)
    _fp16_rounds(donor, rounds=2)
    assert donor.sync.log.logged == 0  # nobody downloading: dropped, in the averager process too
    result = asyncio.run(newcomer.sync.sync(donor.target()))
    assert result.ok and result.rounds == 0 and newcomer.sync.state_hash == donor.sync.state_hash, result
    # a donor with nothing to send says so (an empty list of epochs), no error on either side
    assert not [r.getMessage() for r in caplog.records if "no rounds from" in r.getMessage()]


@pytest.mark.light
def test_bad_donors_are_skipped_and_the_next_one_tried(peers):
    good, declining, newcomer = peers(), peers(), peers()
    good.advance(2)
    declining.advance(2)
    declining.averager.averager.allow_state_sharing = False
    target = Target(2, good.sync.state_hash, [declining.id, good.id])
    for _ in range(5):  # donors are shuffled: whatever the order, the good one ends up used
        newcomer.outer.epoch = 0
        result = asyncio.run(newcomer.sync.sync(target))
        assert result.ok and result.donor == good.id and result.attempts in (1, 2), result
    assert param_sha256(newcomer.outer.params) == param_sha256(good.outer.params)


@pytest.mark.light
def test_a_download_broken_off_resumes_from_another_donor_where_it_was(peers, monkeypatch, caplog):
    """The first donor's stream ends after 5 tensors (fault ``break_serve``): the next donor sends the rest only,
    the 5 tensors kept having matched the digests listed for the swarm's state."""
    good, newcomer, breaking = peers(), peers(), peers(faults=Faults.parse("break_serve:5"))
    good.advance(2)
    assert asyncio.run(breaking.sync.sync(good.target())).ok  # it holds (and publishes) the swarm's very state
    monkeypatch.setattr(state_sync.random, "shuffle", lambda donors: None)  # the breaking donor is tried first
    with caplog.at_level("INFO", logger=state_sync.__name__):
        result = asyncio.run(newcomer.sync.sync(Target(2, good.sync.state_hash, [breaking.id, good.id])))
    assert result.ok and result.donor == good.id and result.attempts == 2, result
    n = len(good.outer.params)
    assert result.donor_errors == [f"donor {breaking.id[-8:]}: the state download broke off after 5 of {2 * n} tensors"]
    assert f"resuming at tensor 5 of {2 * n} from {good.id[-8:]}" in caplog.text
    state = [*good.outer.params, *good.outer.momentum_views]
    rest = sum(t.numel() * 4 for t in state[5:])  # what the good donor sent: the rest, not the whole state again
    assert rest <= result.bytes < rest + (state[0].numel() * 4) // 2, (rest, result.bytes)
    assert newcomer.sync.state_hash == good.sync.state_hash == newcomer.sync._own_hash()
    assert newcomer.sync.digests == good.sync.digests


@pytest.mark.light
@pytest.mark.parametrize("shared", [False, True], ids=["momentum-off-the-host", "momentum-in-shared-memory"])
def test_the_momentum_is_downloaded_into_a_file_and_resumed_there(peers, monkeypatch, tmp_path, shared):
    """A download stages the momentum half in a file of the peer's spill directory, not in memory (4 bytes per
    parameter less on the host for the length of a sync: the peak of a CPU joiner): a GPU peer's momentum lives on
    its GPU (``outer.momentum_on``; here: outside shared memory), a CPU peer's in shared memory. Broken off inside
    that half, it resumes there from the next donor; the file goes once the state is ours."""
    good = peers()
    n = len(good.outer.params)
    newcomer, breaking = peers(shared=shared), peers(faults=Faults.parse(f"break_serve:{n + 3}"))
    good.advance(2)
    assert asyncio.run(breaking.sync.sync(good.target())).ok  # it holds (and publishes) the swarm's very state
    newcomer.averager.averager.served.spill_to(tmp_path, 0)
    made, create = [], state_files.SpilledTensors.create
    monkeypatch.setattr(state_files.SpilledTensors, "create",
                        lambda path, shapes: made.append((path, weakref.ref(staged := create(path, shapes)))) or staged)
    monkeypatch.setattr(state_sync.random, "shuffle", lambda donors: None)  # the breaking donor is tried first
    result = asyncio.run(newcomer.sync.sync(Target(2, good.sync.state_hash, [breaking.id, good.id])))
    assert result.ok and result.donor == good.id and result.attempts == 2, result
    made = [(path, ref) for path, ref in made if "rounds" not in path.name]  # (not the replay's: nothing logged)
    assert [path.parent for path, _ in made] == [tmp_path]
    assert newcomer.sync.state_hash == good.sync.state_hash == newcomer.sync._own_hash()
    assert param_sha256(newcomer.outer.momentum_buffers()) == param_sha256(good.outer.momentum_buffers())
    state = [*good.outer.params, *good.outer.momentum_views]
    rest = sum(t.numel() * 4 for t in state[n + 3:])  # the good donor sent the momentum's rest only
    assert rest <= result.bytes < rest + (state[0].numel() * 4) // 2, (rest, result.bytes)
    gc.collect()
    assert made[0][1]() is None and not made[0][0].exists(), "the download's file outlived the state it staged"


@pytest.mark.parametrize("fault, reason", [
    ("corrupt_state", "the state it sent (weights, momentum, epoch, LR position) does not match the hash it published"),
    ("corrupt_state:nan", "it sent non-finite values"),
    # it publishes epoch 2 and the swarm's hash, but serves its state as epoch 1000
    ("lie_epoch:1000", "it sent epoch 1000, expected the swarm's 2 (>= ours, 0)"),
])
@pytest.mark.light
def test_a_corrupt_or_lying_donor_is_rejected_with_its_reason_and_the_next_one_used(peers, monkeypatch, fault, reason):
    good, newcomer, bad = peers(), peers(), peers(faults=Faults.parse(fault))
    good.advance(2)
    assert asyncio.run(bad.sync.sync(good.target())).ok  # it holds (and publishes) the swarm's very state
    assert bad.sync.state_hash == good.sync.state_hash
    monkeypatch.setattr(state_sync.random, "shuffle", lambda donors: None)  # the bad donor is tried first
    result = asyncio.run(newcomer.sync.sync(Target(2, good.sync.state_hash, [bad.id, good.id])))
    assert result.ok and result.donor == good.id and result.attempts == 2, result
    assert result.donor_errors == [f"donor {bad.id[-8:]} rejected: {reason}"]
    assert len(bad.served) == 1 and newcomer.sync._own_hash() == good.sync.state_hash
    assert newcomer.outer.epoch == 2
    offenses, deadline = [], time.monotonic() + 10  # counted in the averager process, towards a ban
    while not offenses and time.monotonic() < deadline:
        time.sleep(0.1)
        offenses = newcomer.averager.offenses()
    assert [(o["offender"], o["kind"], o["detail"]) for o in offenses] == [(bad.id, "state", reason)], offenses


@pytest.mark.light
def test_an_honest_donor_named_by_a_forged_record_is_no_offender(peers):
    """Progress records are signed by per-process keys, not peer ids: anyone can publish one under an honest
    peer's id claiming a state that peer does not hold. A syncing peer then downloads the honest state, which
    is what its donor says it is (in the reply libp2p authenticates) but not the record's claim: the claim is
    distrusted (``rejected``), and no offense counts against the honest peer. A donor whose reply contradicts
    itself still is an offender."""
    good, newcomer, bad = peers(), peers(), peers(faults=Faults.parse("corrupt_state:nan"))
    good.advance(2)
    assert asyncio.run(bad.sync.sync(good.target())).ok
    forged = [Target(2, "f" * 64, [good.id]), Target(4, good.sync.state_hash, [good.id])]  # another hash, epoch
    for target in forged:
        result = asyncio.run(newcomer.sync.sync(target))
        assert not result.ok and result.rejected == [good.id] and len(result.donor_errors) == 1, result
        assert newcomer.outer.epoch == 0  # nothing was taken in
    result = asyncio.run(newcomer.sync.sync(Target(2, good.sync.state_hash, [bad.id])))
    assert not result.ok and result.rejected == [bad.id], result
    offenses, deadline = [], time.monotonic() + 10  # reported in order: the bad donor's comes after any other
    while not offenses and time.monotonic() < deadline:
        time.sleep(0.1)
        offenses = newcomer.averager.offenses()
    assert [(o["offender"], o["kind"]) for o in offenses] == [(bad.id, "state")], offenses


@pytest.mark.light
@pytest.mark.parametrize("poison", ["momentum", "inner_step", "momentum, self-consistent"])
def test_a_donor_serving_the_true_weights_with_poisoned_momentum_or_lr_position_is_refused(peers, poison):
    """An attacker's client (its state provider replaced, not a fault hook) serves the swarm's weights and
    epoch with momentum x100 (it was accepted before: the newcomer's loss went to 87 against ~2.4), or with
    another LR position. It is refused either way; it is an offense when its reply contradicts itself (the hash
    it sends with the state is the swarm's), and none when it also rewrites that hash and the tensor digests to
    match its poison: then its reply is what it says, and only the record naming it lies, which anyone can forge
    under its id (SECURITY.md). That claim is distrusted instead."""
    good, newcomer, bad = peers(), peers(), peers()
    good.advance(2)
    assert asyncio.run(bad.sync.sync(good.target())).ok and bad.sync.state_hash == good.sync.state_hash
    honest_state = bad.averager.averager.state_provider

    def poisoned_state():
        metadata, tensors = honest_state()
        n = len(bad.outer.params)
        if poison.startswith("momentum"):
            tensors[n:] = [t * 100 for t in tensors[n:]]
        else:
            metadata["inner_step"] += 7
        if poison.endswith("self-consistent"):
            digests = [param_sha256([t]) for t in tensors]
            metadata = {**metadata, state_sync.DIGESTS: digests,
                        "state_hash": state_digest(digests, metadata["epoch"], metadata["inner_step"])}
        return metadata, tensors

    bad.averager.averager.state_provider = poisoned_state
    result = asyncio.run(newcomer.sync.sync(Target(2, good.sync.state_hash, [bad.id])))
    reason = "the state it sent (weights, momentum, epoch, LR position) does not match the hash it published"
    assert not result.ok and result.donor_errors == [f"donor {bad.id[-8:]} rejected: {reason}"], result
    assert newcomer.outer.epoch == 0 and newcomer.sync.state_hash != good.sync.state_hash  # ours untouched
    assert result.rejected == [bad.id]  # the claim that named it is distrusted (target.after_failed_sync)
    offenses, deadline = [], time.monotonic() + (3 if poison.endswith("self-consistent") else 10)
    while not offenses and time.monotonic() < deadline:
        time.sleep(0.1)
        offenses = newcomer.averager.offenses()
    expected = [] if poison.endswith("self-consistent") else [(bad.id, "state")]
    assert [(o["offender"], o["kind"]) for o in offenses] == expected, offenses


def test_a_donor_that_stalls_is_given_up_on_within_the_sync_timeout_and_the_next_one_used(peers, monkeypatch):
    """An attacker's client whose state provider hangs (a donor that takes the request, then sends nothing)."""
    good, newcomer, staller = peers(), peers(), peers()
    good.advance(2)
    assert asyncio.run(staller.sync.sync(good.target())).ok and staller.sync.state_hash == good.sync.state_hash
    honest_state = staller.averager.averager.state_provider

    def stalled_state():
        time.sleep(staller.sync.cfg.sync_timeout + 2)  # past the downloader's patience, not the test's
        return honest_state()

    staller.averager.averager.state_provider = stalled_state
    monkeypatch.setattr(state_sync.random, "shuffle", lambda donors: None)  # the staller is tried first
    started = time.monotonic()
    result = asyncio.run(newcomer.sync.sync(Target(2, good.sync.state_hash, [staller.id, good.id])))
    assert result.ok and result.donor == good.id and result.attempts == 2, result
    assert len(result.donor_errors) == 1 and result.donor_errors[0].startswith(f"donor {staller.id[-8:]}: ")
    timeout = newcomer.sync.cfg.sync_timeout
    assert timeout <= time.monotonic() - started < timeout + 5, result
    assert newcomer.sync.state_hash == good.sync.state_hash


def test_a_donor_that_serves_then_stalls_is_given_up_on_and_the_next_one_sends_the_rest(peers, monkeypatch):
    """A donor that sends 5 tensors, then nothing, its stream left open (fault ``stall_serve``): the newcomer gives
    up on it within its sync timeout and the next donor sends the rest only; no offense (a stall may be the
    network)."""
    good, newcomer, staller = peers(), peers(), peers(faults=Faults.parse("stall_serve:5"))
    good.advance(2)
    assert asyncio.run(staller.sync.sync(good.target())).ok  # it holds (and publishes) the swarm's very state
    monkeypatch.setattr(state_sync.random, "shuffle", lambda donors: None)  # the staller is tried first
    started = time.monotonic()
    result = asyncio.run(newcomer.sync.sync(Target(2, good.sync.state_hash, [staller.id, good.id])))
    waited = time.monotonic() - started
    assert result.ok and result.donor == good.id and result.attempts == 2, result
    assert len(result.donor_errors) == 1 and result.donor_errors[0].startswith(f"donor {staller.id[-8:]}: ")
    timeout = newcomer.sync.cfg.sync_timeout
    assert timeout <= waited < timeout + 5, (waited, result)
    state = [*good.outer.params, *good.outer.momentum_views]
    rest = sum(t.numel() * 4 for t in state[5:])  # what the good donor sent: the rest, not the whole state again
    assert rest <= result.bytes < rest + (state[0].numel() * 4) // 2, (rest, result.bytes)
    assert newcomer.sync.state_hash == good.sync.state_hash == newcomer.sync._own_hash()
    time.sleep(1.0)
    assert newcomer.averager.offenses() == []


@pytest.mark.light
def test_a_donor_that_trained_on_during_the_download_is_no_offense(peers):
    good, newcomer = peers(), peers()
    good.advance(2)
    result = asyncio.run(newcomer.sync.sync(Target(1, "hash of epoch 1", [good.id])))  # the swarm stepped on
    assert not result.ok and result.moved_on, result  # the daemon asks the swarm for its new state at once
    assert result.donor_errors == [f"donor {good.id[-8:]} rejected: it sent epoch 2, expected the swarm's 1 "
                                   f"(>= ours, 0)"]
    time.sleep(1.0)
    assert newcomer.averager.offenses() == []  # nothing counts towards a ban
    # what it sent is the swarm's new state: taken as it is (a 1.2 GB llama-150m state was downloaded 3 times
    # when the donor stepped during each download, BENCHMARKS.md)
    downloaded = result.bytes
    retry = asyncio.run(newcomer.sync.sync(good.target(), reuse=result)).after(result)
    assert retry.ok and retry.attempts == 1 and retry.bytes == downloaded > 0 and len(good.served) == 1, retry
    assert retry.donor_errors == result.donor_errors  # the daemon's one sync event names both tries
    assert newcomer.outer.epoch == 2 and newcomer.sync.state_hash == good.sync.state_hash == newcomer.sync._own_hash()
    assert result.later is None  # handed over: its memory is not held twice


@pytest.mark.light
def test_a_later_state_that_is_not_the_new_target_is_downloaded_again(peers):
    good, newcomer = peers(), peers()
    good.advance(2)
    result = asyncio.run(newcomer.sync.sync(Target(1, "hash of epoch 1", [good.id])))
    assert result.moved_on and result.later is not None, result
    good.advance(1)  # the swarm stepped once more: what was sent (epoch 2) is not its target (epoch 3)
    downloaded = result.bytes
    retry = asyncio.run(newcomer.sync.sync(good.target(), reuse=result)).after(result)
    assert retry.ok and retry.bytes > 1.99 * downloaded and len(good.served) == 2, retry  # (epoch 3's metadata)
    assert newcomer.outer.epoch == 3 and newcomer.sync._own_hash() == good.sync.state_hash


@pytest.mark.light
def test_states_that_fail_the_checks_are_refused(peers):
    donor, newcomer = peers(), peers()
    foreign = peers(fingerprint="another-model")
    donor.advance(2)
    before = param_sha256(newcomer.outer.params)

    lying = Target(2, "0" * 64, [donor.id])  # the published hash does not match what is sent
    result = asyncio.run(newcomer.sync.sync(lying))
    assert not result.ok and "does not match the hash" in result.error

    newcomer.outer.epoch = 5  # the donor's state is older than ours
    result = asyncio.run(newcomer.sync.sync(donor.target()))
    assert not result.ok and "older than ours (5)" in result.error and result.bytes == 0

    foreign.advance(2)
    newcomer.outer.epoch = 0
    result = asyncio.run(newcomer.sync.sync(foreign.target()))
    assert not result.ok and "fingerprint" in result.error
    assert param_sha256(newcomer.outer.params) == before, "a refused state must leave ours untouched"

    result = asyncio.run(newcomer.sync.sync(Target(2, "x", [newcomer.id])))
    assert not result.ok and result.error == "no peer holds the swarm's state"


@pytest.mark.light
def test_needs_sync_says_why(peers):
    me = peers()
    assert me.sync.needs_sync(None) == ""
    assert me.sync.needs_sync(me.target()) == ""
    assert "the swarm is at epoch 4, we are at 0" in me.sync.needs_sync(Target(4, "h", ["x"]))
    assert "differ from the swarm's (held by 2 peers)" in me.sync.needs_sync(Target(0, "h", ["x", "y"]))


@pytest.mark.slow
def test_a_newcomer_rejects_a_corrupt_donor_and_syncs_from_an_honest_one(local_swarm, monkeypatch):
    """Two peers train together; one serves corrupt weights (finite, plausible, not matching its hash)."""
    local_swarm.start_bootstrap()
    sets = ["averaging.min_peers=2", "outer.inner_steps=30"]
    local_swarm.start_peer("honest", *sets)
    local_swarm.start_peer("corrupt", *sets, env={FAULT_ENV: "corrupt_state"})

    def peer_id(name):
        return next((e["peer_id"] for e in local_swarm.events(name) if e["event"] == "start"), None)

    def serves(name):
        return [e for e in local_swarm.events(name) if e["event"] == "serve"]

    ids = {name: wait_until(lambda: peer_id(name), f"{name} start") for name in ("honest", "corrupt")}
    rejected = (f"donor {ids['corrupt'][-8:]} rejected: the state it sent (weights, momentum, epoch, LR position) "
                f"does not match the hash it published")

    # 1. a newcomer in this process, where the donor order can be fixed: the corrupt donor is tried first
    cfg = load_config(None, SYNC_SETS)
    newcomer = SyncPeer(cfg, [local_swarm.address])
    try:
        add_progress_validators(newcomer.dht, cfg.run.run_id)

        def target_held_by_both():  # between two rounds: both averaged into the same state
            target = swarm_target(asyncio.run(fetch_progress(newcomer.dht, cfg.run.run_id)))
            return target if target and target.epoch >= 1 and set(target.holders) == set(ids.values()) else None

        monkeypatch.setattr(state_sync.random, "shuffle", lambda donors: donors.sort(key=lambda d: d != ids["corrupt"]))
        results = []
        while len(results) < 3:  # if the swarm steps while we download, the honest state moves on: take the next
            target = wait_until(target_held_by_both, "state held by both peers")
            results.append(result := asyncio.run(newcomer.sync.sync(target)))
            if result.ok or "expected the swarm's" not in result.error:
                break
        assert result.ok and result.donor == ids["honest"] and result.donor_errors == [rejected], results
        assert newcomer.sync.state_hash == target.state_hash and newcomer.outer.epoch == target.epoch
    finally:
        newcomer.close()
    assert serves("corrupt")
    monkeypatch.undo()

    # 2. a real newcomer, donors in random order: whichever it tried first, it ends on the honest peer's state
    local_swarm.start_peer("new", *sets)
    synced = wait_until(lambda: [e for e in local_swarm.events("new") if e["event"] == "sync" and e["ok"]],
                         "successful sync")[0]
    assert synced["donor"] == ids["honest"], synced
    # the honest peer may download too: a round cut short under load leaves it behind, and it catches up
    syncs = [e for name in ("new", "honest") for e in local_swarm.events(name) if e["event"] == "sync"]
    refusals = [err for e in syncs for err in e["donor_errors"] if ids["corrupt"][-8:] in err]
    # (or, served while it stepped, refused as a donor that moved on, as in part 1: no offense, nothing taken; CI
    # 2026-11-27: "it sent epoch 4, expected the swarm's 3")
    moved_on = f"donor {ids['corrupt'][-8:]} rejected: it sent epoch "

    def refused(err: str) -> bool:  # its corrupt state, or its state of an epoch the swarm had moved on from
        return err == rejected or err.startswith(moved_on) and "expected the swarm's" in err

    assert all(refused(err) for err in refusals), refusals
    # every state the corrupt peer served was refused, by us and by each peer each time it tried it (ours too may have
    # been refused as a donor that moved on first: a fresh clone's suite, it sent epoch 2 where the swarm's was 1)
    ours = sum(refused(err) for r in results for err in r.donor_errors)
    assert len(serves("corrupt")) == ours + len(refusals), (serves("corrupt"), results, syncs)


def test_a_donor_ends_with_an_end_mark_and_waits_for_the_downloader_to_hang_up():
    """p2pd may drop a stream's last messages when their sender hangs up first (``p2pd_internals``): a donor's
    stream ends with an end mark, after which the donor waits, open, until the downloader hangs up."""
    donor = SimpleNamespace(state_compression=NoCompression(), faults=NO_FAULTS)
    tensors = [torch.randn(3, 4), torch.randn(5)]

    async def serve_and_hang_up():
        stream = state_transfer.serve(donor, b"metadata", tensors, None)
        messages = [await anext(stream) for _ in range(len(tensors) + 1)]
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.5)
        still_open = not waiting.done()
        waiting.cancel()  # the downloader hangs up: hivemind cancels the handler
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return messages, still_open

    messages, still_open = asyncio.run(serve_and_hang_up())
    assert [m.tensor_part.size for m in messages[:-1]] == [[3, 4], [5]] and messages[0].metadata == b"metadata"
    assert state_transfer._is_end_mark(messages[-1]) and not any(map(state_transfer._is_end_mark, messages[:-1]))
    assert still_open, "the donor hung up first: the end of its stream could be lost"
