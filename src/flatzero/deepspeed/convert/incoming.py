"""``from_deepspeed``: a DeepSpeed ZeRO-1/2 checkpoint as a flatzero checkpoint.

``flatzero.deepspeed.reader`` says where each param's elements lie in DeepSpeed's files; this
module plans a flatzero layout over the same params, copies masters and every
per-element optimizer state into it through the same resharding plans as a flatzero
load (rank file by rank file, reading only the needed slices), and carries over the
scalar state: ``step`` and hyperparameters, the loss scale, the LR scheduler, buffers and
frozen params, DeepSpeed's counters and the client state.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...checkpoint.atomic import staged_directory, write_latest
from ...checkpoint.format import (
    MASTER,
    MODEL_REST,
    CheckpointMeta,
    FileRecord,
    GroupRecord,
    check_tag,
    encode_value,
    state_key,
)
from ...checkpoint.reshard import GroupReadPlan, execute, plan_reads
from ...checkpoint.writer import LazyTensor, write_rank_file, write_tensors
from ...config import DEFAULT_BUCKET_NUMEL
from ...layout import DEFAULT_ALIGNMENT, Layout, plan_layout
from ...progress import progress_bar
from ..reader import DeepSpeedCheckpoint, read_deepspeed
from ..state import flatzero_loss_scaler, flatzero_scheduler

__all__ = [
    "from_deepspeed",
]

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from tqdm import tqdm


def _loss_scaler(ds: DeepSpeedCheckpoint) -> dict[str, Any] | None:
    skipped = int(ds.model_states.get("skipped_steps", 0) or 0)
    half = any(g.dtype != "float32" for g in ds.layout.groups)
    return flatzero_loss_scaler(ds.optim_state(0).get("loss_scaler"), skipped, half=half)


def _rest(ds: DeepSpeedCheckpoint) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    module = ds.model_states["module"]
    trained = ds.param_names
    shared = dict(ds.model_states.get("shared_params") or {})
    rest = {}
    for name, tensor in module.items():
        if name in trained or name in shared:
            continue
        if isinstance(tensor, torch.Tensor):
            rest[name] = tensor.detach().contiguous()
    aliases = {a: t for a, t in shared.items() if t in trained or t in rest}
    return rest, aliases


ENGINE_STATE_KEY = "flatzero_engine"
"""Key of the engine's counters in a checkpoint's ``extra`` (``flatzero.deepspeed.engine``'s)."""

_DS_MODEL_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
}


def _client_state(states: dict[str, Any]) -> dict[str, Any]:
    """The ``client_state`` a DeepSpeed user passed to ``save_checkpoint`` (JSON-able
    entries; DeepSpeed stores them beside its own keys)."""
    out = {}
    for key, value in states.items():
        if key in _DS_MODEL_KEYS:
            continue
        encoded = _json_or_none(value, f"client_state[{key!r}]")
        if encoded is not None or value is None:
            out[key] = encoded
    return out


def _json_or_none(value: Any, what: str) -> Any:
    try:
        return encode_value(value, what)
    except TypeError as error:
        logger.warning("not importing %s: %s", what, error)
        return None


def _layout(ds: DeepSpeedCheckpoint, world_size: int, bucket_numel: int) -> Layout:
    """A flatzero layout over DeepSpeed's groups and params."""
    specs = [[slot.spec for slot in g.slots] for g in ds.layout.groups]
    _check_world_size(world_size, ds, sum(s.numel for group in specs for s in group))
    return plan_layout(specs, world_size=world_size, bucket_numel=bucket_numel)


def _check_world_size(world_size: int, ds: DeepSpeedCheckpoint, numel: int) -> None:
    """Refuse, before anything is written, a world size with more ranks than the model
    has 64-element chunks (beyond DeepSpeed's own): their files would hold padding only."""
    limit = max(ds.world_size, -(-numel // DEFAULT_ALIGNMENT), 1)
    if not 1 <= world_size <= limit:
        raise ValueError(
            f"world size {world_size} for {numel} elements: every rank past {limit} would "
            f"write a file of padding only; pass a world size in [1, {limit}] (any loads at "
            "any world size)"
        )


def _group_records(ds: DeepSpeedCheckpoint, layout: Layout) -> list[GroupRecord]:
    """Per layout group, its state names, scalar state and hyperparameters (rank 0's)."""
    records = []
    for gl in layout.groups:
        gi = gl.group_index
        inner = ds.inner_state(0, gi)
        tensor_states = [k for k, v in inner.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        scalars = {
            k: encode_value(v, f"optimizer state {k!r}")
            for k, v in inner.items()
            if k not in tensor_states
        }
        hyper = {k: encode_value(v, f"hyperparameter {k!r}") for k, v in ds.hyperparams(gi).items()}
        records.append(GroupRecord((MASTER, *tensor_states), scalars, hyper))
    return records


def _state_shard(
    ds: DeepSpeedCheckpoint, plan: GroupReadPlan, state: str, last_read: bool
) -> torch.Tensor:
    """One optimizer state (or the master) of one group of one output rank, read from
    DeepSpeed's partitions; ``last_read``: the DeepSpeed files it read are closed after."""
    out = torch.zeros(plan.shard_numel, dtype=torch.float32)
    execute(plan, out, ds.fetcher(state))
    if last_read:
        ds.close_files()
    return out


def _write_rank_files(
    ds: DeepSpeedCheckpoint,
    layout: Layout,
    records: list[GroupRecord],
    tmp: Path,
    tag: str,
    checksums: bool,
    progress: tqdm,
) -> list[FileRecord]:
    """Every rank file of ``layout``, each copied from DeepSpeed's partitions.

    [Note: the import's memory bound] A rank file is written one tensor (one state of one
    group) at a time, each made just before it is written and dropped after
    (``LazyTensor``), and the DeepSpeed files (memory-mapped) are closed after the last
    tensor of each rank file. Peak host memory: the pages of the DeepSpeed rank files that
    one output rank file reads from (one file at the same world size, a few at another)
    plus one state of one group of that output rank, whatever the checkpoint's size."""
    index = ds.index()
    files = []
    for rank in range(layout.world_size):
        plans = plan_reads(index, layout, rank, where=str(ds.path))
        tensors: list[tuple[str, torch.Tensor | LazyTensor]] = []
        for gi, plan in enumerate(plans):
            for si, state in enumerate(records[gi].states):
                last = gi == len(plans) - 1 and si == len(records[gi].states) - 1
                make = functools.partial(_state_shard, ds, plan, state, last)
                lazy = LazyTensor(torch.float32, (plan.shard_numel,), make)
                tensors.append((state_key(gi, state), lazy))
        files.append(
            write_rank_file(
                tmp,
                rank,
                layout.world_size,
                tensors,
                layout_digest=layout.digest(),
                tag=tag,
                checksums=checksums,
                progress=progress,
            )
        )
    return files


def _extra(ds: DeepSpeedCheckpoint) -> dict[str, Any]:
    """The checkpoint's ``extra``: the engine's counters, the client state, DeepSpeed's."""
    states = ds.model_states
    accumulation = int((states.get("ds_config") or {}).get("gradient_accumulation_steps", 1))
    steps = int(states.get("global_steps") or 0)
    return {
        # The engine's counters, under the key flatzero's Engine reads them from.
        ENGINE_STATE_KEY: {
            "global_steps": steps,
            "global_samples": int(states.get("global_samples") or 0),
            "micro_steps": steps * max(1, accumulation),
            "skipped_steps": int(states.get("skipped_steps") or 0),
        },
        "client_state": _client_state(states),
        "deepspeed": {
            "tag": ds.tag,
            "world_size": ds.world_size,
            "stage": ds.stage,
            "global_steps": states.get("global_steps"),
            "global_samples": states.get("global_samples"),
            "skipped_steps": states.get("skipped_steps"),
            "ds_version": states.get("ds_version"),
            "clip_grad": ds.optim_state(0).get("clip_grad"),
        },
    }


def _write_checkpoint(
    ds: DeepSpeedCheckpoint,
    layout: Layout,
    tmp: Path,
    tag: str,
    checksums: bool,
    progress: bool,
) -> CheckpointMeta:
    """Write the rank files and the model's rest into ``tmp``; the checkpoint's meta.
    ``progress``: a bar of the bytes written (``flatzero.progress``)."""
    records = _group_records(ds, layout)
    total = 4 * sum(len(records[i].states) * g.numel for i, g in enumerate(layout.groups))
    with progress_bar(total, "import-deepspeed", "B", wanted=progress, scale=True) as bar:
        files = _write_rank_files(ds, layout, records, tmp, tag, checksums, bar)
    rest, aliases = _rest(ds)
    rest_record = None
    if rest:
        rest_record = write_tensors(
            tmp / MODEL_REST, list(rest.items()), {"format": "pt"}, checksums=checksums
        )
    version = ds.model_states.get("ds_version", "?")
    scheduler = ds.model_states.get("lr_scheduler")
    return CheckpointMeta(
        tag=tag,
        layout=layout,
        groups=tuple(records),
        files=tuple(files),
        optimizer=None,
        stage=ds.stage,
        loss_scaler=_loss_scaler(ds),
        scheduler=_json_or_none(flatzero_scheduler(scheduler), "lr_scheduler")
        if scheduler
        else None,
        extra=_json_or_none(_extra(ds), "extra") or {},
        model_rest=rest_record.file if rest_record is not None else None,
        rest_record=rest_record,
        aliases=aliases,
        source=f"deepspeed {version}",
        versions={"deepspeed": str(version), "torch": torch.__version__},
    )


def from_deepspeed(
    ds_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    out_tag: str | None = None,
    world_size: int | None = None,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
    checksums: bool = True,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a DeepSpeed ZeRO-1/2 checkpoint into a flatzero checkpoint.

    The result loads with ``load_checkpoint`` at any world size, optimizer states
    included (fp32 masters, ``exp_avg``/``exp_avg_sq``/``step``, DeepSpeed's Muon
    ``momentum_buffer`` (``flatzero.deepspeed.muon_state``) and the torch optimizer's
    hyperparameters, loss scale, LR scheduler state). DeepSpeed's ``global_steps``,
    ``global_samples`` and ``skipped_steps`` land in the checkpoint's ``extra``
    (``LoadResult.extra["deepspeed"]``).

    Args:
        ds_dir: DeepSpeed's checkpoint directory (with ``latest``) or one tag directory.
        out_dir: flatzero checkpoint directory to write into (``out_dir/<tag>``, ``latest``).
        tag: DeepSpeed tag to import; ``None`` follows ``latest``.
        out_tag: tag of the flatzero checkpoint; default DeepSpeed's.
        world_size: ranks of the written layout; default DeepSpeed's data-parallel size
            (any value loads at any world size; this only sets how many files).
        bucket_numel: bucket size of the written layout (elements).
        checksums: record crc32 checksums.
        overwrite: replace an existing flatzero checkpoint of that tag.
        progress: a bar of the bytes written on stderr, where ``flatzero.progress`` shows
            one (a terminal; ``FLATZERO_PROGRESS``).

    Peak host memory is bounded by one DeepSpeed rank file and one optimizer state of one
    group of an output rank, not by the checkpoint (see ``_write_rank_files``).

    Returns:
        The new checkpoint's path.
    """
    t0 = time.perf_counter()
    ds = read_deepspeed(ds_dir, tag)
    out_tag = check_tag(out_tag or ds.tag)
    layout = _layout(ds, world_size or ds.world_size, bucket_numel)
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / out_tag
    if final.exists() and not overwrite:
        raise ValueError(f"{final} already exists; choose another out_tag or pass overwrite=True")
    with staged_directory(final, overwrite=overwrite) as tmp:
        _write_checkpoint(ds, layout, tmp, out_tag, checksums, progress).write(tmp / "meta.json")
    write_latest(root, out_tag)
    logger.info(
        "imported DeepSpeed ZeRO-%d checkpoint %s (%d ranks, %d params) as %s in %.1f s",
        ds.stage,
        ds.path,
        ds.world_size,
        ds.layout.num_params,
        final,
        time.perf_counter() - t0,
    )
    return final
