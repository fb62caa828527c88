"""The swarm view: peers' stats in their signed DHT records, the bootstrap's swarm gauges, forged records."""

import asyncio
import math
import time

import pytest
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from diloco_peer.observe.monitor import SwarmMonitor, format_status, summarize
from diloco_peer.swarm.progress import SwarmProgress
from diloco_peer.swarm.progress_store import fetch_progress
from diloco_peer.swarm.progress_record import PeerStats, ProgressRecord

RUN = "monitor-test"


def _record(peer, epoch, ready=False, state="training", loss=2.0, tps=1000.0, name=None, state_hash="h"):
    stats = PeerStats(name=name or peer, state=state, tokens_per_second=tps, train_loss=loss,
                      eval_loss=None if loss is None else loss + 0.5,
                      rounds_averaged=epoch, rounds_solo=0, rounds_failed=0)
    return ProgressRecord(peer_id=peer, epoch=epoch, inner_step=epoch * 10, tokens=epoch * 100, ready=ready,
                          state_hash=state_hash, time=time.time(), stats=stats, joined=state != "joining")


def test_summary_states_losses_and_the_swarm_epoch():
    records = [_record("a", 4), _record("b", 4, ready=True), _record("c", 4, ready=True, state="averaging"),
               _record("d", 3, loss=4.0), _record("e", 4, state="leaving", loss=9.0)]
    s = summarize(records)
    assert s.peers == 5 and s.epoch == 4
    assert s.by_state == {"joining": 0, "training": 2, "waiting": 1, "averaging": 1, "leaving": 1}
    assert s.tokens == 4 * 100 * 4 + 300
    assert s.tokens_per_second == 4000.0  # the leaving peer no longer counts
    assert s.train_loss == 2.5 and s.eval_loss == 3.0  # means over the peers that train (not the leaving one)
    table = format_status(s, RUN)
    assert "5 peers (2 training, 1 waiting, 1 averaging, 1 leaving), epoch 4" in table
    assert len(table.splitlines()) == 2 + 5 and all(name in table for name in "abcde")


def test_monitor_gauges_count_joins_and_leaves():
    monitor = SwarmMonitor(RUN)

    def value(name, **labels):
        return monitor.registry.get_sample_value(name, labels)

    monitor.update([_record("a", 1), _record("b", 1)])
    assert value("diloco_swarm_peers") == 2 and value("diloco_swarm_joins_total") == 0  # a census, not joins
    monitor.update([_record("b", 2), _record("c", 0, state="joining", loss=None)])
    assert value("diloco_swarm_joins_total") == 1 and value("diloco_swarm_leaves_total") == 1
    assert value("diloco_swarm_peers_by_state", state="joining") == 1 and value("diloco_swarm_epoch") == 2
    monitor.update([])
    assert value("diloco_swarm_peers") == 0 and value("diloco_swarm_leaves_total") == 3
    assert math.isnan(value("diloco_swarm_train_loss"))  # no data, not a fake zero
    assert value("diloco_swarm_info", run_id=RUN) == 1


@pytest.fixture
def honest_and_attacker():
    root = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    addrs = [str(a) for a in root.get_visible_maddrs()]
    honest = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addrs)
    attacker = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=addrs)
    yield root, honest, attacker
    for dht in (attacker, honest, root):
        dht.shutdown()


@pytest.mark.slow
@pytest.mark.light
def test_forged_or_malformed_swarm_records_are_rejected(honest_and_attacker):
    root, honest, attacker = honest_and_attacker
    SwarmProgress(root, RUN, "root", heartbeat=5)  # the bootstrap: validators installed
    key = f"{RUN}_progress"

    async def scenario():
        peer = SwarmProgress(honest, RUN, "honest", heartbeat=5)
        peer.stats_provider = lambda: _record("x", 1).stats.dict()
        await peer.publish(epoch=1, inner_step=10, tokens=100, ready=False)
        victim = peer.subkey
        good = peer.record.dict()
        expiration = get_dht_time() + 30
        # 1. the attacker writes into the honest peer's slot without its private key (a forged signature)
        forged = {**good, "stats": {**good["stats"], "eval_loss": 0.001}}
        stored_forged = attacker.store(key, forged, expiration, subkey=victim)
        # 2. the attacker signs with its own key but sends a record of the wrong shape
        signer = RSASignatureValidator(RSAPrivateKey())
        attacker.add_validators([signer])
        bad_shape = {**good, "peer_id": "attacker", "stats": {**good["stats"], "tokens_per_second": "fast"}}
        stored_bad = attacker.store(key, bad_shape, expiration, subkey=signer.local_public_key)
        # 3. an absurd value (negative loss) with a valid signature and shape otherwise
        absurd = {**good, "peer_id": "attacker2", "stats": {**good["stats"], "train_loss": -1.0}}
        stored_absurd = attacker.store(key, absurd, expiration, subkey=signer.local_public_key)
        return stored_forged, stored_bad, stored_absurd, await fetch_progress(root, RUN)

    stored_forged, stored_bad, stored_absurd, seen = asyncio.run(scenario())
    assert not stored_forged and not stored_bad and not stored_absurd
    assert [(r.peer_id, r.stats.eval_loss) for r in seen] == [("honest", 2.5)]
