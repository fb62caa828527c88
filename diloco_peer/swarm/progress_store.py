"""The run's progress records in the DHT: the validators every node of ours installs, and reading them back.

A record is checked where it enters: its schema (``progress_record.ProgressSchema``), its signature (hivemind's
``RSASignatureValidator``, the key in the subkey: nobody can write or delete another peer's record) and its
expiration (``ExpirationCap``, on every key of the DHT), when another node asks us to store it and when a node
answers our search. ``progress.py`` publishes our record and reads the others' through ``fetch_progress_entries``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import SchemaValidator
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from ..lifecycle import hivemind_calls
from .progress_record import ProgressRecord, ProgressSchema

logger = logging.getLogger(__name__)

MAX_TTL = 600.0
"""Seconds into the future a DHT record may expire at most. Ours live 3 heartbeats, hivemind's matchmaking
and state-sharing records a few matchmaking periods or ``3 * heartbeat``: all far below. It also bounds
the clock skew a peer may have (its records' expirations are in its own clock)."""
DHT_CALL_TIMEOUT = 30.0
"""Seconds a DHT get or store may take: a healthy one answers within hivemind's RPC timeouts (a few seconds);
one that takes longer waits on a DHT process that is gone, and is abandoned (``hivemind_calls``)."""


class ExpirationCap(RecordValidatorBase):
    """Rejects every DHT record that expires more than ``max_ttl`` seconds from now, on any key.

    Checked when another node asks us to store a record and when a node answers our search, so a node
    that keeps such a record in its own storage cannot hand it to us either. An honest record is checked
    when it is fresh, and only gets closer to its expiration afterwards.
    """

    def __init__(self, max_ttl: float = MAX_TTL):
        self.max_ttl = max_ttl

    def validate(self, record: DHTRecord) -> bool:
        if record.expiration_time > get_dht_time() + self.max_ttl:
            logger.debug(f"rejected a DHT record expiring {record.expiration_time - get_dht_time():.0f}s from now")
            return False
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        if not isinstance(other, ExpirationCap):
            return False
        self.max_ttl = min(self.max_ttl, other.max_ttl)  # one check, the stricter cap
        return True


class RemembersPassed:
    """A record validator that remembers the last ``REMEMBERED`` records it passed: one that passed once passes
    again without the work.

    A waiting gate reads every peer's record, each from several nodes, and most of them have not changed since its
    last read (a record changes once a heartbeat): checking their signatures and schemas again and again was the
    largest part of a waiting peer's DHT process's work (BENCHMARKS.md, "Many peers"). Only a pass is remembered,
    and a record is the whole of what the check reads (key, subkey, value, expiration), so the answer is the one
    the check would give; a merge with another validator (hivemind merges schemas) forgets them all.
    """

    REMEMBERED = 4096

    def validate(self, record: DHTRecord) -> bool:
        passed = self.__dict__.setdefault("_passed", OrderedDict())  # (made here: validators arrive pickled)
        if record in passed:
            passed.move_to_end(record)
            return True
        if not super().validate(record):
            return False
        passed[record] = None
        if len(passed) > self.REMEMBERED:
            passed.popitem(last=False)
        return True

    def merge_with(self, other: RecordValidatorBase) -> bool:
        merged = super().merge_with(other)
        if merged:
            self.__dict__.pop("_passed", None)
        return merged


class RememberedSignatures(RemembersPassed, RSASignatureValidator):
    """hivemind's signature check of owned records, remembering what passed."""


class RememberedSchema(RemembersPassed, SchemaValidator):
    """hivemind's schema check, remembering what passed."""


def add_progress_validators(dht: DHT, run_id: str) -> bytes:
    """Install the signature, schema and expiration validators for ``run_id``; returns our public key (the
    subkey).

    Each caller gets a key of its own (not hivemind's process-wide one), so that two peers that share a
    process, as in tests, still own separate records.
    """
    signer = RememberedSignatures(RSAPrivateKey())
    dht.add_validators([RememberedSchema(ProgressSchema, prefix=run_id), signer, ExpirationCap()])
    return signer.local_public_key


async def fetch_progress(dht: DHT, run_id: str) -> list[ProgressRecord]:
    """The live progress records of the run, one per peer (withdrawn and expired ones left out)."""
    return [record for record, _ in (await fetch_progress_entries(dht, run_id)).values() if record is not None]


async def fetch_progress_entries(dht: DHT, run_id: str) -> dict[bytes, tuple[ProgressRecord | None, float]]:
    """The run's progress entries as the DHT answered now: subkey -> (record, None if withdrawn; its expiration)."""
    found = await hivemind_calls.call(dht.get, f"{run_id}_progress", latest=True, timeout=DHT_CALL_TIMEOUT)
    if found is None or not isinstance(found.value, dict):
        return {}
    entries = {}
    for subkey, entry in found.value.items():
        try:  # validated on store; re-checked because the DHT is shared with strangers
            entries[subkey] = (None if entry.value is None else ProgressRecord.parse_obj(entry.value),
                               entry.expiration_time)
        except ValueError:
            continue
    return entries
