"""The benchmarks' models by name (``flatzero bench ... --model``, ``flatzero plan
--model``): scaled-down shapes of the zoo's presets, for this machine and for a GPU node."""

from __future__ import annotations

import functools
from collections.abc import Callable

from .config import ModelConfig
from .zoo import scaled

__all__ = ["MODELS", "STEP_MODELS"]


def _narrow_moe(expert_layout: str):
    return scaled(
        "qwen3-30b-a3b",
        layers=16,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=32,
        vocab=1024,
        expert_layout=expert_layout,
    )


MODELS = {
    # A few million params: for tests and smoke runs.
    "tiny": lambda: scaled(
        "llama-3-8b", layers=2, hidden=128, heads=2, kv_heads=1, intermediate=256, vocab=4096
    ),
    # ~0.43B params: the Llama-3-8B shape at 1/4 width and 12 layers.
    "llama-0.4b": lambda: scaled(
        "llama-3-8b", layers=12, hidden=1024, heads=8, kv_heads=2, intermediate=3584
    ),
    # Qwen3-30B-A3B shape with 2 layers and 32 experts, both expert layouts.
    "qwen3-moe-small-fused": lambda: scaled(
        "qwen3-30b-a3b", layers=2, experts=32, expert_layout="fused"
    ),
    "qwen3-moe-small-unfused": lambda: scaled(
        "qwen3-30b-a3b", layers=2, experts=32, expert_layout="unfused"
    ),
    # The 16-layer Qwen3-30B-A3B tensor count (179 fused, 6,291 unfused, LM head included)
    # at hidden 64: what each method spends per tensor, apart from the bytes.
    "qwen3-moe-narrow-fused": lambda: _narrow_moe("fused"),
    "qwen3-moe-narrow-unfused": lambda: _narrow_moe("unfused"),
    # Full shapes, for a GPU node.
    "llama-3-8b": lambda: scaled("llama-3-8b"),
    "qwen3-30b-a3b-16l-fused": lambda: scaled("qwen3-30b-a3b", layers=16, expert_layout="fused"),
    "qwen3-30b-a3b-16l-unfused": lambda: scaled(
        "qwen3-30b-a3b", layers=16, expert_layout="unfused"
    ),
}
"""Benchmark models by name: functions returning a model config."""


_LLAMA_SIZES = ("layers", "hidden", "heads", "kv_heads", "intermediate")


def _llama(*sizes: int, **more: int) -> Callable[[], ModelConfig]:
    """The Llama-3-8B shape at ``sizes`` (in the order of ``_LLAMA_SIZES``) and ``more``
    (``head_dim``, ``vocab``), as a ``STEP_MODELS`` entry."""
    given = dict(zip(_LLAMA_SIZES, sizes, strict=True))
    return functools.partial(scaled, "llama-3-8b", **given, **more)


STEP_MODELS = {
    # _llama(layers, hidden, heads, kv_heads, intermediate, head_dim=..., vocab=...)
    # Seconds per step on a laptop CPU: for tests and smoke runs.
    "tiny": _llama(2, 64, 4, 2, 128, head_dim=16, vocab=512),
    # ~22M params, a few hundred ms per step on 2 CPU cores.
    "llama-22m": _llama(4, 512, 8, 4, 1536, head_dim=64, vocab=8192),
    # ~0.43B params: the Llama-3-8B shape at 1/4 width and 12 layers (a GPU run).
    "llama-0.4b": _llama(12, 1024, 8, 2, 3584),
}
"""The step benchmark's models by name (``flatzero bench step --model``, the plan's
step fixtures): functions returning a model config."""
