"""The process-group backend of the emulated device: gloo on CPU aliases of its bytes."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .state import require
from .storage import cpu_alias
from .streams import before_op

__all__ = ["GlooOverAliases"]


def _aliases(x: Any) -> Any:
    name = require().name

    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.device.type == name:
            return cpu_alias(t)
        return t

    if isinstance(x, (list, tuple)):
        return type(x)(_aliases(v) for v in x)
    return one(x)


class GlooOverAliases(dist.ProcessGroup):
    """A process group for emulated (and host) tensors: gloo on CPU aliases of their bytes.

    torch lets a Python backend be a ``ProcessGroup`` only (``c10d.Backend`` has no Python
    constructor), and such a group replaces the whole group of ``init_process_group`` for
    every device of its backend string, so it serves host tensors too (passed through).
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return require().backend_name

    def _forward(self, method: str, *args):
        """Run gloo's ``method`` on CPU aliases and wait for it: the aliases do not own
        their bytes, so the work must finish while the caller's tensors are alive (an
        emulated collective is synchronous, like every emulated op)."""
        if not require().host_collectives:
            _refuse_host_tensors(method, args)
        before_op()  # NCCL's stream waits for the current stream
        work = getattr(self._gloo, method)(*(_aliases(a) for a in args))
        work.wait()
        return work

    def allreduce(self, tensors, opts=None):
        return self._forward("allreduce", tensors, *_opt(opts))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._forward("allreduce_coalesced", tensors, *_opt(opts))

    def allgather(self, output_lists, inputs, opts=None):
        return self._forward("allgather", output_lists, inputs, *_opt(opts))

    def _allgather_base(self, output, input, opts=None):
        return self._forward("_allgather_base", output, input, *_opt(opts))

    def all_gather_single(self, output, input, opts=None):
        return self._forward("_allgather_base", output, input, *_opt(opts))

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._forward("allgather_into_tensor_coalesced", outputs, inputs, *_opt(opts))

    def reduce_scatter_single(self, output, input, opts=None):
        return self._forward("_reduce_scatter_base", output, input, *_opt(opts))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._forward("reduce_scatter_tensor_coalesced", outputs, inputs, *_opt(opts))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._forward("allgather_into_tensor_coalesced", outputs, inputs, *_opt(opts))

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._forward("reduce_scatter", outputs, input_lists, *_opt(opts))

    def _reduce_scatter_base(self, output, input, opts=None):
        return self._forward("_reduce_scatter_base", output, input, *_opt(opts))

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._forward("reduce_scatter_tensor_coalesced", outputs, inputs, *_opt(opts))

    def broadcast(self, tensors, opts=None):
        return self._forward("broadcast", tensors, *_opt(opts))

    def reduce(self, tensors, opts=None):
        return self._forward("reduce", tensors, *_opt(opts))

    def gather(self, output_lists, inputs, opts=None):
        return self._forward("gather", output_lists, inputs, *_opt(opts))

    def scatter(self, outputs, input_lists, opts=None):
        return self._forward("scatter", outputs, input_lists, *_opt(opts))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._forward(
            "alltoall_base", output, input, output_split_sizes, input_split_sizes, *_opt(opts)
        )

    def barrier(self, opts=None):
        return self._gloo.barrier(*_opt(opts))

    def send(self, tensors, dst: int, tag: int):
        return self._forward("send", tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int):
        return self._forward("recv", tensors, src, tag)


def _refuse_host_tensors(method: str, args: tuple) -> None:
    """As NCCL does: a collective on a host tensor is an error, not a silent host path."""
    flat: list[Any] = []
    for a in args:
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    for t in flat:
        nested = t if isinstance(t, (list, tuple)) else [t]
        for x in nested:
            if isinstance(x, torch.Tensor) and x.device.type == "cpu":
                raise RuntimeError(
                    f"{require().backend_name} {method}: tensors must be on "
                    f"{require().name}, got a host tensor (emulating a device-only backend)"
                )


def _opt(opts) -> tuple:
    return () if opts is None else (opts,)
