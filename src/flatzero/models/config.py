"""Frozen, validated configs of the decoder-only models in the zoo.

Field names follow the Hugging Face ``config.json`` keys so a real config can be copied
field by field.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EXPERT_LAYOUTS", "LlamaConfig", "ModelConfig", "Qwen3MoeConfig"]

EXPERT_LAYOUTS = ("fused", "unfused")
"""How MoE expert weights are stored: ``"fused"`` as two 3-D tensors per layer
(transformers 5.x), ``"unfused"`` as three ``nn.Linear`` per expert (transformers 4.x)."""


MAX_LAYERS = 10_000
"""The most decoder layers a config may have (the largest models have a few hundred): the
layer count drives loops that build modules and plan layouts."""

MAX_EXPERT_MODULES = 1_000_000
"""The most experts over all layers (``num_hidden_layers * num_experts``; DeepSeek-V3 has
about 15,000): each is a module, or three, to build and lay out."""


MAX_WIDTH = 10_000_000
"""The largest size of one dimension (vocabulary, width, heads, head width, MLP width; real
models stay below a few hundred thousand): their products size the tensors built."""


def _check_positive_int(owner: str, name: str, value: object, high: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}; pass e.g. 1 or 64")
    if high is not None and value > high:
        raise ValueError(
            f"{owner}.{name}={value} is more than {high:,}, far beyond any real model; "
            "use the value of the model's config.json"
        )


def _check_positive_float(owner: str, name: str, value: object) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ValueError(
            f"{owner}.{name} must be a positive number, got {value!r}; "
            "use the value of the model's config.json"
        )


@dataclass(frozen=True, kw_only=True)
class _DecoderConfig:
    """Fields shared by every decoder-only transformer of the zoo (see subclasses)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            _check_positive_int(owner, name, getattr(self, name), MAX_WIDTH)
        _check_positive_int(owner, "num_hidden_layers", self.num_hidden_layers, MAX_LAYERS)
        _check_positive_float(owner, "rms_norm_eps", self.rms_norm_eps)
        _check_positive_float(owner, "rope_theta", self.rope_theta)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{owner}.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads} (grouped-query attention); "
                "choose a divisor of num_attention_heads"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"{owner}.head_dim={self.head_dim} must be even (RoPE rotates pairs of "
                "elements); use an even head_dim such as 64 or 128"
            )


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(_DecoderConfig):
    """A dense Llama decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP).

    Attributes:
        vocab_size: vocabulary size, in tokens.
        hidden_size: model width, in elements per token.
        intermediate_size: SwiGLU MLP width, in elements per token.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: number of query heads per layer.
        num_key_value_heads: number of key/value heads per layer; divides
            ``num_attention_heads``.
        head_dim: width of one attention head, in elements; even. Need not equal
            ``hidden_size / num_attention_heads``.
        rms_norm_eps: epsilon added to the mean square in RMSNorm (dimensionless).
        rope_theta: RoPE base period (dimensionless; wavelengths range up to
            ``2π·rope_theta`` positions).
    """

    intermediate_size: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("LlamaConfig", "intermediate_size", self.intermediate_size, MAX_WIDTH)


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(_DecoderConfig):
    """A Qwen3-MoE decoder: Llama-style attention with per-head q/k RMSNorm, and a sparse
    mixture-of-experts SwiGLU block in every layer (no shared expert, no dense layers).

    Attributes:
        vocab_size: vocabulary size, in tokens.
        hidden_size: model width, in elements per token.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: number of query heads per layer.
        num_key_value_heads: number of key/value heads per layer; divides
            ``num_attention_heads``.
        head_dim: width of one attention head, in elements; even. Qwen3 uses 128 for
            every size, so ``num_attention_heads * head_dim`` may exceed ``hidden_size``.
        rms_norm_eps: epsilon added to the mean square in every RMSNorm (dimensionless).
        rope_theta: RoPE base period (dimensionless).
        moe_intermediate_size: width of one expert's SwiGLU MLP, in elements per token.
        num_experts: experts per layer.
        num_experts_per_tok: experts each token is routed to (top-k); at most
            ``num_experts``.
        norm_topk_prob: renormalize the top-k router probabilities to sum to 1.
        expert_layout: one of ``EXPERT_LAYOUTS``; how the expert weights are stored.
    """

    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    expert_layout: str = "fused"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("moe_intermediate_size", "num_experts", "num_experts_per_tok"):
            _check_positive_int("Qwen3MoeConfig", name, getattr(self, name), MAX_WIDTH)
        experts = self.num_experts * self.num_hidden_layers
        if experts > MAX_EXPERT_MODULES:
            raise ValueError(
                f"Qwen3MoeConfig: {self.num_hidden_layers} layers of {self.num_experts} experts "
                f"are {experts:,} experts, more than {MAX_EXPERT_MODULES:,}, far beyond any real "
                "model; use the values of the model's config.json"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"Qwen3MoeConfig.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                f"num_experts={self.num_experts}; route each token to at most num_experts"
            )
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(
                f"Qwen3MoeConfig.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}"
            )
        if self.expert_layout not in EXPERT_LAYOUTS:
            raise ValueError(
                f"Qwen3MoeConfig.expert_layout is {self.expert_layout!r}; it must be one of "
                f"{', '.join(EXPERT_LAYOUTS)}"
            )


ModelConfig = LlamaConfig | Qwen3MoeConfig
"""Any config the zoo can build."""
