"""Turn what users pass (a module, params, named params, param groups) into clean groups."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .layout import ParamSpec

__all__ = ["ParamGroup", "collect_param_groups", "dtype_name", "rebind_param"]


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def rebind_param(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """Make ``param`` hold ``tensor`` (same shape) while staying the same Python object.

    ``param.data = tensor`` where possible; a param on the meta device cannot take real
    storage that way, so its contents are swapped in place instead.
    """
    if param.device.type == "meta":
        replacement = nn.Parameter(tensor, requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, replacement)
    else:
        param.data = tensor


@dataclass
class ParamGroup:
    """One user param group: its trainable params (tied ones once) and its options.

    Attributes:
        names: fully qualified names, in registration order.
        params: the trainable params, in registration order, each once.
        options: the group's hyperparameters (everything but ``"params"``).
        frozen: params of the group with ``requires_grad=False``; never touched.
    """

    names: list[str]
    params: list[nn.Parameter]
    options: dict[str, Any] = field(default_factory=dict)
    frozen: list[nn.Parameter] = field(default_factory=list)

    def specs(self) -> list[ParamSpec]:
        """The layout's view of the group."""
        return [
            ParamSpec(n, tuple(p.shape), dtype_name(p.dtype))
            for n, p in zip(self.names, self.params, strict=True)
        ]


def _named(items: Iterable[Any], group_index: int) -> list[tuple[str, torch.Tensor]]:
    named = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            named.append(item)
        elif isinstance(item, torch.Tensor):
            named.append((f"group{group_index}.param{i}", item))
        else:
            raise TypeError(
                f"param group {group_index} item {i} is a {type(item).__name__}; expected a "
                "torch.nn.Parameter or a (name, Parameter) pair as model.named_parameters() gives"
            )
    return named


def collect_param_groups(params: Any) -> list[ParamGroup]:
    """Normalize ``params`` into groups of trainable, deduplicated parameters.

    Accepts an ``nn.Module`` (its ``named_parameters()``), an iterable of params, an
    iterable of ``(name, param)`` pairs, or a list of dicts with a ``"params"`` key
    (torch.optim's param groups, whose ``"params"`` may be either of the former).

    Raises:
        TypeError: an item is not a parameter.
        ValueError: no trainable params at all, a param in two groups, or a name used twice.
    """
    if isinstance(params, nn.Module):
        params = list(params.named_parameters())
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params is a single tensor; pass an iterable of params such as model.parameters()"
        )
    raw = list(params)
    if raw and all(isinstance(g, dict) for g in raw):
        group_dicts = raw
    elif any(isinstance(g, dict) for g in raw):
        raise TypeError("params mixes param-group dicts with params; pass one kind only")
    else:
        group_dicts = [{"params": raw}]

    owner: dict[int, int] = {}
    names_seen: set[str] = set()
    groups = []
    for gi, gd in enumerate(group_dicts):
        if "params" not in gd:
            raise ValueError(f"param group {gi} has no 'params' key; add the group's params")
        items = gd["params"]
        if isinstance(items, torch.Tensor):
            items = [items]
        group = ParamGroup([], [], {k: v for k, v in gd.items() if k != "params"})
        for name, p in _named(items, gi):
            if not isinstance(p, nn.Parameter):
                raise TypeError(
                    f"{name!r} is a {type(p).__name__}, not a torch.nn.Parameter; flatzero "
                    "rebinds parameters in place and needs them to be nn.Parameter objects"
                )
            if id(p) in owner:
                if owner[id(p)] != gi:
                    raise ValueError(
                        f"param {name!r} is in param groups {owner[id(p)]} and {gi}; a param "
                        "may belong to one group only: remove it from one of them"
                    )
                continue  # a tied param listed twice in one group: keep it once
            owner[id(p)] = gi
            if not p.requires_grad:
                group.frozen.append(p)
                continue
            if name in names_seen:
                raise ValueError(
                    f"two different params are both named {name!r}; give them unique names"
                )
            names_seen.add(name)
            group.names.append(name)
            group.params.append(p)
        groups.append(group)

    if not any(g.params for g in groups):
        raise ValueError(
            "there are no trainable parameters (none given, or all have requires_grad=False); "
            "pass the model's parameters and make sure some require gradients"
        )
    return groups
