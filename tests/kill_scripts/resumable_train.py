"""One rank of a resumable 2-rank ZeRO-2 run, killed where ``KILL_AT`` says.

Used by ``tests/test_checkpoint_kill.py``, which starts both ranks (torchrun's environment:
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) in one process group of the
operating system. The run trains ``--steps`` steps through ``flatzero.initialize`` (the
DeepSpeed door), resumes from ``CKPT/latest`` if there is one, saves under the fixed tag
``last`` every ``--save-every`` steps (``"flatzero": {"async_save": ...}`` from
``ASYNC_SAVE``), and appends each step's loss to ``LOG/losses.rank<r>.jsonl``. At the end it
writes its optimizer shards to ``LOG/final.rank<r>.pt``.

``KILL_AT=point:count:rank``: when rank ``rank`` reaches ``point`` for the ``count``-th
time in this process, it SIGKILLs its whole process group, all ranks at once, as a
preempted node dies. ``point`` is a fault point of a save (``flatzero.checkpoint.atomic``)
or ``step`` (between a step's backward and its optimizer step). ``SLOW_WRITES=s``: sleep
``s`` seconds after each tensor a save writes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import flatzero
from flatzero.checkpoint.atomic import set_fault_hook


def killer(spec: str, rank: int, slow_s: float):
    """``hook(point, rank)`` that kills the process group at the ``count``-th ``point``
    (``spec`` empty: never), and sleeps ``slow_s`` seconds after each tensor written, so
    that an asynchronous save is still writing while the next steps change the state."""
    point, count, target = spec.split(":") if spec else ("", "0", "-1")
    seen = 0

    def hook(where: str, _at: int) -> None:
        nonlocal seen
        if where == "tensor_written":
            time.sleep(slow_s)
        if where == point and rank == int(target):
            seen += 1
            if seen == int(count):
                os.killpg(os.getpgrp(), signal.SIGKILL)

    return hook


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt")
    parser.add_argument("log")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, required=True)
    args = parser.parse_args()
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
            "gradient_clipping": 1.0,
            "steps_per_print": None,
            "flatzero": {
                "progress": False,
                "bucket_numel": 512,
                "async_save": os.environ.get("ASYNC_SAVE") == "1",
            },
        },
    )
    engine.load_checkpoint(args.ckpt)
    hook = killer(os.environ.get("KILL_AT", ""), rank, float(os.environ.get("SLOW_WRITES", 0)))
    set_fault_hook(hook)
    log = open(Path(args.log) / f"losses.rank{rank}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
    while engine.global_steps < args.steps:
        step = engine.global_steps
        x, y = batch(step, rank)
        loss = (engine(x) - y).square().mean()
        engine.backward(loss)
        hook("step", rank)
        engine.step()
        log.write(json.dumps({"step": step, "loss": float(loss).hex()}) + "\n")
        log.flush()
        if engine.global_steps % args.save_every == 0:
            engine.save_checkpoint(args.ckpt, tag="last")
    engine.destroy()  # waits for an asynchronous save
    state = engine.optimizer.sharded_state()
    final = {f"{gi}.master": g.master for gi, g in enumerate(state.groups)}
    for gi, g in enumerate(state.groups):
        final |= {f"{gi}.{k}": v for k, v in g.shards.items()}
        final |= {f"{gi}.{k}": torch.as_tensor(v) for k, v in g.scalars.items()}
    torch.save(final, Path(args.log) / f"final.rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
