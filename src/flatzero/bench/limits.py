"""Moved to ``flatzero.measure.limits`` (``flatzero plan`` measures with it too, and the
product imports nothing from ``bench``); the names stay importable from here."""

from __future__ import annotations

from ..measure.limits import (
    DEFAULT_CHUNK_BYTES,
    SETTLE_SECONDS,
    CopyLimit,
    device_copy_seconds,
    first_touch_seconds,
    memcpy_seconds,
    pinned_h2d_seconds,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "SETTLE_SECONDS",
    "CopyLimit",
    "device_copy_seconds",
    "first_touch_seconds",
    "memcpy_seconds",
    "pinned_h2d_seconds",
]
