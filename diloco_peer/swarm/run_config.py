"""The run's config in the DHT, signed by the run's owner: what ``bootstrap --config`` publishes and ``join`` takes.

    diloco-peer bootstrap --identity boot.key --config tiny-cpu --set outer.inner_steps=10   # the owner
    diloco-peer join /ip4/203.0.113.7/tcp/31337/p2p/QmOwner...                              # a volunteer

The owner is the bootstrap node: its identity key signs, and the peer id at the end of the address a volunteer
pasted (``/p2p/<id>``) is the hash of that key's public half, a trust anchor the volunteer already holds. The record
lives under the DHT key ``CONFIG_KEY``, in the subkey of its owner's peer id (several bootstraps, several subkeys):

    {"v": 1, "body": '<canonical JSON>', "public_key": <libp2p protobuf bytes>, "signature": <bytes>}
    body = {"owner": "<peer id>", "config": {<the swarm-wide keys: config/swarm_wide.py>} or null,
            "name": "tiny-cpu", "expires": <the record's DHT expiration>, "version": "<diloco-peer version>"}

A record counts only if its public key hashes to its subkey and to ``body.owner``, its signature over ``DOMAIN +
body`` verifies (``owner_key.py``), and ``body.expires`` is the expiration the DHT holds it with (a replay cannot
outlive the owner's own). A joiner takes a record only from the owners its addresses name, and checks it itself
(``check_record``); every node of ours also refuses to store or pass on a forged one (``RunConfigValidator``), so
a stranger cannot overwrite an owner's record on them. A forged, unsigned or malformed record is ignored, logged
once. Records expire after ``TTL`` (under ``progress_store.MAX_TTL``, which every node enforces) and the owner stores
its record again every ``REPUBLISH`` seconds. ``config: null`` says the owner publishes no config (a bootstrap
without ``--config``): each peer brings its own, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hivemind.dht import DHT
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from multiaddr import Multiaddr

from .. import __version__
from ..config import DEFAULT_CONFIG, ConfigError, PeerConfig
from ..config.swarm_wide import adopt, flatten, shown
from ..lifecycle import hivemind_calls
from .addresses import BootstrapUnreachable
from .join import join_dht_peers
from .owner_key import OwnerKey, peer_id_of, verify

logger = logging.getLogger(__name__)

CONFIG_KEY = "diloco-peer.run-config"
"""The DHT key of the owners' config records (one subkey per owner: its peer id)."""
DOMAIN = b"diloco-peer run config v1\n"
"""Signed before the body: a signature made for anything else never passes for a config record."""
TTL = 300.0
"""Seconds a config record lives in the DHT (under ``progress_store.MAX_TTL``, the cap every node of ours enforces)."""
REPUBLISH = 60.0
"""Seconds between two stores of the owner's record: a record survives four missed stores."""
STORE_TIMEOUT = 30.0
"""Seconds one DHT store or get may take (then it is abandoned: ``hivemind_calls``)."""


class ForgedRecord(ValueError):
    """A config record that does not come from the owner it names; the message says why."""


@dataclass(frozen=True)
class RunConfigRecord:
    """A checked config record: ``config`` (the swarm-wide part) is what ``owner`` signed, or None for no config."""

    owner: str
    config: dict | None
    name: str
    expires: float
    version: str


def sign_record(key: OwnerKey, config: dict | None, name: str, expires: float) -> dict:
    """The DHT value of a config record: ``config`` (the swarm-wide part, or None) signed by ``key``."""
    body = json.dumps({"owner": key.peer_id, "config": config, "name": name, "expires": expires,
                       "version": __version__}, sort_keys=True, separators=(",", ":"))
    return {"v": 1, "body": body, "public_key": key.public_key, "signature": key.sign(DOMAIN + body.encode())}


def check_record(value, owner: str, expiration: float | None = None) -> RunConfigRecord:
    """``value`` (a config record as the DHT returned it) if ``owner`` signed it; else ``ForgedRecord``.

    :param owner: the peer id it must come from (its subkey; for a joiner, a peer id of the addresses it was given)
    :param expiration: the expiration the DHT holds it with, which the owner signed; None: not checked
    """
    if not isinstance(value, dict) or value.get("v") != 1:
        raise ForgedRecord("not a config record of this version")
    body = value.get("body")
    public_key = value.get("public_key")
    signature = value.get("signature")
    if not isinstance(body, str) or not isinstance(public_key, bytes) or not isinstance(signature, bytes):
        raise ForgedRecord("unsigned, or not a config record")
    if peer_id_of(public_key) != owner:
        raise ForgedRecord("signed by a key that is not the owner's (its peer id differs)")
    if not verify(public_key, DOMAIN + body.encode(), signature):
        raise ForgedRecord("its signature does not verify")
    try:
        fields = json.loads(body)
        record = RunConfigRecord(fields["owner"], fields["config"], str(fields["name"]), float(fields["expires"]),
                                 str(fields["version"]))
    except (ValueError, TypeError, KeyError):
        raise ForgedRecord("a malformed body") from None
    if record.owner != owner or not isinstance(record.config, dict | None):
        raise ForgedRecord("a body that names another owner, or no config")
    if expiration is not None and record.expires != expiration:
        raise ForgedRecord("stored with an expiration its owner did not sign (a replay)")
    return record


def owners_of(addresses: list[str]) -> list[str]:
    """The peer ids at the end of bootstrap addresses (``/p2p/<id>``): the owners whose records a joiner takes."""
    return list(dict.fromkeys(Multiaddr(a).value_for_protocol("p2p") for a in addresses))


_warned: set[tuple[str, str]] = set()


def _warn_once(owner: str, reason: str) -> None:
    if (owner, reason) not in _warned:
        _warned.add((owner, reason))
        logger.warning(f"ignored a config record for owner {owner[:60]!r}: {reason}")


class RunConfigValidator(RecordValidatorBase):
    """Refuses, on every node of ours, a record under ``CONFIG_KEY`` that its subkey's owner did not sign (asked to
    store it, or finding it in a search), so a stranger can neither overwrite an owner's record nor slip one by.
    Other keys pass. Runs in the DHT's process, which logs each refusal once."""

    def __init__(self):
        self.key_id = DHTID.generate(source=CONFIG_KEY).to_bytes()

    def validate(self, record: DHTRecord) -> bool:
        if record.key != self.key_id:
            return True
        owner = "?"
        try:
            owner = MSGPackSerializer.loads(record.subkey)
            if not isinstance(owner, str):
                raise ForgedRecord("not in an owner's subkey")
            check_record(MSGPackSerializer.loads(record.value), owner, record.expiration_time)
        except ForgedRecord as e:
            _warn_once(str(owner), str(e))
            return False
        except Exception:  # bytes that are no msgpack
            _warn_once(str(owner), "a malformed record")
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return isinstance(other, RunConfigValidator)  # one is enough


def add_run_config_validator(dht: DHT) -> None:
    dht.add_validators([RunConfigValidator()])


class ConfigPublisher:
    """The owner's side: stores its signed record now (``start``), then again every ``REPUBLISH`` seconds.

    :param key: the owner's key (its node's identity), which signs
    :param config: the swarm-wide part of the run's config (``config.swarm_wide.swarm_part``); None: no config
    :param name: the config's name, for the joiners' log lines (e.g. ``tiny-cpu``)
    """

    def __init__(self, dht: DHT, key: OwnerKey, config: dict | None, name: str = ""):
        self.dht = dht
        self.key = key
        self.config = config
        self.name = name
        self._task: asyncio.Task | None = None

    async def publish(self) -> bool:
        expires = get_dht_time() + TTL
        value = sign_record(self.key, self.config, self.name, expires)
        return await hivemind_calls.call(self.dht.store, CONFIG_KEY, value, expires, subkey=self.key.peer_id,
                                         timeout=STORE_TIMEOUT)

    async def start(self) -> None:
        add_run_config_validator(self.dht)
        if not await self.publish():
            logger.warning("the run's config record was stored by no DHT node; storing it again in "
                           f"{REPUBLISH:g}s")
        self._task = asyncio.create_task(self._republish())

    async def _republish(self) -> None:
        while True:
            await asyncio.sleep(REPUBLISH)
            try:
                await self.publish()
            except Exception as e:  # a DHT that did not answer in time: the record lives on until its TTL
                logger.warning(f"could not store the run's config record again: {e!r}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


async def fetch_run_configs(dht: DHT, owners: list[str]) -> list[RunConfigRecord]:
    """The checked config records of ``owners`` the DHT holds now, in ``owners``' order; others are ignored, a
    forged one (an owner's subkey with a record the owner did not sign) logged once."""
    found = await hivemind_calls.call(dht.get, CONFIG_KEY, latest=True, timeout=STORE_TIMEOUT)
    entries = found.value if found is not None and isinstance(found.value, dict) else {}
    records = []
    for owner in owners:
        if owner in entries:
            try:
                records.append(check_record(entries[owner].value, owner, entries[owner].expiration_time))
            except ForgedRecord as e:
                _warn_once(owner, str(e))
    return records


async def wait_for_run_config(dht: DHT, owners: list[str], wait: float, should_stop: Callable[[], bool],
                              poll: float = 0.5, addresses: Sequence[str] = ()) -> list[RunConfigRecord] | None:
    """``fetch_run_configs`` until one of ``owners`` answers, for up to ``wait`` seconds (a line every 10 s says
    so); [] if none did, None if ``should_stop()`` turned true meanwhile. Every ``REJOIN_SECONDS`` without an answer
    it joins ``addresses`` (the owners' bootstrap addresses) again: the node it reached may have restarted since
    (a bootstrap restarts its node when its relay check fails), and then our DHT knows nobody to read from."""
    started = time.monotonic()
    shown = rejoined = started
    while not should_stop():
        try:
            records = await fetch_run_configs(dht, owners)
        except TimeoutError:  # a DHT read that did not finish in time: the next one may
            records = []
        waited = time.monotonic() - started
        if records or waited >= wait:
            return records
        if addresses and time.monotonic() - rejoined >= REJOIN_SECONDS:
            rejoined = time.monotonic()
            with contextlib.suppress(BootstrapUnreachable):  # down for now: the next try may find it
                await hivemind_calls.call(join_dht_peers, dht, list(addresses))
        if time.monotonic() - shown >= 10:
            shown = time.monotonic()
            logger.info(f"still waiting for the swarm's config ({waited:.0f}s of {wait:g}s)")
        await asyncio.sleep(poll)
    return None


@dataclass
class Joiner:
    """What a volunteer brings to ``join``: its own config and which of its keys it stated itself.

    :param local: its validated config (its ``--config``, or the default one, with its ``--set`` and flags)
    :param stated: the keys it stated -> where (``config.swarm_wide.stated_keys``)
    :param config: its ``--config``; None: it takes the swarm's config (and waits ``WAIT`` for it)
    :param addresses: the bootstrap addresses it joins through (joined again while no record comes); the peer ids
      at their ends are the owners whose config records it takes (``owners``)
    :param check: ``check(cfg, name)`` raises if config ``cfg`` cannot run here (its data, its memory: the CLI's
      checks); called on the config it adopts, unless that is ``local``, which was checked before joining
    """

    local: PeerConfig
    stated: dict[str, str]
    config: str | None
    addresses: list[str]
    check: Callable[[PeerConfig, str], None]

    @property
    def owners(self) -> list[str]:
        return owners_of(self.addresses)


WAIT = 30.0
"""Seconds a ``join`` without ``--config`` waits for its owners' config record (then it gives up, exit 3)."""
REJOIN_SECONDS = 5.0
"""Seconds without a config record after which a joiner joins its bootstrap addresses again."""
WAIT_WITH_CONFIG = 5.0
"""Seconds a ``join --config`` looks for one to check its config against (then it trains with its own)."""


def _the_config(records: list[RunConfigRecord]) -> RunConfigRecord | None:
    """The config record among ``records`` that carries a config (None if none does); owners that disagree are
    refused, naming the first key they differ on."""
    configs = [r for r in records if r.config is not None]
    for other in configs[1:]:
        theirs, ours = flatten(other.config), flatten(configs[0].config)
        key = next((k for k in sorted({*theirs, *ours}) if theirs.get(k) != ours.get(k)), None)
        if key is not None:
            raise ConfigError(f"the swarm's owners disagree: {configs[0].owner} publishes {key}="
                              f"{shown(ours.get(key))}, {other.owner} {shown(theirs.get(key))}: join through one "
                              f"of them")
    return configs[0] if configs else None


async def adopt_swarm_config(dht: DHT, should_stop: Callable[[], bool], joiner: Joiner) -> PeerConfig | None:
    """The config this peer trains with, once its DHT is up: the swarm's swarm-wide keys (from a record its owners
    signed) with the volunteer's own choices (``config.swarm_wide.adopt``), checked for this machine; ``local`` if
    the owners publish no config. ``ConfigError`` for a stated key that disagrees with the swarm;
    ``BootstrapUnreachable`` if no record came within ``WAIT`` (without ``--config``); None if asked to stop."""
    add_run_config_validator(dht)
    wait = WAIT_WITH_CONFIG if joiner.config else WAIT
    logger.info(f"asking the swarm's owner ({', '.join(joiner.owners)}) for the swarm's config (up to {wait:g}s)")
    records = await wait_for_run_config(dht, joiner.owners, wait, should_stop, addresses=joiner.addresses)
    if records is None:
        return None
    if not records and not joiner.config:
        raise BootstrapUnreachable(
            f"no config from the swarm's owner ({', '.join(joiner.owners)}) within {wait:g}s: its bootstrap may "
            f"publish none (an older diloco-peer); give the swarm's config with --config NAME and its --set, or "
            f"retry later")
    record = _the_config(records)
    if record is None:
        given = f"--config {joiner.config}" if joiner.config else f"the default config ({DEFAULT_CONFIG})"
        logger.info(f"the swarm's owner publishes no config{'' if records else ' (none found)'}: training with "
                    f"{given} and --set as given")
        return joiner.local
    cfg = adopt(joiner.local, joiner.stated, record.config, record.owner)
    if cfg != joiner.local:
        await asyncio.to_thread(joiner.check, cfg, record.name or "the swarm's")
    logger.info(f"training with the swarm's config from its owner {record.owner}: {record.name or 'unnamed'}, run "
                f"'{cfg.run.run_id}', H={cfg.outer.inner_steps}, {cfg.outer.overlap} rounds; this peer's own: "
                f"batch {cfg.inner.batch_size}x{cfg.inner.grad_accum}, device {cfg.inner.device}")
    return cfg
