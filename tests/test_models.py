"""Tests of the model zoo: preset shapes, init, forward, expert layouts, safetensors."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from flatzero.models import (
    IGNORE_INDEX,
    INIT_STD,
    PRESETS,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    build_model,
    count_bytes,
    count_params,
    count_tensors,
    get_preset,
    load_model_safetensors,
    materialize,
    save_model_safetensors,
    scaled,
)
from flatzero.models.layers import Attention, rope_cos_sin
from flatzero.models.qwen3_moe import SparseMoeBlock

TINY_LLAMA = scaled(
    "llama-3-8b", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, vocab=97
)
TINY_QWEN = scaled(
    "qwen3-30b-a3b",
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=32,
    experts=8,
    top_k=2,
    vocab=97,
)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """The models here are tiny: one intra-op thread is fastest, and it keeps these tests
    fast when other processes compete for the cores (spinning OpenMP threads then wait on
    descheduled ones at every op)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tokens(config: LlamaConfig | Qwen3MoeConfig, batch: int = 2, seq: int = 12) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, config.vocab_size, (batch, seq), generator=generator)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _fuse_experts(state: dict[str, torch.Tensor], config: Qwen3MoeConfig) -> dict:
    """Unfused (transformers 4.x) expert weights -> fused (5.x) 3-D tensors."""
    fused = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        experts = range(config.num_experts)
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [state[f"{prefix}.{e}.gate_proj.weight"], state[f"{prefix}.{e}.up_proj.weight"]]
                )
                for e in experts
            ]
        )
        fused[f"{prefix}.down_proj"] = torch.stack(
            [state[f"{prefix}.{e}.down_proj.weight"] for e in experts]
        )
    return fused


# ---------------------------------------------------------------- preset shapes (meta)


@pytest.mark.parametrize(("layout", "tensors"), [("fused", 178), ("unfused", 6290)])
def test_qwen3_30b_a3b_16_layers_matches_the_reported_model(layout: str, tensors: int) -> None:
    config = scaled("qwen3-30b-a3b", layers=16, expert_layout=layout)
    base = build_model(config, with_lm_head=False)
    assert all(p.is_meta for p in base.parameters())
    assert count_tensors(base) == tensors
    assert count_params(base) == 10_281_097_216
    assert round(count_params(base) / 1e9, 1) == 10.3
    assert round(count_bytes(base) / 2**30, 1) == 19.2

    causal = build_model(config)
    assert count_tensors(causal) == tensors + 1
    assert count_params(causal) == count_params(base) + 151936 * 2048


def test_llama_3_8b_has_8_03b_params() -> None:
    model = build_model(get_preset("llama-3-8b"))
    assert count_params(model) == 8_030_261_248
    assert round(count_params(model) / 1e9, 2) == 8.03
    assert count_tensors(model) == 32 * 9 + 3
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_parameter_names_follow_hf_transformers() -> None:
    fused = dict(build_model(TINY_QWEN).named_parameters())
    unfused = dict(build_model(scaled(TINY_QWEN, expert_layout="unfused")).named_parameters())
    llama = dict(build_model(TINY_LLAMA).named_parameters())
    assert fused["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert fused["model.layers.1.mlp.experts.down_proj"].shape == (8, 64, 32)
    assert fused["model.layers.0.mlp.gate.weight"].shape == (8, 64)
    assert fused["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert unfused["model.layers.0.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert unfused["model.layers.0.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    for names in (fused, unfused, llama):
        order = list(names)
        assert order[0] == "model.embed_tokens.weight"
        assert order[-2:] == ["model.norm.weight", "lm_head.weight"]
        assert "model.layers.1.self_attn.o_proj.weight" in names
        assert "model.layers.1.post_attention_layernorm.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in llama
    assert not any("q_norm" in name for name in llama)


def test_scaled_replaces_only_the_given_fields() -> None:
    config = scaled("qwen3-30b-a3b", layers=4, intermediate=64)
    assert config == dataclasses.replace(
        PRESETS["qwen3-30b-a3b"], num_hidden_layers=4, moe_intermediate_size=64
    )
    assert scaled(TINY_LLAMA, intermediate=128).intermediate_size == 128


# ---------------------------------------------------------------- init


def test_materialize_is_deterministic_and_seeded() -> None:
    first = _state(build_model(TINY_QWEN, device="cpu", seed=0))
    second = _state(build_model(TINY_QWEN, device="cpu", seed=0))
    other = _state(build_model(TINY_QWEN, device="cpu", seed=1))
    assert first.keys() == second.keys() == other.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
        if first[name].dim() >= 2:
            assert not torch.equal(first[name], other[name]), name


def test_materialize_values_do_not_depend_on_order_count_threads_or_dtype() -> None:
    reference = build_model(TINY_LLAMA, dtype=torch.float32)
    reference = _state(materialize(reference, "cpu", threads=3))
    # Fewer parameters before each one (no lm_head) and one thread: same values.
    headless = build_model(TINY_LLAMA, dtype=torch.float32, with_lm_head=False)
    headless = _state(materialize(headless, "cpu", threads=1))
    for name, value in headless.items():
        assert torch.equal(value, reference[name]), name
    # A bfloat16 model is the rounding of the float32 one.
    bf16 = _state(build_model(TINY_LLAMA, device="cpu", dtype=torch.bfloat16))
    for name, value in bf16.items():
        assert torch.equal(value, reference[name].to(torch.bfloat16)), name


def test_materialize_init_distribution() -> None:
    # Large enough to span several random chunks per matrix.
    config = scaled(TINY_LLAMA, vocab=40_000)
    state = _state(build_model(config, device="cpu", dtype=torch.float32))
    for name, value in state.items():
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
    embed = state["model.embed_tokens.weight"]
    assert embed.std().item() == pytest.approx(INIT_STD, rel=0.01)
    assert abs(embed.mean().item()) < 1e-4
    # Chunks are independent streams, not one stream repeated.
    flat = embed.flatten()
    assert not torch.equal(flat[: 1 << 10], flat[1 << 20 : (1 << 20) + (1 << 10)])


def test_materialize_rejects_meta_device() -> None:
    with pytest.raises(ValueError, match="meta"):
        materialize(build_model(TINY_LLAMA), "meta")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (run with FLATZERO_TEST_GPU=1)"
)
def test_materialize_on_cuda_equals_cpu() -> None:
    on_cpu = _state(build_model(TINY_QWEN, device="cpu"))
    on_cuda = _state(build_model(TINY_QWEN, device="cuda"))
    for name, value in on_cuda.items():
        assert value.is_cuda
        assert torch.equal(value.cpu(), on_cpu[name]), name


# ---------------------------------------------------------------- tied embeddings


def test_tied_embeddings_share_one_parameter() -> None:
    meta = build_model(TINY_LLAMA, tie_embeddings=True)
    assert meta.lm_head.weight is meta.model.embed_tokens.weight
    assert count_tensors(meta) == count_tensors(build_model(TINY_LLAMA)) - 1
    model = materialize(meta, "cpu")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight.is_meta
    with pytest.raises(ValueError, match="with_lm_head"):
        build_model(TINY_LLAMA, with_lm_head=False, tie_embeddings=True)


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize(
    "config", [TINY_LLAMA, TINY_QWEN, scaled(TINY_QWEN, expert_layout="unfused")]
)
def test_forward_shapes_loss_and_determinism(config) -> None:
    model = build_model(config, device="cpu", dtype=torch.float32)
    ids = _tokens(config)
    out = model(ids, labels=ids)
    assert out.logits.shape == (2, 12, config.vocab_size)
    assert out.last_hidden_state.shape == (2, 12, config.hidden_size)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    # Near-uniform predictions from a fresh init.
    assert out.loss.item() == pytest.approx(math.log(config.vocab_size), rel=0.05)
    expected = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, config.vocab_size), ids[:, 1:].flatten()
    )
    assert torch.allclose(out.loss, expected)
    again = model(ids, labels=ids)
    assert torch.equal(again.logits, out.logits)
    assert model(ids).loss is None


def test_loss_ignores_ignore_index() -> None:
    model = build_model(TINY_LLAMA, device="cpu", dtype=torch.float32)
    ids = _tokens(TINY_LLAMA)
    labels = ids.clone()
    labels[:, 6:] = IGNORE_INDEX
    out = model(ids, labels=labels)
    expected = F.cross_entropy(
        out.logits[:, :5].reshape(-1, TINY_LLAMA.vocab_size), ids[:, 1:6].flatten()
    )
    assert torch.allclose(out.loss, expected)


def test_bfloat16_forward_and_headless_model() -> None:
    model = build_model(TINY_QWEN, device="cpu")
    ids = _tokens(TINY_QWEN)
    assert model(ids, labels=ids).logits.dtype == torch.bfloat16
    headless = build_model(TINY_QWEN, device="cpu", with_lm_head=False)
    out = headless(ids)
    assert out.logits is None and out.last_hidden_state.shape == (2, 12, 64)
    with pytest.raises(ValueError, match="lm_head"):
        headless(ids, labels=ids)


def test_fused_and_unfused_experts_compute_the_same_function() -> None:
    unfused_config = scaled(TINY_QWEN, expert_layout="unfused")
    unfused = build_model(unfused_config, device="cpu", dtype=torch.float32)
    fused = build_model(TINY_QWEN, device="cpu", dtype=torch.float32, seed=7)
    fused.load_state_dict(_fuse_experts(unfused.state_dict(), unfused_config))
    ids = _tokens(TINY_QWEN, seq=24)
    a, b = unfused(ids, labels=ids), fused(ids, labels=ids)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-6, atol=1e-6)


def _reference_moe(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, renormalize, weighted sum of expert MLPs."""
    out = torch.zeros_like(x)
    for t, token in enumerate(x):
        probs = torch.softmax(block.gate.weight @ token, dim=-1)
        weights, chosen = torch.topk(probs, block.top_k)
        weights = weights / weights.sum()
        for w, e in zip(weights, chosen.tolist(), strict=True):
            expert = block.experts[e]
            hidden = F.silu(expert.gate_proj.weight @ token) * (expert.up_proj.weight @ token)
            out[t] += w * (expert.down_proj.weight @ hidden)
    return out


def test_moe_block_matches_a_token_by_token_reference() -> None:
    model = build_model(
        scaled(TINY_QWEN, expert_layout="unfused"), device="cpu", dtype=torch.float32
    )
    block = model.model.layers[0].mlp
    x = torch.randn(1, 20, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(block(x)[0], _reference_moe(block, x[0]))


def test_attention_matches_an_explicit_reference() -> None:
    model = build_model(TINY_QWEN, device="cpu", dtype=torch.float32)
    attn: Attention = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
    seq, heads, kv_heads, dim = 10, 4, 2, 16
    x = torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_cos_sin(seq, dim, TINY_QWEN.rope_theta, device=x.device, dtype=x.dtype)

    def rms(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + TINY_QWEN.rms_norm_eps)

    def rope(v: torch.Tensor) -> torch.Tensor:  # [seq, heads, dim], as complex rotations
        half = dim // 2
        freq = TINY_QWEN.rope_theta ** (-torch.arange(half, dtype=torch.float64) * 2 / dim)
        angle = torch.arange(seq, dtype=torch.float64)[:, None] * freq
        z = torch.complex(v[..., :half].double(), v[..., half:].double())
        z = z * torch.polar(torch.ones_like(angle), angle)[:, None, :]
        return torch.cat([z.real, z.imag], dim=-1).float()

    q = rope(rms((x[0] @ attn.q_proj.weight.T).view(seq, heads, dim), attn.q_norm.weight))
    k = rope(rms((x[0] @ attn.k_proj.weight.T).view(seq, kv_heads, dim), attn.k_norm.weight))
    v = (x[0] @ attn.v_proj.weight.T).view(seq, kv_heads, dim)
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
    mixed = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(seq, heads * dim)
    with torch.no_grad():
        torch.testing.assert_close(attn(x, cos, sin)[0], mixed @ attn.o_proj.weight.T)


# ---------------------------------------------------------------- gradients and training


def test_gradients_reach_every_routed_parameter() -> None:
    config = scaled(TINY_QWEN, expert_layout="unfused", experts=16)
    model = build_model(config, device="cpu", dtype=torch.float32)
    ids = _tokens(config, batch=1, seq=4)  # 4 tokens x top-2 cannot reach all 16 experts
    model(ids, labels=ids).loss.backward()
    no_grad = {name for name, p in model.named_parameters() if p.grad is None}
    assert no_grad, "expected some experts to receive no tokens"
    assert all(".mlp.experts." in name for name in no_grad)
    routed = {name for name, p in model.named_parameters() if ".mlp.experts." in name}
    assert routed - no_grad, "expected some experts to receive tokens"

    # Fused layout, same weights: the same gradients, zeros where unfused has None.
    fused = build_model(scaled(config, expert_layout="fused"), dtype=torch.float32)
    fused.load_state_dict(_fuse_experts(model.state_dict(), config), assign=True)
    fused(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in fused.parameters())
    grads = {
        name: torch.zeros_like(p) if p.grad is None else p.grad
        for name, p in model.named_parameters()
    }
    for name, grad in _fuse_experts(grads, config).items():
        torch.testing.assert_close(fused.get_parameter(name).grad, grad, msg=name)


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN], ids=["llama", "qwen3-moe"])
def test_adamw_steps_reduce_the_loss(config) -> None:
    model = build_model(config, device="cpu", dtype=torch.float32, tie_embeddings=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = _tokens(config, batch=4, seq=16)
    losses = []
    for _ in range(12):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert losses[-1] < 0.7 * losses[0], losses


# ---------------------------------------------------------------- safetensors


def test_safetensors_round_trip_is_bitwise(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    source = build_model(scaled(TINY_QWEN, expert_layout="unfused"), device="cpu", seed=3)
    save_model_safetensors(source, path)
    expected = _state(source)

    into_materialized = build_model(scaled(TINY_QWEN, expert_layout="unfused"), device="cpu")
    param = into_materialized.model.norm.weight
    load_model_safetensors(into_materialized, path)
    assert into_materialized.model.norm.weight is param  # updated in place

    into_meta = load_model_safetensors(
        build_model(scaled(TINY_QWEN, expert_layout="unfused")), path
    )
    for model in (into_materialized, into_meta):
        state = _state(model)
        assert state.keys() == expected.keys()
        for name, value in state.items():
            assert value.dtype == torch.bfloat16 and torch.equal(value, expected[name]), name


def test_safetensors_saves_tied_weights_once(tmp_path) -> None:
    from safetensors import safe_open

    path = tmp_path / "tied.safetensors"
    save_model_safetensors(build_model(TINY_LLAMA, device="cpu", tie_embeddings=True), path)
    with safe_open(path, framework="pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys
    assert "model.embed_tokens.weight" in keys
    loaded = load_model_safetensors(build_model(TINY_LLAMA, tie_embeddings=True), path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert not loaded.lm_head.weight.is_meta


def test_safetensors_rejects_mismatches(tmp_path) -> None:
    path = tmp_path / "llama.safetensors"
    save_model_safetensors(build_model(TINY_LLAMA, device="cpu"), path)
    with pytest.raises(ValueError, match="missing"):
        load_model_safetensors(build_model(scaled(TINY_LLAMA, layers=3)), path)
    with pytest.raises(ValueError, match="shape"):
        load_model_safetensors(build_model(scaled(TINY_LLAMA, intermediate=64)), path)
    with pytest.raises(ValueError, match="materialize"):
        save_model_safetensors(build_model(TINY_LLAMA), tmp_path / "meta.safetensors")


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: scaled(TINY_LLAMA, kv_heads=3), "num_key_value_heads=3 must divide"),
        (lambda: scaled(TINY_LLAMA, head_dim=15), "head_dim=15 must be even"),
        (lambda: scaled(TINY_LLAMA, layers=0), "num_hidden_layers must be a positive int, got 0"),
        (lambda: dataclasses.replace(TINY_LLAMA, hidden_size=True), "hidden_size"),
        (lambda: dataclasses.replace(TINY_LLAMA, rms_norm_eps=-1.0), "rms_norm_eps"),
        (lambda: dataclasses.replace(TINY_LLAMA, intermediate_size=2.5), "intermediate_size"),
        (lambda: scaled(TINY_QWEN, top_k=9), "num_experts_per_tok=9 exceeds num_experts=8"),
        (lambda: scaled(TINY_QWEN, expert_layout="packed"), "expert_layout is 'packed'"),
        (lambda: dataclasses.replace(TINY_QWEN, norm_topk_prob=1), "norm_topk_prob"),
        (lambda: scaled(TINY_LLAMA, experts=4), "experts apply to MoE models only"),
        (lambda: scaled("llama-2-7b"), "unknown model preset 'llama-2-7b'"),
        (lambda: materialize(build_model(TINY_LLAMA), seed=-1), "seed"),
        (lambda: materialize(build_model(TINY_LLAMA), threads=0), "threads"),
    ],
)
def test_bad_configs_raise_clear_errors(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_build_model_rejects_other_configs() -> None:
    with pytest.raises(TypeError, match="LlamaConfig or Qwen3MoeConfig"):
        build_model({"hidden_size": 64})


def test_model_classes() -> None:
    assert isinstance(build_model(TINY_LLAMA), LlamaForCausalLM)
    assert isinstance(build_model(TINY_QWEN), Qwen3MoeForCausalLM)
