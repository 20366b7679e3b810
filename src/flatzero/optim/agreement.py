"""What every rank's ``ZeroOptimizer`` setup must agree on, described by meaning.

``comm.check_same_everywhere`` compares one text per field across ranks, so a text must
say what a setting means and nothing that differs by rank for the same meaning. ``repr``
does not: a tensor ``lr`` prints its device (``device='cuda:3'``, another on every rank),
a function or an object its address. ``meaning`` describes a value by what it is:
numbers exactly, tensors by dtype, shape and values, devices by type, functions and
classes by qualified name.
"""

from __future__ import annotations

import enum
import hashlib
import json
import re
from collections.abc import Mapping
from typing import Any

import torch

from ..dtypes import dtype_name
from .config import ZeroConfig

__all__ = ["meaning", "setup_fields"]

_LISTED_NUMEL = 64
"""Tensors up to this many elements are described by their values, larger ones by a
SHA-256 of their bytes."""

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _tensor_meaning(tensor: torch.Tensor) -> dict[str, Any]:
    """Dtype, shape and values (or a hash of the bytes) of ``tensor``, on any device."""
    host = tensor.detach().cpu()
    if host.numel() <= _LISTED_NUMEL:
        values: Any = host.tolist()
    else:
        raw = host.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        values = "sha256:" + hashlib.sha256(raw).hexdigest()
    return {"tensor": dtype_name(tensor.dtype), "shape": list(tensor.shape), "values": values}


def meaning(value: Any) -> Any:
    """A JSON-serializable description of ``value`` that is the same on two ranks exactly
    when the values mean the same: ``None``, bools, ints, floats and strings as they are;
    tensors by dtype, shape and values (never device); ``torch.dtype`` by name,
    ``torch.device`` by type; mappings, lists and tuples element by element; enums by
    name; functions and classes by qualified name; anything else by type and ``repr``
    without memory addresses.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return _tensor_meaning(value)
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device type": value.type}
    if isinstance(value, Mapping):
        return {str(k): meaning(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [meaning(v) for v in value]
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return {"type": type(value).__qualname__, "repr": _ADDRESS.sub("", repr(value))}


def setup_fields(
    config: ZeroConfig, optimizer_cls: type, arguments: Mapping[str, Any]
) -> dict[str, str]:
    """The fields every rank's optimizer setup must agree on (``check_same_everywhere``).

    Args:
        config: the ``ZeroConfig`` (its ``repr`` holds only numbers, flags and dtypes).
        optimizer_cls: the inner optimizer's class.
        arguments: the optimizer's keyword arguments (``lr``, ``betas``, ...), compared by
            ``meaning``: a tensor ``lr`` on ``cuda:0`` and one of the same value on
            ``cuda:1`` agree; ``lr`` 1e-3 and 2e-3 do not.
    """
    return {
        "ZeroConfig": repr(config),
        "optimizer": f"{optimizer_cls.__module__}.{optimizer_cls.__qualname__}",
        "optimizer arguments": json.dumps(meaning(dict(arguments)), sort_keys=True),
    }
