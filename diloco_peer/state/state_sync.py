"""State sync: a peer that is behind or off the swarm's weights downloads the current state from a peer.

Who needs it: a newcomer, a peer restarted from an old checkpoint, a straggler whose round went on without it,
and a peer whose weights left the swarm's (a solo step while the others averaged, or a reducer that died
mid-all-reduce and left its shard un-averaged). All are detected the same way, from the signed progress records:
each peer publishes its outer ``epoch`` and ``state_hash``, and a peer whose (epoch, hash) differs from the
swarm's *target* syncs (``state/target.py``: the hash, the target and the limit of that rule); peers holding the
target serve it.

What is transferred: outer weights and Nesterov momentum (fp32), the outer epoch and the inner LR-schedule
position. The inner AdamW moments stay local (they describe this peer's own shard).

Download: donors are the peers that hold the target, in random order (newcomers spread over donors instead of all
hitting one); each chunk must arrive within ``averaging.sync_timeout`` or the next donor is tried, up to
``averaging.sync_attempts`` donors. A download that breaks off is not started over: the donor lists the digest of
each tensor (their hash is the published one, ``model.state_digest``), each tensor that matched is kept, and the
next donor sends the rest (``state_transfer.download``). A state is checked before it replaces ours: same config
fingerprint, same tensor count and shapes, all values finite, not older than ours, and the state hash of what
arrived (weights, momentum, epoch, LR position) equals the hash the donor published: a donor serving true weights
with poisoned momentum fails it like one serving corrupt weights. Its epoch must be the swarm's (the quorum's, not
a claim of the donor's): a donor that serves another epoch than the one it published is refused too. A donor
failing any check is skipped and the next one tried; each failure is reported (``SyncResult.donor_errors``).

A peer at most ``averaging.log_rounds`` rounds behind first asks a donor for the updates of those rounds (logged while
someone downloads) and computes the state from ours: the same checks, fewer bytes (``averaging/round_log.py``).
Fault injection (tests only, ``config/faults.py``): ``corrupt_state`` serves weights off by 1e-3 (finite, plausible,
not what the peer published), ``corrupt_state:nan`` NaN weights; ``lie_epoch:N`` the state under epoch N.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..averaging import round_log
from ..averaging.pseudo_gradient_averager import PseudoGradientAverager
from ..averaging.robust_aggregation import all_finite
from ..averaging.state_files import SpilledTensor, staging_for
from ..averaging.state_transfer import DIGESTS
from ..config import AveragingConfig
from ..config.faults import NO_FAULTS, Faults
from ..lifecycle import hivemind_calls
from ..training.model import param_sha256, state_digest
from ..training.outer_optimizer import OuterOptimizer
from .sync_result import SyncResult, timed
from .target import Target

logger = logging.getLogger(__name__)

FALLING_BEHIND = 3
"""Syncs in a row with no outer step of our own between them: at this many, the peer says why it is not catching
up (a joiner whose download outlasts the swarm's rounds arrives one epoch late every time, and downloads again)."""


class StateSync:
    """Serves this peer's outer state to others and replaces it with a donor's when behind.

    :param averager: the running averager (its p2p handlers serve and fetch states)
    :param outer: the outer optimizer whose weights, momentum and epoch are the state
    :param fingerprint: the config fingerprint a state must carry to be accepted
    :param inner_steps: H, to turn an epoch into the inner LR-schedule position
    :param cfg: the ``[averaging]`` section (sync_timeout, sync_attempts)
    :param on_serve: called with (epoch, bytes) each time a peer downloads our state (any thread)
    :param faults: fault injection, for the tests only (``lie_epoch``, ``corrupt_state``: what we serve)
    :param spill_dir: where an outer step during a download writes the state that download has not read yet,
      when it is over ``cfg.serve_copy_in_memory_mb`` (None: always in memory)
    """

    def __init__(self, averager: PseudoGradientAverager, outer: OuterOptimizer, fingerprint: str,
                 inner_steps: int, cfg: AveragingConfig, on_serve=None, *, faults: Faults = NO_FAULTS,
                 spill_dir: Path | None = None):
        self.averager = averager
        self.outer = outer
        self.fingerprint = fingerprint
        self.inner_steps = inner_steps
        self.cfg = cfg
        self.on_serve = on_serve
        self.faults = faults
        self.lock = threading.Lock()
        """Held while the outer state changes, so that a peer never downloads a half-updated state."""
        outer.before_change.append(averager.served.freeze)  # a download in flight keeps the state it started with
        if spill_dir is not None:
            averager.served.spill_to(spill_dir, int(cfg.serve_copy_in_memory_mb * 2**20))
        self.state_hash = self._own_hash()
        averager.state_provider = self._current_state
        self.log = round_log.RoundLog(averager, cfg.log_rounds)
        outer.on_step.append(lambda update: self.log.record(outer.epoch, self.state_hash, update))
        self.behind: list[tuple[int, float]] = []
        """(epoch, seconds) of each sync since our last outer step (``FALLING_BEHIND``)."""

    def _own_hash(self) -> str:
        outer = self.outer
        self.digests = [param_sha256([t]) for t in [*outer.params, *outer.momentum_views]]
        """Of each tensor we serve (``model.state_digest``): listed in what we serve."""
        return state_digest(self.digests, outer.epoch, outer.epoch * self.inner_steps)

    def after_outer_step(self) -> None:
        """Call (under ``lock``) after the outer state changed: refresh the published hash."""
        self.state_hash = self._own_hash()
        self.behind.clear()  # a round of our own: we keep up

    def _count_behind(self, result: SyncResult, count: bool = True) -> SyncResult:
        """One more sync without a round of our own (if it succeeded); at ``FALLING_BEHIND`` in a row, say why."""
        if result.ok and count:
            self.behind.append((result.epoch, result.seconds))
        if not result.ok or not count or len(self.behind) != FALLING_BEHIND:
            return result
        first = self.behind[0][0]
        last = self.behind[-1][0]
        seconds = ", ".join(f"{s:.1f}" for _, s in self.behind)
        logger.warning(f"state sync: {len(self.behind)} syncs in a row with no round of our own between them (the "
                       f"swarm went from epoch {first} to {last} meanwhile; syncs of {seconds} s): its rounds end "
                       f"faster than this peer downloads its state or their updates, so it arrives late each time (or "
                       f"our rounds keep failing: see above). A faster link, or longer rounds for the whole swarm "
                       f"(a larger outer.inner_steps), would let it catch up")
        return result

    def _current_state(self):
        # hivemind calls this in a thread of ours when a peer downloads our state: the live tensors (in shared
        # memory, the averager process streams them from there, see averaging/state_transfer.py), registered
        # so that they stay unchanged for this download
        n = len(self.outer.params)
        with self.lock:
            metadata = {"epoch": self.outer.epoch, "inner_step": self.outer.epoch * self.inner_steps,
                        "fingerprint": self.fingerprint, "state_hash": self.state_hash, DIGESTS: self.digests}
            live = [p.detach() for p in self.outer.params] + self.outer.momentum_views
            # (a GPU peer's momentum: a copy written for this download, which the averager process reads back)
            tensors = live[:n] + self.averager.served.readable(live[n:])
            if self.faults.corrupt:  # fault injection: serve other weights (copies: ours stay as they are)
                tensors[:n] = self.faults.corrupt_state([t.clone() for t in tensors[:n]])
            self.averager.served.open(tensors)  # this download's slot: an outer step meanwhile freezes its rest
        lie = self.faults.lie_epoch  # fault injection: serve our state under another epoch
        if lie is not None:
            metadata.update(epoch=lie, inner_step=lie * self.inner_steps)
        self.log.served_at = time.time()  # the next rounds are logged for this peer (``round_log``)
        if self.on_serve is not None:
            self.on_serve(metadata["epoch"], sum(t.numel() * t.element_size() for t in live))
        return metadata, tensors

    def needs_sync(self, target: Target | None) -> str:
        """Why we must sync to ``target`` ("" if we hold it or nobody else does)."""
        if target is None:
            return ""
        if target.epoch > self.outer.epoch:
            return f"the swarm is at epoch {target.epoch}, we are at {self.outer.epoch}"
        if target.epoch == self.outer.epoch and target.state_hash != self.state_hash:
            holders = len(target.holders)
            return (f"our weights at epoch {self.outer.epoch} differ from the swarm's "
                    f"(held by {holders} peer{'s' if holders > 1 else ''})")
        return ""

    def _check(self, metadata, tensors: list[torch.Tensor], target: Target) -> str:
        """What is wrong with a downloaded state ("" if nothing). ``self.checked`` then holds its tensor digests,
        and it does whenever the tensors themselves are sound (``_contradicts_itself`` reads them)."""
        n = len(self.outer.params)
        self.checked = None
        if not isinstance(metadata, dict) or metadata.get("fingerprint") != self.fingerprint:
            return "its config fingerprint differs from ours (another model or run)"
        if len(tensors) != 2 * n:
            return f"it sent {len(tensors)} tensors, expected {2 * n}"
        digests = []
        for mine, theirs in zip(self.outer.params * 2, tensors):
            if theirs.shape != mine.shape or theirs.dtype != torch.float32:
                return f"a tensor has shape {tuple(theirs.shape)} {theirs.dtype}, expected {tuple(mine.shape)} float32"
            values = theirs.load() if isinstance(theirs, SpilledTensor) else theirs  # (read from its file once)
            if not all_finite(values):
                return "it sent non-finite values"
            digests.append(param_sha256([values]))
        self.checked = digests
        if metadata.get("epoch") != target.epoch or target.epoch < self.outer.epoch:
            return (f"it sent epoch {metadata.get('epoch')}, expected the swarm's {target.epoch} "
                    f"(>= ours, {self.outer.epoch})")
        if state_digest(self.checked, metadata["epoch"], metadata.get("inner_step")) != target.state_hash:
            return "the state it sent (weights, momentum, epoch, LR position) does not match the hash it published"
        return ""

    def _contradicts_itself(self, metadata) -> bool:
        """Does a refused state contradict what its donor says of it in the same reply (``_check`` ran)? That is
        an offense: the donor is the peer we dialled, and libp2p authenticates it. A state that is what its donor
        says, only not what a progress record under its id claims, is none: records are signed by per-process
        keys, not by peer ids, so anyone can publish one under an honest peer's id (SECURITY.md)."""
        if not isinstance(metadata, dict):
            return True
        if metadata.get("fingerprint") != self.fingerprint:
            return False  # another run's (or model's) state, as it says
        if self.checked is None:  # wrong count, shapes, dtypes or values: nothing an honest peer serves
            return True
        said = metadata.get("state_hash")
        return state_digest(self.checked, metadata.get("epoch"), metadata.get("inner_step")) != said

    def _trained_on(self, metadata, target: Target) -> bool:
        """Did the donor send our model's state one or two epochs past the target (it stepped while we looked)?"""
        if not isinstance(metadata, dict) or metadata.get("fingerprint") != self.fingerprint:
            return False
        later = metadata.get("epoch")
        return isinstance(later, int) and target.epoch < later <= target.epoch + 2

    def _refused(self, donor: str, metadata, tensors: list[torch.Tensor], target: Target, problem: str,
                 result: SyncResult) -> None:
        """A downloaded state failed ``_check``: say why, and count an offense if the donor is to blame."""
        result.error = f"donor {donor[-8:]} rejected: {problem}"
        result.donor_errors.append(result.error)
        logger.warning(f"state sync: {result.error}")
        if self._trained_on(metadata, target):
            result.moved_on = True  # a donor that trained on while we looked: not an offense
            if self.checked is not None:  # likely the swarm's next state: kept, to check against the next target
                result.later = (donor, metadata, tensors)
            return
        result.rejected.append(donor)  # the claim that named it does not hold: distrusted (``OuterRounds``)
        if self._contradicts_itself(metadata):
            self.averager.report_offense(donor, "state", problem)
        else:
            logger.warning(f"state sync: donor {donor[-8:]} serves the state it says it holds, not the one a "
                           f"record under its id claims (forged, or a liar's record): no offense")

    async def _download(self, donor: str, target: Target, staging: list[torch.Tensor], resume: torch.Tensor,
                        should_stop: Callable[[], bool]) -> tuple[dict, list[torch.Tensor], int]:
        """One donor's state into ``staging``, from tensor ``resume[0]`` on: the tensors before it came from
        earlier donors and matched the digests listed for ``target`` (the averager process moves it on)."""
        if int(resume[0]):
            logger.info(f"state sync: resuming at tensor {int(resume[0])} of {len(staging)} from {donor[-8:]}")
        metadata, tensors, received = await hivemind_calls.unless_stopped(hivemind_calls.call(
            self.averager.download_state_from, donor, self.cfg.sync_timeout, into=staging, resume=resume,
            expected=target.state_hash), should_stop)
        # a staging file's items come back as copies of ours: ours, whose file lives as long as they are referenced
        tensors = [staging[i] if isinstance(t, SpilledTensor) else t for i, t in enumerate(tensors)]
        # a reset stream (e.g. a relay's limit) ends like a complete one, between two tensors: a network fault, not
        # the donor's offense
        if len(tensors) < len(staging):
            raise RuntimeError(f"the state download broke off after {len(tensors)} of {len(staging)} tensors")
        return metadata, tensors, received

    async def sync(self, target: Target, should_stop: Callable[[], bool] = lambda: False,
                   reuse: SyncResult | None = None, count: bool = True) -> SyncResult:
        """Download ``target`` from one of its holders and make it ours; never raises. Gives up at once (the
        download in flight abandoned) when ``should_stop()``: a peer asked to leave does not finish a sync.
        ``reuse``: an earlier result whose donor had stepped on: what it sent is taken if it is ``target``. ``count``
        off: a retry within one catch-up, not one more sync for ``FALLING_BEHIND``."""
        started = time.perf_counter()
        me = self.averager.peer_id.to_base58()
        donors = [p for p in target.holders if p != me]
        random.shuffle(donors)
        result = SyncResult(ok=False)
        later = None
        if reuse is not None:
            later = reuse.later
            reuse.later = None  # ours now: its memory goes as soon as it is not the target
        if target.epoch < self.outer.epoch:
            result.error = f"refusing the state of epoch {target.epoch}: older than ours ({self.outer.epoch})"
            return result
        if later is not None and await self._take(later, target, result):
            result.seconds = time.perf_counter() - started
            return self._count_behind(result, count)
        later = None
        self.averager.allow_state_sharing = False  # nobody should download from us while we are behind
        # kept across donors: a download broken off resumes where it was, from the next donor
        staging = staging_for(self.outer.params, self.averager.served.spill_dir)
        resume = torch.zeros(1, dtype=torch.int64).share_memory_()
        try:
            if not await self._replay(target, donors, result):
                await self._download_from(list(donors), target, staging, resume, should_stop, result)
            if not donors:
                result.error = "no peer holds the swarm's state"
        finally:
            self.averager.allow_state_sharing = True
            result.seconds = time.perf_counter() - started
        return self._count_behind(result, count)

    async def _download_from(self, queue: list[str], target: Target, staging: list[torch.Tensor],
                             resume: torch.Tensor, should_stop: Callable[[], bool], result: SyncResult) -> None:
        """Download ``target`` from the donors of ``queue`` in turn, until one's state passes the checks and is ours
        (``result.ok``), ``averaging.sync_attempts`` were made, or ``should_stop()``; each attempt told in
        ``result``. A donor whose download failed (a timeout, a broken stream: it may pass) is tried again, last."""
        while queue and result.attempts < self.cfg.sync_attempts and not should_stop():
            donor = queue.pop(0)
            result.attempts += 1
            try:
                metadata, tensors, received = await timed(
                    result, "download", self._download(donor, target, staging, resume, should_stop))
            except asyncio.CancelledError:
                if not should_stop():
                    raise  # cancelled from outside: not ours to swallow
                result.error = "stopped: asked to leave during the download"
                return
            except Exception as e:
                result.error = f"donor {donor[-8:]}: {e}"
                result.donor_errors.append(result.error)
                logger.warning(f"state sync: {result.error}; trying another donor")
                queue.append(donor)
                continue
            result.bytes += received
            problem = await timed(result, "check", asyncio.to_thread(self._check, metadata, tensors, target))
            if problem:
                self._refused(donor, metadata, tensors, target, problem, result)
                if result.later is not None:
                    return  # the swarm stepped on: ask for its new target (a later donor would overwrite this)
                continue
            await timed(result, "load", self._load(tensors, target, self.checked))
            result.ok = True
            result.donor = donor
            result.epoch = target.epoch
            return

    async def _replay(self, target: Target, donors: list[str], result: SyncResult) -> bool:
        """Catch up with the rounds a donor logged since our state (``round_log.replay``), if it has them: asked
        whenever we are at most ``averaging.log_rounds`` behind (the ``rounds`` stage, loading included)."""
        if not donors or not 0 < target.epoch - self.outer.epoch <= self.cfg.log_rounds:
            return False
        replayed = await timed(result, "rounds", round_log.replay(
            self.averager, self.outer, self.state_hash, target, self.inner_steps, self.cfg.sync_timeout, donors,
            self.cfg.log_rounds))
        if replayed is None:
            return False
        result.rounds, (result.donor, state, digests, result.bytes) = target.epoch - self.outer.epoch, replayed
        await timed(result, "rounds", self._load(state, target, digests))
        result.ok = True
        result.epoch = target.epoch
        result.attempts = 1
        return True

    async def _load(self, tensors: list[torch.Tensor], target: Target, digests: list[str]) -> None:
        """Make a checked state ours: weights, momentum and epoch, in place, under ``lock``."""
        n = len(self.outer.params)
        with self.lock:
            await asyncio.to_thread(self.outer.load_state, tensors[:n], tensors[n:], target.epoch)
            self.state_hash = target.state_hash
            self.digests = digests

    async def _take(self, later: tuple, target: Target, result: SyncResult) -> bool:
        """Make ``later`` (``SyncResult.later``) ours if it is the state ``target`` names: the donor that had stepped
        on sent the swarm's next state, which is now the target. True if taken."""
        donor, metadata, tensors = later
        epoch = metadata["epoch"]
        if epoch != target.epoch:
            return False
        # hashed again, a few seconds at GB scale (BENCHMARKS.md, "State sync against raw TCP on a shaped link")
        digests = await asyncio.to_thread(lambda: [param_sha256([t]) for t in tensors])
        if state_digest(digests, epoch, metadata.get("inner_step")) != target.state_hash:
            return False
        await self._load(tensors, target, digests)
        result.ok = True
        result.donor = donor
        result.epoch = target.epoch
        logger.info(f"state sync: the state of epoch {epoch} that {donor[-8:]} sent is the swarm's now: taken")
        return True
