"""An emulated accelerator: a pure-Python PrivateUse1 backend over CPU memory.

flatzero's device half (the device, upload, sharded and offload tiers, the out-of-memory
ladder, peak device memory, streams and events, collectives on device tensors) has to run
where there is no GPU, in CI. :func:`install` registers a backend that torch treats as an
accelerator like any other (``torch.device("emu", 0)``, ``torch.get_device_module("emu")``,
``init_process_group("cpu:gloo,emu:emu-gloo")``) with:

- memory: CPU bytes underneath; a capacity per device (bytes) beyond which an allocation
  raises ``torch.OutOfMemoryError``; allocated / peak counters that drop when a storage
  is freed; ``mem_get_info`` as ``(capacity - allocated, capacity)``;
- ops: allocation, copies and ``item()`` by hand; every other op through one fallback
  that runs the CPU kernel on CPU aliases of the same bytes and maps the results back
  (views stay views, in-place stays in-place, ``out=`` is resized as needed); mixing
  tensors of two devices raises like CUDA does, so placement bugs surface;
- one device per process, ``name:0`` (torch's Python device guard places every tensor of
  a Python backend on index 0): each rank sees one device, as under a launcher that
  gives each rank one GPU (``CUDA_VISIBLE_DEVICES`` per rank);
- streams and events that exist and order nothing: everything runs synchronously;
- collectives: a process-group backend wrapping gloo over CPU aliases of the same bytes;
- ``module.to(name)`` swaps parameters in place (``torch.__future__``'s
  ``set_swap_module_params_on_conversion``), so tied weights stay tied, as with CUDA.

Known limits (do not read more into a test on it): every op is synchronous, so a missing
stream wait is never caught; there is no pinned host memory (``pin_memory()`` raises once
the emulated device is the process's accelerator); reserved == allocated (no caching
allocator); each op costs ~40x its CPU time. Registration is process-global and cannot be
undone: use it in a process of its own (a spawned test worker).

The implementation rests on torch's experimental
``torch.utils.backend_registration._setup_privateuseone_for_python_backend`` and was
written against torch 2.13; :func:`install` raises :class:`EmulationUnavailable` with the
reason where that machinery is missing, and tests skip on it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

__all__ = [
    "EmulatedDevice",
    "EmulationUnavailable",
    "install",
    "installed",
]

_PRIVATEUSE1 = torch._C._autograd.DeviceType.PrivateUse1


class EmulationUnavailable(RuntimeError):
    """This torch cannot host the emulated accelerator (the reason is the message)."""


@dataclass
class _Counters:
    """Memory accounting of one emulated device, in bytes."""

    capacity: int
    allocated: int = 0
    peak: int = 0
    allocations: int = 0


@dataclass
class EmulatedDevice:
    """The installed emulated accelerator: its name and memory counters per device."""

    name: str
    device_count: int
    backend_name: str
    host_collectives: bool = True
    counters: list[_Counters] = field(default_factory=list)
    current: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def device(self, index: int | None = None) -> torch.device:
        """``torch.device(name, index)``; the current device when ``index`` is None."""
        return torch.device(self.name, self.current if index is None else index)

    def set_capacity(self, capacity_bytes: int, index: int | None = None) -> None:
        """Set the memory of device ``index`` (all devices when None) to ``capacity_bytes``."""
        targets = range(self.device_count) if index is None else [index]
        for i in targets:
            self.counters[i].capacity = int(capacity_bytes)

    def _charge(self, index: int, nbytes: int) -> None:
        with self.lock:
            c = self.counters[index]
            if c.allocated + nbytes > c.capacity:
                free = c.capacity - c.allocated
                raise torch.OutOfMemoryError(
                    f"{self.name}:{index} out of memory: tried to allocate {nbytes} bytes "
                    f"with {free} bytes free of {c.capacity} (emulated device)"
                )
            c.allocated += nbytes
            c.allocations += 1
            c.peak = max(c.peak, c.allocated)

    def _release(self, index: int, nbytes: int) -> None:
        with self.lock:
            self.counters[index].allocated -= nbytes


_STATE: EmulatedDevice | None = None


def installed() -> EmulatedDevice | None:
    """The emulated device of this process, or None when :func:`install` was not called."""
    return _STATE


# --- storage -----------------------------------------------------------------------


def _new_storage(nbytes: int, index: int) -> torch.UntypedStorage:
    """An emulated storage of ``nbytes`` on device ``index``, charged to its counters and
    released when torch frees it (the CPU bytes live as long as the storage does)."""
    state = _require()
    state._charge(index, nbytes)
    host = torch.UntypedStorage(max(nbytes, 1))
    storage = torch._C._construct_storage_from_data_pointer(
        host.data_ptr(), torch.device(state.name, index), nbytes
    )
    weakref.finalize(storage, _free, index, nbytes, host)
    return storage


def _free(index: int, nbytes: int, host: torch.UntypedStorage) -> None:
    del host  # the CPU bytes go with the emulated storage
    if _STATE is not None:
        _STATE._release(index, nbytes)


def _extent_bytes(size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> int:
    if any(s == 0 for s in size):
        return 0
    last = sum((s - 1) * st for s, st in zip(size, stride, strict=True))
    return (last + 1) * dtype.itemsize


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for s in reversed(size):
        strides.append(running)
        running *= max(s, 1)
    return tuple(reversed(strides))


_CPU_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _bind(
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


def _empty_on(
    index: int, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    storage = _new_storage(_extent_bytes(size, stride, dtype), index)
    tensor = torch._C._acc.create_empty_tensor(list(size), dtype)
    return _bind(tensor, storage, 0, size, stride)


def _index_of(device: torch.device | str | int | None) -> int:
    if device is None:
        return _require().current
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return _require().current if device.index is None else device.index


def _cpu_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor over the same bytes, offset, sizes and strides as emulated ``tensor``."""
    storage = tensor.untyped_storage()
    host = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), torch.device("cpu"), storage.nbytes()
    )
    alias = torch.empty(0, dtype=tensor.dtype)
    return alias.set_(host, tensor.storage_offset(), tensor.size(), tensor.stride())


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` where either side may be emulated (a real cross-device copy)."""
    d = _cpu_alias(dst) if dst.device.type == _require().name else dst
    s = _cpu_alias(src) if src.device.type == _require().name else src
    d.copy_(s)


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


def _to_emulated(cpu: torch.Tensor, index: int) -> torch.Tensor:
    """A new emulated tensor with ``cpu``'s values, sizes and (dense) strides."""
    dense = _dense(tuple(cpu.shape), tuple(cpu.stride()))
    stride = tuple(cpu.stride()) if dense else _contiguous_strides(tuple(cpu.shape))
    out = _empty_on(index, tuple(cpu.shape), stride, cpu.dtype)
    _cpu_alias(out).copy_(cpu)
    return out


# --- kernels -----------------------------------------------------------------------


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    dtype = dtype or torch.get_default_dtype()
    return _empty_on(_index_of(device), tuple(size), tuple(stride), dtype)


def _empty_memory_format(
    size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None
):
    size = tuple(size)
    if memory_format in (None, torch.contiguous_format, torch.preserve_format):
        stride = _contiguous_strides(size)
    else:
        stride = tuple(torch.empty(size, dtype=torch.int8, memory_format=memory_format).stride())
    return _empty_strided(size, stride, dtype=dtype, device=device)


def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False):
    _copy_bytes(dst, src)
    return dst


def _copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
    _copy_bytes(dst, src)
    return dst


def _local_scalar_dense(tensor: torch.Tensor):
    return _cpu_alias(tensor).item()


def _resize_(tensor: torch.Tensor, size, memory_format=None):
    size = tuple(size)
    stride = _contiguous_strides(size)
    needed = _extent_bytes(size, stride, tensor.dtype) + tensor.storage_offset() * (
        tensor.dtype.itemsize
    )
    storage = tensor.untyped_storage()
    if needed > storage.nbytes():
        grown = _new_storage(needed, tensor.device.index)
        old = _cpu_alias_of_storage(storage)
        new = _cpu_alias_of_storage(grown)
        new[: old.numel()].copy_(old)
        storage = grown
    return _bind(tensor, storage, tensor.storage_offset(), size, stride)


def _cpu_alias_of_storage(storage: torch.UntypedStorage) -> torch.Tensor:
    host = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), torch.device("cpu"), storage.nbytes()
    )
    return torch.empty(0, dtype=torch.uint8).set_(host)


def _record_stream(tensor: torch.Tensor, stream) -> None:
    return None  # one synchronous queue: nothing to record


_MIXED = "Expected all tensors to be on the same device, but found at least two devices"


class _Fallback:
    """Runs one op on CPU aliases of its emulated tensors and maps the results back."""

    def __init__(self, op, args: tuple, kwargs: dict) -> None:
        self.op = op
        self.name = _require().name
        self.devices: set[torch.device] = set()
        self.host_tensor_args = False
        self.emulated_by_alias: dict[int, torch.Tensor] = {}
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.args = tree_map(self._to_cpu, args)
        self.kwargs = tree_map(self._to_cpu, kwargs)
        self.out_copies: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _to_cpu(self, x: Any) -> Any:
        if isinstance(x, torch.device) and x.type == self.name:
            self.devices.add(x if x.index is not None else _require().device())
            return torch.device("cpu")
        if not isinstance(x, torch.Tensor):
            return x
        if x.device.type != self.name:
            if x.device.type == "cpu" and x.dim() > 0:
                self.host_tensor_args = True
            return x
        self.devices.add(x.device)
        alias = _cpu_alias(x)
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
        self._swap_out_args()
        result = self.op(*self.args, **self.kwargs)
        for emulated, clone in self.out_copies:
            if tuple(emulated.shape) != tuple(clone.shape):
                _resize_(emulated, clone.shape)
            _cpu_alias(emulated).copy_(clone)
        index = next(iter(self.devices)).index if self.devices else _require().current
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
            return _bind(view, storage, r.storage_offset(), tuple(r.shape), tuple(r.stride()))
        if not self.devices:
            return r
        return _to_emulated(r, index)


_HOST_OPERAND_OPS = ("index", "index_put", "_index_put_impl", "index_select", "_unsafe_index")


def _allows_host_operands(op) -> bool:
    """CUDA accepts host index tensors for indexing; everything else must be on-device."""
    return op.__name__.split(".")[0] in _HOST_OPERAND_OPS


def _fallback(keyset, op, *args, **kwargs):
    return _Fallback(op, args, kwargs).run()


# --- device module -----------------------------------------------------------------


class Stream(torch.Stream):
    """A stream of the emulated device: real to torch's type checks, ordering nothing."""

    _next_id = 1

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        if "stream_id" in kwargs:
            return super().__new__(cls, **kwargs)
        index = _index_of(device)
        stream_id = Stream._next_id
        Stream._next_id += 1
        return super().__new__(
            cls, stream_id=stream_id, device_index=index, device_type=int(_PRIVATEUSE1)
        )

    def __init__(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def __enter__(self):
        _STREAM_STACK.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _STREAM_STACK.pop()


_DEFAULT_STREAMS: dict[int, Stream] = {}
_STREAM_STACK: list[Stream] = []


class Event(torch.Event):
    """An event of the emulated device: recorded work is always complete."""

    def __new__(cls, device=None, *, enable_timing=False, blocking=False, interprocess=False):
        return super().__new__(cls, device=torch.device("cpu"), enable_timing=enable_timing)

    def __init__(self, *args, **kwargs) -> None:
        self._recorded = False

    def record(self, stream=None) -> None:
        self._recorded = True

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event) -> float:
        return 0.0


class _DeviceModule:
    """``torch.<name>``: the device module torch and flatzero's seam call."""

    Stream = Stream
    Event = Event

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return _require().device_count

    def current_device(self) -> int:
        return _require().current

    def set_device(self, device) -> None:
        index = _index_of(device)
        if not 0 <= index < _require().device_count:
            raise RuntimeError(f"invalid device ordinal {index} (emulated device)")
        _require().current = index

    def synchronize(self, device=None) -> None:
        return None

    def manual_seed_all(self, seed: int) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        return None

    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [torch.get_rng_state() for _ in range(_require().device_count)]

    def set_rng_state_all(self, states) -> None:
        if states:
            torch.set_rng_state(states[0])

    def current_stream(self, device=None) -> Stream:
        if _STREAM_STACK:
            return _STREAM_STACK[-1]
        index = _index_of(device)
        if index not in _DEFAULT_STREAMS:
            _DEFAULT_STREAMS[index] = Stream(
                stream_id=0, device_index=index, device_type=int(_PRIVATEUSE1)
            )
        return _DEFAULT_STREAMS[index]

    def default_stream(self, device=None) -> Stream:
        return self.current_stream(device)

    @contextlib.contextmanager
    def stream(self, stream: Stream | None) -> Iterator[None]:
        if stream is None:
            yield
            return
        with stream:
            yield

    def _counters(self, device=None) -> _Counters:
        return _require().counters[_index_of(device)]

    def mem_get_info(self, device=None) -> tuple[int, int]:
        c = self._counters(device)
        return c.capacity - c.allocated, c.capacity

    def memory_allocated(self, device=None) -> int:
        return self._counters(device).allocated

    def max_memory_allocated(self, device=None) -> int:
        return self._counters(device).peak

    def memory_reserved(self, device=None) -> int:
        return self._counters(device).allocated

    def max_memory_reserved(self, device=None) -> int:
        return self._counters(device).peak

    def reset_peak_memory_stats(self, device=None) -> None:
        c = self._counters(device)
        c.peak = c.allocated

    def empty_cache(self) -> None:
        return None

    def memory_stats(self, device=None) -> dict[str, int]:
        c = self._counters(device)
        return {
            "allocated_bytes.all.current": c.allocated,
            "allocated_bytes.all.peak": c.peak,
            "reserved_bytes.all.current": c.allocated,
            "num_alloc_retries": 0,
        }

    def get_device_name(self, device=None) -> str:
        return f"emulated accelerator ({_require().name})"

    def get_device_properties(self, device=None):
        c = self._counters(device)
        return _Properties(name=self.get_device_name(device), total_memory=c.capacity)


@dataclass(frozen=True)
class _Properties:
    name: str
    total_memory: int


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    def is_available(self) -> bool:
        return True

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


class _Guard(torch._C._acc.DeviceGuard):
    def type_(self):
        return _PRIVATEUSE1


# --- collectives ---------------------------------------------------------------------


def _aliases(x: Any) -> Any:
    name = _require().name

    def one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.device.type == name:
            return _cpu_alias(t)
        return t

    if isinstance(x, (list, tuple)):
        return type(x)(_aliases(v) for v in x)
    return one(x)


class _GlooOverAliases(dist.ProcessGroup):
    """A process group for emulated (and host) tensors: gloo on CPU aliases of their bytes.

    torch lets a Python backend be a ``ProcessGroup`` only (``c10d.Backend`` has no Python
    constructor), and such a group replaces the whole group of ``init_process_group`` for
    every device of its backend string, so it serves host tensors too (passed through).
    """

    def __init__(self, store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self) -> str:
        return _require().backend_name

    def _forward(self, method: str, *args):
        """Run gloo's ``method`` on CPU aliases and wait for it: the aliases do not own
        their bytes, so the work must finish while the caller's tensors are alive (an
        emulated collective is synchronous, like every emulated op)."""
        if not _require().host_collectives:
            _refuse_host_tensors(method, args)
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
                    f"{_require().backend_name} {method}: tensors must be on "
                    f"{_require().name}, got a host tensor (emulating a device-only backend)"
                )


def _opt(opts) -> tuple:
    return () if opts is None else (opts,)


# --- installation --------------------------------------------------------------------


def _require() -> EmulatedDevice:
    if _STATE is None:
        raise RuntimeError("the emulated accelerator is not installed; call install() first")
    return _STATE


_IMPLS: list[tuple[str, Callable]] = [
    ("empty_strided", _empty_strided),
    ("empty.memory_format", _empty_memory_format),
    ("_copy_from", _copy_from),
    ("copy_", _copy_),
    ("_local_scalar_dense", _local_scalar_dense),
    ("resize_", _resize_),
    ("record_stream", _record_stream),
]

_LIBRARIES: list[torch.library.Library] = []


def install(
    name: str = "emu", *, capacity_bytes: int = 1 << 30, host_collectives: bool = True
) -> EmulatedDevice:
    """Register the emulated accelerator ``name`` in this process (once per process).

    Args:
        name: the device type torch will know it by (``torch.device(name, i)``).
        capacity_bytes: memory per device, in bytes; allocations beyond it raise
            ``torch.OutOfMemoryError``. Change it later with ``set_capacity``.
        host_collectives: whether the ``<name>-gloo`` backend also takes host tensors (as
            gloo does); False makes it refuse them as NCCL does, for a group created with
            the device backend alone (``init_process_group("<name>-gloo")``).

    Returns:
        The installed device (its counters and capacity).

    Raises:
        EmulationUnavailable: this torch lacks the Python PrivateUse1 machinery, or the
            PrivateUse1 slot is taken by another backend.
    """
    global _STATE
    if _STATE is not None:
        if _STATE.name != name:
            raise EmulationUnavailable(
                f"emulated device {_STATE.name!r} is already installed in this process; "
                f"one PrivateUse1 backend per process (asked for {name!r})"
            )
        return _STATE
    try:
        from torch.utils.backend_registration import (
            _setup_privateuseone_for_python_backend,
        )
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise EmulationUnavailable(f"torch {torch.__version__} has no Python backends: {e}") from e
    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        raise EmulationUnavailable(
            f"PrivateUse1 is already taken by {torch._C._get_privateuse1_backend_name()!r}"
        )
    _STATE = EmulatedDevice(
        name=name,
        device_count=1,
        backend_name=f"{name}-gloo",
        counters=[_Counters(capacity=capacity_bytes)],
        host_collectives=host_collectives,
    )
    try:
        _setup_privateuseone_for_python_backend(
            name, backend_module=_DeviceModule(), hook=_Hooks(), device_guard=_Guard()
        )
        impl = torch.library.Library("aten", "IMPL")
        for op, fn in _IMPLS:
            impl.impl(op, fn, "PrivateUse1")
        fallback = torch.library.Library("_", "IMPL")
        fallback.fallback(_fallback, dispatch_key="PrivateUse1", with_keyset=True)
        _LIBRARIES.extend([impl, fallback])
        dist.Backend.register_backend(_STATE.backend_name, _GlooOverAliases, devices=[name])
        # torch counts no PrivateUse1 tensor shallow-copy compatible with a host one, so
        # ``module.to(name)`` would give each module a new Parameter and untie tied weights;
        # swapping (torch's announced future default) keeps every Parameter object.
        torch.__future__.set_swap_module_params_on_conversion(True)
    except Exception as e:  # pragma: no cover - depends on the torch build
        _STATE = None
        raise EmulationUnavailable(
            f"could not register the emulated accelerator on torch {torch.__version__}: {e}"
        ) from e
    return _STATE
