"""The node's own sections of the configuration (how this peer is reached, where it keeps its checkpoints and
serves its metrics) and the whole tree, ``PeerConfig``: the run's sections (``schema.py``) and these, with the checks
that span sections."""

from __future__ import annotations

import hashlib
import json
from typing import Literal

from pydantic import Field, model_validator

from .schema import AveragingConfig, DataConfig, InnerConfig, ModelConfig, OuterConfig, RunConfig, _Section


class SwarmConfig(_Section):
    host_maddrs: list[str] = ["/ip4/0.0.0.0/tcp/0"]
    """Where this peer listens (multiaddrs)."""
    announce_maddrs: list[str] = []
    """Addresses others should dial (e.g. your public IP behind port forwarding); empty = detected."""
    identity_path: str = ""
    """libp2p private key file: a stable peer id across restarts; created if missing; empty = new id."""
    secret_file: str = ""
    """A file holding the swarm secret (``diloco-peer keygen --secret FILE``): only peers with the same
    secret can talk to this peer's DHT and average with it (see admission.py). Empty: an open swarm."""
    allowlist: list[str] = []
    """Peer ids allowed to average with us and download our state; empty: anyone (with the secret, if set)."""
    reachability: Literal["auto", "direct", "relayed", "outbound-only"] = "auto"
    """How others reach this peer (see reachability.py). auto: a bootstrap dials us back at start-up; if it
    cannot, we reserve a slot with a relay; if no relay takes us, we run outbound-only (client mode)."""
    relays: list[str] = []
    """Relays (multiaddrs with /p2p/<id>) a NAT'd peer reserves slots with; empty: the bootstrap nodes."""
    relay_service: bool = False
    """When directly reachable, relay for the NAT'd peers that list us in their ``relays`` (as bootstraps do)."""
    reachability_check: float = Field(30.0, gt=0)
    """Seconds between checks that our relays still carry us (relayed peers; a lost relay is logged)."""
    startup_timeout: float = Field(30.0, gt=0)
    join_timeout: float = Field(300.0, ge=0)
    """If no bootstrap is reachable at start, keep retrying (backoff 2 s doubling to 60 s) for this many
    seconds before giving up with exit code 3; 0 gives up at once."""


class CheckpointConfig(_Section):
    """Checkpoints of the peer's whole state, written atomically in the background (see checkpoint.py)."""

    dir: str = "checkpoints"
    """Directory of this peer's checkpoints: ``{dir}/{peer name}/``. ``join`` resumes from the newest one
    there (same --name or --identity); empty disables checkpoints."""
    every_rounds: int = Field(1, ge=1)
    """Write a checkpoint after every this many outer rounds (and always when leaving)."""
    keep: int = Field(3, ge=1)
    """Checkpoints to keep; older ones are deleted once a newer one is safely on disk."""


class MetricsConfig(_Section):
    """Prometheus metrics of this peer (see metrics.py)."""

    port: int = Field(0, ge=0, le=65535)
    """Serve ``/metrics`` and ``/healthz`` on this TCP port; 0 serves none."""
    host: str = "127.0.0.1"
    """Interface to serve them on; ``0.0.0.0`` lets a Prometheus on another host (or container) scrape."""


class PeerConfig(_Section):
    run: RunConfig = RunConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    averaging: AveragingConfig = AveragingConfig()
    swarm: SwarmConfig = SwarmConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _check_cross(self) -> PeerConfig:
        if self.data.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}"
            )
        if self.data.tokenizer == "bytes" and self.data.source != "shards" and self.model.vocab_size < 256:
            raise ValueError(f"tokenizer 'bytes' needs model.vocab_size >= 256, got {self.model.vocab_size}")
        if self.data.source == "files" and not self.data.paths:
            raise ValueError('data.source="files" needs data.paths, e.g. --set data.paths=["corpus.txt"]')
        if self.data.source == "hf" and not self.data.hf_dataset:
            raise ValueError('data.source="hf" needs data.hf_dataset, e.g. --set data.hf_dataset="allenai/c4:en"')
        if self.data.source == "shards" and not self.data.shards_dir:
            raise ValueError('data.source="shards" needs data.shards_dir (the --out of diloco-peer prepare), '
                             'e.g. --set data.shards_dir="data/corpus"')
        return self

    def lends_replica(self, device_type: str) -> bool:
        """Whether the replica lives in the averager's input buffer (``daemon.PeerDaemon._build``, and the memory
        table of ``tools/memory_plan.py``): blocking rounds, no error feedback, training on the CPU
        (``device_type``). The replica is free during a round (reloaded from the outer weights after it), so the
        pseudo-gradient is computed in its memory, and needs no buffer of its own."""
        return self.outer.overlap == "blocking" and not self.averaging.error_feedback and device_type == "cpu"

    def averages_in_place(self, device_type: str) -> bool:
        """Whether a round's average is written over the pseudo-gradient it sent (``RoundAverager(in_place=True)``,
        and the memory table): blocking rounds, no error feedback, training off the CPU. There the replica stays
        untouched until the outer step, so a failed or refused round's solo step computes the pseudo-gradient
        again from it; a lent CPU replica (``lends_replica``) saves the same 4 bytes per parameter instead."""
        return self.outer.overlap == "blocking" and not self.averaging.error_feedback and device_type != "cpu"

    def fingerprint(self) -> str:
        """Hash of everything that must be equal across a swarm (model shape, seed, run id)."""
        shared = {"run_id": self.run.run_id, "seed": self.run.seed, "model": self.model.model_dump()}
        if self.outer.overlap != "blocking":  # peers of the two modes cannot share rounds
            shared["overlap"] = self.outer.overlap
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]
