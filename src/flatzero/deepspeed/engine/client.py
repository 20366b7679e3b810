"""The client optimizer's ``param_groups``, kept in step with flatzero's optimizer.

A script (or Hugging Face Accelerate) builds ``opt = torch.optim.AdamW(model.parameters())``
and ``sched = LambdaLR(opt, ...)``, passes ``opt`` to ``deepspeed.initialize`` and then steps
``sched``, which writes ``opt.param_groups[i]["lr"]``. DeepSpeed's ZeRO optimizer steps that
very optimizer, so the schedule takes effect. flatzero steps its own inner optimizer over
the flat fp32 shards (one param group per user group and dtype), so
``link_client_optimizer`` replaces each of the client's param groups by a
``LinkedParamGroup``: a mapping whose hyperparameters (``lr``, ``weight_decay``,
``initial_lr``, ...) *are* those of flatzero's groups built from it. Reading or writing
either side reads or writes the same value, at any time, in both directions.

``params`` stays the client's own list (the model's params), so code that calls the client's
``zero_grad()`` only touches the model's ``.grad``, never flatzero's fp32 shards.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from ...optim import ZeroOptimizer

__all__ = ["LinkedParamGroup", "link_client_optimizer"]


class LinkedParamGroup(MutableMapping):
    """One param group of the client optimizer, linked to flatzero's groups built from it.

    ``group["params"]`` is the client's own param list. Any other key reads from the first
    of flatzero's groups built from this user group (the client's own value when there is
    none, e.g. a group whose params are all frozen) and writes to all of them and to the
    client's own copy.

    Args:
        optimizer: flatzero's ``ZeroOptimizer``.
        index: the user group's index (``GroupLayout.group_index``).
        own: the client's original group dict (kept for ``params`` and as a fallback).
    """

    def __init__(self, optimizer: ZeroOptimizer, index: int, own: dict[str, Any]) -> None:
        self._optimizer = optimizer
        self._index = index
        self._own = own

    def _targets(self) -> list[dict[str, Any]]:
        # Looked up at every access: loading a state dict replaces the group dicts.
        opt = self._optimizer
        return [
            group
            for group, flat in zip(opt.param_groups, opt.flat.groups, strict=True)
            if flat.layout.group_index == self._index
        ]

    def __getitem__(self, key: str) -> Any:
        if key != "params":
            targets = self._targets()
            if targets and key in targets[0]:
                return targets[0][key]
        return self._own[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._own[key] = value
        if key != "params":
            for group in self._targets():
                group[key] = value

    def __delitem__(self, key: str) -> None:
        del self._own[key]
        if key != "params":
            for group in self._targets():
                group.pop(key, None)

    def _keys(self) -> list[str]:
        keys = list(self._own)
        targets = self._targets()
        if targets:
            keys += [k for k in targets[0] if k != "params" and k not in self._own]
        return keys

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __repr__(self) -> str:
        shown = {k: self[k] for k in self if k != "params"}
        return f"LinkedParamGroup({shown}, params={len(self._own.get('params', []))})"


def link_client_optimizer(client: torch.optim.Optimizer, optimizer: ZeroOptimizer) -> None:
    """Make ``client.param_groups`` show and set the hyperparameters of ``optimizer``'s groups
    (idempotent; call again after ``optimizer.load_state_dict``, which replaces its groups).

    Args:
        client: the optimizer passed to ``initialize``; flatzero's groups were built from its
            ``param_groups`` in order.
        optimizer: flatzero's ``ZeroOptimizer``.
    """
    groups = []
    for index, group in enumerate(client.param_groups):
        own = group._own if isinstance(group, LinkedParamGroup) else group
        groups.append(LinkedParamGroup(optimizer, index, own))
    client.param_groups = groups
