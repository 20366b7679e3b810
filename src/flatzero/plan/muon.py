"""Muon in a plan: which params it steps whole, and how evenly their owners share the work.

``flatzero plan --optimizer muon`` lays the model out as the DeepSpeed door runs DeepSpeed's
``Muon`` config: every param group splits into a Muon half (DeepSpeed's rule,
``deepspeed.engine.muon_groups.uses_muon``: 2+ dims, no ``embed`` nor ``lm_head`` in the
name), laid out whole-params (``flatzero.owners``), then an AdamW half in flat slices.
``muon_balance`` reads from that layout which rank owns each matrix, so its figures are the
owners layout's own, not a re-estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..deepspeed.engine.muon_groups import uses_muon
from ..layout import Layout, ParamSpec
from ..owners import newton_schulz_cost
from ..params import collect_param_groups
from .model_source import ModelSource, group_dicts, meta_model

__all__ = ["MuonBalance", "muon_balance", "muon_param_groups"]


def muon_param_groups(
    source: ModelSource, dtype: str, grouping: str = "one"
) -> tuple[list[list[ParamSpec]], tuple[int, ...]]:
    """The model's param groups as the Muon optimizer splits them, and which are Muon's.

    Each group of ``grouping`` (``model_source.group_dicts``) becomes its Muon half then its
    AdamW half, an empty half left out (DeepSpeed's ``muon-params`` / ``adam-params``).

    Returns:
        The groups' param specs (tied params once) and the indices of the Muon halves (for
        ``plan_layout(whole_params=...)``).
    """
    halves: list[dict] = []
    whole: list[int] = []
    for group in group_dicts(meta_model(source, dtype), grouping):
        for use_muon in (True, False):
            half = [(n, p) for n, p in group["params"] if uses_muon(n, p) is use_muon]
            if half:
                if use_muon:
                    whole.append(len(halves))
                halves.append({"params": half})
    return [g.specs() for g in collect_param_groups(halves)], tuple(whole)


@dataclass(frozen=True)
class MuonBalance:
    """How the whole-params groups of a layout share Muon's work and memory over the ranks.

    Attributes:
        matrices: params stepped whole (each by one owner rank, once per step).
        costs: per rank, the Newton-Schulz cost of the matrices it owns
            (``owners.newton_schulz_cost`` summed: multiply-adds of one iteration).
        owned_numel: per rank, the elements of the matrices it owns.
        shard_numel: elements of every rank's shard of these groups: the fp32 master,
            gradient and momentum shards each hold this many (the same on every rank: each
            rank's slice of a bucket is as long as the fullest rank's part).
        padding_numel: the padding of these groups over all ranks (elements).
    """

    matrices: int
    costs: tuple[int, ...]
    owned_numel: tuple[int, ...]
    shard_numel: int
    padding_numel: int

    @property
    def balance(self) -> float:
        """The busiest rank's Newton-Schulz cost over the mean (1.0: perfectly even)."""
        mean = sum(self.costs) / len(self.costs)
        return max(self.costs) / mean if mean else 1.0

    @property
    def busiest_rank(self) -> int:
        """The rank with the most Newton-Schulz work (the lowest such)."""
        return self.costs.index(max(self.costs))


def muon_balance(layout: Layout) -> MuonBalance | None:
    """The ``MuonBalance`` of ``layout``'s whole-params groups; None without any.

    Each matrix's owner is the rank whose shard holds it (``GroupLayout.param_pieces``: one
    piece per param in a whole-params group)."""
    groups = [g for g in layout.groups if g.whole]
    if not groups:
        return None
    costs = [0] * layout.world_size
    owned = [0] * layout.world_size
    matrices = 0
    for group in groups:
        for index, slot in enumerate(group.slots):
            pieces = group.param_pieces(index)
            if not pieces:  # an empty param: nothing to step
                continue
            assert len(pieces) == 1, f"{slot.spec.name} is cut in a whole-params group"
            rank = pieces[0][0]
            costs[rank] += newton_schulz_cost(slot.spec.shape)
            owned[rank] += slot.numel
            matrices += 1
    return MuonBalance(
        matrices=matrices,
        costs=tuple(costs),
        owned_numel=tuple(owned),
        shard_numel=sum(g.shard_numel for g in groups),
        padding_numel=sum(g.padding_numel for g in groups),
    )
