"""Replacing a model's parameters while keeping tied parameters tied."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ParameterSlots"]


class ParameterSlots:
    """Every place (module, attribute) that holds each unique parameter of ``model``.

    A tied parameter (one ``Parameter`` registered under several names) has several
    slots; :meth:`replace` rebinds all of them, so the tie survives.
    """

    def __init__(self, model: nn.Module) -> None:
        self._slots: dict[int, list[tuple[nn.Module, str]]] = {}
        for module in model.modules():
            for key, param in module._parameters.items():
                if param is not None:
                    self._slots.setdefault(id(param), []).append((module, key))

    def replace(self, old: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
        """Put a new ``Parameter`` holding ``data`` in every slot of ``old``; return it."""
        new = nn.Parameter(data, requires_grad=old.requires_grad)
        slots = self._slots.pop(id(old))
        for module, key in slots:
            module._parameters[key] = new
        self._slots[id(new)] = slots
        return new
