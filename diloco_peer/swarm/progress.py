"""Swarm progress: signed DHT records that tell every peer who is training which outer epoch.

Each peer publishes a small record under ``{run_id}_progress``, in a subkey that carries its RSA public
key and a signature (hivemind's ``RSASignatureValidator``): nobody can write or delete another peer's
record. A ``SchemaValidator`` rejects records of the wrong shape. A record is stored again at least every
``heartbeat`` seconds (a round's own publications count: ``start_heartbeat``) and expires after three heartbeats,
and twice the time the peer's stores take lately (``time_to_live``; a gate counts them one heartbeat more:
``swarm_records``), so a peer that vanishes drops out on its own; a peer that leaves cleanly withdraws its record at
once.

The daemon uses the records to start a round only when the peers of its epoch are ready: the first
round waits for ``min_peers`` (so the swarm does not split into solo learners while it starts), later
rounds wait at most ``ready_timeout`` for stragglers.

Open to volunteers means open to liars: anyone can publish a record that claims any epoch. Three defences:

- **A quorum, not the maximum.** The swarm's epoch (``quorum_epoch``) is the highest epoch that a strict
  majority of the *voting* peers have reached, so one peer claiming epoch 1000 moves nobody. Voters are
  the peers that have *joined*: synced to the swarm's state, or found nothing to sync, since they
  started. A newcomer (or a peer restarted from an old checkpoint) knows nothing about the swarm's
  progress, so its epoch is no evidence: if it voted, three newcomers at epoch 0 would outvote two peers
  at epoch 5 and split the swarm. When the only joined peer is a liar (it founded the swarm, or everyone
  else is new), no count can tell it from a lone founder: the state it claims can. So:
- **A claim that does not hold stops counting.** A peer whose state sync to a claim fails the checks (its
  donor served another epoch or state than it published) or, when one peer alone claims it and the peer has
  not joined yet, cannot be had from it at all, distrusts that (peer, epoch, hash) claim (``distrust``): the
  claim no longer votes, is no target, and holds no gate; the peer then joins the swarm the other records
  describe. Its holder stays a *suspect* as long: a claim it publishes next counts only where another peer we
  trust holds the same state (a liar that made up a new claim after every refused sync kept us from ever
  joining). A banned peer's records stop counting at once (``ban``: our averager banned it).
- **Capped expirations** (``progress_store.ExpirationCap``): a record may expire at most ``MAX_TTL`` seconds from
  now, on every key of the DHT, so nobody can pin a record (a stale lie, a fake peer) for days.
- **Waits that liars can stretch are bounded**: the round gate by ``ready_timeout`` (a peer that claims
  our epoch and never gets ready) and ``min_peers_timeout``, ``wait_for_round_end`` by its timeout.

Fault injection (tests only, ``config/faults.py``): with ``faults.lie_epoch`` set to N the peer publishes
epoch N in every record it stores, with the hash of its real weights; its state download claims epoch N too
(``state_sync.py``). Everything else it does, it does honestly.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hivemind.dht import DHT
from hivemind.utils import get_dht_time

from ..config.faults import NO_FAULTS, Faults
from ..lifecycle import hivemind_calls
from . import progress_store
from .progress_record import PeerStats, ProgressRecord
from .quorum import QUORUM, quorum_epoch

logger = logging.getLogger(__name__)

ALL_READY = "all peers of this epoch are ready"
"""The round gate's reason when nobody is left to wait for."""


@dataclass
class ReadyDecision:
    ready: int
    """Peers (us included) ready for this epoch's round."""
    alive: int
    """Peers with a live record, at any epoch."""
    waited: float
    reason: str
    records: list[ProgressRecord] = field(default_factory=list)
    """The live records the decision was made on (ours included)."""
    reads: int = 0
    """DHT reads of the records the gate made: 1 when every other peer was ready at its first (we came last)."""
    expected: int = 0
    """Peers that may come to this round's matchmaking (us included): every live record but a banned peer's, also
    those whose claims we do not trust (a liar may still average; a group started without it, filled up by the
    trusted count, turned an honest peer away: ``averaging.start_when_complete``), less the peers too slow to be
    in time, which the gate does not wait for and which do not come either, and those that handed in to a proxy
    (``ProgressRecord.hands_to``). 0: not counted."""
    handing_in: int = 0
    """Of the ``ready`` peers, those that handed their pseudo-gradient in to a proxy: they do not come to
    matchmaking."""

    @property
    def members(self) -> int:
        """The ready peers that come to the all-reduce: a peer that handed in is averaged in its proxy's part."""
        return self.ready - self.handing_in


def _round_peers(records: list[ProgressRecord], epoch: int, lag: int,
                 too_slow=None) -> tuple[int, list[ProgressRecord], int]:
    """How many peers of the round of ``epoch`` among ``records`` are ready, those peers (the gate waits for them),
    and how many it leaves out: a peer that is not ready and ``too_slow`` to be in time is not waited for.
    ``lag`` 1 (overlapped): those whose record says they train that round (``round``), and those that sent it (at
    ``epoch`` and ready). ``lag`` 0 (blocking): those at ``epoch``, and joined peers behind that sync towards its round
    (``Healing.heading_for``), not ready yet."""
    if lag:
        sent = [r for r in records if r.epoch == epoch and r.ready]
        peers = sent + [r for r in records if r.round == epoch and not (r.epoch == epoch and r.ready)]
        ready = len(sent)
    else:
        peers = [r for r in records if r.epoch == epoch or r.joined and r.epoch < epoch == r.round]
        ready = sum(r.ready and r.epoch == epoch for r in peers)
    kept = [r for r in peers if r.ready or too_slow is None or not too_slow(r, records)]
    return ready, kept, len(peers) - len(kept)


class SwarmProgress:
    """Publishes this peer's progress and decides when a round may start.

    :param dht: the running DHT
    :param run_id: the run's name; records live under ``{run_id}_progress``
    :param peer_id: our peer id (base58), stored in the record for humans and the monitor
    :param heartbeat: seconds between republications; records expire after ``3 * heartbeat`` (and our stores'
      latency: ``time_to_live``)
    :param faults: fault injection, for the tests only (``lie_epoch``: publish that epoch instead of ours)
    """

    POLL_SECONDS = 0.5
    """Seconds between the round gate's reads of the records once it has waited ``FAST_POLL_WINDOW`` (a straggler):
    a slow poll keeps the DHT load of a large swarm down."""
    FAST_POLL_SECONDS = 0.05
    """Seconds between the gate's reads for its first ``FAST_POLL_WINDOW``: ready peers usually arrive within a
    second of each other, and the last one's matchmaking waits for the others' next poll, every round, so a poll's
    interval is what a waiting peer may lose of the round (measured: BENCHMARKS.md, "Hiding the network", "What the
    numbers say"). A gate told that the round's last peer is ready (``nudged``) reads at once instead."""
    FAST_POLL_WINDOW = 5.0
    """Seconds the gate polls fast before it falls back to ``POLL_SECONDS``."""
    SWARM_POLLS_PER_SECOND = 100
    """In a swarm of more than 5 peers the fast polls come every n / 100 s instead (up to ``POLL_SECONDS``): the
    gates of n peers read the DHT this many times a second together."""
    SWARM_SLOW_POLLS_PER_SECOND = 10
    """Past ``FAST_POLL_WINDOW``, the slow polls of a swarm of n peers come every n / 10 s (``POLL_SECONDS`` at
    least): each read returns every peer's record, so at a fixed interval a swarm's waiting gates read n^2 records a
    poll together, which starved a swarm of 32 peers on one machine at its first gate (BENCHMARKS.md, "Many peers");
    this way n (up to ``SLOW_POLL_MAX_SECONDS``). A gate told that the round's last peer is ready still reads at
    once."""
    SLOW_POLL_MAX_SECONDS = 5.0
    """The longest wait between two slow polls: a gate leaves its stragglers (``averaging.ready_timeout``) at most
    this late."""
    STORES_REMEMBERED = 5
    """Our last stores whose time the next ones' time to live allows for (``time_to_live``)."""
    NUDGE_GAP = 0.005
    """The shortest wait between two reads, however often the gate is nudged."""

    def __init__(self, dht: DHT, run_id: str, peer_id: str, heartbeat: float, *, faults: Faults = NO_FAULTS):
        self.dht = dht
        self.run_id = run_id
        self.heartbeat = heartbeat
        self.faults = faults
        self.key = f"{run_id}_progress"
        self.subkey = progress_store.add_progress_validators(dht, run_id)
        self.record = ProgressRecord(peer_id=peer_id, epoch=0, inner_step=0, tokens=0, ready=False, joined=False,
                                     time=time.time())
        self._heartbeat_task: asyncio.Task | None = None
        self._store_seconds: collections.deque[float] = collections.deque(maxlen=self.STORES_REMEMBERED)
        """How long our last stores took (``time_to_live``)."""
        self._expiration = 0.0
        """The expiration our last store gave our record (``expiration``)."""
        self._published_at = -float("inf")
        """When (``time.monotonic()``) we last began to store our record (``start_heartbeat``)."""
        self._entries: dict[bytes, tuple[ProgressRecord | None, float]] = {}  # (swarm_records)
        self._banned: dict[str, float] = {}
        """Peer id -> ``time.monotonic()`` at which its ban ends."""
        self._distrusted: dict[tuple[str, int, str], float] = {}
        """(peer id, epoch, state hash) claims whose state did not hold -> when we may try them again."""
        self._suspects: dict[str, float] = {}
        """Peer id -> until when its claims count only where another trusted peer confirms them (``distrust``)."""
        self.present = 1
        """Live records (ours included) at the last ``swarm_records``, trusted or not, banned peers' left out."""
        self.stats_provider: Callable[[], dict] | None = None
        """Returns the current ``PeerStats`` fields; called at every publication (the heartbeat included)."""
        self.nudged = None
        """A ``multiprocessing.Event`` our averager sets when a peer says the round's last one is ready (the round
        gate then reads the records at once: ``averaging/member_news.py``); None: the gate only polls."""

    async def publish(self, **changes) -> None:
        """Update fields of our record (epoch, inner_step, tokens, ready) and store it now."""
        if self.stats_provider is not None:
            changes["stats"] = PeerStats(**self.stats_provider())
        self.record = self.record.copy(update={**changes, "time": time.time()})
        self._published_at = time.monotonic()
        await self._store(self.record.dict())

    async def _store(self, value) -> None:
        if value is not None and self.faults.lie_epoch is not None:
            value = {**value, "epoch": self.faults.lie_epoch, "round": self.faults.lie_epoch}
        started = time.monotonic()
        ok = await hivemind_calls.call(self.dht.store, self.key, value, self.expiration(),
                                       subkey=self.subkey, timeout=progress_store.DHT_CALL_TIMEOUT)
        self._store_seconds.append(time.monotonic() - started)
        if not ok:
            logger.debug("progress record was not stored by any DHT node (alone in the swarm?)")

    def expiration(self) -> float:
        """The expiration of the record we store now: ``time_to_live`` from now, and later than any we stored before.
        A DHT node, and every gate's ``swarm_records``, keeps the version of a record that expires last: a store
        whose time to live had shrunk (a slow store no longer among the last ones) was hidden behind the one before
        it. A heartbeat's record, not ready yet, outlived the "ready" stored after it, and the others' gates read us
        as not ready until the next heartbeat: a second a round lost, while we waited for them in matchmaking
        (BENCHMARKS.md, "Unequal volunteers")."""
        self._expiration = max(get_dht_time() + self.time_to_live(), self._expiration + 1e-3)
        return self._expiration

    def time_to_live(self) -> float:
        """Seconds our record lives from the moment we store it: 3 heartbeats, and twice the time our last stores
        took. A store lands that late, and the heartbeat's next one a heartbeat and a store after it: on a loaded
        machine, where a store takes longer than two heartbeats, a record that lived 3 heartbeats from its call
        expired before the next one landed, and the gates counted fewer peers than were there (32 peers on two
        cores: BENCHMARKS.md, "Many peers"). A dead peer is counted that much longer."""
        return 3 * self.heartbeat + 2 * max(self._store_seconds, default=0.0)

    async def swarm_records(self) -> list[ProgressRecord]:
        """Live records of all peers we trust, ours as it is now (not as the DHT last saw it).

        A record counts until it expires, is withdrawn, or a later one replaces it, whether or not the last read
        returned it: a read that missed it (DHT nodes that did not answer in time, a starved DHT process) would
        otherwise make the peer vanish for a moment, and a gate that saw nobody else would step alone. It counts
        one heartbeat past its expiration too: on a loaded machine a heartbeat's store comes late, the peer would
        vanish from the others' gates for a moment, and a gate that counted only the peers it saw would form a
        group of part of the round (BENCHMARKS.md, "Many peers")."""
        now = get_dht_time() - self.heartbeat
        entries = await progress_store.fetch_progress_entries(self.dht, self.run_id)
        for subkey, (record, expiration) in entries.items():
            if expiration >= self._entries.get(subkey, (None, -1.0))[1]:
                self._entries[subkey] = (record, expiration)
        self._entries = {subkey: entry for subkey, entry in self._entries.items() if entry[1] > now}
        others = [r for r, _ in self._entries.values() if r is not None and r.peer_id != self.record.peer_id]
        trusted = self.trusted(others)  # (it also forgets bans that ended)
        self.present = 1 + len({r.peer_id for r in others if r.peer_id not in self._banned})
        return trusted + [self.record]

    def ban(self, peer_id: str, seconds: float) -> None:
        """Stop counting ``peer_id``'s records for ``seconds`` (our averager banned it): no vote, no wait for it."""
        self._banned[peer_id] = time.monotonic() + seconds

    def distrust(self, peer_id: str, epoch: int, state_hash: str, seconds: float = float("inf")) -> None:
        """Stop counting a claim (``peer_id`` holds ``state_hash`` at ``epoch``), for ``seconds``: the state it
        claims failed verification (for good) or could not be had (for a while: maybe the network). A claim is
        forgotten once its peer publishes another one, but for as long the peer's next claims count only where
        another peer we trust holds the same state: otherwise a liar could make up a new claim after every
        refused sync and keep a peer that has not joined from ever joining."""
        until = time.monotonic() + seconds
        self._distrusted[(peer_id, epoch, state_hash)] = until
        self._suspects[peer_id] = max(until, self._suspects.get(peer_id, until))

    def trusted(self, records: list[ProgressRecord]) -> list[ProgressRecord]:
        """``records`` but those of banned peers, distrusted claims, and a suspect's claims no one else confirms."""
        now = time.monotonic()
        self._banned = {peer: until for peer, until in self._banned.items() if until > now}
        self._suspects = {peer: until for peer, until in self._suspects.items() if until > now}
        claims = {(r.peer_id, r.epoch, r.state_hash) for r in records}
        self._distrusted = {c: until for c, until in self._distrusted.items() if until > now and c in claims}
        kept = [r for r in records
                if r.peer_id not in self._banned and (r.peer_id, r.epoch, r.state_hash) not in self._distrusted]
        confirmed = collections.Counter((r.epoch, r.state_hash) for r in kept if r.peer_id not in self._suspects)
        return [r for r in kept if r.peer_id not in self._suspects or confirmed[(r.epoch, r.state_hash)]]

    async def wait_for_round_end(self, epoch: int, timeout: float, should_stop=lambda: False,
                                 ready_only: bool = False, everyone: bool = False) -> list[ProgressRecord]:
        """Records, once the others (by quorum, ``quorum_epoch``) have stepped past ``epoch`` (at once if
        nobody else is at ``epoch``; at most ``timeout`` seconds). A peer whose round failed compares its
        weights with those the others *end* the round with, not with their records from before it. One
        peer claiming a later epoch does not end the wait; one that claims ``epoch`` forever stretches it
        to ``timeout``, no longer. ``ready_only``: peers at ``epoch`` that are not ready are not waited for
        either: their round failed too, and they wait just like us. ``everyone``: a quorum is not enough, every
        peer still at ``epoch`` is waited for (a peer that rechecks a split round compares the states of all the
        round's groups: with a quorum in, the larger group's last members were not, and a peer of it took the
        smaller group's state)."""
        deadline = time.monotonic() + timeout
        while True:
            records = await self.swarm_records()
            others = [r for r in records if r.peer_id != self.record.peer_id]
            pending = [r for r in others if r.epoch == epoch and (r.ready or not ready_only)]
            stepped = not everyone and (quorum_epoch(others, QUORUM) or 0) > epoch
            if stepped or not pending or time.monotonic() >= deadline or should_stop():
                return records
            await asyncio.sleep(self.poll_interval(len(records), waited=self.FAST_POLL_WINDOW))

    def start_heartbeat(self) -> None:
        """Store our record again whenever ``heartbeat`` seconds have passed since we last stored it. A round's own
        publications ("ready", the new epoch, the round's start) store it too, several times a round where rounds are
        short: a beat right after one of them kept no record fresher, and cost a DHT store, the walk to the nodes
        nearest the key and its signature, which every peer's DHT node serves (a peer at a sliver of a core spent
        a large part of it on its DHT: BENCHMARKS.md, "Unequal volunteers")."""
        async def _beat():
            while True:
                await asyncio.sleep(max(0.0, self._published_at + self.heartbeat - time.monotonic()))
                if time.monotonic() - self._published_at < self.heartbeat:
                    continue  # a publication came meanwhile: the next beat is due a heartbeat after it
                try:
                    await self.publish()
                except Exception as e:  # a flaky DHT must not kill the daemon; the next beat retries
                    logger.warning(f"could not publish progress: {e}")

        self._heartbeat_task = asyncio.create_task(_beat())

    async def withdraw(self) -> None:
        """Stop the heartbeat and replace our record with a tombstone so nobody waits for us."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        await self._store(None)

    async def wait_until_ready(self, min_peers: int, min_peers_timeout: float, ready_timeout: float,
                               should_stop=lambda: False, lag: int = 0,
                               too_slow: Callable[[ProgressRecord, list[ProgressRecord]], bool] | None = None
                               ) -> ReadyDecision:
        """Wait until the round of our epoch may start; we must have published ``ready=True`` already.

        The round starts when (a) at least ``min_peers`` peers are alive (their records live, trusted or not: a
        peer whose first sync found a liar out must not count fewer peers than the others do, and sit at its first
        gate while they average) and (b) every live peer we trust at our epoch is ready; a joined peer behind us
        whose record says it syncs towards our round (``round``) counts as one of them, not ready (a joiner one
        round behind at every gate never averaged). It starts anyway after ``ready_timeout`` seconds of (a),
        leaving stragglers behind, or after ``min_peers_timeout`` seconds without (a), with whoever is there.
        Returns early (with reason "stopping") as soon as ``should_stop()`` is true, so that a leaving peer never
        waits here.

        Whom it waits for (``_round_peers``) depends on the schedule's ``lag`` (``rounds/schedule.py``: 0 blocking,
        1 overlapped); a peer not ready yet that ``too_slow(record, records)`` names cannot be ready in time (rounds
        bounded by time: one inner step of it outlasts the round, ``rounds/pace.py``) and is not waited for.

        Liars can only delay or hurry a round, within bounds: one that claims our epoch (or to sync towards it) and
        never gets ready holds the gate ``ready_timeout`` at most; fake peers can fill ``min_peers`` early (the
        first round then starts with fewer real peers, or waits ``min_peers_timeout`` at most); one that claims to
        be ready and never shows up in matchmaking costs a matchmaking timeout and a solo step. A peer at another
        epoch (``lie_epoch``) is not waited for at all, unless most peers are behind us (``quorum_epoch``): then we
        are the one off (our round failed where theirs did not) and wait, ``ready_timeout`` at most, for them to
        reach our epoch.
        """
        started = time.monotonic()
        quorum_since, reads = None, 0
        if self.nudged is not None:
            self.nudged.clear()  # news of an earlier round
        while True:
            if should_stop():
                return ReadyDecision(1, 1, time.monotonic() - started, "stopping")
            records = await self.swarm_records()
            reads += 1
            epoch = self.record.epoch
            ready, same_epoch, too_late = _round_peers(records, epoch, lag, too_slow)
            handing = sum(r.ready and r.epoch == epoch and bool(r.hands_to) for r in same_epoch)
            # (a peer we do not wait for does not come to matchmaking either, nor one that handed in)
            expected = self.present - too_late - handing
            now = time.monotonic()
            waited = now - started
            # ahead of the swarm (a round of ours failed, the others' did not): they reach our epoch round by
            # round; going on alone would put us further ahead every round, never to meet them again
            swarm = quorum_epoch(records) if not lag else None
            ahead = swarm is not None and swarm < epoch
            if self.present >= min_peers:  # every live peer counts, trusted or not (below)
                quorum_since = quorum_since if quorum_since is not None else now
                if ready == len(same_epoch) and not ahead:
                    return ReadyDecision(ready, len(records), waited, ALL_READY, records, reads, expected, handing)
                if now - quorum_since >= ready_timeout:
                    why = (f"ahead of the swarm (epoch {swarm}) after waiting {ready_timeout:g}s for it" if ahead
                           else f"stragglers left behind after {ready_timeout:g}s")
                    return ReadyDecision(ready, len(records), waited, why, records, reads, expected, handing)
            elif waited >= min_peers_timeout:
                return ReadyDecision(ready, len(records), waited,
                                     f"only {self.present} of min_peers={min_peers} after {waited:.0f}s", records,
                                     reads, expected)
            await self._nap(len(records), started)

    def poll_interval(self, peers: int, waited: float) -> float:
        """Seconds between two reads of a gate that has waited ``waited`` seconds, ``peers`` live."""
        if waited < self.FAST_POLL_WINDOW:
            return min(self.POLL_SECONDS, max(self.FAST_POLL_SECONDS, peers / self.SWARM_POLLS_PER_SECOND))
        return min(self.SLOW_POLL_MAX_SECONDS, max(self.POLL_SECONDS, peers / self.SWARM_SLOW_POLLS_PER_SECOND))

    async def _nap(self, peers: int, since: float) -> None:
        """The gate's wait between two reads, ``peers`` live and waiting since ``since``: a poll (fast in the first
        ``FAST_POLL_WINDOW`` seconds, then slower the more peers there are), or until ``nudged`` (``NUDGE_GAP`` at
        least)."""
        seconds = self.poll_interval(peers, time.monotonic() - since)
        if self.nudged is None:
            await asyncio.sleep(seconds)
            return
        started = time.monotonic()
        if await self.nudged.wait_in_loop(seconds):  # (``member_news.Nudge``: the loop sleeps until told)
            self.nudged.clear()
            await asyncio.sleep(max(0.0, started + self.NUDGE_GAP - time.monotonic()))
