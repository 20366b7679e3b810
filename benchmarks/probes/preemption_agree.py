"""What the preemption agreement costs a step: one all-reduce (MAX) of two int64 host tensors
on the control group (gloo), as ``SignalWatch.agree`` makes at every step boundary.

``PYTHONPATH=src python benchmarks/probes/preemption_agree.py`` writes
``benchmarks/results/preemption_agree_cpu_ws2.json``: the median and 90th percentile of 2000
agreements at 2 ranks on this host (after 200 to warm up), and the load average when run.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from flatzero.checkpoint.preemption import PreemptionConfig, SignalWatch
from flatzero.launch import run_ranks

OUT = Path(__file__).parents[1] / "results" / "preemption_agree_cpu_ws2.json"


def agreements(rank: int, ws: int) -> list[float]:
    watch = SignalWatch(PreemptionConfig(directory="unused"), None)  # handlers not installed
    for _ in range(200):
        watch.agree()
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        watch.agree()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    times = run_ranks(agreements, 2, timeout_s=300)[0]
    times.sort()
    result = {
        "what": "SignalWatch.agree: one gloo all-reduce of 2 int64 on the control group",
        "world_size": 2,
        "n": len(times),
        "median_us": round(statistics.median(times) * 1e6, 1),
        "p90_us": round(times[int(0.9 * len(times))] * 1e6, 1),
        "load_average_1min": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d"),
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
