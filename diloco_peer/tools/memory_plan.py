"""What a peer holds in memory, buffer by buffer: the one table behind ``diloco-peer plan`` and ``join``'s check.

    shape = ModelShape.from_config(cfg.model)          # built on the meta device: nothing is allocated
    table = buffers(cfg, shape)                        # one Buffer per allocation, with the code that owns it
    need = peaks(table, overlapped=False)              # {CPU: bytes, GPU_HOST: bytes, GPU: bytes}

Every row names the function that allocates it (``owner``). When a change to the code adds, removes or
shrinks a copy of the model, change its row here: nothing else in ``plan`` knows where bytes go.
``tests/test_plan.py`` holds the activation formulas to the tensors autograd really saves, and the codec
sizes to what the codecs really encode; the rest is checked by reading the owners, and the whole against
measured peers (``RUNTIME_HOST_BYTES`` below; the numbers are in docs/cli.md, section plan).

Three columns: the host memory of a peer that trains on its CPU (``CPU``), and of one that trains on a
GPU, host (``GPU_HOST``) and device (``GPU``). A row belongs to a *phase*; ``concurrent`` says which
phases can be live at the same moment, and a process's peak is what it always holds plus the worst such
moment. A peer is two processes that matter: the peer's own and hivemind's averager process. Memory a
process frees stays with it (glibc keeps freed heap for reuse), so the averager's high-water mark is still
held while the peer process trains: the peak of the peer is the sum of the two processes' peaks.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass

from ..averaging import sparse
from ..config import AveragingConfig, ConfigError, DataConfig, ModelConfig, PeerConfig

CPU, GPU_HOST, GPU = "cpu", "gpu_host", "gpu"
PEER, AVERAGER = "peer", "averager"
"""The processes: the peer's own (training, rounds, checkpoints) and hivemind's averager, forked from it."""
COLUMNS = {CPU: "CPU peer, RAM", GPU_HOST: "GPU peer, RAM", GPU: "GPU peer, GPU"}
FP32 = 4

RUNTIME_HOST_BYTES = 520 * 2**20
"""Python, torch and hivemind in the peer process, its DHT and averager processes, p2pd, torch's shared-memory
manager: the proportional set size (shared pages counted once) of a tiny-cpu peer's process tree at its peak,
measured on Linux with torch on the CPU and 2 peers averaging, less the rows of this table for it (docs/cli.md,
section plan)."""
CUDA_HOST_RUNTIME_BYTES = 1135 * 2**20
"""What training on a GPU adds on the host beyond ``RUNTIME_HOST_BYTES``: the CUDA driver's and torch's CUDA
libraries' memory in the peer process, and their share in the processes around it. Measured on a GPU peer
(``bench/scale.py --set inner.device=cuda``): what its process tree held outside shared memory at its peak, less
this table's rows for it (BENCHMARKS.md, "Memory per parameter at llama-150m")."""
CUDA_CONTEXT_BYTES = 600 * 2**20
"""The CUDA context and kernels torch loads on the GPU before the first tensor (~0.5-0.7 GiB, by GPU)."""
LOSS_TRANSIENT_PER_VOCAB = 8
"""Bytes per token and vocabulary entry live around the loss: the fp32 logits' gradient while the saved
log-softmax is still held (``F.cross_entropy`` in ``LlamaModel.forward``)."""

PHASES = {
    "resident": "always held",
    "start": "building the replica, before training",
    "step": "forward + backward of a micro-batch",
    "optimizer": "the inner AdamW step",
    "allreduce": "averaging a round",
    "conclude": "applying an overlapped round's average",
    "checkpoint": "a checkpoint being written (background thread)",
    "serve": "another peer downloading our state",
    "serve_change": "our outer step (or a state sync) while a peer downloads our state",
    "sync": "downloading the swarm's state",
}


def concurrent(overlapped: bool) -> list[tuple[str, ...]]:
    """The sets of phases that can be live at the same moment. Checkpoint writes and state serving run in
    threads of their own, beside training; a blocking round's all-reduce waits for no training, an
    overlapped one runs during the next round's steps."""
    beside = ("checkpoint", "serve")
    train = ("allreduce",) if overlapped else ()
    # the outer step comes while the round's buffers are held (they are released after it); a download of our
    # state in flight then gets a copy of what it has not read yet
    step = ("allreduce", "serve", "serve_change", *(("conclude",) if overlapped else ()))
    return [("start",), ("step", *beside, *train), ("optimizer", *beside, *train), step, ("sync", "checkpoint")]


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a model, read from one built on the meta device: no memory is allocated, and one layer is
    built, then counted ``num_layers`` times (the layers are alike), so that any size plans at once."""

    tensors: tuple[tuple[int, int], ...]
    """(values, count): the parameter tensors by size, each of a layer's with count ``num_layers``, the others 1:
    what the averager, the codecs (blocks of a tensor) and state sync see."""
    linear_weights: int
    """Values in every ``nn.Linear`` weight, a tied lm_head included: what bf16 autocast copies."""

    @property
    def parameters(self) -> int:
        """Distinct parameters (a tied lm_head counts once), in values: what is averaged and synced."""
        return sum(numel * count for numel, count in self.tensors)

    @property
    def count(self) -> int:
        return sum(count for _, count in self.tensors)

    @property
    def largest(self) -> int:
        return max(numel for numel, _ in self.tensors)

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> ModelShape:
        import torch

        from ..training.model import meta_model

        try:
            model = meta_model(cfg.model_copy(update={"num_layers": 1}))
        except (RuntimeError, OverflowError) as e:  # more values than torch can count
            raise ConfigError(f"the [model] section is too large to build ({type(e).__name__}): make it "
                              f"smaller") from None
        layers = cfg.num_layers
        runs = [(p.numel(), layers if name.startswith("blocks.") else 1) for name, p in model.named_parameters()]
        linear = sum(m.weight.numel() * (layers if name.startswith("blocks.") else 1)
                     for name, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        return cls(tuple(runs), linear)


@dataclass(frozen=True)
class Buffer:
    """One allocation of a running peer: bytes per column (absent: none there)."""

    name: str
    owner: str
    """The function that allocates it: where to look when the number is in doubt."""
    phase: str
    bytes: dict[str, int]
    process: str = PEER
    shared: bool = False
    """In shared memory (/dev/shm, whose size a container caps: ``shared_peaks``), on the host."""


def activation_bytes(cfg: PeerConfig, autocast: bool) -> int:
    """Bytes autograd saves for backward over one micro-batch (``inner.batch_size x data.seq_len`` tokens),
    plus the loss's transient (``LOSS_TRANSIENT_PER_VOCAB``), as ``LlamaModel.forward`` computes.

    Per token and layer, fp32: the two RMSNorms keep input, 1/rms, normed and output (3h + 1 each); SDPA
    keeps q, k, v (k and v after the GQA repeat), its output (4h) and one logsumexp per head; o_proj its
    reshaped input (h); SwiGLU gate, silu(gate), up and their product (4f). Under bf16 autocast the
    projections' outputs are bf16 and each projection keeps a bf16 copy of its input (5 per layer), while
    the norms stay fp32. After the layers: the final norm, lm_head's input, the log-softmax (fp32, V per
    token) and the token ids. Checked against the tensors autograd saves (tests/test_plan.py).
    """
    m = cfg.model
    h = m.hidden_size
    f = m.ffn_hidden_size
    heads = m.num_heads
    vocab = m.vocab_size
    tokens = cfg.inner.batch_size * cfg.data.seq_len
    if autocast:
        per_layer = 36 * h + 8 * f + 4 * heads + 8
        rest = 10 * h + 4 * vocab + 20
    else:
        per_layer = 44 * h + 16 * f + 4 * heads + 8
        rest = 12 * h + 4 * vocab + 20
    return tokens * (m.num_layers * per_layer + rest + LOSS_TRANSIENT_PER_VOCAB * vocab)


def data_bytes(data: DataConfig, vocab_size: int) -> int:
    """Token ids a peer's ``Corpus`` holds in memory. stdlib / files: this shard and the eval split, read whole
    as int64 (at most ``max_bytes`` of text; a byte is a token of the bytes tokenizer, ~4 make one subword
    token); hf: the stream's buffer, twice while it is refilled, and its eval head (``streaming.TokenStream``);
    shards: memory-mapped files, in the page cache, which the kernel can take back (not counted)."""
    if data.source == "shards":
        return 0
    width = 1 if vocab_size <= 256 else 2 if vocab_size <= 2**16 else 4  # ``tokenizer.Tokenizer.dtype``
    if data.source == "hf":
        return width * (2 * data.buffer_tokens + data.eval_tokens)
    tokens = data.max_bytes * (1 / data.num_shards + data.eval_fraction)
    return int(8 * tokens / (1 if data.tokenizer == "bytes" else 4))


def codec_bytes(name: str, tensors: typing.Iterable[tuple[int, int]], density: float = 0.02, bits: int = 2) -> int:
    """Bytes of one pseudo-gradient in codec ``name`` (``averaging/compression.py``), given (values, count) per run
    of tensors (``ModelShape.tensors``): fp32 4 per value, fp16 and bf16 2, int8 1 and int4 one half (two per
    byte), both plus one fp32 scale per block of 1024 values of a tensor; ``topk`` at ``density`` and ``bits``, its
    most (``averaging/sparse.py``: a kept value that is zero is not sent)."""
    total = 0
    for n, count in tensors:
        blocks = math.ceil(n / 1024)
        if name == "topk":
            total += count * sparse.nbytes(n, sparse.kept(n, density), bits)
            continue
        total += count * {"none": 4 * n, "fp16": 2 * n, "bf16": 2 * n, "int8": n + 4 * blocks,
                          "int4": (n + 1) // 2 + 4 * blocks}[name]
    return total


CODECS = typing.get_args(AveragingConfig.model_fields["compression"].annotation)
"""The codec names ``averaging.compression`` takes (the schema's, so that plan never misses a new one)."""


def _row(name: str, owner: str, phase: str, process: str = PEER, shared: bool = False, **columns: int) -> Buffer:
    return Buffer(name, owner, phase, {column: size for column, size in columns.items() if size}, process, shared)


def _training_rows(cfg: PeerConfig, shape: ModelShape) -> list[Buffer]:
    """The replica, its gradients and inner optimizer, activations, and the data (``training/``)."""
    p, largest = shape.parameters * FP32, shape.largest * FP32
    gpu_autocast = cfg.inner.precision != "fp32"  # precision auto takes bf16 on a GPU that has it
    cpu_autocast = cfg.inner.precision == "bf16"
    data = cfg.data
    return [
        _row("fp32 weights (replica)", "training/model.py build_model; Trainer.__init__ moves it", "resident",
             shared=cfg.lends_replica(CPU), cpu=p, gpu=p),
        _row("replica built on the CPU first", "daemon.PeerDaemon._start: build_model, then Trainer.__init__ .to()",
             "start", gpu_host=p),
        _row("AdamW moments (exp_avg, exp_avg_sq)", "training/trainer.py Trainer.__init__ (torch.optim.AdamW)",
             "resident", cpu=2 * p, gpu=2 * p),
        _row("gradients", "training/trainer.py Trainer.train_steps: loss.backward()", "step", cpu=p, gpu=p),
        _row("gradients (during the AdamW step)", "training/trainer.py Trainer.train_steps: optimizer.step()",
             "optimizer", cpu=p, gpu=p),
        # on the CPU AdamW runs tensor by tensor (no foreach/fused): its temporaries are one tensor's size
        _row("AdamW temporaries (CPU: per tensor)", "torch.optim.AdamW (single-tensor on CPU, fused on CUDA)",
             "optimizer", cpu=2 * largest),
        _row(f"activations ({cfg.inner.batch_size}x{data.seq_len} tokens per micro-batch)",
             "training/model.py LlamaModel.forward (autograd's saved tensors)", "step",
             cpu=activation_bytes(cfg, cpu_autocast), gpu=activation_bytes(cfg, gpu_autocast)),
        _row("bf16 copies of linear weights (autocast)", "torch.autocast in Trainer.train_steps", "step",
             cpu=2 * shape.linear_weights if cpu_autocast else 0, gpu=2 * shape.linear_weights if gpu_autocast else 0),
        _row("token ids held (training, eval)", "training/data.py Corpus.__init__", "resident",
             cpu=data_bytes(data, cfg.model.vocab_size), gpu_host=data_bytes(data, cfg.model.vocab_size)),
        _row("runtime (Python, torch, hivemind processes, p2pd)", "measured (RUNTIME_HOST_BYTES)",
             "resident", cpu=RUNTIME_HOST_BYTES, gpu_host=RUNTIME_HOST_BYTES),
        _row("CUDA runtime on the host (driver, torch's CUDA libraries)", "measured (CUDA_HOST_RUNTIME_BYTES)",
             "resident", gpu_host=CUDA_HOST_RUNTIME_BYTES),
        _row("CUDA context", "torch (CUDA_CONTEXT_BYTES)", "resident", gpu=CUDA_CONTEXT_BYTES),
    ]


def _round_rows(cfg: PeerConfig, shape: ModelShape) -> list[Buffer]:
    """The outer optimizer, the pseudo-gradient and the round's result in the peer process
    (``training/outer_optimizer.py``, ``rounds/outer_rounds.py``, ``averaging/averager.py``), on the host for both kinds
    of peer. The averager's two buffers are shared memory (counted once, here) that gives its pages back after
    the outer step (``RoundAverager.release``): they count during a round only."""
    p = shape.parameters * FP32
    overlapped = cfg.outer.overlap != "blocking"
    feedback = cfg.averaging.error_feedback
    on_gpu = cfg.outer.momentum_on == "device"
    rows = [
        _row("outer weights (fp32, shared memory)", "training/outer_optimizer.py OuterOptimizer.__init__ "
             "(flat_tensors)", "resident", shared=True, cpu=p, gpu_host=p),
        _row("outer Nesterov momentum (shared memory; on a GPU peer's GPU with outer.momentum_on=device)",
             "training/outer_optimizer.py OuterOptimizer.__init__ (momentum_device)", "resident", shared=True, cpu=p,
             gpu_host=0 if on_gpu else p, gpu=p if on_gpu else 0),
        _row("round: pseudo-gradient sent (averager's input buffer)", "averaging/averager.py RoundAverager.__init__; "
             "OuterOptimizer.pseudo_gradient writes it in place (a CPU peer's blocking rounds: the replica's memory)",
             "allreduce", shared=True, cpu=0 if cfg.lends_replica(CPU) else p, gpu_host=p),
        _row("round: the average (averager's output buffer, handed out as it is; on a GPU peer's blocking rounds "
             "written over the pseudo-gradient sent)",
             "averaging/averager.py RoundAverager.__init__; allreduce.py ExactAllReduceRunner._register",
             "allreduce", shared=True, cpu=p, gpu_host=0 if cfg.averages_in_place("cuda") else p),
    ]
    if feedback:
        rows += [_row("error-feedback residual", "averaging/compression.py ErrorFeedback.roundtrip", "resident",
                      cpu=p, gpu_host=p),
                 _row("error feedback: pseudo-gradient, old residual, corrected", "OuterOptimizer.pseudo_gradient "
                      "(new tensors), ErrorFeedback.roundtrip", "allreduce", cpu=3 * p, gpu_host=3 * p)]
    if overlapped:
        rows += [_row("replica at the round's start (overlap)", "outer_optimizer.replica_copy",
                      "resident", cpu=p, gpu_host=p),
                 _row("unsent progress, eager step, eval copy", "outer_optimizer.progress_since, "
                      "OuterOptimizer.lookahead, evaluate_outer", "conclude", cpu=3 * p, gpu_host=3 * p)]
    return rows


def _state_rows(cfg: PeerConfig, shape: ModelShape) -> list[Buffer]:
    """Checkpoints and state sync in the peer process (``state/``). No copy of the state is taken to write or
    serve it: what they read stays unchanged until they are past it (``OuterOptimizer.before_change``)."""
    p, largest = shape.parameters * FP32, shape.largest * FP32
    # a bigger copy goes to a file (the page cache), read back a tensor at a time by the averager process
    serve_copy = min(2 * p, int(cfg.averaging.serve_copy_in_memory_mb * 2**20))
    # the rounds kept for a peer that is behind: in memory if they all fit the same limit, else in files
    logged = p * cfg.averaging.log_rounds
    logged = logged if logged <= cfg.averaging.serve_copy_in_memory_mb * 2**20 else 0
    return [
        # written from the live tensors; a GPU peer's AdamW state reaches the file through the host, a tensor at a time
        _row("checkpoint: one GPU tensor on its way to the file", "state/checkpoint.py write_atomically "
             "(torch's serializer)", "checkpoint", gpu_host=largest),
        # a GPU peer's momentum is written to a file for each download (the page cache holds it), a tensor at a time
        _row("state served: a GPU momentum tensor on its way to the download's copy", "state/state_sync.py "
             "StateSync._current_state; averaging/state_transfer.py SpilledTensors.write", "serve",
             gpu_host=largest if cfg.outer.momentum_on == "device" else 0),
        # served from the outer state's shared memory; only an outer step during a download copies anything
        _row("state served: the unread rest, copied when our state changes during a download (in memory up to "
             "averaging.serve_copy_in_memory_mb, else to a file)",
             "averaging/state_transfer.py ServedStates.freeze (OuterOptimizer.before_change)", "serve_change",
             shared=True, cpu=serve_copy, gpu_host=serve_copy),
        _row("round log: the updates of the last averaging.log_rounds rounds, kept while a peer downloads our state "
             "(in memory if they fit averaging.serve_copy_in_memory_mb, else files)",
             "averaging/round_log.py RoundLog.record (OuterOptimizer.on_step)", "serve_change", shared=True,
             cpu=logged, gpu_host=logged),
        # one shared-memory buffer for the whole sync's weights (a broken download resumes into it), which the
        # averager process fills; checked, copied into our state in place, then freed (not kept by either process's
        # heap); the momentum half goes to a file of the spill directory (state_files.staging_for)
        _row("state downloaded: weights (shared memory; the momentum in a file), checked, then copied in",
             "state/state_sync.py StateSync.sync; averaging/state_transfer.py download; OuterOptimizer.load_state",
             "sync", shared=True, cpu=p + largest, gpu_host=p + largest),
    ]


def _averager_rows(cfg: PeerConfig, shape: ModelShape, peers: int) -> list[Buffer]:
    """hivemind's averager process (``averaging/pseudo_gradient_averager.py``): its all-reduce, serving and
    download buffers. It is forked before the model is built (``daemon.PeerDaemon._build``), so it holds no
    copy-on-write pages of the replica or the outer state; it reads our pseudo-gradient from the shared input
    buffer and writes each averaged part straight into the shared output buffer (both counted above)."""
    largest = shape.largest * FP32
    # parts in flight: hivemind encodes one part ahead per peer it sends to, and decodes one ahead per reply
    wire = 2 * cfg.averaging.part_size_bytes * peers
    return [
        _row("averager: parts in flight, one part's average", "averaging/allreduce.py ExactAllReduceRunner, "
             "compression.WireCompression; hivemind TensorPartContainer", "allreduce", AVERAGER,
             cpu=wire + largest, gpu_host=wire + largest),
        _row("averager: serving, one tensor read back (after a step, from the file) and serialised",
             "averaging/state_transfer.py serve, SpilledTensors", "serve", AVERAGER,
             cpu=3 * largest, gpu_host=3 * largest),
        _row("averager: state download, a tensor being assembled", "averaging/state_transfer.py download",
             "sync", AVERAGER, cpu=2 * largest, gpu_host=2 * largest),
    ]


def buffers(cfg: PeerConfig, shape: ModelShape, peers: int = 8) -> list[Buffer]:
    """Every buffer a peer running ``cfg`` allocates, sized for ``shape`` and all-reduce groups of ``peers``."""
    return [*_training_rows(cfg, shape), *_round_rows(cfg, shape), *_state_rows(cfg, shape),
            *_averager_rows(cfg, shape, peers)]


def peaks(table: list[Buffer], overlapped: bool) -> dict[str, int]:
    """Per column, summed over the processes: a process's resident rows plus its largest sum over the phases
    that can be live together."""
    result = dict.fromkeys(COLUMNS, 0)
    for process in {row.process for row in table}:
        for column in COLUMNS:
            by_phase: dict[str, int] = {}
            for row in table:
                if row.process == process:
                    by_phase[row.phase] = by_phase.get(row.phase, 0) + row.bytes.get(column, 0)
            worst = max(sum(by_phase.get(phase, 0) for phase in together) for together in concurrent(overlapped))
            result[column] += by_phase.get("resident", 0) + worst
    return result


def shared_peaks(table: list[Buffer], overlapped: bool) -> dict[str, int]:
    """``peaks`` of the rows in shared memory (/dev/shm) alone, for the host columns: what /dev/shm must have free.
    A container's is 64 MB unless given more, and torch fails to allocate beyond it ("No space left on device")."""
    shared = peaks([row for row in table if row.shared], overlapped)
    return {column: shared[column] for column in (CPU, GPU_HOST)}
