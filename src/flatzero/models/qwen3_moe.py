"""The Qwen3-MoE causal LM (HF ``Qwen3MoeForCausalLM`` names and math), with the expert
weights fused (transformers 5.x) or unfused (transformers 4.x).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import Qwen3MoeConfig
from .layers import SwiGLUMLP
from .transformer import CausalLM, DecoderModel

__all__ = ["FusedExperts", "Qwen3MoeForCausalLM", "SparseMoeBlock", "UnfusedExperts"]


class FusedExperts(nn.Module):
    """All experts of a layer as two 3-D tensors (transformers 5.x layout).

    ``gate_up_proj`` is ``[experts, 2 * intermediate, hidden]`` (gate rows first, then up
    rows); ``down_proj`` is ``[experts, hidden, intermediate]``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run ``tokens`` ``[n, hidden]``, sorted by expert with ``counts[e]`` rows for
        expert ``e``, through their experts; returns ``[n, hidden]`` in the same order."""
        # unbind once per call: indexing the 3-D tensors per expert would make autograd
        # allocate a full-size gradient per expert in the backward pass.
        gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        outputs = []
        for expert, x in enumerate(torch.split(tokens, counts)):
            if x.shape[0]:
                gate, up = F.linear(x, gate_up[expert]).chunk(2, dim=-1)
                outputs.append(F.linear(F.silu(gate) * up, down[expert]))
        return torch.cat(outputs)


class UnfusedExperts(nn.ModuleList):
    """One :class:`SwiGLUMLP` per expert (transformers 4.x layout: three ``Linear`` each)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(SwiGLUMLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Run ``tokens`` ``[n, hidden]``, sorted by expert with ``counts[e]`` rows for
        expert ``e``, through their experts; returns ``[n, hidden]`` in the same order."""
        outputs = [
            self[expert](x) for expert, x in enumerate(torch.split(tokens, counts)) if x.shape[0]
        ]
        return torch.cat(outputs)


class SparseMoeBlock(nn.Module):
    """Top-k routed mixture of SwiGLU experts (HF ``Qwen3MoeSparseMoeBlock``).

    Softmax router in float32, top-k, optional renormalization of the k probabilities,
    each token through its k experts, outputs summed with those weights. Only experts
    that received tokens run, so in a backward pass an unfused expert that received no
    token gets no gradient (``grad is None``) and a fused expert's slice of
    ``gate_up_proj``/``down_proj`` gets zeros (so does an expert whose tokens do not reach
    the loss, e.g. only the last position). No auxiliary load-balancing loss.
    Deterministic: outputs are gathered back in token order and summed over k, no atomics.
    """

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        experts_cls = FusedExperts if config.expert_layout == "fused" else UnfusedExperts
        self.experts = experts_cls(
            config.num_experts, config.hidden_size, config.moe_intermediate_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mix experts over ``x`` of shape ``[batch, seq, hidden]``; returns the same shape."""
        hidden = x.shape[-1]
        tokens = x.reshape(-1, hidden)
        probs = F.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)

        # Sort the (token, slot) pairs by expert so each expert sees one contiguous batch.
        flat_chosen = chosen.reshape(-1)
        order = torch.argsort(flat_chosen, stable=True)
        counts = torch.bincount(flat_chosen, minlength=self.num_experts).tolist()
        per_slot = self.experts(tokens[order // self.top_k], counts)[torch.argsort(order)]
        mixed = (per_slot.view(-1, self.top_k, hidden) * weights.unsqueeze(-1)).sum(dim=1)
        return mixed.view(x.shape)


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE: Llama-style attention plus q/k RMSNorm, a :class:`SparseMoeBlock` per layer.

    Build it under ``torch.device("meta")`` and :func:`~flatzero.models.materialize` it,
    or use :func:`~flatzero.models.build_model`, which does both.

    Args:
        config: the model's shape and expert layout.
        with_lm_head: add ``lm_head``; without it the forward returns hidden states only.
        tie_embeddings: share ``lm_head.weight`` with ``model.embed_tokens.weight``.
    """

    def __init__(
        self, config: Qwen3MoeConfig, *, with_lm_head: bool = True, tie_embeddings: bool = False
    ) -> None:
        model = DecoderModel(config, lambda: SparseMoeBlock(config), qk_norm=True)
        super().__init__(model, with_lm_head=with_lm_head, tie_embeddings=tie_embeddings)
