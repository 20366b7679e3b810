"""Host-ops benchmark: torch operator calls per param in backward and per step, flatzero
against plain torch and DeepSpeed ZeRO.

Every method trains a stack of ``--layers`` small ``nn.Linear`` layers (2 params each; one
bucket holds them all) a few steps; a counting ``TorchDispatchMode``
(``flatzero.testing.host_ops``) counts every operator the host dispatches (aten ops,
``_foreach``/fused kernels, c10d collectives), whoever issues it (Python, autograd, a
hook), in two phases:

- ``backward``: ``loss.backward()`` with the gradient reduction complete (flatzero:
  ``loss.backward()`` then ``reduce_gradients()``; DeepSpeed: ``engine.backward(loss)``);
- ``step``: the optimizer step, the parameter all-gather and zeroing the grads (flatzero:
  ``step()`` and ``zero_grad()``; DeepSpeed: ``engine.step()``; torch: ``step()`` and
  ``zero_grad()``).

Methods: ``torch-adamw`` / ``torch-adamw-fused`` (plain ``torch.optim.AdamW``, foreach or
fused, one process: the world size 1 rows only), ``flatzero-z1`` / ``flatzero-z2``
(``ZeroOptimizer`` stage 1 / 2, AdamW) and ``deepspeed-z1`` / ``deepspeed-z2``
(``deepspeed.initialize`` 0.19.8 on CPU, gloo, fp32, a client ``torch.optim.AdamW``).
Counts are rank 0's, the mean over the counted steps; each row's backward is also given
as ops per param above plain torch's (``torch-adamw``, same layers).
"""

from __future__ import annotations

import argparse
import os
import platform
from typing import Any

from flatzero.launch import run_ranks
from flatzero.testing.deepspeed import without_unavailable_deepspeed
from flatzero.testing.host_ops import HostOpsSpec, count_all
from flatzero_bench.common.machine import cpu_name, versions
from flatzero_bench.common.results import emit, print_skipped, result_head

__all__ = ["run"]


def _methods_for(world_size: int, use_ds: bool) -> tuple[str, ...]:
    torch_methods = ("torch-adamw", "torch-adamw-fused") if world_size == 1 else ()
    ds = ("deepspeed-z1", "deepspeed-z2") if use_ds else ()
    return (*torch_methods, "flatzero-z1", "flatzero-z2", *ds)


def _rows(
    world_size: int, specs: tuple[HostOpsSpec, ...], counted: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    return [
        {
            "world_size": world_size,
            "method": spec.method,
            "layers": spec.layers,
            "params": ops["params"],
            "buckets": ops["buckets"],
            "backward_ops": ops["backward"],
            "backward_per_param": ops["backward"] / ops["params"],
            "step_ops": ops["step"],
            "step_per_param": ops["step"] / ops["params"],
            "backward_by_op": ops["backward_ops"],
            "step_by_op": ops["step_ops"],
        }
        for spec, ops in zip(specs, counted, strict=True)
    ]


def _with_plain(rows: list[dict[str, Any]]) -> None:
    """Each row's backward ops per param above plain torch's at the same layers."""
    plain = {r["layers"]: r["backward_per_param"] for r in rows if r["method"] == "torch-adamw"}
    for row in rows:
        if row["layers"] in plain:
            row["backward_per_param_over_plain"] = row["backward_per_param"] - plain[row["layers"]]


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| world size | method | layers | params | buckets | backward ops / param "
        "| over plain torch | step ops | step ops / param |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        over = r.get("backward_per_param_over_plain")
        lines.append(
            f"| {r['world_size']} | {r['method']} | {r['layers']} | {r['params']} | "
            f"{'' if r['buckets'] is None else r['buckets']} | "
            f"{r['backward_per_param']:.2f} | {'' if over is None else f'{over:+.2f}'} | "
            f"{r['step_ops']:.0f} | {r['step_per_param']:.2f} |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table per world size, then one JSON line."""
    kept, skipped = without_unavailable_deepspeed(() if args.no_deepspeed else ("deepspeed",))
    layers = tuple(int(n) for n in args.layers.split(","))
    rows: list[dict[str, Any]] = []
    for ws in (int(w) for w in args.world_sizes.split(",")):
        specs = tuple(
            HostOpsSpec(m, n, args.width, steps=args.steps, bucket_numel=args.bucket_numel)
            for m in _methods_for(ws, bool(kept))
            for n in layers
        )
        counted = run_ranks(count_all, ws, specs, env={"DS_ACCELERATOR": "cpu"}, timeout_s=3600)
        done = _rows(ws, specs, counted[0])
        rows.extend(done)
        _with_plain(rows)
        print(f"world size {ws}:\n{_table(done)}\n", flush=True)
    header = (
        f"{platform.node()}: {os.cpu_count()} cpus, {cpu_name()}; "
        + ", ".join(f"{k} {v}" for k, v in versions().items())
        + f"; Linear({args.width}, {args.width}) x {args.layers} layers, buckets of "
        f"{args.bucket_numel} elements, {args.steps} counted steps, rank 0"
    )
    print(header)
    print_skipped(skipped)
    table = _table(rows)
    print(table)
    result = {
        **result_head("host-ops", args),
        "machine": {"node": platform.node(), "cpus": os.cpu_count(), "device": cpu_name()},
        **versions(),
        "rows": rows,
        "skipped": skipped,
    }
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"# flatzero bench host-ops, {result['date']}\n\n")
            f.write(f"Command: `{result['command']}`\n\n{header}\n\n{table}\n")
    emit(result, args.json)
    return 0
