"""This process's usable cores, a rank's share of them, the intra-op thread cap of init.

DeepSpeed issue #7677: eight ranks of a node each flattened on the CPU with every core,
2,244 CPU-minutes for a 19-minute init. A rank here uses its share of the cores, and all
of it, whatever ``OMP_NUM_THREADS`` says: on the host, what bounds a fresh bucket or
master shard is the first touch of its pages (a page fault per page), which spreads over
threads, and the upload tiers fill pinned staging buffers that the GPU drains faster than
one thread's memcpy. How the share is counted: [Note: a rank's core share].
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
import torch.distributed as dist

from .comm import world_size_of
from .config import FlattenConfig
from .own_groups import control_group
from .words import plural

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

logger = logging.getLogger(__name__)

_MOUNTINFO = Path("/proc/self/mountinfo")
_PROC_CGROUP = Path("/proc/self/cgroup")
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

LAUNCHER_LOCAL_SIZES = (
    "LOCAL_WORLD_SIZE",  # torchrun
    "LOCAL_SIZE",  # the DeepSpeed launcher
    "OMPI_COMM_WORLD_LOCAL_SIZE",  # Open MPI's mpirun
    "MPI_LOCALNRANKS",  # MPICH, Intel MPI
    "SLURM_NTASKS_PER_NODE",  # srun --ntasks-per-node
)
"""The variables in which launchers say how many ranks they started on this node, in
the order they are read (torchrun under srun: ``LOCAL_WORLD_SIZE`` first). Over a group
that spans the job they are compared with the count and logged; over a subgroup they are a
floor of the count ([Note: a rank's core share])."""


@dataclass(frozen=True)
class CoreShare:
    """A rank's share of its host's cores, and how it was derived.

    Attributes:
        threads: the share: intra-op threads this rank may use (>= 1).
        affinity_cores: CPUs in this process's affinity mask.
        quota_cores: the cgroup CPU quota in cores (``1.5``: 150 ms per 100 ms period),
            or None without one.
        ranks_on_host: ranks of the job on this host (this one included): counted
            through the process group, and at least the launcher's count when the group
            is a subgroup of the job.
        ranks_sharing_cores: of those, the ranks whose affinity overlaps this rank's (a
            rank outside the group counts as overlapping).
        launcher_says: the launcher's own count of ranks on this node as ``NAME=value``
            (``LAUNCHER_LOCAL_SIZES``), or None; for cross-checking only.
    """

    threads: int
    affinity_cores: int
    quota_cores: float | None
    ranks_on_host: int
    ranks_sharing_cores: int
    launcher_says: str | None

    def describe(self) -> str:
        """One line: the share and the numbers it came from."""
        quota = ""
        if self.quota_cores is not None:
            quota = (
                f"; quota {self.quota_cores:g} cores / {plural(self.ranks_on_host, 'rank')} on host"
            )
        launcher = f"; launcher: {self.launcher_says}" if self.launcher_says else ""
        return (
            f"{plural(self.threads, 'thread')} per rank ({plural(self.affinity_cores, 'core')} in "
            f"affinity / {plural(self.ranks_sharing_cores, 'rank')} sharing them{quota}{launcher})"
        )


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _affinity() -> frozenset[int]:
    """The CPUs this process may run on (every CPU where the OS has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class _CgroupMount:
    """A cgroup hierarchy with the cpu controller, as ``/proc/self/mountinfo`` shows it.

    Attributes:
        mount_point: where it is mounted.
        root: the cgroup path shown at ``mount_point`` (``/`` unless a container mounts
            its own cgroup without a cgroup namespace).
        version: 1 or 2.
    """

    mount_point: Path
    root: str
    version: int


def _unescape(field: str) -> str:
    """A mountinfo field with its octal escapes (``\\040`` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cpu_cgroup_mounts(mountinfo: str) -> list[_CgroupMount]:
    """Every cgroup v2 mount and every v1 mount of the cpu controller."""
    mounts = []
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields, fs = before.split(), after.split()
        if not sep or len(fields) < 5 or len(fs) < 3:
            continue
        v1_cpu = fs[0] == "cgroup" and "cpu" in fs[2].split(",")
        if fs[0] == "cgroup2" or v1_cpu:
            mounts.append(
                _CgroupMount(Path(_unescape(fields[4])), _unescape(fields[3]), 1 if v1_cpu else 2)
            )
    return mounts


def _process_cgroup(proc_cgroup: str, version: int) -> str | None:
    """This process's cgroup path in the v2 hierarchy, or in v1's cpu hierarchy."""
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if version == 2 and hierarchy == "0" and not controllers:
            return path
        if version == 1 and "cpu" in controllers.split(","):
            return path
    return None


def _cgroup_dirs(mount: _CgroupMount, path: str) -> list[Path]:
    """The directory of cgroup ``path`` under ``mount`` and its ancestors up to the mount
    point, innermost first. A path outside the mount's root, or one whose directory is
    not there (a container's view), is the mount point itself."""
    leaf = mount.mount_point
    if PurePosixPath(path).is_relative_to(mount.root):
        candidate = mount.mount_point / PurePosixPath(path).relative_to(mount.root)
        if candidate.is_dir():
            leaf = candidate
    chain = [leaf, *leaf.parents]
    return chain[: chain.index(mount.mount_point) + 1]


def _quota_cores(quota: str, period: str) -> float | None:
    """``quota / period`` in cores; None for no limit (``max``, a negative quota, or
    text that is not a pair of integers)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _limit_in(directory: Path, version: int) -> float | None:
    """The CPU quota set in one cgroup directory, in cores (None: none set)."""
    if version == 2:
        text = _read(directory / "cpu.max")  # "max 100000" or "150000 100000"
        parts = text.split() if text else []
        return _quota_cores(parts[0], parts[1]) if len(parts) == 2 else None
    quota = _read(directory / "cpu.cfs_quota_us")  # -1 without a limit
    period = _read(directory / "cpu.cfs_period_us")
    return _quota_cores(quota, period) if quota and period else None


def cgroup_cpu_quota(
    mountinfo: Path = _MOUNTINFO, proc_cgroup: Path = _PROC_CGROUP
) -> float | None:
    """Cores the cgroup CPU quota lets this process use: the tightest quota of its cgroup
    and the cgroup's ancestors (v2 ``cpu.max``; v1 ``cpu.cfs_quota_us`` over
    ``cpu.cfs_period_us``), e.g. ``1.5`` for ``150000 100000``. None without a quota, or
    where there are no cgroups to read (not Linux).

    Args:
        mountinfo: the mount table to find the cgroup hierarchies in.
        proc_cgroup: the process's cgroup membership (``/proc/self/cgroup``).
    """
    mounts, membership = _read(mountinfo), _read(proc_cgroup)
    if mounts is None or membership is None:
        return None
    limits = []
    for mount in _cpu_cgroup_mounts(mounts):
        path = _process_cgroup(membership, mount.version)
        if path is None:
            continue
        for directory in _cgroup_dirs(mount, path):
            limit = _limit_in(directory, mount.version)
            if limit is not None:
                limits.append(limit)
    return min(limits, default=None)


def usable_cores() -> int:
    """Cores this process may use: the CPUs of its affinity mask, capped by the cgroup
    CPU quota rounded down; at least 1."""
    quota = cgroup_cpu_quota()
    cores = len(_affinity())
    return max(1, cores if quota is None else min(cores, math.floor(quota)))


def host_identity() -> str:
    """What ranks on the same host share: the host name and the kernel's boot id."""
    return f"{socket.gethostname()} {_read(_BOOT_ID) or ''}".strip()


def launcher_local_size() -> tuple[str, int] | None:
    """The first of ``LAUNCHER_LOCAL_SIZES`` set to an integer, as (name, value)."""
    for name in LAUNCHER_LOCAL_SIZES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return name, int(value)
    return None


def _gather(item: tuple[str, int], group: dist.ProcessGroup | None) -> list[tuple[str, int]]:
    """``item`` of every rank of ``group``'s control group (one all-gather)."""
    control = control_group(group)
    size = world_size_of(control)
    if size == 1:
        return [item]
    items: list[tuple[str, int] | None] = [None] * size
    dist.all_gather_object(items, item, group=control)
    return [i for i in items if i is not None]


# [Note: a rank's core share]
# The share (``core_share``), with no launcher's variable as its source:
#
# - cores: the CPUs of this process's affinity mask (``os.sched_getaffinity``) and the
#   cgroup CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``;
#   the tightest of the process's cgroup and its ancestors), in cores;
# - ranks: one all-gather, over the group's control group, of each rank's host identity
#   (host name and kernel boot id) and affinity mask. ``ranks_on_host`` counts the ranks
#   with this rank's identity; ``ranks_sharing_cores`` those of them whose affinity
#   overlaps this rank's (all of them unless the launcher pinned ranks to cores);
# - a subgroup (data parallel inside tensor parallelism: one rank per host in each
#   data-parallel group) sees only its own ranks, while every rank of the job on this host
#   shares its cores. There the launcher's count of ranks on this node
#   (``LAUNCHER_LOCAL_SIZES``) is a floor of ``ranks_on_host``, and the ranks the group does
#   not show count as sharing this rank's cores (their affinity is unknown): never more
#   threads than cores, at the price of fewer than the share where ranks are pinned. A
#   launcher that sets none of them (``mp.spawn``) leaves the count to the group:
#   ``FlattenConfig.host_threads`` and ``OffloadConfig.threads`` set it by hand;
# - ``threads = max(1, min(affinity_cores // ranks_sharing_cores,
#   floor(quota / ranks_on_host)))`` (the quota term only where there is a quota). When
#   every rank may run on every core this is ``usable_cores() // ranks_on_host``.
#
# Over a group that spans the job the launchers' own counts are only compared with the
# count and logged when they differ (network namespaces of one kernel: torchrun says 2 per
# "node", 4 ranks share the cores).


def _share(cores: int, quota: float | None, on_host: int, sharing: int) -> int:
    """Threads for one rank: its cores over the ranks sharing them, and the quota over
    the ranks on the host; at least 1."""
    by_affinity = cores // sharing
    if quota is None:
        return max(1, by_affinity)
    return max(1, min(by_affinity, math.floor(quota / on_host)))


def _cross_check(share: CoreShare, launcher: tuple[str, int] | None) -> None:
    """Log a warning when the launcher's count of ranks on this node is not the count."""
    if launcher is not None and launcher[1] != share.ranks_on_host:
        logger.warning(
            "%s=%d says %d rank(s) run on this host; flatzero counted %d of its process "
            "group through the group itself and shares the cores by the count (%s). "
            "FlattenConfig.host_threads sets the threads by hand",
            *launcher,
            launcher[1],
            share.ranks_on_host,
            share.describe(),
        )


def _spans_the_job(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` has every rank of the job (no process group: one rank, alone)."""
    return not dist.is_initialized() or world_size_of(group) == dist.get_world_size()


def core_share(group: dist.ProcessGroup | None) -> CoreShare:
    """This rank's share of its host's cores among the job's ranks on this host, counted
    through ``group`` ([Note: a rank's core share]). Collective: one all-gather on
    ``group``'s control group (none without a process group).
    """
    cpus = _affinity()
    mask = sum(1 << cpu for cpu in cpus)
    me = host_identity()
    peers = [m for host, m in _gather((me, mask), group) if host == me]
    on_host, sharing = len(peers), sum(1 for m in peers if m & mask)
    launcher = launcher_local_size()
    if launcher is not None and not _spans_the_job(group):
        unseen = max(0, launcher[1] - on_host)  # ranks of other groups: they may share
        on_host, sharing = on_host + unseen, sharing + unseen
    quota = cgroup_cpu_quota()
    share = CoreShare(
        threads=_share(len(cpus), quota, on_host, sharing),
        affinity_cores=len(cpus),
        quota_cores=quota,
        ranks_on_host=on_host,
        ranks_sharing_cores=sharing,
        launcher_says=f"{launcher[0]}={launcher[1]}" if launcher else None,
    )
    _cross_check(share, launcher)
    return share


def host_threads(config: FlattenConfig, share: int) -> int:
    """Intra-op threads for flattening: ``config.host_threads`` if set, else the rank's
    ``share`` of the cores (``CoreShare.threads``)."""
    if config.host_threads is not None:
        return config.host_threads
    return share


@contextmanager
def init_threads(threads: int) -> Iterator[int]:
    """Run with exactly ``threads`` intra-op threads, whatever ``OMP_NUM_THREADS`` (torchrun
    sets 1) or an earlier ``torch.set_num_threads`` said: init owns the rank's share. The
    previous setting is restored afterwards, also when the body raises. Yields the count
    torch reports inside."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
