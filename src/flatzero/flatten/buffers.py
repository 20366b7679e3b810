"""The result of flattening: bucket buffers, params as views of them, master shards."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..layout import GroupLayout, Layout
from ..report import InitReport

__all__ = ["FlatGroup", "FlatParams", "shaped_view"]


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def shaped_view(flat: torch.Tensor, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Elements ``[offset, offset + prod(shape))`` of the 1-D contiguous ``flat``, as a
    contiguous tensor of ``shape``: one ``as_strided`` (a slice plus a ``view`` costs two
    ops, which adds up over the thousands of params of an unfused MoE)."""
    return flat.as_strided(shape, _contiguous_strides(shape), flat.storage_offset() + offset)


@dataclass
class FlatGroup:
    """One (param group, dtype) pair after flattening.

    Attributes:
        layout: its layout.
        names: param names, in slot (layout) order.
        params: the params, in slot order; each one's ``.data`` is a view of its bucket.
        buckets: one 1-D buffer per bucket, of the params' dtype.
        options: the user's hyperparameters for this group (``lr``, ``weight_decay``, ...).
        master: this rank's fp32 shard (``layout.shard_numel`` elements), or None when
            ``FlattenConfig.build_master`` is off.
        rank: this rank.
    """

    layout: GroupLayout
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    buckets: list[torch.Tensor]
    options: dict[str, Any]
    master: torch.Tensor | None
    rank: int

    @property
    def dtype(self) -> torch.dtype:
        """The params' dtype."""
        return self.buckets[0].dtype

    @property
    def device(self) -> torch.device:
        """Device of the first bucket."""
        return self.buckets[0].device

    def bucket_shard(self, bucket: int) -> torch.Tensor:
        """This rank's slice of bucket ``bucket`` (a view)."""
        lo, hi = self.layout.buckets[bucket].rank_range(self.rank)
        return self.buckets[bucket][lo:hi]

    def master_slice(self, bucket: int) -> torch.Tensor:
        """The part of the master shard that mirrors bucket ``bucket`` (a view)."""
        if self.master is None:
            raise RuntimeError("no master shard was built (FlattenConfig.build_master=False)")
        b = self.layout.buckets[bucket]
        return self.master[b.shard_offset : b.shard_offset + b.slice_numel]

    def param_view(self, slot: int) -> torch.Tensor:
        """The bucket elements of param ``slot``, shaped like the param."""
        s = self.layout.slots[slot]
        return shaped_view(self.buckets[s.bucket], s.offset, s.spec.shape)


@dataclass
class FlatParams:
    """Everything ``flatten_parameters`` built, for the optimizer to use.

    Attributes:
        layout: the layout of every (param group, dtype) pair.
        groups: one ``FlatGroup`` per entry of ``layout.groups``.
        report: the init report.
        process_group: the process group the layout is sharded over (None: default / none).
        rank: this rank.
        world_size: number of ranks.
        frozen: params with ``requires_grad=False``; left exactly as they were.
        agreement_group: the ranks that decide together (``flatten_parameters``'s
            ``agreement_group``); None: ``process_group``.
    """

    layout: Layout
    groups: list[FlatGroup]
    report: InitReport
    process_group: dist.ProcessGroup | None
    rank: int
    world_size: int
    frozen: list[nn.Parameter] = field(default_factory=list)
    agreement_group: dist.ProcessGroup | None = None
    _state_fences: list[Callable[[], None]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )
    _param_waiters: list[Callable[[], None]] = field(
        default_factory=list, init=False, repr=False, compare=False
    )

    def wait_params_with(self, waiter: Callable[[], None]) -> None:
        """Register ``waiter``: it waits for every outstanding write into the buckets (an
        optimizer's parameter all-gathers left running past ``step()``)."""
        self._param_waiters.append(waiter)

    def wait_for_params(self) -> None:
        """Wait until the buckets hold their values: run every registered waiter."""
        for waiter in self._param_waiters:
            waiter()

    def hold_state_until(self, fence: Callable[[], None]) -> None:
        """Run ``fence()`` once, before the master shards (or the state of an optimizer
        over them) next change: an optimizer's inner step, a load. For a reader that
        copies them in the background (an asynchronous save's snapshot,
        ``checkpoint.async_save``): the fence returns once the copy has what it needs; the
        forward and backward passes before it run meanwhile."""
        self._state_fences.append(fence)

    def before_state_changes(self) -> None:
        """Run the fences ``hold_state_until`` registered (call it before changing the
        master shards or the optimizer state; a fence that raises keeps the later ones).
        Waits for the params first (``wait_for_params``)."""
        self.wait_for_params()
        while self._state_fences:
            self._state_fences.pop(0)()

    @property
    def deciders(self) -> dist.ProcessGroup | None:
        """The group every rank-wide decision about these buffers is taken over."""
        return self.process_group if self.agreement_group is None else self.agreement_group

    def named_params(self) -> dict[str, nn.Parameter]:
        """Every flattened param by name."""
        return {n: p for g in self.groups for n, p in zip(g.names, g.params, strict=True)}
