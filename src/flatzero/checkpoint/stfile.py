"""Writing safetensors files tensor by tensor, and opening them with clear errors.

``safetensors.torch.save_file`` wants every tensor of a file at once in host memory. The
writer here takes the header up front (names, dtypes, shapes are known before any data)
and then streams each tensor: a CPU tensor is written straight from its memory, a device
tensor through a bounded host chunk. It checksums what it writes (crc32) and fsyncs. The
files are ordinary safetensors files (the header padded to 8 bytes, as safetensors
itself does), read back with ``safetensors.safe_open``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

__all__ = ["SafetensorsWriter", "TensorEntry", "open_safetensors", "tensor_crc32"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
if hasattr(torch, "float8_e4m3fn"):
    _DTYPES[torch.float8_e4m3fn] = "F8_E4M3"
    _DTYPES[torch.float8_e5m2] = "F8_E5M2"

_CHUNK_BYTES = 64 * 2**20
"""Device tensors are copied to the host and written in chunks of this many bytes."""


@dataclass(frozen=True)
class TensorEntry:
    """A tensor the writer will write: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return math.prod(self.shape) * self.dtype.itemsize


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def tensor_crc32(tensor: torch.Tensor, crc: int = 0) -> int:
    """crc32 of a tensor's bytes (as written by ``SafetensorsWriter``)."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return zlib.crc32(_byte_view(tensor.contiguous()), crc)


class SafetensorsWriter:
    """Write one safetensors file, tensor by tensor, in the order of ``entries``.

    Use as a context manager; ``write`` every entry in order; leaving the block without an
    error checks that all were written, flushes and fsyncs. ``crc32`` holds the checksum of
    each written tensor (when ``checksums``).

    Args:
        path: the file to create (it must not exist).
        entries: every tensor of the file, in the order they will be written.
        metadata: string-to-string metadata stored in the header.
        checksums: compute crc32 of every tensor's bytes.
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
        self.crc32: dict[str, int | None] = {}
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        names = set()
        for e in self.entries:
            if e.dtype not in _DTYPES:
                raise TypeError(f"tensor {e.name!r} has dtype {e.dtype}, which safetensors lacks")
            if e.name in names:
                raise ValueError(f"tensor name {e.name!r} appears twice in {self.path}")
            names.add(e.name)
            header[e.name] = {
                "dtype": _DTYPES[e.dtype],
                "shape": list(e.shape),
                "data_offsets": [offset, offset + e.nbytes],
            }
            offset += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self._prefix = struct.pack("<Q", len(text)) + text
        self.nbytes = len(self._prefix) + offset
        self._next = 0
        self._file = None

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
        crc = 0
        if tensor.device.type == "cpu":
            view = _byte_view(tensor.contiguous())
            self._file.write(view)
            if self.checksums:
                crc = zlib.crc32(view)
        else:
            flat = tensor.reshape(-1)
            step = max(1, _CHUNK_BYTES // max(1, tensor.element_size()))
            host = torch.empty(min(step, flat.numel()), dtype=tensor.dtype, pin_memory=True)
            for start in range(0, flat.numel(), step):
                n = min(step, flat.numel() - start)
                host[:n].copy_(flat[start : start + n])
                view = _byte_view(host[:n])
                self._file.write(view)
                if self.checksums:
                    crc = zlib.crc32(view, crc)
        self.crc32[name] = crc if self.checksums else None
        self._next += 1

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


def open_safetensors(path: str | os.PathLike[str]) -> Any:
    """``safe_open(path)`` for torch, with errors that name the file and what to do.

    Raises:
        ValueError: the file is missing, truncated or not a safetensors file.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(
            f"{path} is missing; the checkpoint is incomplete (a rank file was deleted or "
            "never written): load another tag"
        )
    try:
        return safe_open(path, framework="pt")
    except Exception as error:  # safetensors raises its own SafetensorError
        raise ValueError(
            f"{path} is not a readable safetensors file ({error}); it is damaged or "
            "truncated: load another tag"
        ) from error
