"""The decisions around flatzero's GPU lines, tested on CPU (issue 11).

Each test reproduces a multi-GPU failure found by review with gloo ranks and, where a
device identity or a memory size is needed, with the device seam answering for CUDA
(``torch.cuda``'s queries stubbed): which device a
rank uses, what ranks compare, which group agrees, how much memory a tier needs, how
much staging memory a rank holds.
"""

from __future__ import annotations

import logging
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import flatzero.accel as accel
import flatzero.control as control
import flatzero.devices as devices
import flatzero.flatten.alloc as flatten_alloc
import flatzero.flatten.tiers as tiers
import flatzero.optim.prepare as prepare
import flatzero.own_groups as own_groups
from flatzero import FlattenConfig, ZeroOptimizer, flatten_parameters, inject_oom
from flatzero.deepspeed.engine.param_sync import bitwise_sum
from flatzero.flatten.choice import choose_tier
from flatzero.flatten.registry import next_tier_down
from flatzero.hostmem import staging_buffer
from flatzero.launch import run_ranks

MiB = 2**20


class _Net(nn.Module):
    """Sizes that divide evenly by no world size from 2 to 4."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(7, 13)
        self.l2 = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _net() -> _Net:
    torch.manual_seed(0)
    return _Net()


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 7, generator=g)


def _reference(ranks: list[int], steps: int) -> dict[str, torch.Tensor]:
    """Plain AdamW on one process over the mean of the given ranks' losses (what data
    parallelism over those ranks computes)."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        loss = sum(model(_batch(step, r)).square().mean() for r in ranks) / len(ranks)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(opt: ZeroOptimizer, model: nn.Module, rank: int, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        loss = model(_batch(step, rank)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def _assert_close(model: nn.Module, reference: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), reference[name], rtol=1e-5, atol=1e-6)


# ------------------------------------------------ 1: configs compared by meaning
def test_flatten_config_is_compared_by_device_type_not_index():
    assert (
        FlattenConfig(device="cuda:0").compared_text()
        == FlattenConfig(device="cuda:1").compared_text()
    )
    assert (
        FlattenConfig(device="cuda").compared_text()
        == FlattenConfig(device="cuda:3").compared_text()
    )
    assert (
        FlattenConfig(device="cpu").compared_text()
        != FlattenConfig(device="cuda:0").compared_text()
    )
    assert FlattenConfig(bucket_numel=64).compared_text() != FlattenConfig().compared_text()


def _per_rank_device_worker(rank: int, world_size: int) -> dict:
    model = _net()
    # What model.to(f"cuda:{local_rank}") gives the PyTorch door: one device string per rank.
    device = "cpu" if rank == 0 else "cpu:0"
    opt = ZeroOptimizer(
        model.parameters(),
        torch.optim.AdamW,
        flatten_config=FlattenConfig(device=device, bucket_numel=64, progress=False),
        lr=1e-2,
    )
    _train(opt, model, rank, 3)
    _assert_close(model, _reference(list(range(world_size)), 3))
    # A real difference is an error on every rank naming each rank's value.
    try:
        flatten_parameters(
            _net(), config=FlattenConfig(bucket_numel=64 * (rank + 1), progress=False)
        )
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


def test_ranks_with_different_device_indices_agree_and_train_like_adamw():
    results = run_ranks(_per_rank_device_worker, 2, timeout_s=60)
    for r in results:
        assert r["error"] is not None
        assert "FlattenConfig (rank 0: " in r["error"]
        assert "bucket_numel=64," in r["error"] and "bucket_numel=128," in r["error"]


# -------------------------------------- 2: master and grad shards, and the tier decision
@pytest.fixture
def stub_free(monkeypatch):
    """``choose_tier`` on a stubbed GPU with a given number of free bytes."""

    def set_free(nbytes: int) -> None:
        monkeypatch.setattr("flatzero.memory.free_bytes", lambda device: nbytes)

    return set_free


def _decide(params_on: str, *, shard: int = 500, world_size: int = 1) -> str:
    return choose_tier(
        "auto",
        params_on=params_on,
        device=torch.device("cuda", 0),
        world_size=world_size,
        largest_bucket_bytes=100,
        total_bytes=1000,
        shard_bytes=shard,
        group=None,
    ).tier


def test_tier_decision_counts_the_fp32_shards(stub_free):
    stub_free(600)  # one bucket + shards
    assert _decide("device") == "device"
    stub_free(599)  # the shards fit, not a bucket beside them: make room by offloading
    assert _decide("device") == "host_park"
    stub_free(499)  # not even the shards: an error before anything is touched
    with pytest.raises(MemoryError, match="fp32 master and gradient shards need"):
        _decide("device")
    stub_free(1500)
    assert _decide("host") == "host"
    assert _decide("host", world_size=2) == "sharded"
    stub_free(1499)  # host params: every bucket and the shards must fit on the GPU
    with pytest.raises(MemoryError, match="nothing was changed"):
        _decide("host")


def test_on_a_gpu_no_tier_falls_back_to_host_memory():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert next_tier_down("device", cuda) == "host_park"
    for tier in ("host_park", "host", "sharded", "cpu"):
        assert next_tier_down(tier, cuda) is None
    assert next_tier_down("host", cpu) == "cpu"  # host buffers may go on in the cpu tier


def _master_oom_worker(rank: int, world_size: int) -> str:
    model = _net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    storages = {n: p.untyped_storage().data_ptr() for n, p in model.named_parameters()}
    if rank == 1:
        original = flatten_alloc.empty

        def failing(numel, dtype, device, **kwargs):
            if dtype == torch.float32:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return original(numel, dtype, device, **kwargs)

        flatten_alloc.empty = failing
    try:
        flatten_parameters(model, config=FlattenConfig(bucket_numel=64, progress=False))
    except MemoryError as error:
        for name, p in model.named_parameters():  # untouched: same values, same storage
            assert torch.equal(p, before[name]), name
            assert p.untyped_storage().data_ptr() == storages[name], name
        return str(error)
    raise AssertionError("no MemoryError")


def test_master_shard_out_of_memory_is_a_memory_error_on_every_rank():
    errors = run_ranks(_master_oom_worker, 3, timeout_s=60)
    assert "on rank 1 allocating the fp32 master shards" in errors[1]
    assert all("on another rank allocating the fp32 master shards" in e for e in errors[::2])
    assert all("nothing was changed" in e for e in errors)


def _grad_oom_worker(rank: int, world_size: int) -> str:
    model = _net()
    if rank == 0:
        original = prepare.empty_buffer

        def failing(numel, dtype, device):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

        prepare.empty_buffer = failing
    try:
        ZeroOptimizer(model.parameters(), flatten_config=FlattenConfig(progress=False), lr=1e-2)
    except MemoryError as error:
        return str(error)
    finally:
        if rank == 0:
            prepare.empty_buffer = original
    raise AssertionError("no MemoryError")


def test_grad_shard_out_of_memory_is_a_memory_error_on_every_rank():
    errors = run_ranks(_grad_oom_worker, 2, timeout_s=60)
    assert "on rank 0 allocating the fp32 gradient shards" in errors[0]
    assert "on another rank allocating the fp32 gradient shards" in errors[1]


# ------------------------------------------------ 3: buckets the optimizer cannot use
def _flat(model: nn.Module):
    return flatten_parameters(model, config=FlattenConfig(bucket_numel=64, progress=False))


def test_buckets_on_several_devices_are_refused():
    flat = _flat(_net())
    flat.groups[0].buckets[-1] = torch.empty(0, device="meta")  # a bucket elsewhere
    with pytest.raises(ValueError, match="on several devices"):
        prepare.check_buckets_usable(flat)


def _backend_mismatch_worker(rank: int, world_size: int) -> str:
    flat = _flat(_net())
    # Buckets on a GPU under a gloo group (what the cpu/cuda mix used to hand over).
    fake = SimpleNamespace(device=torch.device("cuda", rank))
    for g in flat.groups:
        g.buckets = [fake] * len(g.buckets)
        g.master = None
    try:
        prepare.check_buckets_usable(flat)
    except ValueError as error:
        return str(error)
    return "accepted"


def test_cuda_buckets_under_a_gloo_group_are_refused():
    for message in run_ranks(_backend_mismatch_worker, 2, timeout_s=60):
        assert "backend 'gloo' cannot reduce-scatter cuda tensors" in message


# --------------------------------------------- 4 and 5: the device of a rank, one place
@pytest.fixture
def fake_gpus(monkeypatch):
    """``torch.cuda`` stubbed as a node with ``count`` GPUs, current device ``current``."""
    calls: list[int] = []

    def configure(count: int = 8, current: int = 0, local_rank: str | None = None) -> list[int]:
        monkeypatch.setattr(accel, "accelerator_type", lambda: "cuda")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(torch.device(d).index))
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", local_rank)
        return calls

    return configure


def test_local_rank_picks_the_gpu_unless_the_script_chose_one(fake_gpus):
    fake_gpus(count=8, current=0, local_rank="3")
    assert devices.local_device_index("cuda") == 3
    assert devices.resolve_device(None, None) == torch.device("cuda", 3)
    assert devices.resolve_device("cuda", None) == torch.device("cuda", 3)
    assert devices.resolve_device("cuda:5", None) == torch.device("cuda", 5)
    fake_gpus(count=8, current=5, local_rank="3")  # torch.cuda.set_device(5) by the script
    assert devices.local_device_index("cuda") == 5
    fake_gpus(count=1, current=0, local_rank="3")  # the launcher shows each rank one GPU
    assert devices.local_device_index("cuda") == 0
    fake_gpus(count=8, current=0, local_rank=None)
    assert devices.local_device_index("cuda") == 0
    fake_gpus(count=8, current=0, local_rank="9")
    with pytest.raises(ValueError, match="LOCAL_RANK=9 but this process sees 8 cuda devices"):
        devices.local_device_index("cuda")


def test_activate_makes_the_ranks_gpu_current(fake_gpus):
    calls = fake_gpus(count=8, current=0, local_rank="6")
    devices.activate(devices.resolve_device(None, None))
    devices.activate(torch.device("cpu"))
    assert calls == [6]


def test_backends_decide_where_buffers_and_control_tensors_go(fake_gpus, monkeypatch):
    fake_gpus(count=8, current=0, local_rank="2")
    cases = {
        "nccl": (True, False, torch.device("cuda", 2)),
        "gloo": (False, True, torch.device("cpu")),
        "cpu:gloo,cuda:nccl": (True, True, torch.device("cpu")),
    }
    for backend, (on_cuda, on_cpu, control_device) in cases.items():
        monkeypatch.setattr(devices, "backend_of", lambda group, b=backend: b)
        assert devices.buckets_may_use_accelerator(None) is on_cuda, backend
        assert devices.collectives_run_on_cpu(None) is on_cpu, backend
        assert devices.collective_device(None) == control_device, backend
    # A model placed on cuda:5 without set_device: its collectives go with the data.
    monkeypatch.setattr(devices, "backend_of", lambda group: "nccl")
    assert devices.collective_device(None, torch.device("cuda", 5)) == torch.device("cuda", 5)
    assert devices.collective_device(None, torch.device("cpu")) == torch.device("cuda", 2)
    monkeypatch.setattr(devices, "backend_of", lambda group: "gloo")
    assert devices.collective_device(None, torch.device("cuda", 5)) == torch.device("cpu")
    assert devices.resolve_device(None, None) == torch.device("cpu")  # a gloo group, GPUs seen
    with pytest.raises(ValueError, match=r"backend .gloo. cannot reduce-scatter cuda"):
        devices.resolve_device("cuda", None)


def _gloo_on_a_gpu_machine_worker(rank: int, world_size: int) -> str:
    accel.accelerator_type = lambda: "cuda"  # a machine with GPUs; the group is gloo
    flat = flatten_parameters(_net(), config=FlattenConfig(progress=False))
    return str(flat.groups[0].device)


def test_gloo_group_on_a_gpu_machine_keeps_buckets_on_the_host():
    assert run_ranks(_gloo_on_a_gpu_machine_worker, 2, timeout_s=60) == ["cpu", "cpu"]


# ------------------------------------------------- 6: the control group, subgroups
def _count_new_groups(monkeypatch_like: dict) -> None:
    original = dist.new_group

    def counting(*args, **kwargs):
        monkeypatch_like["new_group"].append(kwargs.get("ranks"))
        return original(*args, **kwargs)

    dist.new_group = counting


def _subgroup_worker(rank: int, world_size: int, stage: int) -> dict:
    own_groups._separate_control_needed = lambda group: True  # as on NCCL: a gloo group each
    mine, _ = dist.new_subgroups(group_size=2)  # data parallel inside "tensor parallel"
    created: dict = {"new_group": []}
    _count_new_groups(created)
    ranks = dist.get_process_group_ranks(mine)
    t0 = time.monotonic()
    model = _net()
    opt = ZeroOptimizer(
        model.parameters(),
        process_group=mine,
        stage=stage,
        flatten_config=FlattenConfig(bucket_numel=64, progress=False),
        lr=1e-2,
    )
    _train(opt, model, rank, 3)
    _assert_close(model, _reference(ranks, 3))
    for _ in range(2):  # more flatten calls over the same group reuse its control group
        flatten_parameters(_net(), process_group=mine, config=FlattenConfig(progress=False))
    return {
        "created": created["new_group"],
        "ranks": ranks,
        "seconds": time.monotonic() - t0,
        "control": own_groups.control_group(mine) is not mine,
    }


@pytest.mark.parametrize("stage", [1, 2])
def test_data_parallel_subgroups_train_concurrently_with_one_control_group_each(stage):
    results = run_ranks(_subgroup_worker, 4, stage, timeout_s=90)
    for rank, r in enumerate(results):
        assert r["ranks"] == ([0, 1] if rank < 2 else [2, 3])
        # One control group and one group for flatzero's reductions (issue 41 item 5) per
        # process group, each made once and reused.
        assert r["created"] == [r["ranks"], r["ranks"]]
        assert r["control"]
        assert r["seconds"] < 60


def _control_reuse_worker(rank: int, world_size: int) -> int:
    own_groups._separate_control_needed = lambda group: True
    created: dict = {"new_group": []}
    _count_new_groups(created)
    for _ in range(3):
        flatten_parameters(_net(), config=FlattenConfig(progress=False))
    for _ in range(2):
        ZeroOptimizer(_net().parameters(), flatten_config=FlattenConfig(progress=False), lr=1e-2)
    return len(created["new_group"])


def test_the_control_group_is_created_once_per_process_group():
    # The control group and the optimizers' own group for their reductions (issue 41 item
    # 5), each once, whatever the number of flatten calls and optimizers.
    assert run_ranks(_control_reuse_worker, 2, timeout_s=60) == [2, 2]


def test_gloo_groups_are_their_own_control_group():
    assert own_groups._separate_control_needed(None) is False  # no group: nothing to create


# ------------------------------------------------------- 8: stage 0 decides together
def _stage0_worker(rank: int, world_size: int) -> dict:
    import flatzero

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 40), nn.Linear(40, 40))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flatzero": {"tier": "device", "bucket_numel": 1700},
    }
    if rank == 1:  # only rank 1 runs out of memory at bucket 1
        with inject_oom(at_bucket=1, tier="device"):
            engine, *_ = flatzero.initialize(model=model, config=config)
    else:
        engine, *_ = flatzero.initialize(model=model, config=config)
    report = engine.init_report.flatten
    return {"tiers": report.groups[0].bucket_tiers, "events": report.events}


def test_stage0_ranks_fall_back_together():
    results = run_ranks(_stage0_worker, 2, timeout_s=90)
    assert results[0]["tiers"] == results[1]["tiers"]
    assert results[0]["tiers"][:2] == ("device", "host_park")
    assert any("follow another rank" in e for e in results[0]["events"])
    assert any("on rank 1 at bucket 1" in e for e in results[1]["events"])


# ------------------------------------------- 9 and 10: staging and offload memory
def test_staging_slots_are_bounded_powers_of_two():
    assert tiers.staging_slot_bytes(600 * MiB) == 64 * MiB  # a 152k x 2048 embedding
    assert tiers.staging_slot_bytes(5 * MiB) == 8 * MiB
    assert tiers.staging_slot_bytes(64 * MiB) == 64 * MiB
    assert tiers.chunks(3, 20, 8) == [(3, 11), (11, 19), (19, 20)]


def test_the_sharded_tier_stages_slices_not_buckets():
    ctx = tiers.TierContext(
        device=torch.device("cpu"),
        rank=0,
        world_size=8,
        group=None,
        report=SimpleNamespace(),
        staging_slots=2,
        largest_bucket_bytes=600 * MiB,
        largest_slice_bytes=75 * MiB // 8,
    )
    ring = ctx.ring(ctx.largest_slice_bytes)
    assert ring.nbytes == 2 * 16 * MiB and ctx.ring(ctx.largest_slice_bytes) is ring
    ctx.ring(ctx.largest_bucket_bytes)
    assert ctx.staging_bytes == 2 * 16 * MiB + 2 * 64 * MiB  # never 2 x 600 MiB
    ctx.close()
    assert ctx.staging_bytes == 0


def test_failed_pinning_falls_back_to_pageable_staging(caplog, monkeypatch):
    monkeypatch.setattr(accel, "accelerator_type", lambda: "cuda")
    with caplog.at_level(logging.WARNING):
        staging = staging_buffer(4096, pin=True)  # no CUDA here: pinning fails
    assert staging.data.numel() == 4096 and not staging.pinned and not staging.registered
    assert "could not pin" in caplog.text


@pytest.mark.parametrize("tier", ["host", "sharded", "host_park"])
def test_chunked_staging_fills_buckets_bitwise(tier, monkeypatch):
    monkeypatch.setattr(tiers, "STAGING_CHUNK_BYTES", 64)  # 32 bf16 elements per chunk
    model = _net().to(torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat = flatten_parameters(
        model, config=FlattenConfig(tier=tier, bucket_numel=300, progress=False)
    )
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    for g in flat.groups:
        for slot_index, p in enumerate(g.params):
            assert p.data_ptr() == g.param_view(slot_index).data_ptr()
        for b, buf in enumerate(g.buckets):
            for lo, hi in g.layout.gaps(b):
                assert not buf[lo:hi].any(), "padding is zero"


def test_host_park_moves_one_bucket_at_a_time(monkeypatch):
    order: list[str] = []
    park, fill = tiers.HostParkTier._park, tiers.UploadTier.fill

    def spy_park(self, layout, source, bucket):
        order.append(f"park {bucket}")
        return park(self, layout, source, bucket)

    def spy_fill(self, layout, source, bucket, buf):
        order.append(f"fill {bucket}")
        return fill(self, layout, source, bucket, buf)

    monkeypatch.setattr(tiers.HostParkTier, "_park", spy_park)
    monkeypatch.setattr(tiers.UploadTier, "fill", spy_fill)
    model = _net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat = flatten_parameters(
        model, config=FlattenConfig(tier="host_park", bucket_numel=64, progress=False)
    )
    n = len(flat.groups[0].buckets)
    assert n > 2
    assert order == [step for b in range(n) for step in (f"park {b}", f"fill {b}")]
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_host_park_makes_more_room_when_one_bucket_is_not_enough():
    model = _net()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with inject_oom(at_bucket=1, tier="host_park", times=2):  # room after two more buckets
        flat = flatten_parameters(
            model, config=FlattenConfig(tier="host_park", bucket_numel=64, progress=False)
        )
    assert set(flat.report.groups[0].bucket_tiers) == {"host_park"}
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_bitwise_sum_is_exact_and_chunked(monkeypatch):
    t = torch.randn(1000).to(torch.bfloat16)
    expected = t.view(torch.int16).to(torch.int64).sum()
    monkeypatch.setattr(sys.modules[bitwise_sum.__module__], "_CHECKSUM_CHUNK", 7)
    assert bitwise_sum(t) == expected
    u = t.clone()
    u[500] = torch.nextafter(u[500].float(), torch.tensor(1e9)).to(torch.bfloat16)
    if not torch.equal(u, t):
        assert bitwise_sum(u) != bitwise_sum(t)


# --------------------------------------------------------- the smaller findings
def test_the_init_report_leaves_the_users_peak_statistics_alone(monkeypatch):
    from flatzero.report import ReportBuilder

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 100)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 350)
    monkeypatch.setattr(
        torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset")
    )
    builder = ReportBuilder(0, 1, torch.device("cuda", 0))
    report = builder.build("test", [])
    assert calls == []
    assert report.peak_device_bytes == 250


def test_info_creates_a_cuda_context_on_this_ranks_gpu_only(fake_gpus, monkeypatch, capsys):
    from flatzero.cli import main

    fake_gpus(count=4, current=0, local_rank="2")
    queried: list[int] = []
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda d: SimpleNamespace(name="H100", total_memory=80 * 2**30),
    )
    monkeypatch.setattr(
        torch.cuda,
        "mem_get_info",
        lambda d: (queried.append(torch.device(d).index), (2**30, 80 * 2**30))[1],
    )
    assert main(["info"]) == 0
    assert queried == [2]
    assert capsys.readouterr().out.count("H100") == 4


# ------------------------------------------- 7: waiting for another rank's host work
def _slow_rank0_worker(rank: int, world_size: int, backend: str) -> float:
    from datetime import timedelta

    group = dist.new_group(backend=backend, timeout=timedelta(seconds=1.5))
    control.wait_for_host_work(None, nbytes=0)  # the default group too
    t0 = time.monotonic()
    if rank == 0:
        time.sleep(3.0)  # a checkpoint write longer than the group's own timeout
    control.wait_for_host_work(group, nbytes=0)
    waited = time.monotonic() - t0
    dist.all_reduce(torch.ones(1), group=group)  # the group still works afterwards
    return waited


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo"])
def test_ranks_wait_for_a_slow_writer_beyond_the_groups_timeout(backend):
    waited = run_ranks(_slow_rank0_worker, 3, backend, timeout_s=60)
    assert all(w >= 2.9 for w in waited), waited


def _uneven_groups_world_worker(rank: int, world_size: int) -> int:
    own_groups._separate_control_needed = lambda group: True
    dist.new_group([0])  # every rank calls it; only rank 0 registers it: uneven counts
    flat = flatten_parameters(_net(), config=FlattenConfig(progress=False))
    return len(flat.groups)


def test_a_control_group_over_all_ranks_is_found_whatever_groups_ranks_registered():
    assert run_ranks(_uneven_groups_world_worker, 2, timeout_s=60) == [1, 1]


def _uneven_groups_subgroup_worker(rank: int, world_size: int) -> str:
    own_groups._separate_control_needed = lambda group: True
    mine, _ = dist.new_subgroups(group_size=2)
    dist.new_group([0])  # rank 0 now has one more group than rank 1
    try:
        flatten_parameters(_net(), process_group=mine, config=FlattenConfig(progress=False))
        first = "ok"
    except RuntimeError as error:
        first = str(error)
    dist.barrier()
    own_groups.prepare_control_groups([[0, 1], [2, 3]])  # every rank, the same order
    flatten_parameters(_net(), process_group=mine, config=FlattenConfig(progress=False))
    return first


def test_uneven_group_counts_in_a_subgroup_are_an_error_then_prepared_groups_work():
    t0 = time.monotonic()
    results = run_ranks(_uneven_groups_subgroup_worker, 4, timeout_s=90)
    assert time.monotonic() - t0 < 80  # an error, never a wait for a rendezvous timeout
    for message in results[:2]:
        assert "registered different numbers of process groups" in message
        assert "prepare_control_groups" in message
    assert results[2:] == ["ok", "ok"]


def _stage1_buffer_oom_worker(rank: int, world_size: int) -> str:
    import flatzero.optim.stage1 as stage1

    if rank == 1:

        def failing(numel, dtype, device):
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

        stage1.empty_buffer = failing
    try:
        ZeroOptimizer(
            _net().parameters(), stage=1, flatten_config=FlattenConfig(progress=False), lr=1e-2
        )
    except MemoryError as error:
        return str(error)
    raise AssertionError("no MemoryError")


def test_stage1_gradient_buffer_out_of_memory_is_a_memory_error_on_every_rank():
    errors = run_ranks(_stage1_buffer_oom_worker, 2, timeout_s=60)
    assert "on rank 1 allocating the stage 1 gradient buffers" in errors[1]
    assert "on another rank allocating the stage 1 gradient buffers" in errors[0]
