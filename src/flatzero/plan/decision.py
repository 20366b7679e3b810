"""Free memory at init, and which path DeepSpeed takes.

Which tier flatzero's ``auto`` takes is the library's own pure decision,
``flatten.choice.decide_tier``, called by the planner with the predicted free memory.
"""

from __future__ import annotations

__all__ = ["deepspeed_path", "free_at_init"]


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


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
