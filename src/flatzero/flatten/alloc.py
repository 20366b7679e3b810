"""Allocations every rank makes or fails together: out of memory is agreed, never a hang."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .. import accel
from ..comm import rank_of
from ..control import any_rank_failed
from ..hostmem import empty_host
from ..layout import Layout
from ..memory import is_oom, out_of_memory

__all__ = ["allocate_agreed", "allocate_masters", "allocate_or_oom", "empty"]


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
            if attempt or not accel.is_accelerator(device):
                return None, error
            accel.empty_cache(device)
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
    if not any_rank_failed(error, control):
        return made
    made.clear()
    where = f"on rank {rank_of(control)}" if error is not None else "on another rank"
    raise out_of_memory(
        f"out of memory {where} allocating {what} ({nbytes / 2**30:.2f} GiB per rank on "
        f"{device.type}); {after}. Use more ranks (shards shrink with them) or free memory",
        device,
    ) from error


def allocate_masters(
    layout: Layout,
    device: torch.device,
    control: dist.ProcessGroup | None,
    *,
    huge_pages: bool = True,
) -> list[torch.Tensor]:
    """This rank's empty fp32 master shard of every group, on ``device``, allocated
    before any bucket so that running out of memory here changes nothing (in host memory
    on huge pages if ``huge_pages``)."""
    return allocate_agreed(
        [
            lambda g=g: empty(g.shard_numel, torch.float32, device, huge_pages=huge_pages)
            for g in layout.groups
        ],
        device,
        control,
        what="the fp32 master shards",
        nbytes=sum(g.shard_numel for g in layout.groups) * 4,
        after="nothing was changed",
    )


def empty(
    numel: int, dtype: torch.dtype, device: torch.device, *, huge_pages: bool = True
) -> torch.Tensor:
    """An uninitialized 1-D tensor on ``device`` (host memory via ``empty_host``)."""
    if not accel.is_accelerator(device):
        return empty_host(numel, dtype, huge_pages=huge_pages)
    return torch.empty(numel, dtype=dtype, device=device)
