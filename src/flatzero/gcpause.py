"""Python's cyclic garbage collector, paused while init builds thousands of small objects.

Init makes a few objects per parameter (views, hooks, layout records): tens of thousands
for a model with thousands of tensors. Each allocation burst triggers the cyclic
collector, whose full passes walk every live object of the process; measured on the
unfused Qwen3-MoE shape (6,291 tensors), they were a third of ``flatzero.initialize``
(0.25-0.35 s of 0.7-0.95 s). Those objects are not garbage, so pausing the collector
frees nothing later than it would have been: reference counting still frees everything
as usual, and the collector resumes, as it was, on the way out.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["paused_gc"]


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic collector inside (a decorator too); restore its state after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
