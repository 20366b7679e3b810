"""Dynamic loss scaling for fp16: the scale and its update rule, with no tensors."""

from __future__ import annotations

import logging
from typing import Any

from .config import LossScaleConfig

__all__ = ["LossScaler"]

logger = logging.getLogger(__name__)


class LossScaler:
    """The loss scale and its bookkeeping (see ``LossScaleConfig`` for the rule).

    ``update(found_inf)`` is called once per optimizer step with the verdict every rank
    agreed on, so every rank's scaler stays identical.
    """

    def __init__(self, config: LossScaleConfig) -> None:
        self.config = config
        self.scale = config.init_scale
        self.good_steps = 0
        self.hysteresis_left = config.hysteresis
        self.skipped_steps = 0

    def update(self, found_inf: bool) -> None:
        """Advance the rule after a step that overflowed (``found_inf``) or not."""
        c = self.config
        if found_inf:
            self.skipped_steps += 1
            self.good_steps = 0
            if not c.dynamic:
                return
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                old = self.scale
                self.scale = max(self.scale * c.backoff_factor, c.min_scale)
                self.hysteresis_left = c.hysteresis
                logger.info("fp16 overflow: step skipped, loss scale %g -> %g", old, self.scale)
            else:
                logger.info("fp16 overflow: step skipped, loss scale kept at %g", self.scale)
            return
        self.hysteresis_left = c.hysteresis
        if not c.dynamic:
            return
        self.good_steps += 1
        if self.good_steps >= c.growth_interval:
            self.scale = min(self.scale * c.growth_factor, c.max_scale)
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (plain Python numbers)."""
        return {
            "scale": self.scale,
            "good_steps": self.good_steps,
            "hysteresis_left": self.hysteresis_left,
            "skipped_steps": self.skipped_steps,
        }

    @staticmethod
    def check_state_dict(state: Any) -> None:
        """Raise ``ValueError`` unless ``state`` looks like ``state_dict()``'s output."""
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
