"""Writing safetensors files tensor by tensor.

``safetensors.torch.save_file`` wants every tensor of a file at once in host memory. The
writer here takes the header up front (names, dtypes, shapes are known before any data)
and then streams each tensor: a CPU tensor is written straight from its memory, a device
tensor through two bounded host chunks, the device-to-host copy of one chunk overlapping
the file write of the other (``staging_plan``). It checksums what it writes in chunks
(``checksum``) and fsyncs. The files are ordinary safetensors files (the header padded to
8 bytes, as safetensors itself does), read back with ``safetensors.safe_open``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from .. import accel
from ..hostmem import StagingBuffer, staging_buffer
from .checksum import Checksummer, ChunkSums
from .header import TensorEntry, header_bytes

__all__ = ["ChunkOp", "SafetensorsWriter", "staging_plan"]

_CHUNK_BYTES = 64 * 2**20
"""Device tensors are copied to the host and written in chunks of this many bytes."""

_SLOTS = 2
"""Host chunks a device tensor is staged through: one is copied into while the other is
written."""


class ChunkOp(NamedTuple):
    """One step of writing a device tensor's bytes through host chunks.

    Attributes:
        kind: ``"copy"``: copy the tensor's bytes ``[start, stop)`` into host slot ``slot``
            (asynchronously); ``"write"``: wait until that copy has completed, then write
            the slot's first ``stop - start`` bytes to the file.
        chunk: the chunk's index (chunk ``k`` holds bytes ``[k * chunk_bytes, ...)``).
        start: first byte of the chunk in the tensor.
        stop: one past its last byte.
        slot: the host chunk it goes through (``chunk % slots``).
    """

    kind: str
    chunk: int
    start: int
    stop: int
    slot: int


def staging_plan(nbytes: int, chunk_bytes: int, slots: int = _SLOTS) -> list[ChunkOp]:
    """The order in which ``nbytes`` bytes are copied into ``slots`` host chunks of
    ``chunk_bytes`` and written to the file.

    Chunks are written in order, each once, so the file gets the bytes in order. Copies
    run ahead of the writes by up to ``slots - 1`` chunks: chunk ``k + 1``'s copy is issued
    before chunk ``k`` is written (it overlaps the write), and chunk ``k + slots``'s copy
    into the same slot only after chunk ``k``'s write returned (the slot is free again).
    The last chunk is short when ``chunk_bytes`` does not divide ``nbytes``; no bytes, no
    steps.
    """
    if nbytes < 0 or chunk_bytes < 1 or slots < 1:
        raise ValueError(
            f"staging_plan needs nbytes >= 0, chunk_bytes >= 1 and slots >= 1; got "
            f"nbytes={nbytes}, chunk_bytes={chunk_bytes}, slots={slots}"
        )
    chunks = -(-nbytes // chunk_bytes)
    ops: list[ChunkOp] = []
    copied = 0
    for k in range(chunks):
        while copied < min(chunks, k + slots):
            start = copied * chunk_bytes
            ops.append(
                ChunkOp("copy", copied, start, min(nbytes, start + chunk_bytes), copied % slots)
            )
            copied += 1
        start = k * chunk_bytes
        ops.append(ChunkOp("write", k, start, min(nbytes, start + chunk_bytes), k % slots))
    return ops


def _staged(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is written through host chunks (it is not in host memory)."""
    return tensor.device.type != "cpu"


def _streamed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s chunks are copied on a side stream with events: on an
    accelerator with streams (a test seam: CPU tests run the streamed path with the
    device seam's streams stubbed)."""
    return accel.is_accelerator(tensor.device) and accel.has_streams(tensor.device)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


class SafetensorsWriter:
    """Write one safetensors file, tensor by tensor, in the order of ``entries``.

    Use as a context manager; ``write`` every entry in order; leaving the block without an
    error checks that all were written, flushes and fsyncs. ``checksum`` holds the chunked
    checksums of each written tensor (when ``checksums``).

    Args:
        path: the file to create (it must not exist).
        entries: every tensor of the file, in the order they will be written.
        metadata: string-to-string metadata stored in the header.
        checksums: checksum every tensor's bytes in chunks (``checksum.Checksummer``).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: Sequence[TensorEntry],
        metadata: dict[str, str] | None = None,
        *,
        checksums: bool = True,
    ) -> None:
        self.path = Path(path)
        self.entries = list(entries)
        self.checksums = checksums
        self.checksum: dict[str, ChunkSums | None] = {}
        self._prefix = header_bytes(self.path, self.entries, metadata)
        self.nbytes = len(self._prefix) + sum(e.nbytes for e in self.entries)
        self._next = 0
        self._file = None
        self._staging: list[StagingBuffer] = []
        self._pinned = False  # every slot is page-locked: copies into them are asynchronous

    def __enter__(self) -> SafetensorsWriter:
        self._file = open(self.path, "xb")
        self._file.write(self._prefix)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor (named ``name``; dtype and shape as declared)."""
        assert self._file is not None, "use SafetensorsWriter as a context manager"
        if self._next >= len(self.entries) or self.entries[self._next].name != name:
            expected = self.entries[self._next].name if self._next < len(self.entries) else None
            raise ValueError(f"{self.path}: wrote {name!r}, expected {expected!r} next")
        entry = self.entries[self._next]
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise ValueError(
                f"{self.path}: tensor {name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
                f"declared {entry.dtype} {entry.shape}"
            )
        tensor = tensor.detach()
        summer = Checksummer() if self.checksums else None
        if not _staged(tensor):
            view = _byte_view(tensor.contiguous())
            self._file.write(view)
            if summer is not None:
                summer.update(view)
        else:
            self._write_staged(tensor, summer)
        self.checksum[name] = summer.result() if summer is not None else None
        self._next += 1

    def _staging_slots(self, pin: bool, device: torch.device) -> list[torch.Tensor]:
        """The host chunks device tensors go through: allocated at the first device tensor
        (pinned for ``device`` when ``pin`` and the system allows), as large as the largest
        entry needs, kept until the file is closed."""
        if not self._staging:
            largest = max(e.nbytes for e in self.entries)
            size = max(1, min(_CHUNK_BYTES, largest))
            count = _SLOTS if largest > size else 1
            self._staging = [staging_buffer(size, pin=pin, device=device) for _ in range(count)]
            self._pinned = pin and all(b.pinned for b in self._staging)
        return [b.data for b in self._staging]

    def _write_staged(self, tensor: torch.Tensor, summer: Checksummer | None) -> None:
        """Write a device tensor's bytes through the host chunks, feeding them to
        ``summer``.

        On an accelerator the copies run on a side stream that first waits for the current stream
        (which produced the tensor); each chunk's copy is non-blocking into pinned memory and
        records an event, and the chunk is written only after its event completed, while
        the next chunk's copy runs (``staging_plan``). The side stream is synchronized
        before returning, also on an error, so no copy still reads the tensor or writes a
        chunk afterwards.
        """
        assert self._file is not None
        data = tensor.reshape(-1).contiguous().view(torch.uint8)
        if data.numel() == 0:
            return
        streamed = _streamed(data)
        slots = self._staging_slots(streamed, data.device)
        ops = staging_plan(data.numel(), slots[0].numel(), len(slots))
        if not streamed:  # not on an accelerator: synchronous copies through the chunks
            for op in ops:
                host = slots[op.slot][: op.stop - op.start]
                if op.kind == "copy":
                    host.copy_(data[op.start : op.stop])
                else:
                    self._emit(host, summer)
            return
        with accel.on_device(data.device):
            side = accel.new_stream(data.device)
            side.wait_stream(accel.current_stream(data.device))
            events = [accel.new_event(data.device) for _ in slots]
            try:
                for op in ops:
                    host = slots[op.slot][: op.stop - op.start]
                    if op.kind == "copy":
                        with accel.use_stream(side):
                            host.copy_(data[op.start : op.stop], non_blocking=self._pinned)
                        events[op.slot].record(side)
                    else:
                        events[op.slot].synchronize()
                        self._emit(host, summer)
            finally:
                side.synchronize()

    def _emit(self, host: torch.Tensor, summer: Checksummer | None) -> None:
        """Write a host chunk to the file and feed it to ``summer``."""
        assert self._file is not None
        view = _byte_view(host)
        self._file.write(view)
        if summer is not None:
            summer.update(view)

    def __exit__(self, exc_type, exc, tb) -> None:
        assert self._file is not None
        try:
            if exc_type is None:
                if self._next != len(self.entries):
                    missing = [e.name for e in self.entries[self._next :]]
                    raise ValueError(f"{self.path}: tensors {missing} were never written")
                self._file.flush()
                os.fsync(self._file.fileno())
        finally:
            self._file.close()
            self._file = None
            self._release_staging()

    def _release_staging(self) -> None:
        """Drop the host chunks, unpinning what was pinned for them and nothing else of
        the process (no copy uses them any more: ``_write_staged`` synchronized)."""
        staging, self._staging = self._staging, []
        self._pinned = False
        for buffer in staging:
            buffer.release()
