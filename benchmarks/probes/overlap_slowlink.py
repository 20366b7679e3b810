"""Issue 42 part 1: step time with the parameter all-gathers overlapped vs waited for in
``step()``, on a slow link (``flatzero.testing.slowlink``) with emulated compute.

Each of ``layers`` blocks is a ``Linear(width, width)`` (one bucket each) followed by a
sleep of ``compute_ms`` in forward and again in backward (emulated compute: the machine's
two shared cores would otherwise dominate at 4 ranks). Every collective goes through a
link of ``bytes_per_s``, so one bucket's gather takes ``bucket bytes / bytes_per_s``.
Per setting, ``steps`` iterations (forward, backward, step) are timed after a warm-up;
the median is reported with the model: compute = 2 * layers * compute_ms, one bucket's
gather, all buckets' gathers.

Run: ``PYTHONPATH=src python benchmarks/probes/overlap_slowlink.py --out FILE``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime

import torch
from torch import nn

from flatzero import FlattenConfig, ZeroConfig, ZeroOptimizer
from flatzero.launch import run_ranks
from flatzero.testing.slowlink import slow_link


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class _Block(nn.Module):
    def __init__(self, width: int, seconds: float) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(torch.tanh(self.linear(x)), self.seconds)


def _rank(rank: int, world: int, args: dict, overlap: bool) -> dict:
    torch.manual_seed(0)
    width, layers = args["width"], args["layers"]
    model = nn.Sequential(*(_Block(width, args["compute_ms"] / 1e3) for _ in range(layers)))
    opt = ZeroOptimizer(
        model,
        torch.optim.SGD,
        lr=1e-3,
        config=ZeroConfig(stage=2, overlap_param_gather=overlap),
        flatten_config=FlattenConfig(device="cpu", bucket_numel=width * (width + 1)),
    )
    buckets = len(opt.flat.groups[0].buckets)
    bucket_bytes = opt.flat.groups[0].buckets[0].numel() * 4
    x = torch.randn(8, width)
    times, step_times = [], []
    with slow_link(args["bytes_per_s"]):
        for i in range(args["steps"] + 2):
            t0 = time.perf_counter()
            model(x).sum().backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if i >= 2:  # the first step learns the order; one more warm-up
                times.append(t2 - t0)
                step_times.append(t2 - t1)
        opt.wait_for_params()
    opt.close()
    return {
        "buckets": buckets,
        "bucket_bytes": bucket_bytes,
        "iteration_ms": 1e3 * statistics.median(times),
        "step_call_ms": 1e3 * statistics.median(step_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--bytes-per-s", type=float, default=13e6)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", required=True)
    ns = parser.parse_args()
    args = {k: getattr(ns, k) for k in ("layers", "width", "compute_ms", "bytes_per_s", "steps")}
    rows = []
    for world in ns.ranks:
        for overlap in (False, True):
            per_rank = run_ranks(_rank, world, args, overlap)
            r0 = per_rank[0]
            gather_ms = 1e3 * r0["bucket_bytes"] / ns.bytes_per_s
            rows.append(
                {
                    "ranks": world,
                    "overlap_param_gather": overlap,
                    "iteration_ms_max_over_ranks": max(r["iteration_ms"] for r in per_rank),
                    "step_call_ms_rank0": r0["step_call_ms"],
                    "compute_ms": 2 * ns.layers * ns.compute_ms,
                    "one_bucket_gather_ms": gather_ms,
                    "all_buckets_gather_ms": gather_ms * r0["buckets"],
                    "buckets": r0["buckets"],
                }
            )
    result = {
        "command": "PYTHONPATH=src python benchmarks/probes/overlap_slowlink.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.items())
        + f" --ranks {' '.join(map(str, ns.ranks))}",
        "machine": f"{platform.machine()}, {platform.system()}, torch {torch.__version__}, "
        "2 shared CPU cores, gloo; link and compute emulated (sleeps)",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "args": args,
        "rows": rows,
    }
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
