"""The PyTorch door training step after step until a rank is killed.

Run by ``tests/test_step_unresponsive.py`` under ``torchrun``: each rank writes
``OUT/rank<rank>.pid`` after its second step and trains on, so that a kill lands in the
middle of training (steps run back to back: a step's collectives most of the time); the
test kills one rank and times torchrun's exit. A rank stops by itself after ``--seconds``
so that nothing outlives a broken test.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn

from flatzero import FlattenConfig, ZeroOptimizer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = ZeroOptimizer(
        net.parameters(),
        optimizer=torch.optim.AdamW,
        stage=2,
        flatten_config=FlattenConfig(bucket_numel=200, progress=False),
        lr=1e-3,
    )
    end = time.monotonic() + args.seconds
    step = 0
    while time.monotonic() < end:
        net(torch.randn(4, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if step == 2:
            (args.out / f"rank{rank}.pid").write_text(str(os.getpid()))


if __name__ == "__main__":
    main()
