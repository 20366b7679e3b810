"""What every launched trial (one process per rank, under ``torchrun``) does around its
measurement: join the gloo group, gather each rank's record, print them on rank 0 as one
marked JSON line for the parent, leave the group, and end without the interpreter's
teardown."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["exit_now", "report_ranks"]


def report_ranks(marker: str, door: str, measure: Callable[[], dict[str, Any]]) -> int:
    """Join the gloo process group, run ``measure()`` on this rank, gather every rank's
    record (with its ``rank`` added) and, on rank 0, print ``{"door", "world_size",
    "ranks"}`` as one line prefixed with ``marker`` (the parent parses it); leave the group
    whatever happens. Returns the process's exit code, 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        mine = measure() | {"rank": rank}
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            record = {"door": door, "world_size": world, "ranks": gathered}
            sys.stdout.write(marker + json.dumps(record) + "\n")
            sys.stdout.flush()
    finally:
        dist.destroy_process_group()
    return 0


def exit_now(code: int) -> None:
    """Flush and end the process without the interpreter's teardown: gloo's and OpenMP's
    threads sometimes abort it ("terminate called without an active exception") after
    the result is out."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
