"""Where a bucket's values come from: the params themselves, a safetensors checkpoint, or
nowhere yet (the buckets are allocated and loaded afterwards).

A source also holds the group's params (in slot order) so the flattener can rebind
them once their bucket is complete.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..layout import GroupLayout, ShardPiece
from ..params import rebind_param
from ..storage.index import SafetensorsCheckpoint
from .buffers import shaped_view

__all__ = ["CheckpointSource", "NoValues", "ParamSource", "TensorSource"]


class ParamSource:
    """Base: the group's params in slot order, and how to rebind them."""

    def __init__(self, layout: GroupLayout, params: Sequence[nn.Parameter]) -> None:
        self.layout = layout
        self.params = list(params)

    def rebind_bucket(self, bucket: int, buf: torch.Tensor) -> None:
        """Point every param of ``bucket`` at its view of ``buf``, a complete image of the
        bucket (values already copied there)."""
        slots = self.layout.slots
        for index in self.layout.buckets[bucket].slots:
            slot = slots[index]
            rebind_param(self.params[index], shaped_view(buf, slot.offset, slot.spec.shape))

    def device_of(self, pieces: Sequence[ShardPiece]) -> torch.device | None:
        """Device the pieces are read from (None when there are none)."""
        raise NotImplementedError

    def copy_into(self, pieces: Sequence[ShardPiece], dest: torch.Tensor, dest_start: int) -> int:
        """Copy ``pieces`` into ``dest``, a 1-D tensor standing for bucket elements from
        ``dest_start`` on; returns the bytes copied."""
        raise NotImplementedError


class TensorSource(ParamSource):
    """Reads pieces of a group's params from their current tensors (device, host or pinned)."""

    def device_of(self, pieces: Sequence[ShardPiece]) -> torch.device | None:
        return self.params[pieces[0].slot].device if pieces else None

    def copy_into(self, pieces: Sequence[ShardPiece], dest: torch.Tensor, dest_start: int) -> int:
        """A piece that covers a whole param is copied with the param's own shape and
        strides (no reshape copy of a non-contiguous param)."""
        dsts, srcs = [], []
        slots = self.layout.slots
        for piece in pieces:
            src = self.params[piece.slot].detach()
            start = piece.bucket_start - dest_start
            spec = slots[piece.slot].spec
            if piece.param_start == 0 and piece.param_end == spec.numel:
                dsts.append(shaped_view(dest, start, spec.shape))
                srcs.append(src)
            else:
                dsts.append(dest[start : start + piece.numel])
                srcs.append(src.reshape(-1)[piece.param_start : piece.param_end])
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return sum(d.numel() for d in dsts) * dest.element_size()


class NoValues(ParamSource):
    """Copies nothing: the buckets get storage and the params become views of it, and the
    caller fills every bucket afterwards (``flatten_parameters(allocate_only=True)``)."""

    def device_of(self, pieces: Sequence[ShardPiece]) -> torch.device | None:
        return None

    def copy_into(self, pieces: Sequence[ShardPiece], dest: torch.Tensor, dest_start: int) -> int:
        return 0


class CheckpointSource(ParamSource):
    """Reads pieces of a group's params from a safetensors checkpoint, byte range by range.

    Args:
        layout: the group's layout.
        params: the group's params (typically on the meta device), in slot order.
        checkpoint: the index of the checkpoint's tensors.
        keys: the checkpoint key of each param, in slot order.
    """

    def __init__(
        self,
        layout: GroupLayout,
        params: Sequence[nn.Parameter],
        checkpoint: SafetensorsCheckpoint,
        keys: Sequence[str],
    ) -> None:
        super().__init__(layout, params)
        self.checkpoint = checkpoint
        self.keys = list(keys)

    def device_of(self, pieces: Sequence[ShardPiece]) -> torch.device | None:
        return torch.device("cpu") if pieces else None

    def copy_into(self, pieces: Sequence[ShardPiece], dest: torch.Tensor, dest_start: int) -> int:
        if dest.device.type != "cpu":
            raise ValueError("a checkpoint source reads into host memory only")
        for piece in pieces:
            start = piece.bucket_start - dest_start
            self.checkpoint.read_into(
                self.keys[piece.slot],
                piece.param_start,
                piece.param_end,
                dest[start : start + piece.numel],
            )
        return sum(p.numel for p in pieces) * dest.element_size()
