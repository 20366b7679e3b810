"""Checksums of a tensor's bytes in fixed chunks, so that any range read can be verified.

A rank file records, per tensor, the checksum of every ``chunk_bytes`` bytes of it
(``ChunkSums``). A load that reads part of a tensor (a resharded load reads runs of other
ranks' shards) verifies the chunks it reads, checksumming the bytes just read while they
are in the CPU's cache: one pass, no second read of the file. The algorithm is crc32c
(hardware instructions through the ``crc32c`` package, ~10 GB/s a core) where that package
is installed, else zlib's crc32 (~2-3 GB/s); the record names it. Checkpoints written
before chunked checksums recorded one ``crc32`` per tensor: that is a single chunk.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ALGORITHMS",
    "CHUNK_BYTES",
    "DEFAULT_ALGORITHM",
    "Checksummer",
    "ChunkSums",
    "checksum_function",
]

CHUNK_BYTES = 8 * 2**20
"""Bytes per checksummed chunk (8 MiB: small enough to stay in cache between the read and
its checksum, large enough that ``meta.json`` holds one number per 8 MiB written)."""


def _algorithms() -> dict[str, Callable[[Any, int], int]]:
    found: dict[str, Callable[[Any, int], int]] = {"crc32": zlib.crc32}
    try:
        import crc32c
    except ImportError:
        return found
    found["crc32c"] = crc32c.crc32c
    return found


ALGORITHMS: Mapping[str, Callable[[Any, int], int]] = _algorithms()
"""Checksum functions available here, by name: ``f(bytes, running value) -> value``."""

DEFAULT_ALGORITHM = "crc32c" if "crc32c" in ALGORITHMS else "crc32"
"""What new checkpoints are checksummed with."""


def checksum_function(algorithm: str, where: str) -> Callable[[Any, int], int]:
    """The function of ``algorithm``.

    Raises:
        ValueError: it is not available here (naming ``where`` and the way out).
    """
    fn = ALGORITHMS.get(algorithm)
    if fn is None:
        raise ValueError(
            f"{where} is checksummed with {algorithm!r}, which this Python lacks: "
            f"`pip install {algorithm}`, or load with LoadConfig(verify=False)"
        )
    return fn


@dataclass(frozen=True)
class ChunkSums:
    """The checksums of one tensor's bytes.

    Attributes:
        algorithm: ``"crc32c"`` or ``"crc32"``.
        chunk_bytes: bytes per chunk; the last chunk may be shorter.
        sums: one checksum per chunk, in order (none for an empty tensor).
    """

    algorithm: str
    chunk_bytes: int
    sums: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form in a file record."""
        return {"algorithm": self.algorithm, "chunk_bytes": self.chunk_bytes, "sums": self.sums}

    @classmethod
    def of_record(cls, info: Mapping[str, Any], nbytes: int) -> ChunkSums | None:
        """The sums of a tensor's record in ``meta.json`` (``nbytes`` bytes long), or None
        when it was saved without checksums."""
        data = info.get("checksum")
        if data is not None:
            return cls(str(data["algorithm"]), int(data["chunk_bytes"]), tuple(data["sums"]))
        crc = info.get("crc32")  # written before chunked checksums: one chunk
        if crc is None:
            return None
        return cls("crc32", max(1, nbytes), (int(crc),) if nbytes else ())


class Checksummer:
    """Chunked checksums of bytes fed in pieces of any size, in order."""

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.algorithm = algorithm
        self.chunk_bytes = chunk_bytes
        self._fn = checksum_function(algorithm, "a tensor")
        self._sums: list[int] = []
        self._value = 0
        self._filled = 0

    def update(self, data: memoryview) -> None:
        """Feed the next bytes."""
        at = 0
        while at < len(data):
            take = min(self.chunk_bytes - self._filled, len(data) - at)
            self._value = self._fn(data[at : at + take], self._value)
            self._filled += take
            at += take
            if self._filled == self.chunk_bytes:
                self._sums.append(self._value)
                self._value = self._filled = 0

    def result(self) -> ChunkSums:
        """The sums of everything fed (the last, partial chunk included)."""
        sums = [*self._sums, self._value] if self._filled else self._sums
        return ChunkSums(self.algorithm, self.chunk_bytes, tuple(sums))
