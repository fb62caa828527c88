"""Stream ends: how often a p2pd stream loses its last messages when the handler hangs up first, and when the
caller does (``swarm/p2pd_internals.until_the_caller_hangs_up``), measured side by side in one run.

    .venv/bin/python bench/stream_ends.py --quick     # 2 x 4,000 streams (~1.5 min on 2 cores)
    .venv/bin/python bench/stream_ends.py             # 2 x 16,000 streams (~5 min)

Two hivemind P2P daemons on loopback, in this process. Each stream: the caller asks once, the handler answers
with 3 messages of 200 kB, the caller waits 50 ms before it reads (a busy peer: the answer piles up in the
daemons' buffers) and counts what comes. Busy loops, one per core plus one, load the CPU meanwhile (the race
needs a daemon thread preempted at the wrong moment).

A ("handler hangs up"): the handler returns after its last message, as hivemind's handlers do.
B ("caller hangs up"): the handler sends an end mark after its last message and waits; the caller hangs up
when it sees the end mark, as our state download, all-reduce and matchmaking streams now end.

A and B alternate in batches so that drifts of the machine hit both. The figure ``stream_ends`` is the number of
streams that came short in B (value) against A (baseline), per ``--streams`` streams each.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hivemind.p2p import P2P, P2PContext  # noqa: E402
from hivemind.proto import averaging_pb2  # noqa: E402

from bench.results import figure, save  # noqa: E402
from diloco_peer.swarm.p2pd_internals import until_the_caller_hangs_up  # noqa: E402

MESSAGES, SIZE, READ_DELAY, AT_ONCE = 3, 200_000, 0.05, 8


def _busy() -> None:
    while True:
        pass


async def _handler(request, context: P2PContext):
    for _ in range(MESSAGES):
        yield averaging_pb2.AveragingData(group_id=bytes(SIZE))
    if request.weight:  # B: the end mark, then the caller hangs up
        yield averaging_pb2.AveragingData(weight=-1.0)
        await until_the_caller_hangs_up()


async def _one(client: P2P, server_id, caller_hangs_up: bool) -> bool:
    """One stream; True if every message came."""
    request = averaging_pb2.AveragingData(weight=1.0 if caller_hangs_up else 0.0)
    stream = await client.iterate_protobuf_handler(server_id, "ends", request, averaging_pb2.AveragingData)
    await asyncio.sleep(READ_DELAY)
    got = 0
    try:
        async for message in stream:
            if message.weight == -1.0:
                break
            got += 1
    finally:
        await stream.aclose()
    return got == MESSAGES


async def _run(streams: int) -> dict[str, int]:
    server = await P2P.create()
    client = await P2P.create(initial_peers=await server.get_visible_maddrs())
    await server.add_protobuf_handler("ends", _handler, averaging_pb2.AveragingData, stream_output=True)
    short = {"handler": 0, "caller": 0}
    started, done = time.monotonic(), 0
    try:
        while done < streams:
            for mode in ("handler", "caller"):
                results = await asyncio.gather(*(_one(client, server.peer_id, mode == "caller")
                                                 for _ in range(AT_ONCE)))
                short[mode] += results.count(False)
            done += AT_ONCE
            if done % (AT_ONCE * 100) == 0:
                print(f"{done:,} streams each: short when the handler hangs up first {short['handler']}, "
                      f"when the caller does {short['caller']} ({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        await client.shutdown()
        await server.shutdown()
    return short


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4,000 streams of each kind instead of 16,000")
    parser.add_argument("--streams", type=int, default=None, help="streams of each kind")
    args = parser.parse_args()
    streams = args.streams or (4_000 if args.quick else 16_000)
    load = [mp.Process(target=_busy, daemon=True) for _ in range((os.cpu_count() or 2) + 1)]
    for process in load:
        process.start()
    try:
        short = asyncio.run(_run(streams))
    finally:
        for process in load:
            process.kill()
    print(f"streams that came short, of {streams:,} each: handler hangs up first {short['handler']}, "
          f"caller hangs up first {short['caller']}")
    save([figure("stream_ends", short["caller"], short["handler"], streams=streams, messages=MESSAGES,
                 message_bytes=SIZE, read_delay_s=READ_DELAY, quick=args.quick)])


if __name__ == "__main__":
    main()
