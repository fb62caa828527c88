"""The peer daemon: join the swarm, then train -> average -> outer step, round after round.

    diloco-peer join /ip4/127.0.0.1/tcp/31337/p2p/<peer-id> --config tiny-cpu

One outer round, as DiLoCo (Douillard et al. 2023) and OpenDiLoCo run it:
1. H inner AdamW steps on this peer's shard (in a worker thread; the event loop stays free for
   heartbeats and signals);
2. pseudo-gradient = outer weights - replica weights;
3. publish "ready", wait until the peers of this epoch are ready (bounded wait), then matchmake a group
   and all-reduce the pseudo-gradients weighted by the tokens behind them;
4. outer Nesterov SGD on the CPU copy with the average (or, if no group formed, with our own
   pseudo-gradient: a *solo* step, logged and counted), load the result into the replica, evaluate.

Churn: a peer that is behind (newcomer, restart from an old checkpoint, straggler) or whose weights left
the swarm's (a failed round, a reducer that died mid-all-reduce) downloads the swarm's state from peers
that hold it (``state_sync.py``) and goes on from there. Checkpoints are written in the background after
every ``checkpoint.every_rounds`` rounds and when leaving; ``join`` resumes from the newest one.

SIGTERM/SIGINT: finish the current inner step, write a checkpoint, withdraw from the swarm, exit 0 within
``run.shutdown_grace`` seconds; a second signal exits at once. No child process (p2pd, averager) survives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .swarm.admission import load_admission
from .averaging.averager import RoundAverager, RoundResult
from .state.checkpoint import CheckpointManager, capture, restore
from .config import PeerConfig
from .training.data import Corpus, shard_for_peer
from .observe.events import EventLog
from .observe.metrics import MetricsServer, PeerMetrics
from .training.model import build_model, num_parameters
from .training.outer_optimizer import OuterOptimizer
from .overlapped_round import OverlappedRounds
from .swarm.progress import SwarmProgress
from .swarm.reachability import DIRECT, RELAYED, Reach, ReachabilityWatch
from .reaper import Reaper, exit_with_children
from .averaging.robust_aggregation import refuse_update
from .state.state_sync import StateSync, swarm_target
from .swarm.join import join_swarm, visible_addresses
from .training.trainer import ComputeThread, Trainer

logger = logging.getLogger("diloco_peer")

PROGRESS_EVENTS_PER_ROUND = 5
PROGRESS_LOG_SECONDS = 30.0  # a human-readable progress line at most this often between round lines
WITHDRAW_TIMEOUT = 5.0  # seconds a leaving peer gives the DHT to store its tombstone


class PeerDaemon:
    """One swarm member. Build it with the whole config; each component gets only its own section.

    :param cfg: the validated config tree
    :param initial_peers: bootstrap multiaddrs (one reachable is enough); empty starts a new swarm
    :param name: a human name for logs and the event file (default: the tail of the peer id)
    """

    def __init__(self, cfg: PeerConfig, initial_peers: list[str], name: str = ""):
        self.cfg, self.initial_peers, self.name = cfg, list(initial_peers), name
        self.stopping = False
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
        self.last_sync_epoch = -1
        """The outer epoch our last state sync brought us to (overlapped rounds rebase after it)."""
        self.delayed = cfg.outer.overlap == "delayed"
        self.averager: RoundAverager | None = None
        self._checkpoints: CheckpointManager | None = None
        self.tty = sys.stderr.isatty()
        """On a terminal: a live status bar per round (log lines print above it); else periodic log lines."""

    def _request_stop(self, signame: str) -> None:
        if self.stopping:
            logger.warning(f"second {signame}: exiting now")
            exit_with_children(130)
        grace = self.cfg.run.shutdown_grace
        logger.info(f"{signame}: leaving after the current inner step, within {grace:g}s "
                    f"(press Ctrl+C again to exit at once)")
        self.stopping = True
        asyncio.get_running_loop().call_later(grace, self._grace_expired)

    def _grace_expired(self) -> None:
        logger.error(f"could not leave cleanly within run.shutdown_grace={self.cfg.run.shutdown_grace:g}s: exiting "
                     f"now (the last complete checkpoint stays valid)")
        exit_with_children(1)

    async def run(self) -> int:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._request_stop, sig.name)
        self._compute = ComputeThread(cfg.run.threads or torch.get_num_threads())

        # before joining: a busy port fails at once, and /healthz says "joining" while we look for the swarm
        server = MetricsServer(self.metrics, cfg.metrics) if cfg.metrics.port else None
        self._children_before = {c.pid for c in psutil.Process().children(recursive=True)}
        reaper = Reaper()  # if we are SIGKILLed, our children (DHT, averager, p2pd) must not live on
        try:
            with logging_redirect_tqdm() if self.tty else contextlib.nullcontext():
                return await self._run(reaper)
        finally:
            self._compute.close()
            reaper.close()
            if server is not None:
                server.close()

    async def compute(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the compute thread, where all of our torch work runs."""
        return await self._compute.run(fn, *args, **kwargs)

    def _watch_children(self, reaper: Reaper) -> None:
        # the processes we started (not the host's other children, e.g. in tests); torch's shared-memory
        # manager is left out: it is shared by the whole process and exits by itself
        ours = [c for c in psutil.Process().children(recursive=True)
                if c.pid not in self._children_before and c.pid != reaper.proc.pid]
        reaper.watch([c.pid for c in ours if _name(c) not in ("torch_shm_manager", "")])

    async def _run(self, reaper: Reaper) -> int:
        cfg = self.cfg
        joined = await join_swarm(cfg.swarm, self.initial_peers, should_stop=lambda: self.stopping)
        if joined is None:
            return 0  # asked to leave while still waiting for a bootstrap
        dht, reach = joined
        (logger.info if reach.mode == DIRECT else logger.warning)(reach.line())
        self._watch_children(reaper)
        averager = progress = checkpoints = events = None
        watch = ReachabilityWatch(reach, list(cfg.swarm.relays) or self.initial_peers, cfg.swarm.reachability_check,
                                  on_change=self._on_reachability)
        try:
            peer_id = dht.peer_id.to_base58()
            self.name = self.name or f"peer-{peer_id[-8:]}"
            events = self.events = EventLog(Path(cfg.run.log_dir) / f"{self.name}.jsonl", self.metrics.observe)
            self._on_reachability(reach)
            shard = cfg.data.shard if cfg.data.shard >= 0 else shard_for_peer(peer_id, cfg.data.num_shards)
            corpus = await self.compute(Corpus, cfg.data, shard, cfg.model.vocab_size)
            model = await self.compute(build_model, cfg.model, cfg.run.seed)
            trainer = self.trainer = await self.compute(Trainer, model, corpus, cfg.inner)
            outer = self.outer = await self.compute(OuterOptimizer, trainer.model, cfg.outer)
            resumed_from = ""
            if cfg.checkpoint.dir:
                manager = CheckpointManager(cfg.checkpoint, self.name, cfg.fingerprint())
                state = await asyncio.to_thread(manager.load_latest)  # a foreign checkpoint raises here
                if state is not None:
                    await self.compute(restore, state, trainer, outer)
                    resumed_from = str(manager.files()[0])
                    logger.info(f"resumed from {resumed_from}: epoch {outer.epoch}, inner step {trainer.step}")
                checkpoints = manager
            admission = load_admission(cfg.swarm.secret_file, cfg.swarm.allowlist)
            averager = self.averager = RoundAverager(dht, [p.shape for p in outer.params], cfg.run.run_id,
                                                     cfg.averaging, admission, relayed=reach.mode == RELAYED)
            await watch.start(dht, serve=cfg.swarm.relay_service)
            self._watch_children(reaper)
            sync = self.sync = StateSync(averager.averager, outer, cfg.fingerprint(), cfg.outer.inner_steps,
                                         cfg.averaging, on_serve=lambda epoch, size: events.write(
                                             "serve", peer=self.name, epoch=epoch, bytes=size))
            progress = SwarmProgress(dht, cfg.run.run_id, peer_id, cfg.averaging.heartbeat)
            self.metrics.name = self.name
            progress.stats_provider = self.metrics.swarm_stats  # the swarm monitor reads these from the DHT
            await progress.publish(epoch=outer.epoch, round=outer.epoch, inner_step=trainer.step,
                                   state_hash=sync.state_hash)
            progress.start_heartbeat()

            eval_loss = await self.compute(trainer.evaluate)
            events.write(
                "start", peer=self.name, peer_id=peer_id, addresses=visible_addresses(dht), shard=shard,
                parameters=num_parameters(model), device=str(trainer.device), fingerprint=cfg.fingerprint(),
                eval_loss=eval_loss, param_sha256=sync.state_hash, pid=os.getpid(), epoch=outer.epoch,
                resumed_from=resumed_from,
            )
            logger.info(
                f"{self.name} ({peer_id}) joined run '{cfg.run.run_id}': {num_parameters(model) / 1e6:.2f}M params on "
                f"{trainer.device}, shard {shard}/{cfg.data.num_shards}, H={cfg.outer.inner_steps}, "
                f"epoch {outer.epoch}, eval loss {eval_loss:.4f}"
            )
            await self._catch_up(progress, await progress.swarm_records())
            await self._train(trainer, outer, averager, progress, events, checkpoints)
            events.write("stop", peer=self.name, reason="signal" if self.stopping else "max_rounds",
                         epoch=outer.epoch, inner_step=trainer.step)
            return 0
        finally:
            if checkpoints is not None:
                # leaving: save the last round boundary (an unfinished round is dropped, never half-saved),
                # unless the periodic checkpoint of this very boundary is already written (or being written)
                if self._saved_epoch != self.outer.epoch:
                    state = capture(self.trainer, self.outer, cfg.fingerprint())
                    # resume at the start of the round that follows the saved epoch (delayed: one later)
                    state.inner_step = (self.outer.epoch + self.delayed) * cfg.outer.inner_steps
                    checkpoints.save(state, self._on_checkpoint)
                checkpoints.close()  # waits for the writes in flight
            leaving = time.monotonic()
            if progress is not None:
                # a DHT store can wait out RPC timeouts to peers that just died; never longer than this,
                # since an unwithdrawn record expires by itself after three heartbeats anyway
                try:
                    await asyncio.wait_for(progress.withdraw(), timeout=WITHDRAW_TIMEOUT)
                except TimeoutError:
                    logger.warning(f"could not withdraw our progress record within {WITHDRAW_TIMEOUT:g}s; "
                                   f"it expires by itself within {3 * cfg.averaging.heartbeat:g}s")
            await watch.close()
            if averager is not None:
                await asyncio.to_thread(averager.shutdown)
            await asyncio.to_thread(dht.shutdown)
            logger.info(f"left the swarm in {time.monotonic() - leaving:.1f}s")
            if events is not None:
                events.close()

    def _on_reachability(self, reach: Reach) -> None:
        if self.events is not None:
            self.events.write("reachability", peer=self.name, mode=reach.mode, detail=reach.detail,
                              relays=len(reach.relays))
        if self.averager is not None:
            self.averager.relayed = reach.mode == RELAYED

    def _on_checkpoint(self, path: Path, seconds: float, size: int) -> None:
        self.events.write("checkpoint", peer=self.name, epoch=int(path.stem.split("-")[1]), path=str(path),
                          seconds=seconds, bytes=size)

    async def _catch_up(self, progress: SwarmProgress, records: list) -> bool:
        """If the swarm is ahead of us or our weights differ from its, download its state. True if we did.

        Until we hold the swarm's state (synced, or nothing to sync) our epoch does not vote on the swarm's
        (``progress.quorum_epoch``): a newcomer or a peer restarted from an old checkpoint knows nothing of it.
        """
        target = swarm_target(records)
        why = self.sync.needs_sync(target)
        if not why:
            if not progress.record.joined:
                await progress.publish(joined=True)
            return False
        logger.info(f"state sync: {why}; downloading epoch {target.epoch} from one of {len(target.holders)} peers")
        result = await self.sync.sync(target)
        for _ in range(2):  # the swarm stepped on during the download: once more, for its new state
            if not result.moved_on or not self.sync.needs_sync(target := swarm_target(await progress.swarm_records())):
                break
            result = (await self.sync.sync(target)).after(result)
        self.events.write("sync", peer=self.name, reason=why, donor=result.donor, epoch=result.epoch,
                          seconds=result.seconds, bytes=result.bytes, attempts=result.attempts, ok=result.ok,
                          error=result.error, donor_errors=result.donor_errors)
        if not result.ok:
            logger.warning(f"state sync failed ({result.error}); will try again at the next round")
            return False
        # the inner LR-schedule position: the round after the synced epoch (delayed mode: the round after that,
        # which the swarm trains while it averages the synced epoch's)
        self.trainer.step = (self.outer.epoch + self.delayed) * self.cfg.outer.inner_steps
        self.last_sync_epoch = self.outer.epoch
        self.averager.reset_feedback()  # the residual belonged to the weights we just replaced
        await progress.publish(epoch=self.outer.epoch, round=self.outer.epoch + self.delayed,
                               inner_step=self.trainer.step, ready=False, state_hash=self.sync.state_hash, joined=True)
        logger.info(f"state sync: now at epoch {self.outer.epoch} ({result.bytes / 1e6:.2f} MB from "
                    f"{result.donor[-8:]} in {result.seconds:.2f}s)")
        return True

    async def _train(self, trainer: Trainer, outer: OuterOptimizer, averager: RoundAverager,
                     progress: SwarmProgress, events: EventLog, checkpoints: CheckpointManager | None) -> None:
        """Outer rounds until stopped or ``run.max_rounds``; an interrupted round is abandoned, not sent."""
        self._last_log = time.monotonic()
        self._checkpoints = checkpoints
        if self.delayed:
            return await OverlappedRounds(self, averager, progress).run(self._finish_round)
        while not self.stopping and not self._reached_max_rounds():
            started = time.perf_counter()
            epoch = outer.epoch
            inner = await self._inner_steps(trainer, epoch, progress, events)
            if self.stopping:
                return  # a partial pseudo-gradient would skew the average
            record = await self._outer_round(trainer, outer, averager, progress, epoch, inner)
            if record is None:
                continue  # stopping, or the round was replaced by a state sync
            record.update(round_seconds=time.perf_counter() - started)
            self._finish_round(record, inner)

    def _finish_round(self, record: dict, inner: dict) -> None:
        """Log and count a finished round, and write the periodic checkpoint when due."""
        if record["outcome"] == "averaged" and self.first_contribution is None:
            self.first_contribution = time.time() - psutil.Process().create_time()
            record["first_contribution_seconds"] = self.first_contribution
        self.events.write("round", **record)
        self._last_log = time.monotonic()
        megabytes = (record["bytes_sent"] + record["bytes_received"]) / 1e6
        logger.info(
            f"round {record['round']}: {record['outcome']} with group of {record['group_size']} "
            f"({record['allreduce_seconds']:.2f}s, {megabytes:.2f} MB)"
            f" | train loss {record['train_loss']:.4f} | eval loss {record['eval_loss']:.4f} | "
            f"{inner['tokens'] / max(inner['compute_seconds'], 1e-9):,.0f} tok/s"
        )
        if self._checkpoints is not None and self._checkpoints.due(self.outer.epoch):
            self._checkpoints.save(capture(self.trainer, self.outer, self.cfg.fingerprint()), self._on_checkpoint)
            self._saved_epoch = self.outer.epoch

    def _reached_max_rounds(self) -> bool:
        if self.cfg.run.max_rounds and self.outer.epoch >= self.cfg.run.max_rounds:
            logger.info(f"{self.name}: reached run.max_rounds={self.cfg.run.max_rounds}, leaving the swarm")
            return True
        return False

    async def _inner_steps(self, trainer: Trainer, epoch: int, progress: SwarmProgress, events: EventLog) -> dict:
        """The H inner steps of ``epoch``, in chunks so that progress shows between them."""
        H = self.cfg.outer.inner_steps
        chunk = max(1, H // PROGRESS_EVENTS_PER_ROUND)
        tokens, compute, weighted_loss = 0, 0.0, 0.0
        bar = tqdm(total=H, initial=trainer.step - epoch * H, desc=f"round {epoch + 1}", unit="step", leave=False,
                   dynamic_ncols=True, disable=not self.tty)
        while trainer.step - epoch * H < H and not self.stopping:
            todo = min(chunk, H - (trainer.step - epoch * H))
            stats = await self.compute(trainer.train_steps, todo, lambda: self.stopping)
            tokens, compute = tokens + stats.tokens, compute + stats.seconds
            weighted_loss += stats.loss * stats.steps
            progress.record = progress.record.copy(update={"inner_step": trainer.step})  # sent with the heartbeat
            tokens_per_second = stats.tokens / max(stats.seconds, 1e-9)
            events.write("progress", peer=self.name, epoch=epoch, inner_step=trainer.step, steps=stats.steps,
                         seconds=stats.seconds, loss=stats.loss, lr=stats.lr, tokens=stats.tokens,
                         tokens_per_second=tokens_per_second)
            bar.update(stats.steps)
            bar.set_postfix_str(f"loss {stats.loss:.3f} | {tokens_per_second:,.0f} tok/s | lr {stats.lr:.1e}")
            if not self.tty and time.monotonic() - self._last_log >= PROGRESS_LOG_SECONDS:
                self._last_log = time.monotonic()
                logger.info(f"round {epoch + 1}: inner step {trainer.step - epoch * H}/{H} | "
                            f"train loss {stats.loss:.4f} | lr {stats.lr:.2e} | {tokens_per_second:,.0f} tok/s")
        bar.close()
        return {"tokens": tokens, "compute_seconds": compute, "train_loss": weighted_loss / H}

    async def _outer_round(self, trainer: Trainer, outer: OuterOptimizer, averager: RoundAverager,
                           progress: SwarmProgress, epoch: int, inner: dict) -> dict | None:
        """Gate, all-reduce (or solo), outer step, eval. Returns the round's record; None if stopping or if
        the swarm had moved on and the round was replaced by a state sync."""
        cfg = self.cfg
        pseudo_gradient = await self.compute(outer.pseudo_gradient)
        await progress.publish(epoch=epoch, inner_step=trainer.step, ready=True,
                               tokens=progress.record.tokens + inner["tokens"])
        decision = await progress.wait_until_ready(
            min_peers=cfg.averaging.min_peers if epoch == 0 else 1,
            min_peers_timeout=cfg.averaging.first_round_timeout,
            ready_timeout=cfg.averaging.ready_timeout,
            should_stop=lambda: self.stopping,
        )
        if self.stopping:
            return None
        # behind or off the swarm's weights: our pseudo-gradient is relative to a state nobody else holds
        if await self._catch_up(progress, decision.records):
            return None
        if decision.ready > 1:
            self.events.write("averaging", peer=self.name, epoch=epoch, ready_peers=decision.ready)
            result = await averager.average(pseudo_gradient, weight=inner["tokens"], epoch=epoch)
            self.report_offenses(result)
            if result.ok and (why := refuse_update(result.averaged, pseudo_gradient, cfg.averaging.max_update_ratio)):
                result.ok, result.error = False, f"refused the group's average: {why}"
            outcome = "averaged" if result.ok else "failed"
        else:
            result, outcome = RoundResult(ok=False, error=decision.reason), "solo"
        if outcome == "failed":
            logger.warning(f"round {epoch + 1}: averaging failed ({result.error}); taking a solo outer step")
        if len(set(result.group_epochs)) > 1:
            logger.warning(f"round {epoch + 1}: the group mixed epochs {sorted(result.group_epochs)}")
        await self.compute(self._outer_step, result.averaged if result.ok else pseudo_gradient)
        await progress.publish(epoch=outer.epoch, round=outer.epoch, ready=False, state_hash=self.sync.state_hash)
        if result.values_not_averaged or outcome == "failed":
            # our weights now differ from those of the others in the group: re-sync at once, before training
            logger.warning(f"round {epoch + 1}: {result.values_not_averaged} values were not averaged "
                           f"(a peer failed mid-round); checking our weights against the swarm's")
            # compare with the state the others end this round with: wait until one of them has stepped (a
            # peer that died mid-round stops counting when its record expires, after 3 heartbeats)
            timeout = cfg.averaging.ready_timeout + 3 * cfg.averaging.heartbeat
            await self._catch_up(progress, await progress.wait_for_round_end(epoch, timeout, lambda: self.stopping))
        eval_loss = await self.compute(trainer.evaluate)
        return {
            "peer": self.name, "round": outer.epoch, "epoch": epoch, "outcome": outcome,
            "group_size": result.group_size, "group_epochs": result.group_epochs, "ready_peers": decision.ready,
            "alive_peers": decision.alive, "wait_seconds": decision.waited, "allreduce_seconds": result.seconds,
            "transfer_seconds": result.transfer_seconds,
            "bytes_sent": result.bytes_sent, "bytes_received": result.bytes_received,
            "bytes_relayed": result.bytes_relayed,
            "values_not_averaged": result.values_not_averaged, "error": result.error, **inner,
            "eval_loss": eval_loss, "inner_lr": trainer.current_lr(), "outer_lr": cfg.outer.lr,
            "inner_step": trainer.step, "param_sha256": self.sync.state_hash,
        }

    def report_offenses(self, result: RoundResult) -> None:
        """Log the contributions our averager refused (metrics count them, by kind, from the event log)."""
        for offense in result.offenses:
            self.events.write("offense", peer=self.name, **offense)
            if offense["banned"]:
                logger.warning(f"banned peer {offense['offender']} for {self.cfg.averaging.ban_seconds:g}s: repeated "
                               f"offenses, the last: {offense['kind']}: {offense['detail']}")

    def _outer_step(self, update: list[torch.Tensor]) -> None:
        with self.sync.lock:  # a peer downloading our state sees the state before or after, never between
            self.outer.step(update)
            self.sync.after_outer_step()


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:  # gone meanwhile
        return ""
