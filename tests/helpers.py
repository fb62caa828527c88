"""What several test modules use, so that no test module imports another: the command line as a subprocess, a
trainer with its outer optimizer and the hash of everything a resume restores, and a state-sync peer in this
process (the ``peers`` fixture of ``conftest.py`` makes them)."""

from __future__ import annotations

import hashlib
import random
import socket
import subprocess

import torch
from hivemind.dht import DHT

from diloco_peer.averaging.averager import RoundAverager
from diloco_peer.config.faults import NO_FAULTS
from diloco_peer.state.state_sync import StateSync
from diloco_peer.state.target import Target
from diloco_peer.tools.local_swarm import diloco_command
from diloco_peer.training.data import Corpus
from diloco_peer.training.model import build_model, param_sha256
from diloco_peer.training.outer_optimizer import OuterOptimizer
from diloco_peer.training.trainer import Trainer

PEER_ID = "12D3KooWHQEFuYFG1pGNfSsfDsM5nCiACFRgDLDg5faqtUaKTuzT"
GOOD_ADDR = f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}"
"""A well-formed bootstrap address where nobody listens."""


def free_port() -> int:
    """A TCP port free on loopback now, below the kernel's ephemeral range. A port the kernel picks (a bind to port 0)
    is in that range, and the kernel may pick it again for the next process that listens on port 0 (the p2pd of
    the swarm the test starts next): a peer's metrics port was taken so, between the pick and the peer's start."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for _ in range(100):
        port = random.randrange(10_000, ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use: another
                continue
            return port
    raise RuntimeError(f"no free port found below {ephemeral}")


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``diloco-peer ARGS`` as a subprocess, its output captured."""
    return subprocess.run(diloco_command(*args), capture_output=True, text=True, timeout=timeout)


TRAIN_SETS = ["data.max_bytes=200_000", "data.num_shards=2", "data.shard=0", "outer.inner_steps=3"]
"""A peer that trains in moments: a small corpus, H=3."""


def trainer_and_outer(cfg) -> tuple[Trainer, OuterOptimizer]:
    """A peer's trainer (model, AdamW, data shard 0) and outer optimizer, as the daemon builds them."""
    corpus = Corpus(cfg.data, 0, cfg.model.vocab_size)
    trainer = Trainer(build_model(cfg.model, cfg.run.seed), corpus, cfg.inner)
    return trainer, OuterOptimizer(trainer.model, cfg.outer)


def state_hash(trainer: Trainer, outer: OuterOptimizer) -> str:
    """One hash over everything a resume must restore."""
    digest = hashlib.sha256()
    digest.update(param_sha256(outer.params).encode())
    digest.update(param_sha256(outer.momentum_buffers()).encode())
    digest.update(param_sha256(trainer.model.parameters()).encode())
    for state in trainer.optimizer.state_dict()["state"].values():
        digest.update(param_sha256([state["exp_avg"], state["exp_avg_sq"], state["step"].reshape(1)]).encode())
    digest.update(f"{outer.epoch} {trainer.step}".encode())
    digest.update(trainer.corpus.rng_state().numpy().tobytes())
    return digest.hexdigest()


SYNC_SETS = ["averaging.sync_timeout=3.0", "averaging.matchmaking_time=2.0", "averaging.request_timeout=1.0"]
"""State-sync peers' config: short timeouts, so that a test of a bad donor ends in seconds."""


class SyncPeer:
    """A DHT + averager + outer optimizer: everything state sync touches, in this process."""

    def __init__(self, cfg, initial_peers=(), seed_offset=0, fingerprint=None, faults=NO_FAULTS, shared=True):
        self.dht = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(initial_peers))
        model = build_model(cfg.model, cfg.run.seed + seed_offset)
        self.outer = OuterOptimizer(model, cfg.outer, shared=shared)  # (shared: as the daemon's)
        self.averager = RoundAverager(self.dht, [p.shape for p in self.outer.params], cfg.run.run_id, cfg.averaging,
                                      faults=faults)
        self.served = []
        self.sync = StateSync(self.averager.averager, self.outer, fingerprint or cfg.fingerprint(),
                              cfg.outer.inner_steps, cfg.averaging, on_serve=lambda e, n: self.served.append((e, n)),
                              faults=faults)
        self.id = self.dht.peer_id.to_base58()

    def advance(self, rounds):
        for _ in range(rounds):
            with torch.no_grad():
                for p in self.outer.model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            with self.sync.lock:
                self.outer.step(self.outer.pseudo_gradient())
                self.sync.after_outer_step()

    def target(self):
        return Target(self.outer.epoch, self.sync.state_hash, [self.id])

    def close(self):
        self.averager.shutdown()
        self.dht.shutdown()
