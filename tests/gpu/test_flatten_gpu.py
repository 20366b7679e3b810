"""Every flatten tier on CUDA: values, views, freed storage, peak memory, staging, real OOM.

Sizes come from the layout (``plan_layout`` over the model's specs, checked against the
layout ``flatten_parameters`` used): buckets are sized to their contents, not to
``bucket_numel``. Run with ``FLATZERO_TEST_GPU=1`` (the CPU suite hides the GPUs).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero import FlattenConfig, flatten_parameters, inject_oom, plan_layout
from flatzero.flatten.tiers import STAGING_CHUNK_BYTES
from flatzero.launch import free_port
from flatzero.layout import Layout
from flatzero.params import collect_param_groups

pytestmark = pytest.mark.gpu

MiB = 2**20
SLACK = MiB
"""Allowance for the caching allocator's 512-byte rounding in device-memory checks."""

BIG = 8192
"""Width of the models that fill a card: a Linear(BIG, BIG) layer is a 128 MiB bucket."""


def _model(device: str, layers: int = 8, width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Linear(width, width, device=device, dtype=torch.bfloat16) for _ in range(layers)]
    )


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _layout(model: nn.Module, config: FlattenConfig) -> Layout:
    """The layout ``flatten_parameters(model, config=config)`` plans at world size 1."""
    specs = [g.specs() for g in collect_param_groups(model)]
    return plan_layout(
        specs, world_size=1, bucket_numel=config.bucket_numel, alignment=config.alignment
    )


def _bucket_bytes(layout: Layout) -> list[int]:
    return [b.numel * getattr(torch, g.dtype).itemsize for g in layout.groups for b in g.buckets]


def _master_bytes(layout: Layout) -> int:
    return sum(g.shard_numel for g in layout.groups) * 4


def _model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _assert_flat(model: nn.Module, before: dict, flat, device_type: str = "cuda") -> None:
    """Every param holds its old value as a view of its bucket; masters mirror buckets."""
    for name, p in model.named_parameters():
        assert p.device.type == device_type, name
        assert torch.equal(p.detach().cpu(), before[name]), name
    for g in flat.groups:
        for slot, p in zip(g.layout.slots, g.params, strict=True):
            buf = g.buckets[slot.bucket]
            assert p.data_ptr() == buf.data_ptr() + slot.offset * buf.element_size()
        if g.master is not None:
            assert g.master.device == g.device
            for b in range(len(g.buckets)):  # world size 1: the shard is the whole bucket
                assert torch.equal(g.master_slice(b), g.buckets[b].float())


def _settle() -> int:
    """Bytes allocated on the GPU now, with the peak statistic reset to it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _warm_up() -> None:
    """Flatten a small model in the tiers a test is about to use, so that the kernels CUDA
    loads lazily (device memory) and the copy stream exist before the card is filled."""
    for tier in ("device", "host_park"):
        flatten_parameters(
            _model("cuda", layers=2, width=256),
            config=FlattenConfig(tier=tier, bucket_numel=2**16, progress=False),
        )
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@contextmanager
def _card_with_free(target: int, tolerance: int) -> Iterator[int]:
    """Fill the GPU until the driver reports ``target`` bytes free (to ``tolerance``).

    Fillers are multiples of 2 MiB and at least 10 MiB, which the caching allocator maps
    to segments of exactly their size; the cache is emptied first, so what the driver
    reports free is all a flatten call can get.
    """
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    hog: list[torch.Tensor] = []
    chunk = 8 * 2**30
    try:
        for _ in range(200):
            free, _total = torch.cuda.mem_get_info()
            excess = (free - target) // (2 * MiB) * (2 * MiB)
            if excess < 10 * MiB:
                break
            try:
                hog.append(torch.empty(min(excess, chunk), dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:  # the driver keeps some of what it reports free
                chunk = max(10 * MiB, min(excess, chunk) // 2)
        free, _total = torch.cuda.mem_get_info()
        assert abs(free - target) <= tolerance, (
            f"could not fill the GPU to {target / MiB:.0f} MiB free (+-{tolerance / MiB:.0f}); "
            f"{free / MiB:.0f} MiB are free: is another process using it?"
        )
        yield free
    finally:
        hog.clear()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("build_master", [False, True])
def test_device_tier_peaks_at_one_bucket_plus_the_masters(build_master):
    """The fp32 masters are allocated first; then each bucket replaces its params, so the
    peak is the masters plus the largest bucket, and the old storage is released."""
    model = _model("cuda")
    before = _snapshot(model)
    config = FlattenConfig(
        tier="device", bucket_numel=2**20, build_master=build_master, progress=False
    )
    layout = _layout(model, config)
    buckets = _bucket_bytes(layout)
    masters = _master_bytes(layout) if build_master else 0
    padding = sum(g.padding_numel for g in layout.groups) * 2
    base = _settle()
    flat = flatten_parameters(model, config=config)
    torch.cuda.synchronize()
    assert flat.layout.digest() == layout.digest()
    _assert_flat(model, before, flat)
    assert (flat.groups[0].master is not None) == build_master
    grown = torch.cuda.memory_allocated() - base
    assert padding + masters <= grown <= padding + masters + SLACK, "old storage must go"
    peak = torch.cuda.max_memory_allocated() - base
    assert max(buckets) + masters <= peak <= max(buckets) + masters + padding + SLACK
    assert flat.report.peak_device_bytes == peak
    moved = flat.report.bytes_moved
    assert moved["device_copy"] == _model_bytes(model) + (sum(buckets) if build_master else 0)
    assert moved["h2d"] == moved["d2h"] == moved["host_copy"] == moved["all_gather"] == 0


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("tier", ["host", "sharded", "auto"])
def test_host_params_go_to_the_device(tier, pinned):
    model = _model("cpu")
    if pinned:
        for p in model.parameters():
            p.data = p.data.pin_memory()
    before = _snapshot(model)
    config = FlattenConfig(tier=tier, bucket_numel=2**20, progress=False)
    flat = flatten_parameters(model, config=config)
    _assert_flat(model, before, flat)
    expected = "host" if tier == "auto" else tier  # auto: params on the host, one rank
    assert flat.report.tiers == (expected,)
    assert set(flat.report.groups[0].bucket_tiers) == {expected}
    moved = flat.report.bytes_moved
    # One rank uploads whole buckets (``sharded`` too: its slice is the whole bucket).
    assert moved["h2d"] == sum(_bucket_bytes(flat.layout))
    assert moved["host_copy"] == _model_bytes(model)
    assert moved["d2h"] == moved["all_gather"] == 0


def _pinned_bytes() -> tuple[int, int] | None:
    """(current, peak) bytes of PyTorch's pinned host allocator, cached blocks included;
    None on a PyTorch without the statistics."""
    stats_of = getattr(torch.cuda.memory, "host_memory_stats", None)
    if stats_of is None:
        return None
    stats = stats_of()
    if "allocated_bytes.current" not in stats:
        return None
    return stats["allocated_bytes.current"], stats["allocated_bytes.peak"]


def test_host_tier_streams_a_large_bucket_through_bounded_pinned_staging():
    """A bucket larger than a staging slot is uploaded chunk by chunk: the staging ring
    stays at most ``staging_buffers`` x 64 MiB of pinned memory, is released afterwards,
    and takes no device memory."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40_000, 1024), nn.Linear(1024, 1024)).to(torch.bfloat16)
    before = _snapshot(model)
    config = FlattenConfig(
        tier="host", bucket_numel=1024 * 1024 + 1024, build_master=False, progress=False
    )
    layout = _layout(model, config)
    buckets = _bucket_bytes(layout)
    assert len(buckets) == 2 and max(buckets) > STAGING_CHUNK_BYTES  # the embedding alone
    torch.cuda.init()
    torch.accelerator.empty_host_cache()  # earlier tests' cached pinned blocks: not this test's
    pinned_before = _pinned_bytes()
    reset_peak = getattr(torch.cuda.memory, "reset_peak_host_memory_stats", None)
    if reset_peak is not None:
        reset_peak()
    base = _settle()
    flat = flatten_parameters(model, config=config)
    torch.cuda.synchronize()
    assert flat.layout.digest() == layout.digest()
    _assert_flat(model, before, flat)
    grown = torch.cuda.memory_allocated() - base
    assert sum(buckets) <= grown <= sum(buckets) + 512 * len(buckets)
    assert torch.cuda.max_memory_allocated() - base == grown, "staging used device memory"
    assert flat.report.bytes_moved["h2d"] == sum(buckets)
    pinned_after = _pinned_bytes()
    if pinned_before is not None and pinned_after is not None:
        assert pinned_after[0] == pinned_before[0], "staging memory stayed pinned"
        ring = config.staging_buffers * STAGING_CHUNK_BYTES
        assert ring < 2 * max(buckets)  # what a ring of whole buckets would pin
        if reset_peak is not None:
            assert pinned_after[1] - pinned_before[0] <= ring


def test_host_park_tier_round_trips_through_host_memory_bucket_by_bucket():
    """Each bucket's params leave the device before its buffer is allocated: beyond the
    masters, the host_park tier needs no device memory."""
    model = _model("cuda")
    before = _snapshot(model)
    config = FlattenConfig(tier="host_park", bucket_numel=2**20, progress=False)
    layout = _layout(model, config)
    base = _settle()
    flat = flatten_parameters(model, config=config)
    torch.cuda.synchronize()
    _assert_flat(model, before, flat)
    assert set(flat.report.groups[0].bucket_tiers) == {"host_park"}
    peak = torch.cuda.max_memory_allocated() - base
    assert _master_bytes(layout) <= peak <= _master_bytes(layout) + SLACK
    assert flat.report.bytes_moved["d2h"] == _model_bytes(model)
    assert flat.report.bytes_moved["h2d"] == sum(_bucket_bytes(layout))


@pytest.mark.parametrize("times", [1, 2])
def test_injected_oom_in_device_tier(times):
    """On a GPU a failed allocation is retried once after emptying the allocator's cache
    (``allocate_or_oom``): one failure changes nothing; two send bucket 3 and every later
    one to ``host_park``, which moves them to the host and back, bucket by bucket."""
    model = _model("cuda")
    before = _snapshot(model)
    config = FlattenConfig(tier="device", bucket_numel=2**20, progress=False)
    layout = _layout(model, config)
    (group,) = layout.groups
    with inject_oom(at_bucket=3, tier="device", times=times):
        flat = flatten_parameters(model, config=config)
    _assert_flat(model, before, flat)
    (report,) = flat.report.groups
    assert flat.report.tiers == ("device",)
    assert report.device == flat.report.device  # every bucket on the GPU
    moved = flat.report.bytes_moved
    if times == 1:
        assert report.bucket_tiers == ("device",) * len(group.buckets)
        assert flat.report.events == ()
        assert moved["d2h"] == moved["h2d"] == 0
        return
    assert report.bucket_tiers == ("device",) * 3 + ("host_park",) * (len(group.buckets) - 3)
    (event,) = flat.report.events
    assert "bucket 3" in event and "tier 'host_park'" in event
    assert moved["d2h"] == sum(s.spec.numel for s in group.slots if s.bucket >= 3) * 2
    assert moved["h2d"] == sum(b.numel for b in group.buckets[3:]) * 2


def _big_model_and_config(tier: str) -> tuple[nn.Module, FlattenConfig, Layout]:
    """Two Linear(BIG, BIG) layers on the GPU, one bucket each (128 MiB of bf16)."""
    model = _model("cuda", layers=2, width=BIG)
    config = FlattenConfig(tier=tier, bucket_numel=BIG * BIG + BIG, progress=False)
    layout = _layout(model, config)
    assert len(layout.groups[0].buckets) == 2
    return model, config, layout


def test_real_out_of_memory_in_device_tier_falls_back_to_host_park():
    """Less than one bucket free once the masters are allocated: ``device`` fails on the
    first bucket and, on a GPU, ``host_park`` is the next tier (never host buffers): it moves
    each bucket's params to the host first, which frees what its buffer needs."""
    model, config, layout = _big_model_and_config("device")
    before = _snapshot(model)
    bucket = max(_bucket_bytes(layout))
    masters = _master_bytes(layout)
    _warm_up()
    with _card_with_free(masters + bucket // 2, tolerance=bucket // 4):
        flat = flatten_parameters(model, config=config)
        torch.cuda.synchronize()
    _assert_flat(model, before, flat)
    (report,) = flat.report.groups
    assert flat.report.tiers == ("device",)
    assert report.bucket_tiers == ("host_park", "host_park")
    assert report.device == flat.report.device  # every bucket on the GPU
    (event,) = flat.report.events
    assert "bucket 0" in event and "tier 'device'" in event and "tier 'host_park'" in event
    assert flat.report.bytes_moved["d2h"] == _model_bytes(model)


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        # tier='device' is taken as asked; the masters are allocated before any bucket
        ("device", "out of memory on rank 0 allocating the fp32 master shards"),
        # auto counts the master and gradient shards and refuses up front
        ("auto", "the fp32 master and gradient shards need"),
    ],
)
def test_real_out_of_memory_for_the_masters_changes_nothing(tier, message):
    """Not even the fp32 masters fit: ``MemoryError`` (not torch's ``OutOfMemoryError``)
    before any param is touched, and nothing is left allocated."""
    model, config, layout = _big_model_and_config(tier)
    before = _snapshot(model)
    pointers = {n: p.data_ptr() for n, p in model.named_parameters()}
    masters = _master_bytes(layout)
    _warm_up()
    with _card_with_free(masters // 2, tolerance=masters // 8):
        allocated = torch.cuda.memory_allocated()
        with pytest.raises(MemoryError, match=message) as raised:
            flatten_parameters(model, config=config)
        assert "nothing was changed" in str(raised.value)
        del raised
        gc.collect()
        assert torch.cuda.memory_allocated() == allocated
    for name, p in model.named_parameters():
        assert p.data_ptr() == pointers[name], name
        assert torch.equal(p.detach().cpu(), before[name]), name


def test_auto_picks_device_for_params_on_the_gpu():
    model = _model("cuda")
    before = _snapshot(model)
    flat = flatten_parameters(model, config=FlattenConfig(progress=False))
    _assert_flat(model, before, flat)
    assert flat.report.tiers == ("device",)
    assert "fp32 shards" in flat.report.tier_reason  # the masters and grads were counted


def test_gloo_process_group_keeps_the_buckets_on_the_host():
    """gloo cannot reduce-scatter CUDA tensors: with a gloo group on a GPU machine the
    buckets stay in host memory, and asking for CUDA is refused before anything moves."""
    model = _model("cpu")
    before = _snapshot(model)
    on_gpu = _model("cuda", layers=1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        flat = flatten_parameters(model, config=FlattenConfig(progress=False))
        with pytest.raises(ValueError, match="cannot reduce-scatter CUDA tensors"):
            flatten_parameters(on_gpu, config=FlattenConfig(device="cuda", progress=False))
    finally:
        dist.destroy_process_group()
    assert flat.report.device == "cpu"
    assert flat.report.tiers == ("cpu",)
    _assert_flat(model, before, flat, device_type="cpu")
    assert all(p.is_cuda for p in on_gpu.parameters())
