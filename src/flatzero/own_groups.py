"""The control group: host-side agreement that never waits behind GPU collectives.

flatzero's ranks agree on small things (a tier, an out-of-memory error, a checkpoint's
progress) with tiny all-reduces. On an NCCL group those would queue behind the GPU's work
and, while one rank spends minutes writing a checkpoint, trip the NCCL watchdog. So they
run on a gloo group over the same ranks: the process group itself when its backend runs
on the host, else one created for it.

A control group is created once per set of ranks and reused by every flatten call,
optimizer and checkpoint over them. Over all ranks of the job every rank creates it;
over a data-parallel subgroup inside tensor parallelism only the subgroup's ranks do
(``use_local_synchronization``), after checking that torch will name it the same on each
of them (``prepare_control_groups`` creates them all at once when it would not). It lives
as long as its process group: it is destroyed with them by
``torch.distributed.destroy_process_group()``. (Destroying it earlier and creating it
again would reuse its rendezvous prefix in the store, which torch derives from the ranks
and the number of groups, and meet the previous group's stale keys.)

The optimizer's reductions and gathers run on a group of flatzero's own too
(``collective_group``): the same ranks and backend as the user's group, created once the
same way. Stage 2 issues its reductions during backward at points that differ between
ranks (as each rank's gradients arrive); a user's collective inside backward on the same
group (SyncBatchNorm, a mixture-of-experts all-to-all) would then meet a different
collective of ours on each rank: a gloo error, an NCCL hang. DeepSpeed clones the group
for the same reason.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch.distributed as dist

from .comm import all_reduce_max_each, world_size_of
from .devices import collectives_run_on_cpu
from .process_group import job_timeout

__all__ = ["collective_group", "control_group", "prepare_control_groups"]

logger = logging.getLogger(__name__)

_controls: dict[tuple[int, ...], dist.ProcessGroup] = {}
"""Control groups by the global ranks they span (any process group over those ranks
shares one)."""

_collectives: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}
"""flatzero's own collective groups by the global ranks they span and their backend."""

_shared: dict[tuple[tuple[int, ...], str], dist.ProcessGroup] = {}
"""Ranks and backends whose reductions share the user's group (``collective_group``), with
the default group they were decided under (void once the job's groups are made again)."""


def _separate_control_needed(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` needs a gloo group of its own for host-side agreement."""
    return not collectives_run_on_cpu(group)


def _alive(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still registered (not destroyed with the job's groups).
    ``get_rank`` checks that; ``get_world_size`` answers for a destroyed group too."""
    try:
        dist.get_rank(group)
    except (ValueError, RuntimeError):
        return False
    return True


def _new_control(ranks: list[int], *, everyone_calls: bool) -> dist.ProcessGroup:
    control = dist.new_group(
        ranks=ranks,
        backend="gloo",
        timeout=job_timeout(),
        use_local_synchronization=not everyone_calls,
        group_desc="flatzero control",
    )
    _controls[tuple(ranks)] = control
    logger.debug("created a gloo control group over ranks %s", ranks)
    return control


def prepare_control_groups(rank_lists: Sequence[Sequence[int]]) -> None:
    """Create the control groups of several process groups at once, and flatzero's own
    collective groups over them (``collective_group``, with the default group's backend),
    on every rank of the job, in the same order everywhere (what
    ``torch.distributed.new_group`` asks).

    Call it right after creating data-parallel subgroups (e.g. with the same rank lists
    as ``dist.new_subgroups_by_enumeration``) when ranks of the job have created
    different sets of other process groups; ``control_group`` and ``collective_group``
    then find them instead of creating them over the subgroup's ranks alone. Collective
    over the whole job.
    """
    backend = str(dist.get_backend())
    keys = [tuple(sorted(int(r) for r in ranks)) for ranks in rank_lists]
    missing = all_reduce_max_each([int(not _prepared(key, backend)) for key in keys], None)
    for key, needed in zip(keys, missing, strict=True):
        if not needed:  # [Note: every rank of the job decides alike]
            continue
        control = _new_control(list(key), everyone_calls=True)
        if dist.get_rank() not in key:
            del _controls[key]  # torch's placeholder for a group this rank is not in
        del control
        if len(key) > 1:
            ours = dist.new_group(
                ranks=list(key),
                backend=backend,
                timeout=job_timeout(),
                group_desc="flatzero collectives",
            )
            if dist.get_rank() in key:
                _collectives[(key, backend)] = ours


def _prepared(key: tuple[int, ...], backend: str) -> bool:
    """Whether this rank has nothing to create over ``key`` (it is not in it, or it has
    both groups alive).

    [Note: every rank of the job decides alike] ``prepare_control_groups`` creates a rank
    list's groups with job-wide ``new_group`` calls, which advance torch's group count (its
    name for the next job-wide group) on every rank that makes them. A rank that skipped a
    list its neighbours created would name every later job-wide group differently and wait
    for them forever, so the ranks all-reduce whether any member lacks a group, and skip a
    list only together.
    """
    if dist.get_rank() not in key:
        return True
    control = _controls.get(key)
    ours = _collectives.get((key, backend))
    return (
        control is not None
        and _alive(control)
        and (len(key) == 1 or (ours is not None and _alive(ours)))
    )


def _splits_the_default_group() -> bool:
    """Whether a new NCCL group is split off the default group's communicator (the default
    group is bound to a device: ``init_process_group(device_id=...)``), which every rank of
    the job must take part in (pytorch#129965)."""
    return dist.distributed_c10d._get_default_group().bound_device_id is not None


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The group for host-side agreement among ``group``'s ranks (``None``: the default
    group, or no group at all).

    Collective the first time it is called for a ``group`` with an NCCL-only backend.
    Over all ranks of the job, every rank creates it (torch names it by the job's group
    count, the same everywhere). Over a subgroup, only its ranks take part
    (``use_local_synchronization``); torch then names it by its ranks and by how many
    groups each rank has registered, so the subgroup's ranks first check that those
    counts agree, and raise ``RuntimeError`` naming the fix (``prepare_control_groups``)
    when they do not, rather than wait in different rendezvous until a timeout.
    """
    if world_size_of(group) == 1 or not _separate_control_needed(group):
        return group
    parent = group if group is not None else dist.group.WORLD
    ranks = sorted(dist.get_process_group_ranks(parent))
    key = tuple(ranks)
    control = _controls.get(key)
    if control is not None and _alive(control):
        return control
    if len(ranks) == dist.get_world_size():
        return _new_control(ranks, everyone_calls=True)
    _check_group_counts_agree(parent, ranks)
    return _new_control(ranks, everyone_calls=False)


def collective_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """flatzero's own group for the optimizer's reductions and gathers over ``group``'s
    ranks, with ``group``'s backend and the job's timeout (``job_timeout``); ``group`` itself
    at world size 1. Created once per set of ranks and backend, as ``control_group`` creates
    its groups (every rank of the job calls ``new_group`` when ``group`` spans the job, the
    group's ranks only otherwise, after the same naming check), and reused. Where that check
    fails (a subgroup's ranks registered different numbers of groups), or the default group
    is bound to a device (a new NCCL group is then split off it by every rank of the job,
    so the subgroup's ranks alone would hang) and ``prepare_control_groups`` did not make
    it, ``group`` itself,
    with one warning naming ``prepare_control_groups``: reductions share the user's group,
    as before there was a group of flatzero's own.

    Collective over ``group`` the first time (over the whole job when it spans the job).
    """
    if world_size_of(group) == 1:
        return group
    parent = group if group is not None else dist.group.WORLD
    ranks = sorted(dist.get_process_group_ranks(parent))
    backend = str(dist.get_backend(parent))
    key = (tuple(ranks), backend)
    ours = _collectives.get(key)
    if ours is not None and _alive(ours):
        return ours
    default = dist.distributed_c10d._get_default_group()
    if _shared.get(key) is default:
        return group
    everyone_calls = len(ranks) == dist.get_world_size()
    if not everyone_calls and (_splits_the_default_group() or not _group_counts_agree(parent)):
        _shared[key] = default  # until the job's groups are destroyed and made again
        logger.warning(
            "flatzero's reductions over ranks %s share their process group: a group of "
            "flatzero's own made by those ranks alone would hang (the default group is bound "
            "to a device, so a new group is split off its communicator by every rank of the "
            "job) or get a different rendezvous name on each (those ranks registered "
            "different numbers of process groups). A collective of yours inside "
            "backward on that group can then hang; call flatzero.own_groups."
            "prepare_control_groups(<the rank lists of every data-parallel group>) on every "
            "rank right after creating those groups",
            ranks,
        )
        return group
    ours = dist.new_group(
        ranks=ranks,
        backend=backend,
        timeout=job_timeout(),
        use_local_synchronization=not everyone_calls,
        group_desc="flatzero collectives",
    )
    _collectives[key] = ours
    logger.debug("created flatzero's %s group over ranks %s", backend, ranks)
    return ours


def _registered_groups() -> int:
    """How many process groups this rank has registered (torch's naming input)."""
    return len(dist.distributed_c10d._world.pg_names)


def _group_counts_agree(parent: dist.ProcessGroup) -> bool:
    """Whether ``parent``'s ranks have registered as many process groups each (torch names a
    group made by some ranks only by its ranks and that count). Collective on ``parent``."""
    count = _registered_groups()
    high, neg_low = all_reduce_max_each([count, -count], parent)
    return high == -neg_low


def _check_group_counts_agree(parent: dist.ProcessGroup, ranks: list[int]) -> None:
    if not _group_counts_agree(parent):
        raise RuntimeError(
            f"cannot create a flatzero group over ranks {ranks}: those ranks have "
            "registered different numbers of process groups, so "
            "torch would give the group a different rendezvous name on each of them and "
            "they would wait for each other until a timeout. Call "
            "flatzero.own_groups.prepare_control_groups(<the rank lists of every "
            "data-parallel group>) on every rank right after creating those groups"
        )
