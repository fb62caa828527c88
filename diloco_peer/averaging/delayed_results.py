"""A member that reduces nothing gets its averages only after it has sent all its parts (hivemind's "delayed
results", ``AllReduceRunner.should_delay_results``): a client, or a member much slower than the group's median
(``vector_split`` gives it no span).

hivemind's reducer reads such a member's whole stream before it answers, and the member reads no answer before its
last part is written. Both waits assume the stream runs to its end. A reducer that refuses the member's part stops
reading and ends the stream instead (``ExactAllReduceRunner._accumulate_parts_streaming``), and then neither side
saw that end: the reducer held its own round for ``reducer_timeout``, and the member, whose writer never finishes a
stream the other side has closed, waited for its ``allreduce_timeout`` (BENCHMARKS.md, "A refused member that
reduces nothing"). ``replies_after_sending`` gives the member the reducer's answer as soon as there is one: its
averages once its parts are out, as before, or the stream's end, whichever comes first.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


async def replies_after_sending(replies: AsyncIterator, sent: asyncio.Event) -> AsyncIterator:
    """``replies``, read once ``sent`` is set or once the first reply (or the stream's end) comes, whichever is first.

    What follows is read as the caller reads it: its timeouts count from when our parts are out, as hivemind's do.
    """
    first = asyncio.ensure_future(anext(replies, None))
    sending = asyncio.ensure_future(sent.wait())
    try:
        await asyncio.wait({first, sending}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        await _stopped(first)
        raise
    finally:
        sending.cancel()
    return _starting_with(first, replies)


async def _starting_with(first: asyncio.Future, replies: AsyncIterator) -> AsyncIterator:
    try:
        message = await first
        if message is None:  # the reducer ended the stream: it sends nothing more
            return
        yield message
        async for message in replies:
            yield message
    finally:
        await _stopped(first)
        await replies.aclose()


async def _stopped(first: asyncio.Future) -> None:
    """``first`` cancelled, if still reading, and over: a stream it may still be reading is closed only after."""
    if not first.done():
        first.cancel()
    await asyncio.gather(first, return_exceptions=True)
