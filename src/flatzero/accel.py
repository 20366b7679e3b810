"""The device seam: every call flatzero makes to an accelerator's runtime.

One room talks to the device. Everything else asks here, in terms of ``torch.device``:
how much memory is free, the allocator's counters, streams and events, pinned host
memory, random-number states, which device is current. The calls go through what torch
gives every backend, ``torch.get_device_module(device)`` (``torch.cuda`` on CUDA,
``torch.xpu``, ``torch.npu`` from torch_npu, ``torch.hpu``, ``torch.mps``, or a
PrivateUse1 backend's registered module) and ``torch.accelerator``, so CUDA, XPU, Ascend,
Gaudi and any out-of-tree backend with a device module are served by the same lines.

A function whose call the backend's module lacks (``memory_reserved`` on a backend
without a caching allocator, say) answers what is true without it (0 cached bytes) rather
than failing: every such default is stated in its docstring. Host tensors
(``device.type == "cpu"``) are never passed to a device module: the functions that take a
device return at once for the host.

Which device a rank uses and which collectives a group runs where is policy, not a device
call: that is ``devices.py``, built on this module.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import logging
import mmap
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "accelerator_type",
    "current_index",
    "current_stream",
    "device_count",
    "device_module",
    "device_name",
    "empty_cache",
    "has_streams",
    "is_accelerator",
    "max_memory_allocated",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "new_event",
    "new_stream",
    "on_device",
    "pin_host",
    "pinned_bytes",
    "pinned_empty",
    "reset_peak_memory_stats",
    "rng_states",
    "set_current",
    "set_rng_states",
    "synchronize",
    "total_memory",
    "unpin_host",
    "use_stream",
]

logger = logging.getLogger(__name__)

_HOST_TYPES = ("cpu", "meta")


def accelerator_type() -> str | None:
    """The device type of this process's accelerator (``"cuda"``, ``"xpu"``, ``"npu"``,
    a PrivateUse1 backend's name, ...), or None when there is none available."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        if not accelerator.is_available():
            return None
        current = accelerator.current_accelerator()
        return None if current is None else current.type
    return "cuda" if torch.cuda.is_available() else None  # torch < 2.6: CUDA only


def is_accelerator(device: torch.device | str) -> bool:
    """Whether ``device`` is an accelerator (not host memory, not meta)."""
    return torch.device(device).type not in _HOST_TYPES


def device_module(device: torch.device | str) -> Any:
    """The runtime module of ``device``'s type (``torch.cuda`` for CUDA)."""
    return torch.get_device_module(torch.device(device).type)


def _call(device: torch.device, name: str, default: Any = None) -> Any:
    """``module.name(device)``, or ``module.name()`` when the function takes no argument
    (a backend module whose ``synchronize``/``empty_cache``/... act on the current
    device); ``default`` when the module has no such function."""
    fn = getattr(device_module(device), name, None)
    if fn is None:
        return default
    return fn(device) if _takes_an_argument(fn) else fn()


@functools.cache
def _takes_an_argument(fn: Any) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: torch's own modules
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters
    )


def device_count(device_type: str) -> int:
    """How many devices of ``device_type`` this process sees."""
    return int(device_module(device_type).device_count())


def current_index(device_type: str) -> int:
    """The index of this process's current ``device_type`` device."""
    return int(device_module(device_type).current_device())


def set_current(device: torch.device) -> None:
    """Make ``device`` the current device of its type (a no-op for the host)."""
    if not is_accelerator(device) or device.index is None:
        return
    if current_index(device.type) != device.index:
        device_module(device).set_device(device)


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current for the block (kernels and streams default to it), when its
    module has a device context (``torch.cuda.device``); else nothing changes."""
    context = getattr(device_module(device), "device", None) if is_accelerator(device) else None
    if context is None or device.index is None:
        yield
        return
    with context(device):
        yield


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (a no-op for the host)."""
    if is_accelerator(device):
        _call(device, "synchronize")


def mem_get_info(device: torch.device) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device`` as its runtime reports them (for CUDA: the
    driver's view, which excludes what the caching allocator holds)."""
    free, total = _call(device, "mem_get_info")
    return int(free), int(total)


def memory_allocated(device: torch.device) -> int:
    """Bytes of ``device`` held by live tensors; 0 for the host."""
    if not is_accelerator(device):
        return 0
    return int(_call(device, "memory_allocated", default=0))


def max_memory_allocated(device: torch.device) -> int:
    """Peak of ``memory_allocated`` since the last ``reset_peak_memory_stats`` (bytes);
    0 for the host or a backend without the counter."""
    if not is_accelerator(device):
        return 0
    return int(_call(device, "max_memory_allocated", default=0))


def reset_peak_memory_stats(device: torch.device) -> None:
    """Start a new peak for ``max_memory_allocated``."""
    if is_accelerator(device):
        _call(device, "reset_peak_memory_stats")


def memory_reserved(device: torch.device) -> int:
    """Bytes the caching allocator holds on ``device`` (live tensors included); equal to
    ``memory_allocated`` for a backend without a caching allocator."""
    if not is_accelerator(device):
        return 0
    reserved = _call(device, "memory_reserved")
    return memory_allocated(device) if reserved is None else int(reserved)


def empty_cache(device: torch.device) -> None:
    """Return the caching allocator's unused blocks to the device (a no-op for the host).

    The cache is per process and device type: torch's ``empty_cache`` takes no device."""
    if is_accelerator(device):
        fn = getattr(device_module(device), "empty_cache", None)
        if fn is not None:
            fn()


def total_memory(device: torch.device) -> int:
    """Total bytes of ``device`` (its properties, else ``mem_get_info``)."""
    props = _call(device, "get_device_properties")
    total = getattr(props, "total_memory", None)
    return int(total) if total is not None else mem_get_info(device)[1]


def device_name(device: torch.device) -> str:
    """The product name of ``device`` (``"NVIDIA H100 80GB HBM3"``), else its type."""
    props = _call(device, "get_device_properties")
    return str(getattr(props, "name", device.type))


# --- streams and events ---------------------------------------------------------------


def has_streams(device: torch.device) -> bool:
    """Whether ``device``'s module offers streams and events (``Stream``, ``Event``,
    ``current_stream``, ``stream``); without them copies are synchronous."""
    module = device_module(device)
    return all(hasattr(module, n) for n in ("Stream", "Event", "current_stream", "stream"))


def new_stream(device: torch.device) -> Any:
    """A new stream on accelerator ``device`` (``torch.cuda.Stream`` on CUDA)."""
    return device_module(device).Stream(device)


def current_stream(device: torch.device) -> Any:
    """The stream kernels on ``device`` are queued on now."""
    return _call(device, "current_stream")


@contextlib.contextmanager
def use_stream(stream: Any) -> Iterator[None]:
    """Queue the block's kernels on ``stream`` (``torch.cuda.stream(s)`` on CUDA)."""
    with device_module(stream.device).stream(stream):
        yield


def new_event(device: torch.device, *, blocking: bool = False) -> Any:
    """A new event for ``device``'s streams (no timing: cheaper to record). ``blocking``:
    a thread waiting on it (``synchronize``) sleeps rather than spins, where the backend
    offers the choice (``torch.cuda.Event(blocking=True)``)."""
    if blocking:
        try:
            return device_module(device).Event(blocking=True)
        except TypeError:  # a backend whose events take no such argument
            pass
    return device_module(device).Event()


def new_timing_event(device: torch.device) -> Any:
    """A new event that can time ``device``'s work (``start.elapsed_time(end)``, ms)."""
    return device_module(device).Event(enable_timing=True)


# --- pinned host memory ---------------------------------------------------------------

_pin_refused: set[str] = set()


def pinned_empty(nbytes: int) -> torch.Tensor | None:
    """A page-locked 1-D uint8 host tensor of ``nbytes`` for copies to this process's
    accelerator, or None where page-locked memory cannot be had: no accelerator, a
    backend without a pinned allocator (warned once per process), or the system's
    page-locked limit reached (warned each time, with the size). A caller falls back
    to pageable memory: slower uploads, never wrong ones."""
    device_type = accelerator_type()
    if device_type is None or device_type in _pin_refused:
        return None
    try:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except NotImplementedError as error:
        _pin_refused.add(device_type)
        logger.warning(
            "%s has no pinned host memory (%s); uploads use pageable memory and are synchronous",
            device_type,
            str(error).splitlines()[0],
        )
    except RuntimeError as error:
        logger.warning(
            "could not pin %d bytes of host memory (%s); uploads use pageable memory and "
            "are synchronous",
            nbytes,
            str(error).splitlines()[0],
        )
    return None


# --- random-number states -------------------------------------------------------------


def rng_states() -> tuple[str, list[torch.Tensor]] | None:
    """``(device_type, [state per device])`` of this process's accelerator generators, or
    None without an accelerator (or before its runtime was initialized: no state to keep)."""
    device_type = accelerator_type()
    if device_type is None:
        return None
    module = device_module(device_type)
    initialized = getattr(module, "is_initialized", None)
    if initialized is not None and not initialized():
        return None
    get_all = getattr(module, "get_rng_state_all", None)
    return None if get_all is None else (device_type, list(get_all()))


def set_rng_states(device_type: str, states: list[torch.Tensor]) -> bool:
    """Restore the generators of ``device_type`` from ``states``; False (nothing changed)
    when this process has no such accelerator or sees another number of devices."""
    if accelerator_type() != device_type or len(states) != device_count(device_type):
        return False
    device_module(device_type).set_rng_state_all(states)
    return True


# --- host memory registered in place -------------------------------------------------

_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: the pages are pinned for every device context (as
``torch.cuda._pin_memory_utils`` registers them)."""


def _host_registration() -> tuple[Any, Any, Any] | None:
    """``(register, unregister, runtime)`` of this process's accelerator runtime for
    page-locking existing host memory (CUDA and ROCm: ``cudaHostRegister``/
    ``cudaHostUnregister`` of ``torch.cuda.cudart()``), or None where the runtime offers no
    such calls."""
    device_type = accelerator_type()
    if device_type is None:
        return None
    runtime = getattr(device_module(device_type), "cudart", None)
    if runtime is None:
        return None
    try:
        calls = runtime()
    except (RuntimeError, AssertionError):  # torch raises both for a runtime it cannot load
        return None
    register = getattr(calls, "cudaHostRegister", None)
    unregister = getattr(calls, "cudaHostUnregister", None)
    return None if register is None or unregister is None else (register, unregister, calls)


_PAGE = mmap.PAGESIZE
"""Bytes per host page: the runtime page-locks whole pages."""

_pinned_pages: dict[int, tuple[int, int]] = {}
"""Address -> (first page, end page) of every range ``pin_host`` registered and
``unpin_host`` did not release yet."""
_pinned_lock = threading.Lock()


def _pages(tensor: torch.Tensor) -> tuple[int, int]:
    start = tensor.data_ptr()
    return start // _PAGE, -(-(start + tensor.nbytes) // _PAGE)


# [Note: a refused registration]
# ``torch.cuda.cudart().cudaHostRegister`` returns the runtime's error and leaves it
# latched as the thread's last error (torch's binding does not clear it): the next kernel
# launch, whose check reads that last error, would raise it (712 "part or all of the
# requested memory range is already mapped", 2 "out of memory") at an unrelated op. So a
# refused registration clears it at once (``_clear_last_error``), and ``pin_host`` never
# asks for what the runtime refuses for sure: memory that does not start on a page of its
# own, or shares a page with memory it registered (two registrations of one page fail
# with 712; small buffers from the heap share pages, ``hostmem.page_locked`` gives each
# buffer a mapping of its own).


def _clear_last_error(runtime: Any) -> None:
    """Clear the accelerator runtime's latched error of this thread (see
    [Note: a refused registration]): its ``cudaGetLastError`` where the runtime object has
    one, else that of the CUDA (HIP) runtime library this process has loaded."""
    get_last_error = getattr(runtime, "cudaGetLastError", None) or _loaded_get_last_error()
    if get_last_error is not None:
        get_last_error()


_TORCH_LIBRARIES = (("libtorch_cuda", "cudaGetLastError"), ("libtorch_hip", "hipGetLastError"))
"""torch's accelerator libraries and their runtime's call: a symbol looked up through a
library's handle is searched in that library, then in its dependencies, so this finds the
runtime instance torch itself uses (the last error is kept per runtime instance)."""
_RUNTIMES = (("libcudart", "cudaGetLastError"), ("libamdhip64", "hipGetLastError"))

_REFUSALS = frozenset({1, 2, 712, 801})
"""Runtime errors of a registration that leave the device usable (invalid value, out of
memory, already mapped, not supported): ``pin_host`` falls back to pageable memory. Any
other (a sticky 700, an illegal address) is raised."""


def _mapped_libraries() -> set[str]:
    """Paths of the shared libraries mapped into this process (empty where unknown)."""
    try:
        with open("/proc/self/maps") as maps:
            return {line.split()[-1] for line in maps if "/lib" in line}
    except OSError:
        return set()


@functools.cache
def _loaded_get_last_error() -> Any:
    """``cudaGetLastError`` (``hipGetLastError``) of the runtime torch uses: looked up
    through torch's own accelerator library (``_TORCH_LIBRARIES``), else through the runtime
    library where exactly one copy is mapped (a conda or cupy copy beside torch's would be
    another runtime instance, with its own last error); None otherwise. ``RTLD_NOLOAD``
    never loads a library."""
    paths = _mapped_libraries()
    for libraries in (_TORCH_LIBRARIES, _RUNTIMES):
        for library, name in libraries:
            found = sorted(p for p in paths if library in os.path.basename(p))
            if libraries is _RUNTIMES and len(found) != 1:
                continue
            for path in found:
                try:
                    return getattr(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY), name)
                except (OSError, AttributeError):
                    continue
    return None


def pin_host(tensor: torch.Tensor) -> bool:
    """Page-lock the host memory of the contiguous CPU ``tensor`` in place, for
    asynchronous copies to and from this process's accelerator (in the current device's
    context: ``on_device`` the device the buffer serves); True when done.

    The pages stay the caller's alone: ``unpin_host`` releases exactly them, where memory
    from torch's pinned caching allocator could only be given back by emptying that
    process-wide cache, every other cached block with it (a DataLoader's ``pin_memory``
    batches). False, nothing changed, where the runtime cannot register host memory (no
    accelerator, or a backend without the calls: the caller may take ``pinned_empty``'s
    memory instead), ``tensor`` does not start on a page boundary or shares a page with
    memory registered here, or the runtime refused (``_REFUSALS``: the system's page-locked
    limit; warned with the size, its latched error cleared: [Note: a refused
    registration]). Raises ``RuntimeError`` for any other runtime error."""
    calls = _host_registration()
    if calls is None or tensor.nbytes == 0:
        return False
    pages = _pages(tensor)
    with _pinned_lock:
        if tensor.data_ptr() % _PAGE or any(
            first < pages[1] and pages[0] < end for first, end in _pinned_pages.values()
        ):
            return False
        code = int(calls[0](tensor.data_ptr(), tensor.nbytes, _REGISTER_PORTABLE))
        if code != 0:
            _clear_last_error(calls[2])
        if code == 0:
            _pinned_pages[tensor.data_ptr()] = pages
            return True
    if code not in _REFUSALS:
        raise RuntimeError(
            f"page-locking {tensor.nbytes} bytes of host memory failed with runtime error "
            f"{code}, which is not a refusal of the registration (1, 2, 712, 801): the "
            "device is unusable"
        )
    logger.warning(
        "could not page-lock %d bytes of host memory (runtime error %d); uploads use "
        "pageable memory and are synchronous",
        tensor.nbytes,
        code,
    )
    return False


def unpin_host(tensor: torch.Tensor) -> None:
    """Undo ``pin_host(tensor)``: call it with the same tensor once no copy reads or
    writes it any more, before its memory is freed. Nothing else of the process is touched."""
    calls = _host_registration()
    assert calls is not None, "unpin_host without a runtime that pinned it"
    with _pinned_lock:
        _pinned_pages.pop(tensor.data_ptr(), None)
        code = int(calls[1](tensor.data_ptr()))
        if code != 0:
            _clear_last_error(calls[2])
    if code != 0:
        logger.warning(
            "unpinning %d bytes of host memory failed (runtime error %d)", tensor.nbytes, code
        )


def pinned_bytes() -> int:
    """Bytes of whole pages ``pin_host`` registered and ``unpin_host`` did not release."""
    with _pinned_lock:
        return sum((end - first) * _PAGE for first, end in _pinned_pages.values())
