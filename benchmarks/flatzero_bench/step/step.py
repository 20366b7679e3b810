"""Step benchmark: ZeroOptimizer's training step against plain AdamW and DeepSpeed ZeRO.

Every method trains its own copy of the same model on the same data, alternately, in one
run and one process tree, with the same optimizer (``torch.optim.AdamW``, lr 1e-4), the
same global-norm clipping (1.0) and the same bucket size:

- ``flatzero-z2`` / ``flatzero-z1``: ``ZeroOptimizer`` stage 2 / stage 1 (which runs
  AdamW's fused kernel over its flat shards by default);
- ``torch-adamw``: plain ``torch.optim.AdamW`` on the model's params with
  ``torch.nn.utils.clip_grad_norm_`` (world size 1 only);
- ``deepspeed-z2`` / ``deepspeed-z1``: ``deepspeed.initialize`` 0.19.8 with a client
  ``torch.optim.AdamW`` (``zero_force_ds_cpu_optimizer: false``), ``engine.backward`` and
  ``engine.step`` (world size > 1, when DeepSpeed is importable);
- ``...-fused``: the same baseline given ``torch.optim.AdamW(fused=True)``, so that the
  comparison does not hinge on flatzero choosing the fused kernel.

Each step is timed in three phases, after a barrier that aligns the ranks:

- ``fwd``: the forward pass and the loss;
- ``bwd``: backward with gradient reduction complete (flatzero: ``loss.backward()`` then
  ``reduce_gradients()``; DeepSpeed: ``engine.backward(loss)``);
- ``step``: clipping, the optimizer step, the parameter all-gather and zeroing the grads.

A step's phase time is the slowest rank's; the table reports the median over the timed
steps, and ratios of each method to the baseline of its world size.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import torch

from flatzero.launch import run_ranks
from flatzero.models import build_model, count_params
from flatzero.models.bench_models import STEP_MODELS
from flatzero.testing.deepspeed import without_unavailable_deepspeed
from flatzero_bench.common.machine import device_name, versions
from flatzero_bench.common.ranks import (
    backend_for,
    device_or_default,
    rank_device,
    threads_per_rank,
)
from flatzero_bench.common.results import emit, print_skipped, result_head
from flatzero_bench.common.settings import BENCH_DTYPES, spec_from_args
from flatzero_bench.step.step_methods import StepMethod, StepSpec, make_method, stage_of

__all__ = ["run"]


def _rank_main(rank: int, world_size: int, spec: StepSpec) -> dict[str, Any]:
    """This rank's copies of the model, one per method, trained on the same batches (one
    stream per rank), the methods alternating step by step; their phase times and losses."""
    device = rank_device(spec.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads_per_rank(world_size))
    config = STEP_MODELS[spec.model]()
    pristine = build_model(config, device="cpu", dtype=BENCH_DTYPES[spec.dtype], seed=0)
    state = {k: v.detach().clone() for k, v in pristine.state_dict().items()}
    n_params = count_params(pristine)
    del pristine

    methods: list[StepMethod] = []
    for name in spec.methods:
        model = build_model(config, device="meta", dtype=BENCH_DTYPES[spec.dtype])
        model.to_empty(device=device)
        model.load_state_dict(state)
        methods.append(make_method(name, model, device, spec))
    del state

    g = torch.Generator().manual_seed(1000 + rank)
    total = spec.warmup + spec.steps
    data = [
        torch.randint(0, config.vocab_size, (spec.batch, spec.seq), generator=g).to(device)
        for _ in range(total)
    ]
    cursor = dict.fromkeys(spec.methods, 0)

    def run_steps(method: StepMethod, count: int, record: bool) -> None:
        for _ in range(count):
            method.train_step(data[cursor[method.name]], record)
            cursor[method.name] += 1

    for method in methods:
        run_steps(method, spec.warmup, record=False)
    # Alternate step by step (reversing the order every other step), so that any drift in
    # the machine's load hits every method alike.
    for i in range(spec.steps):
        for method in methods if i % 2 == 0 else methods[::-1]:
            run_steps(method, 1, record=True)
    return {
        "params": n_params,
        "threads": torch.get_num_threads(),
        "times": {m.name: m.times for m in methods},
        "losses": {m.name: m.losses for m in methods},
    }


def _baselines_of(method: str, world_size: int) -> tuple[str, str]:
    """What ``method`` is compared with: (default, fused) plain AdamW at world size 1,
    else (default, fused) DeepSpeed at the same stage."""
    if world_size == 1:
        return "torch-adamw", "torch-adamw-fused"
    stage = stage_of(method)
    return f"deepspeed-z{stage}", f"deepspeed-z{stage}-fused"


def _summarize(world_size: int, ranks: list[dict[str, Any]], spec: StepSpec) -> list[dict]:
    """Per method: median over steps of the slowest rank's phase times, and ratios."""
    rows = []
    for name in spec.methods:
        per_step = [
            tuple(max(r["times"][name][i][k] for r in ranks) for k in range(3))
            for i in range(len(ranks[0]["times"][name]))
        ]
        fwd, bwd, step = (statistics.median(s[k] for s in per_step) for k in range(3))
        total = statistics.median(sum(s) for s in per_step)
        rows.append(
            {
                "world_size": world_size,
                "method": name,
                "fwd_s": fwd,
                "bwd_s": bwd,
                "step_s": step,
                "bwd_plus_step_s": statistics.median(s[1] + s[2] for s in per_step),
                "total_s": total,
                "final_loss": ranks[0]["losses"][name][-1],
                "timed_steps": len(per_step),
            }
        )
    by_name = {row["method"]: row for row in rows}
    for row in rows:
        row["ratios"] = {
            base: {
                key[:-2]: row[key] / by_name[base][key]
                for key in ("bwd_s", "step_s", "bwd_plus_step_s", "total_s")
            }
            for base in _baselines_of(row["method"], world_size)
            if base in by_name
        }
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| world size | method | fwd ms | bwd+reduce ms | step ms | bwd+step ms | total ms "
        "| bwd+step / baseline | total / baseline |",
        "|---:|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in rows:
        ratios = row["ratios"].items()
        lines.append(
            f"| {row['world_size']} | {row['method']} | {row['fwd_s'] * 1e3:.1f} | "
            f"{row['bwd_s'] * 1e3:.1f} | {row['step_s'] * 1e3:.1f} | "
            f"{row['bwd_plus_step_s'] * 1e3:.1f} | {row['total_s'] * 1e3:.1f} | "
            + "<br>".join(f"{r['bwd_plus_step']:.3f}x {b}" for b, r in ratios)
            + " | "
            + "<br>".join(f"{r['total']:.3f}x {b}" for b, r in ratios)
            + " |"
        )
    return "\n".join(lines)


def _methods_for(
    world_size: int, stages: Sequence[int], deepspeed: bool, fused: bool
) -> tuple[str, ...]:
    ours = tuple(f"flatzero-z{s}" for s in stages)
    variants = ("", "-fused") if fused else ("",)
    if world_size == 1:
        return (*ours, *(f"torch-adamw{v}" for v in variants))
    if not deepspeed:
        return ours
    return (*ours, *(f"deepspeed-z{s}{v}" for s in stages for v in variants))


def _checked(args: argparse.Namespace) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The ZeRO stages and dtypes asked for, checked."""
    stages = tuple(int(s) for s in args.stages.split(","))
    if any(s not in (1, 2) for s in stages):
        raise SystemExit(f"--stages must list 1 and/or 2, got {args.stages!r}")
    dtypes = tuple(d for d in args.dtypes.split(",") if d)
    if any(d not in BENCH_DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes must list fp32 and/or bf16, got {args.dtypes!r}")
    return stages, dtypes


def _run_all(
    args: argparse.Namespace, stages: tuple[int, ...], dtypes: tuple[str, ...], use_ds: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """One launch of ranks per dtype and world size, each one's table printed as it ends;
    returns the rows, the specs, and the model's params and threads per rank."""
    rows: list[dict[str, Any]] = []
    specs: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    env = {"DS_ACCELERATOR": "cpu"} if args.device == "cpu" else None
    for dtype in dtypes:
        for ws in (int(w) for w in args.world_sizes.split(",")):
            methods = _methods_for(ws, stages, use_ds, not args.no_fused_baselines)
            spec = spec_from_args(StepSpec, args, dtype=dtype, methods=methods)
            ranks = run_ranks(
                _rank_main, ws, spec, backend=backend_for(args.device), env=env, timeout_s=3600
            )
            done = [{"dtype": dtype, **row} for row in _summarize(ws, ranks, spec)]
            rows.extend(done)
            specs.append(asdict(spec))
            print(f"dtype {dtype}, world size {ws}:\n{_table(done)}\n", flush=True)
            info = {"params": ranks[0]["params"], "threads_per_rank": ranks[0]["threads"]}
    return rows, specs, info


def _markdown(result: dict[str, Any], header: str, steps: int, table: str) -> str:
    """The result as a markdown page: command, machine, how to read it, the tables."""
    return (
        f"# flatzero bench step, {result['date']}\n\n"
        f"Command: `{result['command']}`\n\n{header}\n\n"
        f"Each phase: the slowest rank's time, median over {steps} timed steps per "
        "method (methods alternate step by step). bwd+reduce: backward with the "
        "gradient reduction complete; step: clipping, optimizer step, parameter "
        "all-gather, zeroing.\n\n"
        f"{table}\n"
    )


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table and one JSON line."""
    args.device = device_or_default(args.device, "cpu")
    stages, dtypes = _checked(args)
    kept, skipped = without_unavailable_deepspeed(() if args.no_deepspeed else ("deepspeed",))
    load_before = os.getloadavg()
    rows, specs, info = _run_all(args, stages, dtypes, use_ds=bool(kept))
    load_after = os.getloadavg()
    device, library_versions = device_name(args.device), versions()
    header = (
        f"model {args.model}: {info['params'] / 1e6:.1f}M params; batch {args.batch} x "
        f"{args.seq} tokens per rank; {platform.node()}: {os.cpu_count()} cpus, {device}; "
        + ", ".join(f"{k} {v}" for k, v in library_versions.items())
        + f"; 1-min load average {load_before[0]:.1f} before, {load_after[0]:.1f} after"
    )
    print(header)
    print_skipped(skipped)
    table = "\n\n".join(
        f"dtype {dtype}:\n\n" + _table([r for r in rows if r["dtype"] == dtype]) for dtype in dtypes
    )
    print(table)
    result = {
        **result_head("step", args),
        "machine": {
            "node": platform.node(),
            "cpus": os.cpu_count(),
            "device": device,
            "load_average_before": load_before,
            "load_average_after": load_after,
            **library_versions,
        },
        "model": {"name": args.model, **info},
        "specs": specs,
        "rows": rows,
        "skipped": skipped,
    }
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(_markdown(result, header, args.steps, table))
    emit(result, args.json)
    return 0
