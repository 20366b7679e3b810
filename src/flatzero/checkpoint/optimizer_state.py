"""Between ``ZeroOptimizer`` and the checkpoint format: what is sharded, what is scalar.

A ``ZeroOptimizer`` (or anything with the same face: ``flat``, ``state_dict()``,
``load_state_dict()``, ``param_groups``) is saved through its own ``state_dict()``: per
layout group, the fp32 master shard and every per-element state of the inner optimizer
(tensors with the shard's length: ``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``, ...)
are sharded tensors; the rest (``step``, the group's hyperparameters) is scalar and the
same on every rank. Loading builds a state dict of the same form for the optimizer's own
layout and hands it to ``load_state_dict``, which checks it and updates the params.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .format import MASTER, GroupRecord, decode_value, encode_value

__all__ = ["CapturedState", "build_state_dict", "capture_optimizer", "merge_group_records"]

logger = logging.getLogger(__name__)

_SKIPPED_HYPERPARAMS = ("params", "param_names")


@dataclass
class CapturedState:
    """This rank's optimizer state, split for the checkpoint format.

    Attributes:
        tensors: per layout group, ``(state name, 1-D shard)`` pairs, ``master`` first.
        groups: per layout group, its scalar state and hyperparameters.
        loss_scaler: the loss scaler's state, or None.
        optimizer: the inner optimizer's class name.
        stage: the ZeRO stage.
        bucket_order: the optimizer's bucket launch order, or None.
    """

    tensors: list[list[tuple[str, torch.Tensor]]]
    groups: list[GroupRecord]
    loss_scaler: dict[str, Any] | None
    optimizer: str
    stage: int | None
    bucket_order: list[int] | None = None

    @property
    def step(self) -> int | None:
        """The inner optimizer's ``step`` of the first group, when it has one."""
        for g in self.groups:
            if "step" in g.scalars:
                value = decode_value(g.scalars["step"])
                return int(value.item() if isinstance(value, torch.Tensor) else value)
        return None


def capture_optimizer(optimizer: Any) -> CapturedState:
    """Split ``optimizer.state_dict()`` into sharded tensors and scalar records (no copy).

    Raises:
        ValueError: a per-element state whose length is not the shard's (an optimizer that
            is not elementwise), or a scalar state that JSON cannot hold.
    """
    sd = optimizer.state_dict()
    layout = optimizer.flat.layout
    inner = sd["optimizer"]
    tensors: list[list[tuple[str, torch.Tensor]]] = []
    groups: list[GroupRecord] = []
    for gi, gl in enumerate(layout.groups):
        master = sd["master"][gi].detach()
        pairs = [(MASTER, master.reshape(-1))]
        scalars: dict[str, Any] = {}
        for name, value in inner["state"].get(gi, {}).items():
            where = f"optimizer state {name!r} of group {gi}"
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                if value.numel() != gl.shard_numel:
                    raise ValueError(
                        f"{where} has {value.numel()} elements but the shard has "
                        f"{gl.shard_numel}; only per-element state can be sharded"
                    )
                if name == MASTER:
                    raise ValueError(f"{where} is named {MASTER!r}, which is reserved")
                pairs.append((name, value.detach().reshape(-1)))
            else:
                scalars[name] = encode_value(value, where)
        hyper = {
            k: encode_value(v, f"hyperparameter {k!r} of group {gi}")
            for k, v in inner["param_groups"][gi].items()
            if k not in _SKIPPED_HYPERPARAMS
        }
        tensors.append(pairs)
        groups.append(GroupRecord(tuple(n for n, _ in pairs), scalars, hyper))
    inner_cls = type(getattr(optimizer, "inner", optimizer)).__name__
    order = sd.get("bucket_order")
    return CapturedState(
        tensors,
        groups,
        sd.get("loss_scaler"),
        inner_cls,
        sd.get("stage"),
        [int(i) for i in order] if order is not None else None,
    )


def merge_group_records(
    records: Sequence[GroupRecord], sources: Sequence[int], new_group: int, where: str
) -> GroupRecord | None:
    """The saved record for a new group whose params come from saved groups ``sources``.

    ``None`` when there are none. Scalar state and per-element state names must agree
    between the sources (else ``ValueError``); hyperparameters that differ are dropped
    (the new group keeps its own) with a warning.
    """
    if not sources:
        return None
    first = records[sources[0]]
    for s in sources[1:]:
        other = records[s]
        if other.scalars != first.scalars or other.states != first.states:
            raise ValueError(
                f"new optimizer group {new_group} takes params from saved groups {list(sources)}"
                f" of {where}, whose optimizer states differ (e.g. 'step' "
                f"{first.scalars.get('step')} vs {other.scalars.get('step')}); group the "
                "params as they were when saved"
            )
    hyper = first.hyperparams
    if any(records[s].hyperparams != hyper for s in sources[1:]):
        logger.warning(
            "new optimizer group %d takes params from saved groups %s with different "
            "hyperparameters; it keeps its own",
            new_group,
            list(sources),
        )
        hyper = {}
    return GroupRecord(first.states, first.scalars, hyper)


def _like(saved: Any, live: Any) -> Any:
    """``saved`` with lists turned into tuples where the live value is a tuple."""
    if isinstance(live, tuple) and isinstance(saved, list):
        return tuple(saved)
    return saved


def build_state_dict(
    optimizer: Any,
    masters: Sequence[torch.Tensor],
    states: Sequence[dict[str, torch.Tensor]],
    records: Sequence[GroupRecord | None],
    loss_scaler: dict[str, Any] | None,
    *,
    bucket_order: list[int] | None = None,
    load_optimizer_states: bool = True,
) -> dict[str, Any]:
    """A state dict in ``optimizer.state_dict()``'s form, for the optimizer's own layout.

    Args:
        masters: per group, this rank's new master shard.
        states: per group, this rank's new per-element state shards by name.
        records: per group, the saved scalar state and hyperparameters (None: none saved).
        loss_scaler: the saved loss scaler state (None keeps the current one).
        bucket_order: the saved bucket launch order when the layout is the same, else None
            (the optimizer then learns its own at the next step).
        load_optimizer_states: False keeps the current inner state, hyperparameters and
            loss scaler (masters only).
    """
    current = optimizer.state_dict()
    out = dict(current)
    out["master"] = list(masters)
    if "bucket_order" in out:
        out["bucket_order"] = bucket_order
    if not load_optimizer_states:
        return out
    inner_state: dict[int, dict[str, Any]] = {}
    param_groups = []
    for gi, live in enumerate(current["optimizer"]["param_groups"]):
        group = dict(live)
        record = records[gi]
        state: dict[str, Any] = {}
        if record is not None:
            for k, v in record.hyperparams.items():
                group[k] = _like(decode_value(v), live.get(k))
            state.update({k: decode_value(v) for k, v in record.scalars.items()})
        state.update(states[gi])
        if state:
            inner_state[gi] = state
        param_groups.append(group)
    out["optimizer"] = {"state": inner_state, "param_groups": param_groups}
    if loss_scaler is not None and current.get("loss_scaler") is not None:
        out["loss_scaler"] = loss_scaler
    elif loss_scaler is not None:
        logger.warning("the checkpoint has a loss scaler state; this optimizer has no scaler")
    return out
