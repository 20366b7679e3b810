"""Muon under ZeRO-1/2: whole matrices on owner ranks, each orthogonalized once per step.

``torch.optim.Muon`` (and any optimizer that steps whole tensors) runs through
``ZeroOptimizer`` on a whole-params layout (``flatzero.owners``): every matrix lies inside
one rank's slice, its owner runs Muon on it, the all-gather spreads the result. Parity is
against single-process ``torch.optim.Muon`` + ``AdamW`` (as torch's docs pair them), at
world sizes 1-4 with sizes that do not divide evenly.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flatzero import ZeroOptimizer
from flatzero.checkpoint import load_checkpoint, save_checkpoint
from flatzero.config import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.layout import ParamSpec, plan_layout
from flatzero.models.zoo import PRESETS, build_model
from flatzero.owners import newton_schulz_cost

pytestmark = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch without Muon")

STEPS = 50
BATCH = 12  # rows per rank
SMALL_BUCKETS = FlattenConfig(bucket_numel=900, progress=False)  # several buckets, uneven


class Net(nn.Module):
    """Matrices of odd shapes (Muon) beside biases and a norm (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(13, 37)
        self.b = nn.Linear(37, 29)
        self.norm = nn.LayerNorm(29)
        self.c = nn.Linear(29, 7)
        self.d = nn.Linear(7, 5, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(torch.tanh(self.c(self.norm(torch.tanh(self.b(torch.tanh(self.a(x))))))))


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """torch's docs' split: 2-D params to Muon, the rest to AdamW."""
    params = list(model.parameters())
    return [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]


def _batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH * world_size, 13, generator=g), torch.randn(
        BATCH * world_size, 5, generator=g
    )


def _optimizers(model: nn.Module, stage: int, **zero):
    matrices, rest = _split(model)
    muon = ZeroOptimizer(matrices, torch.optim.Muon, stage=stage, lr=0.02, **zero)
    adamw = ZeroOptimizer(rest, torch.optim.AdamW, stage=stage, lr=1e-3, **zero)
    return muon, adamw


def _train(model, optimizers, steps, world_size, rank, first=0):
    for step in range(first, first + steps):
        x, y = _batch(step, world_size)
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def _plain(model: nn.Module) -> dict[str, list]:
    """The model's weights as nested lists (plain data across the process boundary)."""
    return {k: v.tolist() for k, v in model.state_dict().items()}


def _reference(steps: int, world_size: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    matrices, rest = _split(model)
    optimizers = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, fused=True)]
    for step in range(steps):
        x, y = _batch(step, world_size)
        # the mean over ranks of each rank's mean loss: DDP's (and flatzero's) gradient
        losses = [
            nn.functional.mse_loss(
                model(x[r * BATCH : (r + 1) * BATCH]), y[r * BATCH : (r + 1) * BATCH]
            )
            for r in range(world_size)
        ]
        (sum(losses) / world_size).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _count_orthogonalizations(monkeypatch_target: list[int]):
    import torch.optim._muon as muon_module

    original = muon_module._zeropower_via_newtonschulz

    def counted(*args, **kwargs):
        monkeypatch_target[0] += 1
        return original(*args, **kwargs)

    muon_module._zeropower_via_newtonschulz = counted


def _parity_rank(rank: int, world_size: int, stage: int) -> dict:
    torch.manual_seed(0)
    model = Net()
    optimizers = _optimizers(model, stage, flatten_config=SMALL_BUCKETS)
    count = [0]
    _count_orthogonalizations(count)  # in the steps (construction probes the state's names)
    _train(model, optimizers, STEPS, world_size, rank)
    for opt in optimizers:
        opt.close()
    return {
        "weights": _plain(model),
        "orthogonalizations": count[0],
    }


@pytest.mark.parametrize(("world_size", "stage"), [(1, 2), (2, 1), (3, 2), (4, 2)])
def test_muon_matches_single_process_muon_and_each_matrix_is_orthogonalized_once(world_size, stage):
    results = run_ranks(_parity_rank, world_size, stage)
    expected = _reference(STEPS, world_size)
    matrices = sum(1 for v in expected.values() if v.ndim == 2)
    # every matrix exactly once per step over all ranks: no rank repeats another's work
    assert sum(r["orthogonalizations"] for r in results) == matrices * STEPS
    if world_size > 1:  # and the work is spread
        assert max(r["orthogonalizations"] for r in results) < matrices * STEPS
    for result in results:
        for name, value in expected.items():
            got = torch.tensor(result["weights"][name])
            rel = (got - value).norm() / value.norm()
            assert rel <= 1e-6, (name, rel.item())


def _resume_rank(rank: int, world_size: int, directory: str, phase: str) -> dict:
    torch.manual_seed(0)
    model = Net()
    muon, adamw = _optimizers(model, 2, flatten_config=SMALL_BUCKETS)
    if phase == "save":
        _train(model, (muon, adamw), 6, world_size, rank)
        save_checkpoint(f"{directory}/muon", muon, tag="t", model=model)
        save_checkpoint(f"{directory}/adamw", adamw, tag="t")
    else:
        load_checkpoint(f"{directory}/muon", muon, model=model)
        load_checkpoint(f"{directory}/adamw", adamw)
        _train(model, (muon, adamw), 4, world_size, rank, first=6)
    muon.close()
    adamw.close()
    return _plain(model)


@pytest.mark.parametrize("new_world_size", [3, 1])
def test_muon_momentum_saves_and_reshards(tmp_path, new_world_size):
    """Saved at 2 ranks after 6 steps, resumed at 3 (or 1) ranks for 4 more: the weights
    equal one process that took the same 10 steps (the momentum buffers reached their new
    owners; without them the 4 steps would differ)."""
    run_ranks(_resume_rank, 2, str(tmp_path), "save")
    resumed = run_ranks(_resume_rank, new_world_size, str(tmp_path), "load")
    reference = _reference_resumed(new_world_size)
    for name, value in reference.items():
        rel = (torch.tensor(resumed[0][name]) - value).norm() / value.norm()
        assert rel <= 1e-6, (name, rel.item())


def _reference_resumed(new_world_size: int) -> dict[str, torch.Tensor]:
    """6 steps as 2 ranks, then 4 as ``new_world_size`` ranks, in one process."""
    torch.manual_seed(0)
    model = Net()
    matrices, rest = _split(model)
    optimizers = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3, fused=True)]
    for step in range(10):
        world_size = 2 if step < 6 else new_world_size
        x, y = _batch(step, world_size)
        losses = [
            nn.functional.mse_loss(
                model(x[r * BATCH : (r + 1) * BATCH]), y[r * BATCH : (r + 1) * BATCH]
            )
            for r in range(world_size)
        ]
        (sum(losses) / world_size).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_owner_layout_balances_newton_schulz_work_on_real_shapes(preset, world_size):
    """Llama-3-8B and Qwen3-30B-A3B hidden matrices: per-rank Newton-Schulz cost within
    1.15 of the mean, every matrix whole on one rank, padding under 10 %."""
    model = build_model(PRESETS[preset], device="meta")
    specs = [
        ParamSpec(n, tuple(p.shape), "bfloat16")
        for n, p in model.named_parameters()
        if p.ndim == 2 and "embed" not in n and "lm_head" not in n
    ]
    layout = plan_layout([specs], world_size=world_size, bucket_numel=2**26, whole_params=True)
    group = layout.groups[0]
    cost = [0] * world_size
    for i, slot in enumerate(group.slots):
        pieces = group.param_pieces(i)
        assert len(pieces) == 1, slot.spec.name
        cost[pieces[0][0]] += newton_schulz_cost(slot.spec.shape)
    assert max(cost) / (sum(cost) / world_size) <= 1.15
    assert group.padding_numel <= 0.10 * group.param_numel


def test_muon_state_dict_round_trips_and_an_adafactor_save_is_refused_clearly():
    torch.manual_seed(0)
    model = Net()
    matrices, _ = _split(model)
    opt = ZeroOptimizer(matrices, torch.optim.Muon, lr=0.02)
    model(torch.randn(4, 13)).sum().backward()
    opt.step()
    state = opt.state_dict()
    assert set(state["optimizer"]["state"][0]) == {"momentum_buffer"}
    buffer = state["optimizer"]["state"][0]["momentum_buffer"]
    assert buffer.shape == opt.master_shards[0].shape and buffer.abs().sum() > 0
    saved = buffer.clone()
    opt.load_state_dict(state)
    assert torch.equal(opt.state_dict()["optimizer"]["state"][0]["momentum_buffer"], saved)
    opt.close()
    if hasattr(torch.optim, "Adafactor"):
        model = Net()
        opt = ZeroOptimizer(list(model.parameters()), torch.optim.Adafactor, lr=0.01)
        model(torch.randn(4, 13)).sum().backward()
        opt.step()  # trains: whole matrices on their owner
        with pytest.raises(ValueError, match="Adafactor keeps state .* cannot be saved"):
            opt.state_dict()
        opt.close()
