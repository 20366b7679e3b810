"""``flatten_parameters``: build the flat, sharded buffers bucket by bucket."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from contextlib import closing
from typing import Any

import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..comm import (
    all_reduce_max,
    all_reduce_max_each,
    check_same_everywhere,
    rank_of,
    world_size_of,
)
from ..config import FlattenConfig
from ..control import control_group
from ..devices import resolve_device
from ..gcpause import paused_gc
from ..hostmem import empty_host
from ..layout import GroupLayout, Layout, plan_layout
from ..memory import choose_tier, is_oom, next_tier_down
from ..params import ParamGroup, collect_param_groups
from ..report import GroupReport, ReportBuilder
from ..safetensors_index import SafetensorsCheckpoint
from .buffers import FlatGroup, FlatParams
from .faults import allocate_bucket
from .source import CheckpointSource, NoValues, ParamSource, TensorSource
from .threads import capped_threads, host_threads
from .tiers import Fill, Tier, TierContext, make_tier

__all__ = ["flatten_parameters"]

logger = logging.getLogger(__name__)


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


# How far down its fallback chain (device/host/sharded -> offload -> cpu) a bucket went;
# every chain starts at the tier all ranks agreed on, so the maximum over ranks is the
# lowest tier any rank reached.
_TIER_LEVEL = {"device": 0, "host": 0, "sharded": 0, "offload": 1, "cpu": 2}
_UNFILLED = 3  # a bucket that no tier could allocate


class _GroupFlattener:
    """Flattens the buckets of one group, falling back a tier when memory runs out.

    Every rank must end with each bucket in the same tier (the optimizer's collectives
    run bucket by bucket, on the bucket's device). A tier whose fill is a collective
    (``sharded``: the all-gather) agrees with the other ranks on every allocation before
    filling. The other tiers fill locally, so a rank falls back on its own and the ranks
    agree once, after the last bucket: a bucket that went lower on any rank goes to that
    tier everywhere. That saves a round trip per bucket (hundreds on a large model), and
    out-of-memory stays an exception rather than the rule.
    """

    def __init__(
        self,
        layout: GroupLayout,
        source: ParamSource,
        ctx: TierContext,
        control: dist.ProcessGroup | None,
        first_ordinal: int,
        progress: tqdm,
    ) -> None:
        self.layout = layout
        self.source = source
        self.ctx = ctx
        self.control = control
        self.first_ordinal = first_ordinal
        self.progress = progress
        self.buffers: list[torch.Tensor | None] = [None] * len(layout.buckets)
        self.bucket_tiers: list[str] = [""] * len(layout.buckets)
        self._pending: list[tuple[int, Fill]] = []

    def run(self, tier_name: str) -> None:
        """Flatten every bucket of the group, starting in tier ``tier_name``.

        Raises:
            MemoryError: on every rank, when a bucket fits in no tier on some rank.
        """
        tier = make_tier(tier_name, self.ctx)
        tier.begin(self.layout, self.source, range(len(self.layout.buckets)))
        out_of_memory: MemoryError | None = None
        for bucket in range(len(self.layout.buckets)):
            try:
                tier, buf = self._allocate_agreed(tier, bucket)
            except MemoryError as error:  # the last tier, on this rank alone
                out_of_memory = error
                break
            self.bucket_tiers[bucket] = tier.name
            self._pending.append((bucket, tier.fill(self.layout, self.source, bucket, buf)))
            self._complete(block=False)
            self.progress.update(1)
        self._complete(block=True)
        self._agree_on_tiers(out_of_memory)

    def _allocate_agreed(self, tier: Tier, bucket: int) -> tuple[Tier, torch.Tensor]:
        """The bucket's buffer, in ``tier`` or, after running out of memory, a lower one.

        A collective tier checks with every rank first: a rank that could not allocate
        must not leave the others waiting in the fill's all-gather.
        """
        tier.prepare(self.layout, self.source, bucket)
        while True:
            buf, error = self._allocate(tier, bucket)
            while buf is None and tier.make_room(self.layout, self.source):
                buf, error = self._allocate(tier, bucket)
            if tier.collective:
                if all_reduce_max(int(error is not None), self.control) == 0:
                    assert buf is not None
                    return tier, buf
            elif buf is not None:
                return tier, buf
            tier = self._fall_back(tier, bucket, error)

    def _agree_on_tiers(self, out_of_memory: MemoryError | None) -> None:
        """Make every rank hold each bucket in the lowest tier any rank used for it.

        Raises:
            MemoryError: on every rank, when some rank could not allocate a bucket even in
                the last tier (every parameter still holds its data).
        """
        mine = [_TIER_LEVEL.get(t, _UNFILLED) for t in self.bucket_tiers]
        agreed = all_reduce_max_each(mine, self.control)
        if out_of_memory is not None:
            raise out_of_memory
        if max(agreed) == _UNFILLED:
            bucket = agreed.index(_UNFILLED)
            raise self._last_tier_error("on another rank", bucket, "the last tier")
        followed = [b for b, (m, a) in enumerate(zip(mine, agreed, strict=True)) if a > m]
        for bucket in followed:
            # Only the label changes: a GPU's chain ends at offload (on the device, like
            # device), and host buffers are in host memory whatever their tier.
            lower = "cpu" if agreed[bucket] == _TIER_LEVEL["cpu"] else "offload"
            self.bucket_tiers[bucket] = lower
        if followed:
            self._warn(
                f"buckets {followed[0]}..{followed[-1]} of group {self.layout.group_index} "
                f"({self.layout.dtype}) follow another rank, which ran out of memory, into "
                f"tier(s) {sorted({self.bucket_tiers[b] for b in followed})}"
            )

    def _allocate(
        self, tier: Tier, bucket: int
    ) -> tuple[torch.Tensor | None, BaseException | None]:
        """The bucket's buffer on the tier's device, or the out-of-memory error (on a GPU,
        after emptying the allocator's cache and trying once more)."""
        numel = self.layout.buckets[bucket].numel
        dtype = getattr(torch, self.layout.dtype)
        ordinal = self.first_ordinal + bucket
        return allocate_or_oom(
            lambda: allocate_bucket(
                numel, dtype, tier.bucket_device, ordinal=ordinal, tier=tier.name
            ),
            tier.bucket_device,
        )

    def _fall_back(self, tier: Tier, bucket: int, error: BaseException | None) -> Tier:
        """Switch this rank's remaining buckets to the next tier down.

        Raises:
            MemoryError: ``tier`` is the last one.
        """
        self._complete(block=True)
        lower = next_tier_down(tier.name, self.ctx.device)
        where = f"on rank {rank_of(self.control)}" if error is not None else "on another rank"
        if lower is None:
            last = f"tier {tier.name!r}, the last tier"
            raise self._last_tier_error(where, bucket, last) from error
        self._warn(
            f"out of memory {where} at bucket {bucket} of group {self.layout.group_index} "
            f"({self.layout.dtype}) in tier {tier.name!r}; buckets {bucket}.. continue in "
            f"tier {lower!r}"
        )
        new_tier = make_tier(lower, self.ctx)
        new_tier.begin(self.layout, self.source, range(bucket, len(self.layout.buckets)))
        new_tier.prepare(self.layout, self.source, bucket)
        return new_tier

    def _last_tier_error(self, where: str, bucket: int, tier_text: str) -> MemoryError:
        """The error of a bucket that not even the last tier could allocate."""
        return MemoryError(
            f"out of memory {where} at bucket {bucket} of group {self.layout.group_index} "
            f"({self.layout.dtype}) in {tier_text}; every parameter still holds its data. "
            "Free memory, use more ranks, or a smaller bucket_numel"
            + (
                ""
                if self.ctx.device.type == "cpu"
                else " (on a GPU the buffers never fall back to host memory: the optimizer needs "
                "every bucket on the device)"
            )
        )

    def _warn(self, message: str) -> None:
        """Log a fallback and record it in the init report."""
        logger.warning("%s", message)
        self.ctx.report.events.append(message)

    def _complete(self, *, block: bool) -> None:
        """Rebind the params of every bucket whose copy has finished."""
        still = []
        for bucket, fill in self._pending:
            if block or fill.ready():
                fill.wait()
                self._rebind(bucket, fill.buffer)
            else:
                still.append((bucket, fill))
        self._pending = still

    def _rebind(self, bucket: int, buf: torch.Tensor) -> None:
        self.source.rebind_bucket(bucket, buf)
        self.buffers[bucket] = buf


def allocate_or_oom(
    allocate: Callable[[], torch.Tensor], device: torch.device
) -> tuple[torch.Tensor | None, BaseException | None]:
    """``allocate()``, or ``(None, error)`` when memory runs out; on a GPU the caching
    allocator's unused blocks are released and the allocation tried once more first."""
    for attempt in (0, 1):
        try:
            return allocate(), None
        except (torch.OutOfMemoryError, RuntimeError, MemoryError) as error:
            if not is_oom(error):
                raise
            if attempt or device.type != "cuda":
                return None, error
            torch.cuda.empty_cache()
    raise AssertionError("unreachable")


def allocate_agreed(
    makers: Sequence[Callable[[], torch.Tensor]],
    device: torch.device,
    control: dist.ProcessGroup | None,
    *,
    what: str,
    nbytes: int,
    after: str,
) -> list[torch.Tensor]:
    """``[make() for make in makers]`` on every rank, or a ``MemoryError`` on every rank.

    Every rank tries its allocations, then all agree on the control group: one rank out of
    memory must not leave the others waiting in their next collective.

    Args:
        makers: allocations on ``device``, in order.
        device: where they go (for the message, and the cache retry on a GPU).
        control: the group that agrees.
        what: what is allocated, for the message ("the fp32 master shards").
        nbytes: bytes per rank of all of it, for the message.
        after: what holds when it fails, for the message ("nothing was changed").
    """
    made: list[torch.Tensor] = []
    error: BaseException | None = None
    for make in makers:
        tensor, error = allocate_or_oom(make, device)
        if tensor is None:
            break
        made.append(tensor)
    if all_reduce_max(int(error is not None), control) == 0:
        return made
    made.clear()
    where = f"on rank {rank_of(control)}" if error is not None else "on another rank"
    raise MemoryError(
        f"out of memory {where} allocating {what} ({nbytes / 2**30:.2f} GiB per rank on "
        f"{device.type}); {after}. Use more ranks (shards shrink with them) or free memory"
    ) from error


def _allocate_masters(
    layout: Layout, device: torch.device, control: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    """This rank's empty fp32 master shard of every group, on ``device``, allocated
    before any bucket so that running out of memory here changes nothing."""
    return allocate_agreed(
        [lambda g=g: _empty(g.shard_numel, torch.float32, device) for g in layout.groups],
        device,
        control,
        what="the fp32 master shards",
        nbytes=sum(g.shard_numel for g in layout.groups) * 4,
        after="nothing was changed",
    )


def _empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return empty_host(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def _copy_master(group: FlatGroup, report: ReportBuilder) -> None:
    """Copy this rank's slices of the group's buckets into its master shard."""
    master = group.master
    assert master is not None
    dsts = [master[b.shard_offset : b.shard_offset + b.slice_numel] for b in group.layout.buckets]
    srcs = [group.bucket_shard(b) for b in range(len(group.buckets))]
    torch._foreach_copy_(dsts, srcs)
    kind = "host_copy" if master.device.type == "cpu" else "device_copy"
    report.moved(kind, sum(s.nbytes for s in srcs))


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
            when ``torch.distributed`` is initialized, else a single rank.
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
    """
    config = config or FlattenConfig()
    rank, ws = rank_of(process_group), world_size_of(process_group)
    deciders = process_group if agreement_group is None else agreement_group
    if reserve_grad_shards is None:
        reserve_grad_shards = config.build_master
    if world_size is not None and world_size != ws:
        raise ValueError(
            f"world_size={world_size} was given but the process group has {ws} ranks; "
            "launch with the matching number of processes or drop the world_size argument"
        )
    device = resolve_device(config.device, process_group)
    report = ReportBuilder(rank, ws, device)

    with report.phase("plan"):
        groups = collect_param_groups(params)
        if allocate_only:
            params_on = "device"  # nothing is read: buckets go straight to the target
            if checkpoint is not None:
                raise ValueError(
                    "allocate_only=True reads no values but a checkpoint was given; "
                    "pass one of them"
                )
            if config.tier not in ("auto", "device", "cpu"):
                raise ValueError(
                    f"FlattenConfig.tier={config.tier!r} has nothing to stage with "
                    "allocate_only=True; use 'auto', 'device' or 'cpu'"
                )
        elif checkpoint is None:
            params_on, _ = _where_params_are(groups)
        else:
            keys = _checkpoint_keys(groups, checkpoint, key_map)
            params_on = "host"
            if config.tier in ("device", "offload"):
                raise ValueError(
                    f"FlattenConfig.tier={config.tier!r} cannot read from a checkpoint; "
                    "use 'auto', 'sharded', 'host' or 'cpu'"
                )
        specs = [g.specs() for g in groups]
        if config.dtype is not None:  # cast while copying into the buckets
            specs = [[dataclasses.replace(s, dtype=config.dtype) for s in g] for g in specs]
        layout = plan_layout(
            specs,
            world_size=ws,
            bucket_numel=config.bucket_numel,
            alignment=config.alignment,
        )

    with report.phase("sync"):
        # Every agreement runs on the gloo control group: no control tensor on a GPU.
        control = control_group(deciders)
        if world_size_of(deciders) > 1:  # the digest hashes every param's entry: skip it alone
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
        bucket_bytes = [
            b.numel * getattr(torch, g.dtype).itemsize for g in layout.groups for b in g.buckets
        ]
        slice_bytes = [
            b.slice_numel * getattr(torch, g.dtype).itemsize
            for g in layout.groups
            for b in g.buckets
        ]
        shard_bytes = sum(g.shard_numel for g in layout.groups) * 4
        shards_per_group = int(config.build_master) + int(reserve_grad_shards)
        decision = choose_tier(
            config.tier,
            params_on=params_on,
            device=device,
            world_size=ws,
            largest_bucket_bytes=max(bucket_bytes),
            total_bytes=sum(bucket_bytes),
            shard_bytes=shard_bytes * shards_per_group,
            group=control,
        )
        master_device = torch.device("cpu") if decision.tier == "cpu" else device
        masters = _allocate_masters(layout, master_device, control) if config.build_master else []

    ctx = TierContext(
        device=device,
        rank=rank,
        world_size=ws,
        group=process_group,
        report=report,
        staging_slots=config.staging_buffers,
        largest_bucket_bytes=max(bucket_bytes),
        largest_slice_bytes=max(slice_bytes),
    )
    flat_groups: list[FlatGroup] = []
    group_reports: list[GroupReport] = []
    progress = tqdm(
        total=len(bucket_bytes),
        desc="flatzero init",
        unit="bucket",
        disable=not config.progress or rank != 0,
        delay=2.0,
    )
    with capped_threads(host_threads(config)), progress, closing(ctx):
        ordinal = 0
        for gl in layout.groups:
            user_group = groups[gl.group_index]
            by_name = dict(zip(user_group.names, user_group.params, strict=True))
            slot_params = tuple(by_name[s.spec.name] for s in gl.slots)
            source: ParamSource
            if allocate_only:
                source = NoValues(gl, slot_params)
            elif checkpoint is None:
                source = TensorSource(gl, slot_params)
            else:
                slot_keys = [keys[slot.spec.name] for slot in gl.slots]
                source = CheckpointSource(gl, slot_params, checkpoint, slot_keys)
            flattener = _GroupFlattener(gl, source, ctx, control, ordinal, progress)
            with report.phase("flatten"):
                flattener.run(decision.tier)
            ordinal += len(gl.buckets)
            flat = FlatGroup(
                layout=gl,
                names=tuple(s.spec.name for s in gl.slots),
                params=slot_params,
                buckets=flattener.buffers,  # type: ignore[arg-type]
                options=dict(user_group.options),
                master=None,
                rank=rank,
            )
            if config.build_master:
                flat.master = masters[len(flat_groups)]
                if not allocate_only:
                    with report.phase("master"):
                        _copy_master(flat, report)
            devices = {str(b.device) for b in flat.buckets}
            flat_groups.append(flat)
            group_reports.append(
                GroupReport(
                    group_index=gl.group_index,
                    dtype=gl.dtype,
                    tier=decision.tier,
                    bucket_tiers=tuple(flattener.bucket_tiers),
                    params=len(gl.slots),
                    elements=gl.param_numel,
                    padding=gl.padding_numel,
                    buckets=len(gl.buckets),
                    device=devices.pop() if len(devices) == 1 else "mixed",
                )
            )

    init_report = report.build(decision.reason, group_reports)
    if rank == 0:
        logger.info("%s", init_report.summary())
    return FlatParams(
        layout=layout,
        groups=flat_groups,
        report=init_report,
        process_group=process_group,
        rank=rank,
        world_size=ws,
        frozen=[p for g in groups for p in g.frozen],
        agreement_group=agreement_group,
    )
