"""One launch of ``flatzero bench offload --what init``: one door's init with optimizer
offload, its first steps, and the host memory they leave.

Run under ``torchrun`` (``python -m torch.distributed.run --standalone --nproc-per-node N
-m flatzero_bench.offload.offload_trial --door D ...``), a fresh process per rank as at a job's
start. Each rank joins the gloo group, imports the door's library, builds the model (seed,
bf16, on the host), trims its heap and, after a barrier, times ``flatzero.initialize`` or
``deepspeed.initialize`` with the same DeepSpeed config (``offload_config``: ZeRO stage,
bf16, ``offload_optimizer: {device: cpu, pin_memory: true}``, an ``optimizer`` section
with AdamW, clipping 1.0), then ``--steps`` training steps on one random batch.

Host memory (``/proc/self/status``): RSS before ``initialize`` (the model built), right
after it, after the first step and after the last (each after ``gc`` and
``malloc_trim``), and the peak (high-water mark): of ``initialize``, and of each phase
of every step (``PHASES``; the heap is trimmed and the mark reset at each phase's start),
so that the optimizer step's peak, where offload's host memory is all live, stands apart
from backward's (on a host-only machine the autograd temporaries of the model's own
compute are host memory too). The steps' seconds leave the trims out but include the
page faults of the memory each phase takes back after one: not a measure of step time
(``--what step`` is).
For flatzero the engine's ``offload_host_bytes()`` (what its optimizer allocated, from the
tensors) is recorded too; the parent sets those beside the formula of ``flatzero plan``.

Rank 0 prints every rank's numbers as one JSON line prefixed with ``MARKER``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
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

__all__ = ["DOORS", "MARKER", "main", "offload_config"]

MARKER = "FLATZERO_OFFLOAD_TRIAL "
"""Prefix of the result line on stdout."""

DOORS = ("flatzero", "deepspeed")
PHASES = ("forward", "backward", "step")
"""A training step's phases, each with its own high-water mark of host memory."""
ADAMW = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
"""The ``optimizer`` section's AdamW parameters, both doors."""


def offload_config(
    *, stage: int, bucket_numel: int, dtype: str = "bf16", offload: bool = True
) -> dict[str, Any]:
    """The DeepSpeed config both doors get: ZeRO ``stage``, ``dtype``, clipping 1.0,
    micro-batch 1, an ``optimizer`` section (AdamW: with offload DeepSpeed builds its
    ``DeepSpeedCPUAdam`` from it, flatzero its fused host step), and with ``offload``
    ``offload_optimizer: {device: cpu, pin_memory: true}`` as in Hugging Face's ZeRO-2
    example."""
    from flatzero.testing.deepspeed import deepspeed_config

    config = deepspeed_config(stage=stage, dtype=dtype, bucket_numel=bucket_numel)
    config["gradient_clipping"] = 1.0
    config["optimizer"] = {"type": "AdamW", "params": dict(ADAMW)}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return config


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flatzero_bench.offload.offload_trial")
    p.add_argument("--door", required=True, choices=DOORS)
    p.add_argument("--model", required=True)
    p.add_argument("--stage", type=int, default=2, choices=[1, 2])
    p.add_argument("--bucket-numel", type=int, default=2**26)
    p.add_argument("--seq", type=int, default=2, help="tokens per step")
    p.add_argument("--steps", type=int, default=2, help="training steps after init")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _initialize(door: str) -> Any:
    if door == "deepspeed":
        from flatzero.testing.deepspeed import import_deepspeed

        return import_deepspeed().initialize
    import flatzero

    return flatzero.initialize


def _rank(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from flatzero.models import build_model, count_bytes, count_params
    from flatzero_bench.init.init_bench import MODELS

    initialize = _initialize(args.door)
    config = MODELS[args.model]()
    model = build_model(config, device="cpu", dtype=torch.bfloat16, seed=args.seed)
    info = {"params": count_params(model), "model_bytes": count_bytes(model)}
    g = torch.Generator().manual_seed(args.seed * 1000 + 7)
    ids = torch.randint(0, config.vocab_size, (1, args.seq), generator=g)
    ds_config = offload_config(stage=args.stage, bucket_numel=args.bucket_numel)
    trim_host_memory()
    dist.barrier()
    reset_peak_rss()
    rss_before = rss_bytes()
    captured = io.StringIO()
    c0, t0 = cpu_seconds(), time.perf_counter()
    with contextlib.redirect_stdout(captured):
        engine, optimizer, *_ = initialize(
            model=model, model_parameters=model.parameters(), config=ds_config
        )
    c1, t1 = cpu_seconds(), time.perf_counter()
    peak_init = peak_rss_bytes()
    trim_host_memory()
    rss_init = rss_bytes()
    steps, losses, rss_steps = [], [], []
    phase_peaks: dict[str, list[int]] = {phase: [] for phase in PHASES}

    def phase(name: str, run: Callable[[], Any]) -> tuple[Any, float]:
        """``run()`` with the heap trimmed first and the mark reset, so that its peak is
        the memory live at its start plus what it allocates (not what an earlier phase
        freed and glibc kept: the settled environment raises glibc's trim threshold);
        its result and seconds (the trim not counted)."""
        trim_host_memory()
        reset_peak_rss()
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(captured):
            out = run()
        seconds = time.perf_counter() - t0
        phase_peaks[name].append(peak_rss_bytes())
        return out, seconds

    for _ in range(args.steps):
        dist.barrier()
        loss, forward_s = phase("forward", lambda: engine(ids, labels=ids).loss)
        _, backward_s = phase("backward", functools.partial(engine.backward, loss))
        _, step_s = phase("step", engine.step)
        steps.append(forward_s + backward_s + step_s)
        losses.append(float(loss.detach().float()))
        trim_host_memory()
        rss_steps.append(rss_bytes())
    out: dict[str, Any] = {
        **info,
        "init_s": t1 - t0,
        "init_cpu_s": c1 - c0,
        "step_s": steps,
        "loss": losses,
        "rss_before_bytes": rss_before,
        "rss_init_bytes": rss_init,
        "rss_step_bytes": rss_steps,
        "peak_rss_init_bytes": peak_init,
        "peak_rss_bytes": max([peak_init, *(max(p) for p in phase_peaks.values() if p)]),
        "peak_rss_phase_bytes": phase_peaks,
        "optimizer": type(optimizer).__name__,
    }
    if args.door == "flatzero":
        zero = getattr(engine, "optimizer", optimizer)
        host = getattr(zero, "offload_host_bytes", lambda: None)()
        out["offload_host_bytes"] = None if host is None else dataclasses.asdict(host)
        out["held_gradient_peak_bytes"] = zero.held_gradient_peak_bytes()
        out["inner_optimizer"] = type(getattr(zero, "inner", zero)).__name__
        report = getattr(engine, "init_report", None)
        if report is not None:
            out["phase_seconds"] = dict(report.phase_seconds)
            out["tier"] = "+".join(report.tiers)
    else:
        inner = getattr(optimizer, "optimizer", None)
        out["inner_optimizer"] = type(inner).__name__
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one launch on this rank; rank 0 prints the gathered result line."""
    args = _parse(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed's first import
    import torch

    return report_ranks(
        MARKER, args.door, lambda: _rank(args) | {"threads": torch.get_num_threads()}
    )


if __name__ == "__main__":
    exit_now(main())
