"""Plain ``loss.backward()`` instead of ``engine.backward(loss)`` (issue 39; DeepSpeed's
tests/unit/v1/zero/test_zero_user_backward.py), side by side with DeepSpeed 0.19.8 (CPU,
gloo; skipped without DeepSpeed): the same losses and weights as DeepSpeed's plain backward
and as flatzero's ``engine.backward``, gradients divided by ``gradient_accumulation_steps``;
with fp16 loss scaling an unscaled backward is refused naming ``engine.backward`` and
``engine.scale(loss).backward()`` trains as ``engine.backward`` does.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from flatzero.launch import run_ranks

GAS = 2
STEPS = 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _config(stage: int, fp16: bool = False) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def _train(engine: Any, rank: int, how: str) -> tuple[list[float], list[list[float]]]:
    g = torch.Generator().manual_seed(rank + 1)
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for _ in range(STEPS * GAS):
        x = torch.randn(4, 8, generator=g).to(dtype)
        loss = engine(x).float().pow(2).mean()
        if how == "engine":
            engine.backward(loss)
        elif how == "scale":
            engine.scale(loss).backward()
        else:
            loss.backward()
        engine.step()
        losses.append(loss.item())
    return losses, [p.detach().float().flatten().tolist() for p in engine.module.parameters()]


def _parity_rank(rank: int, world_size: int, stage: int) -> dict[str, Any]:
    from flatzero.testing.deepspeed import prepare_deepspeed, release_engine

    prepare_deepspeed()
    import deepspeed

    import flatzero

    out: dict[str, Any] = {}
    for name, initialize, how in (
        ("deepspeed", deepspeed.initialize, "plain"),
        ("flatzero", flatzero.initialize, "plain"),
        ("flatzero engine.backward", flatzero.initialize, "engine"),
    ):
        engine, *_ = initialize(model=_model(), config=_config(stage))
        out[name] = _train(engine, rank, how)
        release_engine(engine) if name == "deepspeed" else engine.destroy()
    return out


def _parity_ranks(rank: int, world_size: int, stages: list[int]) -> dict[int, Any]:
    """``_parity_rank`` at each of ``stages``, one after another in this rank process."""
    return {stage: _parity_rank(rank, world_size, stage) for stage in stages}


@pytest.fixture(scope="module")
def parity() -> list[dict[int, Any]]:
    """Each rank's runs at stages 1 and 2, from one launch (a launch pays DeepSpeed's import
    and warm-up again)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    return run_ranks(_parity_ranks, 2, [1, 2], env={"DS_ACCELERATOR": "cpu"})


@pytest.mark.parametrize("stage", [1, 2])
def test_plain_backward_trains_as_deepspeeds(stage, parity):
    for out in (per_rank[stage] for per_rank in parity):
        ds_losses, ds_params = out["deepspeed"]
        fz_losses, fz_params = out["flatzero"]
        eb_losses, eb_params = out["flatzero engine.backward"]
        # gas 2: dividing the loss or the gradient by it is exact, so bit for bit
        assert (fz_losses, fz_params) == (eb_losses, eb_params)
        # DeepSpeed's fp32 step (its own reduction and AdamW over flat groups): rounding
        assert fz_losses == pytest.approx(ds_losses, rel=1e-6)
        for a, b in zip(fz_params, ds_params, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


def _fp16_rank(rank: int, world_size: int) -> dict[str, Any]:
    import flatzero

    out: dict[str, Any] = {}
    engine, *_ = flatzero.initialize(model=_model().half(), config=_config(2, fp16=True))
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine(torch.ones(4, 8, dtype=torch.half)).float().pow(2).mean()
    try:
        loss.backward()
    except RuntimeError as error:
        out["error"] = str(error)
    out["untouched"] = all(
        torch.equal(a, b) for a, b in zip(before, engine.module.parameters(), strict=True)
    )
    engine.destroy()
    for how in ("engine", "scale"):
        engine, *_ = flatzero.initialize(model=_model().half(), config=_config(2, fp16=True))
        out[how] = _train(engine, rank, how)
        engine.destroy()
    return out


def test_fp16_plain_backward_is_refused_and_scale_trains_as_engine_backward():
    for out in run_ranks(_fp16_rank, 2):
        assert "engine.backward(loss)" in out["error"]
        assert "engine.scale(loss).backward()" in out["error"]
        assert out["untouched"]
        assert out["scale"] == out["engine"]
