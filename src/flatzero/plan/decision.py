"""Which tier ``auto`` takes for hypothetical free memory, and which path DeepSpeed takes.

``auto_tier`` is the decision of ``memory.choose_tier`` on given numbers: the same rules,
reading each tier's memory need from ``flatten.registry`` (``TierSpec.peak_device_bytes``),
without measuring free memory or agreeing over a process group. It must agree with
``memory.choose_tier``; ``tests/test_plan.py`` checks that it does over a grid of inputs.
(Library change proposed: factor the pure part of ``choose_tier`` out as
``memory.decide_tier(requested, params_on, device_type, world_size, min_free, sizes)`` and
call it from both.)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..flatten.registry import spec

__all__ = ["PlanDecision", "auto_tier", "deepspeed_path", "free_at_init"]


@dataclass(frozen=True)
class PlanDecision:
    """The tier ``auto`` takes, and why.

    Attributes:
        tier: the tier, or ``None`` when nothing fits (``choose_tier`` raises
            ``MemoryError`` on every rank then).
        reason: one sentence.
        need_bytes: free memory the tier needs per rank (bytes).
        free_bytes: free memory the decision saw (bytes).
    """

    tier: str | None
    reason: str
    need_bytes: int
    free_bytes: int


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def auto_tier(
    *,
    params_on: str,
    device_type: str,
    world_size: int,
    min_free: int,
    largest_bucket_bytes: int,
    total_bytes: int,
    shard_bytes: int,
) -> PlanDecision:
    """``memory.choose_tier("auto", ...)`` for ``min_free`` bytes free on every rank.

    ``params_on`` is as ``choose_tier`` takes it (``"device"``, ``"host"``, ``"meta"``; a
    checkpoint source is ``"host"``); ``shard_bytes`` includes the gradient shards.
    """

    def need(tier: str) -> int:
        return spec(tier).peak_device_bytes(largest_bucket_bytes, total_bytes, shard_bytes)

    if device_type == "cpu":
        return PlanDecision("cpu", "no accelerator: flat buffers in host memory", 0, min_free)
    if params_on == "device":
        if min_free >= need("device"):
            return PlanDecision(
                "device",
                f"params on the GPU; {_gib(min_free)} free >= one bucket and the fp32 shards "
                f"({_gib(need('device'))})",
                need("device"),
                min_free,
            )
        if min_free >= need("offload"):
            return PlanDecision(
                "offload",
                f"params on the GPU but only {_gib(min_free)} free, less than one bucket and "
                f"the fp32 shards ({_gib(need('device'))})",
                need("offload"),
                min_free,
            )
        return PlanDecision(
            None,
            f"the fp32 master and gradient shards need {_gib(need('offload'))} per rank but "
            f"{_gib(min_free)} is free: use more GPUs",
            need("offload"),
            min_free,
        )
    upload = "host" if world_size == 1 else "sharded"
    if min_free < need(upload):
        return PlanDecision(
            None,
            f"the flat buffers and fp32 shards need {_gib(need(upload))} per rank but "
            f"{_gib(min_free)} is free: use more GPUs or bf16 params",
            need(upload),
            min_free,
        )
    reason = (
        "params in host memory, one rank"
        if world_size == 1
        else f"params in host memory, {world_size} ranks share the upload"
    )
    return PlanDecision(upload, reason, need(upload), min_free)


def free_at_init(gpu_memory: int, reserved: int, params_on_device: int) -> int:
    """Free device memory a rank sees when init starts: the GPU's memory less what the
    runtime holds (CUDA context, NCCL buffers: ``reserved``) and the params already there."""
    return max(0, gpu_memory - reserved - params_on_device)


def deepspeed_path(free: int, flat_bytes: int) -> tuple[str, str]:
    """DeepSpeed 0.19.x's path for one group: on the device when the free memory (after
    ``empty_cache``) is at least the group's flat buffer, else through the host (the
    legacy path, the only one before PR #7828). Returns (path, reason)."""
    if free >= flat_bytes:
        return "deepspeed_device", (
            f"{_gib(free)} free >= the flat buffer ({_gib(flat_bytes)}): torch.cat on the "
            "device, peak 2x the model"
        )
    return "deepspeed_legacy", (
        f"{_gib(free)} free < the flat buffer ({_gib(flat_bytes)}): through host memory"
    )
