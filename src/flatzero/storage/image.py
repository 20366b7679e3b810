"""Safetensors files laid out in host memory, then written without the page cache.

An asynchronous save (``checkpoint.async_save``) copies what a rank writes into one reusable
host buffer. The copy is laid out as the files' data regions: per file, its tensors' bytes
in file order, starting on a page boundary of the buffer (``FileImage``). The header is
padded (with spaces, as safetensors pads) so that the data starts on a page boundary of the
file too. Then the whole file can be written with ``O_DIRECT``: the disk reads the buffer by
DMA, and no CPU copies the bytes into the page cache (the kernel's copy and its page
allocation): a background write does not take the cores training steps use (measured in
docs/benchmarks.md, "Writing without the page cache"). Where ``O_DIRECT`` is missing or
refused (another OS, tmpfs on older kernels, some network file systems) the same writes go
through the page cache.

The checksums of the chunks of every tensor are computed from the buffer (``checksums``)
(``crc32c`` releases the GIL for large buffers, so the training thread runs meanwhile).

Buffer bytes of a file: its data bytes rounded up to the page (``padded``); the header
lives in a separate page-aligned scratch while it is written. ``flatzero plan`` shows the
same formula (``plan/memory_model.py``).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .checksum import Checksummer, ChunkSums
from .header import TensorEntry, header_bytes

__all__ = ["PAGE", "FileImage", "lay_out", "padded", "write_image"]

PAGE = 4096
"""Alignment of file offsets, lengths and buffer addresses for ``O_DIRECT`` (the page size;
at least the logical block size of common disks)."""

DIRECT = True
"""Write with ``O_DIRECT`` where the system allows (False: through the page cache, as the
benchmark's ``async_buffered`` compares)."""

_WRITE_BYTES = 64 * 2**20
"""Bytes per ``write`` system call (the GIL is released during each)."""


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of ``PAGE``."""
    return -(-nbytes // PAGE) * PAGE


@dataclass(frozen=True)
class FileImage:
    """One file of a snapshot: its header and its data in host memory.

    Attributes:
        name: the file's name in the checkpoint directory.
        entries: its tensors, in file order.
        prefix: the header's length and the header, padded to a multiple of ``PAGE``.
        data: ``padded(nbytes)`` bytes (uint8) of the snapshot buffer, starting on a page
            boundary: the tensors' bytes back to back, then padding.
        nbytes: the data bytes.
    """

    name: str
    entries: tuple[TensorEntry, ...]
    prefix: bytes
    data: torch.Tensor
    nbytes: int

    @property
    def file_bytes(self) -> int:
        """The size of the file written."""
        return len(self.prefix) + self.nbytes


def lay_out(
    name: str,
    tensors: Sequence[tuple[str, torch.Tensor]],
    metadata: dict[str, str] | None,
    data: torch.Tensor,
) -> tuple[FileImage, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The file ``name``'s image in ``data`` (page-aligned uint8 host memory of at least
    ``padded(sum of the tensors' bytes)``) and the copies that fill it: per tensor with
    bytes, its part of ``data`` and its bytes (a flat uint8 view of the tensor, any device).
    Nothing is copied here.

    Raises:
        TypeError / ValueError: a dtype safetensors lacks, a name twice.
    """
    entries = tuple(TensorEntry(n, t.dtype, tuple(t.shape)) for n, t in tensors)
    prefix = header_bytes(name, entries, metadata, align=PAGE)
    copies = []
    offset = 0
    for (_, tensor), entry in zip(tensors, entries, strict=True):
        n = entry.nbytes
        if n:
            source = tensor.detach().reshape(-1).view(torch.uint8)
            copies.append((data[offset : offset + n], source))
        offset += n
    return FileImage(name, entries, prefix, data[: padded(offset)], offset), copies


def _bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(b"")
    return memoryview(tensor.numpy()).cast("B")


def checksums(image: FileImage) -> dict[str, ChunkSums]:
    """The chunked checksums of every tensor of ``image``, from the buffer."""
    view = _bytes(image.data)
    out = {}
    offset = 0
    for e in image.entries:
        summer = Checksummer()
        summer.update(view[offset : offset + e.nbytes])
        out[e.name] = summer.result()
        offset += e.nbytes
    return out


def _open(path: Path) -> tuple[int, bool]:
    """A new file for writing, with ``O_DIRECT`` where this system allows it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    direct = getattr(os, "O_DIRECT", 0) if DIRECT else 0
    if direct:
        try:
            return os.open(path, flags | direct, 0o666), True
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            flags &= ~os.O_EXCL  # some file systems create the file before they refuse
    return os.open(path, flags, 0o666), False


def _buffered(fd: int) -> None:
    """Turn ``O_DIRECT`` off for ``fd`` (a write it refused goes through the page cache)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _write_all(fd: int, view: memoryview, direct: bool, written: Callable[[int], None]) -> bool:
    """Write ``view`` to ``fd`` in calls of ``_WRITE_BYTES``; ``written(n)`` after each with
    the bytes written so far. Returns whether ``O_DIRECT`` is still on."""
    at = 0
    while at < len(view):
        try:
            n = os.write(fd, view[at : at + _WRITE_BYTES])
        except OSError as error:
            if not (direct and error.errno == errno.EINVAL):
                raise
            _buffered(fd)
            direct = False
            continue
        at += n
        written(at)
    return direct


def write_image(
    directory: Path,
    image: FileImage,
    *,
    tensor_written: Callable[[], None] = lambda: None,
) -> int:
    """Write ``image`` to ``directory / image.name`` (a new file) and fsync it; its size.
    (Its checksums are ``checksums(image)``, computed by another thread meanwhile.)

    ``tensor_written()`` runs once per tensor, after the file holds that tensor's bytes
    (the test seam of ``atomic.fault_point``).
    """
    ends = []
    offset = len(image.prefix)
    for e in image.entries:
        offset += e.nbytes
        ends.append(offset)
    done = 0

    def written(upto: int) -> None:
        nonlocal done
        while done < len(ends) and ends[done] <= upto:
            done += 1
            tensor_written()

    path = directory / image.name
    fd, direct = _open(path)
    try:
        head = mmap.mmap(-1, len(image.prefix))  # page-aligned, as O_DIRECT needs
        try:
            head.write(image.prefix)
            with memoryview(head) as view:
                direct = _write_all(fd, view, direct, lambda _: None)
        finally:
            head.close()
        written(len(image.prefix))  # tensors without bytes
        data = _bytes(image.data)[: padded(image.nbytes) if direct else image.nbytes]
        _write_all(fd, data, direct, lambda n: written(len(image.prefix) + n))
        if len(data) != image.nbytes:
            os.ftruncate(fd, image.file_bytes)  # the padding of the last page
        os.fsync(fd)
    finally:
        os.close(fd)
    return image.file_bytes
