"""The safetensors header, written and parsed in this one place.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each
tensor name to its dtype, shape and ``[begin, end)`` byte offsets (counted from the end of
the header) plus an optional ``__metadata__`` of strings, then the raw little-endian data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..dtypes import SAFETENSORS_DTYPES, SAFETENSORS_NAMES

__all__ = ["MAX_HEADER_BYTES", "Header", "TensorEntry", "header_bytes", "read_header"]

MAX_HEADER_BYTES = 100 * 2**20
"""Largest header accepted (bytes), as safetensors limits it."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: what it is and, once written, where its bytes are.

    Attributes:
        name: its name in the header.
        dtype: its dtype.
        shape: its shape.
        offset: byte offset of its first element in the file (0 for a tensor still to be
            written: ``header_bytes`` places it).
        file: the file it is in (None for a tensor still to be written).
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0
    file: Path | None = None

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Header:
    """A parsed header.

    Attributes:
        metadata: the ``__metadata__`` strings (empty when there are none).
        tensors: every tensor by name, in header order, with its absolute offset.
    """

    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]


def header_bytes(
    path: str | os.PathLike[str],
    entries: Sequence[TensorEntry],
    metadata: dict[str, str] | None = None,
    *,
    align: int = 8,
) -> bytes:
    """What a safetensors file of ``entries`` (data in their order, no gaps) starts with:
    the header's length (8 bytes, little endian) and the JSON header, padded with spaces so
    that the data starts at a multiple of ``align`` bytes (safetensors itself pads to 8; a
    file written without the page cache pads to the page size, ``image``).

    Raises:
        TypeError: a dtype safetensors lacks. ValueError: a name appears twice (``path``
            names the file).
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    names: set[str] = set()
    for e in entries:
        if e.dtype not in SAFETENSORS_NAMES:
            raise TypeError(f"tensor {e.name!r} has dtype {e.dtype}, which safetensors lacks")
        if e.name in names:
            raise ValueError(f"tensor name {e.name!r} appears twice in {os.fspath(path)}")
        names.add(e.name)
        header[e.name] = {
            "dtype": SAFETENSORS_NAMES[e.dtype],
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % align)
    return struct.pack("<Q", len(text)) + text


def read_header(fd: int, path: Path) -> Header:
    """The header of the open safetensors file ``fd`` (``path`` names it in errors).

    Raises:
        ValueError: the file is shorter than 8 bytes, its header length does not fit, its
            header is not JSON or malformed, a dtype is unsupported, or a tensor's bytes do
            not match its shape or lie beyond the end of the file (truncated).
    """
    size = os.fstat(fd).st_size
    raw = os.pread(fd, 8, 0)
    if len(raw) != 8:
        raise ValueError(f"{path} is not a safetensors file: shorter than 8 bytes")
    (length,) = struct.unpack("<Q", raw)
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(
            f"{path} is not a valid safetensors file: header length {length} does not fit "
            f"in the file ({size} bytes); the file may be truncated or corrupt"
        )
    try:
        header = json.loads(os.pread(fd, length, 8))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} has a corrupt safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} has a corrupt safetensors header: not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        try:
            tensors[name] = _entry(path, name, info, base, size)
        except (KeyError, TypeError) as error:
            raise ValueError(
                f"{path} has a corrupt safetensors header: tensor {name!r} lacks {error}"
            ) from None
    return Header(dict(metadata), tensors)


def _entry(path: Path, name: str, info: dict[str, Any], base: int, size: int) -> TensorEntry:
    """The entry of tensor ``name`` from its header record ``info`` (data at ``base`` in a
    file of ``size`` bytes)."""
    if info.get("dtype") not in SAFETENSORS_DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')}")
    dtype = SAFETENSORS_DTYPES[info["dtype"]]
    shape = tuple(int(d) for d in info["shape"])
    begin, end = (int(x) for x in info["data_offsets"])
    if not 0 <= begin <= end or end - begin != math.prod(shape) * dtype.itemsize:
        raise ValueError(
            f"{path}: tensor {name!r} has data offsets [{begin}, {end}) that do not match its "
            f"dtype {info['dtype']} and shape {list(shape)}; the file is corrupt"
        )
    if base + end > size:
        raise ValueError(
            f"{path} is truncated: tensor {name!r} ends at byte {base + end} but the file "
            f"has {size} bytes; re-download or re-export it"
        )
    return TensorEntry(name, dtype, shape, base + begin, path)
