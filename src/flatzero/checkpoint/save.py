"""``save_checkpoint``: every rank writes its own shard file; the directory appears complete.

Protocol (collective; every rank of the optimizer's process group calls it):

1. The ranks agree on the tag and on rank 0's random nonce.
2. Rank 0 creates ``DIR/.tmp-<tag>-<nonce>/`` (and removes stale ``.tmp-*`` left by
   killed saves). All ranks learn whether that worked.
3. Every rank writes and fsyncs its rank file there (its master and optimizer-state
   shards, optionally its RNG states); rank 0 also writes the model's frozen params and
   buffers when a model is given. Nothing is gathered: each rank writes its own shard.
4. Rank 0 collects the small file records, writes ``meta.json``, fsyncs, renames the
   directory to ``DIR/<tag>/`` and then points ``DIR/latest`` at it.

An error on any rank makes every rank raise and rank 0 remove the temporary directory; a
process killed mid-save leaves only the ``.tmp-*`` directory, which loaders ignore.

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..comm import world_size_of
from ..control import agree_on_error, control_group, wait_for_host_work
from .atomic import publish, remove_stale_tmp, tmp_dir_name, write_latest
from .config import SaveConfig
from .format import (
    MODEL_REST,
    CheckpointMeta,
    FileRecord,
    available_tags,
    check_tag,
    encode_value,
    read_latest,
    state_key,
)
from .optimizer_state import capture_optimizer
from .rng import capture_rng
from .writer import fault_point, model_extras, write_rank_file, write_tensors

__all__ = ["save_checkpoint", "save_nbytes"]

logger = logging.getLogger(__name__)


def _versions() -> dict[str, str]:
    import flatzero

    return {"flatzero": flatzero.__version__, "torch": torch.__version__}


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


def _all_ok(error: BaseException | None, group: dist.ProcessGroup | None, what: str) -> None:
    """Raise on every rank if ``error`` happened on any rank (on the control group)."""
    agree_on_error(
        error, group, f"saving the checkpoint failed on another rank while {what} (see its error)"
    )


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def save_nbytes(optimizer: Any, model: torch.nn.Module | None = None) -> int:
    """About how many bytes ``save_checkpoint(..., optimizer, model=model)`` writes on rank 0:
    its master and per-element optimizer-state shards, and the model's frozen params and
    buffers (no collective, nothing copied)."""
    sd = optimizer.state_dict()
    shards = list(sd["master"])
    for state in sd["optimizer"]["state"].values():
        shards += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    nbytes = _tensor_bytes(shards)
    if model is not None:
        flat = optimizer.flat
        ids = {id(p): n for g in flat.groups for n, p in zip(g.names, g.params, strict=True)}
        with contextlib.suppress(ValueError):  # meta tensors: save_checkpoint says so
            nbytes += _tensor_bytes(model_extras(model, ids)[0].values())
    return nbytes


def _prune(root: Path, keep_last: int, keep: set[str]) -> None:
    """Remove the oldest complete checkpoints so that ``keep_last`` remain."""
    tags = sorted(available_tags(root), key=lambda t: (root / t / "meta.json").stat().st_mtime)
    for tag in tags[: max(0, len(tags) - keep_last)]:
        if tag in keep:
            continue
        doomed = root / tmp_dir_name(tag, "pruned-" + secrets.token_hex(3))
        (root / tag).rename(doomed)  # disappears as a whole, then is deleted
        shutil.rmtree(doomed, ignore_errors=True)
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
) -> Path:
    """Save a ZeRO checkpoint: each rank writes its shard; loadable at any world size.

    Collective: call on every rank of the optimizer's process group with the same
    ``directory`` (on a file system every rank sees) and ``tag``.

    Args:
        directory: the checkpoint directory (created if needed); the checkpoint goes to
            ``directory/tag`` and ``directory/latest`` names it.
        optimizer: a ``ZeroOptimizer`` (anything with ``flat``, ``state_dict()``,
            ``param_groups``).
        tag: the checkpoint's name; default ``step<N>`` from the optimizer's step count.
        scheduler: an LR scheduler (or anything with a JSON-able ``state_dict()``).
        model: the model; its frozen params and persistent buffers are saved too (from
            rank 0), and its param names and tied aliases are recorded for export.
        extra: JSON-able client state (e.g. ``{"epoch": 3, "samples": 12800}``) returned
            by ``load_checkpoint``.
        config: ``SaveConfig`` (RNG states, checksums, overwrite, keep_last, ...).

    Returns:
        The path of the new checkpoint, ``directory/tag``.

    Raises:
        ValueError: the tag exists (without ``overwrite``), tags differ between ranks, or
            a state cannot be stored (named); nothing is published.
        OSError: writing failed on some rank; nothing is published.
    """
    config = config or SaveConfig()
    t0 = time.perf_counter()
    flat = optimizer.flat
    group = flat.process_group
    rank, world_size = flat.rank, flat.world_size
    layout = flat.layout
    root = Path(directory)
    control_group(group)  # created (collective) now, not while some rank writes

    error: BaseException | None = None
    captured = None
    rest: dict[str, torch.Tensor] = {}
    model_names: dict[str, str] = {}
    aliases: dict[str, str] = {}
    scheduler_state = None
    extra_state: Any = {}
    try:
        captured = capture_optimizer(optimizer)
        if tag is None:
            tag = f"step{captured.step or 0}"
        check_tag(tag)
        if scheduler is not None:
            scheduler_state = encode_value(scheduler.state_dict(), "scheduler.state_dict()")
        if extra is not None:
            extra_state = encode_value(extra, "extra")
        if model is not None:
            ids = {id(p): n for g in flat.groups for n, p in zip(g.names, g.params, strict=True)}
            rest, model_names, aliases = model_extras(model, ids)
    except (ValueError, TypeError) as e:
        error = e
    _all_ok(error, group, "collecting the state to save")
    assert captured is not None and tag is not None
    tag, nonce = _agree_tag(tag, group)
    tmp = root / tmp_dir_name(tag, nonce)
    final = root / tag

    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            if final.exists() and not config.overwrite:
                raise ValueError(
                    f"checkpoint {final} already exists; choose another tag or save with "
                    "SaveConfig(overwrite=True)"
                )
            if config.stale_tmp_age_s is not None:
                remove_stale_tmp(root, keep=tmp.name, min_age_s=config.stale_tmp_age_s)
            tmp.mkdir()
        except (OSError, ValueError) as e:
            error = e
    wait_for_host_work(group, 0)  # rank 0 may be removing stale directories
    _all_ok(error, group, f"creating {tmp}")

    record: FileRecord | None = None
    rest_record: FileRecord | None = None
    # The most any rank writes: rank 0 its shards (every rank's are the same size) and the
    # model's rest.
    written = _tensor_bytes(t for pairs in captured.tensors for _, t in pairs)
    written += _tensor_bytes(rest.values())
    try:
        tensors = [
            (state_key(gi, name), t)
            for gi, pairs in enumerate(captured.tensors)
            for name, t in pairs
        ]
        metadata: dict[str, str] = {}
        if config.save_rng:
            rng_tensors, metadata = capture_rng()
            tensors += rng_tensors
        record = write_rank_file(
            tmp,
            rank,
            world_size,
            tensors,
            layout_digest=layout.digest(),
            tag=tag,
            metadata=metadata,
            checksums=config.checksums,
        )
        if rank == 0 and rest:
            rest_record = write_tensors(  # device tensors stream through two host chunks
                tmp / MODEL_REST,
                list(rest.items()),
                {"format": "pt", "tag": tag},
                checksums=config.checksums,
            )
    except (OSError, ValueError, TypeError) as e:
        error = e
    try:
        wait_for_host_work(group, written)
        _all_ok(error, group, f"writing its rank file into {tmp}")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    records: list[Any] = [record]
    if world_size_of(group) > 1:
        records = [None] * world_size
        dist.all_gather_object(records, record, group=control_group(group))

    if rank == 0:
        try:
            meta = CheckpointMeta(
                tag=tag,
                layout=layout,
                groups=tuple(captured.groups),
                files=tuple(records),
                optimizer=captured.optimizer,
                stage=captured.stage,
                loss_scaler=captured.loss_scaler,
                scheduler=scheduler_state,
                extra=extra_state,
                rng=config.save_rng,
                model_rest=rest_record.file if rest_record is not None else None,
                model_names=model_names,
                aliases=aliases,
                versions=_versions(),
                bucket_order=captured.bucket_order,
            )
            meta.write(tmp / "meta.json")
            fault_point("before_publish", rank)
            publish(tmp, final, overwrite=config.overwrite)
            if config.update_latest:
                write_latest(root, tag)
            if config.keep_last is not None:
                keep = {tag}
                with contextlib.suppress(ValueError):
                    keep.add(read_latest(root))
                _prune(root, config.keep_last, keep)
        except (OSError, ValueError, TypeError) as e:
            error = e
            shutil.rmtree(tmp, ignore_errors=True)
    wait_for_host_work(group, 0)  # rank 0 writes meta.json, renames and prunes
    _all_ok(error, group, f"publishing {final}")
    if rank == 0:
        total = sum(r.bytes for r in records)
        logger.info(
            "saved checkpoint %s: %d rank files, %.1f MiB, %.2f s",
            final,
            world_size,
            total / 2**20,
            time.perf_counter() - t0,
        )
    return final
