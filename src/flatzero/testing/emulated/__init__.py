"""An emulated accelerator: a pure-Python PrivateUse1 backend over CPU memory.

flatzero's device half (the device, upload, sharded and host_park tiers, the out-of-memory
ladder, peak device memory, streams and events, collectives on device tensors) has to run
where there is no GPU, in CI. :func:`install` registers a backend that torch treats as an
accelerator like any other (``torch.device("emu", 0)``, ``torch.get_device_module("emu")``,
``init_process_group("cpu:gloo,emu:emu-gloo")``), one job per module: ``state`` (the
device, its capacity and counters), ``storage`` (CPU bytes underneath), ``kernels`` and
``fallback`` (the ops), ``streams`` (synchronous, or deferred: [Note: deferred streams]),
``pinning`` (host registration under CUDA's rules), ``device_module``, ``collectives``
(gloo over CPU aliases) and ``registration``.

Known limits (do not read more into a test on it): the default stream is synchronous, and
side-stream copies too unless the deferred mode is on (``FLATZERO_EMU_STREAMS=deferred``);
there is no pinned allocator (``pin_memory()`` raises once the emulated device is the
process's accelerator; ``install(host_registration=True)`` registers host memory in place);
reserved == allocated (no caching allocator); each op costs ~40x its CPU time.
"""

from .registration import install
from .state import EmulatedDevice, EmulationUnavailable, installed

__all__ = [
    "EmulatedDevice",
    "EmulationUnavailable",
    "install",
    "installed",
]
