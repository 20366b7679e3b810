"""``torch.compile`` under the PyTorch door (``ZeroOptimizer``; issue 42 part 3, compile).

A compiled model trains with the eager losses (bit for bit with an eager backend, within
``COMPILED_REL`` with inductor) and no graph break: the optimizer's gradient hooks are
post-accumulate-grad hooks on the params, which autograd runs outside the compiled graph.
Compiled autograd: stage 1 trains with the eager losses; stage 2 is refused loudly by torch
(its end-of-backward callback, ``queue_callback``, needs compiled autograd's fullgraph
mode), never trained wrong.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from flatzero.launch import run_ranks

COMPILED_REL = 1e-5
"""Inductor against eager losses, relative (fp32): fused kernels round differently."""


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _losses(stage: int, rank: int, mode: str) -> list[float]:
    import flatzero

    torch.manual_seed(0)
    model = _Net()
    opt = flatzero.ZeroOptimizer(
        model.parameters(), optimizer=torch.optim.AdamW, stage=stage, lr=1e-2
    )
    run = model
    if mode == "inductor":
        model.compile()
    elif mode in ("aot_eager", "compiled autograd"):
        run = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(rank + 1)
    losses = []
    try:
        for _ in range(3):
            loss = run(torch.randn(4, 8, generator=g)).pow(2).mean()
            if mode == "compiled autograd":
                compiler = torch.compile(backend="aot_eager")
                with torch._dynamo.compiled_autograd._enable(compiler):
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        opt.close()
    return losses


MODES = {
    1: ("eager", "aot_eager", "compiled autograd"),
    2: ("eager", "inductor", "compiled autograd"),
}
"""What each stage runs (the suite's time: inductor once)."""


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo.utils import counters

    out: dict[str, Any] = {}
    for stage, modes in MODES.items():
        for mode in modes:
            torch._dynamo.reset()
            counters.clear()
            try:
                losses: Any = _losses(stage, rank, mode)
            except Exception as error:  # what compiled autograd says at stage 2
                losses = f"{type(error).__name__}: {error}"
            graphs = counters["stats"]["unique_graphs"]
            out[f"{stage} {mode}"] = (losses, dict(counters["graph_break"]), graphs)
    return out


def test_compiled_model_trains_under_zero_optimizer_as_eager():
    for out in run_ranks(_rank, 2):
        for stage in (1, 2):
            assert out[f"{stage} eager"][2] == 0
        losses, breaks, graphs = out["1 aot_eager"]
        assert (losses, breaks) == (out["1 eager"][0], {}) and graphs >= 1
        losses, breaks, graphs = out["2 inductor"]
        assert breaks == {} and graphs >= 1
        assert losses == pytest.approx(out["2 eager"][0], rel=COMPILED_REL)
        assert out["1 compiled autograd"][0] == out["1 eager"][0]
        assert "queue_callback" in out["2 compiled autograd"][0]
