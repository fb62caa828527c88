"""One identity, one process: the lock on an identity's key file (``swarm/addresses.py``), within one process
and across processes. How the CLI shows it (bootstraps and joins sharing a key) is in test_cli.py."""

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diloco_peer.swarm.addresses import SwarmError, _create_locked_key, hold_identity, lock_identity

IN_USE = "is already used by another running peer: give each process its own --identity file"

# claims the identity and forks a child (as hivemind forks its DHT and averager processes), which prints its pid
# once it runs its own code (after the fork's hooks)
HOLDER = """
import os, sys, time
from diloco_peer.swarm.addresses import hold_identity
hold_identity(sys.argv[1])
if os.fork() == 0:
    print(os.getpid(), flush=True)
time.sleep(60)
"""


def test_two_opens_of_one_key_file_conflict_even_in_one_process(tmp_path):
    key = tmp_path / "peer.key"
    key.write_bytes(b"any key type: the lock never reads the key")
    first = lock_identity(str(key))
    with pytest.raises(SwarmError) as error:
        lock_identity(str(key))
    assert str(error.value) == f"identity {key} {IN_USE}"
    os.close(first)  # closing the descriptor frees it
    os.close(lock_identity(str(key)))


def test_claiming_an_identity_again_in_the_same_process_is_the_same_claim(tmp_path):
    key = tmp_path / "peer.key"
    key.write_bytes(b"key")
    assert hold_identity(str(key)) is False  # an existing key: not created here
    assert hold_identity(str(key)) is False  # the DHT may start several times
    with pytest.raises(SwarmError, match=IN_USE):  # and it is held: any other open of the file is refused
        lock_identity(str(key))


def test_a_process_holds_its_identity_until_it_dies_even_by_sigkill(tmp_path):
    key = tmp_path / "peer.key"
    key.write_bytes(b"key")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(key)], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(holder.stdout.readline())
        with pytest.raises(SwarmError, match=IN_USE):
            lock_identity(str(key))
        holder.kill()
        holder.wait()
        # its forked child still runs but holds no copy of the lock: the identity is free once the process is gone
        assert Path(f"/proc/{child}").exists()
        os.close(lock_identity(str(key)))
    finally:
        holder.kill()
        holder.wait()
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


def test_a_missing_key_is_created_whole_and_already_locked(tmp_path):
    from hivemind.p2p import PeerID

    key = tmp_path / "new" / "peer.key"
    assert hold_identity(str(key)) is True
    PeerID.from_identity(key.read_bytes())  # the RSA key hivemind would have created
    assert [p.name for p in key.parent.iterdir()] == ["peer.key"]  # no temporary file left beside it
    with pytest.raises(SwarmError, match=IN_USE):
        lock_identity(str(key))
    assert hold_identity(str(key)) is True  # the same claim: still the key this process created

    # a process that loses the race to create a key: the file appeared meanwhile, so the link fails
    taken = tmp_path / "taken.key"
    taken.write_bytes(b"the winner's key")
    assert _create_locked_key(taken) is None
    assert taken.read_bytes() == b"the winner's key"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "taken.key"]
