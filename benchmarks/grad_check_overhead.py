"""What the gradient check (``ZeroConfig.check_gradients``) costs a training step (issue 42).

Trains a bench model with ZeRO stage 2, clipping (``max_grad_norm``) and the check on,
over gloo on this host's CPUs, steps alternating check on / check off, and times on every
rank the whole step (forward, backward, ``step()``) and the time spent inside the check:
its own work (``GradCheck.local`` per staged chunk, ``GradCheck.land`` and
``GradCheck.compare`` per step) and what its scalars add to the gradient norm's
all-reduce they ride on (that all-reduce's time in checked steps less in unchecked ones;
[Note: the check rides on the norm]). The overhead is the check's share of the unchecked
step, per rank, over the timed steps; timing the check from inside the same steps keeps
the number steady on a shared, loaded machine where two separate runs would differ by
more than what is measured (the step-time difference, ``overhead_ab``, is reported too).
Writes a JSON result:

    PYTHONPATH=src:benchmarks python benchmarks/grad_check_overhead.py llama-22m 2 \
        benchmarks/results/grad_check_overhead_cpu_llama-22m_ws2.json
"""

import json
import os
import platform
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist

from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.models import build_model
from flatzero.models.bench_models import STEP_MODELS
from flatzero.optim import ZeroConfig, ZeroOptimizer, grad_check, norm
from flatzero.optim.grad_check import GradCheck
from flatzero_bench.common.machine import describe_host

WARMUP, STEPS, BATCH, SEQ = 2, 20, 1, 32
"""Untimed steps, timed steps with the check (as many without), the bench step's batch."""


def _timed(totals: dict[str, float], key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start

    return wrapper


def _rank(rank: int, world: int, model_name: str) -> dict[str, float]:
    torch.set_num_threads(1)
    keys = ("local_s", "land_s", "compare_s", "norm_on_s", "norm_off_s", "own_all_reduces")
    totals = dict.fromkeys(keys, 0.0)
    GradCheck.local = _timed(totals, "local_s", GradCheck.local)
    GradCheck.land = _timed(totals, "land_s", GradCheck.land)
    GradCheck.compare = _timed(totals, "compare_s", GradCheck.compare)
    on = False  # the step being timed is a checked one

    def norm_all_reduce(*args, **kwargs):
        return _timed(totals, "norm_on_s" if on else "norm_off_s", dist.all_reduce)(*args, **kwargs)

    def own_all_reduce(*args, **kwargs):
        totals["own_all_reduces"] += 1
        return dist.all_reduce(*args, **kwargs)

    norm.dist = types.SimpleNamespace(all_reduce=norm_all_reduce, ReduceOp=dist.ReduceOp)
    grad_check.dist = types.SimpleNamespace(all_reduce=own_all_reduce)
    config = STEP_MODELS[model_name]()
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=0)
    opt = ZeroOptimizer(
        model,
        lr=1e-4,
        config=ZeroConfig(stage=2, check_gradients=True, max_grad_norm=1.0),
        flatten_config=FlattenConfig(device="cpu", progress=False),
    )
    gen = torch.Generator().manual_seed(rank)
    check = opt._reducer.check
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(WARMUP + 2 * STEPS):
        if step == WARMUP:
            totals.update(dict.fromkeys(keys, 0.0))
        on = step % 2 == 0  # steps alternate: check on, check off
        opt._reducer.check = check if on else None
        ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=gen)
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= WARMUP:
            times[on].append(time.perf_counter() - start)
    on_s, off_s = statistics.median(times[True]), statistics.median(times[False])
    own_s = (totals["local_s"] + totals["land_s"] + totals["compare_s"]) / STEPS
    riding_s = (totals["norm_on_s"] - totals["norm_off_s"]) / STEPS
    return {
        "step_on_median_s": on_s,
        "step_off_median_s": off_s,
        "overhead_ab": on_s / off_s - 1,
        "check_local_s": totals["local_s"] / STEPS,
        "check_land_s": totals["land_s"] / STEPS,
        "check_compare_s": totals["compare_s"] / STEPS,
        "norm_all_reduce_on_s": totals["norm_on_s"] / STEPS,
        "norm_all_reduce_off_s": totals["norm_off_s"] / STEPS,
        "check_own_all_reduces": int(totals["own_all_reduces"]),
        "overhead_compute": own_s / off_s,
        "overhead_riding": riding_s / off_s,
        "overhead_timed": (own_s + riding_s) / off_s,
        "checks": check.verified,
    }


def main() -> None:
    model_name, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    load = os.getloadavg()
    rows = run_ranks(_rank, world, model_name)
    result = {
        "benchmark": "grad_check_overhead",
        "command": "PYTHONPATH=src:benchmarks python benchmarks/grad_check_overhead.py "
        + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": describe_host(load),
        "spec": {
            "model": model_name,
            "world_size": world,
            "dtype": "bf16",
            "stage": 2,
            "max_grad_norm": 1.0,
            "batch": BATCH,
            "seq": SEQ,
            "warmup": WARMUP,
            "steps": STEPS,
            "threads_per_rank": 1,
            "python": platform.python_version(),
        },
        "ranks": rows,
        "max_overhead_timed": max(r["overhead_timed"] for r in rows),
        "max_overhead_compute": max(r["overhead_compute"] for r in rows),
        "max_overhead_riding": max(r["overhead_riding"] for r in rows),
        "overhead_ab": statistics.mean(r["overhead_ab"] for r in rows),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
