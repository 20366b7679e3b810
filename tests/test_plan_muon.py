"""``flatzero plan --optimizer muon``: Muon's state and the owners' Newton-Schulz balance.

- the balance and the owned matrices per rank are what ``owners.place_whole`` gives the
  model's hidden matrices (called here directly, bucket window by bucket window, as the
  layout calls it), on the zoo's Llama-3 and Qwen3-30B-A3B shapes;
- the memory (master shard, Muon's momentum beside AdamW's moments) equals what a stepped
  ``ZeroOptimizer`` with DeepSpeed's Muon split holds, and the Newton-Schulz work per rank
  equals the orthogonalizations each rank really ran, at 3 ranks (gloo), stage 2, bf16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flatzero import FlattenConfig
from flatzero.cli import main
from flatzero.deepspeed.engine.muon_groups import muon_param_groups as door_groups
from flatzero.launch import run_ranks
from flatzero.layout import DEFAULT_ALIGNMENT
from flatzero.models import LlamaConfig, build_model
from flatzero.models.zoo import PRESETS
from flatzero.optim import ZeroOptimizer, deepspeed_muon
from flatzero.owners import newton_schulz_cost, place_whole
from flatzero.plan import PlanSpec, make_plan
from flatzero.plan.model_source import ModelSource, group_dicts, meta_model
from flatzero.plan.muon import muon_param_groups

LLAMA = LlamaConfig(
    vocab_size=97,
    hidden_size=40,
    intermediate_size=72,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=10,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
BUCKET = 3001  # elements: several buckets, none a multiple of the world size


def _plan(source: ModelSource, world_size: int, **spec) -> object:
    return make_plan(
        PlanSpec(
            model=source,
            gpus_per_node=world_size,
            gpu=None,
            optimizer="muon",
            bucket_numel=BUCKET,
            **spec,
        )
    )


@pytest.mark.parametrize(("preset", "world_size"), [("llama-3-8b", 3), ("qwen3-30b-a3b", 4)])
def test_plan_balance_is_what_the_owners_placement_gives(preset, world_size):
    source = ModelSource(preset, PRESETS[preset])
    plan = make_plan(PlanSpec(model=source, gpus_per_node=world_size, gpu=None, optimizer="muon"))
    model = meta_model(source, "bfloat16")
    hidden = [
        p
        for n, p in model.named_parameters()
        if p.ndim >= 2 and "embed" not in n and "lm_head" not in n
    ][::-1]  # layout order: reverse registration
    placement = place_whole(
        [p.numel() for p in hidden],
        [newton_schulz_cost(p.shape) for p in hidden],
        world_size=world_size,
        bucket_numel=plan.spec.bucket_numel,
        alignment=DEFAULT_ALIGNMENT,
    )
    costs, owned = [0] * world_size, [0] * world_size
    for p, rank in zip(hidden, placement.owners, strict=True):
        costs[rank] += newton_schulz_cost(p.shape)
        owned[rank] += p.numel()
    muon = plan.muon
    assert muon.matrices == len(hidden)
    assert list(muon.costs) == costs and list(muon.owned_numel) == owned
    assert muon.balance == max(costs) / (sum(costs) / world_size)
    assert muon.shard_numel == sum(placement.slice_numels)
    assert muon.balance <= 1.15  # the bound, on the real shapes


def test_newton_schulz_cost_of_fused_experts_and_convolutions_is_deepspeeds_batching():
    """DeepSpeed's Muon orthogonalizes a 3-D param as a batch of matrices and a 4-D one as
    one matrix: the owners balance the work it really does (Qwen3's fused experts)."""
    assert newton_schulz_cost((6, 10)) == 6 * 10 * 6
    assert newton_schulz_cost((4, 8, 16)) == 4 * (8 * 16 * 8)
    assert newton_schulz_cost((8, 3, 2, 2)) == 8 * 12 * 8
    assert newton_schulz_cost((7,)) == 7


def _step_and_count(rank: int, world_size: int) -> dict:
    """One step of DeepSpeed's Muon split under ZeroOptimizer; the state bytes it holds and
    the Newton-Schulz cost of the matrices this rank orthogonalized."""
    shapes = []
    real = deepspeed_muon.orthogonalize

    def counted(update, method):
        shapes.append(tuple(update.shape))
        return real(update, method)

    deepspeed_muon.orthogonalize = counted
    model = build_model(LLAMA, device="cpu", dtype=torch.bfloat16, seed=1, tie_embeddings=True)
    groups, options = door_groups(model, group_dicts(model, "decay"), {})
    opt = ZeroOptimizer(
        groups,
        deepspeed_muon.DeepSpeedMuon,
        stage=2,
        flatten_config=FlattenConfig(device="cpu", bucket_numel=BUCKET, progress=False),
        **options,
    )
    ids = torch.randint(0, LLAMA.vocab_size, (2, 7), generator=torch.Generator().manual_seed(rank))
    model(ids, labels=ids).loss.backward()
    shapes.clear()  # the optimizer's probes at construction: not the step's work
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    out = {
        "master": sum(m.nbytes for m in opt.master_shards),
        "optimizer": sum(t.nbytes for t in state),
        "cost": sum(newton_schulz_cost(s) for s in shapes),
        "matrices": len(shapes),
    }
    opt.close()
    return out


def test_plan_muon_memory_and_work_equal_the_stepped_optimizer():
    world_size = 3
    got = run_ranks(_step_and_count, world_size)
    source = ModelSource("llama", LLAMA, tie_embeddings=True)
    plan = _plan(source, world_size, grouping="decay")
    groups, whole = muon_param_groups(source, "bfloat16", "decay")
    assert whole == (0,) and len(groups) == 3  # matrices | embedding | norms
    for rank, real in enumerate(got):
        assert real["master"] == plan.states.master, rank
        assert real["optimizer"] == plan.states.optimizer, rank
        assert real["cost"] == plan.muon.costs[rank], rank
    assert sum(r["matrices"] for r in got) == plan.muon.matrices == 7 * LLAMA.num_hidden_layers
    adamw = make_plan(dataclasses.replace(plan.spec, optimizer="adamw"))
    assert plan.states.optimizer < adamw.states.optimizer  # one moment, not two, on matrices


def test_plan_cli_reports_muon_balance_and_json(capsys, tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--model", "llama-3-8b", "--layers", "2", "--optimizer", "muon"]
    assert main([*args, "--gpus-per-node", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "muon: 14 matrices whole on owner ranks" in text
    assert "Newton-Schulz work max/mean" in text
    import json

    data = json.loads(out.read_text())["muon"]
    assert data["matrices"] == 14 and len(data["costs"]) == 4
    assert data["balance"] == max(data["costs"]) / (sum(data["costs"]) / 4)
