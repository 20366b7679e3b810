"""Dynamic loss scaling for fp16: the scale and its update rule, with no tensors."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from .config import LossScaleConfig

__all__ = ["LossScaler", "loss_scaler_for"]

logger = logging.getLogger(__name__)


class LossScaler:
    """The loss scale and its bookkeeping (see ``LossScaleConfig`` for the rules).

    ``update(found_inf)`` is called once per optimizer step with the verdict every rank
    agreed on, so every rank's scaler stays identical.

    Attributes:
        scale: the current scale.
        good_steps: clean steps since the last growth or overflow (``"torch"`` rule).
        hysteresis_left: overflows still absorbed before the scale backs off.
        skipped_steps: steps skipped for an overflow, in all.
        iteration: steps taken, skipped ones included (DeepSpeed's ``cur_iter``).
        last_overflow_iteration: the ``iteration`` of the last overflow, -1 before any
            (DeepSpeed's ``last_overflow_iter``).
    """

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = config.init_scale
        self.good_steps = 0
        self.hysteresis_left = config.hysteresis
        self.skipped_steps = 0
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, found_inf: bool) -> None:
        """Advance the rule after a step that overflowed (``found_inf``) or not."""
        if found_inf:
            self.skipped_steps += 1
        if self.config.dynamic:
            if self.config.rule == "deepspeed":
                self._deepspeed(found_inf)
            else:
                self._torch(found_inf)
        if found_inf:
            self.last_overflow_iteration = self.iteration
        self.iteration += 1

    def _back_off(self) -> None:
        old = self.scale
        self.scale = max(self.scale * self.config.backoff_factor, self.config.min_scale)
        logger.info("fp16 overflow: step skipped, loss scale %g -> %g", old, self.scale)

    def _grow(self) -> None:
        self.scale = min(self.scale * self.config.growth_factor, self.config.max_scale)

    def _torch(self, found_inf: bool) -> None:
        c = self.config
        if found_inf:
            self.good_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self._back_off()
                self.hysteresis_left = c.hysteresis
            else:
                logger.info("fp16 overflow: step skipped, loss scale kept at %g", self.scale)
            return
        self.hysteresis_left = c.hysteresis
        self.good_steps += 1
        if self.good_steps >= c.growth_interval:
            self._grow()
            self.good_steps = 0

    def _deepspeed(self, found_inf: bool) -> None:
        c = self.config
        if found_inf:
            self.good_steps = 0
            if c.hysteresis == 1 or self.hysteresis_left == 1:
                self._back_off()  # the hysteresis stays spent: the next overflow halves too
            else:
                self.hysteresis_left -= 1
                logger.info("fp16 overflow: step skipped, loss scale kept at %g", self.scale)
            return
        self.good_steps += 1
        if c.consecutive_hysteresis:
            self.hysteresis_left = c.hysteresis
        stable = self.iteration - self.last_overflow_iteration - 1
        if stable > 0 and stable % c.growth_interval == 0:
            self.hysteresis_left = c.hysteresis
            self._grow()
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (plain Python numbers; the iteration counts only for a
        dynamic scale, whose rule reads them)."""
        state = {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }
        if self.config.dynamic:
            state["iteration"] = self.iteration
            state["last_overflow_iteration"] = self.last_overflow_iteration
        return state

    @staticmethod
    def check_state_dict(state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` looks like ``state_dict()``'s output (the
        two iteration counts may be absent: checkpoints written before they were kept)."""
        keys = ("scale", "good_steps", "hysteresis_left", "skipped_steps")
        if not isinstance(state, dict) or any(k not in state for k in keys):
            raise ValueError(
                f"loss scaler state must be a dict with keys {', '.join(keys)}, got {state!r}"
            )
        if not float(state["scale"]) > 0:
            raise ValueError(f"loss scaler state has a non-positive scale {state['scale']!r}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (checked with ``check_state_dict`` first)."""
        self.check_state_dict(state)
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.skipped_steps = int(state["skipped_steps"])
        # older checkpoints: as many steps since the last overflow as clean steps counted
        self.iteration = int(state.get("iteration", self.good_steps))
        self.last_overflow_iteration = int(state.get("last_overflow_iteration", -1))


def loss_scaler_for(
    config: LossScaleConfig | None, dtypes: Sequence[torch.dtype]
) -> LossScaler | None:
    """The loss scaler of ``config``, or the default one when a group's params (of
    ``dtypes``) are fp16; None without scaling."""
    if config is None and torch.float16 in dtypes:
        config = LossScaleConfig()
    return LossScaler(config) if config is not None else None
