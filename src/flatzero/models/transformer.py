"""The decoder-only skeleton shared by the zoo: layer, stack, causal-LM head and loss.

Names match Hugging Face transformers: ``model.embed_tokens``, ``model.layers.<i>``,
``model.norm``, ``lm_head``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Attention, RMSNorm, rope_cos_sin

__all__ = ["IGNORE_INDEX", "CausalLM", "CausalLMOutput", "DecoderLayer", "DecoderModel"]

IGNORE_INDEX = -100
"""Label value excluded from the loss (as in HF transformers)."""


@dataclass(frozen=True)
class CausalLMOutput:
    """What :meth:`CausalLM.forward` returns.

    Attributes:
        last_hidden_state: final-normed hidden states, ``[batch, seq, hidden]``.
        logits: next-token logits ``[batch, seq, vocab]`` in the model's dtype; ``None``
            for a model built without ``lm_head``.
        loss: mean cross entropy (nats per predicted token, computed in float32) of
            predicting ``labels[:, t + 1]`` from position ``t``, over labels other than
            ``IGNORE_INDEX``; ``None`` when no labels were given.
    """

    last_hidden_state: torch.Tensor
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, self_attn: Attention, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Token embedding, decoder layers and final norm (HF's ``<Arch>Model``).

    Args:
        config: the model's config.
        make_mlp: builds the MLP of one layer (dense or mixture of experts).
        qk_norm: give attention per-head q/k RMSNorm (Qwen3).
    """

    def __init__(
        self, config: ModelConfig, make_mlp: Callable[[], nn.Module], *, qk_norm: bool
    ) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(
                Attention(
                    config.hidden_size,
                    config.num_attention_heads,
                    config.num_key_value_heads,
                    config.head_dim,
                    config.rms_norm_eps if qk_norm else None,
                ),
                make_mlp(),
                config.hidden_size,
                config.rms_norm_eps,
            )
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[batch, seq, hidden]`` of token ids ``[batch, seq]``."""
        x = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(
            input_ids.shape[1],
            self.config.head_dim,
            self.config.rope_theta,
            device=x.device,
            dtype=x.dtype,
        )
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class CausalLM(nn.Module):
    """A decoder with an optional ``lm_head`` (HF's ``<Arch>ForCausalLM``).

    Args:
        model: the decoder stack, registered as ``model``.
        with_lm_head: add ``lm_head`` (``Linear(hidden, vocab, bias=False)``).
        tie_embeddings: make ``lm_head.weight`` the same ``Parameter`` as
            ``model.embed_tokens.weight``; needs ``with_lm_head``.
    """

    def __init__(self, model: DecoderModel, *, with_lm_head: bool, tie_embeddings: bool):
        super().__init__()
        if tie_embeddings and not with_lm_head:
            raise ValueError(
                "tie_embeddings=True needs with_lm_head=True: there is no lm_head to tie; "
                "pass with_lm_head=True or tie_embeddings=False"
            )
        self.config = model.config
        self.model = model
        self.lm_head: nn.Linear | None = None
        if with_lm_head:
            config = model.config
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            if tie_embeddings:
                self.lm_head.weight = model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> CausalLMOutput:
        """Run the model on token ids ``[batch, seq]`` (int64).

        ``labels`` (same shape, int64, ``IGNORE_INDEX`` to skip) are the input ids
        themselves for plain language modeling; they are shifted here, as in HF.
        """
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must have shape [batch, seq], got {tuple(input_ids.shape)}"
            )
        hidden = self.model(input_ids)
        if self.lm_head is None:
            if labels is not None:
                raise ValueError("labels need an lm_head; build the model with_lm_head=True")
            return CausalLMOutput(last_hidden_state=hidden)
        logits = self.lm_head(hidden)
        if labels is None:
            return CausalLMOutput(last_hidden_state=hidden, logits=logits)
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal input_ids shape "
                f"{tuple(input_ids.shape)}"
            )
        loss = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
        )
        return CausalLMOutput(last_hidden_state=hidden, logits=logits, loss=loss)
