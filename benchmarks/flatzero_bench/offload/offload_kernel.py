"""One launch of ``flatzero bench offload --what kernel``: the host optimizer kernels over
one flat fp32 tensor, and DeepSpeed's ``cpu_adam`` JIT build.

Run as its own process (``python -m flatzero_bench.offload.offload_kernel --threads N ...``) with
``OMP_NUM_THREADS=N`` in its environment, so that every kernel, torch's and DeepSpeed's
(an OpenMP loop in its C++ op), runs on the same ``N`` threads; ``torch.set_num_threads(N)``
is set too. Methods, each over its own copy of the same flat tensor (``--numel`` fp32
elements, the same initial values, the same gradients step by step), with the same
hyperparameters (AdamW: lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, bias
correction, decoupled weight decay):

- ``flatzero``: flatzero's host step, as an offloaded ``ZeroOptimizer`` runs it over its
  host master shard: the inner ``torch.optim.AdamW`` built by ``optim.inner`` for the host
  (``with_fused_default``: its fused CPU kernel), stepped by ``optim.offload.host_step``
  with ``--threads`` intra-op threads, over memory placed as flatzero places it: the
  master and gradient shards from ``hostmem.empty_host`` and the moments made by the first
  step on huge pages (``hostmem.HugePageFactories``);
- ``deepspeed``: ``deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)`` (its AVX op),
  over memory as DeepSpeed's engine has it (torch's allocator, 4 KiB pages);
- ``deepspeed_huge_pages``: the same op over memory placed as flatzero's (the kernels
  alone, side by side: what is left of the ratio once placement is the same);
- ``torch_foreach`` and ``torch_single``: ``torch.optim.AdamW(foreach=True)`` and the
  single-tensor loop (``foreach=False``), for context.

The methods alternate step by step, the order rotating every step; a step's time is the
``optimizer.step()`` call alone (the gradient is copied in before, untimed). After every
step has run, the final params and second moments of each method are compared with
flatzero's (max abs difference), so the times compare the same computation.

``--build-only``: time ``CPUAdamBuilder().load()`` into the ``TORCH_EXTENSIONS_DIR`` this
process was given (empty for a fresh machine's figure) and print that alone.

The result is one line on stdout prefixed with ``MARKER``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "DEFAULT_KERNEL_METHODS",
    "HUGE_PAGE_METHODS",
    "HYPERPARAMETERS",
    "KERNEL_METHODS",
    "MARKER",
    "host_step",
    "main",
]

MARKER = "FLATZERO_OFFLOAD_KERNEL "
"""Prefix of the result line on stdout."""

KERNEL_METHODS = (
    "flatzero",
    "deepspeed",
    "deepspeed_huge_pages",
    "torch_foreach",
    "torch_single",
)
DEFAULT_KERNEL_METHODS = ("flatzero", "deepspeed", "deepspeed_huge_pages")
"""What ``flatzero bench offload --what kernel`` compares by default (the context methods
allocate param-sized temporaries every step, which slow the others in the same process)."""
HUGE_PAGE_METHODS = ("flatzero", "deepspeed_huge_pages")
"""The methods over memory placed as flatzero places it (2 MiB pages where the OS allows)."""
HYPERPARAMETERS: dict[str, Any] = {
    "lr": 1e-3,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "weight_decay": 0.01,
}
"""AdamW's settings, every method (DeepSpeed's: ``bias_correction=True, adamw_mode=True``)."""


def host_step(flat: Any, threads: int, **hyperparameters: Any) -> tuple[Any, Callable[[], None]]:
    """flatzero's host step over ``flat`` (a 1-D fp32 host ``nn.Parameter`` whose ``.grad``
    is set before each call), as an offloaded ``ZeroOptimizer`` builds and runs it: the
    inner optimizer and a function taking one step."""
    import functools

    import torch

    from flatzero.optim.inner import build_inner_optimizer, with_fused_default
    from flatzero.optim.offload import HOST
    from flatzero.optim.offload import host_step as step

    adamw = torch.optim.AdamW
    inner = build_inner_optimizer(
        adamw, [flat], [{}], with_fused_default(adamw, dict(hyperparameters), [{}], HOST)
    )
    return inner, functools.partial(step, inner, threads=threads)


def _optimizer(method: str, flat: Any, threads: int) -> tuple[Any, Callable[[], None]]:
    """The method's optimizer over ``flat`` and a function taking one step."""
    import torch

    if method == "flatzero":
        return host_step(flat, threads, **HYPERPARAMETERS)
    if method.startswith("deepspeed"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        from flatzero.hostmem import HugePageFactories

        opt = DeepSpeedCPUAdam([flat], bias_correction=True, adamw_mode=True, **HYPERPARAMETERS)
        if method not in HUGE_PAGE_METHODS:
            return opt, opt.step

        def step() -> None:
            with HugePageFactories():  # its moments, made at the first step
                opt.step()

        return opt, step
    foreach = method == "torch_foreach"
    opt = torch.optim.AdamW([flat], foreach=foreach, fused=False, **HYPERPARAMETERS)
    return opt, opt.step


def _state_of(opt: Any) -> Any:
    """The second moment ``opt`` holds for its one tensor."""
    (state,) = opt.state.values()
    return state["exp_avg_sq"]


def _placed(method: str, values: Any) -> Any:
    """A copy of ``values`` in memory placed as ``method``'s library places it."""
    from flatzero.hostmem import empty_host

    if method in HUGE_PAGE_METHODS:
        return empty_host(values.numel(), values.dtype).copy_(values)
    return values.clone()


def _kernels(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from flatzero.cores import usable_cores
    from flatzero_bench.common.trials import rotated

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    init = torch.empty(args.numel).uniform_(-1.0, 1.0, generator=g)
    grads = [torch.randn(args.numel, generator=g).mul_(1e-2) for _ in range(2)]
    flats: dict[str, torch.Tensor] = {}
    opts: dict[str, Any] = {}
    steps: dict[str, Callable[[], None]] = {}
    for method in args.methods:
        flat = torch.nn.Parameter(_placed(method, init))
        flat.grad = _placed(method, init)  # overwritten before every step
        flats[method] = flat
        opts[method], steps[method] = _optimizer(method, flat, args.threads)
    del init
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    cpus: dict[str, list[float]] = {m: [] for m in args.methods}
    for i in range(args.warmup + args.steps):
        for method in rotated(args.methods, i):
            flat = flats[method]
            flat.grad.copy_(grads[i % len(grads)])  # type: ignore[union-attr]
            c0, t0 = os.times(), time.perf_counter()
            steps[method]()
            t1, c1 = time.perf_counter(), os.times()
            if i >= args.warmup:
                times[method].append(t1 - t0)
                cpus[method].append(c1.user + c1.system - c0.user - c0.system)
    with torch.no_grad():  # the comparisons build no graph
        ref = args.methods[0]
        ref_sq = _state_of(opts[ref])
        rows = []
        for method in args.methods:
            sq = _state_of(opts[method])
            rows.append(
                {
                    "method": method,
                    "step_s_median": statistics.median(times[method]),
                    "step_s_min": min(times[method]),
                    "step_s": times[method],
                    "cpu_over_wall": sum(cpus[method]) / sum(times[method]),
                    "optimizer": type(opts[method]).__name__,
                    "fused": opts[method].param_groups[0].get("fused"),
                    "param_max_abs_diff": float((flats[method] - flats[ref]).abs().max()),
                    "exp_avg_sq_max_abs_diff": float((sq - ref_sq).abs().max()),
                    "param_max_abs": float(flats[method].abs().max()),
                }
            )
    return {
        "threads": args.threads,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "usable_cores": usable_cores(),
        "numel": args.numel,
        "steps": args.steps,
        "warmup": args.warmup,
        "compared_with": ref,
        "rows": rows,
    }


def _build(_: argparse.Namespace) -> dict[str, Any]:
    import resource

    t0 = time.perf_counter()
    from deepspeed.ops.op_builder import CPUAdamBuilder

    t1 = time.perf_counter()
    c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        CPUAdamBuilder().load()
    t2 = time.perf_counter()
    c2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "import_s": t1 - t0,
        "build_s": t2 - t1,
        # ninja and the compilers are child processes: their user + system seconds.
        "build_cpu_s": c2.ru_utime + c2.ru_stime - c1.ru_utime - c1.ru_stime,
        "extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR"),
        "max_jobs": os.environ.get("MAX_JOBS"),
        "cpus": os.cpu_count(),
    }


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flatzero_bench.offload.offload_kernel")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--numel", type=int, default=50_000_000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=",".join(KERNEL_METHODS))
    p.add_argument("--build-only", action="store_true")
    args = p.parse_args(argv)
    args.methods = tuple(m for m in args.methods.split(",") if m)
    unknown = set(args.methods) - set(KERNEL_METHODS)
    if unknown or not args.methods:
        p.error(f"--methods: choose from {', '.join(KERNEL_METHODS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run one launch; print its result line."""
    args = _parse(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed's first import
    result = _build(args) if args.build_only else _kernels(args)
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
