"""Issue 42 part 1: step time on a slow link (``flatzero.testing.slowlink``) with emulated
compute, flatzero with the parameter all-gathers overlapped or not against DeepSpeed 0.19.8
with ``overlap_comm`` false and true.

Both libraries get the same DeepSpeed config (ZeRO stage 2, fp32, ``reduce_bucket_size`` =
``allgather_bucket_size`` = one layer's params, ``overlap_comm`` as the row says, a client
``torch.optim.AdamW``): ``flatzero.initialize`` and ``deepspeed.initialize`` each wrap a copy
of the same model. Each of ``layers`` blocks is a ``Linear(width, width)`` (one bucket each)
followed by a sleep of ``compute_ms`` in forward and again in backward (emulated compute:
the machine's two shared cores would otherwise dominate at 4 ranks). Every collective of
either library goes through the same link of ``bytes_per_s`` (the wrapper sits at
``torch.distributed``, under ``deepspeed.comm``), so one bucket's gather or reduction
takes ``bucket bytes / bytes_per_s``. The four engines live in the same processes and run
in blocks of ``block`` consecutive iterations (forward, backward, step), the first of each
block untimed (it starts with no gather outstanding), round-robin over ``rounds`` rounds;
every block ends by waiting for flatzero's outstanding gathers, so no engine's traffic
delays another's. The median iteration of the slowest rank is reported, with the link's
bytes per iteration by collective and the model: compute = 2 * layers * compute_ms.

Run: ``PYTHONPATH=src:benchmarks python benchmarks/probes/overlap_slowlink.py --out FILE``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import time
from datetime import UTC, datetime

import torch
import torch.distributed as dist
from torch import nn

import flatzero
from flatzero.launch import run_ranks
from flatzero.testing.deepspeed import deepspeed_config, prepare_deepspeed
from flatzero.testing.slowlink import slow_link

METHODS = ("flatzero", "flatzero-overlap", "deepspeed", "deepspeed-overlap_comm")


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


def _engine(method: str, args: dict):
    torch.manual_seed(0)
    width = args["width"]
    model = nn.Sequential(*(_Block(width, args["compute_ms"] / 1e3) for _ in range(args["layers"])))
    config = deepspeed_config(stage=2, dtype="fp32", bucket_numel=width * (width + 1))
    config["zero_optimization"]["overlap_comm"] = method.endswith("overlap") or method.endswith(
        "overlap_comm"
    )
    config["train_micro_batch_size_per_gpu"] = args["batch"]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if method.startswith("flatzero"):
        return flatzero.initialize(model=model, optimizer=opt, config=config)[0]
    import deepspeed

    with contextlib.redirect_stdout(io.StringIO()):
        return deepspeed.initialize(model=model, optimizer=opt, config=config)[0]


def _settle(engine) -> None:
    """Nothing of this engine left on the link (flatzero's outstanding gathers)."""
    wait = getattr(engine.optimizer, "wait_for_params", None)
    if wait is not None:
        wait()
    dist.barrier()


def _block(engine, x: torch.Tensor, n: int, link) -> tuple[list[float], dict[str, int]]:
    times = []
    before = dict(link.bytes_by_name)
    for i in range(n):
        t0 = time.perf_counter()
        loss = engine(x).sum()
        engine.backward(loss)
        engine.step()
        if i > 0:  # the first iteration starts with no gather outstanding
            times.append(time.perf_counter() - t0)
    moved = {k: v - before.get(k, 0) for k, v in link.bytes_by_name.items()}
    return times, moved


def _rank(rank: int, world: int, args: dict) -> dict:
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world))
    prepare_deepspeed()
    engines = {m: _engine(m, args) for m in METHODS}
    x = torch.randn(args["batch"], args["width"])
    for engine in engines.values():  # flatzero learns the forward order; warm-up
        for _ in range(2):
            engine.backward(engine(x).sum())
            engine.step()
        _settle(engine)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    moved: dict[str, dict[str, int]] = {m: {} for m in METHODS}
    with slow_link(args["bytes_per_s"]) as link:
        for _ in range(args["rounds"]):
            for m, engine in engines.items():
                t, b = _block(engine, x, args["block"], link)
                _settle(engine)
                times[m] += t
                for k, v in b.items():
                    moved[m][k] = moved[m].get(k, 0) + v
    iterations = args["rounds"] * args["block"]
    return {
        m: {
            "iteration_ms": 1e3 * statistics.median(times[m]),
            "link_bytes_per_iteration": {k: v // iterations for k, v in sorted(moved[m].items())},
        }
        for m in METHODS
    }


def _rows(world: int, per_rank: list[dict], args: dict, bucket_ms: float) -> list[dict]:
    compute = 2 * args["layers"] * args["compute_ms"]
    return [
        {
            "ranks": world,
            "method": m,
            "iteration_ms_max_over_ranks": round(max(r[m]["iteration_ms"] for r in per_rank), 1),
            "compute_ms": compute,
            "one_bucket_ms": round(bucket_ms, 1),
            "buckets": args["layers"],
            "link_bytes_per_iteration_rank0": per_rank[0][m]["link_bytes_per_iteration"],
        }
        for m in METHODS
    ]


def _table(rows: list[dict]) -> str:
    lines = [
        "| ranks | method | ms / iteration | compute | one bucket on the link |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['ranks']} | {r['method']} | {r['iteration_ms_max_over_ranks']:.0f} | "
            f"{r['compute_ms']:.0f} | {r['one_bucket_ms']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--compute-ms", type=float, default=20.0)
    parser.add_argument("--bytes-per-s", type=float, default=13e6)
    parser.add_argument("--block", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True, help="JSON file; a .md table beside it")
    ns = parser.parse_args()
    keys = ("layers", "width", "batch", "compute_ms", "bytes_per_s", "block", "rounds")
    args = {k: getattr(ns, k) for k in keys}
    bucket_ms = 1e3 * ns.width * (ns.width + 1) * 4 / ns.bytes_per_s
    rows = []
    load = os.getloadavg()[0]
    for world in ns.ranks:
        rows += _rows(world, run_ranks(_rank, world, args, timeout_s=900), args, bucket_ms)
    result = {
        "command": "PYTHONPATH=src:benchmarks python benchmarks/probes/overlap_slowlink.py "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in args.items())
        + f" --ranks {' '.join(map(str, ns.ranks))} --out {ns.out}",
        "machine": f"{platform.machine()}, {platform.system()}, torch {torch.__version__}, "
        f"deepspeed 0.19.8, 2 shared CPU cores (load average {load:.2f} at the start, "
        f"{os.getloadavg()[0]:.2f} at the end), gloo; link and compute emulated (sleeps)",
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "args": args,
        "rows": rows,
    }
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    with open(ns.out.removesuffix(".json") + ".md", "w") as f:
        f.write(f"`{result['command']}`\n\n{result['machine']}, {result['date']}\n\n")
        f.write(_table(rows))


if __name__ == "__main__":
    main()
