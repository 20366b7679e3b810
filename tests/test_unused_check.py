"""``zero_optimization.ignore_unused_parameters: false`` with optimizer offload: the step
asserts that every trainable param got a gradient, as DeepSpeed 0.19.8's offloaded ZeRO-1/2
does (its own unit test ``TestStage2IgnoreUnusedParameters`` expects the AssertionError)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import flatzero
from flatzero.deepspeed.engine.config import parse_config


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x).sum()


def _config(ignore: bool, offload: bool = True) -> dict:
    zero = {"stage": 2, "ignore_unused_parameters": ignore}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }


def _train(config: dict) -> None:
    torch.manual_seed(0)
    engine, *_ = flatzero.initialize(model=WithUnused(), config=config)
    try:
        for _ in range(4):
            engine.backward(engine(torch.randn(2, 4)))
            engine.step()
    finally:
        engine.destroy()


def test_a_param_without_gradient_is_an_assertion_only_when_asked_for():
    _train(_config(ignore=True))  # DeepSpeed's default: zero gradients, trains on
    with pytest.raises(
        AssertionError, match=r"unused\.bias, unused\.weight.*ignore_unused_parameters"
    ):
        _train(_config(ignore=False))


def test_without_offload_the_key_is_listed_as_without_effect_as_deepspeed_checks_nothing():
    cfg = parse_config(_config(ignore=False, offload=False), world_size=1)
    assert not cfg.zero.check_unused
    assert any("ignore_unused_parameters" in key for key, _ in cfg.ignored)
    assert parse_config(_config(ignore=False), world_size=1).zero.check_unused
