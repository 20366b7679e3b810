"""``flatzero.launch.run_ranks``: what a rank sees, under ``spawn`` and from the preloaded
fork server the suite uses (``preload_rank_processes`` in ``conftest.py``), and how a
failing rank is reported."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from conftest import RANK_PRELOAD
from flatzero import launch
from flatzero.cores import usable_cores
from flatzero.launch import run_ranks


def _what_a_rank_sees(rank: int, world_size: int) -> dict:
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    return {
        "rank": rank,
        "threads": torch.get_num_threads(),
        "marker": os.environ.get("FLATZERO_TEST_LAUNCH_MARKER"),
        "extra": os.environ.get("FLATZERO_TEST_LAUNCH_EXTRA"),
        "env": (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]),
        "sum": total.item(),
    }


def _fails_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("bad input on rank 1")
    return rank


@pytest.fixture(params=["spawn", "forkserver"])
def start_method(request, monkeypatch) -> str:
    """Both ways ``run_ranks`` starts a rank; the fork server is the suite's."""
    if request.param == "forkserver":
        launch.preload_rank_processes(RANK_PRELOAD)
    monkeypatch.setattr(launch, "_start_method", request.param)
    return request.param


def test_a_rank_sees_the_environment_at_the_launch_and_its_share_of_the_cores(
    start_method, monkeypatch
) -> None:
    # Set after the fork server may have started: a rank must see it all the same.
    monkeypatch.setenv("FLATZERO_TEST_LAUNCH_MARKER", start_method)
    seen = run_ranks(_what_a_rank_sees, 2)
    share = max(1, usable_cores() // 2)
    assert [s["rank"] for s in seen] == [0, 1]
    assert [s["env"] for s in seen] == [("0", "0", "2"), ("1", "1", "2")]
    assert all(s["sum"] == 3.0 for s in seen)
    assert all(s["marker"] == start_method and s["extra"] is None for s in seen)
    assert all(s["threads"] == share for s in seen)

    monkeypatch.delenv("FLATZERO_TEST_LAUNCH_MARKER")
    seen = run_ranks(
        _what_a_rank_sees,
        1,
        env={"OMP_NUM_THREADS": "3", "FLATZERO_TEST_LAUNCH_EXTRA": "x"},
    )
    assert seen[0]["marker"] is None, "a variable removed before the launch stays removed"
    assert seen[0]["extra"] == "x"
    assert seen[0]["threads"] == 3, "an explicit OMP_NUM_THREADS is what the rank runs with"


def test_an_error_on_one_rank_is_raised_with_its_traceback(start_method) -> None:
    with pytest.raises(RuntimeError, match=r"rank 1 failed:[\s\S]*bad input on rank 1"):
        run_ranks(_fails_on_rank_1, 2)


def _late_group_worker(rank: int, world_size: int) -> list[int]:
    """Ranks 2 and 3 make a group of their own well after ranks 0 and 1 returned."""
    if rank < 2:
        return []
    import time

    time.sleep(1.0)
    late = dist.new_group([2, 3], use_local_synchronization=True)
    return dist.get_process_group_ranks(late)


def test_rank_zero_outlives_every_rank_using_its_store() -> None:
    """Rank 0 hosts the store process groups are made through: ranks that finish first
    (one data-parallel subgroup) must not take it down under ranks still making groups."""
    assert run_ranks(_late_group_worker, 4, timeout_s=60) == [[], [], [2, 3], [2, 3]]
