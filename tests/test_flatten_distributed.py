"""Flattening on 1-4 real gloo ranks: sharded and cpu tiers, OOM agreement, mismatches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero import FlattenConfig, flatten_parameters, inject_oom
from flatzero.launch import run_ranks


class Net(nn.Module):
    """Sizes chosen so no bucket divides evenly by 2, 3 or 4 ranks without padding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(101, 13)
        self.l1 = nn.Linear(13, 57)
        self.l2 = nn.Linear(57, 13)
        self.head = nn.Linear(13, 101, bias=False)
        self.head.weight = self.embed.weight
        self.norm = nn.Parameter(torch.ones(13))
        self.frozen = nn.Parameter(torch.randn(5), requires_grad=False)
        self.to(torch.bfloat16)


def _reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(1234)
    return {n: p.detach().clone() for n, p in Net().named_parameters()}


def _check(model: nn.Module, flat, reference: dict[str, torch.Tensor], group=None) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p, reference[name]), name
    rank, ws = dist.get_rank(group), dist.get_world_size(group)
    for g in flat.groups:
        # Every rank holds identical buckets.
        for buf in g.buckets:
            gathered = [torch.empty_like(buf) for _ in range(ws)]
            dist.all_gather(gathered, buf, group=group)
            assert all(torch.equal(x, buf) for x in gathered)
        # The master shard is this rank's slices, upcast; shards have equal sizes.
        for b in range(len(g.buckets)):
            lo, hi = g.layout.buckets[b].rank_range(rank)
            assert torch.equal(g.master_slice(b), g.buckets[b][lo:hi].float())
        assert g.master.numel() * ws == g.layout.numel


def _poison_foreign_pieces(model: nn.Module, flat_layout_fn, rank: int) -> None:
    """Overwrite every element this rank does not own with garbage: the sharded tier
    must read only its own slice and get the rest from the all-gather."""
    layout = flat_layout_fn()
    params = dict(model.named_parameters())
    for gl in layout.groups:
        owned = {s.spec.name: torch.zeros(s.numel, dtype=torch.bool) for s in gl.slots}
        for piece in gl.shard_pieces(rank):
            owned[gl.slots[piece.slot].spec.name][piece.param_start : piece.param_end] = True
        with torch.no_grad():
            for name, mask in owned.items():
                flat = params[name].view(-1)
                flat[~mask] = -1000.0 - rank


def _flatten_worker(rank: int, world_size: int, tier: str, bucket_numel: int) -> str:
    from flatzero.layout import plan_layout
    from flatzero.params import collect_param_groups

    reference = _reference()
    torch.manual_seed(1234)
    model = Net()
    config = FlattenConfig(tier=tier, bucket_numel=bucket_numel, progress=False)
    if tier == "sharded":
        _poison_foreign_pieces(
            model,
            lambda: plan_layout(
                [g.specs() for g in collect_param_groups(model)],
                world_size=world_size,
                bucket_numel=bucket_numel,
            ),
            rank,
        )
    frozen = model.frozen.detach().clone()
    flat = flatten_parameters(model, config=config)
    _check(model, flat, reference)
    assert torch.equal(model.frozen, frozen)
    assert model.head.weight is model.embed.weight
    if tier == "sharded" and world_size > 1:
        assert flat.report.bytes_moved["all_gather"] > 0
    return flat.layout.digest()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_sharded_tier_reads_only_its_slice(world_size):
    digests = run_ranks(_flatten_worker, world_size, "sharded", 500)
    assert len(set(digests)) == 1


@pytest.mark.parametrize("world_size", [2, 3])
def test_cpu_tier_on_several_ranks(world_size):
    run_ranks(_flatten_worker, world_size, "cpu", 300)


def _oom_on_one_rank_worker(rank: int, world_size: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    reference = _reference()
    torch.manual_seed(1234)
    model = Net()
    config = FlattenConfig(tier="sharded", bucket_numel=300, progress=False)
    if rank == world_size - 1:
        with inject_oom(at_bucket=1, tier="sharded"):
            flat = flatten_parameters(model, config=config)
    else:
        flat = flatten_parameters(model, config=config)
    _check(model, flat, reference)
    return flat.report.groups[0].bucket_tiers, flat.report.events


def test_out_of_memory_on_one_rank_moves_every_rank_down_without_a_hang():
    results = run_ranks(_oom_on_one_rank_worker, 3, timeout_s=60)
    tiers = {r[0] for r in results}
    assert len(tiers) == 1
    (bucket_tiers,) = tiers
    assert bucket_tiers[0] == "sharded" and set(bucket_tiers[1:]) == {"cpu"}
    assert "on rank 2" in results[2][1][0]
    assert "on another rank" in results[0][1][0]


def _local_fallback_worker(rank: int, world_size: int) -> dict:
    """``device`` tier (on the CPU): rank 1 runs out of memory at bucket 1 (-> host_park)
    and again at bucket 2 (-> cpu); the other ranks never do."""
    import flatzero.flatten.alloc as alloc
    import flatzero.flatten.driver as driver

    reference = _reference()
    torch.manual_seed(1234)
    model = Net()
    config = FlattenConfig(tier="device", device="cpu", bucket_numel=300, progress=False)
    calls = {"per_bucket": 0, "per_group": 0}
    per_bucket, per_group = driver.all_reduce_max, driver.all_reduce_max_each
    masters = alloc.any_rank_failed

    def counted(fn):
        def count(*args):
            calls["per_group" if fn is per_group else "per_bucket"] += 1
            return fn(*args)

        return count

    driver.all_reduce_max, driver.all_reduce_max_each = counted(per_bucket), counted(per_group)
    alloc.any_rank_failed = counted(masters)
    try:
        if rank == 1:
            with (
                inject_oom(at_bucket=1, tier="device"),
                inject_oom(
                    at_bucket=2,
                    tier="host_park",
                    times=100,  # also each make_room retry
                ),
            ):
                flat = flatten_parameters(model, config=config)
        else:
            flat = flatten_parameters(model, config=config)
    finally:
        driver.all_reduce_max, driver.all_reduce_max_each = per_bucket, per_group
        alloc.any_rank_failed = masters
    _check(model, flat, reference)
    return {
        "tiers": flat.report.groups[0].bucket_tiers,
        "events": flat.report.events,
        "calls": calls,
        "groups": len(flat.groups),
    }


def test_local_tiers_fall_back_alone_and_agree_once_per_group():
    results = run_ranks(_local_fallback_worker, 3, timeout_s=60)
    assert len({r["tiers"] for r in results}) == 1
    tiers = results[0]["tiers"]
    assert len(tiers) > 3
    assert tiers[:3] == ("device", "host_park", "cpu") and set(tiers[3:]) == {"cpu"}
    for r in results:  # no round trip per bucket: one agreement per group, and one on
        # the allocation of the master shards
        assert r["calls"] == {"per_bucket": 1, "per_group": r["groups"]}
    assert "on rank 1" in results[1]["events"][0] and "'host_park'" in results[1]["events"][0]
    assert "on rank 1" in results[1]["events"][1] and "'cpu'" in results[1]["events"][1]
    for r in (results[0], results[2]):
        (event,) = r["events"]
        assert "follow another rank" in event and f"buckets 1..{len(tiers) - 1}" in event


def _last_tier_oom_worker(rank: int, world_size: int) -> str:
    reference = _reference()
    torch.manual_seed(1234)
    model = Net()
    config = FlattenConfig(tier="device", device="cpu", bucket_numel=300, progress=False)
    try:
        if rank == 2:
            with inject_oom(at_bucket=2, times=100):  # device, host_park and cpu all fail
                flatten_parameters(model, config=config)
        else:
            flatten_parameters(model, config=config)
    except MemoryError as error:
        for name, p in model.named_parameters():  # nothing lost on any rank
            assert torch.equal(p, reference[name]), name
        return str(error)
    raise AssertionError("flatten_parameters did not raise")


def test_last_tier_out_of_memory_on_one_rank_raises_on_every_rank():
    errors = run_ranks(_last_tier_oom_worker, 3, timeout_s=60)
    assert "on rank 2 at bucket 2" in errors[2] and "the last tier" in errors[2]
    assert all("on another rank at bucket 2" in e for e in errors[:2])
    assert all("still holds its data" in e for e in errors)


def _mismatch_worker(rank: int, world_size: int) -> str:
    model = nn.Linear(4, 3 + rank)  # different shapes on every rank
    weight = model.weight.detach().clone()
    try:
        flatten_parameters(model, config=FlattenConfig(progress=False))
    except ValueError as error:
        assert torch.equal(model.weight, weight)  # nothing changed
        return str(error)
    return "no error"


def test_different_params_on_different_ranks_is_an_error_not_a_hang():
    messages = run_ranks(_mismatch_worker, 2, timeout_s=60)
    for m in messages:
        assert "the flatten setup differs between ranks" in m
        assert "params (rank 0: '2 params, 15 elements'; rank 1: '2 params, 20 elements')" in m
