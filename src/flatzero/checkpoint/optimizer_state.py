"""Between ``ShardedOptimizerState`` and the checkpoint format: the one reader and writer.

Writing (``capture``): per layout group, the fp32 master shard and every per-element
state of the inner optimizer (tensors with the shard's length: ``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``, ...) go into the rank file as ``g<i>.<state>``; the
rest (``step``, the group's hyperparameters, the loss scaler, the bucket order, the stage)
is the same on every rank and goes into ``meta.json``. Reading (``restored_state``): the
new shards read for this rank's layout and the saved scalar state become the state the
optimizer loads (``ZeroOptimizer.load_sharded_state``), which checks it and updates the
params.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..optim.state import GroupState, ShardedOptimizerState
from .format import MASTER, CheckpointMeta, GroupRecord, decode_value, encode_value, state_key

__all__ = [
    "CapturedState",
    "capture",
    "check_same_optimizer",
    "merge_group_records",
    "restored_state",
    "saved_step",
]

logger = logging.getLogger(__name__)

_SKIPPED_HYPERPARAMS = ("params", "param_names")


@dataclass(frozen=True)
class CapturedState:
    """This rank's optimizer state, split for the checkpoint format (tensors are
    references, nothing copied).

    Attributes:
        tensors: ``(tensor name in the rank file, 1-D shard)``: per group its master,
            then its per-element states.
        groups: per layout group, its state names, scalar state and hyperparameters,
            encoded for ``meta.json``.
        state: the state it was split from.
    """

    tensors: list[tuple[str, torch.Tensor]]
    groups: tuple[GroupRecord, ...]
    state: ShardedOptimizerState

    def meta(self, **fields: Any) -> CheckpointMeta:
        """The ``CheckpointMeta`` of a save of this state; ``fields`` are the rest (tag,
        layout, files, scheduler, ...)."""
        state = self.state
        order, scaler = state.bucket_order, state.loss_scaler
        return CheckpointMeta(
            groups=self.groups,
            optimizer=state.optimizer,
            stage=state.stage,
            loss_scaler=dict(scaler) if scaler is not None else None,
            bucket_order=list(order) if order is not None else None,
            **fields,
        )


def _group_record(group: GroupState, gi: int) -> GroupRecord:
    """Group ``gi``'s record for ``meta.json``.

    Raises:
        ValueError: a per-element state whose length is not the shard's (an optimizer that
            is not elementwise), or one named ``master``.
        TypeError: a scalar state or hyperparameter that JSON cannot hold.
    """
    numel = group.master.numel()
    for name, value in group.shards.items():
        where = f"optimizer state {name!r} of group {gi}"
        if value.numel() != numel:
            raise ValueError(
                f"{where} has {value.numel()} elements but the shard has {numel}; only "
                "per-element state can be sharded"
            )
        if name == MASTER:
            raise ValueError(f"{where} is named {MASTER!r}, which is reserved")
    scalars = {
        name: encode_value(value, f"optimizer state {name!r} of group {gi}")
        for name, value in group.scalars.items()
    }
    hyper = {
        k: encode_value(v, f"hyperparameter {k!r} of group {gi}")
        for k, v in group.options.items()
        if k not in _SKIPPED_HYPERPARAMS
    }
    return GroupRecord((MASTER, *group.shards), scalars, hyper)


def capture(state: ShardedOptimizerState) -> CapturedState:
    """Split ``state`` into rank-file tensors and ``meta.json`` records (no copy).

    Raises:
        ValueError / TypeError: a state the checkpoint format cannot hold (named).
    """
    records = tuple(_group_record(g, gi) for gi, g in enumerate(state.groups))
    tensors: list[tuple[str, torch.Tensor]] = []
    for gi, group in enumerate(state.groups):
        tensors.append((state_key(gi, MASTER), group.master.detach().reshape(-1)))
        tensors += [
            (state_key(gi, name), value.detach().reshape(-1))
            for name, value in group.shards.items()
        ]
    return CapturedState(tensors, records, state)


def saved_step(records: Sequence[GroupRecord]) -> int | None:
    """The inner optimizer's ``step`` of the first saved group that has one, else None."""
    for record in records:
        if "step" in record.scalars:
            value = decode_value(record.scalars["step"])
            return int(value.item() if isinstance(value, torch.Tensor) else value)
    return None


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


def _restored_group(
    live: GroupState,
    master: torch.Tensor,
    shards: dict[str, torch.Tensor],
    record: GroupRecord | None,
) -> GroupState:
    """Group state from its new shards and its saved record (None: none saved)."""
    options = dict(live.options)
    state: dict[str, Any] = {}
    if record is not None:
        for k, v in record.hyperparams.items():
            options[k] = _like(decode_value(v), live.options.get(k))
        state.update({k: decode_value(v) for k, v in record.scalars.items()})
    state.update(shards)
    return GroupState(master, state, options)


def check_same_optimizer(saved: str | None, live: str | None) -> None:
    """Raise ``ValueError`` when the checkpoint's optimizer state is another optimizer
    class's (an AdamW state would give an SGD group ``betas``); None on either side (a
    state dict, an older checkpoint) is not checked."""
    if saved is None or live is None or saved == live:
        return
    raise ValueError(
        f"the checkpoint holds {saved} optimizer state and this optimizer is {live}: "
        f"configure {saved}, or load the weights only (load_optimizer_states=False, or "
        "load_module_only=True on the engine)"
    )


def restored_state(
    current: ShardedOptimizerState,
    meta: CheckpointMeta,
    masters: Sequence[torch.Tensor],
    shards: Sequence[dict[str, torch.Tensor]],
    records: Sequence[GroupRecord | None],
    *,
    load_optimizer_states: bool = True,
) -> ShardedOptimizerState:
    """The state to load into the optimizer whose state is ``current`` (its own layout).

    Args:
        current: the optimizer's ``sharded_state()``.
        meta: the checkpoint's metadata (loss scaler, bucket order, layout).
        masters: per group, this rank's new master shard.
        shards: per group, this rank's new per-element state shards by name.
        records: per group, the saved scalar state and hyperparameters (None: none saved).
        load_optimizer_states: False keeps the current inner state, hyperparameters and
            loss scaler (masters only).
    """
    if load_optimizer_states:
        check_same_optimizer(meta.optimizer, current.optimizer)
    # The learned bucket order is reused only by the layout it was learned for; else the
    # optimizer learns its own at the next step.
    order = meta.bucket_order if meta.layout.digest() == current.layout_digest else None
    bucket_order = tuple(order) if order is not None else None
    if not load_optimizer_states:
        groups = tuple(
            dataclasses.replace(g, master=m) for g, m in zip(current.groups, masters, strict=True)
        )
        return dataclasses.replace(current, groups=groups, bucket_order=bucket_order)
    groups = tuple(
        _restored_group(*args)
        for args in zip(current.groups, masters, shards, records, strict=True)
    )
    loss_scaler = current.loss_scaler
    if meta.loss_scaler is not None and current.loss_scaler is not None:
        loss_scaler = meta.loss_scaler
    elif meta.loss_scaler is not None:
        logger.warning("the checkpoint has a loss scaler state; this optimizer has no scaler")
    return dataclasses.replace(
        current, groups=groups, loss_scaler=loss_scaler, bucket_order=bucket_order
    )
