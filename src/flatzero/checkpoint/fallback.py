"""The way out of a refused load: the newest checkpoint of the directory that is complete
and verifies.

When a load is refused because the checkpoint is missing, incomplete or corrupt
(``CheckpointDamaged``), the ranks look for the newest other tag (by ``saved_at``) whose
``meta.json`` parses, whose files all exist with their recorded sizes, and every one of
whose checksums holds. The checksums are checked by all ranks together, each rank the
files ``r, r + N, r + 2N, ...`` of the candidate, then agreed on: the cost is one read of
one checkpoint spread over the ranks, paid only on this path. The error then names that
tag, or ``LoadConfig(fallback="newest_valid")`` loads it with a warning.

A load that raced a save replacing its tag (``CheckpointReplaced``: not damaged) is made
once more instead (``again_if_replaced``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from ..comm import all_reduce_max, rank_of, world_size_of
from ..control import wait_for_host_work
from ..own_groups import control_group
from .format import CheckpointDamaged, CheckpointReplaced, available_tags
from .reader import CheckpointReader
from .recovery import complete_meta, saved_time

__all__ = ["again_if_replaced", "newest_valid", "refused", "way_out"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def again_if_replaced(read: Callable[[], _T], where: str) -> _T:
    """``read()`` (a collective load of ``where``), made once more when it raced a save
    replacing the checkpoint (``CheckpointReplaced`` on every rank, see ``load``).

    Raises:
        CheckpointReplaced: it was replaced during the second read too ("being replaced").
    """
    try:
        return read()
    except CheckpointReplaced as error:
        logger.info("%s; loading it again", error)
    try:
        return read()
    except CheckpointReplaced as again:
        raise CheckpointReplaced(
            f"checkpoint {where} is being replaced by another save (twice while loading it): "
            f"{again}"
        ) from again


def _candidates(root: Path, skip: str | None) -> list[str]:
    """Complete tags of ``root`` other than ``skip``, newest first."""
    found = []
    for tag in available_tags(root):
        meta = complete_meta(root / tag)
        if tag != skip and meta is not None:
            found.append((saved_time(root / tag, meta), tag))
    return [tag for _, tag in sorted(found, reverse=True)]


def _agreed_candidates(root: Path, skip: str | None, group: dist.ProcessGroup | None) -> list[str]:
    """Rank 0's ``_candidates``, the same on every rank."""
    control = control_group(group)
    if world_size_of(group) == 1:
        return _candidates(root, skip)
    box = [_candidates(root, skip) if rank_of(group) == 0 else None]
    dist.broadcast_object_list(box, group=control, group_src=0)
    return list(box[0] or [])


def _verifies_here(root: Path, tag: str, rank: int, size: int) -> tuple[bool, int]:
    """Whether this rank's share of ``tag``'s files verify; the bytes it read."""
    try:
        with CheckpointReader(root, tag) as reader:
            mine = list(range(rank, reader.meta.world_size, size))
            reader.verify(mine)
            return True, sum(reader.meta.files[r].bytes for r in mine)
    except (ValueError, OSError) as error:
        logger.info("checkpoint %s does not verify: %s", root / tag, error)
        return False, 0


def newest_valid(
    directory: str | Path, group: dist.ProcessGroup | None, skip: str | None = None
) -> str | None:
    """The newest tag of ``directory`` other than ``skip`` that is complete and whose every
    checksum holds, or None. Collective over ``group`` (each rank verifies its share of
    each candidate's files, newest first, until one verifies everywhere)."""
    root = Path(directory)
    rank, size = rank_of(group), world_size_of(group)
    for tag in _agreed_candidates(root, skip, group):
        ok, nbytes = _verifies_here(root, tag, rank, size)
        wait_for_host_work(group, nbytes)
        if all_reduce_max(int(not ok), control_group(group)) == 0:
            return tag
    return None


def way_out(directory: str | Path, good: str | None) -> str:
    """What a refused load's error ends with: the good tag and how to load it."""
    if good is None:
        return f"no other checkpoint in {directory} is complete and verifies"
    return (
        f"{good} is complete and verifies: load_checkpoint({str(directory)!r}, tag={good!r}) "
        "(or LoadConfig(fallback='newest_valid') to load it instead)"
    )


def refused(error: CheckpointDamaged, directory: str | Path, good: str | None) -> CheckpointDamaged:
    """``error`` with the way out appended."""
    return CheckpointDamaged(f"{error}; {way_out(directory, good)}")
