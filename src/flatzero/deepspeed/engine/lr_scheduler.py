"""The LR scheduler of ``flatzero.initialize``: the config's ``scheduler`` section, or the
client's (an instance built over the client optimizer, or a function optimizer ->
scheduler), checked before anything is flattened and built over flatzero's optimizer."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

from ...flatten import FlatParams
from ...optim import ZeroOptimizer
from .config import SchedulerSpec

__all__ = ["build_scheduler", "check_client_scheduler", "probe_scheduler"]


def _is_scheduler(value: Any) -> bool:
    return hasattr(value, "step") and hasattr(value, "optimizer")


def probe_scheduler(spec: SchedulerSpec | None, lrs: list[float]) -> None:
    """Build the config's scheduler on a dummy optimizer with the same groups' lrs, so a
    bad parameter fails before anything is flattened."""
    if spec is None:
        return
    dummy = torch.optim.SGD(
        [{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs], lr=lrs[0]
    )
    try:
        spec.scheduler_class(dummy, **spec.kwargs())
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(
            f"config key 'scheduler' ({spec.type} with params {dict(spec.params)}) cannot be "
            f"built: {error}"
        ) from error


def check_client_scheduler(lr_scheduler: Any, client: torch.optim.Optimizer | None) -> None:
    """A scheduler instance must drive the client optimizer (checked before flattening)."""
    if lr_scheduler is None:
        return
    if _is_scheduler(lr_scheduler):
        if client is None or lr_scheduler.optimizer is not client:
            raise ValueError(
                "lr_scheduler is an instance built over another optimizer than the one passed "
                "to flatzero.initialize; pass a function optimizer -> scheduler instead "
                "(lr_scheduler=lambda opt: torch.optim.lr_scheduler.X(opt, ...))"
            )
    elif not callable(lr_scheduler):
        raise TypeError(
            f"lr_scheduler must be a scheduler or a function optimizer -> scheduler, got "
            f"{type(lr_scheduler).__name__}"
        )


def _expand_per_group(kwargs: dict[str, Any], flat: FlatParams, user_groups: int) -> dict[str, Any]:
    """Lists given per user param group become lists per optimizer group (one per group
    and dtype)."""
    if user_groups == len(flat.groups):
        return kwargs
    out = dict(kwargs)
    for key, value in kwargs.items():
        if isinstance(value, list) and len(value) == user_groups:
            out[key] = [value[g.layout.group_index] for g in flat.groups]
    return out


def _track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's LR schedulers expect (so a scheduler moved onto
    it does not warn that step() was overridden)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)
    step = type(optimizer).step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def _moved_onto(
    lr_scheduler: Any, optimizer: ZeroOptimizer, client: torch.optim.Optimizer | None
) -> Any:
    """The client's scheduler instance, now driving ``optimizer``."""
    if len(optimizer.param_groups) != len(client.param_groups):
        raise ValueError(
            f"lr_scheduler was built over {len(client.param_groups)} param groups but "
            f"flatzero's optimizer has {len(optimizer.param_groups)} (one per group and "
            "dtype); pass a function optimizer -> scheduler instead"
        )
    # The groups were built from the client's (with the scheduler's lr and initial_lr).
    lr_scheduler.optimizer = optimizer
    _track_step_calls(optimizer)
    return lr_scheduler


def build_scheduler(
    lr_scheduler: Any,
    spec: SchedulerSpec | None,
    optimizer: ZeroOptimizer,
    client: torch.optim.Optimizer | None,
    user_groups: int,
) -> Any:
    """The scheduler over flatzero's ``optimizer``, or None.

    Args:
        lr_scheduler: the client's scheduler (instance or function), or None.
        spec: the config's ``scheduler`` section, or None.
        optimizer: flatzero's optimizer.
        client: the client optimizer, or None.
        user_groups: the user's param groups (per-group lists of the config are given
            per user group; the optimizer has one group per user group and dtype).
    """
    if lr_scheduler is None:
        if spec is None:
            return None
        kwargs = _expand_per_group(spec.kwargs(), optimizer.flat, user_groups)
        return spec.scheduler_class(optimizer, **kwargs)
    if _is_scheduler(lr_scheduler):
        return _moved_onto(lr_scheduler, optimizer, client)
    return lr_scheduler(optimizer)
