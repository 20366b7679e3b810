"""The choice of flatten tier: ``auto``'s rule over the registry's tiers, pure
(``decide_tier``: ``flatzero plan`` decides with it as the library does), and the
decision every rank takes on the measured free memory (``choose_tier``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import memory
from ..comm import all_reduce_min
from .registry import spec

__all__ = ["TierDecision", "choose_tier", "decide_tier"]


@dataclass(frozen=True)
class TierDecision:
    """The tier every rank will use, and why.

    Attributes:
        tier: the chosen tier; None when nothing fits (``choose_tier`` raises then).
        reason: one sentence for the init report (or the error).
        min_free_bytes: minimum free memory on the target device over all ranks (bytes).
        need_bytes: free device memory the tier needs per rank (bytes; 0 when the tier
            was requested rather than chosen).
    """

    tier: str | None
    reason: str
    min_free_bytes: int
    need_bytes: int = 0


def decide_tier(
    requested: str,
    *,
    params_on: str,
    device_type: str,
    world_size: int,
    min_free: int,
    largest_bucket_bytes: int,
    total_bytes: int,
    shard_bytes: int,
) -> TierDecision:
    """The tier for ``min_free`` bytes free on the rank with the least: pure (no
    measurement, no process group), so ``flatzero plan`` decides as the library does.

    Args: as ``choose_tier``, with ``device_type`` (``"cuda"``, ``"cpu"``) for the device
    and the measured ``min_free`` (bytes).
    """
    if requested != "auto":
        return TierDecision(requested, f"tier {requested!r} was requested", min_free)
    if device_type == "cpu":
        return TierDecision("cpu", "no accelerator: flat buffers in host memory", min_free)

    def need(tier: str) -> int:
        return spec(tier).peak_device_bytes(largest_bucket_bytes, total_bytes, shard_bytes)

    def decision(tier: str | None, reason: str, need_bytes: int) -> TierDecision:
        return TierDecision(tier, reason, min_free, need_bytes)

    if params_on == "meta":
        return _allocate_only_decision(device_type, min_free, total_bytes, shard_bytes)
    if params_on == "device":
        if min_free >= need("device"):
            return decision(
                "device",
                f"params on {device_type}; {_gib(min_free)} free >= one bucket and the fp32 "
                f"shards ({_gib(need('device'))})",
                need("device"),
            )
        if min_free >= need("host_park"):
            return decision(
                "host_park",
                f"params on {device_type} but only {_gib(min_free)} free, less than one bucket "
                f"and the fp32 shards ({_gib(need('device'))})",
                need("host_park"),
            )
        what = "the fp32 master and gradient shards"
        why = _too_small(device_type, min_free, need("host_park"), what, total_bytes, shard_bytes)
        return decision(None, why, 0)
    upload = "host" if world_size == 1 else "sharded"
    if min_free < need(upload):
        what = "the flat buffers and fp32 shards"
        why = _too_small(device_type, min_free, need(upload), what, total_bytes, shard_bytes)
        return decision(None, why, 0)
    if world_size == 1:
        return decision("host", "params in host memory, one rank", need(upload))
    reason = f"params in host memory, {world_size} ranks share the upload"
    return decision("sharded", reason, need(upload))


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
        params_on: ``"device"`` (the accelerator), ``"host"`` (also a checkpoint) or
            ``"meta"`` (``allocate_only``: nothing is read and the params hold no device
            memory, so every bucket is new device memory).
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
    decision = decide_tier(
        requested,
        params_on=params_on,
        device_type=device.type,
        world_size=world_size,
        min_free=all_reduce_min(memory.free_bytes(device), group),
        largest_bucket_bytes=largest_bucket_bytes,
        total_bytes=total_bytes,
        shard_bytes=shard_bytes,
    )
    if decision.tier is None:
        raise memory.out_of_memory(decision.reason, device)
    return decision


def _allocate_only_decision(
    device_type: str, min_free: int, total_bytes: int, shard_bytes: int
) -> TierDecision:
    """``device`` (buffers straight on the target, nothing read) when every bucket
    (``total_bytes``) plus the fp32 shards (``shard_bytes``) fit in ``min_free`` bytes: params
    that are not on the device free no device memory as their buckets arrive, so no bucket
    replaces anything."""
    need_bytes = total_bytes + shard_bytes
    if min_free < need_bytes:
        what = "the flat buffers and fp32 shards"
        why = _too_small(device_type, min_free, need_bytes, what, total_bytes, shard_bytes)
        return TierDecision(None, why, min_free)
    reason = (
        f"nothing to read (allocate_only) and params not on {device_type}; {_gib(min_free)} "
        f"free >= every bucket and the fp32 shards ({_gib(need_bytes)})"
    )
    return TierDecision("device", reason, min_free, need_bytes)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def _too_small(
    device_type: str, free: int, need: int, what: str, params_bytes: int, shard_bytes: int
) -> str:
    """Why nothing fits, and what helps: at ZeRO-1/2 the params are whole on every rank, so
    more ranks shrink only the fp32 shards."""
    if params_bytes >= free:
        fix = (
            f"the params alone ({_gib(params_bytes)}) are whole on every rank at ZeRO-1/2, so "
            "more ranks cannot help: shard them too (ZeRO-3 / FSDP, not flatzero)"
        )
    else:
        fix = (
            f"more ranks shrink only the fp32 shards ({_gib(shard_bytes)} here; the params, "
            f"{_gib(params_bytes)}, stay whole on every rank at ZeRO-1/2), optimizer offload "
            f"moves them to the host, or free memory on the {device_type}"
        )
    return (
        f"{what} need {_gib(need)} per rank on {device_type} but the rank with the least free "
        f"memory has {_gib(free)}; nothing was changed. {fix}; `flatzero plan` gives the "
        "numbers of each way out"
    )
