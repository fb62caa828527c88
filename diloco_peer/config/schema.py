"""The peer's configuration: one pydantic tree, validated once, each component handed its own section.

Each section is a frozen, strict pydantic model: a typo in a key or a value of the wrong type is an error
at start-up, never a default silently taken. ``loading.py`` reads a TOML file and ``--set`` overrides into
this tree; every component is then handed only its own section (``cfg.averaging``, ``cfg.inner``, ...).
Here: the run's sections (run, model, data, the inner and outer optimizers, averaging); the node's own (swarm,
checkpoint, metrics) and the whole tree, ``PeerConfig``: ``peer.py``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""Run ids and peer names: they become DHT keys and file names, so no slashes, spaces or leading dots."""


class _Section(BaseModel):
    # strict: "yes" is not a bool and "3" is not an int; extra keys are typos, not options.
    # No inf/nan: TOML has them, but an infinite rate or timeout only ever fails later, far from its cause.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _fits_the_machine(cls, value: Any) -> Any:
        # TOML passes both, but torch cannot take an int past 64 bits (seeds, sizes: it fails with
        # "Overflow when unpacking long" deep in the run) and no file name or DHT key can hold a NUL
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and not -2**63 <= item < 2**63:
                raise ValueError(f"{item} does not fit in 64 bits: use a smaller number")
            if isinstance(item, str) and "\x00" in item:
                raise ValueError(f"{item!r} contains a NUL character (\\x00): remove it")
        return value


class RunConfig(_Section):
    run_id: str = Field("diloco-tiny", pattern=NAME_PATTERN)
    """Name of the training run: the DHT namespace. Peers train together iff their run_id is equal."""
    seed: int = 0
    """Seed of the initial weights. Every peer of a swarm must use the same seed (the first round
    averages pseudo-gradients, which only makes sense if everybody started from the same weights)."""
    max_rounds: int = Field(0, ge=0)
    """Leave the swarm cleanly after this many outer rounds; 0 trains until stopped."""
    log_dir: str = "runs"
    """Directory for the peer's JSONL event log (one file per peer)."""
    threads: int = Field(0, ge=0, le=1024)
    """torch intra-op threads of the peer's compute thread (training, eval, outer steps); 0 keeps torch's default."""
    shutdown_grace: float = Field(30.0, gt=0)
    """Seconds a graceful leave (SIGTERM, Ctrl+C, or the end of ``max_rounds``) may take: finish the inner step,
    write the checkpoint, withdraw from the swarm, stop the DHT. Past it the daemon exits at once with code 1 and
    its children with it (the last checkpoint stays valid)."""


class ModelConfig(_Section):
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    vocab_size: int = Field(256, ge=2)
    hidden_size: int = Field(64, ge=8)
    num_layers: int = Field(2, ge=1)
    num_heads: int = Field(4, ge=1)
    num_kv_heads: int = Field(4, ge=1)
    ffn_hidden_size: int = Field(172, ge=1)
    max_seq_len: int = Field(128, ge=8)
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-5, gt=0)
    tie_embeddings: bool = True

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size={self.hidden_size} must be divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError("hidden_size / num_heads must be even (RoPE rotates pairs of channels)")
        return self


class DataConfig(_Section):
    source: Literal["stdlib", "files", "shards", "hf"] = "stdlib"
    """stdlib: the Python standard library's own source (on every machine, no download); files: local
    .txt/.jsonl/.parquet files in ``paths``, read whole; shards: a directory written by ``diloco-peer prepare``
    (``shards_dir``), read in place, any size; hf: a Hugging Face dataset, streamed (needs internet for the hub)."""
    paths: list[str] = []
    """For source="files": text files (each is one document), JSONL files (``text_field`` of each line) or
    Parquet files (the ``text_field`` column). For source="hf" with a local builder (``hf_dataset="json"``,
    ``"parquet"``, ``"text"``): its data files."""
    shards_dir: str = ""
    """For source="shards": the ``--out`` directory of ``diloco-peer prepare``. Its manifest names the tokenizer
    (``tokenizer`` is not used) and vocab size; its eval split is the eval split."""
    text_field: str = "text"
    hf_dataset: str = ""
    """For source="hf": ``name`` or ``name:config`` on the hub, e.g. ``allenai/c4:en``, or a local builder."""
    hf_split: str = "train"
    tokenizer: str = "bytes"
    """``bytes`` (UTF-8 bytes, vocab 256, needs no download), a local ``tokenizer.json`` (e.g. from ``diloco-peer
    prepare --train-tokenizer``; no internet), or a Hugging Face tokenizer name (needs internet)."""
    max_bytes: int = Field(4_000_000, ge=10_000)
    """Read at most this much text (stdlib/files); keeps start-up fast on small machines."""
    seq_len: int = Field(128, ge=8)
    eval_fraction: float = Field(0.02, gt=0, lt=0.5)
    """stdlib/files: share of the text held out for the eval loss: every (1/eval_fraction)-th 2 KB block, the
    same on every peer."""
    eval_tokens: int = Field(1_000_000, ge=16)
    """For source="hf": the eval split is the first this many tokens of the stream (the same on every peer; their
    documents are never trained on)."""
    buffer_tokens: int = Field(4_194_304, ge=32)
    """For source="hf": tokens of this peer's part of the stream held at a time; batches are random windows of it,
    and the next ones replace it once as many tokens were drawn as it holds."""
    eval_batches: int = Field(4, ge=1)
    num_shards: int = Field(64, ge=1)
    """The training data is dealt into this many shards; each peer reads one."""
    shard: int = Field(-1, ge=-1)
    """Which training shard this peer reads; -1 derives it from the peer id (stable per identity)."""
    seed: int = 0


class InnerConfig(_Section):
    """The inner optimizer: AdamW with linear warmup and cosine decay, run for H steps per round."""

    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: list[float] = Field([0.9, 0.95], min_length=2, max_length=2)
    """AdamW (beta1, beta2)."""
    warmup_steps: int = Field(20, ge=0)
    total_steps: int = Field(1000, ge=1)
    """Length of the cosine schedule in inner steps; after it the LR stays at ``min_lr_ratio * lr``."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)
    """Clip the gradient norm to this value; 0 disables clipping."""
    batch_size: int = Field(8, ge=1)
    """Sequences per micro-batch."""
    grad_accum: int = Field(1, ge=1)
    """Micro-batches per inner step (tokens per step = batch_size * grad_accum * seq_len)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 autocast on a GPU that supports it, fp32 otherwise."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$")


class OuterConfig(_Section):
    """The outer optimizer, applied every H inner steps to the averaged pseudo-gradient (weights on the host)."""

    inner_steps: int = Field(50, ge=1)
    """H: inner steps between two outer rounds."""
    lr: float = Field(0.7, gt=0)
    """Outer learning rate. Default 0.7 for blocking rounds (DiLoCo's), 0.35 for overlapped ones, where an outer
    step that lands a round late overshoots at 0.7: the best of the rates tried for eager rounds (measured:
    BENCHMARKS.md, "Overlap and model quality: eager rounds")."""
    momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    momentum_on: Literal["device", "host"] = "device"
    """Where the outer Nesterov momentum lives: ``device``, where the replica trains (a GPU peer's host then holds
    4 bytes per parameter less, and its GPU as much more; a CPU peer's is the host either way), or ``host`` (a GPU
    short of memory). Either way the outer step gives the same bits (``training/outer_optimizer.py``)."""
    overlap: Literal["blocking", "eager", "delayed"] = "blocking"
    """``blocking``: wait for each round's average before training on (DiLoCo, OpenDiLoCo).
    ``eager`` (the overlap to use): average round t's progress while round t+1 trains; round t+1 starts from
    the outer step this peer predicts from its own fresh pseudo-gradient (Kale et al. 2025, "eager updates"),
    and the true average replaces the prediction as soon as it arrives (``apply_on_arrival``; else at the end
    of round t+1). ``delayed``: the same overlap with the own progress kept as it is instead of a predicted step
    (DiLoCoX's one-step delay; for comparison). See rounds/schedule.py. The whole swarm must use the same mode."""
    apply_on_arrival: bool = True
    """Overlapped modes: as soon as round t's average has arrived (checked between inner steps of round t+1) and
    passed the round's checks, move the replica onto where it puts the outer weights, keeping the progress made
    since (``training.outer_optimizer.correct_on_arrival``). The outer step itself, the epoch and the state
    hash still change at the end of round t+1. ``false``: the stand-in lasts the whole round t+1. Each peer's
    own choice (the outer weights are the same either way). The sooner the average arrives, the closer eager rounds
    end to blocking ones (measured: BENCHMARKS.md, "The average applied as soon as it arrives")."""
    round_length: Literal["time", "steps"] = "time"
    """``time``: every peer trains as many inner steps as fit the time the swarm's fastest peer takes for a round of
    ``inner_steps`` (its round's other work included), so that fast and slow volunteers reach the round gate together
    and nobody waits (``rounds/pace.py``); a slower peer trains fewer steps, weighted by its tokens. ``steps``: every
    peer trains exactly ``inner_steps`` a round (the DiLoCo paper's setting; the swarm goes at its slowest peer's
    pace). The whole swarm should use the same."""
    contribution: Literal["tokens", "per_step"] = "tokens"
    """How a pseudo-gradient of fewer inner steps than ``inner_steps`` counts in the average, weighted by its tokens:
    ``tokens``, as it is; ``per_step``, per inner step times H (FedNova's normalization;
    ``training.outer_optimizer.contribution_scale``). The whole swarm must use the same."""

    @model_validator(mode="before")
    @classmethod
    def _overlapped_lr(cls, data: Any) -> Any:
        # an outer step that arrives a round late overshoots at blocking's lr (BENCHMARKS.md, the overlap study)
        if isinstance(data, dict) and "lr" not in data and data.get("overlap", "blocking") != "blocking":
            return {**data, "lr": 0.35}
        return data

    @model_validator(mode="after")
    def _check_nesterov(self) -> OuterConfig:
        if self.nesterov and self.momentum == 0:
            raise ValueError("nesterov=true needs momentum > 0 (set outer.nesterov=false for plain SGD)")
        return self


class AveragingConfig(_Section):
    """How a round finds its group and all-reduces (hivemind's DecentralizedAverager)."""

    compression: Literal["none", "fp16", "bf16", "int8", "int4", "topk"] = "none"
    """Pseudo-gradients on the wire: fp32 (none), fp16, bf16, int8 / int4 with one fp32 scale per 1024
    values, or ``topk``: sparse, the largest ``topk_density`` of every 4096 values in ``topk_bits`` bits, with error
    feedback (see averaging/compression.py, averaging/sparse.py). The reducers reply in the same encoding."""
    topk_density: float = Field(0.02, gt=0, le=1)
    """``topk``: the fraction of every chunk of 4096 values sent (a reducer's reply keeps as many of its average)."""
    topk_bits: Literal[2, 4] = 2
    """``topk``: bits per value sent: 2 (a sign and one of two magnitudes per chunk) or 4 (a sign and 8 steps)."""
    exchange_share: float = Field(0.0, ge=0, le=1)
    """``topk``: the share of a round this peer's exchange may take. Above 0, the peer measures its all-reduces and
    the rounds' length and lowers the density it asks for (down to a sixteenth of ``topk_density``) until its
    exchange fits; a group sends at the lowest density its members asked for (``averaging/link_fit.py``). Blocking
    rounds: the network time you accept (0.1: a tenth of the round); overlapped: up to the whole round (0.9). 0: always
    ``topk_density``."""
    error_feedback: bool = False
    """Carry what a lossy codec dropped from our pseudo-gradient into the next round's (nothing is lost for
    good, only delayed), through failed rounds and state syncs. ``topk`` always does (it drops most values on
    purpose)."""
    feedback_decay: float = Field(1.0, gt=0, le=1)
    """Error feedback: the share of the residual a round carries on. SparseLoCo's recipe for ``topk`` decays it by
    0.95 a round with a plain outer SGD step at lr 1 (``outer.lr=1 outer.momentum=0 outer.nesterov=false``): the
    decayed residual stands in for the outer momentum (docs/rounds.md, "Sparse pseudo-gradients")."""
    min_peers: int = Field(2, ge=1)
    """The first outer round waits until this many peers are live (every live record counts, ready or not), so that
    fast peers do not drift apart with solo steps while the swarm is still starting."""
    first_round_timeout: float = Field(300.0, gt=0)
    """Seconds the first round waits for ``min_peers``; then it goes on with whoever is ready."""
    ready_timeout: float = Field(30.0, ge=0)
    """Wait budget per round: seconds to wait for peers still training in this epoch before the round
    starts with those that are ready (a straggler must not hold the swarm hostage)."""
    matchmaking_time: float = Field(3.0, gt=0)
    """Seconds a group leader gathers followers (hivemind ``min_matchmaking_time``), longer in proportion beyond 4
    expected peers: one more such window per 4 more (``averaging/averager.py`` ``PEERS_PER_WINDOW``); with
    ``start_when_complete`` the most it waits for the live peers the round gate saw."""
    start_when_complete: bool = True
    """A group that holds every peer the round gate saw alive starts its all-reduce at once instead of at the end
    of ``matchmaking_time``: blocking rounds spend much more of their time training, and a loopback round's
    all-reduce takes a fraction of the window (measured: BENCHMARKS.md, "Hiding the network", "What the numbers
    say", "Blocking rounds need not idle"). Alive counts every live record, trusted or not: a group filled up by
    the trusted ones alone turned an honest peer away when a distrusted liar came to average too (same place).
    False: every group gathers for the window."""
    hand_in_slower_than: float = Field(4.0, ge=0)
    """A peer whose inner steps take over this many times the median of the others' at its epoch hands its
    pseudo-gradient in to a fast peer, which averages it in with its own, instead of joining the all-reduce, where
    every member waits for its slow parts (``averaging/hand_in.py``); it gets the round's average from that peer.
    Blocking rounds bounded by time only (``outer.round_length = "time"``, ``outer.overlap = "blocking"``), not with
    ``topk`` (the proxy's sparse encoding would drop most of what was handed in, kept by nobody's error feedback);
    0: never."""
    request_timeout: float = Field(2.0, gt=0)
    allreduce_timeout: float = Field(60.0, gt=0)
    """Seconds after which an all-reduce is abandoned: the round then takes the state the other peers end it with
    (``rounds/healing.py``), and steps alone only if they have none."""
    heartbeat: float = Field(5.0, gt=0)
    """Seconds at most between two stores of this peer's progress record in the DHT (a round's own publications count;
    records expire after 3 heartbeats)."""
    bandwidth: float = Field(0.0, ge=0)
    """Declared bandwidth in MB/s: the share of the all-reduce this peer reduces; 0 = equal shares. It can
    lower a slow peer's share, never raise one above the group's median peer's; in groups of 3 or more, each share
    is also scaled down by how much slower than the median member that peer steps (robust_aggregation.py)."""
    part_size_bytes: int = Field(2**19, ge=4096, le=2**26, multiple_of=1024)
    """The all-reduce sends the pseudo-gradient in parts of up to this many bytes (after compression). A reducer
    answers a part once every sender's copy of it arrived, so a round ends one part (per sender) after the last
    byte: smaller parts shorten that tail, a little nearer a TCP stream's rate on a slow link than hivemind's
    default (kept as ours; measured: BENCHMARKS.md, "Hiding the network", "What the numbers say", "All-reduce
    efficiency")."""
    sync_timeout: float = Field(30.0, gt=0)
    """State sync: seconds to wait for each chunk of a state download before trying another donor."""
    sync_attempts: int = Field(3, ge=1)
    """State sync: donors to try (one after the other) before giving up until the next round."""
    log_rounds: int = Field(4, ge=0, le=64)
    """Rounds whose updates a peer keeps while a peer downloads its state (and for two rounds after), so that a peer
    that many rounds behind catches up with them instead of the whole state (``averaging/round_log.py``): a joiner
    whose download outlasts rounds. In memory within ``serve_copy_in_memory_mb`` in all, else in files beside the
    served copies. 0: none kept (a peer behind always downloads the state)."""
    serve_copy_in_memory_mb: float = Field(64.0, ge=0)
    """Serving our state: an outer step during a peer's download first copies what that download has not read
    yet, so that it still gets one whole state. Up to this many MB the copy is kept in memory; a bigger one is
    written to ``{run.log_dir}/{peer name}.serving/`` and read back a tensor at a time (a llama-150m state is
    1.2 GB: never copied in RAM)."""
    max_update_ratio: float = Field(10.0, ge=0)
    """Refuse an averaged pseudo-gradient whose norm exceeds this many times our own (a weighted mean of
    honest pseudo-gradients is never longer than the longest of them); non-finite values are always
    refused. The round then counts as failed and the peer re-syncs. 0 disables the norm check.
    The same bound applies to every part a reducer receives (against the group's median part's norm, in groups of
    three or more; ours in a pair) and every averaged part it returns: an offending sender is dropped from the
    round, an offending reducer's parts are not used."""
    max_weight_ratio: float = Field(10.0, ge=0)
    """Refuse a sender claiming more than this many times the tokens of the group's median member for the round
    (ours in a pair; its weight in the mean is the tokens it claims); 0 disables the check. Raise it for pairs of
    very unequal batch sizes or speeds."""
    aggregation: Literal["mean", "robust"] = "robust"
    """``robust`` (the default): a reducer drops parts pointing against the group (cosine with the coordinate-wise
    median below ``min_cosine``, groups of 3+, parts of 1024 values or more), clips the rest to the median norm
    and the weights to the median weight, so that no single member can move the average far. Its cost on honest
    rounds is within noise. ``mean``, the token-weighted mean, takes in any update under ``max_update_ratio``: a
    forked client sending its pseudo-gradient negated and scaled up wrecked the honest peers' eval loss and was
    never banned, where ``robust`` banned it within two rounds (measured: BENCHMARKS.md, "Robust aggregation: what
    it costs and what it stops"). ``join`` warns when it runs ``mean``."""
    min_cosine: float = Field(-0.3, ge=-1.0, le=1.0)
    """Robust aggregation: the lowest cosine similarity a part may have with the group's coordinate-wise
    median (groups of 3 or more; two cannot tell which of them is off), beyond noise: a cosine within 3 / sqrt(the
    part's values) of it is not below it (``robust_aggregation.below``). A member judges the averages it gets back
    against its own part by the same bound. Below zero: with a data shard each, an honest peer's part of a span
    can point against the group's, and at 0 it was refused and its member's round ended partial; sign flips sit
    far below (measured: BENCHMARKS.md, "Many peers"). A part kept above it is still clipped to the median norm
    and weight."""
    ban_cosine: float = Field(-0.5, ge=-1.0, le=1.0)
    """Robust aggregation: a part a reducer refuses for its direction counts towards a ban (``ban_after``) only if
    its cosine is below this as well; between ``ban_cosine`` and ``min_cosine`` it is refused, not counted. A
    refusal keeps the part out of the average; a ban shuts a peer out of our groups and downloads for
    ``ban_seconds``, with no way back for an honest peer that was off for a while. Sign flips measured far below
    the default, honest parts in clean runs above zero, and an honest peer after a relay loss slightly below it,
    which two offenses then banned (measured: BENCHMARKS.md, "Robust aggregation: what it costs and what it
    stops"). Set it to ``min_cosine`` to count every such refusal. (A member refusing a reducer's averages by
    direction, judged against its own part alone, counts it only below this too, and only if another reducer's
    averages passed: ``allreduce.py``.)"""
    ban_after: int = Field(2, ge=1)
    """Refused contributions (any kind) within ``ban_seconds`` after which a peer is banned: it cannot join
    our groups, be in a group we average in, or download our state."""
    ban_seconds: float = Field(600.0, gt=0)
    """How long a ban lasts, and the window in which offenses count towards one."""

    @model_validator(mode="before")
    @classmethod
    def _sparse_feeds_back(cls, data: Any) -> Any:
        # what topk leaves behind (98% of a pseudo-gradient by default) would otherwise be lost for good
        if isinstance(data, dict) and data.get("compression") == "topk":
            if data.get("error_feedback") is False:
                raise ValueError("compression='topk' sends a few values of each pseudo-gradient and keeps the rest "
                                 "for later rounds: it needs error_feedback=true (or leave error_feedback unset)")
            return {**data, "error_feedback": True}
        return data

    @model_validator(mode="after")
    def _check_timeouts(self) -> AveragingConfig:
        if self.request_timeout >= self.matchmaking_time:
            raise ValueError(
                f"request_timeout={self.request_timeout} must be smaller than matchmaking_time="
                f"{self.matchmaking_time} (hivemind matchmaking can deadlock otherwise)"
            )
        return self
