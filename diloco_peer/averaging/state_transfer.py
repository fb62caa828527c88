"""A peer's outer state crossing the network without a copy of it in memory: served from where it lies,
downloaded into one buffer.

Serving (the donor). The outer weights and momentum live in shared memory (``OuterOptimizer(shared=True)``):
the averager process, which answers the download, maps the very same pages (torch hands a shared tensor to
another process as a file descriptor) and streams them tensor by tensor, one serialized tensor at a time. What
it sends must be *one* state, though, and the host may take an outer step (or a state sync) while a slow
download is halfway. So the host registers each download (a slot of ``ServedStates.table``, in shared memory:
active, next tensor to read, frozen from, generation) and, before it changes the state, copies the tensors that
download has not read yet (``ServedStates.freeze``) and hands them over; the averager process checks, after
serializing each live tensor, whether the state was frozen meanwhile and then serializes the copy instead (a
seqlock: the host sets "frozen" before it changes anything). Memory: nothing while the state stands still; when a
step falls into a download, the unread rest of the state once, in memory if it is small, else written to a file
that the averager process reads back a tensor at a time (``ServedStates.spill_to``): a GB-scale state is never
copied in RAM, the page cache holds it (the kernel may evict it).

Downloading (the newcomer). The averager process assembles each tensor from its chunks and copies it into one
shared-memory buffer shaped like the state (untouched pages cost nothing): the host then receives that buffer
as it is (no copy through the pipe) and checks it before copying it into its own state. 8 bytes per parameter
for the length of a sync. The donor ends its stream with an end mark and the downloader hangs up: a donor that
hung up first could lose the stream's last tensors (``p2pd_internals.until_the_caller_hangs_up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path

import torch
from hivemind.compression import CompressionInfo
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from ..swarm.p2pd_internals import until_the_caller_hangs_up
from ..training.model import param_sha256, state_digest
from ..training.outer_optimizer import flat_tensors
from . import hivemind_internals as internals
from .compression import deserialize
from .state_files import SpilledTensor, SpilledTensors

logger = logging.getLogger(__name__)

MAX_SERVES = 16
"""Downloads of our state served at once; one more is turned away (the downloader tries another donor)."""
ACTIVE, NEXT, FROZEN, GENERATION = range(4)
FREEZE_WAIT = 30.0
"""Seconds the averager process waits for the frozen copies the host sends when the state changed mid-download."""
STALE = 600.0
"""Seconds without progress after which the host forgets a download (its averager-side stream is gone)."""
DIGESTS = "tensor_sha256"
"""The metadata key of the digest of each tensor a donor serves (``model.state_digest``)."""
PROGRESS_EVERY = 10.0
"""Seconds between two progress lines of a long state download (a GB-scale state takes minutes)."""


def serving_table() -> torch.Tensor:
    """The slots of the downloads being served, in shared memory (made before the averager process forks)."""
    return torch.zeros(MAX_SERVES, 4, dtype=torch.int64).share_memory_()


class ServedStates:
    """The host's side of serving: a slot per download, and copies of the unread rest before the state changes.

    :param averager: the running ``PseudoGradientAverager`` (its ``serving`` table; its process gets the copies)
    """

    def __init__(self, averager):
        self.averager = averager
        self.table = averager.serving
        self._served: dict[int, list] = {}  # slot -> [generation, tensors, last NEXT seen, when it last moved]
        self.opened: tuple[int, int] | None = None
        """The (slot, generation) ``open`` gave last (the averager's ``get_current_state`` passes it on)."""
        self.spill_dir: Path | None = None
        self.in_memory_limit = 0
        self._copies = 0  # copies written for a download by ``readable`` (their files' names)

    def spill_to(self, directory: Path, in_memory_limit: int) -> None:
        """Copies for a frozen download over ``in_memory_limit`` bytes go to a file in ``directory`` instead of
        memory (the directory is made when first needed; a peer's downloads stage their momentum there too,
        ``state_files.staging_for``, the round log its files and a replay of it its result, ``round_log.py``). Files
        an earlier process of this peer left there (killed mid-download, either way) are removed."""
        if directory.is_dir():
            for leftover in [*directory.glob("serve-*.bin"), *directory.glob("download-*.bin"),
                             *directory.glob("round-*.bin"), *directory.glob("replay-*.bin")]:
                leftover.unlink(missing_ok=True)
        self.spill_dir = directory
        self.in_memory_limit = in_memory_limit

    def readable(self, tensors: list[torch.Tensor]) -> list:
        """``tensors`` as the averager process can serve them (call it with the state locked): as they are if they
        lie in the host's shared memory (or, with no ``spill_dir``, on the host at all: torch's pickler moves them
        there), else a copy for one download. A GPU peer's momentum goes to a file in ``spill_dir`` a tensor at a
        time (the page cache holds it, the serving averager process removes it when the download ends), or into
        shared memory if that file cannot be written."""
        if all(t.device.type == "cpu" and (t.is_shared() or self.spill_dir is None) for t in tensors):
            return tensors
        self._copies += 1
        path = self.spill_dir / f"serve-{os.getpid()}-copy-{self._copies}.bin" if self.spill_dir else None
        copies = self._copy_out(tensors, path, "a copy of our state for one download")
        return copies.items() if isinstance(copies, SpilledTensors) else copies

    def open(self, tensors: list[torch.Tensor]) -> tuple[int, int]:
        """Register a download of ``tensors`` (call it with the state locked): its (slot, generation)."""
        self._prune()
        free = [slot for slot in range(MAX_SERVES) if not self.table[slot, ACTIVE]]
        if not free:
            raise RuntimeError(f"already serving {MAX_SERVES} downloads of our state")
        slot = free[0]
        generation = int(self.table[slot, GENERATION]) + 1
        self.table[slot] = torch.tensor([1, 0, -1, generation])
        self._served[slot] = [generation, list(tensors), 0, time.monotonic()]
        self.opened = slot, generation
        return self.opened

    def freeze(self) -> None:
        """Before the state changes: every download in flight gets a copy of the tensors it has not read yet."""
        self._prune()
        for slot, (generation, tensors, _, _) in self._served.items():
            if int(self.table[slot, FROZEN]) >= 0:
                continue  # frozen already: it reads copies
            start = int(self.table[slot, NEXT])
            # (copies written for this download, which come last, stay as they are)
            rest = [t for t in tensors[start:] if not isinstance(t, SpilledTensor)]
            if rest:
                size = sum(t.numel() * t.element_size() for t in rest)
                big = self.spill_dir is not None and size > self.in_memory_limit
                path = self.spill_dir / f"serve-{os.getpid()}-{slot}-{generation}.bin" if big else None
                copies = self._copy_out(rest, path, "our state changed during a download; what it had not read yet")
                internals.send_to_averager_process(self.averager, "_freeze_serve", slot, generation, start, copies)
            self.table[slot, FROZEN] = start  # only now may the state change (the averager process checks this)

    def _copy_out(self, tensors: list[torch.Tensor], path: Path | None, what: str) -> SpilledTensors | list:
        """A copy of ``tensors`` for a download: written to ``path``, read back a tensor at a time (``_spill``), or
        in shared memory with no path, or if writing fails."""
        size = sum(t.numel() * t.element_size() for t in tensors)
        spilled = self._spill(tensors, size, path, what) if path is not None else None
        if spilled is not None:
            return spilled
        copies = flat_tensors([t.shape for t in tensors], shared=True)
        for copy, tensor in zip(copies, tensors):
            copy.copy_(tensor)
        return copies

    def _spill(self, tensors: list[torch.Tensor], size: int, path: Path,
               what: str = "our state changed during a download; what it had not read yet") -> SpilledTensors | None:
        """``tensors`` (``size`` bytes) written to ``path``; None if that failed (e.g. a full disk: the caller copies
        them in memory)."""
        started = time.perf_counter()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            spilled = SpilledTensors.write(path, tensors)
        except OSError as e:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
            logger.warning(f"state served: {what}, {size / 2**20:.0f} MB, could not be written to {path} ({e}); "
                           f"keeping it in memory")
            return None
        logger.info(f"state served: {what}, {size / 2**20:.0f} MB, went to {path} in "
                    f"{time.perf_counter() - started:.1f}s")
        return spilled

    def _prune(self) -> None:
        now = time.monotonic()
        for slot, entry in list(self._served.items()):
            generation, _, seen, moved = entry
            if not self.table[slot, ACTIVE] or int(self.table[slot, GENERATION]) != generation:
                del self._served[slot]
            elif int(self.table[slot, NEXT]) != seen:
                entry[2] = int(self.table[slot, NEXT])
                entry[3] = now
            elif now - moved > STALE:  # its stream is gone without a word (e.g. the averager process restarted)
                self.table[slot, ACTIVE] = 0
                del self._served[slot]


def _drop_frozen(averager, slot: int) -> None:
    dropped = averager.frozen_serves.pop(slot, None)
    if dropped is not None and isinstance(dropped[2], SpilledTensors):
        dropped[2].remove()


async def serve(averager, metadata: bytes, tensors: list[torch.Tensor], served: tuple[int, int] | None,
                first: int = 0):
    """In the averager process: the ``DownloadData`` messages of one download, tensor by tensor from ``first`` on,
    in hivemind's format (the first chunk of each tensor carries its dtype; the first message the metadata).
    ``served``: the (slot, generation) ``ServedStates.open`` gave it, or None for tensors that do not change."""
    table = averager.serving if served is not None else torch.full((1, 4), -1, dtype=torch.int64)
    slot, generation = served if served is not None else (0, -1)
    try:
        compress = averager.state_compression.compress
        if served is not None:
            table[slot, NEXT] = first  # (a step of the host's copies nothing before it)
        for index, tensor in enumerate(tensors[first:], first):
            if index - first == averager.faults.serve_break_after:  # fault injection: a stream that breaks off
                return
            await averager.faults.stall_serving(index - first)  # fault injection: a donor that goes silent
            copied = isinstance(tensor, SpilledTensor)  # written for this download: it never changes
            tensor = tensor.load() if copied else tensor
            info = CompressionInfo.from_tensor(tensor, key=index)
            serialized = None
            if copied:
                serialized = compress(tensor, info, allow_inplace=False)
                table[slot, NEXT] = index + 1
            elif int(table[slot, FROZEN]) < 0:
                serialized = compress(tensor, info, allow_inplace=False)  # a copy of one tensor, from the live one
                if int(table[slot, FROZEN]) < 0:  # still unchanged after the copy: it holds the state we serve
                    table[slot, NEXT] = index + 1
                else:
                    serialized = None
            if serialized is None:  # the host changed (or is changing) the state: read its copy instead
                start, copies = await _frozen(averager, slot, generation)
                serialized = compress(copies[index - start], info, allow_inplace=False)
            for part in split_for_streaming(serialized):
                yield averaging_pb2.DownloadData(tensor_part=part, **({"metadata": metadata} if metadata else {}))
                metadata = b""
    finally:
        if served is not None and int(table[slot, GENERATION]) == generation:
            table[slot, ACTIVE] = 0
            _drop_frozen(averager, slot)
        for file in {id(t.file): t.file for t in tensors if isinstance(t, SpilledTensor)}.values():
            file.remove()
    yield averaging_pb2.DownloadData()  # the end mark: the downloader knows it has everything, and hangs up
    await until_the_caller_hangs_up()


def tensor_messages(averager, tensors, metadata: dict):
    """The ``DownloadData`` messages of a stream of ``tensors`` (any iterable; each compressed with the averager's state
    codec, none by default, and split into chunks) after ``metadata`` (in the first message), and the end mark the
    caller hangs up on: logged rounds (``round_log.serve``), a hand-in and its average (``hand_in.py``)."""
    header = averager.serializer.dumps(metadata)
    compress = averager.state_compression.compress
    for index, tensor in enumerate(tensors):
        serialized = compress(tensor, CompressionInfo.from_tensor(tensor, key=index), allow_inplace=False)
        for part in split_for_streaming(serialized):
            yield averaging_pb2.DownloadData(tensor_part=part, **({"metadata": header} if header else {}))
            header = b""
    if header:
        yield averaging_pb2.DownloadData(metadata=header)
    yield averaging_pb2.DownloadData()  # the end mark


def _is_end_mark(message: averaging_pb2.DownloadData) -> bool:
    return not message.metadata and not message.HasField("tensor_part")


async def _frozen(averager, slot: int, generation: int) -> tuple[int, list[torch.Tensor]]:
    deadline = time.monotonic() + FREEZE_WAIT
    while True:
        found = averager.frozen_serves.get(slot)
        if found is not None and found[0] == generation:
            return found[1], found[2]
        if time.monotonic() > deadline:
            raise RuntimeError("the state changed during the download and its copy never came")
        await asyncio.sleep(0.01)


def keep_frozen(averager, slot: int, generation: int, start: int, copies: list[torch.Tensor]) -> None:
    """In the averager process: the host's copies of download ``slot``'s unread tensors (from ``start`` on)."""
    if int(averager.serving[slot, GENERATION]) == generation and averager.serving[slot, ACTIVE]:
        _drop_frozen(averager, slot)
        averager.frozen_serves[slot] = (generation, start, copies)
    elif isinstance(copies, SpilledTensors):  # that download ended meanwhile
        copies.remove()


async def download(averager, donor: str, timeout: float, into: list[torch.Tensor] | None = None,
                   resume: torch.Tensor | None = None, expected: str = "", rounds: dict | None = None
                   ) -> tuple[dict, list[torch.Tensor], int]:
    """In the averager process: ``donor``'s state as (metadata, tensors, bytes received); the tensors that have our
    state's shapes lie in one shared-memory buffer, ``into`` if given (items of a file: ``state_files.staging_for``).
    ``timeout`` bounds the wait for each chunk. ``resume`` (a shared int64 counter, with ``into`` and ``expected``):
    the donor is asked for the tensors from ``resume[0]`` on only (the earlier ones are in ``into`` already,
    checked); each tensor that arrives matching the digest the donor lists for it moves the counter on, if that
    list hashes to ``expected`` (the state the swarm publishes, ``model.state_digest``). A download broken off then
    resumes there, from another donor. ``rounds``: the donor's logged rounds after our state instead (the request
    of ``round_log.replay``), into ``into`` (fp32; the donor may send them as fp16 or bf16, widened exactly)."""
    start = int(resume[0]) if resume is not None and into is not None else 0
    stream = await asyncio.wait_for(_request(averager, donor, start, rounds), timeout)
    widen = (torch.float32,) if rounds is None else (torch.float32, torch.float16, torch.bfloat16)
    staging = into if into is not None else flat_tensors([t.shape for t in averager.inputs] * 2, shared=True)
    arrived = _Arrivals(staging, start, resume, widen)
    metadata = None
    parts = []
    received = 0
    total = sum(t.numel() * t.element_size() for t in staging[start:])
    started = time.monotonic()
    bound = "at most " if rounds is not None else ""  # (logged rounds may come as fp16: half)
    reported = started
    messages = aiter_with_timeout(stream, timeout=timeout)
    try:
        async for message in messages:
            if _is_end_mark(message):  # (a stream that ends without it broke off: state_sync counts the tensors)
                break
            received += message.ByteSize()
            if time.monotonic() - reported > PROGRESS_EVERY:
                reported = time.monotonic()
                logger.info(f"state download from {donor[-8:]}: {received / 1e6:,.0f} of {bound}{total / 1e6:,.0f} MB "
                            f"({received / 1e6 / (reported - started):.1f} MB/s)")
            if message.metadata:
                metadata = averager.serializer.loads(message.metadata)
                resuming = resume is not None and into is not None
                arrived.digests = _listed(metadata, expected, len(staging)) if resuming else None
            if not message.HasField("tensor_part"):
                continue  # metadata alone (logged rounds: none to send)
            if message.tensor_part.dtype and parts:  # a dtype marks the first chunk of the next tensor
                arrived.add(parts)
                parts = []
            parts.append(message.tensor_part)
    finally:  # we hang up first, the donor waits for it (p2pd_internals.until_the_caller_hangs_up)
        await messages.aclose()
        await stream.aclose()
    if parts:
        arrived.add(parts)
    if metadata is None:
        raise RuntimeError("the donor declined to share its state")
    return metadata, arrived.tensors, received


class _Arrivals:
    """The tensors of one download, as they arrive: each one of our state's shape (and a dtype in ``widen``) goes
    into its place in ``staging``, and one that matches the digest the donor lists for it moves ``resume`` on.

    :param start: the tensors before it are in ``staging`` already (a resumed download)
    """

    def __init__(self, staging: list[torch.Tensor], start: int, resume: torch.Tensor | None,
                 widen: tuple[torch.dtype, ...]):
        self.staging = staging
        self.resume = resume
        self.widen = widen
        self.tensors = list(staging[:start])
        self.digests: list[str] | None = None
        """The digest of each tensor as the donor lists it, if that list hashes to the state expected (``_listed``);
        None: no tensor moves ``resume`` on."""

    def add(self, parts) -> None:
        """The next tensor, all its chunks in (``parts``)."""
        if len(parts) != max(parts[0].chunks, 1):  # a stream that broke off: say so, not "invalid shape"
            raise RuntimeError(f"the state download broke off: tensor {len(self.tensors)} came in "
                               f"{len(parts)} of {parts[0].chunks} chunks")
        tensor = deserialize(combine_from_streaming(parts))
        index = len(self.tensors)
        staging = self.staging
        if index < len(staging) and tensor.shape == staging[index].shape and tensor.dtype in self.widen:
            digests = self.digests
            listed = digests is not None and int(self.resume[0]) == index and param_sha256([tensor]) == digests[index]
            tensor = staging[index].copy_(tensor)  # (a file's item: written there, and the item comes back)
            if listed:
                self.resume[0] = index + 1
        self.tensors.append(tensor)  # not our state's shape: kept as it came, for the checks to refuse clearly


def _request(averager, donor: str, start: int, rounds: dict | None):
    """The call that opens ``download``'s stream: the whole state, its rest from ``start``, or logged ``rounds``."""
    stub = averager.get_stub(internals.p2p_of(averager), PeerID.from_base58(donor), namespace=averager.prefix)
    if rounds is not None:
        return stub.rpc_download_rounds(averaging_pb2.DownloadData(metadata=averager.serializer.dumps(rounds)))
    if start:
        request = averaging_pb2.DownloadData(metadata=averager.serializer.dumps({"start": start}))
        return stub.rpc_download_state_from(request)
    return stub.rpc_download_state(averaging_pb2.DownloadRequest())


def _listed(metadata, expected: str, count: int) -> list[str] | None:
    """The digest of each tensor the donor lists in ``metadata``, if the list hashes to ``expected``; else None."""
    listed = metadata.get(DIGESTS) if isinstance(metadata, dict) else None
    if not expected or not isinstance(listed, list) or len(listed) != count or \
            not all(isinstance(d, str) for d in listed) or type(metadata.get("epoch")) is not int:
        return None
    return listed if state_digest(listed, metadata["epoch"], metadata.get("inner_step")) == expected else None
