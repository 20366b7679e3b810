"""One launch of ``flatzero bench doors``: one door's init and first step, or the limit.

Run under ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node N
-m flatzero_bench.doors.door_trial --door D ...``), as a user's training script is: a fresh
process per rank. Each rank:

1. joins the gloo process group torchrun describes (not timed, the same for both doors)
   and imports the door's library (``deepspeed`` with ``DS_ACCELERATOR=cpu`` and its
   inference-only ``deepspeed_shm_comm`` op marked incompatible, see
   ``deepspeed_runner``), as a script does at its top;
2. builds the model from the seed, in bf16, on the host (identical on every rank), a
   client ``torch.optim.AdamW`` over its params and a random batch from the seed (the same
   for both doors and on every rank, see ``_door``);
3. after a barrier, times ``flatzero.initialize`` or ``deepspeed.initialize`` with the
   same DeepSpeed config, then the first training step: ``engine(ids, labels=ids)``,
   ``engine.backward(loss)``, ``engine.step()``. Wall and CPU seconds (user + system,
   every thread of the process) of each phase and the peak RSS are recorded.

With ``--door limit`` a rank instead writes, after a barrier and all ranks at once, the
bytes an init must write on it (bf16 buckets + fp32 master shard + fp32 gradient shard)
into new memory with the cores a rank may use (``limits.first_touch_seconds``).

Rank 0 gathers every rank's numbers and prints them as one JSON line prefixed with
``MARKER`` (DeepSpeed prints to stdout too); the parent parses that line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import time
from collections.abc import Callable
from typing import Any

from flatzero.procmem import (
    cpu_seconds,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
    trim_host_memory,
)
from flatzero_bench.common.launched import exit_now, report_ranks

__all__ = ["DOORS", "MARKER", "door_config", "main", "must_write_bytes"]

MARKER = "FLATZERO_DOOR_TRIAL "
"""Prefix of the result line on stdout."""

DOORS = ("flatzero", "deepspeed")
LR = 1e-4
GRADIENT_CLIPPING = 1.0


def door_config(*, stage: int, bucket_numel: int) -> dict[str, Any]:
    """The DeepSpeed config both doors get: ZeRO ``stage``, bf16, clipping 1.0, micro-batch 1,
    the client optimizer kept (``zero_force_ds_cpu_optimizer: false``)."""
    from flatzero.testing.deepspeed import deepspeed_config

    config = deepspeed_config(stage=stage, dtype="bf16", bucket_numel=bucket_numel)
    config["gradient_clipping"] = GRADIENT_CLIPPING
    return config


def must_write_bytes(model_bytes: int, params: int, world_size: int) -> int:
    """Bytes an init writes on one rank: the bf16 buckets (the whole model), this rank's fp32
    master shard and its fp32 gradient shard (padding left out)."""
    shard = -(-params // world_size)
    return model_bytes + 2 * 4 * shard


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flatzero_bench.doors.door_trial")
    p.add_argument("--door", required=True, choices=[*DOORS, "limit"])
    p.add_argument("--model", required=True)
    p.add_argument("--stage", type=int, default=2, choices=[1, 2])
    p.add_argument("--bucket-numel", type=int, default=2**26)
    p.add_argument("--seq", type=int, default=2, help="tokens in the first step's batch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit-repeats", type=int, default=1)
    p.add_argument(
        "--limit-settle-s", type=float, default=None, help="before each first-touch pass"
    )
    return p.parse_args(argv)


def _door_initialize(door: str) -> Callable[..., Any]:
    """The door's ``initialize``, its library imported as a script does at its top."""
    if door == "deepspeed":
        from flatzero.testing.deepspeed import import_deepspeed

        return import_deepspeed().initialize
    import flatzero

    return flatzero.initialize


def _timed(
    door_initialize: Callable[..., Any], model: Any, ds_config: dict[str, Any], ids: Any
) -> tuple[Any, dict[str, Any]]:
    """After a barrier: the door's ``initialize`` (its stdout captured), then the first
    step; returns the engine and the times (s), CPU times (s), RSS (bytes), loss and
    gradient norm."""
    import torch
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    trim_host_memory()
    dist.barrier()
    reset_peak_rss()
    rss_before = rss_bytes()
    c0, t0 = cpu_seconds(), time.perf_counter()
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        engine, *_ = door_initialize(model=model, optimizer=optimizer, config=ds_config)
    c1, t1 = cpu_seconds(), time.perf_counter()
    peak_init = peak_rss_bytes()
    del optimizer  # the engine holds what it needs
    loss = engine(ids, labels=ids).loss
    t2 = time.perf_counter()
    engine.backward(loss)
    t3 = time.perf_counter()
    engine.step()
    c4, t4 = cpu_seconds(), time.perf_counter()
    norm = engine.get_global_grad_norm()
    return engine, {
        "init_s": t1 - t0,
        "init_cpu_s": c1 - c0,
        "fwd_s": t2 - t1,
        "bwd_s": t3 - t2,
        "step_s": t4 - t3,
        "first_step_s": t4 - t1,
        "first_step_cpu_s": c4 - c1,
        "ttfs_s": t4 - t0,
        "ttfs_cpu_s": c4 - c0,
        "rss_before_bytes": rss_before,
        "peak_rss_init_bytes": peak_init,
        "peak_rss_bytes": peak_rss_bytes(),
        "loss": float(loss.detach().float()),
        "grad_norm": None if norm is None else float(norm),
        "door_stdout_lines": len(captured.getvalue().splitlines()),
    }


def _door(args: argparse.Namespace) -> dict[str, Any]:
    """This rank's launch of ``args.door``: the model built, then ``_timed``."""
    import torch

    from flatzero.models import build_model, count_bytes, count_params, count_tensors
    from flatzero_bench.init.init_bench import MODELS

    door_initialize = _door_initialize(args.door)
    config = MODELS[args.model]()
    t0 = time.perf_counter()
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=args.seed)
    build_s = time.perf_counter() - t0
    info = {
        "params": count_params(model),
        "tensors": count_tensors(model),
        "model_bytes": count_bytes(model),
    }
    # The same batch on every rank: per-rank batches route an MoE's tokens to different
    # experts on different ranks, and DeepSpeed 0.19.8's ZeRO-2 then reduces different
    # buckets on different ranks (gloo: "Received data size doesn't match expected size").
    g = torch.Generator().manual_seed(args.seed * 1000 + 7)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=g)
    ds_config = door_config(stage=args.stage, bucket_numel=args.bucket_numel)
    engine, timed = _timed(door_initialize, model, ds_config, ids)
    out: dict[str, Any] = {**info, "build_s": build_s, **timed}
    if args.door == "flatzero":
        report = engine.init_report
        out["phase_seconds"] = dict(report.phase_seconds)
        out["tier"] = "+".join(report.tiers)
    return out


def _limit(args: argparse.Namespace) -> dict[str, Any]:
    """The first touch of the bytes an init must write on this rank, all ranks at once."""
    import torch.distributed as dist

    from flatzero.cores import core_share
    from flatzero.measure import limits
    from flatzero.models import build_model, count_bytes, count_params
    from flatzero_bench.init.init_bench import MODELS

    meta = build_model(MODELS[args.model](), device="meta")
    nbytes = must_write_bytes(count_bytes(meta), count_params(meta), dist.get_world_size())
    threads = core_share(None).threads
    settle = limits.SETTLE_SECONDS if args.limit_settle_s is None else args.limit_settle_s
    dist.barrier()
    lim = limits.first_touch_seconds(
        nbytes, threads=threads, repeats=args.limit_repeats, settle_s=settle
    )
    return {"nbytes": lim.nbytes, "limit_s": lim.seconds, "gbps": lim.gbps, "threads": lim.threads}


def main(argv: list[str] | None = None) -> int:
    """Run one launch on this rank; rank 0 prints the gathered result line."""
    args = _parse(argv)
    if args.door == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed's first import
    import torch

    def measure() -> dict[str, Any]:
        mine = _limit(args) if args.door == "limit" else _door(args)
        return mine | {
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        }

    return report_ranks(MARKER, args.door, measure)


if __name__ == "__main__":
    exit_now(main())
