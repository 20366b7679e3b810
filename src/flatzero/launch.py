"""Run a function on N local ranks with ``torch.distributed`` set up, as torchrun would.

Used by the tests, the benchmarks and the demo on a single machine. Each rank is a
fresh process (``spawn``) with torchrun's environment variables set, so code inside
behaves exactly as under ``torchrun --nproc-per-node N``. Results come back in rank
order; an exception on any rank is re-raised here with that rank's traceback.

A caller that launches ranks many times (the test suite: a few hundred launches) can call
``preload_rank_processes`` once: rank processes are then forked from a server that has
imported torch and flatzero already, instead of each paying ~3 CPU-seconds of imports.
Each rank still starts with the caller's environment as it is at the launch.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import accel
from .cores import usable_cores
from .devices import device_backends, local_device_index
from .ports import free_port

__all__ = ["free_port", "preload_rank_processes", "run_ranks"]

_GRACE_S = 15.0
"""Seconds the other ranks get to finish after one rank failed, before they are killed."""

_start_method = "spawn"
"""How ``run_ranks`` starts a rank process: ``spawn``, or ``forkserver`` once
``preload_rank_processes`` was called."""


def preload_rank_processes(modules: Sequence[str] = ("torch", "flatzero")) -> None:
    """Start every later ``run_ranks`` rank from a fork server that imported ``modules``.

    The server starts at the next launch, with ``modules`` imported once; each rank is a
    fork of it, so a launch costs no interpreter start or torch import (per rank; measured:
    docs/benchmarks.md). What a rank sees is unchanged: the caller's environment at the
    launch (``run_ranks`` sends it), its own process group, nothing initialized by the
    server beyond the imports. Settings a preloaded module reads once at its import keep
    the server's values (``torch._dynamo`` preloaded: ``TORCH_COMPILE_DISABLE``,
    ``TORCHINDUCTOR_*``); pass those in the server's own environment. Call it before the
    first launch (later calls change nothing once the server runs).
    """
    global _start_method
    mp.get_context("forkserver").set_forkserver_preload(list(modules))
    _start_method = "forkserver"


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple,
    launcher_env: dict[str, str],
    env: dict[str, str],
    results: Any,
    timeout_s: float,
    prepare: Callable[[], Any] | None,
) -> None:
    # The launcher's environment at the launch (a forked server's may be older), then the
    # extra variables.
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        # What torch took from the variable at import in a process started with it.
        torch.set_num_threads(max(1, int(env["OMP_NUM_THREADS"])))
    else:
        # As torchrun does: ranks of a node share its cores instead of oversubscribing them.
        torch.set_num_threads(max(1, usable_cores() // world_size))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        if prepare is not None:
            prepare()
        device_type = accel.accelerator_type()
        if device_type is not None and device_type in device_backends(backend):
            accel.set_current(torch.device(device_type, local_device_index(device_type)))
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
        try:
            out = fn(rank, world_size, *args)
            _wait_for_every_rank(backend)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _wait_for_every_rank(backend: str) -> None:
    """Return once every rank's ``fn`` has returned. Rank 0 hosts the store process groups
    are made through: a rank that finished first (one data-parallel subgroup) must not
    take it down under ranks still creating groups. A host collective where the backend
    has one, else a barrier (NCCL, on the current device)."""
    if "cpu" in device_backends(backend):
        dist.all_reduce(torch.zeros(1))
    else:
        dist.barrier()


def _collect(procs: list[Any], results: Any) -> tuple[dict[int, Any], dict[int, str]]:
    """Every rank's result or failure, by rank; the ranks still running ``_GRACE_S`` after
    one failed are killed."""
    outputs: dict[int, Any] = {}
    failures: dict[int, str] = {}
    first_failure: float | None = None
    while len(outputs) + len(failures) < len(procs):
        if failures and first_failure is None:
            first_failure = time.monotonic()
        if first_failure is not None and time.monotonic() - first_failure > _GRACE_S:
            for r, p in enumerate(procs):
                if r not in outputs and r not in failures:
                    p.kill()
                    failures[r] = f"killed {_GRACE_S:.0f} s after another rank failed"
            break
        if not results.empty():
            rank, ok, value = results.get()
            (outputs if ok else failures)[rank] = value
            continue
        for r, p in enumerate(procs):
            if r not in outputs and r not in failures and p.exitcode not in (None, 0):
                failures[r] = f"process died with exit code {p.exitcode}"
        time.sleep(0.01)
    return outputs, failures


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
    prepare: Callable[[], Any] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes.

    ``fn`` must be importable (a module-level function) and its result picklable.

    Args:
        fn: the per-rank function; the default process group is initialized around it.
        world_size: number of ranks (>= 1).
        args: extra arguments passed to every rank.
        backend: ``"gloo"`` (CPU), ``"nccl"`` (one GPU per rank) or any backend string
            (``"cpu:gloo,emu:emu-gloo"``); ranks whose accelerator the backend serves
            make their local device current first.
        env: extra environment variables for every rank.
        timeout_s: collective timeout (seconds); a hung rank fails instead of hanging.
        prepare: an importable function each rank calls before its process group is
            made (e.g. installing an emulated accelerator and its backend).

    Returns:
        ``fn``'s return values, in rank order.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or died.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context(_start_method)
    results = ctx.SimpleQueue()
    port = free_port()
    launcher_env = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                r,
                world_size,
                port,
                backend,
                fn,
                args,
                launcher_env,
                env or {},
                results,
                timeout_s,
                prepare,
            ),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs, failures = _collect(procs, results)
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
    if failures:
        raise RuntimeError(
            "\n".join(f"rank {r} failed:\n{text}" for r, text in sorted(failures.items()))
        )
    return [outputs[r] for r in range(world_size)]
