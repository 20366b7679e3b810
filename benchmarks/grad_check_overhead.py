"""What the gradient check (``ZeroConfig.check_gradients``) costs a training step (issue 42).

Trains a bench model with ZeRO stage 2 and the check on, over gloo on this host's CPUs,
and times, on every rank, the whole step (forward, backward, ``step()``) and the time
spent inside the check (``GradCheck.local`` per staged chunk, ``GradCheck.verify`` per
step: its projections and its all-reduce). The overhead is the check's share of the step,
per rank, over the timed steps; timing the check from inside the same steps keeps the
number steady on a shared, loaded machine where two separate runs would differ by more
than what is measured. Writes a JSON result:

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
from flatzero.optim import ZeroConfig, ZeroOptimizer, grad_check
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
    totals = {"local_s": 0.0, "verify_s": 0.0, "all_reduce_s": 0.0}
    GradCheck.local = _timed(totals, "local_s", GradCheck.local)
    GradCheck.verify = _timed(totals, "verify_s", GradCheck.verify)
    grad_check.dist = types.SimpleNamespace(
        all_reduce=_timed(totals, "all_reduce_s", dist.all_reduce)
    )  # the check's own all-reduce only
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
            totals.update(local_s=0.0, verify_s=0.0, all_reduce_s=0.0)
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
    check_s = (totals["local_s"] + totals["verify_s"]) / STEPS
    compute_s = check_s - totals["all_reduce_s"] / STEPS
    return {
        "step_on_median_s": on_s,
        "step_off_median_s": off_s,
        "overhead_ab": on_s / off_s - 1,
        "check_local_s": totals["local_s"] / STEPS,
        "check_verify_s": totals["verify_s"] / STEPS,
        "check_all_reduce_s": totals["all_reduce_s"] / STEPS,
        "overhead_timed": check_s / off_s,
        "overhead_compute": compute_s / off_s,
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
        "overhead_ab": statistics.mean(r["overhead_ab"] for r in rows),
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
