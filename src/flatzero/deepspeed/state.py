"""flatzero's scalar training state and DeepSpeed's, both ways: loss scaler, LR schedule.

Loss scaler. The DeepSpeed door's scaler follows DeepSpeed's ``DynamicLossScaler`` rule and
keeps its counts (``iteration`` and ``last_overflow_iteration`` are ``cur_iter`` and
``last_overflow_iter``), which are copied both ways. A flatzero state without them (written
before they were kept) maps through ``good_steps``: ``last_overflow_iter`` such that
``cur_iter - last_overflow_iter - 1`` at the next step is ``good_steps + 1``.

LR schedule. flatzero's ``WarmupLR``/``WarmupDecayLR``/``WarmupCosineLR`` are torch
schedulers counting ``last_epoch``; DeepSpeed's count ``last_batch_iteration`` (one less)
and load only that key. An export adds it; an import drops it again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .pickle import DynamicLossScaler, StaticLossScaler

__all__ = [
    "FP16_DEFAULTS",
    "deepspeed_loss_scaler",
    "deepspeed_scheduler",
    "flatzero_loss_scaler",
    "flatzero_scheduler",
]

FP16_DEFAULTS: Mapping[str, Any] = {
    "loss_scale": 0,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}
"""DeepSpeed 0.19's defaults of the ``fp16`` keys its loss scaler is built from."""

_LAST_BATCH = "last_batch_iteration"
_WARMUP_KEY = "inverse_log_warm_up"  # in the state of flatzero's DeepSpeed schedules only


def deepspeed_loss_scaler(
    state: Mapping[str, Any] | None, fp16: Mapping[str, Any] | None, steps: int
) -> DynamicLossScaler | StaticLossScaler:
    """DeepSpeed's loss scaler for flatzero's scaler ``state``.

    Args:
        state: flatzero's ``LossScaler.state_dict()``, or None (bf16, fp32).
        fp16: the ``fp16`` section of the DeepSpeed config (missing keys take
            ``FP16_DEFAULTS``), or None when not training in fp16.
        steps: optimizer steps taken, skipped ones included (DeepSpeed's ``cur_iter``).
    """
    if fp16 is None:
        return StaticLossScaler(cur_scale=1.0, dynamic=False)
    config = {**FP16_DEFAULTS, **fp16}
    if float(config["loss_scale"]) > 0:
        return StaticLossScaler(cur_scale=float(config["loss_scale"]), dynamic=False)
    state = state or {}
    scale = float(state.get("scale", 2.0 ** int(config.get("initial_scale_power", 16))))
    good = int(state.get("good_steps", 0))
    hysteresis = int(config["hysteresis"])
    cur_iter = int(state.get("iteration", steps))
    return DynamicLossScaler(
        cur_scale=scale,
        dynamic=True,
        cur_iter=cur_iter,
        last_overflow_iter=int(state.get("last_overflow_iteration", cur_iter - good - 2)),
        scale_factor=2.0,
        scale_window=int(config["loss_scale_window"]),
        min_scale=config["min_loss_scale"],
        delayed_shift=hysteresis,
        cur_hysteresis=int(state.get("hysteresis_left", hysteresis)),
        consecutive_hysteresis=bool(config["consecutive_hysteresis"]),
        raise_error_at_min_scale=True,
        dtype=torch.float16,
    )


def flatzero_loss_scaler(scaler: Any, skipped_steps: int, *, half: bool) -> dict[str, Any] | None:
    """flatzero's scaler state for DeepSpeed's ``scaler`` (a record of
    ``deepspeed_pickle``): None in fp32 training (``half`` False), a static scale's state
    in bf16 (flatzero's bf16 optimizer keeps one for its overflow checks) and static fp16.
    """
    if scaler is None or not half:
        return None
    good, counts = 0, {}
    if getattr(scaler, "dynamic", False):
        window = int(getattr(scaler, "scale_window", 1000) or 1000)
        stable = int(scaler.cur_iter) - int(scaler.last_overflow_iter) - 1
        good = (stable - 1) % window if stable >= 1 else 0
        counts = {
            "iteration": int(scaler.cur_iter),
            "last_overflow_iteration": int(scaler.last_overflow_iter),
        }
    return {
        "scale": float(getattr(scaler, "cur_scale", 1.0)),
        "good_steps": good,
        "hysteresis_left": int(getattr(scaler, "cur_hysteresis", 1) or 1),
        "skipped_steps": int(skipped_steps),
        **counts,
    }


def deepspeed_scheduler(state: Any) -> Any:
    """DeepSpeed's ``lr_scheduler`` entry for flatzero's scheduler ``state_dict()``: a
    flatzero DeepSpeed schedule gains ``last_batch_iteration``; others are unchanged."""
    if isinstance(state, dict) and _WARMUP_KEY in state and "last_epoch" in state:
        return {**state, _LAST_BATCH: int(state["last_epoch"]) - 1}
    return state


def flatzero_scheduler(state: Any) -> Any:
    """flatzero's scheduler state for a DeepSpeed ``lr_scheduler`` entry (the inverse of
    ``deepspeed_scheduler``)."""
    if isinstance(state, dict) and _WARMUP_KEY in state and _LAST_BATCH in state:
        return {k: v for k, v in state.items() if k != _LAST_BATCH}
    return state
