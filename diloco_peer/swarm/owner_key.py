"""The run owner's key: libp2p keys as identity files hold them, the peer ids they make, and signatures.

The peer id at the end of a bootstrap's address (``/p2p/<id>``) is a hash of the node's public key, so a volunteer
who pasted the address already holds a trust anchor: whatever is signed by a key that hashes to that id comes from
the node they meant to join (``run_config.py`` signs the run's config so). Written against the libp2p specs (peer
ids, keys) with ``cryptography`` alone: hivemind reads RSA identities only, and py-libp2p cannot be imported into a
process that imports hivemind (they register the same protobuf package).

- A key is the protobuf message ``{1: KeyType, 2: bytes data}`` (libp2p's ``crypto.pb.PublicKey`` /
  ``PrivateKey``), encoded here by hand (two fields). RSA (type 0): a private key is PKCS#1 DER, a public key
  SubjectPublicKeyInfo DER; what ``diloco-peer keygen`` and hivemind write, peer ids ``Qm...``. Ed25519 (type 1):
  a private key is the 32-byte seed and, as p2pd wants it, the 32-byte public key after it; a public key its 32
  bytes; peer ids ``12D3KooW...``.
- The peer id: the multihash of the encoded public key (identity multihash up to 42 bytes, as Ed25519 keys are;
  sha2-256 beyond, as RSA keys are), in base58.
- Signatures as libp2p makes them: RSA PKCS#1 v1.5 with SHA-256; Ed25519 plain.

    key = OwnerKey.load("boot.key")
    signature = key.sign(b"message")
    assert verify(key.public_key, b"message", signature) and peer_id_of(key.public_key) == key.peer_id
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa

RSA, ED25519 = 0, 1
"""libp2p's ``KeyType`` values of the two key types our identities can hold."""
RSA_BITS = (2048, 8192)
"""RSA key sizes accepted (go-libp2p refuses keys under 2048 bits; the upper bound bounds the cost of a check)."""
_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_IDENTITY_MAX = 42  # libp2p: a public key encoded in at most 42 bytes is its own peer id (identity multihash)


def _varint(number: int) -> bytes:
    out = bytearray()
    while True:
        byte, number = number & 0x7F, number >> 7
        out.append(byte | (0x80 if number else 0))
        if not number:
            return bytes(out)


def _read_varint(blob: bytes, pos: int) -> tuple[int, int]:
    number = shift = 0
    while pos < len(blob) and shift < 64:
        byte = blob[pos]
        number |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return number, pos
        shift += 7
    raise ValueError("truncated varint")


def encode_key(key_type: int, data: bytes) -> bytes:
    """libp2p's protobuf key message (``PublicKey`` or ``PrivateKey``: the same two fields)."""
    return b"\x08" + _varint(key_type) + b"\x12" + _varint(len(data)) + data


def decode_key(blob: bytes) -> tuple[int, bytes]:
    """(key type, data) of a libp2p protobuf key message; ``ValueError`` if it is not one (the two fields, in the
    canonical order an encoder writes them, and nothing else: one key has one encoding, hence one peer id)."""
    if not isinstance(blob, bytes) or blob[:1] != b"\x08":
        raise ValueError("not a libp2p key")
    key_type, pos = _read_varint(blob, 1)
    if blob[pos:pos + 1] != b"\x12":
        raise ValueError("not a libp2p key")
    length, pos = _read_varint(blob, pos + 1)
    if pos + length != len(blob) or encode_key(key_type, blob[pos:]) != blob:
        raise ValueError("not a libp2p key")
    return key_type, blob[pos:]


def base58(data: bytes) -> str:
    number = int.from_bytes(data, "big")
    text = ""
    while number:
        number, digit = divmod(number, 58)
        text = _BASE58[digit] + text
    return "1" * (len(data) - len(data.lstrip(b"\x00"))) + text


def peer_id_of(public_key: bytes) -> str:
    """The peer id (base58) of an encoded public key (``encode_key``)."""
    if len(public_key) <= _IDENTITY_MAX:
        return base58(b"\x00" + _varint(len(public_key)) + public_key)
    return base58(b"\x12\x20" + hashlib.sha256(public_key).digest())


def verify(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``message`` signed by the private half of encoded ``public_key`` (RSA or Ed25519);
    False for anything else, a malformed or unsupported key included."""
    try:
        key_type, data = decode_key(public_key)
        if key_type == ED25519:
            ed25519.Ed25519PublicKey.from_public_bytes(data).verify(signature, message)
            return True
        if key_type == RSA:
            key = serialization.load_der_public_key(data)
            if not isinstance(key, rsa.RSAPublicKey) or not RSA_BITS[0] <= key.key_size <= RSA_BITS[1]:
                return False
            key.verify(signature, message, padding.PKCS1v15(), hashes.SHA256())
            return True
    except (InvalidSignature, ValueError, TypeError):
        pass
    return False


class OwnerKey:
    """A private key that signs: the run owner's, loaded from its identity file.

    :ivar public_key: the encoded public key (``encode_key``), published beside each signature
    :ivar peer_id: its peer id, the one in the owner's address
    """

    def __init__(self, key_type: int, private_key: rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey):
        self._private_key = private_key
        if key_type == RSA:
            data = private_key.public_key().public_bytes(serialization.Encoding.DER,
                                                         serialization.PublicFormat.SubjectPublicKeyInfo)
        else:
            data = private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.key_type = key_type
        self.public_key = encode_key(key_type, data)
        self.peer_id = peer_id_of(self.public_key)

    @classmethod
    def load(cls, path: str | Path) -> OwnerKey:
        """The key in libp2p identity file ``path`` (what ``keygen`` and ``--identity`` write); ``ValueError`` if
        it holds no RSA or Ed25519 private key."""
        key_type, data = decode_key(Path(path).read_bytes())
        if key_type == RSA:
            key = serialization.load_der_private_key(data, password=None)
            if not isinstance(key, rsa.RSAPrivateKey):
                raise ValueError("not an RSA private key")
            return cls(RSA, key)
        if key_type == ED25519 and len(data) in (32, 64):  # the seed, and the public key after it
            key = ed25519.Ed25519PrivateKey.from_private_bytes(data[:32])
            if len(data) == 64 and key.public_key().public_bytes_raw() != data[32:]:
                raise ValueError("an Ed25519 key whose public half does not match its seed")
            return cls(ED25519, key)
        raise ValueError(f"key type {key_type} with {len(data)} bytes: only RSA and Ed25519 identities sign")

    def sign(self, message: bytes) -> bytes:
        if self.key_type == RSA:
            return self._private_key.sign(message, padding.PKCS1v15(), hashes.SHA256())
        return self._private_key.sign(message)
