"""The flatten tiers on an accelerator: values bitwise, memory bounded, out of memory agreed.

Runs on the emulated accelerator everywhere (its memory is counted exactly and its
capacity is set per test) and on CUDA where there is one.
"""

from __future__ import annotations

import gc

import pytest
import torch

from flatzero import FlattenConfig, accel, flatten_parameters
from flatzero.testing import emulated

from .harness import UnevenNet, host_copy, launch, this_device, unchanged

BUCKET = 1024  # elements: the net's 5 blocks, embedding and norm make several buckets


def _config(**kw) -> FlattenConfig:
    return FlattenConfig(bucket_numel=BUCKET, progress=False, **kw)


def _buckets_bytes(flat) -> tuple[int, int, int]:
    """(largest bucket, all buckets, this rank's fp32 master shards), in bytes."""
    buckets = [b for g in flat.groups for b in g.buckets]
    largest = max(b.numel() * b.element_size() for b in buckets)
    total = sum(b.numel() * b.element_size() for b in buckets)
    masters = sum(g.layout.shard_numel * 4 for g in flat.groups)
    return largest, total, masters


# ------------------------------------------------------------------ the device tier
def _device_tier_worker(rank: int, world_size: int, kind: str) -> dict:
    device = this_device(kind)
    model = UnevenNet().to(device)
    before = host_copy(model)
    params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    accel.synchronize(device)
    base = accel.memory_allocated(device)
    accel.reset_peak_memory_stats(device)
    flat = flatten_parameters(model, config=_config())
    accel.synchronize(device)
    peak_extra = accel.max_memory_allocated(device) - base
    grown = accel.memory_allocated(device) - base
    largest, total, masters = _buckets_bytes(flat)

    # DeepSpeed 0.19's on-device path (#7828): torch.cat of the whole group, originals alive.
    ds_model = UnevenNet().to(device)
    ds_base = accel.memory_allocated(device)
    accel.reset_peak_memory_stats(device)
    cat = torch.cat([p.detach().reshape(-1) for p in ds_model.parameters()])
    accel.synchronize(device)
    ds_peak = accel.max_memory_allocated(device) - ds_base
    del cat
    return {
        "tier": flat.report.tiers,
        "device": [str(g.device) for g in flat.groups],
        "changed": unchanged(model, before),
        "views": all(
            p.data_ptr() == g.param_view(i).data_ptr()
            for g in flat.groups
            for i, p in enumerate(g.params)
        ),
        "peak_extra": peak_extra,
        "grown": grown,
        "largest": largest,
        "total": total,
        "masters": masters,
        "params_bytes": params_bytes,
        "ds_peak": ds_peak,
        "buckets": sum(len(g.buckets) for g in flat.groups),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_device_tier_is_bitwise_and_peaks_at_one_bucket_plus_master(kind, world_size):
    for r in launch(kind, _device_tier_worker, world_size):
        assert set(r["tier"]) == {"device"}, r["tier"]
        assert all(d.startswith(kind) for d in r["device"])
        assert r["changed"] == [] and r["views"]
        assert r["buckets"] >= 4
        # What stays: the fp32 master shard and the buckets' padding; what passes: at most
        # one bucket in flight above that.
        assert r["grown"] == r["masters"] + r["total"] - r["params_bytes"], r
        assert r["peak_extra"] - r["grown"] <= r["largest"], r
        # DeepSpeed's torch.cat keeps every original alive: the model once more.
        assert r["ds_peak"] >= r["params_bytes"] - 64 * 4
        assert r["ds_peak"] > r["peak_extra"] - r["masters"]


# ------------------------------------------------------- host, sharded: uploads
def _upload_worker(rank: int, world_size: int, kind: str) -> dict:
    device = this_device(kind)
    model = UnevenNet()  # in host memory
    before = host_copy(model)
    base = accel.memory_allocated(device)
    accel.reset_peak_memory_stats(device)
    flat = flatten_parameters(model, config=_config(device=kind))
    accel.synchronize(device)
    _largest, total, masters = _buckets_bytes(flat)
    return {
        "tier": flat.report.tiers,
        "on": sorted({p.device.type for p in model.parameters()}),
        "changed": unchanged(model, before),
        "grown": accel.memory_allocated(device) - base,
        "peak": accel.max_memory_allocated(device) - base,
        "total": total,
        "masters": masters,
        "buckets": [
            bytes(b.cpu().view(torch.uint8).numpy()) for g in flat.groups for b in g.buckets
        ],
        "moved": dict(flat.report.bytes_moved),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_upload_tiers_fill_device_buckets_bitwise(kind, world_size):
    results = launch(kind, _upload_worker, world_size)
    expected = "host" if world_size == 1 else "sharded"
    for r in results:
        assert set(r["tier"]) == {expected}, r["tier"]
        assert r["on"] == [kind] and r["changed"] == []
        # Nothing on the device but the buckets and the master shard, at the peak too.
        assert r["grown"] == r["total"] + r["masters"]
        assert r["peak"] == r["grown"]
    if world_size > 1:
        # Each rank uploaded about its slice; the all-gather brought the rest.
        total = results[0]["total"]
        for r in results:
            assert r["moved"]["h2d"] <= total // world_size + 64 * 4 * len(r["buckets"])
            assert r["moved"]["all_gather"] > 0
        assert all(r["buckets"] == results[0]["buckets"] for r in results)


# ------------------------------------------------- host_park: a full device makes room
def _host_park_worker(rank: int, world_size: int, kind: str) -> dict:
    device = this_device(kind)
    largest, _total, masters = _buckets_bytes(
        flatten_parameters(UnevenNet().to(device), config=_config())
    )  # the sizes, measured on a first copy that is then freed
    model = UnevenNet().to(device)
    before = host_copy(model)
    # Room for the fp32 master and gradient shards (what flatten_parameters reserves for
    # the optimizer) and half a bucket: the device tier would need a whole one.
    gc.collect()
    room = 2 * masters + largest // 2
    emulated.installed().set_capacity(accel.memory_allocated(device) + room)
    flat = flatten_parameters(model, config=_config())
    return {
        "tier": flat.report.tiers,
        "reason": flat.report.tier_reason,
        "changed": unchanged(model, before),
        "on": sorted({p.device.type for p in model.parameters()}),
    }


def test_host_park_tier_when_not_one_bucket_fits():
    (r,) = launch("emu", _host_park_worker, 1)
    assert set(r["tier"]) == {"host_park"}, r
    assert r["changed"] == [] and r["on"] == ["emu"]


# ----------------------------------------------- the out-of-memory ladder, every bucket
def _allocation_log_worker(rank: int, world_size: int, kind: str) -> list[tuple[int, int]]:
    """The (allocated before, size) of every device allocation a device-tier flatten makes."""
    state = emulated.installed()
    log: list[tuple[int, int]] = []
    charge = state._charge

    def logging_charge(index: int, nbytes: int) -> None:
        log.append((state.counters[index].allocated, nbytes))
        charge(index, nbytes)

    model = UnevenNet().to(this_device(kind))
    state._charge = logging_charge
    flatten_parameters(model, config=_config(build_master=False))
    state._charge = charge
    return log


def _flatten_with_capacity(kind: str, capacity: int) -> dict:
    """A fresh net on the device flattened with ``capacity`` bytes of device memory."""
    state = emulated.installed()
    state.set_capacity(1 << 40)
    gc.collect()
    model = UnevenNet().to(this_device(kind))
    before = host_copy(model)
    state.set_capacity(capacity)
    try:
        flat = flatten_parameters(model, config=_config(build_master=False))
    except torch.OutOfMemoryError as error:
        return {
            "error": str(error),
            "memory_error": isinstance(error, MemoryError),
            "changed": unchanged(model, before),
        }
    return {
        "error": None,
        "tiers": [t for g in flat.report.groups for t in g.bucket_tiers],
        "events": flat.report.events,
        "changed": unchanged(model, before),
        "on": sorted({p.device.type for p in model.parameters()}),
    }


def _ladder_worker(rank: int, world_size: int, kind: str, capacities: list[int]) -> list[dict]:
    """Rank 1 flattens with each of ``capacities``; the other ranks have room to spare."""
    return [_flatten_with_capacity(kind, c if rank == 1 else 1 << 40) for c in capacities]


def test_out_of_memory_at_every_bucket_loses_nothing_and_every_rank_agrees():
    (log,) = launch("emu", _allocation_log_worker, 1)
    bucket_allocations = [(before, n) for before, n in log if n >= 64 * 4]
    assert len(bucket_allocations) >= 4
    # Rank 1 alone is one byte short of each bucket in turn; rank 0 has room for everything.
    capacities = [before + nbytes - 1 for before, nbytes in bucket_allocations]
    per_rank = launch("emu", _ladder_worker, 2, capacities)
    outcomes = set()
    for capacity, results in zip(capacities, zip(*per_rank, strict=True), strict=True):
        for r in results:
            assert r["error"] is None and r["changed"] == [], (capacity, r)
            assert r["on"] == ["emu"]
        assert results[0]["tiers"] == results[1]["tiers"], "ranks agree on every bucket's tier"
        tiers = results[0]["tiers"]
        assert "host_park" in tiers, results[0]
        if tiers[0] == "device":  # ran out mid-way: the fallback is reported
            assert any("out of memory" in e for e in results[0]["events"]), results[0]
        outcomes.add(tiers[0])
    # Some capacities are caught by the tier decision, the others by the ladder mid-way.
    assert outcomes == {"device", "host_park"}


def test_nothing_fits_is_torch_out_of_memory_on_every_rank_with_params_kept():
    per_rank = launch("emu", _ladder_worker, 2, [1])
    for (r,) in per_rank:
        assert r["error"] is not None and r["changed"] == [], r
        assert r["memory_error"], "still a MemoryError for callers that catch that"


def test_emulated_device_is_refused_where_the_backend_cannot_run_its_collectives():
    results = launch("emu", _gloo_only_worker, 2, backend="gloo")
    assert results == ["cpu", "cpu"]  # a gloo group keeps buckets on the host


def _gloo_only_worker(rank: int, world_size: int, kind: str) -> str:
    model = UnevenNet()
    flat = flatten_parameters(model, config=_config())
    try:
        flatten_parameters(UnevenNet(), config=_config(device="emu"))
    except ValueError as error:
        assert "cannot reduce-scatter emu" in str(error)
    else:
        raise AssertionError("device='emu' on a gloo group must be refused")
    return str(flat.groups[0].device)
