"""DeepSpeed's warmup LR schedules as ``torch.optim.lr_scheduler.LRScheduler`` subclasses.

The numbers are those of ``deepspeed.runtime.lr_schedules`` (0.19.8): the same parameter
names, defaults and formulas, and the same learning rate at every step. Only the
bookkeeping is torch's: ``last_epoch`` counts ``step()`` calls since construction, and
DeepSpeed's ``last_batch_iteration`` is ``last_epoch - 1`` (DeepSpeed's constructor does
not step; torch's does, so the two count from -1 and 0).

Schedule of the learning rate used by optimizer step ``k`` (``k = 0, 1, ...``; the engine
steps the scheduler after every applied optimizer step), with ``i = k - 1`` and ``W =
max(2, warmup_num_steps)``:

- ``i < 0`` (the first step): ``warmup_min_lr`` (WarmupLR, WarmupDecayLR) or 0
  (WarmupCosineLR).
- warmup, ``0 <= i < W``: ``gamma = log(i + 1) / log(W)`` (``warmup_type="log"``) or
  ``i / W`` (``"linear"``).
- WarmupLR: ``min_lr + (max_lr - min_lr) * gamma``, then ``max_lr``.
- WarmupDecayLR: after warmup ``gamma = max(0, (T - i) / max(1, T - W))``.
- WarmupCosineLR: a ratio of each group's initial lr: ``min_ratio + (1 - min_ratio) *
  gamma`` in warmup, then ``max(0, c + (1 - c) * (1 + cos(pi * min(1, p))) / 2)`` with
  ``p = (i - W + 1) / max(1, T - W)`` and ``c = cos_min_ratio``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["SCHEDULERS", "WARMUP_TYPES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

WARMUP_TYPES = ("log", "linear")
"""Warmup curves: logarithmic (DeepSpeed's default) or linear."""


def _number(owner: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner} {name} must be a finite number, got {value!r}")
    return float(value)


def _per_group(owner: str, name: str, value: Any, optimizer: torch.optim.Optimizer) -> list[float]:
    """A scalar for every param group, or a list with one value per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(
                f"{owner} {name} has {len(value)} values but the optimizer has {groups} param "
                "groups; give one value, or one per param group"
            )
        return [_number(owner, name, v) for v in value]
    return [_number(owner, name, value)] * groups


def _positive_steps(owner: str, name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{owner} {name} must be a positive integer (steps), got {value!r}")
    return value


def _warmup_type(owner: str, value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ValueError(
            f"{owner} warmup_type is {value!r}; use one of {', '.join(map(repr, WARMUP_TYPES))}"
        )
    return value


class _Warmup(LRScheduler):
    """The warmup shared by the three schedules (``gamma`` in [0, 1])."""

    warmup_num_steps: int
    warmup_type: str

    def _init_warmup(self, warmup_num_steps: Any, warmup_type: Any) -> None:
        owner = type(self).__name__
        self.warmup_num_steps = max(2, _positive_steps(owner, "warmup_num_steps", warmup_num_steps))
        self.warmup_type = _warmup_type(owner, warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's step counter: -1 before the first ``step()``."""
        return self.last_epoch - 1

    @staticmethod
    def reads_foreign_state(state: Any) -> bool:
        """Whether ``state`` is DeepSpeed's own state of this schedule (what DeepSpeed's
        ``state_dict`` returns, and an imported DeepSpeed checkpoint holds:
        ``{"last_batch_iteration": n}``), which ``load_state_dict`` maps."""
        return (
            isinstance(state, dict)
            and set(state) == {"last_batch_iteration"}
            and isinstance(state["last_batch_iteration"], int)
            and state["last_batch_iteration"] >= -1
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, or DeepSpeed's: the schedule resumes at its step
        (DeepSpeed's ``load_state_dict`` restores only that; the learning rate of the
        next optimizer step is the one saved with the optimizer, as in DeepSpeed)."""
        if not self.reads_foreign_state(state_dict):
            super().load_state_dict(state_dict)
            return
        self.last_epoch = state_dict["last_batch_iteration"] + 1
        self._step_count = self.last_epoch + 1
        self._last_lr = self._lrs(self.last_epoch - 1)

    def _warmup_gamma(self, iteration: int) -> float:
        if self.warmup_type == "log":
            return self.inverse_log_warm_up * math.log(iteration + 1)
        return iteration / self.warmup_num_steps

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return self._lrs(self.last_epoch - 1)

    def _get_closed_form_lr(self) -> list[float]:
        return self._lrs(self.last_epoch - 1)

    def _lrs(self, iteration: int) -> list[float]:
        raise NotImplementedError


class WarmupLR(_Warmup):
    """Raise the lr from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``
    steps (log or linear), then hold it (DeepSpeed's ``WarmupLR``).

    Args:
        optimizer: the optimizer (e.g. the engine's ``ZeroOptimizer``).
        warmup_min_lr: starting lr, one value or one per param group.
        warmup_max_lr: final lr, one value or one per param group; ``None`` takes each
            group's current lr.
        warmup_num_steps: optimizer steps of the warmup (at least 2 are used).
        warmup_type: ``"log"`` or ``"linear"``.
        last_epoch: torch's resume index; -1 starts fresh.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self._init_warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = [float(g["lr"]) for g in optimizer.param_groups]
        self.min_lrs = _per_group(owner, "warmup_min_lr", warmup_min_lr, optimizer)
        self.max_lrs = _per_group(owner, "warmup_max_lr", warmup_max_lr, optimizer)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        super().__init__(optimizer, last_epoch)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_gamma(iteration)
        return 1.0

    def _lrs(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [lo + d * gamma for lo, d in zip(self.min_lrs, self.delta_lrs, strict=True)]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then a linear decay to 0 at ``total_num_steps`` (DeepSpeed's
    ``WarmupDecayLR``; note its ``warmup_max_lr`` default is 0.001, not the group's lr).

    Args:
        optimizer: the optimizer.
        total_num_steps: optimizer steps of the whole schedule.
        warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch: as in
            ``WarmupLR``.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        self.total_num_steps = _positive_steps(
            type(self).__name__, "total_num_steps", total_num_steps
        )
        super().__init__(
            optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch
        )

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return self._warmup_gamma(iteration)
        decay_steps = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, float(self.total_num_steps - iteration) / decay_steps)


class WarmupCosineLR(_Warmup):
    """Warm the lr up from ``warmup_min_ratio`` of each group's lr to all of it, then decay
    it along a cosine to ``cos_min_ratio`` of it at ``total_num_steps`` (DeepSpeed's
    ``WarmupCosineLR``; ratios are of the lr each group had at construction).

    Args:
        optimizer: the optimizer.
        total_num_steps: optimizer steps of the whole schedule.
        warmup_min_ratio: starting ratio of the warmup.
        warmup_num_steps: optimizer steps of the warmup (at least 2 are used).
        cos_min_ratio: ratio at the end of the cosine (and after it).
        warmup_type: ``"log"`` or ``"linear"``.
        last_epoch: torch's resume index; -1 starts fresh.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_epoch: int = -1,
    ) -> None:
        owner = type(self).__name__
        self._init_warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = _positive_steps(owner, "total_num_steps", total_num_steps)
        self.warmup_min_ratio = _number(owner, "warmup_min_ratio", warmup_min_ratio)
        self.cos_min_ratio = _number(owner, "cos_min_ratio", cos_min_ratio)
        self.org_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_epoch)

    def lr_ratio(self, iteration: int) -> float:
        """The ratio of the initial lr at DeepSpeed's ``last_batch_iteration`` ``iteration``."""
        if iteration < 0:
            return 0.0
        if iteration < self.warmup_num_steps:
            gamma = self._warmup_gamma(iteration)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        real_last_step = iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, real_last_step / real_total_steps)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _lrs(self, iteration: int) -> list[float]:
        ratio = self.lr_ratio(iteration)
        return [lr * ratio for lr in self.org_lrs]


SCHEDULERS: dict[str, type[LRScheduler]] = {
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}
"""DeepSpeed scheduler names (``scheduler.type``) implemented here."""
