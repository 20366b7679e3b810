"""Counting a model's unique parameters (tied parameters once)."""

from __future__ import annotations

from torch import nn

__all__ = ["count_bytes", "count_params", "count_tensors"]


def count_tensors(model: nn.Module) -> int:
    """Number of unique parameter tensors."""
    return sum(1 for _ in model.parameters())


def count_params(model: nn.Module) -> int:
    """Number of elements over all unique parameters."""
    return sum(p.numel() for p in model.parameters())


def count_bytes(model: nn.Module) -> int:
    """Bytes over all unique parameters in their current dtypes (meta ones included)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
