"""Whether our DHT node serves the others' requests: a peer too slow to average steps off their paths.

hivemind's DHT stores a record on, and reads it from, the nodes nearest its key, and waits for their answers; in a
small swarm every node is among them. A node that answers late (a peer held to a sliver of a CPU, whose training
takes the time its DHT process would answer in) then slows every record the others publish or read, and their
matchmaking, which runs on the DHT too (BENCHMARKS.md, "Handing in").

A peer that hands its pseudo-gradient in (``averaging/hand_in.py``) has been found too slow to average as a member,
so its node stops serving: it still stores and reads, as a DHT client does (hivemind's ``client_mode``), and the
others drop it from their routing tables at their next request to it, which its p2p daemon refuses at once. After
``SERVE_AGAIN_AFTER`` rounds in a row as a member it serves again: its next request carries its node id, and the
others take it back. A peer that joined as a client (outbound-only) never serves.

The switch is made inside the DHT's process, on the node's ``DHTProtocol`` as hivemind 1.1's ``DHTProtocol.create``
sets it up: its handlers (the ones hivemind adds and removes itself at a node's start and shutdown), its
``client_mode``, its ``node_info`` (what its requests say of it: empty for a client, so that no one adds it), and
the node's id, a fresh one while it serves nobody (``_stop_serving``).
"""

from __future__ import annotations

import logging
from functools import partial

from hivemind import DHT
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID, RoutingTable
from hivemind.proto import dht_pb2
from hivemind.utils.auth import AuthRole, AuthRPCWrapper

from ..lifecycle import hivemind_calls

logger = logging.getLogger("diloco_peer")

SERVE_AGAIN_AFTER = 3
"""Rounds in a row as a member (not handing in) before a node that stopped serving serves again: a peer whose pace
sits near the hand-in threshold would otherwise come and go from the others' routing tables every round."""
SWITCH_TIMEOUT = 10.0
"""Seconds to wait for the DHT process to switch (a node at a sliver of a core answers in a few periods)."""


async def _stop_serving(_dht: DHT, node: DHTNode) -> DHTID | None:
    """(In the DHT's process.) Stop serving; the node id it served under (None: it served nobody already)."""
    protocol = node.protocol
    if protocol.client_mode:
        return None
    served = node.node_id
    await protocol.remove_p2p_handlers(protocol.p2p)
    protocol.client_mode = True
    protocol.node_info = dht_pb2.NodeInfo()
    # a client's id is its own business: the others still name the one we served under (until a request to it
    # fails), and a node that finds its own id among the nearest to a key stops (hivemind asserts it never does)
    _take_id(node, DHTID.generate())
    return served


async def _serve(_dht: DHT, node: DHTNode, node_id: DHTID | None) -> bool:
    """(In the DHT's process.) Serve again, under ``node_id`` (None: the id it has); False if it served already."""
    protocol = node.protocol
    if not protocol.client_mode:
        return False
    node_id = node.node_id if node_id is None else node_id
    _take_id(node, node_id)
    await protocol.add_p2p_handlers(protocol.p2p, AuthRPCWrapper(protocol, AuthRole.SERVICER, protocol.authorizer))
    protocol.node_info = dht_pb2.NodeInfo(node_id=node_id.to_bytes())
    protocol.client_mode = False
    return True


def _take_id(node: DHTNode, node_id: DHTID) -> None:
    """Give ``node`` the id ``node_id``: the node's, its protocol's, and its routing table's, rebuilt around it (a
    table splits its buckets by their distance to its own id)."""
    old = node.protocol.routing_table
    table = RoutingTable(node_id, old.bucket_size, old.depth_modulo)
    for uid, peer_id in list(old.uid_to_peer_id.items()):
        if uid != node_id:
            table.add_or_update_node(uid, peer_id)
    node.node_id = node.protocol.node_id = node_id
    node.protocol.routing_table = table


class DhtRole:
    """Our DHT node's role, round by round: serving (a full node) or a client while we hand in.

    :param dht: our DHT
    :param serving: whether the node serves now; False (it joined as a client: outbound-only): it never will
    """

    def __init__(self, dht: DHT, serving: bool):
        self.dht = dht
        self.serving = serving
        self.may_serve = serving
        self.member_rounds = 0
        """Rounds in a row we averaged as a member (``SERVE_AGAIN_AFTER``)."""
        self.served_as: DHTID | None = None
        """The node id we served under, while we do not (we serve again under it)."""

    async def round(self, handed_in: bool) -> bool:
        """A round's exchange began: we handed our pseudo-gradient in (``handed_in``), or joined the all-reduce.
        True if our node switched roles."""
        if not self.may_serve:
            return False
        if handed_in:
            self.member_rounds = 0
            return self.serving and await self._switch(
                False, "we hand our pseudo-gradients in: our DHT node stops serving the others' requests")
        self.member_rounds += 1
        return not self.serving and self.member_rounds >= SERVE_AGAIN_AFTER and await self._switch(
            True, f"{self.member_rounds} rounds averaged as a member: our DHT node serves the others again")

    async def _switch(self, serve: bool, why: str) -> bool:
        try:
            if serve:
                await hivemind_calls.call(self.dht.run_coroutine, partial(_serve, node_id=self.served_as),
                                          timeout=SWITCH_TIMEOUT)
            else:
                self.served_as = await hivemind_calls.call(self.dht.run_coroutine, _stop_serving,
                                                           timeout=SWITCH_TIMEOUT)
        except Exception as e:  # the node goes on as it was: slower for the others, never wrong
            logger.warning(f"could not {'serve' if serve else 'stop serving'} DHT requests: {e!r}")
            return False
        self.serving = serve
        logger.info(why)
        return True
