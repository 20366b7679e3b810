"""Reading a saved checkpoint: validated metadata, verified runs of rank files.

``CheckpointReader`` checks the cheap things up front (``meta.json`` parses and is
consistent, every rank file exists with the recorded size) and opens rank files lazily,
so a rank that needs pieces of two old ranks' shards opens only those two files and reads
only the runs it needs, straight into its new shard, each checksum chunk verified as it is
read (``tensorfile.TensorFile``). Every error that says the checkpoint is missing,
incomplete or corrupt is a ``CheckpointDamaged``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..hostmem import empty_host
from ..layout import Layout
from ..storage.checksum import ChunkSums
from ..storage.tensorfile import TensorFile, open_safetensors
from .format import (
    MASTER,
    META,
    CheckpointDamaged,
    CheckpointMeta,
    CheckpointReplaced,
    check_tag,
    damage,
    read_latest,
    resolve_tag,
    state_key,
)
from .recovery import lost_copy
from .reshard import GroupReadPlan, ParamIndex, index_layout, plan_reads
from .validate import check_meta

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
        CheckpointDamaged: no such checkpoint, a damaged ``meta.json``, a missing or
            truncated rank file (each error names the file).
    """

    def __init__(self, directory: str | os.PathLike[str], tag: str | None = None) -> None:
        with damage():
            self.tag, self.path = locate(directory, tag)
            self.meta = CheckpointMeta.read(self.path / META)
            check_meta(self.meta, self.path)  # every field, not only what the digest covers
            self.index: ParamIndex = index_layout(self.meta.layout)
        self._handles: dict[int, Any] = {}
        self._files: dict[int, TensorFile] = {}
        try:
            self.check_files()
        except CheckpointDamaged as error:
            self.raise_if_replaced(error)
            raise

    def replaced(self) -> bool:
        """Whether ``meta.json`` is no longer the one this reader read (another save
        replaced the tag, or removed it, since)."""
        try:
            now = CheckpointMeta.read(self.path / META)
        except ValueError:  # gone or unreadable now: removed or replaced meanwhile
            return True
        mine = self.meta
        return (now.nonce, now.saved_at, now.files) != (mine.nonce, mine.saved_at, mine.files)

    def raise_if_replaced(self, error: CheckpointDamaged) -> None:
        """Raise ``CheckpointReplaced`` (from ``error``) when ``meta.json`` is no longer the
        one this reader read (another save replaced the tag, or removed it, meanwhile):
        ``error`` then says nothing about the checkpoint's health. Nothing otherwise."""
        if isinstance(error, CheckpointReplaced):
            raise error
        if not self.replaced():
            return
        raise CheckpointReplaced(
            f"{self.path} was replaced by another save while it was being loaded ({error}); "
            "load it again"
        ) from error

    @property
    def layout(self) -> Layout:
        """The layout the checkpoint was saved with."""
        return self.meta.layout

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the open rank files (and drop their memory maps)."""
        self._handles.clear()
        for file in self._files.values():
            file.close()
        self._files.clear()

    def file_path(self, rank: int) -> Path:
        """Path of rank ``rank``'s file."""
        return self.path / self.meta.files[rank].file

    def check_files(self) -> None:
        """Every rank file exists and has the size ``meta.json`` recorded.

        Raises:
            CheckpointDamaged: one is missing or has another size.
        """
        rest = self.meta.rest_record
        for record in (*self.meta.files, *([rest] if rest is not None else [])):
            path = self.path / record.file
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                whose = f"rank {record.rank}'s file" if record.rank >= 0 else "the model's rest"
                raise CheckpointDamaged(
                    f"{path} is missing: the checkpoint was written by "
                    f"{self.meta.world_size} ranks and {whose} is gone"
                ) from None
            if size != record.bytes:
                raise CheckpointDamaged(
                    f"{path} has {size} bytes but {self.path / META} records {record.bytes}: "
                    "the file is truncated or was replaced"
                )

    def _check_header(self, rank: int, metadata: Mapping[str, str], keys: set[str]) -> None:
        """Rank ``rank``'s file names this checkpoint and holds what ``meta.json`` lists."""
        path = self.file_path(rank)
        expected = {
            "rank": str(rank),
            "world_size": str(self.meta.world_size),
            "layout_digest": self.meta.layout.digest(),
        }
        if self.meta.nonce is not None and metadata.get("nonce") != self.meta.nonce:
            raise CheckpointReplaced(
                f"{path} is of another save of {self.tag} (nonce {metadata.get('nonce')!r}, "
                f"{META} says {self.meta.nonce!r}): the tag was replaced while it was being "
                "loaded; load it again"
            )
        for key, value in expected.items():
            if metadata.get(key) != value:
                raise CheckpointDamaged(
                    f"{path} belongs to another checkpoint ({key} is {metadata.get(key)!r}, "
                    f"expected {value!r}); it was copied in from elsewhere: restore the right "
                    "file"
                )
        wanted = set(self.meta.files[rank].tensors)
        if not wanted <= keys:
            raise CheckpointDamaged(
                f"{path} lacks tensors {sorted(wanted - keys)[:4]} that {META} lists; the "
                "file is damaged"
            )

    def handle(self, rank: int) -> Any:
        """The open (memory-mapped) safetensors file of rank ``rank``, checked once."""
        handle = self._handles.get(rank)
        if handle is None:
            with damage():
                handle = open_safetensors(self.file_path(rank))
                self._check_header(rank, handle.metadata() or {}, set(handle.keys()))
            self._handles[rank] = handle
        return handle

    def rest_file(self) -> TensorFile:
        """``model_rest.safetensors`` opened for reads, checked once to be of this save (its
        ``nonce``), so that verifying, checking and loading it read the same file (a
        ``safe_open`` handle would not: it maps the file again by its name).

        Raises:
            CheckpointReplaced: it is of another save of the tag.
        """
        file = self._files.get(-1)
        if file is None:
            path = self.path / str(self.meta.model_rest)
            with damage():
                file = TensorFile(path)
            nonce = file.metadata.get("nonce")
            if self.meta.nonce is not None and nonce != self.meta.nonce:
                file.close()
                raise CheckpointReplaced(
                    f"{path} is of another save of {self.tag} (nonce {nonce!r}, {META} says "
                    f"{self.meta.nonce!r}): the tag was replaced while it was being loaded"
                )
            self._files[-1] = file
        return file

    def tensor_file(self, rank: int) -> TensorFile:
        """Rank ``rank``'s file opened for verified reads, checked once."""
        file = self._files.get(rank)
        if file is None:
            with damage():
                file = TensorFile(self.file_path(rank))
                try:
                    self._check_header(rank, file.metadata, set(file.tensors))
                except BaseException:
                    file.close()
                    raise
            self._files[rank] = file
        return file

    def sums(self, rank: int, key: str) -> ChunkSums | None:
        """The checksums ``meta.json`` records for tensor ``key`` of rank ``rank``'s file
        (None: saved without checksums)."""
        info = self.meta.files[rank].tensors[key]
        return ChunkSums.of_record(info, self.tensor_file(rank).info(key).nbytes)

    def state_dtype(self, group: int, state: str) -> torch.dtype:
        """The dtype ``state`` of saved group ``group`` was stored in."""
        info = self.meta.files[0].tensors.get(state_key(group, state))
        if info is None:
            raise CheckpointDamaged(
                f"{self.path / META}: group {group} has no saved state {state!r}; the "
                "checkpoint is damaged"
            )
        return getattr(torch, info["dtype"])

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

    def _read_run(
        self, source: Hashable, state: str, start: int, out: torch.Tensor, verify: bool
    ) -> None:
        """Read ``out.numel()`` elements of saved shard ``source`` (``(rank, group)``) of
        ``state`` from ``start`` into ``out``."""
        rank, group = source  # type: ignore[misc]
        key = state_key(group, state)
        with damage():
            file = self.tensor_file(rank)
            file.read_into(key, start, out, self.sums(rank, key) if verify else None)

    def read(
        self,
        plan: GroupReadPlan,
        state: str,
        out: torch.Tensor | None = None,
        *,
        verify: bool = True,
    ) -> torch.Tensor:
        """Fill a new shard of ``state`` for ``plan`` (zeros where nothing is copied),
        verifying what is read against the recorded checksums unless not ``verify``.

        Raises:
            CheckpointDamaged: a file is damaged or a chunk read fails its checksum.
        """
        if out is None:
            groups = plan.source_groups or (0,)
            dtype = torch.float32 if state == MASTER else self.state_dtype(groups[0], state)
            # On huge pages, as the state a first step makes (hostmem.HugePageFactories).
            out = empty_host(plan.shard_numel, dtype).zero_()
        if out.numel() != plan.shard_numel:
            raise ValueError(f"out has {out.numel()} elements, the shard {plan.shard_numel}")
        for c in plan.copies:
            self._read_run(
                c.source, state, c.src_start, out[c.dst_start : c.dst_start + c.numel], verify
            )
        return out

    def read_tensor(self, rank: int, key: str, *, verify: bool = True) -> torch.Tensor:
        """The whole of tensor ``key`` of rank ``rank``'s file, verified with ``verify``."""
        with damage():
            file = self.tensor_file(rank)
            info = file.info(key)
            out = torch.empty(math.prod(info.shape), dtype=info.dtype)
            file.read_into(key, 0, out, self.sums(rank, key) if verify else None)
        return out.view(info.shape)

    def read_param(self, name: str, state: str = MASTER, *, verify: bool = False) -> torch.Tensor:
        """The whole of saved param ``name`` (its ``state``, fp32), shaped like the param,
        verified against the checksums with ``verify``."""
        record = self.index.get(name)
        if record is None:
            raise ValueError(f"param {name!r} is not in {self.path}")
        out = torch.empty(record.numel, dtype=torch.float32)
        for seg in record.segments:
            piece = out[seg.param_start : seg.param_end]
            self._read_run(seg.source, state, seg.offset, piece, verify)
        return out.view(record.shape)

    def verify(self, ranks: Iterable[int] | None = None) -> None:
        """Check the checksums of every tensor of the given ranks' files (default: all),
        one chunk at a time.

        Raises:
            CheckpointDamaged: a checksum differs (naming file, tensor and bytes).
        """
        ranks = range(self.meta.world_size) if ranks is None else list(ranks)
        if 0 in ranks:  # whoever checks rank 0's file checks the model's rest
            self.verify_rest()
        for rank in ranks:
            file = self.tensor_file(rank)
            for key in self.meta.files[rank].tensors:
                sums = self.sums(rank, key)
                if sums is not None:
                    with damage():
                        file.verify(key, sums)

    def verify_rest(self) -> None:
        """Check the checksums of every tensor of ``model_rest.safetensors`` (the model's
        frozen params and buffers) that ``meta.json`` records, one chunk at a time (nothing
        for a checkpoint without it, or written before its checksums were recorded).

        Raises:
            CheckpointDamaged: a checksum differs, or the file is damaged (naming it).
        """
        record = self.meta.rest_record
        if record is None:
            return
        file = self.rest_file()
        with damage():
            for key, info in record.tensors.items():
                sums = ChunkSums.of_record(info, file.info(key).nbytes)
                if sums is not None:
                    file.verify(key, sums)
