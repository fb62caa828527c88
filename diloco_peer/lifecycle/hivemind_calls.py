"""Blocking calls into hivemind, made from the event loop: each in a daemon thread, with a bounded wait.

hivemind's DHT and averager run in child processes; their host-side methods (``DHT.get``/``store``/``shutdown``,
``DecentralizedAverager.step(...).result()``, ``shutdown``) send a request through a pipe and block on an
``MPFuture`` with no timeout. When the child is gone (it died, or it is shutting down), some of them never
return. Run with ``asyncio.to_thread`` such a call occupies a worker of the loop's default executor, and
that executor is waited for twice on the way out: by ``asyncio.Runner.close`` (``shutdown_default_executor``)
and by Python itself at exit, which joins every executor thread. A peer that had left the swarm in 5 s then
never exited (issue 15: 13 minutes, until SIGKILL).

``call`` runs the function in a thread of its own, marked daemon, that nobody joins: the caller stops waiting
after ``timeout`` (``TimeoutError``) and a call that can no longer finish is abandoned with the process, never
waited for. Use it for every call into hivemind's processes; plain CPU or disk work keeps ``asyncio.to_thread``.
``unless_stopped`` gives up such a wait at once when the peer is asked to leave (a state download in flight).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller gave up (timeout, cancelled) before the call returned
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


async def call(fn: Callable[..., Any], *args, timeout: float | None = None, **kwargs) -> Any:
    """``fn(*args, **kwargs)`` in a daemon thread; its result, or its exception, here.

    :param timeout: seconds to wait at most (None: as long as it takes); then ``TimeoutError``, while the call
      itself runs on, abandoned: it cannot keep the process from exiting
    """
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        result = None
        error = None
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller, whatever it is
            error = e
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop is closed: nobody waits for this answer any more
            pass

    threading.Thread(target=run, name=f"hivemind-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return await asyncio.wait_for(future, timeout)


async def unless_stopped(download, should_stop: Callable[[], bool], poll: float = 0.5):
    """``await download``, unless ``should_stop()`` turns true first: then it is cancelled (``CancelledError``)."""
    task = asyncio.ensure_future(download)
    while not task.done():
        if should_stop():
            task.cancel()
            raise asyncio.CancelledError()
        await asyncio.wait({task}, timeout=poll)
    return task.result()
