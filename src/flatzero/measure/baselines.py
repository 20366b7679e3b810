"""DeepSpeed ZeRO-1/2 parameter flattening at init, reimplemented as timed baselines.

Two algorithms, both written here from a reading of DeepSpeed's source (no code copied),
so that ``flatzero bench init`` can time them against flatzero in the same process tree:
``flatten_torch_cat`` ([Note: DeepSpeed 0.19.x's flatten]) and ``flatten_legacy_cpu``
([Note: DeepSpeed's legacy CPU flatten]). Both work in place: afterwards every trainable
param is a view of its group's flat buffer, exactly as after ``deepspeed.initialize``.
Partitioning is pure computation on ``rank``/``world_size``: no process group is needed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import accel
from ..deepspeed.layout import padded_numel, partition_range
from ..params import rebind_param

__all__ = [
    "BaselineResult",
    "available_bytes",
    "flatten_legacy_cpu",
    "flatten_torch_cat",
    "trainable_params",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaselineResult:
    """Outcome of one baseline flatten of all param groups on one rank.

    Attributes:
        algorithm: ``"torch_cat"`` (DeepSpeed 0.19.x) or ``"legacy_cpu"`` (before PR #7828).
        paths: per group, ``"device"`` (one ``torch.cat`` on the device) or ``"host"``
            (through host memory).
        placement_s: seconds spent moving params that were not on ``device`` onto it before
            the timed phases (DeepSpeed's engine does this in ``module.to(device)`` before
            building the optimizer); not part of ``flatten_s``.
        flatten_s: seconds, all groups: memory check, flatten, rebinding params to views.
        master_s: seconds, all groups: partitioning and the fp32 master partition.
        flatten_bytes: bytes written by copies in the flatten phase (``torch.cat`` output,
            plus host staging copies on the host path).
        master_bytes: bytes written by the master phase (clone plus fp32 cast).
        group_numel: trainable elements per group, before padding.
        padded_numel: elements per group's flat buffer, padding included.
        flat_buffers: the flat buffer of each group on ``device``; params are views of it.
        master_partitions: this rank's fp32 master partition of each group.
        rank: the rank whose partition was built.
        world_size: number of partitions per group.
    """

    algorithm: str
    paths: tuple[str, ...]
    placement_s: float
    flatten_s: float
    master_s: float
    flatten_bytes: int
    master_bytes: int
    group_numel: tuple[int, ...]
    padded_numel: tuple[int, ...]
    flat_buffers: tuple[torch.Tensor, ...]
    master_partitions: tuple[torch.Tensor, ...]
    rank: int
    world_size: int

    @property
    def total_s(self) -> float:
        """Seconds of the timed phases (flatten plus master)."""
        return self.flatten_s + self.master_s

    @property
    def bytes_moved(self) -> int:
        """Bytes written by copies in the timed phases."""
        return self.flatten_bytes + self.master_bytes


def trainable_params(group: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """The params DeepSpeed's ZeRO-1/2 optimizer owns, in the group's order.

    Keeps ``requires_grad`` params with at least one element (DeepSpeed's
    ``is_optimized_parameter``). Raises ``ValueError`` on a param listed twice or on mixed
    dtypes, which DeepSpeed's single ``torch.cat`` per group cannot handle either.
    """
    kept: list[nn.Parameter] = []
    seen: set[int] = set()
    for p in group:
        if id(p) in seen:
            raise ValueError(
                f"param group lists a parameter of shape {tuple(p.shape)} twice; "
                "each parameter must appear once (deduplicate tied weights)"
            )
        seen.add(id(p))
        if p.requires_grad and p.numel() > 0:
            kept.append(p)
    dtypes = {p.dtype for p in kept}
    if len(dtypes) > 1:
        raise ValueError(
            f"param group mixes dtypes {sorted(str(d) for d in dtypes)}; DeepSpeed flattens "
            "a group with one torch.cat, so put each dtype in its own group"
        )
    return kept


def available_bytes(device: torch.device) -> int:
    """Free memory on ``device`` in bytes, as DeepSpeed's accelerator reports it.

    An accelerator: free bytes from its ``mem_get_info`` (on CUDA the driver's count, as
    NVML's). CPU: ``MemAvailable`` from ``/proc/meminfo`` (what ``psutil`` reports), else
    free pages.
    """
    if accel.is_accelerator(device):
        return accel.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _empty_cache(device: torch.device) -> None:
    accel.empty_cache(device)


def _check_args(
    param_groups: Sequence[Sequence[nn.Parameter]], rank: int, world_size: int
) -> list[list[nn.Parameter]]:
    if isinstance(param_groups, nn.Parameter) or (
        len(param_groups) > 0 and isinstance(param_groups[0], nn.Parameter)
    ):
        raise TypeError(
            "param_groups must be a list of lists of parameters; wrap a single group as "
            "[list(model.parameters())]"
        )
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    groups = [trainable_params(g) for g in param_groups]
    all_ids = [id(p) for g in groups for p in g]
    if len(all_ids) != len(set(all_ids)):
        raise ValueError("a parameter appears in more than one param group; list it once")
    return groups


def _place(groups: list[list[nn.Parameter]], device: torch.device) -> float:
    """Move params not on ``device`` there (untimed setup); returns seconds."""
    t0 = time.perf_counter()
    moved = 0
    for group in groups:
        for p in group:
            if p.device != device:
                rebind_param(p, p.data.to(device))
                moved += 1
    accel.synchronize(device)
    if moved:
        logger.debug("moved %d params to %s before flattening", moved, device)
    return time.perf_counter() - t0


def _pad_tensor(pad: int, like: torch.Tensor) -> list[torch.Tensor]:
    """DeepSpeed's ``align_dense_tensors``: one zero tensor of ``pad`` elements, if any."""
    return [torch.zeros(pad, dtype=like.dtype, device=like.device)] if pad else []


def _flatten_on_device(params: list[nn.Parameter], padded: int) -> tuple[torch.Tensor, int]:
    """DeepSpeed 0.19.x device path: one ``torch.cat``, then rebind with narrow/view."""
    shapes = [p.shape for p in params]
    numels = [p.numel() for p in params]
    first = params[0].data
    pad = padded - sum(numels)
    # Every original stays referenced by its param until the cat returns: peak 2x the group.
    flat = _flatten_dense_tensors([p.data for p in params] + _pad_tensor(pad, first)).detach()
    offset = 0
    for p, shape, n in zip(params, shapes, numels, strict=True):
        rebind_param(p, flat.narrow(0, offset, n).view(shape))
        offset += n
    return flat, padded * first.element_size()


def _flatten_through_host(
    params: list[nn.Parameter], padded: int, device: torch.device, emulate_transfers: bool
) -> tuple[torch.Tensor, int]:
    """Legacy path: params to host copies, ``torch.cat`` on the host, copy back, unflatten."""
    es = params[0].element_size()
    dtype = params[0].dtype
    copy_on_host = device.type == "cpu" and emulate_transfers
    moved = 0
    host: list[torch.Tensor] = []
    for p in params:
        data = p.data
        h = data.clone() if copy_on_host else data.cpu()
        if h.data_ptr() != data.data_ptr():
            moved += data.numel() * es
        host.append(h)
        # DeepSpeed frees the device copy by pointing the param at a 1-element fp32 tensor.
        rebind_param(p, torch.empty(1, device=data.device))
        del data
    _empty_cache(device)
    metas = [torch.empty(h.shape, dtype=dtype, device="meta") for h in host]
    pad = padded - sum(h.numel() for h in host)
    flat_host = _flatten_dense_tensors(host + _pad_tensor(pad, host[0]))
    moved += padded * es
    del host
    flat = flat_host.clone() if copy_on_host else flat_host.to(device)
    if flat.data_ptr() != flat_host.data_ptr():
        moved += padded * es
    del flat_host
    for p, view in zip(params, _unflatten_dense_tensors(flat, metas), strict=True):
        rebind_param(p, view.data)
    return flat, moved


def _master_partition(
    flat: torch.Tensor, rank: int, world_size: int, device: torch.device
) -> tuple[torch.Tensor, int]:
    """This rank's slice of ``flat``, cloned then cast to fp32 (DeepSpeed's two copies)."""
    start, numel = partition_range(flat.numel(), rank, world_size)
    part = flat.narrow(0, start, numel)
    cloned = part.detach().clone()
    moved = cloned.numel() * cloned.element_size()
    master = cloned.to(device=device, dtype=torch.float32)
    if master.data_ptr() != cloned.data_ptr():
        moved += master.numel() * master.element_size()
    return master, moved


@dataclass(frozen=True)
class _GroupFlat:
    """One group's outcome: its path, buffers, seconds and bytes written per phase."""

    path: str
    flat: torch.Tensor
    master: torch.Tensor
    flatten_s: float
    master_s: float
    flatten_bytes: int
    master_bytes: int


def _target_device(
    groups: list[list[nn.Parameter]], device: torch.device | str | None
) -> torch.device:
    """``device``, else the first param's device, else the CPU; an accelerator with its
    index."""
    first = next((p for g in groups for p in g), None)
    if device is None:
        dev = first.device if first is not None else torch.device("cpu")
    else:
        dev = torch.device(device)
    if accel.is_accelerator(dev) and dev.index is None:
        dev = torch.device(dev.type, accel.current_index(dev.type))
    return dev


def _on_device(
    algorithm: str, group: list[nn.Parameter], padded: int, dev: torch.device, memory_check: bool
) -> bool:
    """Whether the group takes the device path: ``torch_cat`` with the memory for it."""
    if algorithm != "torch_cat":
        return False
    if not memory_check:
        return True
    _empty_cache(dev)
    if available_bytes(dev) >= padded * group[0].element_size():
        return True
    logger.info("not enough free memory on %s: flattening group via host", dev)
    return False


def _flatten_group(
    algorithm: str,
    group: list[nn.Parameter],
    padded: int,
    rank: int,
    world_size: int,
    dev: torch.device,
    emulate_transfers: bool,
    memory_check: bool,
) -> _GroupFlat:
    """Flatten one group (``padded`` elements) and build its fp32 master partition, timed."""
    if not group:
        # DeepSpeed would fail on an empty group; keep the result aligned with the input.
        empty = torch.empty(0, device=dev)
        return _GroupFlat("device", empty, torch.empty(0, device=dev), 0.0, 0.0, 0, 0)
    t0 = time.perf_counter()
    use_device = _on_device(algorithm, group, padded, dev, memory_check)
    if use_device:
        flat, moved = _flatten_on_device(group, padded)
    else:
        flat, moved = _flatten_through_host(group, padded, dev, emulate_transfers)
    accel.synchronize(dev)
    t1 = time.perf_counter()
    master, mmoved = _master_partition(flat, rank, world_size, dev)
    accel.synchronize(dev)
    t2 = time.perf_counter()
    path = "device" if use_device else "host"
    return _GroupFlat(path, flat, master, t1 - t0, t2 - t1, moved, mmoved)


def _run(
    algorithm: str,
    param_groups: Sequence[Sequence[nn.Parameter]],
    rank: int,
    world_size: int,
    device: torch.device | str | None,
    emulate_transfers: bool,
    memory_check: bool,
) -> BaselineResult:
    groups = _check_args(param_groups, rank, world_size)
    dev = _target_device(groups, device)
    placement_s = _place(groups, dev)
    group_numel = tuple(sum(p.numel() for p in group) for group in groups)
    padded = tuple(padded_numel(n, world_size) for n in group_numel)
    done = [
        _flatten_group(
            algorithm, group, numel, rank, world_size, dev, emulate_transfers, memory_check
        )
        for group, numel in zip(groups, padded, strict=True)
    ]
    return BaselineResult(
        algorithm=algorithm,
        paths=tuple(g.path for g in done),
        placement_s=placement_s,
        flatten_s=sum((g.flatten_s for g in done), 0.0),
        master_s=sum((g.master_s for g in done), 0.0),
        flatten_bytes=sum(g.flatten_bytes for g in done),
        master_bytes=sum(g.master_bytes for g in done),
        group_numel=group_numel,
        padded_numel=padded,
        flat_buffers=tuple(g.flat for g in done),
        master_partitions=tuple(g.master for g in done),
        rank=rank,
        world_size=world_size,
    )


# [Note: DeepSpeed 0.19.x's flatten]
# ``flatten_torch_cat`` — DeepSpeed 0.19.x (after PR #7828), the loop over
# ``optimizer.param_groups`` in ``DeepSpeedZeroOptimizer.__init__``
# (``deepspeed/runtime/zero/stage_1_and_2.py``):
#
# 1. the group's trainable params (``is_optimized_parameter`` in
#    ``deepspeed/runtime/utils.py``: ``requires_grad`` and ``numel() > 0``), in the order
#    the optimizer holds them (registration order; ``round_robin_gradients`` is off by
#    default so no reordering);
# 2. the group's padded size: ``alignment = nccl_start_alignment_factor (2) * world_size``
#    elements, no per-param padding (``parameter_alignment`` is off by default);
# 3. ``empty_cache()`` then ``accelerator.available_memory()`` (CUDA: free bytes from NVML,
#    CPU: ``psutil.virtual_memory().available``); the group is flattened on the device when
#    that is at least the padded group's bytes, else it takes the host path below;
# 4. device path: ``flatten_dense_tensors_aligned`` → ``align_dense_tensors`` appends one
#    zero tensor of the padding, and ``self.flatten`` (torch's ``_flatten_dense_tensors``,
#    one ``torch.cat``) builds the whole group's buffer while every original param is still
#    alive (peak: 2x the group);
# 5. ``_update_model_bit16_weights``: ``p.data = flat.narrow(0, offset, numel).view(shape)``
#    for each param (shapes kept as meta tensors), which frees the originals;
# 6. ``get_data_parallel_partitions``: ``world_size`` consecutive slices of the flat buffer
#    (``numel // world_size`` each, the remainder spread over the first ranks);
# 7. ``single_partition_of_fp32_groups``: this rank's slice
#    ``.detach().clone().to(device, dtype=float32)`` (a clone in the param dtype, then a
#    cast: two copies for bf16/fp16, one for fp32).


def flatten_torch_cat(
    param_groups: Sequence[Sequence[nn.Parameter]],
    *,
    rank: int,
    world_size: int,
    device: torch.device | str | None = None,
    memory_check: bool = True,
    emulate_transfers: bool = True,
) -> BaselineResult:
    """Flatten like DeepSpeed 0.19.x ZeRO-1/2: one ``torch.cat`` per group on the device
    ([Note: DeepSpeed 0.19.x's flatten]).

    Args:
        param_groups: lists of params (one dtype per group); frozen and empty params are
            skipped as DeepSpeed does. Modified in place: afterwards each trainable param is
            a view of its group's flat buffer.
        rank: the rank whose fp32 master partition is built (0-based).
        world_size: number of data-parallel ranks the groups are partitioned over.
        device: the accelerator (default: the first param's device). Params elsewhere are
            moved there first, outside the timed phases.
        memory_check: as DeepSpeed, fall back to the host path for a group when the
            device's free memory is below the group's padded size in bytes.
        emulate_transfers: for the host fallback on a CPU device, see
            [Note: transfers on a CPU-only machine].

    Returns:
        Timings in seconds, bytes written, the flat buffers and master partitions.
    """
    return _run(
        "torch_cat", param_groups, rank, world_size, device, emulate_transfers, memory_check
    )


# [Note: DeepSpeed's legacy CPU flatten]
# ``flatten_legacy_cpu`` — DeepSpeed before PR #7828 (read in 0.14.0, same file and
# function): per param ``param.cpu_data = param.data.cpu()`` and
# ``param.data = torch.empty(1).to(param.device)`` (a 1-element fp32 placeholder), then
# ``empty_cache()``; meta tensors of the shapes; ``flatten_dense_tensors_aligned(...,
# use_cpu_data=True)`` (``torch.cat`` on the host); ``del param.cpu_data``;
# ``flattened_buffer.to(current_device_name())``; ``_update_model_bit16_weights`` then
# rebinds with ``self.unflatten`` (torch's ``_unflatten_dense_tensors``) and
# ``p.data = q.data``; partitions and the master as in steps 6–7 of
# [Note: DeepSpeed 0.19.x's flatten] (written there as ``.to(device).clone().float()
# .detach()``, the same two copies). DeepSpeed 0.19.x keeps this as its fallback when free
# memory is short; ``flatten_torch_cat`` uses it then too.
#
# [Note: transfers on a CPU-only machine]
# On a CPU-only machine the "device" is the CPU. DeepSpeed's ``.cpu()`` and ``.to("cpu")``
# are then no-ops, so by default (``emulate_transfers=True``) the legacy path performs them
# as real copies (``clone``) so that it moves the bytes it moves on a GPU machine
# (device→host, cat, host→device: 3x the group); pass ``emulate_transfers=False`` to get
# exactly what DeepSpeed does on its CPU accelerator.


def flatten_legacy_cpu(
    param_groups: Sequence[Sequence[nn.Parameter]],
    *,
    rank: int,
    world_size: int,
    device: torch.device | str | None = None,
    emulate_transfers: bool = True,
) -> BaselineResult:
    """Flatten like DeepSpeed before PR #7828: every param to the host, cat there, copy back
    ([Note: DeepSpeed's legacy CPU flatten]).

    Args:
        param_groups: lists of params (one dtype per group); frozen and empty params are
            skipped as DeepSpeed does. Modified in place: afterwards each trainable param is
            a view of its group's flat buffer on ``device``.
        rank: the rank whose fp32 master partition is built (0-based).
        world_size: number of data-parallel ranks the groups are partitioned over.
        device: the accelerator (default: the first param's device). Params elsewhere are
            moved there first, outside the timed phases.
        emulate_transfers: on a CPU device, perform the device→host and host→device steps
            as real copies (default) instead of DeepSpeed's no-op ``.cpu()``/``.to("cpu")``.

    Returns:
        Timings in seconds, bytes written, the flat buffers and master partitions.
    """
    return _run("legacy_cpu", param_groups, rank, world_size, device, emulate_transfers, False)
