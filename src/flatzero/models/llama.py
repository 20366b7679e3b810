"""The dense Llama causal LM (HF ``LlamaForCausalLM`` names and math)."""

from __future__ import annotations

from .config import LlamaConfig
from .layers import SwiGLUMLP
from .transformer import CausalLM, DecoderModel

__all__ = ["LlamaForCausalLM"]


class LlamaForCausalLM(CausalLM):
    """Llama: RMSNorm, RoPE, grouped-query attention, SwiGLU MLP.

    Build it under ``torch.device("meta")`` and :func:`~flatzero.models.materialize` it,
    or use :func:`~flatzero.models.build_model`, which does both.

    Args:
        config: the model's shape.
        with_lm_head: add ``lm_head``; without it the forward returns hidden states only.
        tie_embeddings: share ``lm_head.weight`` with ``model.embed_tokens.weight``.
    """

    def __init__(
        self, config: LlamaConfig, *, with_lm_head: bool = True, tie_embeddings: bool = False
    ) -> None:
        model = DecoderModel(
            config,
            lambda: SwiGLUMLP(config.hidden_size, config.intermediate_size),
            qk_norm=False,
        )
        super().__init__(model, with_lm_head=with_lm_head, tie_embeddings=tie_embeddings)
