"""Who a node is and whom it dials: multiaddrs and libp2p identity files, checked before anything starts.

The CLI checks every address and key file it is given here, before the DHT starts: a typo is a one-line
error naming the value, in a fraction of a second. So this module imports no hivemind (and so no torch)
unless a key file must be read or written.
"""

from __future__ import annotations

import os
from pathlib import Path

from multiaddr import Multiaddr

EXAMPLE_ADDR = "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooW..."


class SwarmError(RuntimeError):
    """Cannot join or start the swarm; the message says why and what to do."""


class BootstrapUnreachable(SwarmError):
    """No bootstrap peer answered; retrying later may help (the CLI exits with its own code, 3)."""


def parse_multiaddr(text: str, *, need_peer_id: bool, what: str = "address") -> Multiaddr:
    """Validate a multiaddr; bootstrap addresses must end in /p2p/<peer-id> so that we know whom we dial."""
    try:
        addr = Multiaddr(text)
    except Exception as e:  # multiaddr raises several exception types for bad input
        reason = str(e).split(" (string:")[0]
        raise SwarmError(f"bad {what} '{text}': {reason}; expected e.g. {EXAMPLE_ADDR}") from None
    names = [p.name for p in addr.protocols()]
    if not any(n in names for n in ("tcp", "udp")):
        raise SwarmError(f"bad {what} '{text}': no /tcp/ or /udp/ port; expected e.g. {EXAMPLE_ADDR}")
    if need_peer_id and "p2p" not in names:
        raise SwarmError(
            f"bad {what} '{text}': missing /p2p/<peer-id>; copy the whole line the bootstrap node prints, "
            f"e.g. {EXAMPLE_ADDR}"
        )
    return addr


def _refuse_nul(path: str) -> None:
    if "\x00" in path:  # pathlib's checks say False for such a path; opening it raises ValueError
        raise SwarmError(f"bad identity path {path!r}: it contains a NUL character: remove it")


def generate_identity(path: str, force: bool = False) -> str:
    """``diloco-peer keygen``: write a new libp2p private key to ``path`` (mode 0600), return its peer id.

    The key is the kind ``join``/``bootstrap --identity`` create on first use (RSA, which hivemind's check
    for a second process with the same identity can read)."""
    _refuse_nul(path)
    target = Path(path).expanduser()
    try:
        if target.is_dir():
            raise SwarmError(f"bad identity path {path}: it is a directory: give a file name, e.g. {path}/peer.key")
        if target.exists() and not force:
            raise SwarmError(f"bad identity path {path}: the file exists (a peer's identity is in it): choose "
                             f"another path, or pass --force to replace it")
        target.unlink(missing_ok=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        from hivemind.p2p import P2P, PeerID

        P2P.generate_identity(str(target))
    except OSError as e:
        raise SwarmError(f"bad identity path {path}: cannot write it ({e.strerror}): choose a writable path") from None
    os.chmod(target, 0o600)
    return PeerID.from_identity(target.read_bytes()).to_base58()


def check_identity(path: str) -> None:
    """``--identity`` / ``swarm.identity_path`` before the DHT starts: an existing file must hold a libp2p
    private key; a missing one will be created, so its directory is created now (hivemind does not)."""
    _refuse_nul(path)
    target = Path(path)
    try:
        if target.is_dir():
            raise SwarmError(f"bad identity path {path}: it is a directory: give a file name, e.g. {path}/peer.key")
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            return
        key = target.read_bytes()
    except OSError as e:
        raise SwarmError(f"bad identity path {path}: {e.strerror}: give a readable key file, or a new path") from None
    from hivemind.p2p import PeerID

    try:
        PeerID.from_identity(key)
    except Exception:  # protobuf and cryptography raise several types for a file that is no key
        raise SwarmError(f"bad identity file {path}: it holds no libp2p private key: give the file that "
                         f"'diloco-peer keygen' wrote, or a new path to create one") from None
