"""Measured free memory and the choice of flatten tier, agreed by every rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import all_reduce_min

__all__ = ["TierDecision", "choose_tier", "free_bytes", "is_oom", "next_tier_down"]

logger = logging.getLogger(__name__)

_FALLBACK = {"device": "offload", "offload": "cpu", "host": "cpu", "sharded": "cpu"}


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


def next_tier_down(tier: str) -> str | None:
    """The tier that takes over the remaining buckets after ``tier`` ran out of memory."""
    return _FALLBACK.get(tier)


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
    group: dist.ProcessGroup | None,
) -> TierDecision:
    """Pick the flatten tier; every rank must call this and gets the same answer.

    Args:
        requested: ``FlattenConfig.tier``.
        params_on: ``"device"`` (the accelerator), ``"host"`` or ``"meta"``.
        device: where the flat buffers go.
        world_size: ranks in the process group.
        largest_bucket_bytes: bytes of the largest bucket of any group.
        total_bytes: bytes of all buckets of all groups.
        group: the process group used to agree on the minimum free memory.
    """
    min_free = all_reduce_min(free_bytes(device), group)
    if requested != "auto":
        return TierDecision(requested, f"tier {requested!r} was requested", min_free)
    gib = 2**30
    if device.type == "cpu":
        return TierDecision("cpu", "no accelerator: flat buffers in host memory", min_free)
    if params_on == "device":
        if min_free >= largest_bucket_bytes:
            return TierDecision(
                "device",
                f"params on {device.type}; {min_free / gib:.2f} GiB free >= one bucket",
                min_free,
            )
        return TierDecision(
            "offload",
            f"params on {device.type} but only {min_free / gib:.2f} GiB free, "
            f"less than one bucket ({largest_bucket_bytes / gib:.2f} GiB)",
            min_free,
        )
    if min_free < total_bytes:
        logger.warning(
            "the flat buffers need %.2f GiB on %s but the least free memory over all ranks "
            "is %.2f GiB; buckets that do not fit will stay in host memory",
            total_bytes / gib,
            device,
            min_free / gib,
        )
    if world_size == 1:
        return TierDecision("host", "params in host memory, one rank", min_free)
    return TierDecision(
        "sharded", f"params in host memory, {world_size} ranks share the upload", min_free
    )
