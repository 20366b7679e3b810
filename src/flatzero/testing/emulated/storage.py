"""Emulated storages: CPU bytes charged to a device's counters, and CPU aliases of them."""

from __future__ import annotations

import weakref

import torch

from .state import installed, require

__all__ = [
    "bind",
    "contiguous_strides",
    "cpu_alias",
    "cpu_alias_of_storage",
    "empty_on",
    "extent_bytes",
    "new_storage",
    "to_emulated",
]

# [Note: emulated memory]
# CPU bytes lie underneath every emulated storage; each device has a capacity (bytes)
# beyond which an allocation raises ``torch.OutOfMemoryError``, and allocated / peak
# counters that drop when a storage is freed (``mem_get_info`` is ``(capacity - allocated,
# capacity)``). There is no caching allocator: reserved == allocated.


def new_storage(nbytes: int, index: int) -> torch.UntypedStorage:
    """An emulated storage of ``nbytes`` on device ``index``, charged to its counters and
    released when torch frees it (the CPU bytes live as long as the storage does; see
    [Note: emulated memory])."""
    state = require()
    state._charge(index, nbytes)
    host = torch.UntypedStorage(max(nbytes, 1))
    storage = torch._C._construct_storage_from_data_pointer(
        host.data_ptr(), torch.device(state.name, index), nbytes
    )
    weakref.finalize(storage, _free, index, nbytes, host)
    return storage


def _free(index: int, nbytes: int, host: torch.UntypedStorage) -> None:
    del host  # the CPU bytes go with the emulated storage
    state = installed()
    if state is not None:
        state._release(index, nbytes)


def extent_bytes(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes a tensor of ``size``, ``stride`` and ``dtype`` spans in its storage."""
    if any(s == 0 for s in size):
        return 0
    last = sum((s - 1) * st for s, st in zip(size, stride, strict=True))
    return (last + 1) * dtype.itemsize


def contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    """The strides (elements) of a contiguous tensor of ``size``."""
    strides, running = [], 1
    for s in reversed(size):
        strides.append(running)
        running *= max(s, 1)
    return tuple(reversed(strides))


_CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def bind(
    tensor: torch.Tensor,
    storage: torch.UntypedStorage,
    offset: int,
    size: tuple[int, ...],
    stride: tuple[int, ...],
) -> torch.Tensor:
    """Point ``tensor`` at ``storage`` (the CPU ``set_`` kernel does the metadata)."""
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU_KEYSET, tensor, storage, offset, list(size), list(stride)
    )
    return tensor


def empty_on(
    index: int, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """A new emulated tensor on device ``index`` (its values are whatever the bytes hold)."""
    storage = new_storage(extent_bytes(size, stride, dtype), index)
    tensor = torch._C._acc.create_empty_tensor(list(size), dtype)
    return bind(tensor, storage, 0, size, stride)


def cpu_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same bytes, offset, sizes and strides as emulated ``tensor``."""
    storage = tensor.untyped_storage()
    host = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), torch.device("cpu"), storage.nbytes()
    )
    alias = torch.empty(0, dtype=tensor.dtype)
    return alias.set_(host, tensor.storage_offset(), tensor.size(), tensor.stride())


def cpu_alias_of_storage(storage: torch.UntypedStorage) -> torch.Tensor:
    """A CPU uint8 tensor over every byte of emulated ``storage``."""
    host = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), torch.device("cpu"), storage.nbytes()
    )
    return torch.empty(0, dtype=torch.uint8).set_(host)


def _dense(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether sizes and strides cover their bytes exactly once, in some dimension order."""
    expected = 1
    for s, st in sorted(zip(size, stride, strict=True), key=lambda d: d[1]):
        if s == 1:
            continue
        if st != expected:
            return False
        expected *= s
    return True


def to_emulated(cpu: torch.Tensor, index: int) -> torch.Tensor:
    """A new emulated tensor with ``cpu``'s values, sizes and (dense) strides."""
    dense = _dense(tuple(cpu.shape), tuple(cpu.stride()))
    stride = tuple(cpu.stride()) if dense else contiguous_strides(tuple(cpu.shape))
    out = empty_on(index, tuple(cpu.shape), stride, cpu.dtype)
    cpu_alias(out).copy_(cpu)
    return out
