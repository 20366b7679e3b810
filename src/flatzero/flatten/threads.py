"""Moved to ``flatzero.cores``: a rank's share of its host's cores is no part of flattening
(``launch``, ``report``, ``plan``, ``optim`` and ``bench`` use it too), so it lives on a
floor below them (docs/architecture.md). The names stay importable from here; patch them
on ``flatzero.cores``, where they are looked up.
"""

from __future__ import annotations

from ..cores import (
    LAUNCHER_LOCAL_SIZES,
    CoreShare,
    cgroup_cpu_quota,
    core_share,
    host_identity,
    host_threads,
    init_threads,
    launcher_local_size,
    usable_cores,
)

__all__ = [
    "LAUNCHER_LOCAL_SIZES",
    "CoreShare",
    "cgroup_cpu_quota",
    "core_share",
    "host_identity",
    "host_threads",
    "init_threads",
    "launcher_local_size",
    "usable_cores",
]
