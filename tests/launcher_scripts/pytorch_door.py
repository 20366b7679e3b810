"""README's PyTorch-door snippet as a newcomer pastes it: no ``init_process_group``.

Run by ``tests/test_launchers.py`` under ``torchrun --nproc-per-node 2``. Each rank feeds
its own half of a batch; the script writes ``OUT/rank<rank>.json`` with the world size the
optimizer saw and the weights after three steps, which the test compares across ranks and
with plain ``torch.optim.AdamW`` over the whole batch in one process.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from torch import nn

from flatzero import ZeroOptimizer

STEPS = 3


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step`` (both ranks' halves)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    net = model()
    # README's snippet, unchanged: the launcher's variables and nothing else
    opt = ZeroOptimizer(net.parameters(), optimizer=torch.optim.AdamW, stage=2, lr=3e-2)
    for step in range(STEPS):
        x, y = batch(step)
        half = slice(2 * rank, 2 * rank + 2)
        loss = nn.functional.mse_loss(net(x[half]), y[half])
        loss.backward()
        opt.step()
        opt.zero_grad()
    record = {
        "world_size": opt.flat.world_size,
        "weights": [p.detach().float().flatten().tolist() for p in net.parameters()],
    }
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
