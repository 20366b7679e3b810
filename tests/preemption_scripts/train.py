"""One rank of a 2-rank run with save on a signal, under real torchrun.

Used by ``tests/test_preemption.py``. Trains through ``flatzero.initialize`` with
``"flatzero": {"preemption_dir": CKPT, "async_save": true}``, resumes from ``CKPT/latest``
if there is one (appending the step it resumed from to ``LOG/resumed.rank<r>``), saves
asynchronously every ``--save-every`` steps, sleeps ``--step-s`` seconds per step and writes
its step to ``LOG/step.rank<r>`` (its pid to ``LOG/pid.rank<r>``). On ``Preempted`` it
appends the saved step to ``LOG/preempted.rank<r>`` and lets the exception end the process.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import flatzero
from flatzero.checkpoint import Preempted


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("log", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=0.1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    (args.log / f"pid.rank{rank}").write_text(str(os.getpid()))
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
            "flatzero": {
                "progress": False,
                "bucket_numel": 512,
                "async_save": True,
                "preemption_dir": args.ckpt,
            },
        },
    )
    if (Path(args.ckpt) / "latest").exists():
        engine.load_checkpoint(args.ckpt)
        with open(args.log / f"resumed.rank{rank}", "a") as f:
            f.write(f"{engine.global_steps}\n")
    try:
        while engine.global_steps < args.steps:
            g = torch.Generator().manual_seed(1000 * engine.global_steps + rank)
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
            engine.backward((engine(x) - y).square().mean())
            time.sleep(args.step_s)
            engine.step()
            (args.log / f"step.rank{rank}").write_text(str(engine.global_steps))
            if engine.global_steps % args.save_every == 0:
                engine.save_checkpoint(args.ckpt)
    except Preempted as preempted:
        with open(args.log / f"preempted.rank{rank}", "a") as f:
            f.write(f"{engine.global_steps} {preempted.checkpoint.name} {preempted.code}\n")
        raise
    engine.destroy()


if __name__ == "__main__":
    main()
