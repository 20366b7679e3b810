"""One rank of a 2-rank run whose last act is an asynchronous save, with no ``destroy()``.

Used by ``tests/test_checkpoint_exit.py`` (torchrun's environment: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``). Trains two steps through ``flatzero.initialize`` with
``"flatzero": {"async_save": true}``, then ``engine.save_checkpoint(CKPT, tag="last")`` and
ends: as Hugging Face Trainer and Accelerate end, without ``engine.destroy()``; with
``--destroy-group``, after ``torch.distributed.destroy_process_group()``. Each tensor the save
writes is followed by a ``--slow`` seconds sleep, so that the save is still being written
when the script ends. ``--fault``:

- ``none``: nothing goes wrong;
- ``full``: rank 0 fills the disk (``CKPT/ballast``) before the save: every rank fails;
- ``full-late``: rank 0 fills the disk once rank 1 has written its file: only rank 0 fails.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import flatzero
from flatzero.checkpoint.atomic import set_fault_hook


def fill(disk: Path) -> None:
    """Write ``disk/ballast`` until the file system is full."""
    fd = os.open(disk / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 4096)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt", type=Path)
    parser.add_argument("--fault", choices=("none", "full", "full-late"), default="none")
    parser.add_argument("--slow", type=float, default=0.0)
    parser.add_argument("--destroy-group", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))
    engine, _, _, _ = flatzero.initialize(
        model=model,
        config={
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 4,
            "zero_optimization": {"stage": 2},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "steps_per_print": None,
            "flatzero": {"progress": False, "bucket_numel": 512, "async_save": True},
        },
    )
    for _ in range(2):
        loss = engine(torch.randn(4, 16)).square().mean()
        engine.backward(loss)
        engine.step()

    def hook(point: str, at: int) -> None:
        if point == "tensor_written":
            time.sleep(args.slow)
        if point == "copying_snapshot" and at == 0 and args.fault == "full-late":
            time.sleep(1.5)  # rank 1 writes its file meanwhile
            fill(args.ckpt)

    set_fault_hook(hook)
    if args.fault == "full" and rank == 0:
        fill(args.ckpt)
    dist.barrier()
    engine.save_checkpoint(args.ckpt, tag="last")
    if args.destroy_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
