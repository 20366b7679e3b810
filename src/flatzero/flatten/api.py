"""``flatten_parameters``: build the flat, sharded buffers bucket by bucket.

The steps, in order: collect the param groups and plan the layout (``_plan``); agree on
the setup and choose the tier, every rank together (``_decide``); allocate the fp32
master shards; flatten each group bucket by bucket (``GroupFlattener``) and copy this
rank's slices into its master shard.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from .. import accel
from ..comm import check_same_everywhere, rank_of, world_size_of
from ..config import FlattenConfig
from ..cores import CoreShare, core_share, init_threads
from ..devices import resolve_device
from ..gcpause import paused_gc
from ..layout import GroupLayout, Layout, plan_layout
from ..own_groups import control_group
from ..params import ParamGroup, collect_param_groups
from ..process_group import join_launched_job
from ..progress import progress_bar
from ..report import GroupReport, ReportBuilder, report_is_owned
from ..storage.index import SafetensorsCheckpoint
from .alloc import allocate_masters
from .buffers import FlatGroup, FlatParams
from .choice import TierDecision, choose_tier
from .driver import GroupFlattener
from .registry import chain, spec, tiers_reading
from .source import CheckpointSource, NoValues, ParamSource, TensorSource
from .tiers import TierContext

__all__ = ["flatten_parameters"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    """What ``_plan`` found: the user's groups, the layout, and where values come from.

    Attributes:
        groups: the param groups as collected.
        layout: the layout of every (group, dtype).
        params_on: ``"device"``, ``"host"`` (also a checkpoint) or ``"meta"``
            (``allocate_only`` with params that hold no accelerator memory).
        keys: checkpoint key of every trainable param (None without a checkpoint).
        sizes: bytes of the layout's buffers.
    """

    groups: list[ParamGroup]
    layout: Layout
    params_on: str
    keys: dict[str, str] | None
    sizes: _Sizes


@dataclass(frozen=True)
class _Sizes:
    """Bytes of the layout's buffers, for the tier decision and the staging rings.

    Attributes:
        largest_bucket: the largest bucket of any group (bytes).
        total: all buckets of all groups (bytes).
        largest_slice: the largest rank slice of any bucket (bytes).
        shards: one fp32 shard of every group on this rank (bytes).
        buckets: number of buckets over all groups.
    """

    largest_bucket: int
    total: int
    largest_slice: int
    shards: int
    buckets: int

    @classmethod
    def of(cls, layout: Layout) -> _Sizes:
        buckets = [(b, getattr(torch, g.dtype).itemsize) for g in layout.groups for b in g.buckets]
        return cls(
            largest_bucket=max(b.numel * size for b, size in buckets),
            total=sum(b.numel * size for b, size in buckets),
            largest_slice=max(b.slice_numel * size for b, size in buckets),
            shards=sum(g.shard_numel for g in layout.groups) * 4,
            buckets=len(buckets),
        )


def _where_params_are(groups: list[ParamGroup]) -> tuple[str, torch.device]:
    """``("device" | "host" | "meta", device)``; raises if params are on several devices."""
    devices = {p.device for g in groups for p in g.params}
    if len(devices) > 1:
        names = sorted(str(d) for d in devices)
        raise ValueError(
            f"trainable params are on several devices ({', '.join(names)}); move the model to "
            "one device first (model.to(device)) or build it on the host"
        )
    (device,) = devices
    if device.type == "meta":
        raise ValueError(
            "params are on the meta device and no source of their values was given; "
            "materialize the model (model.to_empty(...) plus init, or load a checkpoint) first"
        )
    return ("host" if device.type == "cpu" else "device"), device


def _allocate_only_params_on(groups: list[ParamGroup]) -> str:
    """Where ``allocate_only`` finds the params: ``"device"`` when every one is on an
    accelerator (each bucket then replaces its params' storage, which is released as they
    are rebound), else ``"meta"`` (on the meta device or the host: every bucket is new
    device memory). Either way nothing is read and the buckets go straight to the target."""
    on_device = all(accel.is_accelerator(p.device) for g in groups for p in g.params)
    return "device" if on_device else "meta"


def _return_cached_blocks(flat_groups: list[FlatGroup]) -> None:
    """Give the device the blocks its caching allocator kept during the flatten, once, when
    the buckets are on an accelerator: the params' old storage, freed bucket by bucket,
    stays cached in per-param blocks that a first training step's larger requests cannot
    use (the step could run out of memory on a model whose init just fit)."""
    on_accelerator = [
        b.device for g in flat_groups for b in g.buckets if accel.is_accelerator(b.device)
    ]
    if on_accelerator:
        accel.empty_cache(on_accelerator[0])


def _checkpoint_keys(
    groups: list[ParamGroup],
    checkpoint: SafetensorsCheckpoint,
    key_map: Callable[[str], str] | None,
) -> dict[str, str]:
    """The checkpoint key of every trainable param; raises naming the first that is off."""
    keys = {}
    for g in groups:
        for name, p in zip(g.names, g.params, strict=True):
            key = key_map(name) if key_map is not None else name
            if key not in checkpoint:
                hint = " (the key_map maps it)" if key != name else ""
                raise ValueError(
                    f"param {name!r} has no tensor {key!r}{hint} in checkpoint "
                    f"{checkpoint.path}; pass key_map= to map model names to checkpoint keys"
                )
            entry = checkpoint.entries[key]
            if entry.numel != p.numel():
                raise ValueError(
                    f"param {name!r} has shape {tuple(p.shape)} but checkpoint tensor {key!r} "
                    f"in {entry.file} has shape {entry.shape}; the checkpoint is for another model"
                )
            keys[name] = key
    return keys


def _readable_by(config: FlattenConfig, source: str, what: str) -> None:
    """Raise unless ``config.tier`` can take bucket values from ``source``."""
    accepted = tiers_reading(source)
    if config.tier not in accepted:
        names = ", ".join(repr(t) for t in accepted[:-1]) + f" or {accepted[-1]!r}"
        raise ValueError(f"FlattenConfig.tier={config.tier!r} {what}; use {names}")


def _plan(
    params: Any,
    config: FlattenConfig,
    world_size: int,
    checkpoint: SafetensorsCheckpoint | None,
    key_map: Callable[[str], str] | None,
    allocate_only: bool,
) -> _Plan:
    """Collect the param groups, check where their values come from, plan the layout."""
    groups = collect_param_groups(params)
    keys = None
    if allocate_only:
        if checkpoint is not None:
            raise ValueError(
                "allocate_only=True reads no values but a checkpoint was given; pass one of them"
            )
        _readable_by(config, "nothing", "has nothing to stage with allocate_only=True")
        params_on = _allocate_only_params_on(groups)
    elif checkpoint is None:
        params_on, _ = _where_params_are(groups)
    else:
        _readable_by(config, "checkpoint", "cannot read from a checkpoint")
        keys = _checkpoint_keys(groups, checkpoint, key_map)
        params_on = "host"
    specs = [g.specs() for g in groups]
    if config.dtype is not None:  # cast while copying into the buckets
        specs = [[dataclasses.replace(s, dtype=config.dtype) for s in g] for g in specs]
    layout = plan_layout(
        specs,
        world_size=world_size,
        bucket_numel=config.bucket_numel,
        alignment=config.alignment,
        whole_params=config.whole_params,
    )
    return _Plan(groups, layout, params_on, keys, _Sizes.of(layout))


def _decide(
    plan: _Plan,
    config: FlattenConfig,
    device: torch.device,
    control: dist.ProcessGroup | None,
    *,
    world_size: int,
    shards_per_group: int,
) -> TierDecision:
    """Check every rank has the same setup, then choose the tier together."""
    layout = plan.layout
    if world_size_of(control) > 1:  # the digest hashes every param's entry: skip it alone
        check_same_everywhere(
            "the flatten setup",
            {
                "params": f"{layout.num_params} params, {layout.param_numel} elements",
                "layout digest": layout.digest(),
                "FlattenConfig": config.compared_text(),
                "buffer device type": device.type,
            },
            control,
        )
    sizes = plan.sizes
    decision = choose_tier(
        config.tier,
        params_on=plan.params_on,
        device=device,
        world_size=world_size,
        largest_bucket_bytes=sizes.largest_bucket,
        total_bytes=sizes.total,
        shard_bytes=sizes.shards * shards_per_group,
        group=control,
    )
    if config.tier_reason is not None and decision.tier == config.tier:
        decision = dataclasses.replace(decision, reason=config.tier_reason)  # not "requested"
    return decision


def _source(
    gl: GroupLayout,
    slot_params: tuple[torch.nn.Parameter, ...],
    plan: _Plan,
    checkpoint: SafetensorsCheckpoint | None,
    allocate_only: bool,
) -> ParamSource:
    """Where the group's bucket values come from."""
    if allocate_only:
        return NoValues(gl, slot_params)
    if checkpoint is None:
        return TensorSource(gl, slot_params)
    assert plan.keys is not None
    slot_keys = [plan.keys[slot.spec.name] for slot in gl.slots]
    return CheckpointSource(gl, slot_params, checkpoint, slot_keys)


def _copy_master(group: FlatGroup, report: ReportBuilder) -> None:
    """Copy this rank's slices of the group's buckets into its master shard."""
    master = group.master
    assert master is not None
    dsts = [master[b.shard_offset : b.shard_offset + b.slice_numel] for b in group.layout.buckets]
    srcs = [group.bucket_shard(b) for b in range(len(group.buckets))]
    torch._foreach_copy_(dsts, srcs)
    kind = "host_copy" if master.device.type == "cpu" else "device_copy"
    report.moved(kind, sum(s.nbytes for s in srcs))


def _tier_context(
    plan: _Plan,
    config: FlattenConfig,
    device: torch.device,
    group: dist.ProcessGroup | None,
    report: ReportBuilder,
) -> TierContext:
    """What every tier of this call shares (staging rings sized from the layout)."""
    sizes = plan.sizes
    return TierContext(
        device=device,
        rank=rank_of(group),
        world_size=world_size_of(group),
        group=group,
        report=report,
        staging_slots=config.staging_buffers,
        largest_bucket_bytes=sizes.largest_bucket,
        largest_slice_bytes=sizes.largest_slice,
        huge_pages=config.host_huge_pages,
    )


def _group_report(flat: FlatGroup, tier: str, bucket_tiers: list[str]) -> GroupReport:
    gl = flat.layout
    devices = {str(b.device) for b in flat.buckets}
    return GroupReport(
        group_index=gl.group_index,
        dtype=gl.dtype,
        tier=tier,
        bucket_tiers=tuple(bucket_tiers),
        params=len(gl.slots),
        elements=gl.param_numel,
        padding=gl.padding_numel,
        buckets=len(gl.buckets),
        device=devices.pop() if len(devices) == 1 else "mixed",
    )


def _flatten_groups(
    plan: _Plan,
    decision: TierDecision,
    masters: list[torch.Tensor | None],
    ctx: TierContext,
    control: dist.ProcessGroup | None,
    progress: tqdm,
    *,
    checkpoint: SafetensorsCheckpoint | None,
    allocate_only: bool,
) -> tuple[list[FlatGroup], list[GroupReport]]:
    """Flatten every group bucket by bucket; copy this rank's slices into its masters."""
    flat_groups: list[FlatGroup] = []
    reports: list[GroupReport] = []
    ordinal = 0
    for gl, master in zip(plan.layout.groups, masters, strict=True):
        user_group = plan.groups[gl.group_index]
        by_name = dict(zip(user_group.names, user_group.params, strict=True))
        slot_params = tuple(by_name[s.spec.name] for s in gl.slots)
        source = _source(gl, slot_params, plan, checkpoint, allocate_only)
        flattener = GroupFlattener(gl, source, ctx, control, ordinal, progress)
        with ctx.report.phase("flatten"):
            flattener.run(decision.tier)
        ordinal += len(gl.buckets)
        flat = FlatGroup(
            layout=gl,
            names=tuple(s.spec.name for s in gl.slots),
            params=slot_params,
            buckets=flattener.buffers,  # type: ignore[arg-type]
            options=dict(user_group.options),
            master=master,
            rank=ctx.rank,
        )
        if master is not None and not allocate_only:
            with ctx.report.phase("master"):
                _copy_master(flat, ctx.report)
        flat_groups.append(flat)
        reports.append(_group_report(flat, decision.tier, flattener.bucket_tiers))
    return flat_groups, reports


def _check_world_size(given: int | None, world_size: int) -> None:
    """Raise ``ValueError`` when the caller's ``world_size`` guard is not the group's."""
    if given is not None and given != world_size:
        raise ValueError(
            f"world_size={given} was given but the process group has {world_size} ranks; "
            "launch with the matching number of processes or drop the world_size argument"
        )


def _progress_bar(plan: _Plan, config: FlattenConfig, rank: int) -> tqdm:
    """Init's progress bar, one step per bucket: on rank 0, shown after two seconds."""
    return progress_bar(
        plan.sizes.buckets, "flatzero init", "bucket", rank=rank, wanted=config.progress,
        delay_s=2.0,
    )  # fmt: skip


def _agree(
    plan: _Plan,
    config: FlattenConfig,
    device: torch.device,
    agreement_group: dist.ProcessGroup | None,
    world_size: int,
    *,
    reserve_grad_shards: bool,
) -> tuple[dist.ProcessGroup | None, CoreShare, TierDecision, list[torch.Tensor | None]]:
    """The sync phase: the control group, this rank's core share, the tier every rank
    takes, and the master shards (allocated before the first bucket, so that running out of
    memory here changes nothing)."""
    # Every agreement runs on the gloo control group: no control tensor on a GPU.
    control = control_group(agreement_group)
    share = core_share(control)  # one all-gather: the ranks on this host
    decision = _decide(
        plan,
        config,
        device,
        control,
        world_size=world_size,
        shards_per_group=int(config.build_master and not config.master_on_host)
        + int(reserve_grad_shards),
    )
    on_host = spec(decision.tier).buffers_on_host or config.master_on_host
    master_device = torch.device("cpu") if on_host else device
    masters: list[torch.Tensor | None] = [None] * len(plan.layout.groups)
    if config.build_master:
        masters = list(
            allocate_masters(plan.layout, master_device, control, huge_pages=config.host_huge_pages)
        )
    return control, share, decision, masters


@paused_gc()
def flatten_parameters(
    params: Any,
    *,
    process_group: dist.ProcessGroup | None = None,
    config: FlattenConfig | None = None,
    world_size: int | None = None,
    checkpoint: SafetensorsCheckpoint | None = None,
    key_map: Callable[[str], str] | None = None,
    allocate_only: bool = False,
    agreement_group: dist.ProcessGroup | None = None,
    reserve_grad_shards: bool | None = None,
) -> FlatParams:
    """Flatten ``params`` into contiguous, sharded bucket buffers, in place.

    Every rank of ``process_group`` must call this with the same params (names, shapes,
    dtypes, groups) and config. Afterwards each param's ``.data`` is a view of its
    bucket holding bitwise the same values; its old storage is released; frozen params
    are untouched.

    Args:
        params: an ``nn.Module``, an iterable of params or ``(name, param)`` pairs, or a
            list of param-group dicts as ``torch.optim`` takes.
        process_group: ranks the buckets are sharded over; ``None`` uses the default group
            (made from the launcher's environment when torchrun started several processes
            and none made it: ``process_group.join_launched_job``), else a single rank.
        config: tier, target device, bucket size, ...; defaults to ``FlattenConfig()``.
        world_size: if given, must equal the process group's size (a guard for launchers).
        checkpoint: read the params' values from this safetensors checkpoint instead of
            the params (which may then be on the meta device): each rank reads only the
            bytes of its slices in the ``sharded`` tier, the all-gather fills the rest.
        key_map: maps a param name to its checkpoint key (default: the same name).
        allocate_only: allocate the buckets (and master shards) on the target device and
            make the params views of them without copying any values; the params may be
            on the meta device. Every bucket then holds garbage but its zeroed padding
            until the caller fills it, e.g. ``checkpoint.load_flat_params`` or
            ``ZeroOptimizer.load_state_dict``.
        agreement_group: the ranks that take every decision together (the layout check,
            the tier, the out-of-memory fallback); default ``process_group``. Replicated
            data parallelism (ZeRO stage 0) shards over a one-rank group per rank and
            decides over all of them.
        reserve_grad_shards: count an fp32 gradient shard per group (what
            ``ZeroOptimizer`` allocates next) in the memory the tier decision needs;
            default: when ``config.build_master`` is on.

    Returns:
        ``FlatParams`` owning the buffers, the layout, the master shards and the report.

    Raises:
        ValueError / TypeError: bad input (named in the message, nothing changed).
        MemoryError: on every rank, when the buckets and shards fit in no tier (every
            param keeps its data; on a GPU buffers never fall back to host memory).
        BucketFillError: on every rank, when reading or copying a bucket's values failed
            on some rank (each such rank and its error named; every param keeps its data).
    """
    config = config or FlattenConfig()
    if process_group is None:
        join_launched_job()  # under torchrun without a group: one job, never N copies
    rank, ws = rank_of(process_group), world_size_of(process_group)
    _check_world_size(world_size, ws)
    if reserve_grad_shards is None:
        reserve_grad_shards = config.build_master
    device = resolve_device(config.device, process_group)
    report = ReportBuilder(rank, ws, device)
    with report.phase("plan"):
        plan = _plan(params, config, ws, checkpoint, key_map, allocate_only)
    with report.phase("sync"):
        agreement = process_group if agreement_group is None else agreement_group
        control, share, decision, masters = _agree(
            plan, config, device, agreement, ws, reserve_grad_shards=reserve_grad_shards
        )
    ctx = _tier_context(plan, config, device, process_group, report)
    progress = _progress_bar(plan, config, rank)
    threads = max(spec(t).threads(config, share.threads) for t in chain(decision.tier, device))
    with init_threads(threads) as used, progress, closing(ctx):
        report.threads(share, used)
        flat_groups, group_reports = _flatten_groups(
            plan, decision, masters, ctx, control, progress,
            checkpoint=checkpoint, allocate_only=allocate_only,
        )  # fmt: skip
    with report.phase("flatten"):
        _return_cached_blocks(flat_groups)

    init_report = report.build(decision.reason, group_reports)
    if rank == 0 and not report_is_owned():
        logger.info("%s", init_report.summary())
    frozen = [p for g in plan.groups for p in g.frozen]
    return FlatParams(
        plan.layout, flat_groups, init_report, process_group, rank, ws, frozen, agreement_group
    )
