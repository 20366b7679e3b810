"""``torch.compile`` through the DeepSpeed door (issue 39 item 3).

- ``flatzero.initialize(model=torch.compile(model))`` and ``engine.compile()`` train, with the
  losses of the eager engine (within ``COMPILED_REL``) and no graph break: flatzero's hooks
  run outside the compiled graph.
- HF Trainer with ``torch_compile=True`` under a DeepSpeed config routed to flatzero trains
  and matches DeepSpeed 0.19.8 (tests/test_hf_compile.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from flatzero.launch import run_ranks

COMPILED_REL = 1e-5
"""Compiled against eager losses, relative (fp32): inductor fuses and reorders the
reductions of a step (measured: within 1e-7 over 4 steps); the eager backends
(``aot_eager``) are bit for bit."""

STEPS = 4


class _Net(nn.Module):
    """A model of its own class, as a transformers model is (``module.compile()``, which
    DeepSpeed's and flatzero's ``engine.compile`` call, leaves a module of torch's own
    classes such as ``nn.Sequential`` eager: dynamo skips torch's files)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm, self.out = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(nn.functional.gelu(self.inp(x))))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _config(stage: int, overlap_comm: bool = False) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": stage, "overlap_comm": overlap_comm},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "gradient_clipping": 1.0,
    }


def _train(engine: Any, rank: int) -> list[float]:
    g = torch.Generator().manual_seed(rank + 1)
    losses = []
    for _ in range(STEPS * 2):
        x = torch.randn(4, 16, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _compile_rank(rank: int, world_size: int, stage: int, ways: tuple[str, ...]) -> dict:
    import torch._dynamo
    from torch._dynamo.utils import counters

    import flatzero

    out: dict[str, Any] = {}
    for way in ("eager", *ways):
        torch._dynamo.reset()
        counters.clear()
        model = _model()
        compiled = way in ("wrapped", "wrapped, overlap_comm")
        given = torch.compile(model) if compiled else model  # default backend
        config = _config(stage, overlap_comm=way == "wrapped, overlap_comm")
        engine, *_ = flatzero.initialize(model=given, config=config)
        if way == "engine.compile":
            engine.compile(backend="aot_eager", compile_kwargs={"dynamic": False})
            engine.compile()  # a second call does nothing, as DeepSpeed's
        out[way] = {
            "losses": _train(engine, rank),
            "is_compiled": engine.is_compiled,
            "module_is_model": engine.module is model,
            "names": sorted(n for n, _ in engine.module.named_parameters()),
            "graph_breaks": dict(counters["graph_break"]),
            "graphs": counters["stats"]["unique_graphs"],
        }
        engine.destroy()
    return out


@pytest.mark.parametrize(
    ("world_size", "stage", "ways"),
    [
        # overlap_comm: the per-bucket waits cannot live in a graph; overlap turns itself
        # off for a compiled forward (it crashed dynamo's tracing before)
        (2, 2, ("wrapped", "engine.compile", "wrapped, overlap_comm")),
        (1, 1, ("engine.compile",)),
    ],
)
def test_compiled_model_and_engine_compile_train_as_eager(world_size, stage, ways):
    for rank_out in run_ranks(_compile_rank, world_size, stage, ways):
        eager = rank_out["eager"]
        assert not eager["is_compiled"] and eager["graphs"] == 0
        for way in ways:
            got = rank_out[way]
            assert got["is_compiled"], way
            assert got["module_is_model"], way  # the module itself, compiled in place
            assert got["names"] == eager["names"], way  # no "_orig_mod." prefix
            assert got["graphs"] >= 1, way  # it did compile
            assert got["graph_breaks"] == {}, way
            if way.startswith("wrapped"):  # inductor
                assert got["losses"] == pytest.approx(eager["losses"], rel=COMPILED_REL)
            else:  # aot_eager: the eager kernels
                assert got["losses"] == eager["losses"], way


def test_compile_refuses_what_flatzero_does_not_run():
    import flatzero

    engine, *_ = flatzero.initialize(model=_model(), config=_config(2))
    try:
        with pytest.raises(NotImplementedError, match="compiled_autograd_enabled=True"):
            engine.compile(compiled_autograd_enabled=True)
        with pytest.raises(NotImplementedError, match="DeepCompile"):
            engine.compile(schedule=[(0, [])])
        assert not engine.is_compiled
    finally:
        engine.destroy()
