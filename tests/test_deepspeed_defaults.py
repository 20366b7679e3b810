"""Every default DeepSpeed 0.19.8 applies to a key the door accepts is the door's default.

DeepSpeed's own config object (``DeepSpeedConfig``, built in a one-rank gloo process from
minimal configs) and the signatures of the classes it builds (``FusedAdam``,
``DeepSpeedCPUAdam``, torch's AdamW/Adam/SGD, its warmup schedules) are read, never copied,
and set beside the value ``parse_config`` ends up using for the same config. A difference is
an error unless ``ON_PURPOSE`` lists it with its reason, and docs/deepspeed-door.md names
every key listed there. Then the one such default a run feels at once, clipping, is
trained through both: no ``gradient_clipping`` key, a gradient norm above 1, SGD.
"""

from __future__ import annotations

import inspect
import math
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from flatzero.config import DEFAULT_BUCKET_NUMEL
from flatzero.deepspeed.engine.config import parse_config
from flatzero.deepspeed.engine.schedulers import SCHEDULERS
from flatzero.launch import run_ranks

BASE = {"train_batch_size": 8}
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32 stage 2": {**BASE, "zero_optimization": {"stage": 2}},
    "bf16 stage 1": {**BASE, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}},
    "fp16 stage 2": {**BASE, "zero_optimization": {"stage": 2}, "fp16": {"enabled": True}},
    "micro batch only": {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}},
}
"""Minimal configs: every setting below is DeepSpeed's default for them."""

OPTIMIZERS: dict[str, dict[str, Any]] = {
    "Adam": {"type": "Adam", "params": {}},
    "AdamW": {"type": "AdamW", "params": {}},
    "AdamW torch_adam": {"type": "AdamW", "params": {"torch_adam": True}},
    "Adam adam_w_mode false": {"type": "Adam", "params": {"adam_w_mode": False}},
    "SGD": {"type": "SGD", "params": {"lr": 0.1}},
}
OPTIMIZER_ARGS = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening")

ON_PURPOSE: dict[str, str] = {
    "reduce_bucket_size": "flatzero's buckets default to DEFAULT_BUCKET_NUMEL elements, "
    "not 5e8: a bucket is also the unit of the flatten and of the overlap",
    "allgather_bucket_size": "one bucket size serves both collectives",
    "communication_data_type fp16": "fp16 gradients are summed in fp32 (DeepSpeed: fp16 after "
    "pre-dividing by the world size); flatzero divides once after the sum",
    "zero_allow_untested_optimizer": "any elementwise torch.optim optimizer is allowed",
}
"""Where the door differs from DeepSpeed's default on purpose, and why."""

KNOWN: dict[str, str] = {}
"""Differences that are bugs with an open issue, named here until they are fixed."""


def _door(config: dict[str, Any]) -> dict[str, Any]:
    """The values the door ends up using for ``config`` at one rank."""
    cfg = parse_config(config, world_size=1)
    zc, batch = cfg.zero_optimizer, cfg.batch
    out = {
        "train_batch_size": batch.train_batch_size,
        "train_micro_batch_size_per_gpu": batch.micro_batch_per_gpu,
        "gradient_accumulation_steps": batch.gradient_accumulation_steps,
        "gradient_clipping": zc.max_grad_norm or 0.0,
        "steps_per_print": cfg.steps_per_print,
        "dataloader_drop_last": cfg.dataloader_drop_last,
        "reduce_bucket_size": cfg.flatten.bucket_numel,
        "allgather_bucket_size": cfg.flatten.bucket_numel,
        "communication_data_type": zc.reduce_dtype,
        "grad_accum_dtype": zc.grad_accum_dtype,
        # no settings of their own: gradients are summed over the ranks, then divided once,
        # which is what these defaults of DeepSpeed's ask for; no list of tested optimizers
        "prescale_gradients": False,
        "gradient_predivide_factor": 1.0,
        "zero_allow_untested_optimizer": True,
    }
    scale = zc.loss_scale
    if cfg.precision.dtype == "fp16":
        out |= {
            "loss_scale": 0.0 if scale.dynamic else scale.init_scale,
            "initial_scale_power": int(math.log2(scale.init_scale)),
            "loss_scale_window": scale.growth_interval,
            "hysteresis": scale.hysteresis,
            "consecutive_hysteresis": scale.consecutive_hysteresis,
            "min_loss_scale": scale.min_scale,
        }
    return out


def _door_optimizer(section: dict[str, Any]) -> dict[str, Any]:
    spec = parse_config({**BASE, "optimizer": section}, world_size=1).optimizer
    defaults = {
        name: p.default
        for name, p in inspect.signature(spec.torch_class).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    merged = {**defaults, **spec.kwargs()}
    return {k: _plain(merged[k]) for k in OPTIMIZER_ARGS if k in merged} | {
        "adam_w": spec.torch_name == "AdamW"
    }


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _deepspeed_side(rank: int, world_size: int) -> dict[str, Any]:
    """(One rank, under gloo.) DeepSpeed's values for ``CONFIGS`` and the optimizers and
    schedules it would build."""
    from flatzero.testing.deepspeed import prepare_deepspeed

    prepare_deepspeed()
    import deepspeed.runtime.lr_schedules as ds_schedules
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.config import DeepSpeedConfig

    configs = {}
    for name, config in CONFIGS.items():
        c = DeepSpeedConfig(dict(config))
        z, fp16 = c.zero_config, c.float16_config
        values = {
            "train_batch_size": c.train_batch_size,
            "train_micro_batch_size_per_gpu": c.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": c.gradient_accumulation_steps,
            "gradient_clipping": c.gradient_clipping,
            "steps_per_print": c.steps_per_print,
            "dataloader_drop_last": c.dataloader_drop_last,
            "reduce_bucket_size": int(z.reduce_bucket_size),
            "allgather_bucket_size": int(z.allgather_bucket_size),
            # None: the engine communicates in the training dtype
            "communication_data_type": c.communication_data_type
            or {"fp16": torch.float16, "bf16": torch.bfloat16}.get(name[:4], torch.float32),
            "grad_accum_dtype": c.grad_accum_dtype,
            "prescale_gradients": c.prescale_gradients,
            "gradient_predivide_factor": c.gradient_predivide_factor,
            "zero_allow_untested_optimizer": c.zero_allow_untested_optimizer,
        }
        if fp16.enabled:
            values |= {
                "loss_scale": fp16.loss_scale,
                "initial_scale_power": fp16.initial_scale_power,
                "loss_scale_window": fp16.loss_scale_window,
                "hysteresis": fp16.hysteresis,
                "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_loss_scale": fp16.min_loss_scale,
            }
        configs[name] = values

    def defaults(cls: type) -> dict[str, Any]:
        found = {
            name: _plain(p.default)
            for name, p in inspect.signature(cls).parameters.items()
            if p.default is not inspect.Parameter.empty
        }
        return {k: found[k] for k in OPTIMIZER_ARGS if k in found}

    optimizers = {  # the class DeepSpeed's engine builds (get_optimizer_configuration)
        "Adam": defaults(FusedAdam) | {"adam_w": True},
        "AdamW": defaults(FusedAdam) | {"adam_w": True},
        "AdamW torch_adam": defaults(torch.optim.AdamW) | {"adam_w": True},
        "Adam adam_w_mode false": defaults(FusedAdam) | {"adam_w": False},
        "SGD": defaults(torch.optim.SGD) | {"lr": 0.1, "adam_w": False},
        "offload Adam": defaults(DeepSpeedCPUAdam) | {"adam_w": True},
    }
    schedules = {name: _schedule_defaults(getattr(ds_schedules, name)) for name in SCHEDULERS}
    return {"configs": configs, "optimizers": optimizers, "schedules": schedules}


def _schedule_defaults(cls: type) -> dict[str, Any]:
    renamed = {"last_batch_iteration": "last_epoch"}  # flatzero's are torch LRSchedulers
    return {
        renamed.get(name, name): p.default
        for name, p in inspect.signature(cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def _deepspeed_runs(rank: int, world_size: int) -> dict[str, Any]:
    """DeepSpeed's defaults (``_deepspeed_side``), then the clipping run (``_clip_rank``),
    in one rank process (a launch pays DeepSpeed's import and warm-up again); by name, the
    outcome or the traceback it raised."""
    out = {}
    for name, run in (("defaults", _deepspeed_side), ("clip", _clip_rank)):
        try:
            out[name] = ("ok", run(rank, world_size))
        except Exception:  # reported by the tests that use it
            out[name] = ("raised", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def deepspeed_runs() -> dict[str, Any]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    return run_ranks(_deepspeed_runs, 1, env={"DS_ACCELERATOR": "cpu"}, timeout_s=240)[0]


def _outcome(runs: dict[str, Any], name: str) -> Any:
    status, value = runs[name]
    assert status == "ok", f"{name!r} raised in the rank:\n{value}"
    return value


@pytest.fixture(scope="module")
def deepspeed_side(deepspeed_runs) -> dict[str, Any]:
    return _outcome(deepspeed_runs, "defaults")


def _differences(ours: dict[str, Any], theirs: dict[str, Any], case: str) -> list[str]:
    return [
        f"{case}: {key}: flatzero {ours[key]!r}, DeepSpeed {theirs[key]!r}"
        for key in theirs
        if ours[key] != theirs[key]
        and key not in ON_PURPOSE
        and f"{key} {case[:4]}" not in ON_PURPOSE
        and f"{case}: {key}" not in KNOWN
    ]


def test_every_config_default_is_deepspeeds(deepspeed_side):
    found = []
    for case, config in CONFIGS.items():
        found += _differences(_door(config), deepspeed_side["configs"][case], case)
    assert found == []


def test_the_differences_listed_are_real_and_documented(deepspeed_side):
    ours, theirs = _door(CONFIGS["fp16 stage 2"]), deepspeed_side["configs"]["fp16 stage 2"]
    assert ours["reduce_bucket_size"] == DEFAULT_BUCKET_NUMEL != theirs["reduce_bucket_size"]
    assert ours["communication_data_type"] == torch.float32
    assert theirs["communication_data_type"] == torch.float16
    assert ours["zero_allow_untested_optimizer"] != theirs["zero_allow_untested_optimizer"]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "deepspeed-door.md").read_text()
    for key in ON_PURPOSE:
        assert f"`{key.split()[0]}`" in doc, f"docs/deepspeed-door.md does not name {key}"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_defaults_are_the_class_deepspeed_builds(deepspeed_side, name):
    assert _door_optimizer(OPTIMIZERS[name]) == deepspeed_side["optimizers"][name]


def test_offloaded_adam_defaults_are_deepspeed_cpu_adams(deepspeed_side):
    config = {
        **BASE,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "optimizer": {"type": "AdamW", "params": {}},
    }
    spec = parse_config(config, world_size=1).optimizer
    theirs = deepspeed_side["optimizers"]["offload Adam"]
    assert spec.kwargs().get("weight_decay") == theirs["weight_decay"] == 0


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_schedule_defaults_are_deepspeeds(deepspeed_side, name):
    ours = _schedule_defaults(SCHEDULERS[name])
    assert ours == deepspeed_side["schedules"][name]


# ------------------------------------------------------------------ clipping, trained
STEPS = 3


def _train(engine: Any) -> tuple[list[float], list[float]]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 8, generator=g), 4 * torch.randn(4, 2, generator=g)
    losses, norms = [], []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def _clip_rank(rank: int, world_size: int) -> dict[str, Any]:
    from flatzero.testing.deepspeed import prepare_deepspeed, release_engine

    prepare_deepspeed()
    import deepspeed

    import flatzero

    config = {  # no gradient_clipping key: DeepSpeed clips at 1.0
        "train_batch_size": 4,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,  # DeepSpeed refuses SGD under ZeRO otherwise
    }
    out = {}
    for name, initialize in (
        ("deepspeed", deepspeed.initialize),
        ("flatzero", flatzero.initialize),
    ):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        engine, *_ = initialize(model=model, config=dict(config))
        out[name] = _train(engine)
        if name == "deepspeed":
            release_engine(engine)
        else:
            engine.destroy()
    return out


@pytest.mark.slow
def test_no_clipping_key_clips_at_one_as_deepspeed(deepspeed_runs):
    out = _outcome(deepspeed_runs, "clip")
    (ds_losses, ds_norms), (fz_losses, fz_norms) = out["deepspeed"], out["flatzero"]
    assert min(ds_norms) > 1.5  # the gradient is clipped at every step
    assert fz_losses == pytest.approx(ds_losses, rel=1e-5, abs=1e-6)
    assert fz_norms == pytest.approx(ds_norms, rel=1e-5)  # the norm before clipping
