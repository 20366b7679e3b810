"""The tier registry: every registered tier is consistent, falls back, and agrees across
ranks; a new tier is one registry entry."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import flatzero
from flatzero import FlattenConfig, flatten_parameters, inject_oom
from flatzero.flatten.registry import REGISTRY, TIERS, chain, spec, tiers_reading
from flatzero.flatten.tiers import DirectTier
from flatzero.launch import run_ranks

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


class Net(nn.Module):
    """Six buckets of 64 elements at world sizes 1-3 (sizes divide by none of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(7, 7) for _ in range(5))
        self.to(torch.bfloat16)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("device", [CPU, CUDA], ids=["host", "cuda"])
def test_every_chain_goes_strictly_down_and_ends(name, device):
    names = chain(name, device)
    assert len(set(names)) == len(names)
    assert all(n in REGISTRY for n in names)
    levels = [spec(n).level for n in names]
    assert levels == sorted(levels) and len(set(levels)) == len(levels)
    if device.type == "cuda" and not spec(name).buffers_on_host:
        # buffers that start on a GPU never fall back to host memory
        assert not any(spec(n).buffers_on_host for n in names)


def test_public_tier_names_come_from_the_registry():
    assert flatzero.TIERS == TIERS == ("auto", *REGISTRY)
    for source in ("params", "checkpoint", "nothing"):
        assert tiers_reading(source)[0] == "auto"
        assert set(tiers_reading(source)[1:]) == {
            n for n, s in REGISTRY.items() if source in s.sources
        }


def _fallback_worker(rank: int, world_size: int) -> dict[str, object]:
    """For every registered tier: rank 1 runs out of memory at bucket 1 in that tier."""
    out: dict[str, object] = {}
    for name in REGISTRY:
        torch.manual_seed(7)
        model = Net()
        before = _snapshot(model)
        config = FlattenConfig(tier=name, device="cpu", bucket_numel=64, progress=False)
        fault = inject_oom(at_bucket=1, tier=name, times=100 if rank == 1 else 0)
        try:
            with fault:
                flat = flatten_parameters(model, config=config)
        except MemoryError as error:
            out[name] = ("MemoryError", str(error))
        else:
            out[name] = ("ok", flat.report.groups[0].bucket_tiers)
        for n, p in model.named_parameters():  # bitwise the same values, either way
            assert torch.equal(p, before[n]), (name, n)
    return out


def test_every_registered_tier_falls_back_and_all_ranks_agree():
    results = run_ranks(_fallback_worker, 2, timeout_s=120)
    for name in REGISTRY:
        outcomes = [r[name] for r in results]
        lower = spec(name).fallback(CPU)
        if lower is None:  # the last tier: an error on every rank, nothing lost
            assert [kind for kind, _ in outcomes] == ["MemoryError"] * 2, name
            assert "on rank 1" in outcomes[1][1] and "on another rank" in outcomes[0][1]
            continue
        assert outcomes[0] == outcomes[1], name  # the same tier for every bucket
        kind, bucket_tiers = outcomes[0]
        assert kind == "ok" and bucket_tiers[0] == name, name
        assert set(bucket_tiers[1:]) == {lower}, name


def test_a_new_tier_is_one_registry_entry(monkeypatch):
    built = []

    def build(ctx):
        built.append(ctx)
        return DirectTier("copy", ctx, on_host=True)

    entry = dataclasses.replace(spec("cpu"), name="copy", build=build)
    monkeypatch.setitem(REGISTRY, "copy", entry)
    torch.manual_seed(7)
    model = Net()
    before = _snapshot(model)
    flat = flatten_parameters(model, config=FlattenConfig(tier="copy", bucket_numel=64))
    assert built and set(flat.report.groups[0].bucket_tiers) == {"copy"}
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    with inject_oom(at_bucket=2, tier="copy"), pytest.raises(MemoryError, match="still holds"):
        flatten_parameters(Net(), config=FlattenConfig(tier="copy", bucket_numel=64))


def test_the_old_tier_name_offload_still_works_with_one_warning(monkeypatch):
    """``offload``, the ``host_park`` tier's old name (too easily taken for optimizer
    offload), is accepted wherever a tier is named, with one ``FutureWarning`` per
    process; the tier itself and its reports carry the new name."""
    from flatzero.flatten import registry
    from flatzero.plan.model_source import resolve_model
    from flatzero.plan.planner import PlanSpec

    monkeypatch.setattr(registry, "_warned_aliases", set())
    assert "offload" not in REGISTRY and registry.TIER_ALIASES == {"offload": "host_park"}
    with pytest.warns(FutureWarning, match="'offload' is now called 'host_park'"):
        assert FlattenConfig(tier="offload").tier == "host_park"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert FlattenConfig(tier="offload").tier == "host_park"  # once only
        assert PlanSpec(model=resolve_model("llama-3-8b"), tier="offload").tier == "host_park"
        assert FlattenConfig(tier="host_park").tier == "host_park"
