"""Where a bucket's contents come from: the params themselves, in any memory."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..layout import GroupLayout, ShardPiece

__all__ = ["TensorSource"]


class TensorSource:
    """Reads pieces of a group's params from their current tensors (device, host or pinned).

    Args:
        layout: the group's layout.
        tensors: the group's params, in slot order.
    """

    def __init__(self, layout: GroupLayout, tensors: Sequence[torch.Tensor]) -> None:
        self.layout = layout
        self.tensors = list(tensors)

    def rebind(self, slot: int, tensor: torch.Tensor) -> None:
        """Point param ``slot`` at ``tensor`` (same shape; values already copied there)."""
        self.tensors[slot].data = tensor

    def device_of(self, pieces: Sequence[ShardPiece]) -> torch.device | None:
        """Device the pieces are read from (None when there are none)."""
        return self.tensors[pieces[0].slot].device if pieces else None

    def pairs(
        self, pieces: Sequence[ShardPiece], dest: torch.Tensor, dest_start: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(destinations, sources)`` for copying ``pieces`` into ``dest``.

        ``dest`` is a 1-D tensor standing for bucket elements from ``dest_start`` on. A
        piece that covers a whole param is copied with the param's own shape and
        strides (no reshape copy of non-contiguous params).
        """
        dsts, srcs = [], []
        for piece in pieces:
            src = self.tensors[piece.slot].detach()
            start = piece.bucket_start - dest_start
            dst = dest[start : start + piece.numel]
            if piece.param_start == 0 and piece.param_end == src.numel():
                dsts.append(dst.view(src.shape))
                srcs.append(src)
            else:
                dsts.append(dst)
                srcs.append(src.reshape(-1)[piece.param_start : piece.param_end])
        return dsts, srcs

    def copy_into(self, pieces: Sequence[ShardPiece], dest: torch.Tensor, dest_start: int) -> int:
        """Copy ``pieces`` into ``dest`` (see ``pairs``); returns the bytes copied."""
        dsts, srcs = self.pairs(pieces, dest, dest_start)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        return sum(d.numel() for d in dsts) * dest.element_size()
