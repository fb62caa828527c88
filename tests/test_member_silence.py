"""Telling a silent member from a slow one (``averaging/member_silence.py``), on the watch alone: a member is
dropped only when it said nothing for ``SILENT_AFTER`` and then answered nothing within ``PROBE_TIMEOUT`` (both
longer in a large group: ``Patience``).
The whole path, on a real group whose member freezes, is in test_averaging_round.py."""

import asyncio
import time

import pytest

from diloco_peer.averaging import member_silence
from diloco_peer.averaging.member_silence import MemberSilent, Patience, SilenceWatch


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(member_silence, "SILENT_AFTER", 0.2)
    monkeypatch.setattr(member_silence, "PROBE_TIMEOUT", 0.3)
    monkeypatch.setattr(member_silence, "WATCH_EVERY", 0.02)
    monkeypatch.setattr(member_silence, "SILENT_PER_MEMBER", 0.01)
    monkeypatch.setattr(member_silence, "PROBE_PER_MEMBER", 0.03)


def _watch(answer, waited_on=("a",), members=0):
    """A watch over ``waited_on`` (in a group of ``members``) whose question to a member is ``answer(peer)``; returns
    it and the dropped."""
    dropped, asked = [], []

    async def ask(peer):
        asked.append(peer)
        await answer(peer)

    async def on_silent(peer):
        dropped.append(peer)

    return SilenceWatch(ask, lambda: set(waited_on), on_silent, Patience(members)), dropped, asked


async def _never(peer):
    await asyncio.Event().wait()


async def _at_once(peer):
    return None


async def _refuses(peer):
    raise RuntimeError("protocol not supported")  # an older peer without rpc_still_there


def test_a_member_that_answers_nothing_is_dropped_and_its_waiters_woken():
    async def scenario():
        watch, dropped, asked = _watch(_never)
        watch.start()
        started = time.monotonic()
        with pytest.raises(MemberSilent, match="went silent"):
            await watch.unless_silent("a", asyncio.sleep(60))
        watch.stop()
        return time.monotonic() - started, dropped, asked, watch.found

    took, dropped, asked, found = asyncio.run(scenario())
    assert dropped == found == ["a"] and asked == ["a"]
    assert 0.5 <= took < 2.0, took  # SILENT_AFTER + PROBE_TIMEOUT, then dropped


@pytest.mark.parametrize("answer", [_at_once, _refuses], ids=["answers", "answers with an error"])
def test_a_quiet_member_that_answers_is_waited_for(answer):
    async def scenario():
        watch, dropped, asked = _watch(answer)
        watch.start()
        result = await watch.unless_silent("a", asyncio.sleep(1.2, result="done"))
        watch.stop()
        return result, dropped, asked

    result, dropped, asked = asyncio.run(scenario())
    assert result == "done" and dropped == []
    assert len(asked) >= 3, asked  # asked again after each further SILENT_AFTER of quiet


@pytest.mark.parametrize("members", [3, 32])
def test_a_large_group_waits_longer_for_an_answer(members):
    """A member that answers after 0.5 s: past the probe timeout of a small group (0.3 s), within a group of 32's (0.96
    s): on one loaded machine, a member answers behind its work for every other member of the group."""
    async def late(peer):
        await asyncio.sleep(0.5)

    async def scenario():
        watch, dropped, asked = _watch(late, members=members)
        watch.start()
        try:
            await watch.unless_silent("a", asyncio.sleep(1.5))
        except MemberSilent:
            pass
        watch.stop()
        return dropped

    dropped = asyncio.run(scenario())
    assert dropped == (["a"] if members == 3 else []), dropped
    assert Patience(32).silent_after == pytest.approx(0.32) and Patience(3).silent_after == 0.2


def test_a_member_whose_messages_come_while_it_is_asked_is_not_silent():
    async def scenario():
        watch, dropped, asked = _watch(_never)
        watch.start()

        async def talks():  # its parts keep coming, every 0.1 s, while the question goes unanswered
            for _ in range(15):
                watch.heard("a")
                await asyncio.sleep(0.1)
            return "done"

        result = await watch.unless_silent("a", talks())
        watch.stop()
        return result, dropped

    assert asyncio.run(scenario()) == ("done", [])


def test_only_the_members_waited_on_are_asked():
    async def scenario():
        watch, dropped, asked = _watch(_never, waited_on=())
        watch.start()
        await asyncio.sleep(0.8)
        watch.stop()
        return dropped, asked

    assert asyncio.run(scenario()) == ([], [])
