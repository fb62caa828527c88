"""Who takes part in our averaging: the peers that may be in our groups, lead the groups we join, download our state.

A peer must pass admission (``swarm/admission.py``: swarm secret, allowlist) and must not be banned
(``robust_aggregation.BanList``: its contributions were refused repeatedly). ``PseudoGradientAverager`` asks,
in its own process:

- of a follower knocking at a group we lead, and of every member of a group we are in before we average with
  it: ``refusal`` (a member shows its proof of the swarm secret in the data it gathers with the group);
- of a leader our matchmaking found in the DHT, and of a donor we are told to download from: ``refuses`` (a
  refused leader is skipped, as if it had turned us down: it would take us into a group we then refuse);
- of the followers of a group we are about to form: ``left_out``, those its members ban (``group_bans.py``);
- of a peer that downloads our state: ``refuses_download`` (in a swarm closed by a secret, only a peer with a
  progress record in the swarm's DHT: only secret holders can write there).

It also reads what the members of a group declare in the data they gather with it: their share of the vector's
split (``declared``) and their tokens (``tokens``).
"""

from __future__ import annotations

import logging

from hivemind.averaging.allreduce import AveragingMode
from hivemind.compression import CompressionBase
from hivemind.dht import DHT
from hivemind.p2p import PeerID

from ..swarm.admission import Admission
from . import link_fit, vector_split
from .compression import TopKCodec, WireCompression
from .group_bans import left_out
from .robust_aggregation import BanList

logger = logging.getLogger(__name__)


class Membership:
    """Admission and bans, as our averager process checks them.

    :param admission: who may join our groups and download our state
    :param bans: the ban list (the averager's own: its offenses count there)
    :param progress_key: the DHT key of the swarm's progress records ("": not checked)
    :param serializer: hivemind's serializer of the data members gather with a group (the averager's)
    """

    def __init__(self, admission: Admission, bans: BanList, progress_key: str, serializer):
        self.admission = admission
        self.bans = bans
        self.progress_key = progress_key
        self.serializer = serializer

    def refusal(self, peer_id: PeerID, gathered: bytes | None) -> tuple[str, str]:
        """(kind, why) if ``peer_id``, showing the data it gathers with a group, may not be in our group."""
        return self.refusal_of(peer_id.to_base58(), self._fields(gathered))

    def refusal_of(self, peer: str, fields: dict) -> tuple[str, str]:
        """(kind, why) if ``peer`` (base58), showing ``fields`` (its proof of the swarm secret among them, where one is
        asked), may not average with us: in our group, or handing its pseudo-gradient in to us (``hand_in.py``)."""
        if self.bans.is_banned(peer):
            return "banned", f"peer {peer} is banned for repeated offenses"
        proof = fields.get("proof", b"") if self.admission.secret is not None else None
        why = self.admission.refuses(peer, proof)
        return ("unadmitted", why) if why else ("", "")

    def expected(self, gathered: bytes | None) -> int | None:
        """How many members the peer that gathers ``gathered`` expects its round's group to have (its round gate's
        count, ``RoundAverager.average``); None if it says none we can read. A member that claims more than there
        are only makes a group we lead gather for its whole window, as without ``start_when_complete``."""
        expected = self._fields(gathered).get("expected")
        return expected if isinstance(expected, int) and not isinstance(expected, bool) and expected >= 2 else None

    def refuses(self, peer: str) -> bool:
        """``peer`` (base58) is banned or not admitted (its proof unasked: it shows none where this is asked)."""
        return self.bans.is_banned(peer) or bool(self.admission.refuses(peer, None))

    def left_out(self, requests: dict, leader: PeerID) -> list[PeerID]:
        """Followers to leave out of the group we (``leader``) are about to form: those its members ban.

        ``requests``: hivemind's ``{peer id: JoinRequest}`` of the followers in; each one's gather data carries the
        peers it bans (``group_bans.py``)."""
        bans = {leader: self.bans.banned()}
        for peer, request in requests.items():
            try:
                bans[peer] = set(self._fields(request.gather).get("bans", []))
            except TypeError:  # not a list: PseudoGradientAverager._refuse_group deals with such a member
                bans[peer] = set()
        names = {peer: peer.to_base58() for peer in bans}
        out = left_out({names[p]: banned for p, banned in bans.items()}, leader=names[leader])
        if out:
            logger.info(f"leaving {len(out)} peer(s) out of the group we form, banned by its members: "
                        f"{', '.join(p[-8:] for p in out)}")
        by_name = {name: peer for peer, name in names.items()}
        return [by_name[name] for name in out]

    def declared(self, group_info) -> list[vector_split.Member]:
        """What each member of a group declares for the split of the vector (``vector_split.split``): its bandwidth,
        whether it is a client, relayed, and its pace, from the data it gathered with the group."""
        members = []
        for gathered in group_info.gathered:
            bandwidth, mode, user = self.serializer.loads(gathered)
            client = AveragingMode(mode) == AveragingMode.CLIENT
            try:
                fields = self.serializer.loads(user)
                pace = fields.get("step_seconds")
                members.append(vector_split.Member(
                    bandwidth, client, relayed=fields.get("relayed") is True,
                    step_seconds=float(pace) if isinstance(pace, (int, float)) and pace == pace else None))
            except Exception:  # not our gather format: refusal deals with such a member
                members.append(vector_split.Member(bandwidth, client))
        return members

    def compression(self, group_info, ours: CompressionBase) -> CompressionBase:
        """The compression a group's all-reduce encodes with: ``ours``, or for ``topk`` at the lowest density its
        members gathered (``link_fit.agreed``): every member computes the same from the same gathered picks."""
        codec = getattr(ours, "codec", None)
        if not isinstance(codec, TopKCodec):
            return ours
        picks = [self._fields(gathered).get("density") for gathered in group_info.gathered]
        return WireCompression(TopKCodec(link_fit.agreed(picks, codec.density), codec.bits))

    def tokens(self, group_info) -> list[float]:
        """The tokens each member of a group gathered with (0 where it says none we can read)."""
        tokens = []
        for gathered in group_info.gathered:
            try:
                tokens.append(float(self.serializer.loads(self.serializer.loads(gathered)[2]).get("tokens", 0)))
            except Exception:  # not our gather format: refusal deals with such a member
                tokens.append(0.0)
        return tokens

    def _fields(self, gathered: bytes | None) -> dict:
        """The fields a member gathers with (``RoundAverager.average``'s ``gather``), inside hivemind's own gather
        tuple; empty where they are not in our format (a stranger's, a forged one)."""
        try:
            fields = self.serializer.loads(self.serializer.loads(gathered)[2])
        except Exception:
            return {}
        return fields if isinstance(fields, dict) else {}

    async def refuses_download(self, peer: str, dht: DHT) -> bool:
        """``peer`` (base58) may not download our state: banned, not admitted, or (in a swarm closed by a secret)
        without a progress record in the swarm's DHT. Logged."""
        why = "banned" if self.bans.is_banned(peer) else self.admission.refuses(peer, None)
        if not why and self.admission.secret is not None and self.progress_key:
            found = await dht.get(self.progress_key, latest=True, return_future=True)
            entries = found.value.values() if found is not None and isinstance(found.value, dict) else []
            holders = {entry.value.get("peer_id") for entry in entries if isinstance(entry.value, dict)}
            why = "" if peer in holders else f"peer {peer} has no progress record in the swarm's DHT"
        if why:
            logger.warning(f"refused to serve our state to {peer}: {why}")
        return bool(why)
