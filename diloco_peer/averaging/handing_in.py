"""``RoundAverager``'s side of handing in (``hand_in.py``): the slow peer hands its pseudo-gradient in and gets the
round's average back; the proxy tells the peers that handed in when it runs no all-reduce for their round.

The calls go to the averager process (``HandInService``), each through ``lifecycle.hivemind_calls`` with a bounded
wait; a failure is a reason (a string) or a failed ``RoundResult``, never an exception into the round.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from ..lifecycle import hivemind_calls

logger = logging.getLogger(__name__)


class HandingIn:
    """Mixed into ``RoundAverager``: uses its ``averager`` (the process's ``PseudoGradientAverager``), ``cfg``,
    ``faults``, ``admission``, ``peer_id``, ``_handed``, ``_in_flight`` and its ``_copy_in``, ``_result`` and
    ``matchmaking_window``."""

    async def hand_in(self, pseudo_gradient: list[torch.Tensor], weight: float, epoch: int, proxy: str) -> str:
        """Hand ``pseudo_gradient`` (weighted by ``weight``, its tokens) in to ``proxy`` (base58) for the round of
        ``epoch``, instead of joining its all-reduce (``hand_in.py``): sent whole, in fp32. Why it was not taken ("" if
        it was: ``handed_back`` gets the round's average from the proxy once its round ended)."""
        self._handed = (time.perf_counter(), self.averager.traffic.clone())
        self._copy_in(pseudo_gradient)
        self._in_flight = True
        try:
            timeout = self.cfg.request_timeout * 10
            return await hivemind_calls.call(self.averager.hand_in_to, proxy, epoch,
                                             float(self.faults.poisoned_weight(weight)),
                                             self.admission.proof(self.peer_id), timeout, timeout=timeout * 2)
        except Exception as e:  # the proxy is gone, or broke off: we join the all-reduce instead
            return f"{type(e).__name__}: {e}".strip(": ")
        finally:
            self._in_flight = False

    async def no_all_reduce(self, epoch: int) -> None:
        """(The proxy.) We run no all-reduce for the round of ``epoch``: the peers that handed it in to us hear so at
        once."""
        try:
            await hivemind_calls.call(self.averager.no_all_reduce, epoch, timeout=self.cfg.request_timeout * 10)
        except Exception as e:  # they hear it when their wait for our average ends
            logger.warning(f"could not tell the peers that handed round {epoch} in that it has no average: {e!r}")

    async def finish_hand_backs(self, timeout: float) -> float:
        """(The proxy, leaving.) Give the peers that handed in to us ``timeout`` seconds to take their rounds'
        answers: a slow peer receives the average at its own pace, and stopping our averager process would break
        its stream (its round failed, and with the swarm gone, its replica stayed off the others'). The seconds
        waited."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            try:
                owed = await hivemind_calls.call(self.averager.hand_backs_owed, timeout=self.cfg.request_timeout)
            except Exception as e:  # our averager process is not answering: nobody gets an answer from it anyway
                logger.debug(f"could not ask our averager which hand-backs are owed: {e!r}")
                break
            if not owed:
                break
            await asyncio.sleep(0.05)
        return time.monotonic() - started

    async def handed_back(self, proxy: str, epoch: int):  # -> RoundResult (averager.py imports this module)
        """The round's average from the proxy we handed in to (``hand_in``), once its round ended: a result as
        ``average``'s, the proxy's group's size its size (failed: no clean average came; we heal as after a failed
        round)."""
        started, before = self._handed
        wait = self.matchmaking_window(None) * 3 + 2 * self.cfg.allreduce_timeout  # (as ``_average`` waits a step)
        self._in_flight = True
        try:
            group_size = await hivemind_calls.call(self.averager.fetch_average, proxy, epoch, wait,
                                                   timeout=wait + self.cfg.request_timeout * 20)
        except Exception as e:
            return self._result(False, started, before, error=f"{type(e).__name__}: {e}".strip(": "))
        finally:
            self._in_flight = False
        if not group_size:
            return self._result(False, started, before, error=f"no clean average from our proxy {proxy[-8:]}")
        with self.averager.get_tensors() as tensors:
            averaged = list(tensors)
        return self._result(True, started, before, averaged=averaged, group_size=group_size,
                            group_epochs=[epoch] * group_size)
