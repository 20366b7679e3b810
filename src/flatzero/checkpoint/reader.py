"""Reading a saved checkpoint: validated metadata, memory-mapped slices of rank files.

``CheckpointReader`` checks the cheap things up front (``meta.json`` parses and is
consistent, every rank file exists with the recorded size) and opens rank files lazily,
so a rank that needs pieces of two old ranks' shards maps only those two files and reads
only the slices it needs (``safe_open(...).get_slice(key)[a:b]``).
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..layout import Layout
from .format import MASTER, META, CheckpointMeta, check_tag, read_latest, resolve_tag, state_key
from .recovery import lost_copy
from .reshard import GroupReadPlan, ParamIndex, execute, index_layout, plan_reads
from .stfile import open_safetensors

__all__ = ["CheckpointReader", "locate"]

logger = logging.getLogger(__name__)


def locate(directory: str | os.PathLike[str], tag: str | None) -> tuple[str, Path]:
    """``(tag, path)`` of the checkpoint to read: ``resolve_tag``'s, or, when that tag was
    lost by a save killed while replacing it, its newest complete copy (with a warning;
    see ``recovery``).

    Raises:
        ValueError: no such checkpoint and no complete copy of it.
    """
    try:
        return resolve_tag(directory, tag)
    except ValueError:
        root = Path(directory)
        try:
            wanted = check_tag(tag) if tag is not None else read_latest(root)
        except ValueError:
            wanted = None
        copy = lost_copy(root, wanted) if wanted is not None else None
        if copy is None:
            raise
        logger.warning(
            "checkpoint %s is missing: a save was killed while replacing it; loading its "
            "complete copy %s (the next save renames it back)",
            root / wanted,
            copy,
        )
        return wanted, copy


class CheckpointReader:
    """One complete checkpoint, opened for reading.

    Args:
        directory: the checkpoint directory (with ``latest``), or a checkpoint itself.
        tag: which checkpoint; ``None`` follows ``latest``. A tag lost by a save killed
            while replacing it is read from its complete copy (``locate``).

    Raises:
        ValueError: no such checkpoint, a damaged ``meta.json``, a missing or truncated
            rank file (each error names the file).
    """

    def __init__(self, directory: str | os.PathLike[str], tag: str | None = None) -> None:
        self.tag, self.path = locate(directory, tag)
        self.meta = CheckpointMeta.read(self.path / META)
        self.index: ParamIndex = index_layout(self.meta.layout)
        self._handles: dict[int, Any] = {}
        self.check_files()

    @property
    def layout(self) -> Layout:
        """The layout the checkpoint was saved with."""
        return self.meta.layout

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the open file handles (their memory maps)."""
        self._handles.clear()

    def file_path(self, rank: int) -> Path:
        """Path of rank ``rank``'s file."""
        return self.path / self.meta.files[rank].file

    def check_files(self) -> None:
        """Every rank file exists and has the size ``meta.json`` recorded."""
        for record in self.meta.files:
            path = self.path / record.file
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                raise ValueError(
                    f"{path} is missing: the checkpoint was written by "
                    f"{self.meta.world_size} ranks and rank {record.rank}'s file is gone; "
                    "restore it or load another tag"
                ) from None
            if size != record.bytes:
                raise ValueError(
                    f"{path} has {size} bytes but {self.path / META} records {record.bytes}: "
                    "the file is truncated or was replaced; load another tag"
                )

    def handle(self, rank: int) -> Any:
        """The open safetensors file of rank ``rank`` (opened and checked once)."""
        handle = self._handles.get(rank)
        if handle is not None:
            return handle
        path = self.file_path(rank)
        handle = open_safetensors(path)
        metadata = handle.metadata() or {}
        expected = {
            "rank": str(rank),
            "world_size": str(self.meta.world_size),
            "layout_digest": self.meta.layout.digest(),
        }
        for key, value in expected.items():
            if metadata.get(key) != value:
                raise ValueError(
                    f"{path} belongs to another checkpoint ({key} is {metadata.get(key)!r}, "
                    f"expected {value!r}); it was copied in from elsewhere: restore the right "
                    "file or load another tag"
                )
        keys = set(handle.keys())
        wanted = set(self.meta.files[rank].tensors)
        if not wanted <= keys:
            raise ValueError(
                f"{path} lacks tensors {sorted(wanted - keys)[:4]} that {META} lists; the "
                "file is damaged: load another tag"
            )
        self._handles[rank] = handle
        return handle

    def state_dtype(self, group: int, state: str) -> torch.dtype:
        """The dtype ``state`` of saved group ``group`` was stored in."""
        info = self.meta.files[0].tensors.get(state_key(group, state))
        if info is None:
            raise ValueError(
                f"{self.path / META}: group {group} has no saved state {state!r}; the "
                "checkpoint is damaged"
            )
        return getattr(torch, info["dtype"])

    def fetcher(self, state: str) -> Callable[[Hashable, int, int], torch.Tensor]:
        """``fetch(source, start, numel)`` over saved shards of ``state`` (for ``execute``)."""

        def fetch(source: Hashable, start: int, numel: int) -> torch.Tensor:
            rank, group = source  # type: ignore[misc]
            key = state_key(group, state)
            handle = self.handle(rank)
            try:
                return handle.get_slice(key)[start : start + numel]
            except Exception as error:
                raise ValueError(
                    f"reading {key}[{start}:{start + numel}] from {self.file_path(rank)} "
                    f"failed ({error}); the file is damaged: load another tag"
                ) from error

        return fetch

    def plan(
        self,
        layout: Layout,
        rank: int,
        *,
        rename: Callable[[str], str] | Mapping[str, str] | None = None,
        strict: bool = True,
    ) -> list[GroupReadPlan]:
        """The reads that fill rank ``rank``'s shards of ``layout`` (see ``reshard``)."""
        return plan_reads(
            self.index, layout, rank, rename=rename, strict=strict, where=str(self.path)
        )

    def read(
        self, plan: GroupReadPlan, state: str, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Fill a new shard of ``state`` for ``plan`` (zeros where nothing is copied)."""
        if out is None:
            groups = plan.source_groups or (0,)
            dtype = torch.float32 if state == MASTER else self.state_dtype(groups[0], state)
            out = torch.zeros(plan.shard_numel, dtype=dtype)
        execute(plan, out, self.fetcher(state))
        return out

    def read_param(self, name: str, state: str = MASTER) -> torch.Tensor:
        """The whole of saved param ``name`` (its ``state``, fp32), shaped like the param."""
        record = self.index.get(name)
        if record is None:
            raise ValueError(f"param {name!r} is not in {self.path}")
        out = torch.empty(record.numel, dtype=torch.float32)
        fetch = self.fetcher(state)
        for seg in record.segments:
            n = seg.param_end - seg.param_start
            out[seg.param_start : seg.param_end].copy_(fetch(seg.source, seg.offset, n))
        return out.view(record.shape)

    def verify(self, ranks: Iterable[int] | None = None) -> None:
        """Check the crc32 of every tensor of the given ranks' files (default: all).

        Raises:
            ValueError: a checksum differs (naming file and tensor).
        """
        for rank in range(self.meta.world_size) if ranks is None else ranks:
            handle = self.handle(rank)
            for key, info in self.meta.files[rank].tensors.items():
                if info.get("crc32") is None:
                    continue
                tensor = handle.get_tensor(key).contiguous()
                raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""
                if zlib.crc32(raw) != info["crc32"]:
                    raise ValueError(
                        f"{self.file_path(rank)}: tensor {key} fails its checksum; the file "
                        "is corrupt: load another tag"
                    )
