"""How a round's inner steps show while they run: a ``progress`` event after every chunk of steps (metrics, the
monitor and the demo's summary read those), a live status bar on a terminal, and otherwise a human-readable log
line every ``PROGRESS_LOG_SECONDS`` (``OuterRounds._inner_steps`` feeds it; the daemon's round line resets the
clock, so that a log shows one or the other, never both at once)."""

from __future__ import annotations

import logging
import time

from tqdm import tqdm

from .events import EventLog

logger = logging.getLogger("diloco_peer")

PROGRESS_LOG_SECONDS = 30.0
"""A progress line at most this often between two round lines (no terminal)."""


class InnerProgress:
    """The progress display of one peer's rounds.

    :param events: the event log the ``progress`` events go to
    :param name: this peer's name, in the events
    :param tty: show a live status bar per round (else a progress line every ``PROGRESS_LOG_SECONDS``)
    """

    def __init__(self, events: EventLog, name: str, tty: bool):
        self.events = events
        self.name = name
        self.tty = tty
        self.last_log = time.monotonic()
        """When the last line about training was logged (``logged_round`` after a round's own line)."""
        self._bar: tqdm | None = None

    def start(self, epoch: int, inner_steps: int, done: int) -> None:
        """Round ``epoch + 1`` of ``inner_steps`` steps begins (or goes on: ``done`` of them are behind it)."""
        self._bar = tqdm(total=inner_steps, initial=done, desc=f"round {epoch + 1}", unit="step", leave=False,
                         dynamic_ncols=True, disable=not self.tty)

    def chunk(self, epoch: int, inner_step: int, done: int, stats) -> None:
        """A chunk of steps ended (``stats``: the trainer's ``InnerStats``); ``done`` of the round's steps are."""
        tokens_per_second = stats.tokens / max(stats.seconds, 1e-9)
        self.events.write("progress", peer=self.name, epoch=epoch, inner_step=inner_step, steps=stats.steps,
                          seconds=stats.seconds, loss=stats.loss, lr=stats.lr, tokens=stats.tokens,
                          tokens_per_second=tokens_per_second)
        if done > self._bar.total:  # a round bounded by time trains past its plan while its time lasts
            self._bar.total = done
        self._bar.update(stats.steps)
        self._bar.set_postfix_str(f"loss {stats.loss:.3f} | {tokens_per_second:,.0f} tok/s | lr {stats.lr:.1e}")
        if not self.tty and time.monotonic() - self.last_log >= PROGRESS_LOG_SECONDS:
            self.last_log = time.monotonic()
            logger.info(f"round {epoch + 1}: inner step {done}/{self._bar.total} | train loss {stats.loss:.4f} | "
                        f"lr {stats.lr:.2e} | {tokens_per_second:,.0f} tok/s")

    def end(self) -> None:
        """The round's steps are over (or stopped): the bar goes."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def logged_round(self) -> None:
        """The daemon logged a round's line: the next progress line waits ``PROGRESS_LOG_SECONDS`` from now."""
        self.last_log = time.monotonic()
