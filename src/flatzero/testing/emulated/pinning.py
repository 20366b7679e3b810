"""Host memory registration on the emulated device: ``torch.<name>.cudart()``'s calls.

[Note: emulated registration]
With ``install(host_registration=True)`` (the default in the deferred-stream mode) the
emulated device module offers ``cudart()`` with ``cudaHostRegister``,
``cudaHostUnregister`` and ``cudaGetLastError``, over a record of the registered page
ranges, with CUDA's rules: registering a range that shares a page with a registered one
fails with 712 (``cudaErrorHostMemoryAlreadyRegistered``), unregistering what is not
registered with 713, and ``refuse`` makes the next registrations fail with 2 (out of
memory: the system's page-locked limit). A failed call also latches its error, as the
CUDA runtime does: the next op on the device raises it (as torch's check after a kernel
launch does) unless ``cudaGetLastError`` cleared it first. Each call is recorded
(``calls``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["ALREADY_REGISTERED", "NOT_REGISTERED", "OUT_OF_MEMORY", "PAGE", "HostRegistry"]

PAGE = 4096
"""Bytes per host page: registration works on whole pages."""

OUT_OF_MEMORY = 2
ALREADY_REGISTERED = 712
NOT_REGISTERED = 713


@dataclass
class HostRegistry:
    """The registered host ranges of one process and its latched error (see
    [Note: emulated registration]).

    Attributes:
        ranges: start address -> (first page, end page) of each registered range.
        refuse: how many of the next registrations fail with ``OUT_OF_MEMORY``.
        last_error: the latched error (0: none).
        calls: (call, address, bytes) of every register and unregister call, in order.
    """

    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)
    refuse: int = 0
    last_error: int = 0
    calls: list[tuple[str, int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def registered_bytes(self) -> int:
        """Bytes of whole pages registered now."""
        return sum((end - first) * PAGE for first, end in self.ranges.values())

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        pages = (ptr // PAGE, -(-(ptr + nbytes) // PAGE))
        with self.lock:
            self.calls.append(("register", ptr, nbytes))
            if self.refuse > 0:
                self.refuse -= 1
                return self._fail(OUT_OF_MEMORY)
            if any(first < pages[1] and pages[0] < end for first, end in self.ranges.values()):
                return self._fail(ALREADY_REGISTERED)
            self.ranges[ptr] = pages
            return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        with self.lock:
            self.calls.append(("unregister", ptr, 0))
            if self.ranges.pop(ptr, None) is None:
                return self._fail(NOT_REGISTERED)
            return 0

    def cudaGetLastError(self) -> int:
        with self.lock:
            error, self.last_error = self.last_error, 0
            return error

    def _fail(self, code: int) -> int:
        self.last_error = code
        return code

    def raise_latched(self) -> None:
        """(Before a device op.) Raise the latched error, clearing it, as torch's check
        after a kernel launch does."""
        error = self.cudaGetLastError()
        if error:
            raise RuntimeError(f"CUDA error: runtime error {error} latched by an earlier call")
