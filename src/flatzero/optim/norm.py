"""The global L2 norm of sharded gradients, with one all-reduce over all groups."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import world_size_of
from ..devices import collective_device

__all__ = ["global_sq_norm"]


def global_sq_norm(shards: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ranks of the squared L2 norms of this rank's ``shards`` (a 0-d fp64 tensor).

    Every rank must call this with its own shards of the same groups. The result is inf or
    nan when any element anywhere is (which is how an fp16 overflow is detected). The
    squares are summed in float64 so that finite fp32 gradients never overflow the sum.
    """
    distributed = world_size_of(group) > 1
    device = collective_device(group, shards[0].device) if distributed else shards[0].device
    norms = torch._foreach_norm(shards)
    sq = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms]).square().sum()
    if distributed:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq
