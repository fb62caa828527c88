"""Who a node is and whom it dials: multiaddrs and libp2p identity files, checked before anything starts.

The CLI checks every address and key file it is given here, before the DHT starts: a typo is a one-line
error naming the value, in a fraction of a second. So this module imports no hivemind (and so no torch)
unless a key file must be read or written.

One identity, one process: a process that uses an identity holds an exclusive lock on its key file
(``hold_identity``) from before its DHT starts until it exits, so a second process on this machine with
that key stops at once with a one-line error, whatever the key type and whether or not a DHT is reachable.
Across machines, hivemind's check at the DHT's start (``join.start_dht``) still finds a peer id in use.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path

from multiaddr import Multiaddr

logger = logging.getLogger(__name__)

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
    private key and is claimed for this process (``hold_identity``); a missing one is created and claimed
    when the DHT starts, so its directory is created now (hivemind does not)."""
    _refuse_nul(path)
    target = Path(path)
    try:
        if target.is_dir():
            raise SwarmError(f"bad identity path {path}: it is a directory: give a file name, e.g. {path}/peer.key")
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            return
        hold_identity(path)  # before the seconds that importing hivemind takes: a second process stops at once
        key = target.read_bytes()
    except OSError as e:
        raise SwarmError(f"bad identity path {path}: {e.strerror}: give a readable key file, or a new path") from None
    from hivemind.p2p import PeerID

    try:
        PeerID.from_identity(key)
    except Exception:  # protobuf and cryptography raise several types for a file that is no key
        raise SwarmError(f"bad identity file {path}: it holds no libp2p private key: give the file that "
                         f"'diloco-peer keygen' wrote, or a new path to create one") from None


def identity_in_use(path: str) -> SwarmError:
    """The error for an identity that another running process uses: seen by its lock on this machine, or by
    hivemind's check in the DHT on another (``join.start_dht``)."""
    return SwarmError(f"identity {path} is already used by another running peer: give each process its own "
                      f"--identity file")


def _lock(fd: int, path: str) -> int:
    """Lock open file ``fd`` (key file ``path``) exclusively without waiting; close it and raise if we cannot."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise identity_in_use(path) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def lock_identity(path: str) -> int:
    """Open key file ``path`` and lock it exclusively without waiting; return the descriptor that holds the lock,
    or raise ``identity_in_use`` if another open file holds it.

    flock, not fcntl/lockf: a flock belongs to the open file, so two opens conflict even in one process, and
    closing another descriptor of the file keeps it (a POSIX lock is per process, dropped by any close). The
    kernel drops it when the descriptor is closed, and a dying process's descriptors are closed whatever ends
    it, SIGKILL and the OOM killer included: there is no stale lock to clean up, and no lock file."""
    # non-inheritable (PEP 446): the programs we exec (p2pd, the reaper) never hold it
    return _lock(os.open(path, os.O_RDONLY), path)


_held: dict[tuple[int, int], tuple[int, bool]] = {}  # (st_dev, st_ino) -> (the locked descriptor, created here)
_held_guard = threading.Lock()  # the DHT starts in a worker thread
_fork_hook: list[bool] = []  # [True] once _forget_in_child is registered


def _forget_in_child() -> None:
    # a forked child (hivemind's DHT and averager processes) closes its copies: the lock is the process's
    # own, free as soon as it dies, and the reaper ends the children that outlive it
    for fd, _ in _held.values():
        os.close(fd)
    _held.clear()


def _create_locked_key(target: Path) -> int | None:
    """Create key file ``target``; return a descriptor that holds its lock, or None if it exists already.

    The key is written to a temporary file beside it, locked, then hard-linked to ``target``: the link fails if
    ``target`` exists, so of two processes creating it at once exactly one wins, and the file appears whole and
    already locked (an exclusive create, then a write, could show the other an empty key or let it lock first)."""
    from hivemind.p2p import P2P

    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".new")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # nobody else knows this file: never fails
        P2P.generate_identity(tmp)  # the key hivemind creates on first use: RSA, mode 0400
        os.link(tmp, target)
    except FileExistsError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    finally:
        os.unlink(tmp)
    return fd


def _claim(path: str) -> tuple[int, bool]:
    """The locked descriptor of key file ``path`` (created if missing) and whether we created it; a file that
    this process holds already: that descriptor."""
    target = Path(path)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = _create_locked_key(target)
        except OSError as e:  # e.g. a file system without hard links: keygen writes it in place
            raise SwarmError(f"bad identity path {path}: cannot create it ({e.strerror}): create it first with "
                             f"diloco-peer keygen {path}") from None
        if fd is not None:
            return fd, True
    fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK)  # no wait for a writer, should it be a FIFO
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise SwarmError(f"bad identity path {path}: it is not a regular file: give a key file, or a new path")
    if (info.st_dev, info.st_ino) in _held:
        os.close(fd)
        return _held[info.st_dev, info.st_ino]
    return _lock(fd, path), False


def hold_identity(path: str) -> bool:
    """Claim identity ``path`` until this process exits: create the key file if it is missing, then hold its lock
    (as ``lock_identity``). Returns whether this process created the key (a new key is used nowhere else).

    Claiming a file that this process holds already does nothing: the DHT may start several times. Another
    process holding it raises ``identity_in_use`` at once. Where the file system cannot lock (some network
    file systems), a warning says so and hivemind's check at the DHT's start is the only one."""
    _refuse_nul(path)
    with _held_guard:
        if not _fork_hook:
            os.register_at_fork(after_in_child=_forget_in_child)
            _fork_hook.append(True)
        try:
            fd, created = _claim(path)
        except OSError as e:
            # no locks here, or (EBADF) NFS, whose exclusive locks need a file open for writing
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF):
                logger.warning(f"cannot lock identity file {path} ({e.strerror}): a second process with this "
                               f"identity on this machine is not stopped at once")
                return False
            raise SwarmError(f"bad identity path {path}: {e.strerror}: give a readable key file, or a new "
                             f"path") from None
        info = os.fstat(fd)
        _held[info.st_dev, info.st_ino] = fd, created
        return created
