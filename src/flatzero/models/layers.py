"""Building blocks shared by the zoo's decoders: RMSNorm, RoPE, attention, SwiGLU MLP.

Module and parameter names match Hugging Face transformers, so checkpoints load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Attention", "RMSNorm", "SwiGLUMLP", "apply_rope", "rope_cos_sin"]


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 (as in HF).

    Args:
        size: width of the normalized dimension, in elements.
        eps: epsilon added to the mean square (dimensionless).
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, *, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosine and sine tables of rotary position embeddings for positions ``0..seq_len-1``.

    Computed in float32, then cast to ``dtype``. Returns two ``[seq_len, head_dim]`` tensors.
    """
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    )
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[batch, heads, seq, head_dim]`` by the RoPE tables."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE and optional per-head q/k RMSNorm.

    Args:
        hidden_size: model width, in elements.
        num_heads: query heads.
        num_kv_heads: key/value heads; divides ``num_heads``.
        head_dim: width of one head, in elements.
        qk_norm_eps: when not ``None``, add ``q_norm``/``k_norm`` (RMSNorm over
            ``head_dim``, Qwen3) with this epsilon.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        if qk_norm_eps is None:
            self.q_norm = self.k_norm = None
        else:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attend over ``x`` of shape ``[batch, seq, hidden]``; returns the same shape."""
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        v = v.transpose(1, 2)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            shape = (batch, self.num_heads, seq, self.head_dim)
            k = k[:, :, None].expand(batch, self.num_kv_heads, group, seq, self.head_dim)
            v = v[:, :, None].expand(batch, self.num_kv_heads, group, seq, self.head_dim)
            k, v = k.reshape(shape), v.reshape(shape)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases (Llama MLP, Qwen3 expert).

    Args:
        hidden_size: model width, in elements.
        intermediate_size: MLP width, in elements.
    """

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
