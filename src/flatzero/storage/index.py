"""Read element ranges of tensors in safetensors files, straight into caller-owned memory.

Knowing where each tensor's bytes are (``header.read_header``), a rank can read the exact
bytes of its slice of each parameter with ``preadv`` into a staging buffer or a
bucket: no full tensor, no extra copy, and no file pages mapped into the process (a
memory-mapped read counts towards the reader's RSS; a ``pread`` does not).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

from .header import TensorEntry, read_header

__all__ = ["SafetensorsCheckpoint"]


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"checkpoint path {path} does not exist")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {path}")
    return files


class SafetensorsCheckpoint:
    """An index of every tensor in a safetensors file or directory (HF-style sharded or not).

    Args:
        path: a ``.safetensors`` file, or a directory with ``*.safetensors`` files (and
            optionally a ``*.safetensors.index.json``, as ``save_pretrained`` writes).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self._fds: dict[Path, int] = {}
        self.path = Path(path)
        self.entries: dict[str, TensorEntry] = {}
        for file in _files(self.path):
            for name, entry in read_header(self._fd(file), file).tensors.items():
                if name in self.entries:
                    raise ValueError(
                        f"tensor {name!r} is in both {self.entries[name].file} and {file}"
                    )
                self.entries[name] = entry

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(file, os.O_RDONLY)
        return self._fds[file]

    def close(self) -> None:
        """Close the open files (reading again reopens them)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        self.close()

    def read_into(self, name: str, start: int, end: int, out: torch.Tensor) -> int:
        """Read flat elements ``[start, end)`` of tensor ``name`` into the 1-D host tensor ``out``.

        ``out`` may have another dtype (the values are converted). Returns bytes read.
        """
        entry = self.entries[name]
        if not 0 <= start <= end <= entry.numel:
            raise ValueError(f"range [{start}, {end}) is outside tensor {name!r} of {entry.numel}")
        if out.numel() != end - start or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError("out must be a contiguous host tensor of end - start elements")
        target = out if out.dtype == entry.dtype else torch.empty(end - start, dtype=entry.dtype)
        size = entry.dtype.itemsize
        view = memoryview(target.view(torch.uint8).numpy()).cast("B")
        fd, offset, done = self._fd(entry.file), entry.offset + start * size, 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise ValueError(f"{entry.file} ended early while reading {name!r}: truncated?")
            done += n
        if target is not out:
            out.copy_(target)
        return done

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor ``name`` as a new host tensor of its stored dtype and shape."""
        entry = self.entries[name]
        out = torch.empty(entry.numel, dtype=entry.dtype)
        self.read_into(name, 0, entry.numel, out)
        return out.view(entry.shape)
