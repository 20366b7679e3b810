"""The global L2 norm of sharded gradients, with one all-reduce over all groups."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import world_size_of
from ..roll_call import raise_naming_ranks

__all__ = ["global_sq_norm", "global_sq_norm_with"]


def global_sq_norm(shards: list[torch.Tensor], group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ranks of the squared L2 norms of this rank's ``shards`` (a 0-d fp64 tensor).

    Every rank must call this with its own shards of the same groups. The result is inf or
    nan when any element anywhere is (which is how an fp16 overflow is detected). The
    squares are summed in float64 so that finite fp32 gradients never overflow the sum.

    The sum stays on the shards' device and is all-reduced there, by the backend that
    reduces the gradients themselves (NCCL for GPU shards of a ``cpu:gloo,cuda:nccl``
    group): one collective, no copy to the host and no host sync.
    """
    return global_sq_norm_with(shards, group, None)[0]


def global_sq_norm_with(
    shards: list[torch.Tensor], group: dist.ProcessGroup | None, rider: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``global_sq_norm``, and ``rider`` (float64 values on the shards' device, or None)
    summed over ranks in the same all-reduce: the gradient check's projections ride on the
    norm's collective instead of waiting for one of their own. Each element of an
    all-reduce is summed on its own, so packing leaves the norm's value as it was (at 3 or
    more ranks the backend may pick another algorithm for the longer tensor, and so
    another order of the ranks' float64 terms).

    Returns:
        (the squared norm, ``rider`` summed over ranks, shaped as given; None without one).
    """
    norms = torch._foreach_norm(shards)
    sq = torch.stack(norms).to(torch.float64).square().sum()
    packed = sq if rider is None else torch.cat([sq.reshape(1), rider.reshape(-1).to(sq.device)])
    if world_size_of(group) > 1:
        try:
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
            raise_naming_ranks(error, group, "all-reducing the gradient norm at the step")
    if rider is None:
        return packed, None
    return packed[0], packed[1:].view(rider.shape)
