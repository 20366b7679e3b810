"""Measured free memory and the choice of flatten tier, agreed by every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_reduce_min

__all__ = ["TierDecision", "choose_tier", "free_bytes", "is_oom"]


def free_bytes(device: torch.device) -> int:
    """Bytes this process could still allocate on ``device``.

    CUDA: the driver's free memory (``torch.cuda.mem_get_info``) plus what the caching
    allocator has reserved but not handed out. CPU: ``MemAvailable`` of /proc/meminfo.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free + cached)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**62  # unknown: do not let an unreadable /proc block the CPU tier


def is_oom(error: BaseException) -> bool:
    """True for an out-of-memory error from CUDA or the CPU allocator."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


@dataclass(frozen=True)
class TierDecision:
    """The tier every rank will use, and why.

    Attributes:
        tier: the chosen tier.
        reason: one sentence for the init report.
        min_free_bytes: minimum free memory on the target device over all ranks (bytes).
    """

    tier: str
    reason: str
    min_free_bytes: int


def choose_tier(
    requested: str,
    *,
    params_on: str,
    device: torch.device,
    world_size: int,
    largest_bucket_bytes: int,
    total_bytes: int,
    shard_bytes: int,
    group: dist.ProcessGroup | None,
) -> TierDecision:
    """Pick the flatten tier; every rank must call this and gets the same answer.

    Args:
        requested: ``FlattenConfig.tier``.
        params_on: ``"device"`` (the accelerator), ``"host"`` or ``"meta"``.
        device: where the flat buffers go.
        world_size: ranks the buckets are sharded over.
        largest_bucket_bytes: bytes of the largest bucket of any group.
        total_bytes: bytes of all buckets of all groups.
        shard_bytes: bytes this rank allocates on ``device`` beside the buckets: the fp32
            master and gradient shards (0 when no master is built).
        group: the ranks that agree on the minimum free memory.

    Raises:
        MemoryError: on every rank, when ``auto`` finds that no tier can fit the buckets
            and shards on the GPU of the rank with the least free memory (nothing has been
            touched yet).
    """
    # Imported here: the flatten package, which holds the registry, imports this module.
    from .flatten.registry import spec

    min_free = all_reduce_min(free_bytes(device), group)
    if requested != "auto":
        return TierDecision(requested, f"tier {requested!r} was requested", min_free)
    if device.type == "cpu":
        return TierDecision("cpu", "no accelerator: flat buffers in host memory", min_free)

    def need(tier: str) -> int:
        return spec(tier).peak_device_bytes(largest_bucket_bytes, total_bytes, shard_bytes)

    if params_on == "device":
        if min_free >= need("device"):
            return TierDecision(
                "device",
                f"params on {device.type}; {_gib(min_free)} free >= one bucket and the fp32 "
                f"shards ({_gib(need('device'))})",
                min_free,
            )
        if min_free >= need("offload"):
            return TierDecision(
                "offload",
                f"params on {device.type} but only {_gib(min_free)} free, less than one bucket "
                f"and the fp32 shards ({_gib(need('device'))})",
                min_free,
            )
        raise _too_small(device, min_free, need("offload"), "the fp32 master and gradient shards")
    upload = "host" if world_size == 1 else "sharded"
    if min_free < need(upload):
        raise _too_small(device, min_free, need(upload), "the flat buffers and fp32 shards")
    if world_size == 1:
        return TierDecision("host", "params in host memory, one rank", min_free)
    return TierDecision(
        "sharded", f"params in host memory, {world_size} ranks share the upload", min_free
    )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _too_small(device: torch.device, free: int, need: int, what: str) -> MemoryError:
    return MemoryError(
        f"{what} need {_gib(need)} per rank on {device.type} but the rank with the least free "
        f"memory has {_gib(free)}; nothing was changed. Use more ranks (the shards shrink with "
        "them), free memory on the GPU, or bf16 params"
    )
