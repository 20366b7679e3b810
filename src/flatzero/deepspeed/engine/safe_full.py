"""``deepspeed.utils.safe_get_full_*`` / ``safe_set_full_*`` answering for flatzero's params.

DeepSpeed's functions find its ZeRO-1/2 optimizer through attributes it attaches to every
param (``param._hp_mapping`` and bound ``param.get_full_hp_param``, ...); on a param that has
none they return None or do nothing, silently, and on a stage-1 param with a ``.grad`` they
return the local, unreduced gradient. flatzero attaches nothing to a user's param, so
``install()`` replaces each function, in ``deepspeed.utils``, ``deepspeed.utils.
tensor_fragment`` and every loaded module that imported it by name (``from deepspeed.utils
import safe_get_full_grad``), by one that asks ``full_values.owner(param)`` first and calls
DeepSpeed's own function for any param no flatzero engine trains. ``install()`` runs when
``flatzero.patch_deepspeed()`` is called and at every ``flatzero.initialize`` while
``deepspeed`` is imported; it is idempotent. A reference to DeepSpeed's function kept
elsewhere (a local variable, a closure) before then still gets DeepSpeed's answer.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import torch

from . import full_values

__all__ = ["install"]

_MARK = "__flatzero_safe_full__"


def _get_param(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def safe_get_full_fp32_param(param: Any) -> Any:
        opt = full_values.owner(param)
        return original(param) if opt is None else full_values.get_full_param(opt, param)

    return safe_get_full_fp32_param


def _set_param(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def safe_set_full_fp32_param(param: Any, value: torch.Tensor) -> None:
        opt = full_values.owner(param)
        if opt is None:
            original(param, value)
        else:
            full_values.set_full_param(opt, param, value)

    return safe_set_full_fp32_param


def _get_state(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def safe_get_full_optimizer_state(param: Any, optim_state_key: str) -> Any:
        opt = full_values.owner(param)
        if opt is None:
            return original(param, optim_state_key)
        return full_values.get_full_param(opt, param, optim_state_key)

    return safe_get_full_optimizer_state


def _set_state(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def safe_set_full_optimizer_state(
        param: Any, value: torch.Tensor, optim_state_key: str
    ) -> None:
        opt = full_values.owner(param)
        if opt is None:
            original(param, value, optim_state_key)
        else:
            full_values.set_full_param(opt, param, value, optim_state_key)

    return safe_set_full_optimizer_state


def _get_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def safe_get_full_grad(param: Any) -> Any:
        opt = full_values.owner(param)
        return original(param) if opt is None else full_values.get_full_grad(opt, param)

    return safe_get_full_grad


def _set_grad(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def safe_set_full_grad(param: Any, value: torch.Tensor) -> None:
        opt = full_values.owner(param)
        if opt is None:
            original(param, value)
        else:
            full_values.set_full_grad(opt, param, value)

    return safe_set_full_grad


def _update_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def safe_update_full_grad_vectorized(param_list: list[Any], update_func: Callable) -> None:
        ours = [p for p in param_list if full_values.owner(p) is not None]
        if len(ours) < len(param_list):
            original([p for p in param_list if full_values.owner(p) is None], update_func)
        for p in ours:
            opt = full_values.owner(p)
            assert opt is not None
            full_values.set_full_grad(opt, p, update_func(full_values.get_full_grad(opt, p), p))

    return safe_update_full_grad_vectorized


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "safe_get_full_fp32_param": _get_param,
    "safe_set_full_fp32_param": _set_param,
    "safe_get_full_optimizer_state": _get_state,
    "safe_set_full_optimizer_state": _set_state,
    "safe_get_full_grad": _get_grad,
    "safe_set_full_grad": _set_grad,
    "safe_update_full_grad_vectorized": _update_grads,
}


def install() -> bool:
    """Replace DeepSpeed's functions (see the module docstring); False when
    ``deepspeed.utils.tensor_fragment`` cannot be imported (nothing to replace)."""
    try:  # by its full name: ``deepspeed.utils.tensor_fragment`` is also a dataclass there
        tensor_fragment = importlib.import_module("deepspeed.utils.tensor_fragment")
    except Exception:  # no (or a broken) DeepSpeed: nothing calls its functions
        return False
    replaced: dict[int, Callable[..., Any]] = {}
    for name, wrap in _WRAPPERS.items():
        original = getattr(tensor_fragment, name, None)
        if original is None or getattr(original, _MARK, False):
            continue
        wrapper = wrap(original)
        setattr(wrapper, _MARK, True)
        replaced[id(original)] = wrapper
    if not replaced:
        return True
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name in _WRAPPERS:
            value = namespace.get(name)
            if value is not None and id(value) in replaced:
                namespace[name] = replaced[id(value)]
    return True
