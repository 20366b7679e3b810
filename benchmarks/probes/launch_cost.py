"""What a rank launch costs the test suite: a torch import in a fresh interpreter, and an
empty 2-rank ``flatzero.launch.run_ranks`` started with ``spawn`` against one forked from
the preloaded server (``preload_rank_processes``, as ``tests/conftest.py`` does).

    PYTHONPATH=src:benchmarks python benchmarks/probes/launch_cost.py

Each figure ``TRIALS`` times (wall seconds; the import also in CPU seconds of the child);
the server's first launch, which starts it, is reported apart. Prints one JSON line.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import subprocess
import sys
import time

from flatzero import launch
from flatzero_bench.common.machine import describe_host
from flatzero_bench.common.provenance import utc_timestamp

TRIALS = 3


def _empty(rank: int, world_size: int) -> int:
    return rank


def _torch_import() -> tuple[float, float]:
    """(wall s, CPU s) of ``python -c "import torch"``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return wall, cpu


def _launches(count: int) -> list[float]:
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        assert launch.run_ranks(_empty, 2) == [0, 1]
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    load_before = os.getloadavg()
    date = utc_timestamp()
    imports = [_torch_import() for _ in range(TRIALS)]
    spawn = _launches(TRIALS)
    launch.preload_rank_processes()
    server_start = _launches(1)[0]
    forked = _launches(TRIALS)
    print(
        json.dumps(
            {
                "probe": "launch_cost",
                "command": "PYTHONPATH=src:benchmarks python benchmarks/probes/launch_cost.py",
                "date": date,
                "machine": describe_host(load_before),
                "torch_import_wall_s": [w for w, _ in imports],
                "torch_import_cpu_s": [c for _, c in imports],
                "empty_2rank_spawn_s": spawn,
                "empty_2rank_first_forkserver_s": server_start,
                "empty_2rank_forkserver_s": forked,
            }
        )
    )


if __name__ == "__main__":
    mp.set_start_method("spawn")
    main()
