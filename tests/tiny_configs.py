"""Model configs small enough for multi-process CPU tests (a few thousand params)."""

from __future__ import annotations

from flatzero.models import LlamaConfig

TINY_LLAMA = LlamaConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
"""A 2-layer Llama with grouped-query attention; 4 heads of 8 dims, vocabulary 96."""
