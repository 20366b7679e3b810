"""Huge-page host buffers behave like torch.empty."""

from __future__ import annotations

import sys

import pytest
import torch

from flatzero.hostmem import empty_host


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_large_buffers_start_on_a_huge_page_and_hold_values(dtype):
    t = empty_host(5 * 2**20 + 3, dtype)
    assert t.shape == (5 * 2**20 + 3,) and t.dtype == dtype and t.is_contiguous()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % (2 * 2**20) == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32).to(dtype))
    assert t[-1].item() == torch.tensor(t.numel() - 1, dtype=torch.float32).to(dtype).item()


def test_small_buffers_are_plain():
    t = empty_host(10, torch.float32)
    assert t.shape == (10,) and t.storage_offset() == 0
