"""A test seam: make a bucket allocation fail as if memory had run out."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .alloc import empty

__all__ = ["allocate_bucket", "inject_oom"]


@dataclass
class _Fault:
    at_bucket: int
    tier: str | None
    remaining: int


_faults: list[_Fault] = []


@contextmanager
def inject_oom(*, at_bucket: int, tier: str | None = None, times: int = 1) -> Iterator[None]:
    """Make allocations of bucket number ``at_bucket`` raise ``torch.OutOfMemoryError``.

    Args:
        at_bucket: ordinal of the bucket over all groups, in flattening order (0-based).
        tier: only fail when this tier allocates (``None``: any tier).
        times: how many allocations fail before the fault clears (a fallback tier
            allocating the same bucket again counts as another).
    """
    fault = _Fault(at_bucket, tier, times)
    _faults.append(fault)
    try:
        yield
    finally:
        _faults.remove(fault)


def allocate_bucket(
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    ordinal: int,
    tier: str,
    huge_pages: bool = True,
) -> torch.Tensor:
    """Allocate an uninitialized 1-D bucket buffer (where injected faults fire)."""
    for fault in _faults:
        if fault.at_bucket == ordinal and fault.tier in (None, tier) and fault.remaining > 0:
            fault.remaining -= 1
            raise torch.OutOfMemoryError(
                f"injected out-of-memory error at bucket {ordinal} in tier {tier!r}"
            )
    return empty(numel, dtype, device, huge_pages=huge_pages)
