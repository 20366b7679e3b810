"""What the tests of ``flatzero plan`` share: the step benchmark's tiny model under a
ZeroOptimizer that took one step (world size 1, in this process), the plan of the same
model and settings, and a calibration of round rates."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flatzero import FlattenConfig, ZeroOptimizer
from flatzero.models import build_model
from flatzero.models.bench_models import STEP_MODELS as MODELS
from flatzero.plan.calibration import Calibration
from flatzero.plan.model_source import ModelSource
from flatzero.plan.planner import Plan, PlanSpec, make_plan

BUCKET = 4096  # elements: several buckets

OPTIMIZERS = pytest.mark.parametrize(("optimizer", "torch_optimizer", "kwargs"), [
    ("adamw", torch.optim.AdamW, {}),
    ("sgd", torch.optim.SGD, {"momentum": 0.9}),
])  # fmt: skip
"""The optimizers each formula is checked with: plan's name, torch's class, its options."""


def stepped_tiny(
    torch_optimizer: type[torch.optim.Optimizer], kwargs: dict[str, Any], **zero: Any
) -> tuple[Any, torch.nn.Module, ZeroOptimizer]:
    """The tiny model's config, the model and its stage-2 ZeroOptimizer (``zero``: more of
    its arguments) after one step: the optimizer state exists from the first step on."""
    config = MODELS["tiny"]()
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=0)
    opt = ZeroOptimizer(
        model,
        torch_optimizer,
        stage=2,
        flatten_config=FlattenConfig(bucket_numel=BUCKET, progress=False),
        lr=1e-3,
        **zero,
        **kwargs,
    )
    ids = torch.randint(0, config.vocab_size, (1, 8))
    model(ids, labels=ids).loss.backward()
    opt.step()
    return config, model, opt


def tiny_plan(config: Any, optimizer: str, **spec: Any) -> Plan:
    """The plan of the tiny model on one rank without a GPU (``spec``: more of its
    settings)."""
    return make_plan(
        PlanSpec(
            model=ModelSource("tiny", config),
            gpus_per_node=1,
            gpu=None,
            optimizer=optimizer,
            bucket_numel=BUCKET,
            **spec,
        )
    )


def calibration(scale: float = 1.0, *, plain: bool = True) -> Calibration:
    """A calibration of round rates (GB/s) times ``scale``; ``plain``: with the plain
    (huge-page-free) first-touch and cast rates."""
    return Calibration(
        cores=4,
        memory_bytes=2**34,
        memcpy_gbps=10 * scale,
        thread_memcpy_gbps=5 * scale,
        first_touch_gbps=2 * scale,
        thread_first_touch_gbps=1 * scale,
        cast_gbps=1.5 * scale,
        thread_cast_gbps=1 * scale,
        plain_first_touch_gbps=4 * scale if plain else None,
        plain_cast_gbps=3 * scale if plain else None,
        tensor_seconds=dict.fromkeys(("flatzero", "torch_cat", "legacy_cpu"), 0.0),
    )
