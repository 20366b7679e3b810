"""Stage 2, gradients delivered more than once per backward pass, differently by rank.

A block in two reentrant checkpointed segments on rank 0 and in one on rank 1 in the first
backward pass, in two on both later: rank 1 must have learnt the repeat from rank 0 (the
first pass's end agrees them), else its later pass reduces after the first delivery and
raises alone while rank 0 waits in a collective. Values checked against stage 1 (which
reduces at the boundary, whatever the deliveries).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.optim import ZeroConfig, ZeroOptimizer


def _run(rank: int, stage: int) -> tuple[dict[str, list], str]:
    torch.manual_seed(0)
    first, block, out = nn.Linear(8, 32), nn.Linear(32, 32), nn.Linear(32, 4)
    model = nn.ModuleDict({"first": first, "block": block, "out": out})
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.SGD,
        lr=0.1,
        config=ZeroConfig(stage=stage),
        flatten_config=FlattenConfig(device="cpu", progress=False, bucket_numel=512),
    )

    def loss(step: int, uses: int) -> torch.Tensor:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        h = torch.tanh(first(x))
        for _ in range(uses):
            h = checkpoint(lambda t: torch.tanh(block(t)), h, use_reentrant=True)
        return out(h).square().mean()

    error = "none"
    try:
        for step, uses in enumerate([2 if rank == 0 else 1, 2, 2]):
            loss(step, uses).backward()
            opt.step()
    except RuntimeError as e:  # the other rank then waits in a collective: fail it fast
        error = str(e)
    masters = {n: p.tolist() for n, p in opt.full_params().items()} if error == "none" else {}
    opt.close()
    return masters, error


def _both(rank: int, world: int) -> tuple[dict[str, list], str, dict, str]:
    torch.set_num_threads(1)
    one, error_one = _run(rank, 1)
    two, error_two = _run(rank, 2)
    return one, error_one, two, error_two


def test_repeats_learnt_on_one_rank_are_agreed_by_every_rank() -> None:
    for one, error_one, two, error_two in run_ranks(_both, 2, timeout_s=30):
        assert error_one == "none" and error_two == "none", (error_one, error_two)
        for name, value in one.items():
            torch.testing.assert_close(torch.tensor(two[name]), torch.tensor(value))
