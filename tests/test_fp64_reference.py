"""ZeRO-2 at 2 ranks against an fp64 single-process reference (issue 42 part 2).

DeepSpeed itself shipped silent ZeRO-2 regressions, so parity with it proves little on its
own; here the reference is exact arithmetic's stand-in: the same model in float64 in one
process, plain ``torch.optim.SGD`` over the two ranks' batches together.

[Note: the tolerance] Both runs start from the same fp32 values. Each fp32 gradient element
is a sum of at most ``TERMS`` products (the batch rows times the widest layer), so it differs
from the fp64 one by at most ``TERMS * u`` of the magnitudes summed (``u = 2**-24``,
fp32's unit roundoff); the reduction over 2 ranks and the update add a few ``u`` more. SGD
moves a param by ``lr * grad`` per step, so after the steps the fp32 params lie within
``(TERMS + 4) * u * sum over steps of lr * max|grad|`` of the fp64 ones, plus one rounding of
the param itself. A wrong reduction (a rank's gradient missing, counted twice, not averaged)
moves them by about ``lr * |grad|`` per step: millions of times the tolerance.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.optim import ZeroConfig, ZeroOptimizer

STEPS, LR, BATCH, WIDTH = 6, 0.1, 4, 32
TERMS = BATCH * 2 * WIDTH
U32 = 2.0**-24


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 4))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(BATCH, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def _reference(world: int) -> tuple[dict[str, torch.Tensor], float]:
    """fp64 params after the steps, and the tolerance of the note."""
    model = _model().double()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    moved = 0.0
    for step in range(STEPS):
        x = torch.cat([_batch(step, r) for r in range(world)]).double()
        _loss(model, x).backward()
        moved += LR * max(float(p.grad.abs().max()) for p in model.parameters())
        opt.step()
        opt.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, (TERMS + 4) * U32 * moved + U32 * 2


def _zero2(rank: int, world: int) -> float:
    model = _model()
    init = copy.deepcopy(model)
    opt = ZeroOptimizer(
        model,
        torch.optim.SGD,
        lr=LR,
        config=ZeroConfig(stage=2, check_gradients=True, reduce_staging_bytes=4096),
        flatten_config=FlattenConfig(device="cpu", progress=False, bucket_numel=128),
    )
    for step in range(STEPS):
        _loss(model, _batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()
    want, tol = _reference(world)
    worst = max(float((p.double() - want[n]).abs().max()) for n, p in model.named_parameters())
    moved = max(float((want[n] - p.double()).abs().max()) for n, p in init.named_parameters())
    assert moved > 1000 * tol, (moved, tol)  # the steps moved the params, far past tol
    assert worst <= tol, (worst, tol)
    return worst / tol


def test_zero2_matches_an_fp64_reference_within_the_fp32_floor() -> None:
    ratios = run_ranks(_zero2, 2)
    assert all(r <= 1 for r in ratios)
