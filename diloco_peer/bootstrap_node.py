"""The bootstrap node: a long-lived DHT node that new peers dial first, and a window on the swarm.

    diloco-peer bootstrap --identity ./boot.key --listen /ip4/0.0.0.0/tcp/31337 --config tiny-cpu

It trains nothing. It keeps a stable peer id (``--identity``; the key is created on first run, and a second
process with it stops at once: ``swarm.addresses.hold_identity``), prints the exact ``diloco-peer join ...``
line to give to volunteers, publishes the run's config signed by its key (``--config``; the swarm's owner is
whoever holds that key, ``swarm/run_config.py``), stores and validates the run's signed progress records, relays
for peers behind NAT and dials peers back when they ask whether they are reachable (reachability.py), and logs
a one-line summary of the swarm every ``--report-every`` seconds. With ``--metrics-port`` it serves the
swarm-wide gauges of ``monitor.py`` on ``/metrics``. ``diloco-peer status <bootstrap>`` (``run_status``) prints
the same view as a table. Deploy files (a systemd unit) live in ``bootstrap/`` at the top of the repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from pathlib import Path

import psutil
from hivemind.dht import DHT

from .config import MetricsConfig, SwarmConfig
from .lifecycle import hivemind_calls
from .lifecycle.reaper import Reaper, kill_leftovers, new_children
from .lifecycle.shutdown import Shutdown
from .observe.metrics import MetricsServer
from .observe.monitor import SwarmMonitor, format_status, status_json, summarize
from .swarm.addresses import SwarmError, hold_identity, parse_multiaddr
from .swarm.join import join_address, join_dht_peers, start_dht, visible_addresses
from .swarm.owner_key import OwnerKey
from .swarm.progress_store import add_progress_validators, fetch_progress
from .swarm.reachability import ProbeService
from .swarm.run_config import ConfigPublisher

logger = logging.getLogger("diloco_peer.bootstrap")

MONITOR_REFRESH_SECONDS = 5.0
SHUTDOWN_GRACE = 30.0  # seconds a bootstrap node may take to stop (then it exits 1); a second signal: at once
RELAY_STARTS = 5


def _announce(dht: DHT, address_file: str) -> None:
    """Write the address to ``address_file`` (if given), then print the line to join us and our other addresses:
    whoever saw the line finds the file there (a loaded machine let a reader of the line miss it, seen in CI)."""
    address = join_address(dht)
    if address_file:  # written whole, then renamed: a reader never sees half an address
        path = Path(address_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(address + "\n")
        path.with_suffix(".tmp").replace(path)
    # the exact line to paste; tests and the demo parse it, so keep its shape stable
    print(f"diloco-peer join {address}", flush=True)
    others = [a for a in visible_addresses(dht) if a != address]
    if others:
        print(f"(other addresses of this node: {' '.join(others)})", flush=True)


def _owner_identity(identity: str, publishes: bool) -> tuple[str, OwnerKey | None, str]:
    """The identity file this node runs with, claimed for this process (a second bootstrap with it stops here, with
    nothing to tear down), the key that signs the run's config record (None if it cannot sign: no record then), and
    a scratch directory to remove once the DHT has started ("" if none). Without ``identity`` the key is a new one
    in the scratch directory: p2pd's own, made when it is given none, is out of our reach."""
    scratch = "" if identity else tempfile.mkdtemp(prefix="diloco-bootstrap-")
    path = identity or str(Path(scratch) / "identity.key")
    hold_identity(path)
    try:
        return path, OwnerKey.load(path), scratch
    except (OSError, ValueError) as e:
        if publishes:
            raise SwarmError(f"bad identity file {path}: it cannot sign the run's config ({e}): give a key that "
                             f"diloco-peer keygen wrote") from None
        logger.warning(f"identity {path} cannot sign ({e}): this node publishes no config record")
        return path, None, scratch


async def _report(dht: DHT, monitor: SwarmMonitor, run_id: str, report_every: float, stop: asyncio.Event) -> None:
    """Refresh the monitor, and log a one-line summary every ``report_every`` seconds, until ``stop`` is set."""
    refresh = min(report_every, MONITOR_REFRESH_SECONDS)  # the gauges stay fresh between log lines
    last_report = time.monotonic()
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=refresh)
        except TimeoutError:
            summary = monitor.update(await fetch_progress(dht, run_id))
            if time.monotonic() - last_report >= report_every - 1e-3:
                last_report = time.monotonic()
                logger.info(format_status(summary, run_id).splitlines()[0] if summary.peers
                            else f"run '{run_id}': no training peers yet")


async def run_bootstrap(
    listen: list[str], announce: list[str], identity: str, initial_peers: list[str], run_id: str,
    report_every: float, metrics: MetricsConfig | None = None, address_file: str = "", secret_file: str = "",
    *, config: dict | None = None, config_name: str = "",
) -> int:
    """Serve as a bootstrap node until stopped; 0 on a clean stop.

    :param config: the swarm-wide part of the run's config (``config.swarm_wide.swarm_part``), published signed by
      this node's identity to the peers that join through it; None publishes a record that says "no config"
    :param config_name: its name, shown to the joiners (e.g. ``tiny-cpu``)
    """
    identity, key, scratch = _owner_identity(identity, config is not None)
    cfg = SwarmConfig(host_maddrs=listen, announce_maddrs=announce, identity_path=identity, secret_file=secret_file)
    monitor = SwarmMonitor(run_id)
    # before the DHT starts: a busy metrics port fails at once, with nothing to tear down
    server = MetricsServer(monitor, metrics) if metrics is not None and metrics.port else None
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    reaper = Reaper()  # a SIGKILLed bootstrap must not leave its DHT process and p2pd behind
    stop = asyncio.Event()
    shutdown = Shutdown(SHUTDOWN_GRACE, "shutting down", owns_process=True, on_request=stop.set)
    shutdown.install(asyncio.get_running_loop())
    try:
        dht, probes = await start_relay(cfg, initial_peers)
    except BaseException:
        reaper.close()
        shutdown.finished()
        raise
    finally:
        if scratch:  # p2pd read our new key at its start
            shutil.rmtree(scratch, ignore_errors=True)
    reaper.watch([c.pid for c in new_children(before, reaper.proc.pid)])
    publisher = ConfigPublisher(dht, key, config, config_name) if key is not None else None
    try:
        add_progress_validators(dht, run_id)
        if publisher is not None:  # before the line to join us: a peer that read it finds the record
            await publisher.start()
            logger.info(f"publishing the run's config, signed by this node: {config_name}, run '{run_id}'" if config
                        else "publishing no config: each peer brings its own (bootstrap --config NAME publishes one)")
        _announce(dht, address_file)
        logger.info(f"bootstrap node up for run '{run_id}', peer id {dht.peer_id.to_base58()}"
                    + ", relaying for peers behind NAT")
        await _report(dht, monitor, run_id, report_every, stop)
        logger.info("bootstrap node shutting down")
        return 0
    finally:
        shutdown.arm()  # stopping is bounded, asked to or not
        if publisher is not None:
            await publisher.close()
        await probes.close()
        with contextlib.suppress(TimeoutError):  # a DHT process that stopped answering is killed below
            await hivemind_calls.call(dht.shutdown, timeout=SHUTDOWN_GRACE / 2)
        # (else the interpreter's exit would wait for it: multiprocessing joins its children)
        for killed in kill_leftovers(new_children(before, reaper.proc.pid)):
            logger.warning(f"child process {killed} did not stop when told: killed it")
        reaper.close()
        if server is not None:
            server.close()
        shutdown.finished()


async def start_relay(cfg: SwarmConfig, initial_peers: list[str], starts: int = RELAY_STARTS
                      ) -> tuple[DHT, ProbeService]:
    """The DHT node as a relay that NAT'd peers can train through, with the probe service that tells peers how
    others reach them. The node is handed out once its relay grants circuits big enough for averaging
    (``ProbeService.relay_limit``: p2pd also runs go-libp2p's default relay, 128 KiB per relayed connection, and
    either may serve); otherwise it is started again, and after the last start it serves anyway with an error
    line. Other bootstraps are joined only then, so that a restart leaves no trace in their routing tables."""
    for addr in initial_peers:
        parse_multiaddr(addr, need_peer_id=True, what="--initial-peer address")
    for start in range(1, starts + 1):
        dht = await hivemind_calls.call(start_dht, cfg, [], relay_service=True)
        try:
            probes = await ProbeService.start(dht)
            try:
                ok, limit = await probes.relay_limit()
                problem = f"it grants {limit} (go-libp2p's default relay serves), too little for averaging"
            except Exception as e:  # no answer from our own relay is a failed check, not a failed start
                ok = False
                problem = f"it did not answer a reservation: {str(e).strip()[:200] or type(e).__name__}"
            if ok or start == starts:  # the last start serves anyway: still a bootstrap node
                if ok:
                    logger.info(f"relay for peers behind NAT: {limit} (start {start})")
                else:
                    logger.error(f"relay: {problem}, in {starts} starts; serving anyway: peers behind NAT cannot "
                                 f"average through this node (check the hivemind version: 1.1.12 is tested)")
                try:
                    await hivemind_calls.call(join_dht_peers, dht, initial_peers)
                except BaseException:
                    await probes.close()
                    raise
                return dht, probes
            await probes.close()
        except BaseException:
            await hivemind_calls.call(dht.shutdown)
            raise
        await hivemind_calls.call(dht.shutdown)
        logger.warning(f"relay: {problem}; starting the node again ({start}/{starts})")
    raise AssertionError("unreachable: the last start returns")


async def run_status(bootstrap: list[str], run_id: str, as_json: bool, wait: float, secret_file: str = "") -> int:
    """``diloco-peer status``: join the DHT as a client, print the swarm's table, leave."""
    # the local p2pd's start only (an unreachable swarm is told by the join, in seconds): a loaded machine took over
    # a second to start it, which had made `status --wait 1` fail as if the node could not run here
    cfg = SwarmConfig(host_maddrs=["/ip4/0.0.0.0/tcp/0"], startup_timeout=max(wait, 10.0), secret_file=secret_file)
    dht = await hivemind_calls.call(start_dht, cfg, bootstrap, client_mode=True)
    try:
        add_progress_validators(dht, run_id)
        deadline = time.monotonic() + wait
        records = await fetch_progress(dht, run_id)
        while not records and time.monotonic() < deadline:  # a fresh client may need a moment to find the nodes
            await asyncio.sleep(1.0)
            records = await fetch_progress(dht, run_id)
        summary = summarize(records)
        print(status_json(summary, run_id) if as_json else format_status(summary, run_id), flush=True)
        return 0
    finally:
        await hivemind_calls.call(dht.shutdown)
