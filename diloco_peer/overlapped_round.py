"""Overlapped rounds (``outer.overlap = "delayed"``): the all-reduce of round t runs while round t+1 trains.

DiLoCoX's one-step delay, as ``diloco-peer simulate --overlap delayed`` computes it (and a test checks
that a real swarm computes the same). At the end of round t a peer:

1. takes its *progress* during round t (weights at the start of the round minus weights now);
2. waits for the average of round t-1, which was all-reduced in the background while round t trained
   (usually long done: this is the only place where communication can still cost training time);
3. applies the outer step with that average to the CPU outer weights and continues from
   ``outer + progress of round t``: the progress already included in the average is replaced by the
   average, the progress not sent yet is kept;
4. publishes "ready" for epoch t and starts the gate + all-reduce of round t's progress in the
   background, then goes straight on with round t+1.

Epochs: after step 3 of round t the outer weights are at epoch t (t averages applied); the record says
``epoch t, ready, round t+1`` while round t+1 trains. The gate of epoch t waits for the peers whose
record says ``round t`` (``SwarmProgress.wait_until_ready(delayed=True)``). The outer weights of peers
that averaged together stay bit-identical; their replicas differ by each peer's own unsent progress.

Churn, failures and bad averages fall back on a *rebase*: download the swarm's outer state (state sync)
and continue from it plus our own progress. A newcomer synced at epoch e trains round e+1 and rebases at
its end onto epoch e+1, which the others reach by applying the average of round e it never saw; from
there it is in step. A round whose all-reduce failed rebases onto the peers that succeeded, or, if none
did within ``averaging.ready_timeout``, takes a solo step with its own progress.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from .averaging.averager import RoundAverager, RoundResult
from .swarm.progress import ReadyDecision, SwarmProgress
from .averaging.robust_aggregation import refuse_update

logger = logging.getLogger("diloco_peer")


class OverlappedRounds:
    """Runs the daemon's rounds in delayed mode; the daemon hands over its running components.

    :param peer: the ``PeerDaemon`` (config, trainer, outer optimizer, state sync, events, stop flag)
    :param averager: the round averager (the all-reduce runs in its process)
    :param progress: our progress record and the round gate
    """

    def __init__(self, peer, averager: RoundAverager, progress: SwarmProgress):
        self.peer, self.averager, self.progress = peer, averager, progress
        self.pending: asyncio.Task | None = None
        """The gate + all-reduce of the last round's progress, running while this round trains."""
        self.sent: list[torch.Tensor] = []
        """The pseudo-gradient ``pending`` averages (a solo step applies it if the all-reduce fails)."""

    async def run(self, finish_round) -> None:
        """Rounds until stopped or ``run.max_rounds``; ``finish_round(record)`` logs, counts and checkpoints."""
        peer, cfg = self.peer, self.peer.cfg
        trainer, H = peer.trainer, cfg.outer.inner_steps
        try:
            while not peer.stopping and not peer._reached_max_rounds():
                started = time.perf_counter()
                start = await peer.compute(_cpu_copy, trainer.model)
                inner = await peer._inner_steps(trainer, trainer.step // H, self.progress, peer.events)
                if peer.stopping:
                    return  # a partial round is neither sent nor applied
                progress = await peer.compute(_progress_since, trainer.model, start)
                record = await self._end_of_round(progress, inner)
                self._launch(progress, inner["tokens"])
                if record is not None:
                    record["round_seconds"] = time.perf_counter() - started
                    finish_round(record, inner)
        finally:
            if self.pending is not None:
                self.pending.cancel()

    async def _end_of_round(self, progress: list[torch.Tensor], inner: dict) -> dict | None:
        """Steps 2-3: apply the last round's average (or rebase, or go solo). The round's record, or None
        when there was nothing to apply (the first round after starting or syncing)."""
        peer, cfg = self.peer, self.peer.cfg
        outer = peer.outer
        if self.pending is None:
            if peer.last_sync_epoch == outer.epoch:
                # synced into a running swarm: the others apply the average of the round we joined in the
                # middle of; take their result as soon as they have it, with our progress on top
                records = await self.progress.wait_for_round_end(outer.epoch, cfg.averaging.ready_timeout,
                                                                 lambda: peer.stopping)
                await self._rebase(progress, records)
            else:
                self._keep(progress)  # a fresh start: nothing to apply yet
            return None
        waited = time.perf_counter()
        try:
            decision, result = await self.pending
        except Exception as e:  # e.g. the DHT failed to store our record: never fatal, the round is lost
            decision = ReadyDecision(1, 1, 0.0, "error")
            result = RoundResult(ok=False, error=f"{type(e).__name__}: {e}")
        self.pending = None
        self.peer.report_offenses(result)
        wait_seconds = time.perf_counter() - waited
        epoch = outer.epoch
        outcome = "averaged" if result.ok else ("failed" if decision.ready > 1 else "solo")
        if result.ok and (why := refuse_update(result.averaged, self.sent, cfg.averaging.max_update_ratio)):
            result.ok, result.error, outcome = False, f"refused the group's average: {why}", "failed"
        if outcome == "failed":
            logger.warning(f"round {epoch + 1}: averaging failed ({result.error})")
        if result.ok:
            await self.peer.compute(self._apply, result.averaged, progress)
        elif not await self._rebase(progress, await self.progress.wait_for_round_end(
                epoch, cfg.averaging.ready_timeout, lambda: peer.stopping)):
            await self.peer.compute(self._apply, self.sent, progress)  # solo: our own progress of that round
        if result.values_not_averaged:
            logger.warning(f"round {epoch + 1}: {result.values_not_averaged} values were not averaged "
                           f"(a peer failed mid-round); checking our weights against the swarm's")
            await self._rebase(progress, await self.progress.wait_for_round_end(
                epoch, cfg.averaging.ready_timeout + 3 * cfg.averaging.heartbeat, lambda: peer.stopping))
        eval_loss = await self.peer.compute(self._evaluate_outer)
        return {
            "peer": peer.name, "round": outer.epoch, "epoch": epoch, "outcome": outcome,
            "group_size": result.group_size, "group_epochs": result.group_epochs, "ready_peers": decision.ready,
            "alive_peers": decision.alive, "wait_seconds": decision.waited, "allreduce_seconds": result.seconds,
            "transfer_seconds": result.transfer_seconds,
            "overlap_wait_seconds": wait_seconds,
            "bytes_sent": result.bytes_sent, "bytes_received": result.bytes_received,
            "bytes_relayed": result.bytes_relayed,
            "values_not_averaged": result.values_not_averaged, "error": result.error, **inner,
            "eval_loss": eval_loss, "inner_lr": peer.trainer.current_lr(), "outer_lr": cfg.outer.lr,
            "inner_step": peer.trainer.step, "param_sha256": peer.sync.state_hash,
        }

    def _apply(self, update: list[torch.Tensor], progress: list[torch.Tensor]) -> None:
        """Outer step with ``update`` (loads the new outer weights into the replica), then our progress."""
        self.peer._outer_step(update)
        self._keep(progress)

    def _evaluate_outer(self) -> float:
        """Eval loss of the outer weights (the replica holds outer + unsent progress: put it back after)."""
        trainer = self.peer.trainer
        live = [p.detach().clone() for p in trainer.model.parameters()]
        self.peer.outer.load_into_model()
        try:
            return trainer.evaluate()
        finally:
            with torch.no_grad():
                for p, saved in zip(trainer.model.parameters(), live):
                    p.copy_(saved)

    def _keep(self, progress: list[torch.Tensor]) -> None:
        """Replica = outer weights + ``progress`` (the progress not averaged yet)."""
        with torch.no_grad():
            for p, o, d in zip(self.peer.trainer.model.parameters(), self.peer.outer.params, progress):
                p.copy_((o + d).to(p.device, p.dtype))

    async def _rebase(self, progress: list[torch.Tensor], records: list) -> bool:
        """If the swarm holds other outer weights than ours, download them and keep our progress on top."""
        if not await self.peer._catch_up(self.progress, records):
            return False
        await self.peer.compute(self._keep, progress)
        return True

    def _launch(self, progress: list[torch.Tensor], tokens: int) -> None:
        """Step 4: publish "ready" for our epoch and average the round's pseudo-gradient in the background."""
        self.sent = [-d for d in progress]  # start - end, like ``outer - replica`` in blocking mode
        self.pending = asyncio.create_task(self._gate_and_average(self.sent, tokens, self.peer.outer.epoch))

    async def _gate_and_average(self, pseudo_gradient: list[torch.Tensor], tokens: int,
                                epoch: int) -> tuple[ReadyDecision, RoundResult]:
        peer, cfg = self.peer, self.peer.cfg
        await self.progress.publish(epoch=epoch, round=epoch + 1, ready=True, state_hash=peer.sync.state_hash,
                                    tokens=self.progress.record.tokens + tokens)
        decision = await self.progress.wait_until_ready(
            min_peers=cfg.averaging.min_peers if epoch == 0 else 1,
            min_peers_timeout=cfg.averaging.first_round_timeout,
            ready_timeout=cfg.averaging.ready_timeout,
            should_stop=lambda: peer.stopping,
            delayed=True,
        )
        if decision.ready < 2 or peer.stopping:
            return decision, RoundResult(ok=False, error=decision.reason)
        peer.events.write("averaging", peer=peer.name, epoch=epoch, ready_peers=decision.ready)
        return decision, await self.averager.average(pseudo_gradient, weight=tokens, epoch=epoch)


def _cpu_copy(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().to("cpu", torch.float32, copy=True) for p in model.parameters()]


def _progress_since(model: torch.nn.Module, start: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().to("cpu", torch.float32) - s for p, s in zip(model.parameters(), start)]
