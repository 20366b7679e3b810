"""flatzero's reductions and gathers run on a group of its own (issue 41 item 5).

Stage 2 reduces chunks during backward as each rank's gradients arrive, so the points
where its reductions are issued differ between ranks. A user's collective inside backward
on the same group (SyncBatchNorm, a mixture-of-experts all-to-all) then met a different
collective of flatzero's on each rank: gloo failed ("Application timeout caused pair
closure"), NCCL would hang. Here an expert used on rank 1 only, before an ``all_reduce`` in
backward on the default group, orders rank 1's collectives [all_reduce, reduce, ...] and
rank 0's [reduce, ..., all_reduce, ...]; training must finish, every rank with the same
params, and no flatzero collective may run on the user's group.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn

from flatzero import FlattenConfig, ZeroOptimizer, comm, own_groups
from flatzero.launch import run_ranks

WIDTH = 16


class MeanInBackward(torch.autograd.Function):
    """Identity forward; backward averages the gradient over the default group (what
    SyncBatchNorm's backward does on its group)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad / dist.get_world_size()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.expert = nn.Linear(WIDTH, WIDTH)  # registered last: launched first

    def loss(self, x: torch.Tensor, expert: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if expert:  # tokens routed to the expert on this rank only
            h = h + self.expert(h)
        h = MeanInBackward.apply(h)
        return torch.tanh(self.b(h)).square().mean()


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    groups: list[Any] = []
    reduce = dist.reduce

    def recording(*args: Any, **kwargs: Any) -> Any:
        groups.append(kwargs.get("group"))
        return reduce(*args, **kwargs)

    dist.reduce = recording
    model = Net()
    opt = ZeroOptimizer(
        model.parameters(),
        stage=2,
        lr=1e-2,
        flatten_config=FlattenConfig(bucket_numel=WIDTH * WIDTH, device="cpu", progress=False),
    )
    losses = []
    for step in range(3):
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model.loss(x, expert=rank == 1)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    ours = own_groups.collective_group(None)
    return {
        "losses": losses,
        "params": {n: p.detach().flatten().tolist() for n, p in model.named_parameters()},
        "reduces": len(groups),
        "on_ours": all(g is ours for g in groups),
        "ours_ranks": dist.get_process_group_ranks(ours),
        "ours_is_world": ours is dist.group.WORLD,
    }


def test_a_user_collective_inside_backward_does_not_meet_flatzeros_reductions():
    results = run_ranks(_worker, 2, timeout_s=30)
    for r in results:
        assert r["reduces"] > 0 and r["on_ours"]
        assert r["ours_ranks"] == [0, 1] and not r["ours_is_world"]
        assert all(torch.isfinite(torch.tensor(r["losses"])))
    assert results[0]["params"] == results[1]["params"]


def _subgroup_worker(rank: int, world_size: int) -> list[int]:
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    ours = own_groups.collective_group(mine)
    assert ours is not mine and own_groups.collective_group(mine) is ours
    t = torch.ones(1) * rank
    dist.all_reduce(t, group=ours)
    return [int(t.item()), *dist.get_process_group_ranks(ours)]


def test_a_subgroups_own_group_has_its_ranks_and_is_made_once():
    assert run_ranks(_subgroup_worker, 4, timeout_s=60) == [[1, 0, 1]] * 2 + [[5, 2, 3]] * 2


def _review_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Review of issue 41, findings 2 and 3, at 4 ranks in subgroups [0, 1] and [2, 3]."""
    out: dict[str, Any] = {}
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    # Finding 3: ranks 0 and 1 already have a control group over [0, 1]; ranks 2 and 3 none.
    if rank < 2:
        own_groups._new_control([0, 1], everyone_calls=False)
    own_groups.prepare_control_groups([[0, 1], [2, 3]])
    counts = [dist.distributed_c10d._world.group_count]
    out["group_counts"] = comm.all_reduce_max_each([counts[0], -counts[0]], None)
    # Finding 2: a device-bound default group (init_process_group(device_id=...)) splits a
    # new NCCL group off its communicator, which every rank of the job must call: a group
    # made by the subgroup's ranks alone (use_local_synchronization) would hang them.
    other, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    local_calls: list[bool] = []
    real = dist.new_group

    def recording(*args: Any, **kwargs: Any) -> Any:
        local_calls.append(bool(kwargs.get("use_local_synchronization")))
        return real(*args, **kwargs)

    world = dist.group.WORLD
    world.bound_device_id = torch.device("cuda", 0)
    try:
        with mock.patch.object(dist, "new_group", recording):
            out["shares"] = own_groups.collective_group(other) is other
            out["prepared"] = own_groups.collective_group(mine) is not mine
    finally:
        world.bound_device_id = None
    out["local_calls"] = local_calls
    return out


def test_own_groups_never_split_locally_and_prepare_agrees_on_skipping():
    for r in run_ranks(_review_worker, 4, timeout_s=60):
        high, neg_low = r["group_counts"]
        # Before: ranks 0 and 1 skipped [0, 1] while 2 and 3 created its groups job-wide, so
        # the job's group counts (torch's names for the next job-wide group) differed by 2.
        assert high == -neg_low, r
        # Before: the subgroup's ranks called new_group(use_local_synchronization=True).
        assert r["local_calls"] == [] and r["shares"] and r["prepared"], r
