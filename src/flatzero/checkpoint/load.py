"""``load_checkpoint``: load a checkpoint saved at any world size and bucket size.

Each rank plans its reads through the saved layout (``reshard``): its new shard pieces ->
(param name, element range) -> (old rank, old shard offset) runs, and reads only those
runs from the old ranks' memory-mapped files. Per-element optimizer states are read the
same way as the master weights, so they resume exactly; scalar state (``step``,
hyperparameters, loss scaler, scheduler) comes from ``meta.json``. Everything is read and
checked before anything changes: an error on any rank makes every rank raise with the
optimizer, the params and the scheduler untouched. The ranks wait for the slowest reader
on the process group's control group (gloo), with a timeout that fits the bytes read.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..comm import all_gather_buckets_from_own_slices
from ..control import Failures, every_rank_or_none
from ..flatten import FlatParams
from ..layout import Layout
from ..optim import ZeroOptimizer
from ..optim.state import GroupState, ShardedOptimizerState
from ..own_groups import control_group
from .checkpointer import wait_for_save
from .config import LoadConfig
from .fallback import again_if_replaced, newest_valid, refused
from .format import (
    MASTER,
    META,
    CheckpointDamaged,
    CheckpointMeta,
    CheckpointReplaced,
    GroupRecord,
    decode_value,
    read_latest,
)
from .optimizer_state import merge_group_records, restored_state, saved_step
from .reader import CheckpointReader
from .reshard import GroupReadPlan, _resolve
from .rng import RNG_PREFIX, restore_rng
from .validate import (
    agree_on_checkpoint,
    agree_on_load_settings,
    check_for_optimizer,
    check_rank_files,
    check_rng,
    check_scheduler_state,
)

__all__ = ["LoadResult", "load_checkpoint", "load_flat_params"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """What ``load_checkpoint`` loaded.

    Attributes:
        tag: the checkpoint's tag.
        path: its directory.
        saved_world_size: ranks it was saved by.
        resharded: whether its layout differs from the optimizer's (another world size,
            bucket size or param set), so shards were remapped.
        step: the optimizer step it was saved at (from the inner optimizer's ``step``),
            or None.
        extra: the client state passed to ``save_checkpoint(extra=...)``.
        elements_read: elements this rank read, summed over master and states.
        seconds: wall-clock seconds of the load on this rank.
    """

    tag: str
    path: Path
    saved_world_size: int
    resharded: bool
    step: int | None
    extra: Any
    elements_read: int
    seconds: float


@dataclass(frozen=True)
class _Read:
    """Everything a load changes, read and checked on this rank before anything changes.

    Attributes:
        reader: the open checkpoint.
        state: the optimizer state to load (this rank's shards in its own layout).
        scheduler: the scheduler state to load, or None.
        elements: elements read from the rank files (master and states).
        rng: this rank's saved RNG tensors and the file's metadata (Python's and NumPy's
            states), read and verified, when they are to be restored; else None.
    """

    reader: CheckpointReader
    state: ShardedOptimizerState
    scheduler: Any
    elements: int
    rng: tuple[dict[str, torch.Tensor], dict[str, str]] | None


_ELSEWHERE = "loading the checkpoint failed on another rank (see its error); nothing was changed"


def _load_failure(failures: Failures) -> BaseException:
    """Every rank's error once some rank failed to read: ``CheckpointDamaged`` on every
    rank when every error was one (a missing, incomplete or corrupt checkpoint), else
    ``ValueError`` (or the rank's own ``TypeError``), so that all ranks take the same way
    out; ranks without an error of their own name the first failing rank's."""
    mine, first = failures.mine, failures.first
    elsewhere = f"{_ELSEWHERE}: rank {first.rank}: {first.message}"
    if CheckpointReplaced.__name__ in failures.kinds:  # every rank loads again, or says so
        return mine if isinstance(mine, CheckpointReplaced) else CheckpointReplaced(elsewhere)
    if all(kind == CheckpointDamaged.__name__ for kind in failures.kinds):
        return mine if mine is not None else CheckpointDamaged(elsewhere)
    if isinstance(mine, CheckpointDamaged):
        error = ValueError(str(mine))
        error.__cause__ = mine
        return error
    return mine if mine is not None else ValueError(elsewhere)


def _every_rank_reads(group: dist.ProcessGroup | None) -> every_rank_or_none:
    """A load's reading, agreed on once every rank has read (on the control group, never
    behind GPU work): one rank's error is an error on every rank (``_load_failure``). The
    block sets ``wait_bytes`` to the bytes it read, which sizes the wait for the others."""
    return every_rank_or_none(
        group, catch=(ValueError, TypeError, OSError), error_type=_load_failure, wait_bytes=0
    )


def _group_sources(
    reader: CheckpointReader,
    layout: Layout,
    rename: Callable[[str], str] | Mapping[str, str] | None,
) -> list[list[int]]:
    """Per new group, the saved groups its params come from (the same on every rank)."""
    out = []
    for gl in layout.groups:
        found = {
            reader.index[n].group
            for n in (_resolve(s.spec.name, rename) for s in gl.slots)
            if n in reader.index
        }
        out.append(sorted(found))
    return out


def _read_group(
    reader: CheckpointReader,
    plan: GroupReadPlan,
    record: GroupRecord | None,
    current: GroupState,
    config: LoadConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """This rank's new master and state shards of one group; elements read.

    ``current`` is the group's current state: its values stay for params the checkpoint
    lacks (``strict=False``).
    """
    states = record.states if record is not None else (MASTER,)
    if not config.load_optimizer_states:
        states = (MASTER,)
    out: dict[str, torch.Tensor] = {}
    read = 0
    for state in states:
        tensor = reader.read(plan, state, verify=config.verify)
        read += sum(c.numel for c in plan.copies)
        kept = current.master if state == MASTER else current.shards.get(state)
        if kept is not None and plan.missing:
            kept = kept.detach().cpu()
            for _name, start, numel in plan.missing:  # strict=False: keep what is there
                tensor[start : start + numel].copy_(kept[start : start + numel])
        out[state] = tensor
    master = out.pop(MASTER)
    return master, out, read


def _read(
    reader: CheckpointReader,
    plans: list[GroupReadPlan],
    optimizer: ZeroOptimizer,
    rename: Callable[[str], str] | Mapping[str, str] | None,
    config: LoadConfig,
) -> tuple[ShardedOptimizerState, int]:
    """This rank's new optimizer state, read through ``plans``; elements read."""
    meta = reader.meta
    current = optimizer.sharded_state()
    sources = _group_sources(reader, optimizer.flat.layout, rename)
    masters, shards, records = [], [], []
    elements = 0
    for gi, plan in enumerate(plans):
        record = merge_group_records(meta.groups, sources[gi], gi, str(reader.path))
        master, states, read = _read_group(reader, plan, record, current.groups[gi], config)
        elements += read
        masters.append(master)
        shards.append(states)
        records.append(record)
    state = restored_state(
        current,
        meta,
        masters,
        shards,
        records,
        load_optimizer_states=config.load_optimizer_states,
    )
    return state, elements


def _scheduler_state(reader: CheckpointReader, scheduler: Any, config: LoadConfig) -> Any:
    """The saved scheduler state to load, or None."""
    if scheduler is None or not config.load_scheduler:
        return None
    if reader.meta.scheduler is None:
        raise ValueError(
            f"{reader.path} has no scheduler state (saved without scheduler=); "
            "load without scheduler= or with LoadConfig(load_scheduler=False)"
        )
    state = decode_value(reader.meta.scheduler)
    check_scheduler_state(state, scheduler, reader.path)
    return state


def _read_everything(
    directory: str | Path,
    tag: str | None,
    optimizer: ZeroOptimizer,
    scheduler: Any,
    model: torch.nn.Module | None,
    rename: Callable[[str], str] | Mapping[str, str] | None,
    config: LoadConfig,
    check_extra: Callable[[Any], None] | None = None,
) -> _Read:
    """Read and check everything on this rank (``validate``: every field of ``meta.json``
    when the reader opens it, the rank files read, the state against the optimizer and
    the scheduler); every rank learns whether all could, and that all read the same
    checkpoint."""
    with _every_rank_reads(optimizer.flat.process_group) as reading:
        reader = CheckpointReader(directory, tag)
        try:
            read = _read_checked(reader, optimizer, scheduler, model, rename, config)
        except CheckpointDamaged as error:
            reader.raise_if_replaced(error)  # the tag replaced meanwhile: not damaged
            raise
        if check_extra is not None:
            _check_extra(reader, check_extra)
        reading.wait_bytes = read.elements * 4
    agree_on_checkpoint(read.reader, optimizer.flat.process_group)
    return read


def _read_checked(
    reader: CheckpointReader,
    optimizer: ZeroOptimizer,
    scheduler: Any,
    model: torch.nn.Module | None,
    rename: Callable[[str], str] | Mapping[str, str] | None,
    config: LoadConfig,
) -> _Read:
    """(``_read_everything``'s reading, on this rank.)"""
    flat = optimizer.flat
    plans = reader.plan(flat.layout, flat.rank, rename=rename, strict=config.strict)
    check_rank_files(reader, {c.source[0] for p in plans for c in p.copies})
    if config.load_optimizer_states:
        check_for_optimizer(reader.meta, reader.path, optimizer)
    state, elements = _read(reader, plans, optimizer, rename, config)
    rng = _read_rng(reader, flat.rank, flat.world_size, config)
    read = _Read(reader, state, _scheduler_state(reader, scheduler, config), elements, rng)
    if model is not None:
        if config.verify:
            reader.verify_rest()  # frozen params and buffers, checked before any change
        _check_model_rest(reader, model)
    return read


def _check_extra(reader: CheckpointReader, check: Callable[[Any], None]) -> None:
    """``check`` the saved client state; its error names ``meta.json``."""
    try:
        check(decode_value(reader.meta.extra))
    except (ValueError, TypeError) as error:
        raise type(error)(f"{reader.path / META}: {error}") from error


def _read_rng(
    reader: CheckpointReader, rank: int, world_size: int, config: LoadConfig
) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """This rank's saved RNG tensors (verified) and its file's metadata, when they are to
    be restored: saved, asked for, and saved at this world size (else warned once)."""
    meta = reader.meta
    if not (meta.rng and config.load_rng):
        return None
    if meta.world_size != world_size:
        if rank == 0:
            logger.warning(
                "checkpoint %s has RNG states of %d ranks; loading at %d ranks, RNG states "
                "are not restored",
                reader.path,
                meta.world_size,
                world_size,
            )
        return None
    keys = [k for k in reader.meta.files[rank].tensors if k.startswith(RNG_PREFIX)]
    tensors = {k: reader.read_tensor(rank, k, verify=config.verify) for k in keys}
    metadata = dict(reader.tensor_file(rank).metadata)
    check_rng(tensors, metadata, reader.file_path(rank))
    return tensors, metadata


def _read_or_fall_back(
    directory: str | Path,
    tag: str | None,
    optimizer: ZeroOptimizer,
    scheduler: Any,
    model: torch.nn.Module | None,
    rename: Callable[[str], str] | Mapping[str, str] | None,
    config: LoadConfig,
    check_extra: Callable[[Any], None] | None = None,
) -> _Read:
    """``_read_everything``; when the checkpoint is refused as damaged, the newest tag that
    is complete and verifies is named in the error on every rank, or loaded instead with
    ``config.fallback == "newest_valid"`` (with a warning)."""
    group = optimizer.flat.process_group
    try:
        return again_if_replaced(
            lambda: _read_everything(
                directory, tag, optimizer, scheduler, model, rename, config, check_extra
            ),
            f"{tag or 'latest'} of {directory}",
        )
    except CheckpointReplaced:
        raise
    except CheckpointDamaged as error:
        refused_tag = tag if tag is not None else _latest_or_none(directory)
        good = newest_valid(directory, group, skip=refused_tag)
        if good is None or config.fallback != "newest_valid":
            raise refused(error, directory, good) from error
        if optimizer.flat.rank == 0:
            logger.warning(
                "checkpoint %s of %s cannot be loaded (%s); loading %s instead, the newest "
                "that is complete and verifies (LoadConfig.fallback='newest_valid')",
                refused_tag,
                directory,
                error,
                good,
            )
        return _read_everything(
            directory, good, optimizer, scheduler, model, rename, config, check_extra
        )


def _latest_or_none(directory: str | Path) -> str | None:
    try:
        return read_latest(directory)
    except ValueError:
        return None


def load_checkpoint(
    directory: str | Path,
    optimizer: ZeroOptimizer,
    tag: str | None = None,
    *,
    scheduler: Any = None,
    model: torch.nn.Module | None = None,
    rename: Callable[[str], str] | Mapping[str, str] | None = None,
    config: LoadConfig | None = None,
    check_extra: Callable[[Any], None] | None = None,
) -> LoadResult:
    """Load a checkpoint saved at any world size into ``optimizer`` (and its params).

    Collective: call on every rank of the optimizer's process group. Params are matched
    by name (``rename`` maps the optimizer's names to the checkpoint's), never by order. An
    asynchronous save of the optimizer still writing is waited for first.

    Args:
        directory: the checkpoint directory (or a checkpoint itself).
        optimizer: a ``ZeroOptimizer``; its master shards, inner state and params are set.
        tag: which checkpoint; ``None`` follows ``directory/latest``.
        scheduler: an LR scheduler to restore (``load_state_dict``).
        model: the model, to restore its frozen params and buffers saved with
            ``save_checkpoint(model=...)``.
        rename: new param name -> name in the checkpoint (a function or a dict).
        config: ``LoadConfig`` (strictness, what to restore, verification, fallback).
        check_extra: called with the saved client state before anything is changed; what
            it raises (``ValueError``) is raised on every rank (the engine checks its step
            counters with it).

    Returns:
        ``LoadResult`` with the tag (the fallback's when it loaded another), whether shards
        were remapped and the client state.

    Raises:
        CheckpointDamaged: (a ``ValueError``) no such checkpoint, a damaged, missing,
            truncated or corrupt file; the error names the file and the newest tag that
            is complete and verifies. Raised on every rank; nothing is changed.
        ValueError: a checkpoint that does not match the model (naming the param).
    """
    config = config or LoadConfig()
    t0 = time.perf_counter()
    flat = optimizer.flat
    control_group(flat.process_group)  # created (collective) now, not while some rank reads
    wait_for_save(optimizer)  # an asynchronous save of this optimizer finishes first
    settings = {**dataclasses.asdict(config), "scheduler": scheduler is not None}
    agree_on_load_settings({**settings, "model": model is not None}, flat.process_group)
    read = _read_or_fall_back(
        directory, tag, optimizer, scheduler, model, rename, config, check_extra
    )
    reader, meta = read.reader, read.reader.meta

    optimizer.load_sharded_state(read.state)
    if read.scheduler is not None:
        scheduler.load_state_dict(read.scheduler)
    if model is not None and meta.model_rest is not None:
        _load_model_rest(reader, model)
    if read.rng is not None:
        restore_rng(*read.rng)
    reader.close()
    resharded = meta.layout.digest() != flat.layout.digest()
    result = LoadResult(
        tag=reader.tag,
        path=reader.path,
        saved_world_size=meta.world_size,
        resharded=resharded,
        step=saved_step(meta.groups),
        extra=decode_value(meta.extra),
        elements_read=read.elements,
        seconds=time.perf_counter() - t0,
    )
    if flat.rank == 0:
        logger.info(
            "loaded checkpoint %s (saved by %d ranks%s) in %.2f s",
            reader.path,
            meta.world_size,
            ", resharded" if resharded else "",
            result.seconds,
        )
    return result


def _check_model_rest(reader: CheckpointReader, model: torch.nn.Module) -> None:
    meta: CheckpointMeta = reader.meta
    if meta.model_rest is None:
        return
    path = reader.path / meta.model_rest
    file = reader.rest_file()
    targets = dict(model.state_dict(keep_vars=True))
    for key, info in file.tensors.items():
        target = targets.get(key)
        if target is None:
            continue
        shape = info.shape
        if shape != tuple(target.shape):
            raise ValueError(
                f"{key} has shape {shape} in {path} but {tuple(target.shape)} in the model"
            )
        if target.is_meta:
            raise ValueError(f"{key} is on the meta device; materialize the model first")


def _load_model_rest(reader: CheckpointReader, model: torch.nn.Module) -> None:
    path = reader.path / reader.meta.model_rest  # type: ignore[operator]
    file = reader.rest_file()  # the file checked before anything changed
    targets = dict(model.state_dict(keep_vars=True))
    unknown = []
    with torch.no_grad():
        for key, info in file.tensors.items():
            target = targets.get(key)
            if target is None:
                unknown.append(key)
                continue
            out = torch.empty(info.numel, dtype=info.dtype)
            file.read_into(key, 0, out, None)
            target.copy_(out.view(info.shape))
    if unknown:
        logger.warning("%s: %d saved tensors the model lacks: %s", path, len(unknown), unknown[:5])


@torch.no_grad()
def load_flat_params(
    flat: FlatParams,
    directory: str | Path,
    tag: str | None = None,
    *,
    rename: Callable[[str], str] | Mapping[str, str] | None = None,
    strict: bool = True,
    verify: bool = True,
) -> LoadResult:
    """Load only the weights of a checkpoint into ``FlatParams`` (no optimizer needed).

    Each rank reads its slices of the saved fp32 masters (checked against their checksums
    as read, unless not ``verify``), writes them into its master shard (if built) and its
    slice of every bucket (cast to the bucket dtype), and an all-gather fills the rest of
    every bucket. Collective.
    """
    t0 = time.perf_counter()
    control_group(flat.process_group)  # created (collective) now, not while some rank reads
    shards: list[torch.Tensor] = []
    with _every_rank_reads(flat.process_group) as reading:
        reader = CheckpointReader(directory, tag)
        plans = reader.plan(flat.layout, flat.rank, rename=rename, strict=strict)
        for group, plan in zip(flat.groups, plans, strict=True):
            shard = torch.zeros(plan.shard_numel, dtype=torch.float32)
            if plan.missing:
                current = torch.cat(
                    [group.bucket_shard(b).float().cpu() for b in range(len(group.buckets))]
                )
                shard.copy_(current)
            try:
                reader.read(plan, MASTER, shard, verify=verify)
            except CheckpointDamaged as error:
                reader.raise_if_replaced(error)  # the tag replaced meanwhile: not damaged
                raise
            shards.append(shard)
        reading.wait_bytes = sum(s.numel() for s in shards) * 4
    agree_on_checkpoint(reader, flat.process_group)
    flat.before_state_changes()  # an asynchronous save still copying the masters
    for group, shard in zip(flat.groups, shards, strict=True):
        shard = shard.to(group.device)
        if group.master is not None:
            group.master.copy_(shard)
        layouts = group.layout.buckets
        all_gather_buckets_from_own_slices(
            group.buckets,
            [group.bucket_shard(b) for b in range(len(layouts))],
            flat.process_group,
            sources=[shard[b.shard_offset : b.shard_offset + b.slice_numel] for b in layouts],
        )
    reader.close()
    meta = reader.meta
    return LoadResult(
        tag=reader.tag,
        path=reader.path,
        saved_world_size=meta.world_size,
        resharded=meta.layout.digest() != flat.layout.digest(),
        step=None,
        extra=decode_value(meta.extra),
        elements_read=sum(s.numel() for s in shards),
        seconds=time.perf_counter() - t0,
    )
