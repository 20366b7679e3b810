"""Reading ranges of a safetensors file's tensors with positioned reads, verified as read.

``TensorFile`` parses the header (``header.read_header``) and reads a run of a
tensor's elements straight into the destination tensor's memory with ``os.preadv``, one
checksum chunk (``checksum.CHUNK_BYTES``) at a time: each chunk is checksummed right after
it is read, while its bytes are still in the CPU's cache, so verifying costs the checksum
and no second pass over memory or the file. A chunk the run covers only in part (the ends
of a resharded run) is read whole into a scratch buffer, checked, and its part copied.
Unverified reads take the same path without the checksum.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .checksum import CHUNK_BYTES, ChunkSums, checksum_function
from .header import TensorEntry, read_header

__all__ = ["TensorFile", "open_safetensors"]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous 1-D CPU tensor, without a copy."""
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B")


class TensorFile:
    """One safetensors file opened for positioned, optionally verified, reads.

    Args:
        path: the file.

    Raises:
        ValueError: the file is missing or its header is not a safetensors header.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ValueError(
                f"{self.path} is missing; the checkpoint is incomplete (a rank file was "
                "deleted or never written)"
            ) from None
        try:
            self.metadata, self.tensors = self._parse()
        except BaseException:
            os.close(self._fd)
            raise
        self._scratch: torch.Tensor | None = None

    def _parse(self) -> tuple[dict[str, str], dict[str, TensorEntry]]:
        try:
            header = read_header(self._fd, self.path)
        except ValueError as error:
            raise ValueError(
                f"{self.path} is not a readable safetensors file ({error}); it is damaged "
                "or truncated"
            ) from error
        return header.metadata, header.tensors

    def close(self) -> None:
        """Close the file (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._scratch = None

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def info(self, name: str) -> TensorEntry:
        """Where tensor ``name`` is.

        Raises:
            ValueError: the file has no such tensor.
        """
        info = self.tensors.get(name)
        if info is None:
            raise ValueError(f"{self.path} has no tensor {name!r}; the file is damaged")
        return info

    def _pread(self, into: memoryview, offset: int) -> None:
        """Fill ``into`` with the file's bytes from ``offset`` (short reads repeated)."""
        done = 0
        while done < len(into):
            n = os.preadv(self._fd, [into[done:]], offset + done)
            if n == 0:
                raise ValueError(f"{self.path} ends at byte {offset + done}; it is truncated")
            done += n

    def _scratch_bytes(self, nbytes: int) -> memoryview:
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return _bytes_of(self._scratch)[:nbytes]

    def read_into(self, name: str, start: int, out: torch.Tensor, sums: ChunkSums | None) -> None:
        """Read elements ``[start, start + out.numel())`` of tensor ``name`` into ``out``
        (1-D, contiguous, on the CPU), verifying every chunk read against ``sums`` (None:
        unverified).

        Raises:
            ValueError: the range lies outside the tensor, or a chunk fails its checksum
                (naming the file, the tensor and the bytes).
        """
        info = self.info(name)
        if out.dtype != info.dtype:
            staged = torch.empty(out.numel(), dtype=info.dtype)
            self.read_into(name, start, staged, sums)
            out.copy_(staged)
            return
        size = info.dtype.itemsize
        lo, hi = start * size, (start + out.numel()) * size
        if start < 0 or hi > info.nbytes:
            raise ValueError(
                f"{self.path}: elements [{start}, {start + out.numel()}) lie outside tensor "
                f"{name!r} of {info.nbytes // size}; the file does not match its meta.json"
            )
        dest = _bytes_of(out)
        chunk = self._chunk_bytes(name, info, sums)
        for k in range(lo // chunk, -(-hi // chunk)):
            c0, c1 = k * chunk, min((k + 1) * chunk, info.nbytes)
            a, b = max(c0, lo), min(c1, hi)
            if sums is None or (a, b) == (c0, c1):  # straight into the destination
                self._pread(dest[a - lo : b - lo], info.offset + a)
                self._check(name, sums, k, dest[a - lo : b - lo], c0)
            else:  # the run covers part of this chunk: read and check all of it
                view = self._scratch_bytes(c1 - c0)
                self._pread(view, info.offset + c0)
                self._check(name, sums, k, view, c0)
                dest[a - lo : b - lo] = view[a - c0 : b - c0]

    def verify(self, name: str, sums: ChunkSums) -> None:
        """Check every chunk of tensor ``name`` against ``sums``, through the scratch
        buffer (nothing the size of the tensor is allocated).

        Raises:
            ValueError: a chunk fails (naming the file, the tensor and the bytes).
        """
        info = self.info(name)
        chunk = self._chunk_bytes(name, info, sums)
        for k in range(len(sums.sums)):
            c0, c1 = k * chunk, min((k + 1) * chunk, info.nbytes)
            view = self._scratch_bytes(c1 - c0)
            self._pread(view, info.offset + c0)
            self._check(name, sums, k, view, c0)

    def _chunk_bytes(self, name: str, info: TensorEntry, sums: ChunkSums | None) -> int:
        """The chunk size reads of ``name`` go by (the checksums', else ``CHUNK_BYTES``)."""
        if sums is None:
            return CHUNK_BYTES
        if sums.chunk_bytes < 1 or len(sums.sums) != -(-info.nbytes // sums.chunk_bytes):
            raise ValueError(
                f"{self.path}: tensor {name!r} has {len(sums.sums)} checksums recorded for "
                f"{info.nbytes} bytes in chunks of {sums.chunk_bytes}; meta.json is damaged"
            )
        return sums.chunk_bytes

    def _check(self, name: str, sums: ChunkSums | None, k: int, data: memoryview, c0: int) -> None:
        """Compare chunk ``k`` (``data``, starting at byte ``c0``) with its checksum."""
        if sums is None:
            return
        if checksum_function(sums.algorithm, str(self.path))(data, 0) != sums.sums[k]:
            raise ValueError(
                f"{self.path}: tensor {name!r} fails its checksum in bytes "
                f"{c0}-{c0 + len(data)}; the file is corrupt"
            )


def _check_readable(path: str) -> None:
    """A ``ValueError`` in the OS's words when ``path`` cannot be opened (permission denied,
    an I/O error): not to be mistaken for a damaged file."""
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise ValueError(
            f"cannot read {path}: {error.strerror or error}; give this process read access "
            "to the checkpoint (or fix the file system)"
        ) from error


def open_safetensors(path: str | os.PathLike[str]) -> Any:
    """``safe_open(path)`` for torch, with errors that name the file and what to do.

    Raises:
        ValueError: the file is missing, unreadable (in the OS's words), truncated or not a
            safetensors file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} is missing; the checkpoint is incomplete (a rank file was deleted or "
            "never written): load another tag"
        )
    _check_readable(path)
    try:
        return safe_open(path, framework="pt")
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ValueError(
            f"{path} is not a readable safetensors file ({error}); it is damaged or "
            "truncated: load another tag"
        ) from error
