"""The ops the emulated device implements by hand: allocation, copies, ``item()``, resize."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .state import index_of, require
from .storage import (
    bind,
    contiguous_strides,
    cpu_alias,
    cpu_alias_of_storage,
    empty_on,
    extent_bytes,
    new_storage,
)
from .streams import before_op, issue

__all__ = ["IMPLS", "copy_bytes", "resize_"]


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` where either side may be emulated (a real cross-device copy): the
    emulator's one copy routine."""
    d = cpu_alias(dst) if dst.device.type == require().name else dst
    s = cpu_alias(src) if src.device.type == require().name else src
    d.copy_(s)


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = dtype or torch.get_default_dtype()
    return empty_on(index_of(device), tuple(size), tuple(stride), dtype)


def _empty_memory_format(
    size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    size = tuple(size)
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        stride = contiguous_strides(size)
    else:
        stride = tuple(torch.empty(size, dtype=torch.int8, memory_format=memory_format).stride())
    return _empty_strided(size, stride, dtype=dtype, device=device)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False):
    issue(lambda: copy_bytes(dst, src), asynchronous=non_blocking)
    return dst


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
    issue(lambda: copy_bytes(dst, src), asynchronous=non_blocking)
    return dst


def _local_scalar_dense(tensor: torch.Tensor):
    before_op()
    return cpu_alias(tensor).item()


def resize_(tensor: torch.Tensor, size, memory_format=None):
    """Resize emulated ``tensor`` in place to contiguous ``size``, growing its storage (a new
    one, charged, holding the old bytes) when it is too small."""
    before_op()
    size = tuple(size)
    stride = contiguous_strides(size)
    needed = extent_bytes(size, stride, tensor.dtype) + tensor.storage_offset() * (
        tensor.dtype.itemsize
    )
    storage = tensor.untyped_storage()
    if needed > storage.nbytes():
        grown = new_storage(needed, tensor.device.index)
        old = cpu_alias_of_storage(storage)
        new = cpu_alias_of_storage(grown)
        new[: old.numel()].copy_(old)
        storage = grown
    return bind(tensor, storage, tensor.storage_offset(), size, stride)


def _record_stream(tensor: torch.Tensor, stream) -> None:
    return None  # one synchronous queue: nothing to record


IMPLS: list[tuple[str, Callable]] = [
    ("empty_strided", _empty_strided),
    ("empty.memory_format", _empty_memory_format),
    ("_copy_from", _copy_from),
    ("copy_", _copy_),
    ("_local_scalar_dense", _local_scalar_dense),
    ("resize_", resize_),
    ("record_stream", _record_stream),
]
"""(aten op, kernel) registered for PrivateUse1; every other op goes through the fallback."""
