"""``torch.nn.utils.clip_grad_norm_`` on a ``ZeroOptimizer``'s params clips through it.

What every PyTorch loop writes between backward and step sees the wrong gradients under
ZeRO: at stage 2 the params hold no ``.grad`` (the gradients already live in the sharded
shards), so torch's call returns 0.0 and clips nothing; at stage 1 each rank's ``.grad`` is
its own, not yet averaged over the ranks. While a ``ZeroOptimizer`` lives, flatzero wraps
torch's function: a call whose params all belong to live ``ZeroOptimizer``s clips through
their ``clip_grad_norm_`` (the global norm of the averaged, unscaled gradient, applied at
the next ``step()``) and returns that norm, with one warning naming the direct call; any
other call is torch's own, unchanged.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch
import torch.nn.utils.clip_grad as torch_clip


class ZeroOptimizer(Protocol):
    """What this module asks of a ``ZeroOptimizer``."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...


__all__ = ["register", "unregister"]

logger = logging.getLogger(__name__)

_owners: weakref.WeakValueDictionary[int, ZeroOptimizer] = weakref.WeakValueDictionary()
"""The live ``ZeroOptimizer`` of each param, by the param's id."""

_warned = False


def register(optimizer: ZeroOptimizer, params: Iterable[torch.Tensor]) -> None:
    """Route torch's ``clip_grad_norm_`` over ``params`` to ``optimizer`` while it lives;
    installs the wrapper on the first call."""
    for p in params:
        _owners[id(p)] = optimizer
    if not getattr(torch.nn.utils.clip_grad_norm_, "_flatzero_routes", False):
        routed = _routing(torch.nn.utils.clip_grad_norm_)
        torch.nn.utils.clip_grad_norm_ = routed
        torch_clip.clip_grad_norm_ = routed


def unregister(params: Iterable[torch.Tensor]) -> None:
    """Stop routing ``params`` (their optimizer was closed)."""
    for p in params:
        _owners.pop(id(p), None)


def _routing(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def clip_grad_norm_(
        parameters: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        owners = [_owners.get(id(p)) for p in params]
        if not params or any(o is None for o in owners):
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        _warn_once()
        norms = [opt.clip_grad_norm_(max_norm, norm_type) for opt in _distinct(owners)]
        total = torch.stack(norms).square().sum().sqrt() if len(norms) > 1 else norms[0]
        if error_if_nonfinite and not bool(total.isfinite()):
            raise RuntimeError(
                f"the total norm of order {norm_type} for the gradients is non-finite, so it "
                "cannot be clipped (error_if_nonfinite=True)"
            )
        return total

    clip_grad_norm_._flatzero_routes = True  # type: ignore[attr-defined]
    return clip_grad_norm_


def _distinct(owners: list[Any]) -> list[ZeroOptimizer]:
    seen: dict[int, ZeroOptimizer] = {}
    for o in owners:
        seen.setdefault(id(o), o)
    return list(seen.values())


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "torch.nn.utils.clip_grad_norm_ was called on the params of a ZeroOptimizer, "
            "whose gradients live in its shards (stage 2: the params hold no .grad); flatzero "
            "clipped through opt.clip_grad_norm_(max_norm), the global norm of the averaged "
            "gradient over all ranks. Call opt.clip_grad_norm_ directly (or set "
            "ZeroConfig.max_grad_norm) to say so"
        )
