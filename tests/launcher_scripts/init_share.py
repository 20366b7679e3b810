"""One rank of a two-rank flatzero init, started the way a launcher starts it.

Used by ``tests/test_launchers.py``. ``--launcher`` says which launcher started this
process and so how the rank finds its process group (gloo):

- ``torchrun``: torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``MASTER_ADDR``/``MASTER_PORT``, ``OMP_NUM_THREADS=1``); the group from ``env://``;
  ``flatten_parameters``.
- ``deepspeed``: the DeepSpeed launcher's environment (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_SIZE``, ``CROSS_RANK``, ``CROSS_SIZE``,
  ``MASTER_ADDR``/``MASTER_PORT``, no ``LOCAL_WORLD_SIZE``) and ``--local_rank=N``;
  ``flatzero.initialize`` makes the group from ``env://``, as ``deepspeed.initialize``.
- ``mpirun``: Open MPI's ``OMPI_COMM_WORLD_*`` variables only; the group from
  ``--init-method`` with their rank and size; ``flatten_parameters``.
- ``slurm``: srun's ``SLURM_*`` variables only; the group from ``--init-method`` with
  ``SLURM_PROCID`` and ``SLURM_NTASKS``; ``flatten_parameters``.
- ``spawn``: this process starts both ranks with ``torch.multiprocessing.spawn``; each
  calls ``init_process_group`` with nothing but its arguments (``--init-method``, rank,
  world size); ``flatten_parameters``.

Every rank writes ``OUT/rank<rank>.json``: the init report's core share and the threads
init ran with, torch's intra-op threads before and after init, ``OMP_NUM_THREADS`` and the
launcher variables it saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import flatzero
from flatzero import FlattenConfig, flatten_parameters

WORLD_SIZE = 2
TIMEOUT = timedelta(seconds=60)
LAUNCHER_PREFIXES = (
    "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "CROSS_", "GROUP_", "OMPI_", "SLURM_", "PMI",
)  # fmt: skip
"""Prefixes of the variables a launcher sets (recorded to show what each rank saw)."""

DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2},
    "flatzero": {"progress": False},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))


def _init_group(launcher: str, init_method: str | None) -> None:
    """Initialize the process group as a script under ``launcher`` does (under the
    DeepSpeed launcher ``flatzero.initialize`` does it; under ``spawn`` it is done)."""
    env = os.environ
    if launcher == "torchrun":
        dist.init_process_group("gloo", timeout=TIMEOUT)
    elif launcher == "mpirun":
        rank, size = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT
        )
    elif launcher == "slurm":
        rank, size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=size, timeout=TIMEOUT
        )


def _init_report(launcher: str):
    """flatzero's init on a small model: the DeepSpeed door under the DeepSpeed launcher,
    else ``flatten_parameters``."""
    if launcher == "deepspeed":
        engine, _, _, _ = flatzero.initialize(model=_model(), config=DS_CONFIG)
        return engine.init_report.flatten
    return flatten_parameters(_model(), config=FlattenConfig(progress=False)).report


def run_rank(launcher: str, out: Path, init_method: str | None) -> None:
    """Initialize flatzero on this rank and write what it saw."""
    before = torch.get_num_threads()
    _init_group(launcher, init_method)
    report = _init_report(launcher)
    rank = dist.get_rank()
    record = {
        "rank": rank,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "launcher_vars": sorted(k for k in os.environ if k.startswith(LAUNCHER_PREFIXES)),
        "threads_before": before,
        "threads_after": torch.get_num_threads(),
        "core_share": dataclasses.asdict(report.core_share),
        "init_threads": report.host_threads,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


def _spawned(rank: int, out: Path, init_method: str) -> None:
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=WORLD_SIZE, timeout=TIMEOUT
    )
    run_rank("spawn", out, None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launcher", choices=("torchrun", "deepspeed", "mpirun", "slurm", "spawn"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--init-method")
    parser.add_argument("--local_rank", type=int)  # what the DeepSpeed launcher passes
    args = parser.parse_args()
    if args.launcher == "spawn":
        mp.spawn(_spawned, args=(args.out, args.init_method), nprocs=WORLD_SIZE)
    else:
        run_rank(args.launcher, args.out, args.init_method)


if __name__ == "__main__":
    main()
