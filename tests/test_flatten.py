"""Single-process flattening: every tier on the CPU, values, views, memory, errors."""

from __future__ import annotations

import gc
import logging
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from flatzero import FlattenConfig, flatten_parameters, inject_oom
from flatzero.procmem import trim_host_memory

TIERS = ["cpu", "device", "host", "sharded", "host_park"]


class Zoo(nn.Module):
    """Odd shapes: a tied pair, a frozen param, a non-contiguous one, a zero-size one."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.embed = nn.Embedding(37, 11)
        self.a = nn.Linear(11, 23)
        self.b = nn.Linear(23, 5, bias=False)
        self.head = nn.Linear(11, 37, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.frozen = nn.Parameter(torch.randn(7), requires_grad=False)
        self.transposed = nn.Parameter(torch.randn(9, 4).t())  # non-contiguous
        self.empty = nn.Parameter(torch.empty(0, 3))
        self.scalar = nn.Parameter(torch.tensor(1.5))
        self.to(dtype)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_flat(model: nn.Module, flat, before: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert torch.equal(p, before[name]), name
        assert p.dtype == before[name].dtype
    for g in flat.groups:
        for slot, name, p in zip(g.layout.slots, g.names, g.params, strict=True):
            assert params[name] is p
            bucket = g.buckets[slot.bucket]
            if p.numel():
                expected = bucket.data_ptr() + slot.offset * bucket.element_size()
                assert p.data_ptr() == expected, name
                assert p.is_contiguous()
        for b, buf in enumerate(g.buckets):
            for s, e in g.layout.gaps(b):
                assert torch.count_nonzero(buf[s:e]) == 0, "padding must be zero"


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("bucket_numel", [1, 100, 10_000])
def test_every_tier_keeps_values_and_rebinds_to_views(tier, bucket_numel):
    model = Zoo()
    before = _snapshot(model)
    frozen_ptr = model.frozen.data_ptr()
    flat = flatten_parameters(
        model, config=FlattenConfig(tier=tier, bucket_numel=bucket_numel, progress=False)
    )
    _assert_flat(model, flat, before)
    assert model.frozen.data_ptr() == frozen_ptr
    assert model.head.weight is model.embed.weight
    assert flat.report.tiers == (tier,)
    assert flat.frozen == [model.frozen]
    # The fp32 master shard is the bucket contents, upcast.
    g = flat.groups[0]
    for b in range(len(g.buckets)):
        assert torch.equal(g.master_slice(b), g.buckets[b].float())


def test_groups_and_dtypes_get_separate_layouts():
    model = Zoo(torch.float32)
    model.b.to(torch.bfloat16)
    groups = [
        {"params": [model.embed.weight, model.a.weight, model.b.weight], "lr": 0.1},
        {"params": [model.a.bias, model.transposed], "weight_decay": 0.0},
    ]
    before = {id(p): p.detach().clone() for g in groups for p in g["params"]}
    flat = flatten_parameters(groups, config=FlattenConfig(bucket_numel=64, progress=False))
    assert [(g.layout.group_index, g.layout.dtype) for g in flat.groups] == [
        (0, "float32"),
        (0, "bfloat16"),
        (1, "float32"),
    ]
    assert flat.groups[0].options == {"lr": 0.1}
    assert flat.groups[2].options == {"weight_decay": 0.0}
    for g in flat.groups:
        for p in g.params:
            assert torch.equal(p, before[id(p)])


def test_old_storage_is_released():
    arrays = [np.random.rand(1000, 33).astype(np.float32) for _ in range(3)]
    refs = [weakref.ref(a) for a in arrays]
    params = [nn.Parameter(torch.from_numpy(a)) for a in arrays]
    expected = [p.detach().clone() for p in params]
    del arrays
    gc.collect()
    assert all(r() is not None for r in refs)  # the params still hold them
    flatten_parameters(params, config=FlattenConfig(bucket_numel=10_000, progress=False))
    gc.collect()
    assert all(r() is None for r in refs)
    for p, e in zip(params, expected, strict=True):
        assert torch.equal(p, e)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_host_memory_grows_by_at_most_a_bucket():
    # 256 MiB of fp32 params in 16 MiB tensors; buckets of 32 MiB.
    params = [nn.Parameter(torch.randn(4 * 2**20)) for _ in range(16)]
    # Freed heap memory handed back (glibc keeps it when an earlier test raised its
    # adaptive mmap threshold above these 16 MiB tensors): what remains is what init holds.
    trim_host_memory()
    base = _rss_bytes()
    config = FlattenConfig(tier="cpu", bucket_numel=8 * 2**20, build_master=False, progress=False)
    flat = flatten_parameters(params, config=config)
    trim_host_memory()
    grown = _rss_bytes() - base
    assert grown < 48 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
    assert len(flat.groups[0].buckets) == 8


@pytest.mark.parametrize(
    ("tier", "fallback"),
    [("device", "host_park"), ("host", "cpu"), ("sharded", "cpu"), ("host_park", "cpu")],
)
def test_out_of_memory_falls_back_to_the_next_tier(tier, fallback, caplog):
    model = Zoo()
    before = _snapshot(model)
    config = FlattenConfig(tier=tier, bucket_numel=100, progress=False)
    # host_park first makes room by moving later buckets' params out: fail every retry
    times = 100 if tier == "host_park" else 1
    with inject_oom(at_bucket=2, tier=tier, times=times), caplog.at_level(logging.WARNING):
        flat = flatten_parameters(model, config=config)
    _assert_flat(model, flat, before)
    tiers = flat.report.groups[0].bucket_tiers
    assert tiers[:2] == (tier, tier)
    assert set(tiers[2:]) == {fallback}
    (event,) = flat.report.events
    assert "bucket 2" in event and f"tier {fallback!r}" in event
    assert "out of memory" in caplog.text


def test_out_of_memory_in_the_last_tier_loses_no_parameter():
    model = Zoo()
    before = _snapshot(model)
    config = FlattenConfig(tier="cpu", bucket_numel=100, progress=False)
    with inject_oom(at_bucket=3, tier="cpu"), pytest.raises(MemoryError, match="still holds"):
        flatten_parameters(model, config=config)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_one_log_line_on_rank_zero(caplog):
    with caplog.at_level(logging.INFO, logger="flatzero"):
        flatten_parameters(Zoo(), config=FlattenConfig(progress=False))
    lines = [r for r in caplog.records if r.name.startswith("flatzero")]
    assert len(lines) == 1
    assert "flatzero init" in lines[0].getMessage()


def test_report_counts_elements_padding_and_bytes():
    model = Zoo()
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    flat = flatten_parameters(model, config=FlattenConfig(bucket_numel=100, progress=False))
    (g,) = flat.report.groups
    assert g.elements == n
    assert g.padding == flat.groups[0].layout.numel - n
    assert g.buckets == len(flat.groups[0].buckets)
    assert flat.report.bytes_moved["host_copy"] >= 2 * n  # bf16 params, plus the master
    assert flat.report.cpu_seconds >= 0 and flat.report.wall_seconds > 0
    assert set(flat.report.phase_seconds) == {"plan", "flatten", "master", "sync"}


class _Bad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(3))
        self.b = nn.Parameter(torch.randn(3, device="meta"))


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: _Bad(), ValueError, "several devices"),
        (lambda: nn.Linear(2, 3, device="meta"), ValueError, "meta device"),
        (lambda: nn.Linear(2, 2).requires_grad_(False), ValueError, "no trainable"),
        (lambda: [], ValueError, "no trainable"),
        (lambda: [torch.randn(3)], TypeError, "not a torch.nn.Parameter"),
        (lambda: torch.randn(3), TypeError, "single tensor"),
        (lambda: [3], TypeError, "expected a torch.nn.Parameter"),
    ],
)
def test_bad_input_is_named(make, error, message):
    with pytest.raises(error, match=message):
        flatten_parameters(make(), config=FlattenConfig(progress=False))


def test_param_in_two_groups_is_rejected_and_untouched():
    lin = nn.Linear(3, 3)
    ptr = lin.weight.data_ptr()
    groups = [{"params": [lin.weight]}, {"params": [lin.weight, lin.bias]}]
    with pytest.raises(ValueError, match="param groups 0 and 1"):
        flatten_parameters(groups, config=FlattenConfig(progress=False))
    assert lin.weight.data_ptr() == ptr


def test_world_size_mismatch_is_named():
    with pytest.raises(ValueError, match="world_size=2 was given but the process group has 1"):
        flatten_parameters(nn.Linear(2, 2), world_size=2, config=FlattenConfig(progress=False))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tier": "gpu"}, "tier is 'gpu'"),
        ({"bucket_numel": 0}, "bucket_numel must be a positive int"),
        ({"staging_buffers": 0}, "staging_buffers"),
        ({"host_threads": 0}, "host_threads"),
    ],
)
def test_bad_config_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FlattenConfig(**kwargs)


def test_thread_setting_is_restored_after_flattening():
    before = torch.get_num_threads()
    flatten_parameters(nn.Linear(10, 10), config=FlattenConfig(tier="cpu", progress=False))
    assert torch.get_num_threads() == before


def test_allocate_only_binds_meta_params_to_buckets_without_reading_them():
    model = nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 5)).to(torch.bfloat16)
    values = _snapshot(model)
    meta = nn.Sequential(nn.Linear(13, 7), nn.Linear(7, 5)).to(device="meta", dtype=torch.bfloat16)
    before = [id(p) for p in meta.parameters()]
    flat = flatten_parameters(
        meta, config=FlattenConfig(bucket_numel=64, progress=False), allocate_only=True
    )
    assert [id(p) for p in meta.parameters()] == before  # the same Parameter objects
    assert flat.report.bytes_moved.get("host_copy", 0) == 0  # nothing was read
    (group,) = flat.groups
    assert group.master is not None and group.master.dtype == torch.float32
    assert group.master.numel() == group.layout.shard_numel
    for slot, p in enumerate(group.params):
        assert p.device.type == "cpu" and p.data_ptr() == group.param_view(slot).data_ptr()
    for b, bucket in enumerate(group.buckets):
        for lo, hi in group.layout.gaps(b, 0, bucket.numel()):
            assert not bucket[lo:hi].any()  # the padding is zero, as after a real flatten
    # Filling the buckets is what a load does; the params see it.
    with torch.no_grad():
        for name, p in meta.named_parameters():
            p.copy_(values[name])
    for name, p in meta.named_parameters():
        assert torch.equal(p.detach(), values[name])


def test_allocate_only_rejects_what_it_cannot_honour():
    meta = nn.Linear(3, 2, device="meta")
    with pytest.raises(ValueError, match="has nothing to stage with allocate_only"):
        flatten_parameters(
            meta, config=FlattenConfig(tier="sharded", progress=False), allocate_only=True
        )
    assert meta.weight.device.type == "meta"


def test_the_cyclic_gc_is_paused_inside_init_and_restored_after():
    import gc

    from flatzero.gcpause import paused_gc

    seen = []
    model = nn.Linear(4, 4)
    assert gc.isenabled()
    with paused_gc():
        seen.append(gc.isenabled())
        with pytest.raises(RuntimeError), paused_gc():
            raise RuntimeError("an error inside")
        seen.append(gc.isenabled())  # an inner pause does not re-enable it
    seen.append(gc.isenabled())
    assert seen == [False, False, True]
    flatten_parameters(model, config=FlattenConfig(progress=False))
    assert gc.isenabled()
    gc.disable()
    try:
        flatten_parameters(nn.Linear(4, 4), config=FlattenConfig(progress=False))
        assert not gc.isenabled()  # a collector the user disabled stays disabled
    finally:
        gc.enable()
