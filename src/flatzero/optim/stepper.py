"""Where the inner optimizer steps: one seam, a device and a host-offload implementation.

``ZeroOptimizer.step()`` calls a ``ShardStepper`` at three points and never asks which one
it holds: after backward (``after_backward``: reduced gradients start moving to where the
step reads them), the step itself (``step``), and writing the master shards back into the
buckets (``write_back``). ``DeviceStepper`` steps beside the buckets; ``offload.HostOffload``
steps in host memory (ZeRO-Offload, ``ZeroConfig.offload_optimizer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..comm import all_gather_buckets_from_own_slices
from ..cores import core_share
from ..flatten.buffers import FlatParams
from ..own_groups import collective_group, control_group
from ..roll_call import GATHERING, raise_naming_ranks
from .config import OffloadConfig
from .inner import scale_grads, step_with_grad_scale
from .offload import HOST, HostOffload, OffloadHostBytes

__all__ = ["DeviceStepper", "ShardStepper", "make_stepper", "masters_to_host"]


class ShardStepper(Protocol):
    """The inner optimizer's side of a ``ZeroOptimizer`` step.

    Attributes:
        step_grads: per group, the fp32 gradient shard the inner optimizer reads.
        step_device: where the inner optimizer steps (its fused kernel is chosen for it).
    """

    step_grads: list[torch.Tensor]
    step_device: torch.device

    @property
    def chunk_hook(self) -> Callable[[int, bool], None] | None:
        """What the reducer calls when a chunk of a bucket's gradient shard landed
        (``GradReducer.on_chunk_landed``), or None."""
        ...

    def describe(self) -> str:
        """A suffix for the optimizer's log line ("" when there is nothing to say)."""
        ...

    def after_backward(self) -> None:
        """The gradients are reduced: start moving them to where the step reads them."""
        ...

    def abandon(self) -> None:
        """The step is skipped: wait for whatever still reads the gradient shards."""
        ...

    def step(self, inner: torch.optim.Optimizer, coef: float | torch.Tensor) -> None:
        """Step ``inner`` over the master shards, the gradients times ``coef``."""
        ...

    def write_back(self, masters: Sequence[torch.Tensor]) -> None:
        """Cast ``masters`` into this rank's bucket slices; all-gather every bucket."""
        ...

    def host_bytes(
        self, inner: torch.optim.Optimizer, masters: Sequence[torch.Tensor]
    ) -> OffloadHostBytes | None:
        """Host bytes of optimizer offload held now; None without offload."""
        ...


class DeviceStepper:
    """The inner optimizer steps beside the buckets: on the gradient shards the reductions
    write, the master slices all-gathered straight into the buckets.

    Args:
        flat: the flattened params, with master shards beside the buckets.
        grads: per group, the fp32 gradient shard the reductions write.
    """

    chunk_hook = None

    def __init__(self, flat: FlatParams, grads: list[torch.Tensor]) -> None:
        self.step_grads = grads
        self.step_device = flat.groups[0].device
        pairs = [(g, b) for g in flat.groups for b in range(len(g.buckets))]
        self._pg = collective_group(flat.process_group)
        self._buckets = [g.buckets[b] for g, b in pairs]
        self._bucket_shards = [g.bucket_shard(b) for g, b in pairs]
        self._master_slices = [g.master_slice(b) for g, b in pairs]

    def describe(self) -> str:
        return ""

    def after_backward(self) -> None:
        pass

    def abandon(self) -> None:
        pass

    def step(self, inner: torch.optim.Optimizer, coef: float | torch.Tensor) -> None:
        step_with_grad_scale(inner, scale_grads(inner, self.step_grads, coef))

    def write_back(self, masters: Sequence[torch.Tensor]) -> None:
        try:
            all_gather_buckets_from_own_slices(
                self._buckets, self._bucket_shards, self._pg, sources=self._master_slices
            )
        except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
            raise_naming_ranks(error, self._pg, GATHERING)

    def host_bytes(
        self, inner: torch.optim.Optimizer, masters: Sequence[torch.Tensor]
    ) -> OffloadHostBytes | None:
        return None


def masters_to_host(flat: FlatParams) -> None:
    """Move master shards built on the device (``FlatParams`` flattened without
    ``FlattenConfig.master_on_host``) to host memory, for optimizer offload."""
    for group in flat.groups:
        if group.master is not None and group.master.device.type != "cpu":
            group.master = group.master.to(HOST)


def make_stepper(
    flat: FlatParams, grads: list[torch.Tensor], offload: OffloadConfig | None
) -> ShardStepper:
    """The stepper of ``offload``: ``HostOffload`` (master shards already in host memory,
    ``masters_to_host``; threads: ``offload.threads`` or the rank's core share), else
    ``DeviceStepper``."""
    if offload is None:
        return DeviceStepper(flat, grads)
    threads = offload.threads or core_share(control_group(flat.deciders)).threads
    return HostOffload(flat, grads, offload, threads)
