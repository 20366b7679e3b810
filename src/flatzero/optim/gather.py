"""Full fp32 master values of params, gathered from every rank's master shard."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..comm import all_gather_into
from ..flatten import FlatParams

__all__ = ["full_param", "full_params"]


def _locate(flat: FlatParams, name: str) -> tuple[int, int]:
    """``(group, slot)`` of the flattened param ``name``; ``ValueError`` if there is none."""
    for gi, group in enumerate(flat.groups):
        if name in group.names:
            return gi, group.names.index(name)
    raise ValueError(
        f"no trainable flattened param is named {name!r} (frozen params and second "
        "names of tied params are not flattened); known names: "
        + ", ".join(n for g in flat.groups for n in g.names[:8])
        + ", ..."
    )


def _gather_bucket(flat: FlatParams, gi: int, bucket: int) -> torch.Tensor:
    """Bucket ``bucket`` of group ``gi`` in fp32, from every rank's master shard."""
    group = flat.groups[gi]
    full = torch.empty(group.layout.buckets[bucket].numel, dtype=torch.float32, device=group.device)
    all_gather_into(full, group.master_slice(bucket), flat.process_group)
    return full


@torch.no_grad()
def full_param(flat: FlatParams, name: str) -> torch.Tensor:
    """The fp32 master value of param ``name`` (a new tensor shaped like the param).
    Collective: every rank calls it with the same name."""
    gi, slot_index = _locate(flat, name)
    slot = flat.groups[gi].layout.slots[slot_index]
    full = _gather_bucket(flat, gi, slot.bucket)
    return full[slot.offset : slot.end].view(slot.spec.shape).clone()


@torch.no_grad()
def full_params(flat: FlatParams, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """``{name: fp32 master value}`` of ``names`` (default: every flattened param),
    gathering each bucket once. Collective: every rank calls it with the same names."""
    wanted = set(flat.named_params()) if names is None else set(names)
    for name in wanted:
        _locate(flat, name)
    out: dict[str, torch.Tensor] = {}
    for gi, group in enumerate(flat.groups):
        for b in range(len(group.buckets)):
            members = [
                (group.names[i], group.layout.slots[i])
                for i in group.layout.buckets[b].slots
                if group.names[i] in wanted
            ]
            if not members:
                continue
            full = _gather_bucket(flat, gi, b)
            for name, slot in members:
                out[name] = full[slot.offset : slot.end].view(slot.spec.shape).clone()
    return out
