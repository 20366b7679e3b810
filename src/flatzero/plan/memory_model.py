"""Bytes a rank holds: model states after the first step, and the peak during init.

Everything is computed from a ``Layout`` (``plan_layout`` of the model's real param shapes),
so padding, alignment, buckets and shards are exact. What each figure mirrors:

- buckets: ``flatten_parameters`` allocates one buffer of ``bucket.numel`` elements per
  bucket, in the params' dtype (ZeRO-1/2 keep the whole model on every rank);
- fp32 master and gradient shards: ``layout.shard_numel`` fp32 elements per group
  (``flatten.api.allocate_masters``, ``optim.zero._allocate_grad_shards``);
- stage 1: a flat gradient buffer of ``layout.numel`` elements in the params' dtype per
  group, except at world size 1 with fp32 params, where the gradient shard is used in place
  (``optim.stage1.Stage1Reducer``);
- reduction staging: chunk-sized slots in ``reduce_dtype``, as many as
  ``optim.buckets.StagingPool`` allocates (``staging_bytes``), within
  ``ZeroConfig.reduce_staging_bytes``;
- optimizer state: what ``torch.optim`` creates at the first step, per group;
- optimizer offload (``offload_optimizer: {device: cpu}``): the host bytes of
  ``optim.offload.offload_host_bytes`` (``offload_host_memory``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..flatten.registry import spec
from ..flatten.tiers import staging_slot_bytes
from ..layout import GroupLayout, Layout
from ..optim.buckets import staging_geometry
from ..optim.config import DEFAULT_REDUCE_STAGING_BYTES
from ..optim.offload import OffloadHostBytes, offload_host_bytes, state_floats
from .names import OPTIMIZER_STATES, WHOLE_PARAM_OPTIMIZERS

__all__ = [
    "OPTIMIZER_STATES",
    "InitMemory",
    "ModelStates",
    "async_snapshot_bytes",
    "deepspeed_init_memory",
    "flatzero_init_memory",
    "group_states",
    "held_gradient_bytes",
    "itemsize",
    "largest_gradient_bytes",
    "model_states",
    "offload_host_memory",
    "optimizer_state_bytes",
    "staging_bytes",
]

_SCALAR_BYTES = 4  # a 0-dim float32 ``step`` tensor


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named like ``"bfloat16"``."""
    return getattr(torch, dtype).itemsize


def group_states(optimizer: str, group: GroupLayout) -> tuple[int, int]:
    """(fp32 tensors of the shard's size, 0-dim fp32 scalars) the state of ``optimizer`` (a
    key of ``OPTIMIZER_STATES``) holds for ``group``: a whole-param optimizer's own counts in
    its whole-params groups, its companion's (``WHOLE_PARAM_OPTIMIZERS``) in the others."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer {optimizer!r} must be one of {', '.join(OPTIMIZER_STATES)}")
    if optimizer in WHOLE_PARAM_OPTIMIZERS and not group.whole:
        optimizer = WHOLE_PARAM_OPTIMIZERS[optimizer]
    return OPTIMIZER_STATES[optimizer]


def optimizer_state_bytes(layout: Layout, optimizer: str) -> int:
    """Bytes of the optimizer state one rank holds after the first step: per group, its
    state tensors (``group_states``) of the group's shard length in fp32 (the same on every
    rank, a whole-params group's too: each rank's slice of a bucket is as long as the fullest
    rank's part, ``owners.place_whole``) and its 0-dim fp32 scalars."""
    total = 0
    for group in layout.groups:
        tensors, scalars = group_states(optimizer, group)
        total += tensors * group.shard_numel * 4 + scalars * _SCALAR_BYTES
    return total


def _bucket_bytes(group: GroupLayout) -> list[int]:
    size = itemsize(group.dtype)
    return [b.numel * size for b in group.buckets]


def _param_bytes(group: GroupLayout) -> list[int]:
    """Bytes of the params (their own tensors, no padding) of each bucket."""
    size = itemsize(group.dtype)
    out = [0] * len(group.buckets)
    for slot in group.slots:
        out[slot.bucket] += slot.numel * size
    return out


@dataclass(frozen=True)
class ModelStates:
    """What one rank holds for training after the first step, in bytes.

    Attributes:
        params: the flat buckets (the whole model, padded), in the params' dtype.
        master: the fp32 master shards.
        grad_shards: the fp32 gradient shards.
        grad_flat: stage 1's flat gradient buffers (0 in stage 2, or when aliased).
        grad_staging: the reducer's staging slots.
        optimizer: the inner optimizer's state.
    """

    params: int
    master: int
    grad_shards: int
    grad_flat: int
    grad_staging: int
    optimizer: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"ModelStates.{name} must be >= 0, got {value}")

    @property
    def gradients(self) -> int:
        """All gradient storage: what ``ZeroOptimizer.gradient_bytes()`` reports."""
        return self.grad_shards + self.grad_flat + self.grad_staging

    @property
    def total(self) -> int:
        """Everything above, bytes."""
        return self.params + self.master + self.gradients + self.optimizer


def async_snapshot_bytes(
    layout: Layout, *, optimizer: str = "adamw", rank_file_extra: int = 0, rest_bytes: int = 0
) -> int:
    """Host bytes an asynchronous save keeps per rank (``checkpoint.async_save.snapshot``,
    page-locked where a GPU is), from the first asynchronous save on.

    The buffer holds what the rank writes, laid out as its files' data: the rank file's fp32
    master shard and per-element optimizer-state shards of every group (after the first step),
    plus ``rank_file_extra`` bytes (RNG states with ``SaveConfig(save_rng=True)``), rounded up
    to the page (``storage.image.padded``); on rank 0 also the model's frozen params and
    buffers (``rest_bytes``, with ``model=``), rounded up likewise.
    """
    from ..storage.image import PAGE, padded

    shards = sum(g.shard_numel * 4 * (1 + group_states(optimizer, g)[0]) for g in layout.groups)
    return max(PAGE, padded(shards + rank_file_extra) + padded(rest_bytes))


def staging_bytes(
    layout: Layout,
    *,
    stage: int,
    staging_buffers: int = 2,
    reduce_staging_bytes: int = DEFAULT_REDUCE_STAGING_BYTES,
    reduce_dtype: str = "float32",
    backward_passes: int = 1,
    host_gloo: bool = False,
) -> int:
    """Bytes of staging slots the reducer holds after the first step.

    Mirrors ``optim.buckets.StagingPool``: chunk-sized slots (``staging_geometry``) are
    allocated while fewer than the budget's exist and none is free; a slot is freed only
    once every slot is in use, so the pool ends with as many slots as chunks were staged
    in the first accumulation window, at most the budget's. Stage 2 stages every chunk of
    every bucket in each of the window's ``backward_passes``; stage 1 only the chunks of
    buckets it must convert (params not in fp32, or ``reduce_dtype`` not fp32), and every
    chunk with ``host_gloo`` (buckets in host memory on gloo, whose reduce-scatter would
    stage the whole bucket itself: ``comm.on_host_gloo``). World size 1 stages nothing.
    """
    if layout.world_size == 1:
        return 0
    size = itemsize(reduce_dtype)
    buckets = [(g, b) for g in layout.groups for b in g.buckets]
    chunk, slots = staging_geometry(
        max(b.slice_numel for _, b in buckets), reduce_staging_bytes, staging_buffers, size
    )
    per_bucket = {id(b): layout.world_size * -(-b.slice_numel // chunk) for _, b in buckets}
    if stage == 2:
        staged = backward_passes * sum(per_bucket.values())
    else:
        staged = sum(
            per_bucket[id(b)]
            for g, b in buckets
            if host_gloo or g.dtype != "float32" or reduce_dtype != "float32"
        )
    return min(slots, staged) * chunk * size


def model_states(
    layout: Layout,
    *,
    stage: int,
    optimizer: str = "adamw",
    staging_buffers: int = 2,
    reduce_staging_bytes: int = DEFAULT_REDUCE_STAGING_BYTES,
    reduce_dtype: str = "float32",
    backward_passes: int = 1,
    host_gloo: bool = False,
) -> ModelStates:
    """The bytes of ``ModelStates`` for one rank of ``layout`` (every rank holds the same);
    ``backward_passes`` per accumulation window, ``host_gloo``: the buckets are in host
    memory on gloo (see ``staging_bytes``)."""
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 or 2, got {stage!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer {optimizer!r} must be one of {', '.join(OPTIMIZER_STATES)}")
    shard = sum(g.shard_numel for g in layout.groups) * 4
    flat = 0
    if stage == 1:
        flat = sum(
            g.numel * itemsize(g.dtype)
            for g in layout.groups
            if not (layout.world_size == 1 and g.dtype == "float32")
        )
    staging = staging_bytes(
        layout,
        stage=stage,
        staging_buffers=staging_buffers,
        reduce_staging_bytes=reduce_staging_bytes,
        reduce_dtype=reduce_dtype,
        backward_passes=backward_passes,
        host_gloo=host_gloo,
    )
    return ModelStates(
        params=sum(sum(_bucket_bytes(g)) for g in layout.groups),
        master=shard,
        grad_shards=shard,
        grad_flat=flat,
        grad_staging=staging,
        optimizer=optimizer_state_bytes(layout, optimizer),
    )


def largest_gradient_bytes(layout: Layout) -> int:
    """Bytes of the largest trainable param's gradient, in its dtype: autograd makes each
    gradient whole before flatzero takes it (stage 2: the reducer's hook copies it out and
    frees it; stage 1: it is added into the param's view of the flat gradient buffer), so
    backward holds at least the largest one for a moment beside the model states (device
    memory; host memory on a machine without an accelerator).

    A lower bound: a tied param's gradient lives from its first use's backward to its
    last one's and is summed there, and a fused expert tensor's backward stacks its
    experts' gradients, so either can hold about twice its size for a moment.
    Activations are not counted."""
    return max(
        (slot.numel * itemsize(g.dtype) for g in layout.groups for slot in g.slots), default=0
    )


def held_gradient_bytes(layout: Layout, *, stage: int) -> int:
    """Bytes of autograd's gradients one rank holds at once in backward, at least: the
    largest gradient (``largest_gradient_bytes``), and in stage 2 over several ranks the
    gradients of the largest bucket, which wait for their reduction chunks
    (``ZeroOptimizer.held_gradient_peak_bytes``) in every backward pass, the first one
    included (an unused param early in launch order holds back about one bucket, issue 41
    item 1). Device memory (host memory on a machine without an accelerator)."""
    largest = largest_gradient_bytes(layout)
    if stage != 2 or layout.world_size == 1:
        return largest
    bucket = max(
        (
            sum(g.slots[i].numel for i in b.slots) * itemsize(g.dtype)
            for g in layout.groups
            for b in g.buckets
        ),
        default=0,
    )
    return max(largest, bucket)


_TORCH_OPTIMIZERS: dict[str, tuple[str, dict[str, float]]] = {
    "adamw": ("AdamW", {}),
    "adam": ("Adam", {}),
    "sgd": ("SGD", {"momentum": 0.9}),
    "adagrad": ("Adagrad", {}),
}
"""``OPTIMIZER_STATES``' names as ``torch.optim`` classes and the options their state
counts assume."""


def offload_host_memory(layout: Layout, *, optimizer: str, pinned: bool) -> OffloadHostBytes:
    """Host bytes one rank holds with optimizer offload (every rank holds the same): the
    fp32 master shards (4 bytes per shard element), the inner optimizer's state (4 bytes per
    element per state tensor: 8 for AdamW) and the fp32 host gradient shards (4 bytes per
    element; page-locked with ``pinned``). That is the peak: the downloads of every bucket
    in flight land in the gradient shard itself and the upload is staged in its memory, so
    no other host staging exists. ``optimizer``: a key of ``OPTIMIZER_STATES``."""
    if optimizer in WHOLE_PARAM_OPTIMIZERS:  # per group: its own state tensors
        numels = [g.shard_numel for g in layout.groups]
        state = sum(4 * group_states(optimizer, g)[0] * g.shard_numel for g in layout.groups)
        return dataclasses.replace(offload_host_bytes(numels, 0, pinned=pinned), state=state)
    if optimizer not in _TORCH_OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} must be one of {', '.join(_TORCH_OPTIMIZERS)}")
    name, options = _TORCH_OPTIMIZERS[optimizer]
    return offload_host_bytes(
        [g.shard_numel for g in layout.groups], state_floats(name, options), pinned=pinned
    )


@dataclass(frozen=True)
class InitMemory:
    """Peak memory of one rank during init, in bytes.

    Attributes:
        method: the flatzero tier, or a DeepSpeed path (``deepspeed_device``,
            ``deepspeed_legacy``).
        device_peak: peak accelerator memory allocated for params, buckets and shards
            (0 when everything is in host memory).
        host_peak: peak host memory for params, copies and staging (not counting the
            process itself).
        host_model_copy: bytes of the model a rank holds in host memory before init (the
            params as loaded; 0 when the model starts on the device or the meta device).
    """

    method: str
    device_peak: int
    host_peak: int
    host_model_copy: int

    def __post_init__(self) -> None:
        if min(self.device_peak, self.host_peak, self.host_model_copy) < 0:
            raise ValueError(f"InitMemory of {self.method}: bytes must be >= 0")


def _replace_peak(buckets: Sequence[int], params: Sequence[int], *, free_first: bool) -> int:
    """Peak of ``sum(params)`` resident params replaced bucket by bucket: each bucket is
    allocated, then its params are freed (or freed first when ``free_first``)."""
    current = sum(params)
    peak = current
    for new, old in zip(buckets, params, strict=True):
        if free_first:
            current -= old
        peak = max(peak, current + new)
        current += new - (0 if free_first else old)
    return peak


def flatzero_init_memory(
    layout: Layout, tier: str, *, params_on: str, staging_buffers: int = 2, after: int = 0
) -> InitMemory:
    """Peak memory of one rank while ``flatten_parameters`` runs ``tier`` on a GPU node,
    then ``ZeroOptimizer`` allocates its gradient buffers.

    ``params_on``: ``"device"``, ``"host"`` or ``"checkpoint"`` (meta model, values read
    from safetensors). The fp32 master shards are allocated before the first bucket;
    ``after`` is what the rank holds once the optimizer is built (buckets, master and
    gradient buffers: ``ModelStates`` without staging and optimizer state), which the peak
    includes. Allocator rounding is ignored.
    """
    buckets = [b for g in layout.groups for b in _bucket_bytes(g)]
    params = [p for g in layout.groups for p in _param_bytes(g)]
    master = sum(g.shard_numel for g in layout.groups) * 4
    host_copy = sum(params) if params_on == "host" else 0
    on_device = sum(params) if params_on == "device" else 0
    staged = 0
    if tier in ("host", "host_park"):
        staged = max(buckets)
    elif tier == "sharded":
        staged = max(b.slice_numel * itemsize(g.dtype) for g in layout.groups for b in g.buckets)
    ring = staging_buffers * staging_slot_bytes(staged) if staged else 0
    if spec(tier).buffers_on_host:  # cpu: everything on the host
        host = max(master + _replace_peak(buckets, params, free_first=False), after)
        return InitMemory(tier, 0, host, host_copy)
    if tier in ("device", "host_park"):
        if params_on != "device":
            raise ValueError(f"tier {tier!r} takes params on the device, not on {params_on!r}")
        device = master + _replace_peak(buckets, params, free_first=tier == "host_park")
        host = ring + (max(buckets) if tier == "host_park" else 0)
        return InitMemory(tier, max(device, after), host, 0)
    device = max(on_device + master + sum(buckets), after)
    return InitMemory(tier, device, host_copy + ring, host_copy)


def deepspeed_init_memory(
    group_numels: Sequence[int], elt: int, world_size: int, *, path: str, params_on: str
) -> InitMemory:
    """Peak memory of one rank in DeepSpeed ZeRO-1/2's init (0.19.x), per path.

    ``group_numels``: trainable elements per param group; ``elt``: bytes per element.
    DeepSpeed's engine first moves the model to the device (``module.to``), so the params
    start there whatever ``params_on`` says (a host copy is freed as it moves). The device
    path ``torch.cat``s each group while every original is alive (2x the group); the legacy
    path copies every param to the host (``param.cpu_data``), concatenates there and copies
    the result back, so a rank holds the group twice in host memory. Then come the fp32
    master partition (a clone of the rank's partition, then its fp32 copy) and, in
    ``initialize_optimizer_states``, a zeroed fp32 gradient partition, freed again.
    """
    from ..deepspeed.layout import padded_numel

    padded = [padded_numel(n, world_size) for n in group_numels]
    model = sum(group_numels) * elt
    flat = sum(padded) * elt
    part = sum(p // world_size for p in padded)
    after = flat + part * 4 + max(part * elt, part * 4)  # master, then clone or zero grads
    host_copy = model if params_on in ("host", "checkpoint") else 0
    if path == "deepspeed_device":
        return InitMemory(path, max(model + flat, after), host_copy, host_copy)
    if path == "deepspeed_legacy":
        host = max(host_copy, model + flat)
        return InitMemory(path, max(model, after), host, host_copy)
    raise ValueError(f"path {path!r} must be 'deepspeed_device' or 'deepspeed_legacy'")
