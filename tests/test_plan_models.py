"""``flatzero plan`` on any causal-LM ``config.json`` transformers builds, its advice when
the states do not fit, and what its DeepSpeed legacy figure leaves out (issue 38 item 7).

Each family's config is tiny (a few thousand params), so transformers builds it on the meta
device in well under a second; the count must equal ``sum(p.numel())`` of that model."""

from __future__ import annotations

import json

import pytest
import torch

import flatzero.plan.model_source as model_source
from flatzero.plan import PlanSpec, make_plan, resolve_model
from flatzero.plan.advice import fit_advice, fit_advice_lines
from flatzero.plan.hardware import get_gpu
from flatzero.plan.memory_model import offload_host_memory
from flatzero.plan.model_source import param_groups
from flatzero.plan.report import format_plan

_GIB = 2**30

FAMILIES = {
    "qwen2": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 97,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 97,
    },
    "mixtral": {
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "vocab_size": 97,
    },
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 97},
    "gpt_neox": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
        "vocab_size": 97,
    },
    "deepseek_v3": {  # DeepSeek's MoE: shared expert, dense first layer, MLA attention
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 2,
        "first_k_dense_replace": 1,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "vocab_size": 97,
    },
}


def _write(tmp_path, model_type: str, fields: dict) -> str:
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps({"model_type": model_type, **fields}))
    return str(path)


def _meta_model(model_type: str, fields: dict) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_config_json_of_any_family_plans_what_transformers_builds(model_type, tmp_path):
    fields = FAMILIES[model_type]
    hf = _meta_model(model_type, fields)
    source = resolve_model(_write(tmp_path, model_type, fields))
    groups = param_groups(source, "bfloat16")
    assert sum(s.numel for g in groups for s in g) == sum(p.numel() for p in hf.parameters())
    assert {s.name for g in groups for s in g} == {n for n, _ in hf.named_parameters()}
    plan = make_plan(PlanSpec(model=source, gpus_per_node=2, gpu=get_gpu("h100")))
    assert plan.layout.param_numel == sum(p.numel() for p in hf.parameters())
    assert f"({model_type} (transformers), 2 layers)" in format_plan(plan)


def test_layers_replace_a_gpt2_configs_own(tmp_path):
    fields = FAMILIES["gpt2"]
    source = resolve_model(_write(tmp_path, "gpt2", fields), layers=3)
    hf = _meta_model("gpt2", {**fields, "n_layer": 3})
    assert source.num_hidden_layers == 3 and source.tie_embeddings  # GPT-2 ties by default
    groups = param_groups(source, "float32")
    assert sum(s.numel for g in groups for s in g) == sum(p.numel() for p in hf.parameters())


def test_without_transformers_the_zoo_counts_and_other_families_are_named(tmp_path, monkeypatch):
    """The fallback: llama/mistral/qwen3_moe by the zoo's own builders (the same count as
    transformers), any other family refused by its model type, not by a field it lacks
    (GPT-2 has ``n_head``, not ``num_attention_heads``)."""
    mistral = _write(tmp_path, "mistral", FAMILIES["mistral"])
    with_transformers = param_groups(resolve_model(mistral), "bfloat16")
    monkeypatch.setattr(model_source, "transformers_available", lambda: False)
    zoo = resolve_model(mistral)
    assert zoo.config is not None and zoo.hf_config is None
    assert sum(s.numel for g in param_groups(zoo, "bfloat16") for s in g) == sum(
        s.numel for g in with_transformers for s in g
    )
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported") as error:
        resolve_model(_write(tmp_path, "gpt2", FAMILIES["gpt2"]))
    assert "num_attention_heads" not in str(error.value)


def test_a_config_without_a_model_type_is_named(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(FAMILIES["mistral"]))
    with pytest.raises(ValueError, match="'model_type' is None"):
        param_groups(resolve_model(str(path)), "bfloat16")


@pytest.fixture(scope="module")
def llama_70b_on_8_h100():
    source = resolve_model("llama-3-70b")
    return make_plan(PlanSpec(model=source, gpus_per_node=8, gpu=get_gpu("h100")))


def test_70b_on_8x80gb_is_advised_zero3_and_offload_with_numbers(llama_70b_on_8_h100):
    """Llama-3-70B's states do not fit 8 x 80 GB at ZeRO-1/2: the advice is not "more ranks
    or bf16 params" (params are whole on every rank, and bf16 already) but ZeRO-3 / FSDP,
    optimizer offload and a smaller bucket, each with the plan's own bytes."""
    plan = llama_70b_on_8_h100
    s = plan.states
    a = fit_advice(plan)
    assert a is not None and a.params == s.params > plan.free_bytes
    shards = s.master + s.grad_shards + s.optimizer
    assert a.shards == shards
    assert a.zero3 == -(-s.params // 8) + shards + s.grad_staging + plan.largest_gradient
    assert a.zero3 > plan.free_bytes  # ZeRO-3 alone does not fit 8 ranks either ...
    per_rank_at = (s.params + 8 * shards) / a.zero3_ranks + s.grad_staging + plan.largest_gradient
    assert per_rank_at <= plan.free_bytes  # ... it fits from zero3_ranks on, not one fewer
    fewer = (s.params + 8 * shards) / (a.zero3_ranks - 1) + s.grad_staging + plan.largest_gradient
    assert fewer > plan.free_bytes
    assert a.zero3_offload_device <= plan.free_bytes  # ZeRO-3 with optimizer offload fits
    host = offload_host_memory(plan.layout, optimizer="adamw", pinned=True).total
    assert a.offload_host == host
    assert a.offload_device == s.total + plan.largest_gradient - s.master - s.optimizer
    assert a.staging == s.grad_staging
    text = "\n".join(fit_advice_lines(plan))
    assert "more ranks cannot make it fit" in text and "bf16 params" not in text
    for figure in (a.params, a.zero3, a.zero3_offload_device, a.offload_host, a.staging):
        assert f"{figure / _GIB:.2f} GiB" in text
    assert f"from {a.zero3_ranks} ranks on" in text
    reason = plan.decision.reason
    assert plan.decision.tier is None and "bf16 params" not in reason
    assert "more ranks cannot help" in reason and "ZeRO-3" in reason
    assert text in format_plan(plan)


def test_a_plan_that_fits_gets_no_advice():
    plan = make_plan(PlanSpec(model=resolve_model("llama-3-8b"), gpu=get_gpu("h100")))
    assert fit_advice(plan) is None and fit_advice_lines(plan) == []
    assert "What helps" not in format_plan(plan)


def test_the_legacy_figure_says_it_is_a_lower_bound(llama_70b_on_8_h100):
    lines = format_plan(llama_70b_on_8_h100).splitlines()
    row = next(i for i, line in enumerate(lines) if "DeepSpeed legacy CPU cat" in line)
    note = lines[row + 2]  # after the device path's row
    assert "DeepSpeed 0.19 device cat" in lines[row + 1]
    assert note.startswith("  (the legacy CPU cat's time is a lower bound")
    assert "8 ranks each running its host work on every core at once" in note


@pytest.mark.parametrize(
    ("model_type", "change", "message"),
    [
        ("gpt2", {"n_head": 0}, "the config's 'n_head' is 0; it must be a positive whole number"),
        ("gpt2", {"n_embd": 10**12}, "n_embd=1000000000000 is more than 10,000,000"),
        ("mixtral", {"num_local_experts": 10**6}, "are 2,000,000 experts, more than 1,000,000"),
        ("no_such_model", {}, "transformers cannot build model_type 'no_such_model'"),
    ],
)
def test_a_nonsensical_config_of_any_family_is_refused_before_it_is_built(
    model_type, change, message, tmp_path
):
    pytest.importorskip("transformers")
    fields = {**FAMILIES.get(model_type, FAMILIES["gpt2"]), **change}
    with pytest.raises(ValueError, match=message):
        resolve_model(_write(tmp_path, model_type, fields))
