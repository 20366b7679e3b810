"""The ``ZeroOptimizer`` the DeepSpeed door returns, with the attributes of DeepSpeed's ZeRO-1/2
optimizer that user scripts read.

Scripts written for DeepSpeed read a few attributes of ``engine.optimizer`` (DeepSpeed's
``DeepSpeedZeroOptimizer``): the wrapped torch optimizer (``engine.optimizer.optimizer``, to
read its ``state`` or ``param_groups``) and the loss scale (``engine.optimizer.loss_scaler.
cur_scale``, ``engine.optimizer.cur_scale``, ``loss_scale``). ``DoorOptimizer`` adds them to
``ZeroOptimizer`` under DeepSpeed's names; the PyTorch door's ``ZeroOptimizer`` keeps its own
(``inner``, ``loss_scale``). Internals no user script needs (``bit16_groups_flat``,
``single_partition_of_fp32_groups``, ``averaged_gradients``, ...) are not imitated.
"""

from __future__ import annotations

from ...optim import LossScaleConfig, ZeroOptimizer
from ...optim.scaler import LossScaler

__all__ = ["DeepSpeedLossScaler", "DoorOptimizer"]

_FIXED = LossScaleConfig(init_scale=1.0, dynamic=False)


class DeepSpeedLossScaler:
    """DeepSpeed's ``LossScaler`` / ``DynamicLossScaler`` attributes over flatzero's
    ``LossScaler`` (a view: reading and writing ``cur_scale`` reads and writes its scale).

    Args:
        scaler: flatzero's scaler (a fixed scale of 1 where the optimizer has none, as
            DeepSpeed's optimizer then holds ``LossScaler(scale=1)``).
    """

    def __init__(self, scaler: LossScaler) -> None:
        self._scaler = scaler

    @property
    def cur_scale(self) -> float:
        """The current loss scale."""
        return self._scaler.scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self._scaler.scale = float(value)

    @property
    def loss_scale(self) -> float:
        """``cur_scale``."""
        return self._scaler.scale

    @property
    def dynamic(self) -> bool:
        """Whether the scale moves (fp16 dynamic loss scaling)."""
        return self._scaler.config.dynamic

    @property
    def cur_iter(self) -> int:
        """Steps taken, skipped ones included."""
        return self._scaler.iteration

    @property
    def last_overflow_iter(self) -> int:
        """``cur_iter`` of the last overflow, -1 before any."""
        return self._scaler.last_overflow_iteration

    @property
    def cur_hysteresis(self) -> int:
        """Overflows still absorbed before the scale backs off."""
        return self._scaler.hysteresis_left

    @property
    def scale_window(self) -> int:
        """Clean steps between two growths (``loss_scale_window``)."""
        return self._scaler.config.growth_interval

    @property
    def min_scale(self) -> float:
        """The scale never backs off below this (``min_loss_scale``)."""
        return self._scaler.config.min_scale

    def __repr__(self) -> str:
        return f"DeepSpeedLossScaler(cur_scale={self.cur_scale:g}, dynamic={self.dynamic})"


class DoorOptimizer(ZeroOptimizer):
    """``ZeroOptimizer`` plus DeepSpeed's ``optimizer``, ``loss_scaler`` and ``cur_scale``."""

    @property
    def optimizer(self) -> object:
        """The wrapped torch optimizer (``inner``), as DeepSpeed's ``optimizer.optimizer``:
        its params are this rank's fp32 master shards."""
        return self.inner

    @property
    def loss_scaler(self) -> DeepSpeedLossScaler:
        """The loss scaler under DeepSpeed's attribute names (``cur_scale``, ...); without
        loss scaling (stage 0, bf16 with ``check_grad_overflow: false``) a fixed scale of 1
        that nothing reads."""
        return DeepSpeedLossScaler(self._scaler if self._scaler is not None else LossScaler(_FIXED))

    @property
    def cur_scale(self) -> float:
        """The current loss scale (DeepSpeed's ``cur_scale``; ``loss_scale`` too)."""
        return self.loss_scale

    @cur_scale.setter
    def cur_scale(self, value: float) -> None:
        self.loss_scaler.cur_scale = value
