"""``save_checkpoint``: every rank writes its own shard file; the directory appears complete.

Protocol (collective; every rank of the optimizer's process group calls it):

1. The ranks agree on the tag and on rank 0's random nonce.
2. Rank 0 creates ``DIR/.tmp-<tag>-<nonce>/`` (first putting back a tag that a save
   killed while replacing it lost, see ``recovery``, and removing stale ``.tmp-*`` left by
   killed saves). All ranks learn whether that worked.
3. Every rank writes and fsyncs its rank file there (its master and optimizer-state
   shards, optionally its RNG states); rank 0 also writes the model's frozen params and
   buffers when a model is given. Nothing is gathered: each rank writes its own shard.
4. Rank 0 collects the small file records, writes ``meta.json``, fsyncs, renames the
   directory to ``DIR/<tag>/`` (exchanges it with an existing one, ``atomic.publish``)
   and then points ``DIR/latest`` at it.

An error on any rank makes every rank raise and rank 0 remove the temporary directory; a
process killed mid-save leaves only the ``.tmp-*`` directory, which loaders ignore.

With ``asynchronous=True``, steps 3 and 4 run in a background thread of every rank from a
copy of the rank's tensors in host memory, and the ranks meet through marks in the
temporary directory instead of collectives (``async_save``).

Every agreement (the tag, errors, the file records) runs on the process group's control
group (``flatzero.control``: gloo, never queued behind GPU work or the NCCL watchdog).
Where ranks wait for writing (their own and rank 0's files, rank 0's publishing), they
first meet in ``wait_for_host_work`` with a timeout that fits the bytes written, then take
the quick error agreement.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .._version import __version__
from ..comm import world_size_of
from ..control import (
    control_group,
    host_work_timeout,
    raise_if_any_failed,
    wait_for_host_work,
)
from ..storage.image import FileImage
from .async_save import Hasher, Staging, collect_marks, mark, snapshot, start, wait_for_save
from .atomic import (
    fault_point,
    publish,
    remove_in_background,
    remove_stale_tmp,
    tmp_dir_name,
    write_latest,
)
from .config import SaveConfig
from .format import (
    MODEL_REST,
    CheckpointMeta,
    FileRecord,
    available_tags,
    check_tag,
    encode_value,
    rank_file_name,
    read_latest,
)
from .optimizer_state import CapturedState, capture
from .recovery import copy_of_lost, restore_lost
from .rng import capture_rng
from .writer import (
    model_extras,
    rank_file_metadata,
    write_image_file,
    write_rank_file,
    write_tensors,
)

__all__ = ["save_checkpoint", "save_nbytes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Collected:
    """What a save writes, collected and checked before any file is touched.

    Attributes:
        captured: the optimizer's state, split for the format (references).
        tag: this rank's tag for the checkpoint (the ranks agree on it next).
        scheduler: the LR scheduler's ``state_dict()``, encoded, or None.
        extra: the user's client state, encoded (``{}`` when none).
        rest: the model's frozen params and buffers by name (rank 0 writes them).
        model_names: layout param name -> the model's name, where they differ.
        aliases: second names of tied params -> the name they are stored under.
    """

    captured: CapturedState
    tag: str
    scheduler: Any
    extra: Any
    rest: dict[str, torch.Tensor]
    model_names: dict[str, str]
    aliases: dict[str, str]


@dataclass(frozen=True)
class _Files:
    """What this rank writes: its rank file's tensors (state shards, then RNG states) and
    metadata, and on rank 0 the model's rest. Live tensors for a synchronous save, their
    copies in host memory for an asynchronous one."""

    tensors: list[tuple[str, torch.Tensor]]
    metadata: dict[str, str]
    rest: list[tuple[str, torch.Tensor]]


def _versions() -> dict[str, str]:
    return {"flatzero": __version__, "torch": torch.__version__}


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _layout_names(flat: Any) -> dict[int, str]:
    """``id(param) -> name in the layout`` of every flattened param."""
    return {id(p): n for g in flat.groups for n, p in zip(g.names, g.params, strict=True)}


def _all_ok(error: BaseException | None, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise on every rank if ``error`` happened on any rank (on the control group)."""
    raise_if_any_failed(
        error, group, f"saving the checkpoint failed on another rank while {what} (see its error)"
    )


def save_nbytes(optimizer: Any, model: torch.nn.Module | None = None) -> int:
    """About how many bytes ``save_checkpoint(..., optimizer, model=model)`` writes on rank 0:
    its master and per-element optimizer-state shards, and the model's frozen params and
    buffers (no collective, nothing copied)."""
    groups = optimizer.sharded_state().groups
    nbytes = _tensor_bytes([t for g in groups for t in (g.master, *g.shards.values())])
    if model is not None:
        with contextlib.suppress(ValueError):  # meta tensors: save_checkpoint says so
            rest = model_extras(model, _layout_names(optimizer.flat))[0]
            nbytes += _tensor_bytes(rest.values())
    return nbytes


def _collect(
    optimizer: Any, tag: str | None, scheduler: Any, model: torch.nn.Module | None, extra: Any
) -> _Collected:
    """Everything this rank saves (no copy).

    Raises:
        ValueError / TypeError: an unusable tag, or a state the format cannot hold.
    """
    captured = capture(optimizer.sharded_state())
    rest: dict[str, torch.Tensor] = {}
    model_names: dict[str, str] = {}
    aliases: dict[str, str] = {}
    if model is not None:
        rest, model_names, aliases = model_extras(model, _layout_names(optimizer.flat))
    return _Collected(
        captured=captured,
        tag=check_tag(tag if tag is not None else f"step{captured.state.step or 0}"),
        scheduler=(
            encode_value(scheduler.state_dict(), "scheduler.state_dict()")
            if scheduler is not None
            else None
        ),
        extra=encode_value(extra, "extra") if extra is not None else {},
        rest=rest,
        model_names=model_names,
        aliases=aliases,
    )


def _agree_tag(tag: str, group: dist.ProcessGroup | None) -> tuple[str, str]:
    """Every rank's tag must be the same; returns it and rank 0's nonce (gathered on the
    control group of ``group``)."""
    nonce = secrets.token_hex(6)
    if world_size_of(group) == 1:
        return tag, nonce
    values: list[Any] = [None] * world_size_of(group)
    dist.all_gather_object(values, (tag, nonce), group=control_group(group))
    tags = {t for t, _ in values}
    if len(tags) != 1:
        raise ValueError(
            f"ranks passed different checkpoint tags ({sorted(tags)[:4]}); pass the same tag "
            "on every rank (or none: the default is derived from the optimizer step)"
        )
    return tag, values[0][1]


def _create_tmp(root: Path, tmp: Path, final: Path, flat: Any, config: SaveConfig) -> None:
    """Rank 0 creates the temporary directory (removing stale ones first); every rank
    learns whether that worked."""
    error: BaseException | None = None
    if flat.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            restore_lost(root)
            if final.exists() and not config.overwrite:
                raise ValueError(
                    f"checkpoint {final} already exists; choose another tag or save with "
                    "SaveConfig(overwrite=True)"
                )
            if config.stale_tmp_age_s is not None:
                remove_stale_tmp(
                    root, keep=tmp.name, min_age_s=config.stale_tmp_age_s, protected=copy_of_lost
                )
            tmp.mkdir()
        except (OSError, ValueError) as e:
            error = e
    wait_for_host_work(flat.process_group, 0)  # rank 0 may be removing stale directories
    _all_ok(error, flat.process_group, f"creating {tmp}")


def _files(collected: _Collected, flat: Any, config: SaveConfig) -> _Files:
    """What this rank writes (its RNG states captured now, with ``save_rng``)."""
    tensors = list(collected.captured.tensors)
    metadata: dict[str, str] = {}
    if config.save_rng:
        rng_tensors, metadata = capture_rng()
        tensors += rng_tensors
    rest = list(collected.rest.items()) if flat.rank == 0 else []
    return _Files(tensors, metadata, rest)


def _write_files(
    tmp: Path, tag: str, files: _Files, flat: Any, config: SaveConfig
) -> tuple[FileRecord, FileRecord | None]:
    """Write this rank's file (and, on rank 0, the model's rest) into ``tmp``; their
    records."""
    record = write_rank_file(
        tmp,
        flat.rank,
        flat.world_size,
        files.tensors,
        layout_digest=flat.layout.digest(),
        tag=tag,
        metadata=files.metadata,
        checksums=config.checksums,
    )
    rest_record = None
    if files.rest:
        rest_record = write_tensors(  # device tensors stream through two host chunks
            tmp / MODEL_REST, files.rest, {"format": "pt", "tag": tag}, checksums=config.checksums
        )
    return record, rest_record


def _write_everywhere(
    tmp: Path, tag: str, collected: _Collected, files: _Files, flat: Any, config: SaveConfig
) -> tuple[list[Any], FileRecord | None]:
    """Every rank writes its files and all agree that they did; returns every rank's file
    record (in rank order) and the model rest's. On any failure rank 0 removes ``tmp``."""
    error: BaseException | None = None
    record = rest_record = None
    try:
        record, rest_record = _write_files(tmp, tag, files, flat, config)
    except (OSError, ValueError, TypeError) as e:
        error = e
    group = flat.process_group
    try:
        # Allow for the most any rank writes: rank 0 its shards (every rank's are the same
        # size) and the model's rest.
        wait_for_host_work(group, _written_at_most(collected))
        _all_ok(error, group, f"writing its rank file into {tmp}")
    except BaseException:
        if flat.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if world_size_of(group) == 1:
        return [record], rest_record
    records: list[Any] = [None] * flat.world_size
    dist.all_gather_object(records, record, group=control_group(group))
    return records, rest_record


def _meta(
    collected: _Collected,
    tag: str,
    records: list[Any],
    rest_record: FileRecord | None,
    flat: Any,
    config: SaveConfig,
) -> CheckpointMeta:
    """The checkpoint's ``meta.json`` (rank 0 writes it)."""
    return collected.captured.meta(
        tag=tag,
        layout=flat.layout,
        files=tuple(records),
        scheduler=collected.scheduler,
        extra=collected.extra,
        rng=config.save_rng,
        model_rest=rest_record.file if rest_record is not None else None,
        rest_record=rest_record,
        model_names=collected.model_names,
        aliases=collected.aliases,
        versions=_versions(),
        saved_at=time.time(),
    )


def _written_at_most(collected: _Collected) -> int:
    """Bytes the busiest rank writes: rank 0, its shards (every rank's are the same size)
    and the model's rest."""
    return _tensor_bytes([t for _, t in collected.captured.tensors] + list(collected.rest.values()))


def _publish_here(root: Path, tmp: Path, meta: CheckpointMeta, config: SaveConfig) -> None:
    """(Rank 0.) Write ``meta.json``, make ``tmp`` appear as ``root/<tag>``, point
    ``latest`` at it and prune old checkpoints; on failure remove ``tmp`` and raise."""
    try:
        meta.write(tmp / "meta.json")
        fault_point("before_publish", 0)
        publish(tmp, root / meta.tag, overwrite=config.overwrite)
        fault_point("before_latest", 0)
        if config.update_latest:
            write_latest(root, meta.tag)
        if config.keep_last is not None:
            keep = {meta.tag}
            with contextlib.suppress(ValueError):
                keep.add(read_latest(root))
            _prune(root, config.keep_last, keep)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(root: Path, tmp: Path, meta: CheckpointMeta, flat: Any, config: SaveConfig) -> None:
    """Rank 0 publishes (``_publish_here``); every rank learns whether that worked."""
    error: BaseException | None = None
    if flat.rank == 0:
        try:
            _publish_here(root, tmp, meta, config)
        except (OSError, ValueError, TypeError) as e:
            error = e
    wait_for_host_work(flat.process_group, 0)  # rank 0 writes meta.json, renames and prunes
    _all_ok(error, flat.process_group, f"publishing {root / meta.tag}")


def _write_images(
    tmp: Path, images: list[FileImage], flat: Any, hasher: Hasher
) -> tuple[FileRecord, FileRecord | None]:
    """Write this rank's snapshot (its rank file, on rank 0 also the model's rest) into
    ``tmp``; their records, with the checksums ``hasher`` computes meanwhile."""
    record = write_image_file(tmp, images[0], sums=lambda: hasher.sums(0), rank=flat.rank)
    fault_point("rank_file_written", flat.rank)
    rest_record = None
    if len(images) > 1:
        rest_record = write_image_file(tmp, images[1], sums=lambda: hasher.sums(1))
    return record, rest_record


def _write_in_background(
    root: Path,
    tmp: Path,
    tag: str,
    collected: _Collected,
    images: list[FileImage],
    staging: Staging,
    flat: Any,
    config: SaveConfig,
) -> None:
    """(A background thread of every rank, at the caller's priority.) Once the snapshot is
    complete (its host chunks copied by an idle-priority ``Hasher`` or by the next step's
    fence), write this rank's files from it, take the hasher's checksums and leave a mark;
    rank 0 then waits for every rank's mark and publishes (removing ``tmp`` when any rank
    failed). Raises this rank's error, or on rank 0 any rank's."""
    error: BaseException | None = None
    record = rest_record = None
    hasher: Hasher | None = None
    try:
        hasher = Hasher(images, staging, config.checksums, flat.rank)
        staging.landed.wait()
        staging.wait_device_copies()
        record, rest_record = _write_images(tmp, images, flat, hasher)
    except Exception as e:  # every rank leaves its mark, or rank 0 waits for it in vain
        error = e
    if hasher is not None:
        hasher.join()
    mark(tmp, flat.rank, record, error)
    if flat.rank == 0:
        timeout = host_work_timeout(_written_at_most(collected)).total_seconds()
        try:
            records = collect_marks(tmp, flat.world_size, timeout)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if error is None:
            meta = _meta(collected, tag, records, rest_record, flat, config)
            _publish_here(root, tmp, meta, config)
            logger.info("saved checkpoint %s in the background", root / tag)
    if error is not None:
        raise error


def _start_in_background(
    root: Path,
    tmp: Path,
    tag: str,
    collected: _Collected,
    files: _Files,
    optimizer: Any,
    config: SaveConfig,
) -> None:
    """Lay this rank's files out in host memory and start copying them there (every rank
    agrees it could; rank 0 removes ``tmp`` if not), then finish the copies, write and
    publish in a background thread. The rank file's tensors (master and state shards) are
    held by the optimizer's next step or load until copied (``Staging``); the model's rest
    (buffers a forward pass may change) is copied before this returns (on an accelerator:
    the device's next work is queued after its copy)."""
    flat = optimizer.flat
    error: BaseException | None = None
    images: list[FileImage] = []
    staging: Staging | None = None
    meta = rank_file_metadata(flat.rank, flat.world_size, flat.layout.digest(), tag, files.metadata)
    wanted = [(rank_file_name(flat.rank, flat.world_size), files.tensors, meta)]
    if files.rest:
        wanted.append((MODEL_REST, files.rest, {"format": "pt", "tag": tag}))
    try:
        images, staging = snapshot(optimizer, wanted, deferrable=[True, False][: len(wanted)])
    except (RuntimeError, OSError) as e:  # out of host memory
        error = e
    try:
        _all_ok(error, flat.process_group, f"copying its shards into host memory for {tmp}")
        assert staging is not None
        fault_point("snapshot_taken", flat.rank)
        start(
            optimizer,
            lambda: _write_in_background(root, tmp, tag, collected, images, staging, flat, config),
            root / tag,
            flat.process_group,
        )
    except BaseException:
        if staging is not None:  # no device copy may still write the reused buffer
            staging.wait_device_copies()
        if flat.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    flat.hold_state_until(staging.fence)


def _prune(root: Path, keep_last: int, keep: set[str]) -> None:
    """Remove the oldest complete checkpoints so that ``keep_last`` remain."""
    tags = sorted(available_tags(root), key=lambda t: (root / t / "meta.json").stat().st_mtime)
    for tag in tags[: max(0, len(tags) - keep_last)]:
        if tag in keep:
            continue
        remove_in_background(root / tag)  # disappears as a whole, then is deleted
        logger.info("removed old checkpoint %s", root / tag)


def save_checkpoint(
    directory: str | Path,
    optimizer: Any,
    tag: str | None = None,
    *,
    scheduler: Any = None,
    model: torch.nn.Module | None = None,
    extra: Any = None,
    config: SaveConfig | None = None,
    asynchronous: bool = False,
) -> Path:
    """Save a ZeRO checkpoint: each rank writes its shard; loadable at any world size.

    Collective: call on every rank of the optimizer's process group with the same
    ``directory`` (on a file system every rank sees) and ``tag``. A previous asynchronous
    save of the optimizer is waited for first (its error raised here on every rank).

    Args:
        directory: the checkpoint directory (created if needed); the checkpoint goes to
            ``directory/tag`` and ``directory/latest`` names it.
        optimizer: a ``ZeroOptimizer`` (``flat``, ``sharded_state()``).
        tag: the checkpoint's name; default ``step<N>`` from the optimizer's step count.
        scheduler: an LR scheduler (or anything with a JSON-able ``state_dict()``).
        model: the model; its frozen params and persistent buffers are saved too (from
            rank 0), and its param names and tied aliases are recorded for export.
        extra: JSON-able client state (e.g. ``{"epoch": 3, "samples": 12800}``) returned
            by ``load_checkpoint``.
        config: ``SaveConfig`` (RNG states, checksums, overwrite, keep_last, ...).
        asynchronous: lay this rank's files out in reusable host memory, start copying
            its shards there and return; a background thread finishes the copies, writes
            and publishes (``async_save``; the next optimizer step waits for the copies
            only). The checkpoint appears once every rank's file is complete; the next
            save, load or ``wait_for_save`` waits for it.

    Returns:
        The path of the new checkpoint, ``directory/tag`` (after an asynchronous save:
        where it will appear).

    Raises:
        ValueError: the tag exists (without ``overwrite``), tags differ between ranks, or
            a state cannot be stored (named); nothing is published.
        OSError: writing failed on some rank; nothing is published.
    """
    config = config or SaveConfig()
    t0 = time.perf_counter()
    flat = optimizer.flat
    group = flat.process_group
    root = Path(directory)
    control_group(group)  # created (collective) now, not while some rank writes
    wait_for_save(optimizer)

    error: BaseException | None = None
    collected: _Collected | None = None
    try:
        collected = _collect(optimizer, tag, scheduler, model, extra)
    except (ValueError, TypeError) as e:
        error = e
    _all_ok(error, group, "collecting the state to save")
    assert collected is not None
    tag, nonce = _agree_tag(collected.tag, group)
    tmp = root / tmp_dir_name(tag, nonce)
    _create_tmp(root, tmp, root / tag, flat, config)
    files = _files(collected, flat, config)
    if asynchronous:
        _start_in_background(root, tmp, tag, collected, files, optimizer, config)
        return root / tag
    records, rest_record = _write_everywhere(tmp, tag, collected, files, flat, config)
    _publish(root, tmp, _meta(collected, tag, records, rest_record, flat, config), flat, config)
    if flat.rank == 0:
        logger.info(
            "saved checkpoint %s: %d rank files, %.1f MiB, %.2f s",
            root / tag,
            flat.world_size,
            sum(r.bytes for r in records) / 2**20,
            time.perf_counter() - t0,
        )
    return root / tag
