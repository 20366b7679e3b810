"""Every flatten tier on CUDA: values, views, freed storage, peak memory, real OOM."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from flatzero import FlattenConfig, flatten_parameters, inject_oom

MiB = 2**20


def _model(device: str, layers: int = 8, width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(
        device=device, dtype=torch.bfloat16
    )


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def _assert_same(model: nn.Module, before: dict[str, torch.Tensor], flat) -> None:
    for name, p in model.named_parameters():
        assert p.is_cuda, name
        assert torch.equal(p.detach().cpu(), before[name]), name
    for g in flat.groups:
        for slot, p in zip(g.layout.slots, g.params, strict=True):
            buf = g.buckets[slot.bucket]
            assert p.data_ptr() == buf.data_ptr() + slot.offset * buf.element_size()


def _model_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_device_tier_frees_old_storage_and_peaks_at_one_bucket():
    model = _model("cuda")
    before = _snapshot(model)
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated()
    bucket_numel = 2 * 2**20
    config = FlattenConfig(
        tier="device", bucket_numel=bucket_numel, build_master=False, progress=False
    )
    flat = flatten_parameters(model, config=config)
    _assert_same(model, before, flat)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    padding = sum(g.layout.padding_numel for g in flat.groups) * 2
    assert after - base <= padding + MiB, "old storage must be released"
    largest_bucket = max(b.numel for g in flat.layout.groups for b in g.buckets) * 2
    assert flat.report.peak_device_bytes <= largest_bucket + MiB


@pytest.mark.parametrize("pinned", [False, True])
@pytest.mark.parametrize("tier", ["host", "sharded", "auto"])
def test_host_params_go_to_the_device(tier, pinned):
    model = _model("cpu")
    if pinned:
        for p in model.parameters():
            p.data = p.data.pin_memory()
    before = _snapshot(model)
    flat = flatten_parameters(
        model, config=FlattenConfig(tier=tier, bucket_numel=2**20, progress=False)
    )
    _assert_same(model, before, flat)
    assert flat.report.bytes_moved["h2d"] >= _model_bytes(model)
    if tier == "auto":
        assert flat.report.tiers == ("host",)


def test_offload_tier_round_trips_through_pinned_host():
    model = _model("cuda")
    before = _snapshot(model)
    flat = flatten_parameters(
        model, config=FlattenConfig(tier="offload", bucket_numel=2**20, progress=False)
    )
    _assert_same(model, before, flat)
    assert flat.report.bytes_moved["d2h"] >= _model_bytes(model)


def test_injected_oom_in_device_tier_continues_in_offload():
    model = _model("cuda")
    before = _snapshot(model)
    with inject_oom(at_bucket=3, tier="device"):
        flat = flatten_parameters(
            model, config=FlattenConfig(tier="device", bucket_numel=2**20, progress=False)
        )
    _assert_same(model, before, flat)
    assert set(flat.report.groups[0].bucket_tiers[3:]) == {"offload"}


def test_real_out_of_memory_loses_no_parameter():
    """Fill the card until less than one bucket is free, then flatten with tier=device."""
    model = _model("cuda", layers=4, width=2048)
    before = _snapshot(model)
    bucket_numel = 64 * 2**20  # 128 MiB bf16; the model is 32 MiB, one bucket
    hog = []
    try:
        free, _ = torch.cuda.mem_get_info()
        chunk = 256 * MiB
        while free > bucket_numel * 2:
            hog.append(torch.empty(min(chunk, free - 32 * MiB), dtype=torch.uint8, device="cuda"))
            free, _ = torch.cuda.mem_get_info()
            if free < chunk // 4:
                break
        config = FlattenConfig(tier="device", bucket_numel=bucket_numel, progress=False)
        flat = flatten_parameters(model, config=config)
        assert flat.report.events, "the fallback must be reported"
    except MemoryError:
        pass  # no tier fit; what matters is below
    finally:
        del hog
        torch.cuda.empty_cache()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().cpu(), before[name]), name


def test_auto_picks_device_for_params_on_the_gpu():
    model = _model("cuda")
    flat = flatten_parameters(model, config=FlattenConfig(progress=False))
    assert flat.report.tiers == ("device",)
