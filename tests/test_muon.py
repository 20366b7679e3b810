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

    def __init__(self, only_matrices: bool = False) -> None:
        super().__init__()
        bias = not only_matrices
        self.a = nn.Linear(13, 37, bias=bias)
        self.b = nn.Linear(37, 29, bias=bias)
        self.norm = nn.LayerNorm(29, elementwise_affine=bias)
        self.c = nn.Linear(29, 7, bias=bias)
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


def _optimizers(model: nn.Module, stage: int, **zero) -> list[ZeroOptimizer]:
    matrices, rest = _split(model)
    optimizers = [ZeroOptimizer(matrices, torch.optim.Muon, stage=stage, lr=0.02, **zero)]
    if rest:
        optimizers.append(ZeroOptimizer(rest, torch.optim.AdamW, stage=stage, lr=1e-3, **zero))
    return optimizers


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
    """One process: torch's Muon on a model of matrices only, with the gradient of the
    mean over ranks of each rank's mean loss (DDP's, and flatzero's)."""
    torch.manual_seed(0)
    model = Net(only_matrices=True)
    optimizers = [torch.optim.Muon(model.parameters(), lr=0.02)]
    for step in range(steps):
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


def _count_orthogonalizations(count: list[int]) -> None:
    """Count calls of torch's Newton-Schulz in this process into ``count[0]``."""
    import torch.optim._muon as muon_module

    original = muon_module._zeropower_via_newtonschulz

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    muon_module._zeropower_via_newtonschulz = counted


def _full(opt: ZeroOptimizer, shards: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """Whole per-param tensors from every rank's shard-long tensors (one per group):
    gradient shards, momentum buffers; keyed by the param's position in the optimizer's
    params. Collective."""
    out = {}
    for group, shard in zip(opt.flat.layout.groups, shards, strict=True):
        parts = [torch.empty_like(shard) for _ in range(opt.world_size)]
        torch.distributed.all_gather(parts, shard.contiguous())
        for i, slot in enumerate(group.slots):
            full = torch.empty(slot.numel)
            for rank, piece in group.param_pieces(i):
                run = parts[rank][piece.shard_start : piece.shard_start + piece.numel]
                full[piece.param_start : piece.param_end] = run
            out[slot.registration_index] = full.view(slot.spec.shape)
    return out


def _momentum(opt: ZeroOptimizer) -> dict[str, torch.Tensor]:
    state = opt.state_dict()["optimizer"]["state"]
    return _full(opt, [state[i]["momentum_buffer"] for i in range(len(opt.master_shards))])


def _same_gradient_rank(rank: int, world_size: int, stage: int) -> dict:
    """flatzero's Muon beside a single-process ``torch.optim.Muon`` stepping copies of the
    matrices with the very gradient flatzero reduced (gathered whole, times 1/N as the
    step applies it): the updates must be bitwise the same, whoever owns each matrix."""
    torch.manual_seed(0)
    model = Net()
    muon, adamw = _optimizers(model, stage, flatten_config=SMALL_BUCKETS)
    matrices = dict(enumerate(_split(model)[0]))
    copies = {i: p.detach().clone() for i, p in matrices.items()}
    reference = torch.optim.Muon(list(copies.values()), lr=0.02)
    count = [0]
    _count_orthogonalizations(count)  # the steps only (construction probes state names)
    for step in range(STEPS):
        x, y = _batch(step, world_size)
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        muon.reduce_gradients()
        grads = _full(muon, muon.grad_shards)
        own = count[0]
        for i, copy in copies.items():
            copy.grad = grads[i] * (1.0 / world_size)
        reference.step()
        count[0] = own  # count flatzero's orthogonalizations, not the reference's
        for opt in (muon, adamw):
            opt.step()
            opt.zero_grad()
    worst = max(float((matrices[n].detach() - c).norm() / c.norm()) for n, c in copies.items())
    muon.close()
    adamw.close()
    return {"worst": worst, "orthogonalizations": count[0], "matrices": len(copies)}


@pytest.mark.parametrize(("world_size", "stage"), [(2, 1), (3, 2), (4, 2)])
def test_each_matrix_is_orthogonalized_once_by_its_owner_with_torchs_exact_update(
    world_size, stage
):
    results = run_ranks(_same_gradient_rank, world_size, stage)
    matrices = results[0]["matrices"]
    # every matrix exactly once per step over all ranks: no rank repeats another's work
    assert sum(r["orthogonalizations"] for r in results) == matrices * STEPS
    if world_size > 1:  # and the work is spread
        assert max(r["orthogonalizations"] for r in results) < matrices * STEPS
    assert max(r["worst"] for r in results) <= 1e-6, results


def _trajectory_rank(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = Net(only_matrices=True)
    optimizers = _optimizers(model, 2, flatten_config=SMALL_BUCKETS)
    _train(model, optimizers, STEPS, world_size, rank)
    for opt in optimizers:
        opt.close()
    return _plain(model)


@pytest.mark.parametrize("world_size", [1, 2])
def test_muon_matches_the_single_process_run(world_size):
    """50 steps of Muon equal one process running torch's Muon on the whole batch. At 1
    and 2 ranks the averaged gradient is bitwise the single process's (halving is exact).
    Anywhere the gradient differs by one fp32 ulp (a sum in another order at 3+ ranks;
    AdamW on a flat shard beside the matrices) torch's bf16 Newton-Schulz turns it into
    bf16-sized differences within steps (``docs/optimizer.md``): the test above gives
    torch's Muon flatzero's very gradient instead, at every world size."""
    results = run_ranks(_trajectory_rank, world_size)
    expected = _reference(STEPS, world_size)
    for result in results:
        for name, value in expected.items():
            rel = (torch.tensor(result[name]) - value).norm() / value.norm()
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
    momentum = {i: v.tolist() for i, v in _momentum(muon).items()}
    weights = _plain(model)
    muon.close()
    adamw.close()
    return {"momentum": momentum, "weights": weights}


@pytest.mark.parametrize("new_world_size", [3, 1])
def test_muon_momentum_saves_and_reshards(tmp_path, new_world_size):
    """Saved at 2 ranks after 6 steps, loaded at 3 (or 1): every matrix's whole momentum
    buffer and every weight are exactly what was saved, now on their new owners."""
    saved = run_ranks(_resume_rank, 2, str(tmp_path), "save")[0]
    assert any(any(v != 0 for v in row) for m in saved["momentum"].values() for row in m)
    for loaded in run_ranks(_resume_rank, new_world_size, str(tmp_path), "load"):
        assert loaded == saved


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
        with pytest.raises(ValueError, match=r"Adafactor keeps state .* cannot be saved"):
            opt.state_dict()
        opt.close()
