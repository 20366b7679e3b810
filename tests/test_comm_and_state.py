"""The shared helpers of issue 14: errors every rank agrees on, the slice-then-all-gather
of buckets (``flatzero.comm``), and the typed optimizer state (``ShardedOptimizerState``)."""

from __future__ import annotations

import builtins
import dataclasses
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatzero.comm as comm
from flatzero import FlattenConfig
from flatzero.checkpoint.optimizer_state import capture
from flatzero.comm import all_gather_buckets_from_own_slices, all_gather_into
from flatzero.control import Failures, every_rank_or_none, raise_if_any_failed
from flatzero.launch import run_ranks
from flatzero.optim import GroupState, ShardedOptimizerState, ZeroOptimizer


def test_raise_if_any_failed_without_a_process_group():
    raise_if_any_failed(None, None, "unused")
    with pytest.raises(KeyError, match="mine"):
        raise_if_any_failed(KeyError("mine"), None, "unused")


def _agree_worker(rank: int, world_size: int, failing: int, error_type: str) -> str:
    error = OSError(f"disk full on rank {rank}") if rank == failing else None
    kind = getattr(builtins, error_type)
    try:
        raise_if_any_failed(error, None, "failed on another rank", error_type=kind)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.parametrize("error_type", ["RuntimeError", "ValueError"])
def test_raise_if_any_failed_raises_on_every_rank(error_type):
    out = run_ranks(_agree_worker, 3, 1, error_type, timeout_s=60)
    assert out[1] == "OSError: disk full on rank 1"
    elsewhere = f"{error_type}: failed on another rank: rank 1: OSError: disk full on rank 1"
    assert out[0] == out[2] == elsewhere  # what failed, on every rank
    assert run_ranks(_agree_worker, 2, -1, error_type, timeout_s=60) == ["ok", "ok"]


def _every_rank_or_none_worker(rank: int, world_size: int) -> dict[str, Any]:
    """The context manager on 3 ranks: a caught error on rank 1 is raised on every rank; a
    factory decides every rank's error."""
    out: dict[str, Any] = {}
    try:
        with every_rank_or_none(None, "failed elsewhere", catch=(OSError,)):
            reached = "block"
            if rank == 1:
                raise OSError("disk full")
        out["plain"] = reached
    except Exception as e:
        out["plain"] = f"{type(e).__name__}: {e}"

    def factory(failures: Failures) -> BaseException:
        kinds = ",".join(failures.kinds)
        return KeyError(f"{failures.first.rank} {failures.first.kind} {kinds} {failures.mine}")

    try:
        with every_rank_or_none(None, catch=(ValueError,), error_type=factory):
            if rank != 0:
                raise ValueError(f"bad on {rank}")
    except KeyError as e:
        out["factory"] = str(e)
    return out


def test_every_rank_or_none_raises_on_every_rank_or_none():
    out = run_ranks(_every_rank_or_none_worker, 3, timeout_s=60)
    assert out[1]["plain"] == "OSError: disk full"  # its own error, unchanged
    assert (
        out[0]["plain"]
        == out[2]["plain"]
        == ("RuntimeError: failed elsewhere: rank 1: OSError: disk full")
    )
    assert out[0]["factory"] == "'1 ValueError ValueError,ValueError None'"
    assert out[2]["factory"] == "'1 ValueError ValueError,ValueError bad on 2'"


def test_every_rank_or_none_without_a_process_group():
    with every_rank_or_none(None, "unused"):
        pass
    with pytest.raises(OSError, match="mine"), every_rank_or_none(None, "unused"):
        raise OSError("mine")
    with pytest.raises(KeyError), every_rank_or_none(None, "unused", catch=(OSError,)):
        raise KeyError("not caught: raised on this rank alone, as a bug is")


def _gather_worker(rank: int, world_size: int) -> list[list[float]]:
    slice_numel = 3
    buckets = [torch.full((slice_numel * world_size,), -1.0, dtype=torch.bfloat16) for _ in "ab"]
    own = [b[rank * slice_numel : (rank + 1) * slice_numel] for b in buckets]
    sources = [torch.full((slice_numel,), 10.0 * i + rank) for i in range(2)]  # fp32
    all_gather_buckets_from_own_slices(buckets, own, None, sources=sources)
    return [b.float().tolist() for b in buckets]


def test_all_gather_buckets_from_own_slices_fills_every_bucket():
    out = run_ranks(_gather_worker, 2, timeout_s=60)
    expected = [[0.0] * 3 + [1.0] * 3, [10.0] * 3 + [11.0] * 3]
    assert out == [expected, expected]


def _broadcast_gather_worker(rank: int, world_size: int) -> dict[str, Any]:
    """``all_gather_into`` on gloo in host memory, with torch's all-gather made to fail:
    the whole group (own slice in place, sync and async, a shard that is not a view), a
    subgroup of every rank but 0 (group ranks differ from global ones), a 2-D output."""
    out: dict[str, Any] = {}
    refused = mock.patch.object(comm, "_all_gather_single", side_effect=AssertionError("used"))
    rest = dist.new_group(list(range(1, world_size)))
    with refused:
        for name, async_op in (("sync", False), ("async", True)):
            bucket = torch.full((5 * world_size,), -1.0, dtype=torch.bfloat16)
            own = bucket[rank * 5 : (rank + 1) * 5]
            own.fill_(rank + 1)
            work = all_gather_into(bucket, own, None, async_op=async_op)
            if async_op:
                work.wait()
            out[name] = bucket.float().tolist()
        full = torch.zeros(7 * world_size, dtype=torch.float32)
        all_gather_into(full, torch.full((7,), 10.0 + rank), None)
        out["copied"] = full.tolist()
        grid = torch.zeros(world_size, 3, dtype=torch.float64)
        all_gather_into(grid, torch.full((3,), float(rank), dtype=torch.float64), None)
        out["2d"] = grid.tolist()
        if rank > 0 and world_size > 2:
            sub = torch.zeros(4 * (world_size - 1), dtype=torch.int64)
            all_gather_into(sub, torch.full((4,), rank), rest, async_op=True).wait()
            out["rest"] = sub.tolist()
    # One broadcast per rank, in place: nothing else is issued.
    broadcasts = []
    original = dist.broadcast

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        broadcasts.append(tensor.data_ptr())
        return original(tensor, *args, **kwargs)

    bucket = torch.zeros(3 * world_size)
    with refused, mock.patch.object(dist, "broadcast", counted):
        all_gather_into(bucket, bucket[rank * 3 : (rank + 1) * 3], None)
    out["broadcast_ptrs"] = [p - bucket.data_ptr() for p in broadcasts]
    # A strided output or shards of another dtype are not the broadcasts' to fill:
    # torch's all-gather takes them.
    out["refused"] = []
    for name, output, shard in (
        ("strided", torch.zeros(2 * world_size, 2)[:, 0], torch.full((2,), float(rank))),
        ("dtype", torch.zeros(2 * world_size), torch.full((2,), rank, dtype=torch.float64)),
    ):
        try:
            with refused:
                all_gather_into(output, shard, None)
        except AssertionError:
            out["refused"].append(name)
    try:
        all_gather_into(torch.zeros(5), torch.zeros(2), None)
    except ValueError as e:
        out["unequal"] = str(e)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_all_gather_on_gloo_is_in_place_broadcasts(world_size):
    """gloo's all-gather stages the whole output in a temporary (one more bucket of host
    memory per call, and a copy): on host memory ``all_gather_into`` broadcasts each rank's
    slice in place instead, with the same result."""
    for rank, out in enumerate(run_ranks(_broadcast_gather_worker, world_size, timeout_s=90)):
        ranks = range(world_size)
        expected = [float(r + 1) for r in ranks for _ in range(5)]
        assert out["sync"] == expected and out["async"] == expected, rank
        assert out["copied"] == [10.0 + r for r in ranks for _ in range(7)], rank
        assert out["2d"] == [[float(r)] * 3 for r in ranks], rank
        if rank > 0 and world_size > 2:
            assert out["rest"] == [r for r in ranks[1:] for _ in range(4)], rank
        assert out["broadcast_ptrs"] == [3 * 4 * r for r in ranks], rank  # float32 pieces
        assert out["refused"] == ["strided", "dtype"], rank
        assert "not " + str(world_size) + " ranks x 2" in out["unequal"], rank


def _optimizer() -> tuple[nn.Module, ZeroOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    opt = ZeroOptimizer(
        [{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[2].parameters()}],
        flatten_config=FlattenConfig(bucket_numel=64, device="cpu", progress=False),
        lr=1e-3,
    )
    model(torch.randn(4, 5)).square().mean().backward()
    opt.step()
    return model, opt


def test_sharded_state_is_the_state_dict_typed():
    _, opt = _optimizer()
    state = opt.sharded_state()
    assert state.step == 1 and state.optimizer == "AdamW" and state.rank == 0
    assert [g.options["lr"] for g in state.groups] == [1e-2, 1e-3]
    assert list(state.groups[0].shards) == ["exp_avg", "exp_avg_sq"]
    assert list(state.groups[0].scalars) == ["step"]
    masters = opt.master_shards
    assert all(
        g.master.data_ptr() == m.data_ptr() for g, m in zip(state.groups, masters, strict=True)
    )
    sd = opt.state_dict()
    inner = opt.inner.state_dict()
    assert sd["optimizer"]["param_groups"] == inner["param_groups"]
    assert sd["optimizer"]["state"].keys() == inner["state"].keys()
    again = ShardedOptimizerState.from_state_dict(sd)
    assert again.to_state_dict().keys() == sd.keys()
    assert again.bucket_order == state.bucket_order and again.optimizer is None
    names = [name for name, _ in capture(state).tensors]
    assert names[:3] == ["g0.master", "g0.exp_avg", "g0.exp_avg_sq"]


def _clone(state: ShardedOptimizerState) -> ShardedOptimizerState:
    def copy(value: Any) -> Any:
        return value.clone() if isinstance(value, torch.Tensor) else value

    groups = tuple(
        GroupState(g.master.clone(), {k: copy(v) for k, v in g.state.items()}, dict(g.options))
        for g in state.groups
    )
    return dataclasses.replace(state, groups=groups)


def test_load_sharded_state_restores_a_snapshot():
    model, opt = _optimizer()
    snapshot = _clone(opt.sharded_state())
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 5)).square().mean().backward()
    opt.step()
    assert opt.sharded_state().step == 2
    opt.load_sharded_state(snapshot)
    assert opt.sharded_state().step == 1
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)
    bad = dataclasses.replace(snapshot, rank=1)
    with pytest.raises(ValueError, match="rank 1's shard"):
        opt.load_sharded_state(bad)
