"""Where flatzero's DeepSpeed door once differed from DeepSpeed 0.19.8 without a word,
side by side with the real one (CPU, gloo; skipped without DeepSpeed).

- Floating buffers keep their dtype (a rotary ``inv_freq`` stays fp32 under bf16), as
  DeepSpeed's engine keeps them unless ``data_types.buffer_dtype`` is set: the first loss
  of a Llama-style model is bit for bit DeepSpeed's.
Every check runs in one rank process (``_every_check``, one launch for the module: each
launch costs DeepSpeed's import and warm-up again); each test asserts on its check's
outcome, and a check that raised fails its own test with the rank's traceback.
"""

from __future__ import annotations

import math
import os
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from flatzero.launch import run_ranks

pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _every_check(rank: int, world_size: int, root: str, fused_adam: bool) -> dict[str, Any]:
    """Every check of the module, one after another in this rank process (each leaves no
    engine behind: it destroys or releases what it made); by name, its outcome or the
    traceback it raised."""
    checks: dict[str, Callable[[], Any]] = {
        "buffers None": lambda: _buffers_rank(rank, world_size, None),
        "buffers bf16": lambda: _buffers_rank(rank, world_size, "bf16"),
        "scaler": lambda: _scaler_rank(rank, world_size),
        "scheduler": lambda: _scheduler_rank(rank, world_size, root),
        "engine methods": lambda: _engine_methods_rank(rank, world_size),
        "both optimizers": lambda: _both_optimizers_rank(rank, world_size),
    }
    if fused_adam:
        checks["fused adam"] = lambda: _fused_adam_rank(rank, world_size)
    out: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            out[name] = ("ok", check())
        except Exception:  # reported by the check's own test
            out[name] = ("raised", traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Any]:
    """Every check's outcome, from one launch of one rank."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from test_deepspeed_export import adam_kernels

    root = str(tmp_path_factory.mktemp("deepspeed_parity"))
    fused = adam_kernels() is None
    return run_ranks(_every_check, 1, root, fused, timeout_s=300, env={"DS_ACCELERATOR": "cpu"})[0]


def outcome(outcomes: dict[str, Any], name: str) -> Any:
    """What check ``name`` returned; fails with its traceback if it raised."""
    status, value = outcomes[name]
    assert status == "ok", f"check {name!r} raised in the rank:\n{value}"
    return value


def _buffers_rank(rank: int, world_size: int, buffer_dtype: str | None) -> dict[str, Any]:
    from flatzero.testing.deepspeed import prepare_deepspeed, release_engine

    prepare_deepspeed()
    import deepspeed

    import flatzero

    config: dict[str, Any] = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    if buffer_dtype is not None:
        config["data_types"] = {"buffer_dtype": buffer_dtype}
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, initialize in (
        ("deepspeed", deepspeed.initialize),
        ("flatzero", flatzero.initialize),
    ):
        engine, *_ = initialize(model=_llama(), config=dict(config))
        buffers = {n: str(b.dtype) for n, b in engine.module.named_buffers()}
        out[name] = (buffers, engine(ids, labels=ids).loss.item())
        if name == "deepspeed":
            release_engine(engine)
        else:
            engine.destroy()
    return out


@pytest.mark.parametrize("buffer_dtype", [None, "bf16"])
def test_buffers_keep_their_dtype_as_in_deepspeed(buffer_dtype, outcomes):
    out = outcome(outcomes, f"buffers {buffer_dtype}")
    (ds_buffers, ds_loss), (fz_buffers, fz_loss) = out["deepspeed"], out["flatzero"]
    assert ds_buffers and fz_buffers == ds_buffers
    expected = "torch.float32" if buffer_dtype is None else "torch.bfloat16"
    assert set(ds_buffers.values()) == {expected}  # inv_freq
    assert fz_loss == ds_loss  # bit for bit before any step


# ------------------------------------------------------------------ fp16 loss scaling
OVERFLOWS = [True] * 7 + [False] * 5 + [True, False, True, True, True] + [False] * 9 + [True]
"""A scripted run: 7 overflows at the start (an initial scale far too high), clean steps
across two growth windows of 4, scattered and consecutive overflows."""


def _scaler_rank(rank: int, world_size: int) -> dict[str, Any]:
    """Both scalers over ``OVERFLOWS``, for every setting of the keys that shape them."""
    from flatzero.testing.deepspeed import prepare_deepspeed

    prepare_deepspeed()
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from flatzero.deepspeed.engine.config import parse_config
    from flatzero.optim.scaler import LossScaler

    out = {}
    for hysteresis in (1, 2, 3):
        for consecutive in (False, True):
            fp16 = {
                "enabled": True, "initial_scale_power": 16, "loss_scale_window": 4,
                "hysteresis": hysteresis, "consecutive_hysteresis": consecutive,
                "min_loss_scale": 256,
            }  # fmt: skip
            cfg = parse_config({"train_batch_size": 1, "fp16": fp16}, world_size=1)
            ours = LossScaler(cfg.zero_optimizer.loss_scale)
            theirs = DynamicLossScaler(
                init_scale=2.0**16, scale_window=4, min_scale=256,
                delayed_shift=hysteresis, consecutive_hysteresis=consecutive,
                raise_error_at_min_scale=False, dtype=torch.float16,
            )  # fmt: skip
            trace = []
            for overflow in OVERFLOWS:
                ours.update(found_inf=overflow)
                theirs.update_scale(overflow)
                trace.append(((ours.scale, ours.hysteresis_left), (theirs.cur_scale,
                              theirs.cur_hysteresis)))  # fmt: skip
            out[f"hysteresis {hysteresis}, consecutive {consecutive}"] = trace
    return out


def test_fp16_loss_scale_moves_as_deepspeeds_step_for_step(outcomes):
    out = outcome(outcomes, "scaler")
    for case, trace in out.items():
        for step, (ours, theirs) in enumerate(trace):
            assert ours == theirs, (case, step, OVERFLOWS[: step + 1], trace[: step + 1])
    # the defaults (hysteresis 2, not consecutive): the 7 first overflows halve 6 times
    assert out["hysteresis 2, consecutive False"][6][1][0] == 2.0**10


# ------------------------------------------------------------ arriving with its scheduler
SCHEDULES = {
    "WarmupLR": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2},
    "WarmupDecayLR": {"total_num_steps": 8, "warmup_num_steps": 3, "warmup_max_lr": 1e-2},
    "WarmupCosineLR": {"total_num_steps": 8, "warmup_num_steps": 3},
}
SAVED_AT, RESUMED = 3, 4


def _scheduled_config(schedule: str) -> dict[str, Any]:
    return {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": schedule, "params": SCHEDULES[schedule]},
    }


def _steps(engine: Any, first: int, count: int) -> list[tuple[float, float]]:
    """(learning rate, loss) of ``count`` steps from step ``first``."""
    out = []
    for step in range(first, first + count):
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step))
        lr = engine.get_lr()[0]
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        out.append((lr, loss.item()))
    return out


def _scheduler_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from flatzero.testing.deepspeed import prepare_deepspeed, release_engine

    prepare_deepspeed()
    import deepspeed

    import flatzero
    from flatzero.deepspeed.convert import from_deepspeed

    out = {}
    for schedule in SCHEDULES:
        config = _scheduled_config(schedule)
        engine, *_ = deepspeed.initialize(model=_llama(), config=dict(config))
        _steps(engine, 0, SAVED_AT)
        engine.save_checkpoint(f"{root}/{schedule}/ds")
        theirs = _steps(engine, SAVED_AT, RESUMED)  # DeepSpeed going on
        release_engine(engine)
        from_deepspeed(f"{root}/{schedule}/ds", f"{root}/{schedule}/fz")
        engine, *_ = flatzero.initialize(model=_llama(), config=dict(config))
        engine.load_checkpoint(f"{root}/{schedule}/fz")
        ours = _steps(engine, SAVED_AT, RESUMED)
        engine.destroy()
        out[schedule] = (theirs, ours)
    return out


def test_a_deepspeed_checkpoint_with_its_scheduler_resumes_on_flatzero(outcomes):
    out = outcome(outcomes, "scheduler")
    for schedule, (theirs, ours) in out.items():
        assert [lr for lr, _ in ours] == [lr for lr, _ in theirs], schedule  # exactly
        assert [loss for _, loss in ours] == pytest.approx(
            [loss for _, loss in theirs], rel=1e-5
        ), schedule


# ------------------------------------------------------------------ engine methods
def _engine_methods_rank(rank: int, world_size: int) -> dict[str, Any]:
    from flatzero.testing.deepspeed import prepare_deepspeed

    prepare_deepspeed()
    import deepspeed

    import flatzero

    config = _scheduled_config("WarmupLR")
    model = _llama()
    engine, *_ = flatzero.initialize(model=model, config=dict(config))
    out = {"is DeepSpeedEngine": isinstance(engine, deepspeed.DeepSpeedEngine)}
    out["empty_partition_cache"] = engine.empty_partition_cache()  # a no-op at stage 1/2
    # A second engine over the live one's model (DeepSpeed's checkpoint tests load into "a
    # fresh ds engine" so): built, the first one destroyed, the second one trains.
    second, *_ = flatzero.initialize(model=model, config=dict(config))
    out["first destroyed"] = engine._destroyed
    before = [p.detach().clone() for p in model.parameters()]
    out["second trains"] = _steps(second, 0, 3)[-1][1]  # WarmupLR: lr 0 at its first two
    after = list(model.parameters())
    out["changed"] = any(not torch.equal(a, p) for a, p in zip(before, after, strict=True))
    second.destroy()
    return out


def test_engine_methods_deepspeed_makes_no_ops_at_stage_1_and_2_are_no_ops(outcomes):
    out = outcome(outcomes, "engine methods")
    assert out["is DeepSpeedEngine"] and out["empty_partition_cache"] is None
    assert out["first destroyed"]  # as DeepSpeed, a second engine over a live one's model
    assert out["changed"] and math.isfinite(out["second trains"])


def _both_optimizers_rank(rank: int, world_size: int) -> dict[str, Any]:
    """A client optimizer and a config ``optimizer`` section: both doors use the client's."""
    import logging

    from flatzero.testing.deepspeed import prepare_deepspeed, release_engine

    prepare_deepspeed()
    import deepspeed

    import flatzero

    config = {**_scheduled_config("WarmupLR"), "zero_allow_untested_optimizer": True}
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("flatzero").addHandler(handler)
    out = {}
    for name, initialize in (
        ("deepspeed", deepspeed.initialize),
        ("flatzero", flatzero.initialize),
    ):
        model = _llama()
        client = torch.optim.SGD(model.parameters(), lr=0.05)
        engine, optimizer, *_ = initialize(model=model, optimizer=client, config=dict(config))
        inner = engine.basic_optimizer if name == "deepspeed" else optimizer.inner
        out[name] = (type(inner).__name__, inner.param_groups[0]["lr"])
        if name == "deepspeed":
            release_engine(engine)
        else:
            engine.destroy()
    out["warned"] = any("the passed optimizer is used" in m for m in seen)
    return out


def test_a_client_optimizer_beside_a_config_optimizer_is_used_as_in_deepspeed(outcomes):
    out = outcome(outcomes, "both optimizers")
    assert out["flatzero"][0] == out["deepspeed"][0] == "SGD"
    assert out["flatzero"][1] == out["deepspeed"][1]  # WarmupLR's first lr on both
    assert out["warned"]


# ------------------------------------------------------------------ FusedAdam as the client's
def _fused_adam_rank(rank: int, world_size: int) -> dict[str, Any]:
    """DeepSpeed's ``FusedAdam`` passed as the client optimizer, in both of its modes: the
    same weights after three steps on both engines (flatzero runs torch's Adam/AdamW)."""
    from flatzero.testing.deepspeed import prepare_deepspeed, release_engine

    prepare_deepspeed()
    import deepspeed
    from deepspeed.ops.adam import FusedAdam

    import flatzero

    config = {"train_batch_size": 2, "zero_optimization": {"stage": 2}, "gradient_clipping": 0.0}
    out: dict[str, Any] = {}
    for adam_w_mode in (True, False):
        for name, initialize in (
            ("deepspeed", deepspeed.initialize),
            ("flatzero", flatzero.initialize),
        ):
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)
            )
            client = FusedAdam(model.parameters(), lr=0.05, betas=(0.8, 0.99), eps=1e-6,
                               weight_decay=0.1, adam_w_mode=adam_w_mode)  # fmt: skip
            engine, *_ = initialize(model=model, optimizer=client, config=dict(config))
            for step in range(3):
                x = torch.randn(2, 8, generator=torch.Generator().manual_seed(step))
                engine.backward(engine(x).pow(2).mean())
                engine.step()
            weights = [p.detach().tolist() for p in engine.module.parameters()]
            out[f"{name} {adam_w_mode}"] = (type(engine).__name__, weights)
            if name == "deepspeed":
                release_engine(engine)
            else:
                engine.destroy()
    return out


def test_deepspeeds_fused_adam_as_client_optimizer_runs_on_flatzero(outcomes):
    from test_deepspeed_export import adam_kernels

    why = adam_kernels()
    if why is not None:
        pytest.skip(f"DeepSpeed's FusedAdam op cannot be built here: {why}")
    out = outcome(outcomes, "fused adam")
    for mode in (True, False):
        (ds_engine, ds_weights), (fz_engine, fz_weights) = (
            out[f"deepspeed {mode}"],
            out[f"flatzero {mode}"],
        )
        assert fz_engine == "DeepSpeedCompatibleEngine"  # not routed to DeepSpeed
        assert ds_engine == "DeepSpeedEngine"
        for a, b in zip(fz_weights, ds_weights, strict=True):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)
    assert out["flatzero True"][1][0] != out["flatzero False"][1][0]  # the two modes differ
