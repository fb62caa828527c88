"""The peer daemon: a swarm member's lifecycle. Join, build, resume, run the outer rounds, leave.

    diloco-peer join /ip4/127.0.0.1/tcp/31337/p2p/<peer-id> --config tiny-cpu

The rounds themselves (train -> gate -> average -> check -> apply, blocking or overlapped, and the state
syncs that heal a peer that fell off the swarm's state) are ``rounds/``; this module starts and stops
everything around them. Checkpoints are written in the background after every ``checkpoint.every_rounds``
rounds and when leaving; ``join`` resumes from the newest one.

SIGTERM/SIGINT/SIGHUP: finish the current inner step, write a checkpoint, withdraw from the swarm, exit 0
within ``run.shutdown_grace`` seconds (past it: exit 1); a second signal exits at once (130); see
``lifecycle/shutdown.py``. No child process (p2pd, averager) survives, not even a SIGKILL of the daemon
(``lifecycle/reaper.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psutil
import torch
from hivemind.dht import DHT
from tqdm.contrib.logging import logging_redirect_tqdm

from .averaging.averager import RoundAverager
from .config import PeerConfig
from .config.faults import Faults
from .lifecycle import hivemind_calls
from .lifecycle.reaper import Reaper, kill_leftovers, new_children, remove_orphaned_segments
from .lifecycle.shutdown import Shutdown
from .observe.events import EventLog
from .observe.metrics import MetricsServer, PeerMetrics
from .rounds.outer_rounds import OuterRounds
from .rounds.record import RoundRecord
from .state.checkpoint import CheckpointManager, capture, restore
from .state.state_sync import StateSync
from .swarm.admission import load_admission
from .swarm.dht_role import DhtRole
from .swarm.join import join_swarm, visible_addresses
from .swarm.progress import SwarmProgress
from .swarm.reachability import DIRECT, OUTBOUND, RELAYED, Reach, ReachabilityWatch
from .training.data import Corpus, shard_for_peer
from .training.model import build_model, move_parameters, num_parameters, parameter_shapes
from .training.outer_optimizer import OuterOptimizer, flat_tensors
from .training.trainer import ComputeThread, Trainer, pick_device

logger = logging.getLogger("diloco_peer")

WITHDRAW_TIMEOUT = 5.0  # seconds a leaving peer gives the DHT to store its tombstone
CHILD_SHUTDOWN_TIMEOUT = 10.0  # seconds the averager and DHT processes get to stop (then the reaper's turn)


class PeerDaemon:
    """One swarm member. Build it with the whole config; each component gets only its own section.

    :param cfg: the validated config tree
    :param initial_peers: bootstrap multiaddrs (one reachable is enough); empty starts a new swarm
    :param name: a human name for logs and the event file (default: the tail of the peer id)
    :param owns_process: the daemon is this process's whole run (the CLI's ``join``), see ``Shutdown``
    :param adopt: ``await adopt(dht, should_stop)`` once the DHT is up: the config to train with instead of ``cfg``
      (the CLI's ``join``: the swarm's, ``swarm/run_config.py``), None if asked to stop meanwhile; ``cfg`` is used
      only for its volunteer keys until then (``config/swarm_wide.py``)
    """

    def __init__(self, cfg: PeerConfig, initial_peers: list[str], name: str = "", owns_process: bool = False,
                 adopt: Callable[[DHT, Callable[[], bool]], Awaitable[PeerConfig | None]] | None = None):
        self.cfg, self.initial_peers, self.name = cfg, list(initial_peers), name
        self.adopt = adopt
        self.shutdown = Shutdown(cfg.run.shutdown_grace, "leaving after the current inner step", owns_process)
        self.trainer: Trainer | None = None
        """The replica and its inner optimizer; kept after ``run`` returns, for inspection (tests)."""
        self.outer: OuterOptimizer | None = None
        self.sync: StateSync | None = None
        self.events: EventLog | None = None
        self.first_contribution: float | None = None
        """Seconds from process start to the first round this peer averaged with others."""
        self.metrics = PeerMetrics()
        """Fed by the event log; served on ``metrics.port`` when set."""
        self._saved_epoch = -1  # the epoch of the last periodic checkpoint
        self.averager: RoundAverager | None = None
        self.progress: SwarmProgress | None = None
        self.rounds: OuterRounds | None = None
        self._checkpoints: CheckpointManager | None = None
        self.tty = sys.stderr.isatty()
        """On a terminal: a live status bar per round (log lines print above it); else periodic log lines."""

    @property
    def stopping(self) -> bool:
        """True once a signal asked us to leave."""
        return self.shutdown.requested

    async def run(self) -> int:
        cfg = self.cfg
        self.shutdown.install(asyncio.get_running_loop())
        self._compute = ComputeThread(cfg.run.threads or torch.get_num_threads())

        # before joining: a busy port fails at once, and /healthz says "joining" while we look for the swarm
        server = MetricsServer(self.metrics, cfg.metrics) if cfg.metrics.port else None
        self._children_before = {c.pid for c in psutil.Process().children(recursive=True)}
        reaper = Reaper()  # if we are SIGKILLed, our children (DHT, averager, p2pd) must not live on
        count, freed = remove_orphaned_segments()
        if count:
            logger.warning(f"removed {count} shared-memory segments ({freed / 1e9:.2f} GB of RAM) that processes "
                           f"which died had left in /dev/shm")
        try:
            with logging_redirect_tqdm() if self.tty else contextlib.nullcontext():
                return await self._run(reaper)
        finally:
            self._compute.close()
            self._kill_leftover_children(reaper)
            reaper.close()
            if server is not None:
                server.close()
            self.shutdown.finished()

    async def compute(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the compute thread, where all of our torch work runs."""
        return await self._compute.run(fn, *args, **kwargs)

    def _ours(self, reaper: Reaper) -> list[psutil.Process]:
        # the processes we started (not the host's other children, e.g. in tests)
        return new_children(self._children_before, reaper.proc.pid)

    def _watch_children(self, reaper: Reaper) -> None:
        reaper.watch([c.pid for c in self._ours(reaper)])

    def _kill_leftover_children(self, reaper: Reaper) -> None:
        # after a leave, a child that did not stop when told (a DHT process that stopped answering) must not
        # outlive us: the reaper only acts if *we* die, and is told "done" next
        for killed in kill_leftovers(self._ours(reaper)):
            logger.warning(f"child process {killed} did not stop when told: killed it")

    async def _run(self, reaper: Reaper) -> int:
        cfg = self.cfg
        joined = await join_swarm(cfg.swarm, self.initial_peers, should_stop=lambda: self.stopping)
        if joined is None:
            return 0  # asked to leave while still waiting for a bootstrap
        dht, reach = joined
        (logger.info if reach.mode == DIRECT else logger.warning)(reach.line())
        self._watch_children(reaper)
        watch = ReachabilityWatch(reach, list(cfg.swarm.relays) or self.initial_peers, cfg.swarm.reachability_check,
                                  on_change=self._on_reachability)
        try:
            if self.adopt is not None:  # before anything is built: the swarm tells us our job
                adopted = await self.adopt(dht, lambda: self.stopping)
                if adopted is None:
                    return 0  # asked to leave while still waiting for the swarm's config
                self.cfg = adopted
            rounds = await self._start(dht, reach, watch, reaper)
            await rounds.catch_up(await self.progress.swarm_records())
            await rounds.run(self._finish_round)
            self.events.write("stop", peer=self.name, reason="signal" if self.stopping else "max_rounds",
                              epoch=self.outer.epoch, inner_step=self.trainer.step)
            return 0
        finally:
            self.shutdown.arm()  # leaving is bounded by run.shutdown_grace, asked to or not
            await self._leave(dht, watch)

    async def _start(self, dht, reach: Reach, watch: ReachabilityWatch, reaper: Reaper) -> OuterRounds:
        """Build the replica, resume from a checkpoint, start averaging and publish our progress."""
        cfg = self.cfg
        peer_id = dht.peer_id.to_base58()
        self.name = self.name or f"peer-{peer_id[-8:]}"
        events = self.events = EventLog(Path(cfg.run.log_dir) / f"{self.name}.jsonl", self.metrics.observe)
        self._on_reachability(reach)
        shard = cfg.data.shard if cfg.data.shard >= 0 else shard_for_peer(peer_id, cfg.data.num_shards)
        faults = Faults.from_environment(os.environ)  # a test seam: no fault at all unless the tests ask
        averager, trainer, outer = await self._build(dht, shard, reach, faults)
        model = trainer.model
        started = time.perf_counter()
        resumed_from = await self._resume()
        resume_seconds = time.perf_counter() - started
        await watch.start(dht, serve=cfg.swarm.relay_service)
        self._watch_children(reaper)
        sync = self.sync = StateSync(averager.averager, outer, cfg.fingerprint(), cfg.outer.inner_steps, cfg.averaging,
                         on_serve=lambda epoch, size: events.write("serve", peer=self.name, epoch=epoch, bytes=size),
                         faults=faults, spill_dir=Path(cfg.run.log_dir) / f"{self.name}.serving")
        progress = self.progress = SwarmProgress(dht, cfg.run.run_id, peer_id, cfg.averaging.heartbeat, faults=faults)
        self.metrics.name = self.name
        progress.stats_provider = self.metrics.swarm_stats  # the swarm monitor reads these from the DHT
        progress.nudged = averager.nudged  # the round gate reads at once when told the last peer is ready
        await progress.publish(epoch=outer.epoch, round=outer.epoch, inner_step=trainer.step,
                               state_hash=sync.state_hash)
        progress.start_heartbeat()

        eval_loss = await self.compute(trainer.evaluate)
        events.write(
            "start", peer=self.name, peer_id=peer_id, addresses=visible_addresses(dht), shard=shard,
            parameters=num_parameters(model), device=str(trainer.device), fingerprint=cfg.fingerprint(),
            eval_loss=eval_loss, param_sha256=sync.state_hash, pid=os.getpid(), epoch=outer.epoch,
            resumed_from=resumed_from, resume_seconds=resume_seconds if resumed_from else None,
        )
        logger.info(
            f"{self.name} ({peer_id}) joined run '{cfg.run.run_id}': {num_parameters(model) / 1e6:.2f}M params on "
            f"{trainer.device}, shard {shard}/{cfg.data.num_shards}, H={cfg.outer.inner_steps}, "
            f"epoch {outer.epoch}, eval loss {eval_loss:.4f}"
        )
        if cfg.averaging.aggregation == "mean":
            logger.warning("averaging.aggregation=mean: any update under averaging.max_update_ratio (10x ours) is "
                           "averaged in (a forked client sending -3x its pseudo-gradient is never refused); for a "
                           "swarm open to strangers use --set averaging.aggregation=robust (SECURITY.md)")
        self.rounds = OuterRounds(cfg.outer, cfg.averaging, cfg.run.max_rounds, self.name, trainer=trainer,
                                  outer=outer, averager=averager, progress=progress, sync=sync, events=events,
                                  compute=self._compute, should_stop=lambda: self.stopping,
                                  dht_role=DhtRole(dht, serving=reach.mode != OUTBOUND), tty=self.tty)
        return self.rounds

    async def _build(self, dht, shard: int, reach: Reach, faults: Faults) -> tuple[RoundAverager, Trainer,
                                                                                OuterOptimizer]:
        """The averager, the replica and its optimizers, in the order that keeps memory down: the averager process
        is forked first, while this process holds no model (a fork shares our pages copy-on-write, and every
        page the training writes to afterwards would stay behind in the averager process as its own copy:
        ~4 bytes per parameter for each model-sized buffer that existed at the fork)."""
        cfg = self.cfg
        admission = load_admission(cfg.swarm.secret_file, cfg.swarm.allowlist)
        shapes = parameter_shapes(cfg.model)
        device = pick_device(cfg.inner.device).type
        lend = cfg.lends_replica(device)  # blocking rounds on a CPU: no pseudo-gradient
        replica = flat_tensors(shapes, shared=True) if lend else None  # buffer, the replica's memory takes its place
        averager = self.averager = RoundAverager(dht, shapes, cfg.run.run_id, cfg.averaging, admission,
                                                 relayed=reach.mode == RELAYED, faults=faults, inputs=replica,
                                                 in_place=cfg.averages_in_place(device))  # (blocking, on a GPU)
        corpus = await self.compute(Corpus, cfg.data, shard, cfg.model.vocab_size)
        model = await self.compute(build_model, cfg.model, cfg.run.seed)
        if replica is not None:
            await self.compute(move_parameters, model, replica)
        trainer = self.trainer = await self.compute(Trainer, model, corpus, cfg.inner)
        # in shared memory: the averager process serves them to a downloading peer without a copy (state_sync.py)
        outer = self.outer = await self.compute(OuterOptimizer, trainer.model, cfg.outer, shared=True,
                                                momentum_device=trainer.device if cfg.outer.momentum_on == "device"
                                                else None)
        outer.pseudo_gradient_buffers = averager.inputs  # written in place, sent from there: no copy per round
        outer.after_change.append(averager.release)  # an outer step (or a sync) consumed the round's buffers
        return averager, trainer, outer

    async def _resume(self) -> str:
        """Load the newest checkpoint of ``checkpoint.dir``, if any; the file it came from (or "")."""
        if not self.cfg.checkpoint.dir:
            return ""
        manager = CheckpointManager(self.cfg.checkpoint, self.name, self.cfg.fingerprint())
        state = await asyncio.to_thread(manager.load_latest)  # a foreign checkpoint raises here
        self._checkpoints = manager  # only now: a run that refused a foreign checkpoint must not write there
        if state is None:
            return ""
        await self.compute(restore, state, self.trainer, self.outer)
        logger.info(f"resumed from {manager.files()[0]}: epoch {self.outer.epoch}, inner step {self.trainer.step}")
        return str(manager.files()[0])

    async def _leave(self, dht, watch: ReachabilityWatch) -> None:
        """Save the last round boundary, withdraw from the swarm, stop our averager and DHT."""
        cfg, checkpoints = self.cfg, self._checkpoints
        if checkpoints is not None:
            # leaving: save the last round boundary (an unfinished round is dropped, never half-saved),
            # unless the periodic checkpoint of this very boundary is already written (or being written)
            if self._saved_epoch != self.outer.epoch:
                state = capture(self.trainer, self.outer, cfg.fingerprint())
                if self.rounds is not None:
                    # resume at the start of the round after the saved epoch (overlapped: the one after that)
                    state.inner_step = (self.outer.epoch + self.rounds.schedule.lag) * cfg.outer.inner_steps
                checkpoints.save(state, self._on_checkpoint)
        if checkpoints is not None:
            checkpoints.close()  # waits for the writes in flight
        leaving = time.monotonic()
        if self.progress is not None:
            # a DHT store can wait out RPC timeouts to peers that just died; never longer than this,
            # since an unwithdrawn record expires by itself anyway
            try:
                await asyncio.wait_for(self.progress.withdraw(), timeout=WITHDRAW_TIMEOUT)
            except TimeoutError:
                logger.warning(f"could not withdraw our progress record within {WITHDRAW_TIMEOUT:g}s; "
                               f"it expires by itself within {self.progress.time_to_live():.0f}s")
        await watch.close()
        if self.averager is not None:  # (overlapped rounds: the last round's exchange runs while we train)
            bound = min(cfg.averaging.allreduce_timeout, cfg.run.shutdown_grace / 3)
            waited = await self.averager.finish_allreduce(bound)
            if waited >= 0.1:
                logger.info(f"waited {waited:.1f}s for the all-reduce in flight: its group keeps our part")
            handing_back = await self.averager.finish_hand_backs(bound - waited)
            if handing_back >= 0.1:
                logger.info(f"waited {handing_back:.1f}s for the peers that handed in to us to take their average")
        # in daemon threads, bounded: a child process that is already gone must not keep us waiting
        with contextlib.suppress(TimeoutError):
            if self.averager is not None:
                await hivemind_calls.call(self.averager.shutdown, timeout=CHILD_SHUTDOWN_TIMEOUT)
            await hivemind_calls.call(dht.shutdown, timeout=CHILD_SHUTDOWN_TIMEOUT)
        if self.sync is not None:
            self.sync.log.remove_files()  # rounds kept for peers behind us: nobody downloads them any more
        logger.info(f"left the swarm in {time.monotonic() - leaving:.1f}s")
        if self.events is not None:
            self.events.close()

    def _on_reachability(self, reach: Reach) -> None:
        if self.events is not None:
            self.events.write("reachability", peer=self.name, mode=reach.mode, detail=reach.detail,
                              relays=len(reach.relays))
        if self.averager is not None:
            self.averager.relayed = reach.mode == RELAYED

    def _on_checkpoint(self, path: Path, seconds: float, size: int) -> None:
        self.events.write("checkpoint", peer=self.name, epoch=int(path.stem.split("-")[1]), path=str(path),
                          seconds=seconds, bytes=size)

    def _finish_round(self, record: RoundRecord) -> None:
        """Log and count a finished round, and write the periodic checkpoint when due."""
        if record.outcome in ("averaged", "partial") and self.first_contribution is None:
            self.first_contribution = time.time() - psutil.Process().create_time()
            record.first_contribution_seconds = self.first_contribution
        self.events.write("round", **record.fields())
        self.rounds.shown.logged_round()
        megabytes = (record.bytes_sent + record.bytes_received) / 1e6
        logger.info(
            f"round {record.round}: {record.outcome} with group of {record.group_size} "
            f"({record.allreduce_seconds:.2f}s, {megabytes:.2f} MB)"
            f" | train loss {record.train_loss:.4f} | eval loss {_loss(record.eval_loss)} | "
            f"{record.tokens / max(record.compute_seconds, 1e-9):,.0f} tok/s"
        )
        if self._checkpoints is not None and self._checkpoints.due(self.outer.epoch):
            self._checkpoints.save(capture(self.trainer, self.outer, self.cfg.fingerprint()), self._on_checkpoint)
            self._saved_epoch = self.outer.epoch


def _loss(loss: float | None) -> str:
    """A round's eval loss in the log: a peer that handed in does not evaluate (its proxy's group does)."""
    return f"{loss:.4f}" if loss is not None else "left to its group (handed in)"
