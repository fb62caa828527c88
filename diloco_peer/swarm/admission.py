"""Admission: who may take part in a swarm. Open by default; closed with a swarm secret and/or an allowlist.

A closed swarm is checked on both paths a peer can touch:

- **DHT traffic** (secret): every DHT request and response carries an HMAC-SHA256 of its bytes under the
  swarm secret, a timestamp and a nonce (``SwarmSecretAuthorizer``, a hivemind ``AuthorizerBase``). A node
  without the secret cannot store, find or even ping: it cannot join, read the swarm's records or learn
  who trains. Replays are refused (nonces are remembered for the allowed clock skew).
- **Averaging and state downloads** (secret and allowlist): libp2p authenticates each connection's peer
  id (its TLS/Noise handshake proves the key), so the averager checks ids: with an allowlist, only listed
  peer ids may be in our group or download our state; with a secret, every group member must show
  ``proof(peer_id)``, an HMAC of its own id under the secret, in the data it gathers with the group (a
  leader checks it before accepting a follower; every member checks all of them before averaging), and a
  state download is served only to a peer with a progress record in the (closed) DHT.

What is not defended here (see SECURITY.md): a peer that holds the secret or is on the allowlist is
trusted to take part, not to be honest: its numbers still go through ``robust_aggregation.py``.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.timed_storage import get_dht_time

from ..config import ConfigError

logger = logging.getLogger(__name__)

MIN_SECRET_BYTES = 16
MAX_CLOCK_SKEW = 60.0
"""Seconds a signed DHT request stays valid: peers' clocks may differ by this much (NTP keeps them closer)."""


class AdmissionError(ConfigError):
    """A bad secret file or allowlist entry; the message is one line naming the value and the fix."""


@dataclass(frozen=True)
class Admission:
    """Who may take part. ``secret`` None and an empty ``allowlist``: an open swarm, everyone may."""

    secret: bytes | None = None
    allowlist: frozenset[str] = frozenset()

    @property
    def closed(self) -> bool:
        return self.secret is not None or bool(self.allowlist)

    def proof(self, peer_id: str) -> bytes:
        """What a peer shows to prove it holds the secret: an HMAC of its own (authenticated) peer id."""
        if self.secret is None:
            return b""
        return hmac.new(self.secret, b"diloco-peer admission\0" + peer_id.encode(), hashlib.sha256).digest()

    def refuses(self, peer_id: str, proof: bytes | None) -> str:
        """Why ``peer_id``, showing ``proof``, may not take part ("" if it may). ``proof`` None: the caller
        checks the secret another way (state downloads: a progress record in the closed DHT)."""
        if self.allowlist and peer_id not in self.allowlist:
            return f"peer {peer_id} is not on the swarm's allowlist"
        if self.secret is not None and proof is not None and not hmac.compare_digest(proof, self.proof(peer_id)):
            return f"peer {peer_id} did not prove it holds the swarm secret"
        return ""

    def authorizer(self) -> SwarmSecretAuthorizer | None:
        return SwarmSecretAuthorizer(self.secret) if self.secret is not None else None


def load_admission(secret_file: str, allowlist: list[str]) -> Admission:
    """Read the ``[swarm]`` section's ``secret_file`` and ``allowlist``; raises ``AdmissionError``."""
    secret = None
    if secret_file:
        if "\x00" in secret_file:  # reading such a path raises ValueError, not OSError
            raise AdmissionError(f"bad swarm.secret_file {secret_file!r}: it contains a NUL character: remove it")
        path = Path(secret_file).expanduser()
        try:
            raw = path.read_bytes().strip()
        except OSError as e:
            raise AdmissionError(f"cannot read swarm.secret_file {secret_file}: {e.strerror}; create it with: "
                                 f"diloco-peer keygen --secret {secret_file}") from None
        if len(raw) < MIN_SECRET_BYTES:
            raise AdmissionError(f"swarm.secret_file {secret_file} holds {len(raw)} bytes, fewer than "
                                 f"{MIN_SECRET_BYTES}: a guessable secret; make one with: diloco-peer keygen --secret "
                                 f"{secret_file}")
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning(f"swarm.secret_file {secret_file} is readable by other users: chmod 600 {secret_file}")
        secret = raw
    ids = set()
    for entry in allowlist:
        try:
            PeerID.from_base58(entry)
        except Exception:
            raise AdmissionError(f"bad peer id {entry!r} in swarm.allowlist: expected a base58 peer id such as "
                                 f"the one `diloco-peer keygen` prints") from None
        ids.add(entry)
    return Admission(secret, frozenset(ids))


def write_secret(path: str, force: bool = False) -> None:
    """``diloco-peer keygen --secret PATH``: a new random swarm secret (32 bytes, hex), mode 0600."""
    if "\x00" in path:  # pathlib's checks say False for such a path; opening it raises ValueError
        raise AdmissionError(f"bad secret path {path!r}: it contains a NUL character: remove it")
    target = Path(path).expanduser()
    try:
        if target.is_dir():
            raise AdmissionError(f"bad secret path {path}: it is a directory: give a file name, e.g. "
                                 f"{path}/swarm.secret")
        if target.exists() and not force:
            raise AdmissionError(f"bad secret path {path}: the file exists (a swarm's secret may be in it): "
                                 f"choose another path, or pass --force to replace it")
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    except OSError as e:
        raise AdmissionError(f"bad secret path {path}: cannot write it ({e.strerror}): choose a writable "
                             f"path") from None
    os.chmod(target, 0o600)


class SwarmSecretAuthorizer(AuthorizerBase):
    """Signs and checks every DHT request and response with an HMAC under the swarm secret.

    hivemind's ``AuthRPCWrapper`` calls it around every DHT RPC; a request that fails ``validate_request``
    is answered with nothing, a response that fails ``validate_response`` is dropped.
    """

    def __init__(self, secret: bytes):
        self._secret = secret
        self._seen_nonces: dict[bytes, float] = {}
        self.refused = 0
        self._last_warning = 0.0

    def _mac(self, label: bytes, message) -> bytes:
        return hmac.new(self._secret, label + message.SerializeToString(), hashlib.sha256).digest()

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = self._mac(b"request", request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        signature = auth.signature
        now = get_dht_time()
        auth.signature = b""
        expected = self._mac(b"request", request)
        auth.signature = signature
        if not hmac.compare_digest(signature, expected):
            return self._refuse("a DHT request without a valid swarm-secret signature (a peer without the secret?)")
        if abs(now - auth.time) > MAX_CLOCK_SKEW:
            return self._refuse(f"a DHT request signed {now - auth.time:.0f}s ago (clock skew or a replay)")
        self._seen_nonces = {n: t for n, t in self._seen_nonces.items() if now - t <= 2 * MAX_CLOCK_SKEW}
        if auth.nonce in self._seen_nonces:
            return self._refuse("a replayed DHT request")
        self._seen_nonces[auth.nonce] = now
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._mac(b"response", response)

    async def validate_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> bool:
        auth = response.auth
        signature = auth.signature
        auth.signature = b""
        expected = self._mac(b"response", response)
        auth.signature = signature
        if auth.nonce != request.auth.nonce or not hmac.compare_digest(signature, expected):
            return self._refuse("a DHT response without a valid swarm-secret signature")
        return True

    def _refuse(self, what: str) -> bool:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_warning > 30:  # one line per 30 s, not one per request
            logger.warning(f"admission: refused {what} ({self.refused} refused so far)")
            self._last_warning = now
        return False
