"""Presets from real model configs, scaling them down, and building models from configs."""

from __future__ import annotations

import dataclasses

import torch

from .config import LlamaConfig, ModelConfig, Qwen3MoeConfig
from .llama import LlamaForCausalLM
from .materialize import materialize
from .qwen3_moe import Qwen3MoeForCausalLM
from .transformer import CausalLM

__all__ = ["PRESETS", "build_model", "get_preset", "scaled"]

PRESETS: dict[str, ModelConfig] = {
    # meta-llama/Meta-Llama-3-8B config.json (no rope scaling; untied embeddings).
    "llama-3-8b": LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    # meta-llama/Meta-Llama-3-70B config.json (no rope scaling; untied embeddings): the shape
    # whose model states do not fit 8 x 80 GB at ZeRO-1/2 (flatzero plan's advice).
    "llama-3-70b": LlamaConfig(
        vocab_size=128256,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
    ),
    # Qwen/Qwen3-30B-A3B config.json (every layer sparse; untied embeddings).
    "qwen3-30b-a3b": Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        expert_layout="fused",
    ),
}
"""Real model shapes by name. All have untied embeddings in their real configs."""


def get_preset(name: str) -> ModelConfig:
    """The preset config called ``name`` (a key of ``PRESETS``)."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}"
        ) from None


def scaled(
    base: str | ModelConfig,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate: int | None = None,
    experts: int | None = None,
    top_k: int | None = None,
    vocab: int | None = None,
    expert_layout: str | None = None,
) -> ModelConfig:
    """A copy of a preset (or config) with the given fields replaced; ``None`` keeps one.

    ``intermediate`` is the MLP width of a dense model and the expert width
    (``moe_intermediate_size``) of an MoE model. ``experts``, ``top_k`` and
    ``expert_layout`` apply to MoE models only. The result is validated like any config.

    Example: ``scaled("qwen3-30b-a3b", layers=16, expert_layout="unfused")``.
    """
    config = get_preset(base) if isinstance(base, str) else base
    changes: dict[str, object] = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
    }
    if isinstance(config, Qwen3MoeConfig):
        changes |= {
            "moe_intermediate_size": intermediate,
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "expert_layout": expert_layout,
        }
    else:
        moe_only = {"experts": experts, "top_k": top_k, "expert_layout": expert_layout}
        given = [key for key, value in moe_only.items() if value is not None]
        if given:
            raise ValueError(
                f"scaled(): {', '.join(given)} apply to MoE models only and "
                f"{type(config).__name__} is dense; drop them"
            )
        changes["intermediate_size"] = intermediate
    return dataclasses.replace(
        config, **{key: value for key, value in changes.items() if value is not None}
    )


def build_model(
    config: ModelConfig,
    *,
    device: torch.device | str = "meta",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    with_lm_head: bool = True,
    tie_embeddings: bool = False,
) -> CausalLM:
    """Build the causal LM of ``config`` with HF parameter names.

    The model is always constructed on the meta device (no memory, no init cost). Unless
    ``device`` is ``"meta"``, it is then materialized there with the deterministic init of
    :func:`materialize` (``seed``).

    Args:
        config: a :class:`LlamaConfig` or :class:`Qwen3MoeConfig` (see :func:`scaled`).
        device: ``"meta"`` for shapes only, else where the parameters live.
        dtype: floating dtype of every parameter.
        seed: init seed, used when ``device`` is not meta.
        with_lm_head: add ``lm_head``; without it the forward returns hidden states only.
        tie_embeddings: make ``lm_head.weight`` the same ``Parameter`` as
            ``model.embed_tokens.weight`` (the presets' real configs are untied).

    Returns:
        a :class:`LlamaForCausalLM` or :class:`Qwen3MoeForCausalLM` in training mode.
    """
    if isinstance(config, LlamaConfig):
        model_cls = LlamaForCausalLM
    elif isinstance(config, Qwen3MoeConfig):
        model_cls = Qwen3MoeForCausalLM
    else:
        raise TypeError(
            f"build_model needs a LlamaConfig or Qwen3MoeConfig, got {type(config).__name__}; "
            "use get_preset() or scaled()"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"build_model dtype must be a floating dtype, got {dtype}")
    with torch.device("meta"):
        model = model_cls(config, with_lm_head=with_lm_head, tie_embeddings=tie_embeddings)
    model.to(dtype)
    if torch.device(device).type != "meta":
        materialize(model, device, seed=seed)
    return model
