"""Turn what users pass (a module, params, named params, param groups) into clean groups."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .dtypes import dtype_name
from .layout import ParamSpec

__all__ = ["ParamGroup", "collect_param_groups", "rebind_param"]


def rebind_param(param: nn.Parameter, tensor: torch.Tensor) -> None:
    """Make ``param`` hold ``tensor`` (same shape) while staying the same Python object.

    ``param.data = tensor`` where torch allows it; where it does not, the contents are
    swapped in place instead (``torch.utils.swap_tensors``, as ``nn.Module._apply`` does):
    a param on the meta device, and a host param given a tensor of a backend torch does
    not count as shallow-copy compatible with the host (every PrivateUse1 backend, Ascend's
    NPU among them).
    """
    if param.device.type == "meta" or not torch._has_compatible_shallow_copy_type(param, tensor):
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


def _group_dicts(params: Any, names_from: nn.Module | None) -> list[Mapping[str, Any]]:
    """``params`` as a list of ``torch.optim``-style group dicts."""
    if params is None and names_from is not None:
        params = names_from
    if isinstance(params, nn.Module):
        params = list(params.named_parameters())
    if isinstance(params, torch.Tensor):
        raise TypeError(
            "params is a single tensor; pass an iterable of params such as model.parameters()"
        )
    raw = list(params)
    if raw and all(isinstance(g, Mapping) for g in raw):
        return raw
    if any(isinstance(g, Mapping) for g in raw):
        raise TypeError("params mixes param-group dicts with params; pass one kind only")
    return [{"params": raw}]


def _named(
    items: Iterable[Any], group_index: int, names: dict[int, str] | None, where: str
) -> list[tuple[str, Any]]:
    """``(name, param)`` pairs: a pair as given; a param named after the model (``names``:
    ``id(param) -> name``), else after its place (``group0.param3``)."""
    named = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            named.append(item)
        elif names is not None:
            if id(item) not in names:
                raise ValueError(
                    f"{where} item {i} (shape {tuple(getattr(item, 'shape', ()))}) is not a "
                    "parameter of model; pass the model's own parameters"
                )
            named.append((names[id(item)], item))
        elif isinstance(item, torch.Tensor):
            named.append((f"group{group_index}.param{i}", item))
        else:
            raise TypeError(
                f"param group {group_index} item {i} is a {type(item).__name__}; expected a "
                "torch.nn.Parameter or a (name, Parameter) pair as model.named_parameters() gives"
            )
    return named


class _Collector:
    """Builds the groups one by one, remembering which group owns each param and which
    names are taken."""

    def __init__(self) -> None:
        self.owner: dict[int, int] = {}
        self.names_seen: set[str] = set()

    def group(self, index: int, named: list[tuple[str, Any]], options: dict) -> ParamGroup:
        group = ParamGroup([], [], options)
        for name, p in named:
            if not isinstance(p, nn.Parameter):
                raise TypeError(
                    f"{name!r} is a {type(p).__name__}, not a torch.nn.Parameter; flatzero "
                    "rebinds parameters in place and needs them to be nn.Parameter objects"
                )
            if id(p) in self.owner:
                if self.owner[id(p)] != index:
                    raise ValueError(
                        f"param {name!r} is in param groups {self.owner[id(p)]} and {index}; a "
                        "param may belong to one group only: remove it from one of them"
                    )
                continue  # a tied param listed twice in one group: keep it once
            self.owner[id(p)] = index
            if not p.requires_grad:
                group.frozen.append(p)
                continue
            if name in self.names_seen:
                raise ValueError(
                    f"two different params are both named {name!r}; give them unique names"
                )
            self.names_seen.add(name)
            group.names.append(name)
            group.params.append(p)
        return group


def collect_param_groups(
    params: Any, *, names_from: nn.Module | None = None, where: str = "params"
) -> list[ParamGroup]:
    """Normalize ``params`` into groups of trainable, deduplicated parameters: the one place
    both doors turn what users pass into param groups.

    Accepts an ``nn.Module`` (its ``named_parameters()``), an iterable of params, an
    iterable of ``(name, param)`` pairs, a list of dicts with a ``"params"`` key
    (torch.optim's param groups, whose ``"params"`` may be either of the former), or
    groups this function already returned (returned as they are).

    Args:
        params: what to collect; None with ``names_from``: that model's params.
        names_from: name unnamed params after this model (a tied param by its first
            name); a param that is not the model's is then an error.
        where: what ``params`` is called in that error (``"model_parameters"``).

    Raises:
        TypeError: an item is not a parameter.
        ValueError: no trainable params at all, a param in two groups, a name used twice,
            or (with ``names_from``) a param that is not the model's.
    """
    if isinstance(params, list) and params and all(isinstance(g, ParamGroup) for g in params):
        return params
    names = None
    if names_from is not None:
        names = {id(p): n for n, p in names_from.named_parameters()}
    collector = _Collector()
    groups = []
    for gi, gd in enumerate(_group_dicts(params, names_from)):
        if "params" not in gd:
            raise ValueError(f"param group {gi} has no 'params' key; add the group's params")
        items = gd["params"]
        items = [items] if isinstance(items, torch.Tensor) else items
        options = {k: v for k, v in gd.items() if k != "params"}
        groups.append(collector.group(gi, _named(items, gi, names, where), options))
    if not any(g.params for g in groups):
        raise ValueError(
            "there are no trainable parameters (none given, or all have requires_grad=False); "
            "pass the model's parameters and make sure some require gradients"
        )
    return groups
