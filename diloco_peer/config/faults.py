"""Fault injection: the test seam through which the tests make a real peer misbehave on purpose.

The slow tests start real peers that crash in the middle of an all-reduce, send poisoned numbers, lie about
their epoch or serve a corrupt state, and check that the honest peers cope. A peer learns its part from one
environment variable, ``DILOCO_PEER_FAULT`` (``FAULT_ENV``), parsed once at start-up into a ``Faults``: the
daemon hands that object to the three components that can misbehave (``RoundAverager``, ``SwarmProgress``,
``StateSync``), which call its hooks at the one point where each fault acts. No other module reads the
variable or tests a fault's name.

In production the variable is unset and ``Faults()`` (``NO_FAULTS``, the default of every ``faults``
parameter) does nothing: every hook is a no-op.

One fault at a time:

- ``crash_in_allreduce:N``: die (SIGKILL, the daemon process too) in the middle of our N-th all-reduce, as a
  reducer that has received a first part, answered nobody yet and sent nobody a part of its own (it never opens
  its streams): the worst moment for the others;
- ``freeze_in_allreduce:N``: stop (SIGSTOP) our averager process as our N-th all-reduce begins, before it sends
  anything (or, reducing every part, when a first part arrives): its connections stay up and say nothing, as a
  member whose machine went to sleep or whose link went dead without a reset (our DHT and p2pd run on; whoever
  runs the test ends the frozen process);
- ``poison:nan`` / ``poison:X`` / ``poison:signflip``: send NaNs / our pseudo-gradient times X / its negation;
  ``poison:shape`` sends every part one value short (a buggy fork); ``poison:weight`` claims 1e12 tokens;
  ``poison:averages`` sends honestly but, as a reducer, returns every average negated (our own stays true);
- ``lie_epoch:N``: publish epoch N in every progress record (with the hash of our real weights) and serve our
  state as epoch N; everything else honestly;
- ``corrupt_state`` (or ``corrupt_state:noise``): serve weights off by 1e-3 (finite, plausible, not what we
  published); ``corrupt_state:nan``: serve NaN weights.
- ``slow_serve:SECONDS``: wait that long before serving a state download (a newcomer is mid-sync meanwhile).
- ``break_serve:K``: end every state download we serve after K tensors (a stream cut: the newcomer resumes
  from another donor).
- ``stall_serve:K``: send K tensors of every state download we serve, then nothing, the stream left open (a
  donor that serves, then stalls: the newcomer gives up within its sync timeout and resumes elsewhere).
- ``refuse_round:N[,N...]``: refuse the group's average of round N (epoch N-1) after the all-reduce succeeded,
  as a peer whose check of the average fails: the others applied it, we did not (our weights leave theirs).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError, shortened

FAULT_ENV = "DILOCO_PEER_FAULT"
"""The environment variable that switches a fault on (tests only); empty is the same as unset."""
KINDS = ("crash_in_allreduce", "freeze_in_allreduce", "poison", "lie_epoch", "corrupt_state", "slow_serve",
         "break_serve", "stall_serve", "refuse_round")
"""The faults there are; a peer runs with one at most."""
GRAMMAR = ("crash_in_allreduce:N, freeze_in_allreduce:N, poison:nan|signflip|shape|weight|averages|X, lie_epoch:N, "
           "corrupt_state[:nan], slow_serve:SECONDS, break_serve:K, stall_serve:K, refuse_round:N[,N...]")
"""The values ``FAULT_ENV`` may take, as error messages show them."""


@dataclass(frozen=True)
class Faults:
    """The parsed fault plan; every field's default injects nothing. Frozen, so it crosses into the averager
    process (forked) as it is."""

    crash_in_allreduce: int = 0
    """Die in our N-th all-reduce (counted from 1); 0: never."""
    freeze_in_allreduce: int = 0
    """Stop our averager process, silent and connected, in our N-th all-reduce (counted from 1); 0: never."""
    poison_kind: str = ""
    """What we do to the pseudo-gradient we send: "", "nan", "signflip", "scale", "shape" or "weight"; or, as a
    reducer, to the averages we return: "averages"."""
    poison_scale: float = 1.0
    """The factor of ``poison_kind == "scale"`` (``poison:X``)."""
    lie_epoch: int | None = None
    """The epoch we claim in our progress records and state downloads instead of ours; None: the truth."""
    corrupt: str = ""
    """How the weights we serve to a state download are corrupted: "", "noise" or "nan"."""
    serve_delay: float = 0.0
    """Seconds we wait before serving a state download (``slow_serve:S``): a newcomer is then mid-sync that long."""
    serve_break_after: int = -1
    """Tensors we send of a state download before its stream ends (``break_serve:K``); -1: all of them."""
    serve_stall_after: int = -1
    """Tensors we send of a state download before it stalls, open and silent (``stall_serve:K``); -1: never."""
    refuse_rounds: tuple[int, ...] = ()
    """Rounds (counted from 1) whose average we refuse after a successful all-reduce (``refuse_round``)."""

    @classmethod
    def parse(cls, text: str) -> Faults:
        """The plan ``text`` (a ``FAULT_ENV`` value) describes; raises a one-line ``ConfigError`` if it is bad."""
        if text == "":
            return cls()
        kind, sep, arg = text.partition(":")
        if kind == "crash_in_allreduce" and sep and re.fullmatch(r"[1-9][0-9]*", arg):
            return cls(crash_in_allreduce=int(arg))
        if kind == "freeze_in_allreduce" and sep and re.fullmatch(r"[1-9][0-9]*", arg):
            return cls(freeze_in_allreduce=int(arg))
        if kind == "poison" and sep and arg in ("nan", "signflip", "shape", "weight", "averages"):
            return cls(poison_kind=arg)
        if kind == "poison" and sep and _number(arg) is not None:
            return cls(poison_kind="scale", poison_scale=_number(arg))
        if kind == "lie_epoch" and sep and re.fullmatch(r"[0-9]+", arg):
            return cls(lie_epoch=int(arg))
        if kind == "corrupt_state" and arg in ("", "noise", "nan"):
            return cls(corrupt=arg or "noise")
        if kind == "slow_serve" and sep and (delay := _number(arg)) is not None and 0 < delay <= 3600:
            return cls(serve_delay=delay)
        if kind == "break_serve" and sep and re.fullmatch(r"[0-9]+", arg):
            return cls(serve_break_after=int(arg))
        if kind == "stall_serve" and sep and re.fullmatch(r"[0-9]+", arg):
            return cls(serve_stall_after=int(arg))
        if kind == "refuse_round" and sep and re.fullmatch(r"[1-9][0-9]*(,[1-9][0-9]*)*", arg):
            return cls(refuse_rounds=tuple(int(n) for n in arg.split(",")))
        problem = f"unknown fault {shortened(kind)!r}" if kind not in KINDS else f"bad argument for {kind}"
        raise ConfigError(f"bad fault {shortened(text)!r} ({FAULT_ENV}): {problem}; expected one of {GRAMMAR}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> Faults:
        """The plan ``FAULT_ENV`` in ``environ`` describes (``NO_FAULTS`` if unset); raises like ``parse``."""
        return cls.parse(environ.get(FAULT_ENV, ""))

    # --- hooks: each called at the one point where its fault acts; a no-op unless that fault is planned

    def poison(self, tensors) -> None:
        """The all-reduce input, about to be sent: poisoned in place (``poison:nan|signflip|X``)."""
        for tensor in tensors:
            if self.poison_kind == "nan":
                tensor.fill_(float("nan"))
            elif self.poison_kind == "signflip":
                tensor.neg_()
            elif self.poison_kind == "scale":
                tensor.mul_(self.poison_scale)

    def poisoned_reply(self, averaged):
        """An average we return to another member as its reducer (``poison:averages``: negated)."""
        return -averaged if self.poison_kind == "averages" else averaged

    def poisoned_weight(self, weight: float) -> float:
        """The weight (tokens) we claim for our pseudo-gradient (``poison:weight``: a trillion, which would
        swamp the mean)."""
        return 1e12 if self.poison_kind == "weight" else weight

    @property
    def truncates_parts(self) -> bool:
        """Does every part we send lack its last value (``poison:shape``)?"""
        return self.poison_kind == "shape"

    def crash_now_if_due(self, allreduce: int) -> None:
        """Called by a reducer of our ``allreduce``-th all-reduce (counted from 1) when a part arrives: in the
        planned one, SIGKILL the daemon (this runs in its averager process, a child: the daemon's reaper then
        takes the DHT and p2pd along) and this process, with no chance to clean up or to answer anybody."""
        if self.crash_in_allreduce and allreduce == self.crash_in_allreduce:
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.freeze_in_allreduce and allreduce == self.freeze_in_allreduce:  # until someone sends SIGCONT
            os.kill(os.getpid(), signal.SIGSTOP)

    async def hold_sending(self, allreduce: int) -> None:
        """Called before we open a stream to another reducer in our ``allreduce``-th all-reduce: in the one we
        freeze in, stop now; in the one we crash in, never return (we die first, with our parts sent to nobody)."""
        if self.freeze_in_allreduce and allreduce == self.freeze_in_allreduce:  # until someone sends SIGCONT
            os.kill(os.getpid(), signal.SIGSTOP)
        if allreduce and allreduce in (self.crash_in_allreduce, self.freeze_in_allreduce):
            await asyncio.Event().wait()

    def refuses_average(self, round_number: int) -> str:
        """Why we refuse the group's average of round ``round_number`` ("" unless ``refuse_round`` names it).
        Called where the round's verdict checks the average it got (``rounds/outcome.py``)."""
        return "the fault injection says so (refuse_round)" if round_number in self.refuse_rounds else ""

    async def delay_serving(self) -> None:
        """Before we serve a state download (``slow_serve:S``): wait S seconds, as a donor on a slow link would."""
        if self.serve_delay:
            await asyncio.sleep(self.serve_delay)

    async def stall_serving(self, sent: int) -> None:
        """While we serve a state download, ``sent`` tensors into it (``stall_serve:K``): from the K-th on, hang
        with the stream open, as a donor that went silent mid-download would (until the downloader gives up)."""
        if sent == self.serve_stall_after:
            await asyncio.sleep(3600)

    def corrupt_state(self, weights: list) -> list:
        """The outer weights we serve to a state download (``corrupt_state``: off by 1e-3, or NaN). ``weights``
        are copies, free to change."""
        if self.corrupt == "nan":
            return [w.fill_(float("nan")) for w in weights]
        if self.corrupt == "noise":
            return [w + 1e-3 for w in weights]
        return weights


NO_FAULTS = Faults()
"""The production plan: no fault at all."""


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None
