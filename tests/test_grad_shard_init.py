"""The fp32 gradient shard is not zeroed at init: the first reduction of every window
writes it. Filled with NaN at allocation, training must still equal plain AdamW."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flatzero.optim.prepare as prepare
from flatzero import FlattenConfig, ZeroConfig, ZeroOptimizer
from flatzero.launch import run_ranks

STEPS, MICRO, CLIP = 3, 2, 0.05


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    return torch.randn(
        4, 7, generator=torch.Generator().manual_seed(100 * step + 10 * micro + rank)
    )


def _reference(world_size: int) -> dict[str, torch.Tensor]:
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for micro in range(MICRO):
            for rank in range(world_size):
                loss = model(_batch(step, micro, rank)).square().mean()
                (loss / (MICRO * world_size)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world_size: int, stage: int) -> None:
    def poisoned(numel, dtype, device):
        return torch.full((numel,), float("nan"), dtype=dtype, device=device)

    prepare.empty_buffer = poisoned  # what uninitialized memory may hold
    model = _net()
    opt = ZeroOptimizer(
        model.parameters(),
        stage=stage,
        config=ZeroConfig(max_grad_norm=CLIP),
        flatten_config=FlattenConfig(bucket_numel=64, progress=False),
        lr=1e-2,
    )
    for step in range(STEPS):
        for micro in range(MICRO):
            (model(_batch(step, micro, rank)).square().mean() / MICRO).backward()
        opt.step()
        opt.zero_grad()
    reference = _reference(world_size)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), reference[name], rtol=1e-5, atol=1e-6)
    for g in opt.flat.groups:  # padding is zero and stays zero
        for b, buf in enumerate(g.buckets):
            for lo, hi in g.layout.gaps(b):
                assert not buf[lo:hi].any()


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("world_size", [1, 2])
def test_first_steps_need_no_zeroed_gradient_shard(world_size, stage):
    run_ranks(_worker, world_size, stage, timeout_s=60)
