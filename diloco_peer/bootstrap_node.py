"""The bootstrap node: a long-lived DHT node that new peers dial first, and a window on the swarm.

    diloco-peer bootstrap --identity ./boot.key --listen /ip4/0.0.0.0/tcp/31337

It trains nothing. It keeps a stable peer id (``--identity``; the key is created on first run), prints
the exact ``diloco-peer join ...`` line to give to volunteers, stores and validates the run's signed
progress records like any DHT node, and logs a one-line summary of the swarm every ``--report-every``
seconds. Deploy files (a systemd unit) live in ``bootstrap/`` at the top of the repository.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal

from .config import SwarmConfig
from .progress import add_progress_validators, fetch_progress
from .swarm import join_address, start_dht, visible_addresses

logger = logging.getLogger("diloco_peer.bootstrap")


async def run_bootstrap(
    listen: list[str], announce: list[str], identity: str, initial_peers: list[str], run_id: str,
    report_every: float,
) -> int:
    cfg = SwarmConfig(host_maddrs=listen, announce_maddrs=announce, identity_path=identity)
    dht = await asyncio.to_thread(start_dht, cfg, initial_peers)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        add_progress_validators(dht, run_id)
        address = join_address(dht)
        # the exact line to paste; tests and the demo parse it, so keep its shape stable
        print(f"diloco-peer join {address}", flush=True)
        others = [a for a in visible_addresses(dht) if a != address]
        if others:
            print(f"(other addresses of this node: {' '.join(others)})", flush=True)
        logger.info(f"bootstrap node up for run '{run_id}', peer id {dht.peer_id.to_base58()}")
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=report_every)
            except TimeoutError:
                records = await fetch_progress(dht, run_id)
                if records:
                    epochs = collections.Counter(r.epoch for r in records)
                    ready = sum(r.ready for r in records)
                    by_epoch = ", ".join(f"epoch {e}: {n}" for e, n in sorted(epochs.items()))
                    logger.info(f"swarm '{run_id}': {len(records)} peers ({by_epoch}); {ready} waiting for a round")
                else:
                    logger.info(f"swarm '{run_id}': no training peers yet")
        logger.info("bootstrap node shutting down")
        return 0
    finally:
        await asyncio.to_thread(dht.shutdown)
