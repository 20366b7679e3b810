"""flatzero's WarmupLR / WarmupDecayLR / WarmupCosineLR against DeepSpeed 0.19.8's classes:
the same learning rate at every step (when DeepSpeed is importable), and their errors."""

# ruff: noqa: E501  (whole error messages)

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from flatzero.deepspeed.engine.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR

CASES = [
    (WarmupLR, {"warmup_min_lr": 0.001, "warmup_max_lr": 0.05, "warmup_num_steps": 7}),
    (WarmupLR, {"warmup_min_lr": [0.0, 0.01], "warmup_num_steps": 5, "warmup_type": "linear"}),
    (WarmupLR, {"warmup_num_steps": 1}),  # DeepSpeed uses at least 2 warmup steps
    (
        WarmupDecayLR,
        {
            "total_num_steps": 20,
            "warmup_max_lr": 0.05,
            "warmup_num_steps": 6,
            "warmup_type": "linear",
        },
    ),
    (WarmupDecayLR, {"total_num_steps": 20}),  # warmup longer than the schedule
    (
        WarmupCosineLR,
        {
            "total_num_steps": 25,
            "warmup_min_ratio": 0.1,
            "warmup_num_steps": 5,
            "cos_min_ratio": 0.05,
        },
    ),
    (WarmupCosineLR, {"total_num_steps": 3, "warmup_num_steps": 5, "warmup_type": "linear"}),
]


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [
            {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.1},
            {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.02},
        ]
    )


def _lrs(cls, kwargs, steps=40):
    opt = _optimizer()
    sched = cls(opt, **kwargs)
    out = []
    for _ in range(steps):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out, sched


@pytest.mark.parametrize(("cls", "kwargs"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_same_lr_as_deepspeed(cls, kwargs, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    ours, sched = _lrs(cls, kwargs)
    opt = _optimizer()
    theirs_sched = getattr(lr_schedules, cls.__name__)(opt, **kwargs)
    theirs = []
    for _ in range(40):
        theirs.append([g["lr"] for g in opt.param_groups])
        assert sched.last_batch_iteration >= -1
        opt.step()
        theirs_sched.step()
    assert ours == theirs  # bitwise: the same formulas in the same order
    assert sched.last_batch_iteration == theirs_sched.last_batch_iteration


def test_schedule_shape_and_state_dict():
    lrs, sched = _lrs(
        WarmupDecayLR,
        {
            "total_num_steps": 10,
            "warmup_max_lr": 1.0,
            "warmup_num_steps": 4,
            "warmup_type": "linear",
        },
        steps=12,
    )
    first = [lr[0] for lr in lrs]
    assert first[:6] == [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]
    assert first[10:] == [pytest.approx(1 / 6), 0.0]  # (T - i) / (T - W), i = step - 1
    state = sched.state_dict()
    assert "optimizer" not in state and state["last_epoch"] == 12
    opt = _optimizer()
    resumed = WarmupDecayLR(
        opt, total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear"
    )
    resumed.load_state_dict(state)
    assert resumed.last_batch_iteration == sched.last_batch_iteration
    assert resumed.get_lr() == sched.get_lr()


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (
            WarmupLR,
            {"warmup_num_steps": 0},
            "WarmupLR warmup_num_steps must be a positive integer (steps), got 0",
        ),
        (
            WarmupLR,
            {"warmup_type": "cosine"},
            "WarmupLR warmup_type is 'cosine'; use one of 'log', 'linear'",
        ),
        (
            WarmupLR,
            {"warmup_max_lr": [0.1, 0.2, 0.3]},
            "WarmupLR warmup_max_lr has 3 values but the optimizer has 2 param groups; give one value, or one per param group",
        ),
        (
            WarmupDecayLR,
            {"total_num_steps": -5},
            "WarmupDecayLR total_num_steps must be a positive integer (steps), got -5",
        ),
        (
            WarmupCosineLR,
            {"total_num_steps": 10, "cos_min_ratio": "x"},
            "WarmupCosineLR cos_min_ratio must be a finite number, got 'x'",
        ),
    ],
)
def test_errors(cls, kwargs, message):
    with pytest.raises(ValueError) as info:
        cls(_optimizer(), **kwargs)
    assert str(info.value) == message
