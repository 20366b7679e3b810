"""Every op the emulated device does not implement by hand: the CPU kernel on CPU aliases."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from .kernels import resize_
from .state import require
from .storage import bind, cpu_alias, to_emulated
from .streams import before_op

__all__ = ["fallback"]

# [Note: ops through one fallback]
# Allocation, copies and ``item()`` are implemented by hand (``kernels``); every other op
# goes through one fallback that runs the CPU kernel on CPU aliases of the same bytes and
# maps the results back: views stay views, in-place stays in-place, ``out=`` is resized as
# needed. Mixing tensors of two devices raises as CUDA does, so placement bugs surface.
# Each op costs ~40x its CPU time.

_MIXED = "Expected all tensors to be on the same device, but found at least two devices"


class _Fallback:
    """Runs one op on CPU aliases of its emulated tensors and maps the results back (see
    [Note: ops through one fallback])."""

    def __init__(self, op, args: tuple, kwargs: dict) -> None:
        self.op = op
        self.name = require().name
        self.devices: set[torch.device] = set()
        self.host_tensor_args = False
        self.emulated_by_alias: dict[int, torch.Tensor] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.args = tree_map(self._to_cpu, args)
        self.kwargs = tree_map(self._to_cpu, kwargs)
        self.out_copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _to_cpu(self, x: Any) -> Any:
        if isinstance(x, torch.device) and x.type == self.name:
            self.devices.add(x if x.index is not None else require().device())
            return torch.device("cpu")
        if not isinstance(x, torch.Tensor):
            return x
        if x.device.type != self.name:
            if x.device.type == "cpu" and x.dim() > 0:
                self.host_tensor_args = True
            return x
        self.devices.add(x.device)
        alias = cpu_alias(x)
        self.emulated_by_alias[id(alias)] = x
        self.storages[x.untyped_storage().data_ptr()] = x.untyped_storage()
        return alias

    def _check_placement(self) -> None:
        if len(self.devices) > 1:
            names = ", ".join(sorted(str(d) for d in self.devices))
            raise RuntimeError(f"{_MIXED}: {names}! (op {self.op})")
        if self.devices and self.host_tensor_args and not _allows_host_operands(self.op):
            only = next(iter(self.devices))
            raise RuntimeError(f"{_MIXED}, {only} and cpu! (op {self.op})")

    def _swap_out_args(self) -> None:
        """``out=`` tensors become owning CPU clones, so a kernel may resize them."""
        outs = {a.name for a in self.op._schema.arguments if a.is_out}
        for name, value in list(self.kwargs.items()):
            if name not in outs:
                continue
            if isinstance(value, (list, tuple)):
                self.kwargs[name] = type(value)(self._owned(v) for v in value)
            else:
                self.kwargs[name] = self._owned(value)

    def _owned(self, alias: Any) -> Any:
        """An owning CPU clone standing for the emulated tensor behind ``alias``; the clone
        is copied back (resizing the emulated tensor if needed) after the kernel ran."""
        if not isinstance(alias, torch.Tensor):
            return alias
        emulated = self.emulated_by_alias.get(id(alias))
        if emulated is None:
            return alias
        clone = alias.clone()
        self.out_copies.append((emulated, clone))
        self.emulated_by_alias[id(clone)] = emulated
        return clone

    def run(self) -> Any:
        self._check_placement()
        registry = require().host_registry
        if registry is not None:
            registry.raise_latched()
        before_op()
        self._swap_out_args()
        result = self.op(*self.args, **self.kwargs)
        for emulated, clone in self.out_copies:
            if tuple(emulated.shape) != tuple(clone.shape):
                resize_(emulated, clone.shape)
            cpu_alias(emulated).copy_(clone)
        index = next(iter(self.devices)).index if self.devices else require().current
        return tree_map(lambda r: self._back(r, index), result)

    def _back(self, r: Any, index: int) -> Any:
        if not isinstance(r, torch.Tensor):
            return r
        same = self.emulated_by_alias.get(id(r))
        if same is not None:
            return same
        storage = self.storages.get(r.untyped_storage().data_ptr()) if r.numel() else None
        if storage is not None:  # a view of an emulated tensor
            view = torch._C._acc.create_empty_tensor(list(r.shape), r.dtype)
            return bind(view, storage, r.storage_offset(), tuple(r.shape), tuple(r.stride()))
        if not self.devices:
            return r
        return to_emulated(r, index)


_HOST_OPERAND_OPS = ("index", "index_put", "_index_put_impl", "index_select", "_unsafe_index")


def _allows_host_operands(op) -> bool:
    """CUDA accepts host index tensors for indexing; everything else must be on-device."""
    return op.__name__.split(".")[0] in _HOST_OPERAND_OPS


def fallback(keyset, op, *args, **kwargs):
    """The PrivateUse1 fallback kernel: ``op`` run as [Note: ops through one fallback] says."""
    return _Fallback(op, args, kwargs).run()
