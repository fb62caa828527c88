"""``diloco-peer plan``: what a config needs on this machine, before joining; and ``join``'s check that it fits.

    diloco-peer plan --config llama-150m                       # memory, bytes per round, fits or not
    diloco-peer plan --config llama-1b --link 20mbit --peers 8 --device cuda --json

The memory comes from ``memory_plan.py`` (the model built on the meta device: a 1B config costs nothing to plan),
the free memory from the machine (``psutil``, ``torch.cuda.mem_get_info``, and /dev/shm's free space: the outer
state and the round's buffers live in shared memory, which a container caps at 64 MB by default). Bytes per round
are those of each codec of ``averaging/compression.py`` in hivemind's butterfly all-reduce: in a group of K peers
each sends its K-1 foreign parts of the pseudo-gradient to their reducers and returns the average of its own part to
the K-1 others, so 2 (K-1) / K of the encoded pseudo-gradient leaves (and arrives at) each peer per round. Times are
at the link's rate, a lower bound (the all-reduce runs somewhat below a TCP stream's rate: BENCHMARKS.md, "Hiding
the network", "What the numbers say", "All-reduce efficiency").
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, PeerConfig
from . import memory_plan
from .memory_plan import CODECS, COLUMNS, CPU, GPU, GPU_HOST, ModelShape, buffers, codec_bytes, peaks, shared_peaks

SHM = "/dev/shm"
_LINK = re.compile(r"(\d+(?:\.\d+)?)(k|m|g)?bit", re.IGNORECASE)
_PREFIX = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_link(text: str) -> float:
    """``100mbit`` -> 1e8 bits per second each way (tc's units: bit, kbit, mbit, gbit)."""
    match = _LINK.fullmatch(text.strip())
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"{text!r} is not a link speed: give bits per second as tc does, e.g. 100mbit, 20mbit, "
                          f"1gbit")
    return float(match.group(1)) * _PREFIX[(match.group(2) or "").lower() or None]


@dataclass(frozen=True)
class Machine:
    """What this machine has free now."""

    ram_available: int
    ram_total: int
    gpu_name: str = ""
    """The CUDA GPU a peer would train on ("" if none)."""
    gpu_free: int = 0
    gpu_total: int = 0
    shm_free: int | None = None
    """Free bytes in /dev/shm, where torch puts shared memory (None: no /dev/shm, not checked)."""

    @classmethod
    def probe(cls, device: str = "cuda") -> Machine:
        """RAM from psutil; a CUDA GPU's free memory from the driver (``device``: ``cuda`` or ``cuda:N``)."""
        import psutil
        import torch

        memory = psutil.virtual_memory()
        shm = shutil.disk_usage(SHM).free if Path(SHM).is_dir() else None
        if not device.startswith("cuda") or not torch.cuda.is_available():
            return cls(memory.available, memory.total, shm_free=shm)
        index = torch.device(device).index or 0
        free, total = torch.cuda.mem_get_info(index)
        return cls(memory.available, memory.total, torch.cuda.get_device_name(index), free, total, shm)


def peer_device(cfg: PeerConfig, requested: str | None = None) -> str:
    """``cpu``, ``cuda[:N]`` or ``mps``: where a peer with ``cfg`` trains (``requested`` overrides
    ``inner.device``; ``auto`` is a CUDA GPU when there is one, as ``trainer.pick_device`` decides)."""
    name = requested or cfg.inner.device
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def shortfall(need: dict, machine: Machine, device: str) -> str:
    """What is short for a peer on ``device`` ("" if it fits): ``need`` is peak bytes per column, with the shared
    part of the host's under "shared" (``_need``)."""
    if device == "cpu":
        ram = need[CPU]
    elif device == "mps":  # Apple's GPU shares the RAM: the replica's side comes out of it too
        ram = need[GPU_HOST] + need[GPU]
    else:
        ram = need[GPU_HOST]
        if not machine.gpu_name:
            return f"a GPU peer needs a CUDA GPU with {_size(need[GPU])} free, and this machine has none"
        # probing the free memory created this process's CUDA context: the free memory is what is left beside it
        if need[GPU] - memory_plan.CUDA_CONTEXT_BYTES > machine.gpu_free:
            return (f"a GPU peer needs {_size(need[GPU])} of GPU memory, {_size(machine.gpu_free)} is free on "
                    f"{machine.gpu_name}")
    kind = "a CPU peer" if device == "cpu" else "a GPU peer"
    if ram > machine.ram_available:
        return f"{kind} needs {_size(ram)} of RAM, {_size(machine.ram_available)} is available"
    shared = need.get("shared", {}).get(CPU if device == "cpu" else GPU_HOST, 0)
    if machine.shm_free is not None and shared > machine.shm_free:
        return (f"{kind} needs {_size(shared)} of shared memory, {_size(machine.shm_free)} is free in {SHM} (a "
                f"container gets 64 MB unless given more: docker run --shm-size, compose shm_size)")
    return ""


def _need(cfg: PeerConfig, shape: ModelShape, peers: int = 8) -> dict:
    """Peak bytes per column, and under "shared" the part of the host's in shared memory."""
    table = buffers(cfg, shape, peers)
    overlapped = cfg.outer.overlap != "blocking"
    return {**peaks(table, overlapped), "shared": shared_peaks(table, overlapped)}


def smaller_batch(cfg: PeerConfig, shape: ModelShape, machine: Machine, device: str) -> str:
    """The ``--set`` items of the largest ``inner.batch_size`` below the configured one that would fit (the same
    tokens per inner step through ``inner.grad_accum`` where it divides), or "" if none would: activations
    grow with the micro-batch, the rest does not."""
    inner = cfg.inner
    batch = inner.batch_size // 2
    while batch >= 1:
        tokens = inner.batch_size * inner.grad_accum
        accum = tokens // batch if tokens % batch == 0 else inner.grad_accum
        smaller = cfg.model_copy(update={"inner": inner.model_copy(update={"batch_size": batch, "grad_accum": accum})})
        if not shortfall(_need(smaller, shape), machine, device):
            return f"--set inner.batch_size={batch}" + (f" --set inner.grad_accum={accum}" if accum != inner.grad_accum
                                                         else "")
        batch //= 2
    return ""


def make_plan(cfg: PeerConfig, name: str, *, link: float, peers: int, device: str, machine: Machine) -> dict:
    """The whole plan as plain data (what ``--json`` prints)."""
    shape = ModelShape.from_config(cfg.model)
    table = buffers(cfg, shape, peers)
    need = _need(cfg, shape, peers)
    short = shortfall(need, machine, device)
    share = 2 * (peers - 1) / peers  # of the encoded pseudo-gradient, each way, per peer and round
    rounds = []
    for codec in CODECS:
        payload = codec_bytes(codec, shape.tensors, cfg.averaging.topk_density, cfg.averaging.topk_bits)
        rounds.append({"codec": codec, "configured": codec == cfg.averaging.compression, "payload_bytes": payload,
                       "sent_bytes": round(share * payload), "received_bytes": round(share * payload),
                       "seconds": share * payload * 8 / link})
    state_bytes = 2 * shape.parameters * memory_plan.FP32  # outer weights + momentum, fp32 (state_sync.py)
    checkpoint_bytes = 4 * shape.parameters * memory_plan.FP32  # outer, momentum, AdamW's two (checkpoint.py)
    folder = Path(cfg.checkpoint.dir or ".").resolve()
    while not folder.exists():
        folder = folder.parent
    return {
        "config": name, "run_id": cfg.run.run_id, "parameters": shape.parameters, "tensors": shape.count,
        "micro_batch_tokens": cfg.inner.batch_size * cfg.data.seq_len, "device": device,
        "buffers": [{"name": row.name, "owner": row.owner, "phase": row.phase, "process": row.process,
                     **{column: row.bytes.get(column, 0) for column in COLUMNS}} for row in table],
        "phases": memory_plan.PHASES, "peak": need,
        "bytes_per_parameter": {column: need[column] / shape.parameters for column in COLUMNS},
        "machine": machine.__dict__, "short": short,
        "fits_with": smaller_batch(cfg, shape, machine, device) if short else "",
        "link_bits_per_second": link, "peers": peers, "inner_steps": cfg.outer.inner_steps, "rounds": rounds,
        "state_sync_bytes": state_bytes, "state_sync_seconds": state_bytes * 8 / link,
        "checkpoint_bytes": checkpoint_bytes, "checkpoints_kept": cfg.checkpoint.keep if cfg.checkpoint.dir else 0,
        "disk_free": shutil.disk_usage(folder).free, "disk_folder": str(folder),
    }


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _memory_lines(plan: dict) -> list[str]:
    width = max(len(row["name"]) for row in plan["buffers"]) + 2
    lines = [f"{'memory':<{width}}{'phase':<12}" + "".join(f"{title:>15}" for title in COLUMNS.values())]
    for row in plan["buffers"]:
        cells = "".join(f"{_size(row[column]) if row[column] else '-':>15}" for column in COLUMNS)
        lines.append(f"{row['name']:<{width}}{row['phase']:<12}{cells}")
    lines.append(f"{'peak (the phases that can be live together)':<{width + 12}}"
                 + "".join(f"{_size(plan['peak'][column]):>15}" for column in COLUMNS))
    lines.append(f"{'bytes per parameter at the peak':<{width + 12}}"
                 + "".join(f"{plan['bytes_per_parameter'][column]:>15.1f}" for column in COLUMNS))
    shared = plan["peak"]["shared"]
    lines.append(f"{'of the peak, in shared memory (' + SHM + ')':<{width + 12}}"
                 + "".join(f"{_size(shared[column]) if column in shared else '-':>15}" for column in COLUMNS))
    return lines


def _verdict(plan: dict) -> list[str]:
    m = plan["machine"]
    gpu = f"{m['gpu_name']}, {_size(m['gpu_free'])} of {_size(m['gpu_total'])} free" if m["gpu_name"] else "no CUDA GPU"
    kind = "a CPU peer" if plan["device"] == "cpu" else f"a GPU peer ({plan['device']})"
    verdict = f"does NOT fit: {plan['short']}" if plan["short"] else "fits"
    shm = f"{_size(m['shm_free'])} free in {SHM}" if m["shm_free"] is not None else f"no {SHM}"
    lines = [f"this machine: {_size(m['ram_available'])} of {_size(m['ram_total'])} RAM available, {shm}; {gpu}",
             f"{kind}: {verdict}"]
    if plan["fits_with"]:
        lines.append(f"  it fits with a smaller micro-batch: {plan['fits_with']}")
    return lines


def _network_lines(plan: dict) -> list[str]:
    link = f"{plan['link_bits_per_second'] / 1e6:g} Mbit/s"
    lines = [f"each round (every {plan['inner_steps']} inner steps): butterfly all-reduce in a group of "
             f"{plan['peers']}, {link} each way (the times are lower bounds)",
             f"{'codec':<8}{'pseudo-gradient':>16}{'sent per peer':>15}{'received':>12}{'time at link':>14}"]
    for r in plan["rounds"]:
        mark = "  (configured)" if r["configured"] else ""
        lines.append(f"{r['codec']:<8}{_size(r['payload_bytes']):>16}{_size(r['sent_bytes']):>15}"
                     f"{_size(r['received_bytes']):>12}{_seconds(r['seconds']):>14}{mark}")
    lines.append(f"joining (state sync): {_size(plan['state_sync_bytes'])} to download, "
                 f"{_seconds(plan['state_sync_seconds'])} at {link}")
    if plan["checkpoints_kept"]:
        kept = plan["checkpoints_kept"]
        lines.append(f"checkpoints: {_size(plan['checkpoint_bytes'])} each, {kept} kept = "
                     f"{_size(kept * plan['checkpoint_bytes'])} ({_size(plan['disk_free'])} free at "
                     f"{plan['disk_folder']})")
    return lines


def format_plan(plan: dict) -> str:
    """The plan as the text ``diloco-peer plan`` prints."""
    head = (f"{plan['config']} (run {plan['run_id']}): {plan['parameters'] / 1e6:,.1f}M parameters in "
            f"{plan['tensors']} tensors; micro-batch of {plan['micro_batch_tokens']:,} tokens")
    return "\n".join([head, "", *_memory_lines(plan), "", *_verdict(plan), "", *_network_lines(plan)])


def check_fits(cfg: PeerConfig, name: str) -> None:
    """``join``'s check: raise a one-line ``ConfigError`` naming what is short if a peer with ``cfg`` cannot
    fit this machine's free memory (``--no-fit-check`` skips it)."""
    device = peer_device(cfg)
    shape = ModelShape.from_config(cfg.model)
    machine = Machine.probe(device)
    short = shortfall(_need(cfg, shape), machine, device)
    if short:
        fix = smaller_batch(cfg, shape, machine, device)
        raise ConfigError(f"config {name} does not fit this machine: {short}" + (f"; it fits with {fix}" if fix else "")
                          + f" (diloco-peer plan --config {name} shows where it goes; --no-fit-check joins anyway)")


def run_plan(args: argparse.Namespace, cfg: PeerConfig) -> int:
    """``diloco-peer plan``: print the plan (text, or JSON with ``--json``); 0 whether it fits or not."""
    from ..config import DEFAULT_CONFIG

    device = peer_device(cfg, args.device)
    plan = make_plan(cfg, args.config or DEFAULT_CONFIG, link=args.link, peers=args.peers, device=device,
                     machine=Machine.probe(device))
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0
