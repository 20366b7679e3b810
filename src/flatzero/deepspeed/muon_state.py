"""DeepSpeed 0.19.8's ZeRO-1/2 Muon state: param order and momentum, both ways.

[Note: DeepSpeed's Muon momentum in a ZeRO-1/2 checkpoint]
DeepSpeed's ``Muon`` config builds ``MuonWithAuxAdam``, which sorts the params of each Muon
group (``use_muon``) by ``size()``, largest first (a stable sort of the group's order),
before ZeRO flattens them: that is the group's flat order (``param_shapes``). ZeRO-1/2
(``stage_1_and_2._muon_momentum_buffer``) keeps one ``momentum_buffer`` per Muon group and
rank in the base optimizer's state of the rank's flat partition, but not the partition's
length: it is the *whole* momentum of every param with an element in the rank's partition
(``params_in_partition``), concatenated in flat order, because each rank orthogonalizes
every matrix its partition touches whole. A matrix split between two ranks has its whole
momentum in both files (the same values: both update it from the same reduced gradient).
The rigid (default) checkpoint saves that state as it is, and its load hands it back to
``Optimizer.load_state_dict`` unchecked, so it holds only at the world size it was written
for, which is the export's. The Adam groups keep DeepSpeed's Adam format (``exp_avg``,
``exp_avg_sq`` of the partition, ``step``). With optimizer offload DeepSpeed keeps the
momentum per partition instead (``_apply_muon_updates_cpu_offload``); flatzero trains Muon
without offload, and the export refuses a config with both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..layout import GroupLayout, ParamSpec, ShardPiece

__all__ = [
    "MOMENTUM",
    "is_muon_group",
    "momentum_length",
    "momentum_pieces",
    "momentum_to_partition",
    "muon_order",
]

MOMENTUM = "momentum_buffer"
"""The state name of Muon's momentum (DeepSpeed's, flatzero's and torch's)."""


def is_muon_group(hyperparams: Mapping[str, Any]) -> bool:
    """Whether a param group (its hyperparameters) is a Muon half (``use_muon`` true)."""
    return bool(hyperparams.get("use_muon", False))


def muon_order(specs: Sequence[ParamSpec]) -> list[ParamSpec]:
    """A Muon group's params in ``MuonWithAuxAdam``'s order: by shape, largest first, a
    stable sort of ``specs`` (torch's ``sorted(params, key=size, reverse=True)``)."""
    return sorted(specs, key=lambda s: tuple(s.shape), reverse=True)


def momentum_pieces(group: GroupLayout, rank: int) -> list[ShardPiece]:
    """The pieces of the params with an element in ``rank``'s partition of DeepSpeed's
    flat ``group``, in flat order: whose whole momentum that rank's file holds."""
    return [p for p in group.shard_pieces(rank) if p.numel > 0]


def momentum_length(group: GroupLayout, rank: int) -> int:
    """Elements of ``rank``'s ``momentum_buffer`` of a Muon ``group`` in DeepSpeed's file."""
    return sum(group.slots[p.slot].numel for p in momentum_pieces(group, rank))


def momentum_to_partition(group: GroupLayout, rank: int, whole: torch.Tensor) -> torch.Tensor:
    """``rank``'s momentum in DeepSpeed's file (whole params concatenated) as a tensor of
    the partition's length: each param's elements where its piece of the partition lies,
    zero in the padding.

    Raises:
        ValueError: ``whole`` is not as long as the params it should hold.
    """
    flat = whole.reshape(-1)
    pieces = momentum_pieces(group, rank)
    expected = sum(group.slots[p.slot].numel for p in pieces)
    if flat.numel() != expected:
        raise ValueError(
            f"rank {rank}'s Muon momentum_buffer has {flat.numel()} elements; the whole "
            f"params of its partition have {expected}: the checkpoint was not written by "
            "DeepSpeed 0.19.8's ZeRO-1/2 Muon without optimizer offload"
        )
    out = torch.zeros(group.shard_numel, dtype=flat.dtype)
    start = 0
    for piece in pieces:
        begin = start + piece.param_start
        out[piece.shard_start : piece.shard_start + piece.numel] = flat[begin : begin + piece.numel]
        start += group.slots[piece.slot].numel
    return out
