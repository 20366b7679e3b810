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


def test_huge_pages_can_be_declined(monkeypatch):
    """``huge_pages=False`` takes torch's allocator: no ``madvise`` call, a plain tensor."""
    import flatzero.hostmem as hostmem

    calls = []
    monkeypatch.setattr(hostmem, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    # 9 MiB: over the huge-page minimum, and (freed) under the 16 MiB tensors of
    # test_flatten's RSS test, which glibc's adaptive mmap threshold would otherwise keep.
    t = empty_host(9 * 2**18, torch.float32, huge_pages=False)
    assert calls == [] and t.storage_offset() == 0 and t.shape == (9 * 2**18,)
    empty_host(9 * 2**18, torch.float32)
    assert len(calls) == 1


@pytest.mark.parametrize("tier", ["cpu", "offload"])
def test_flatten_parameters_honours_host_huge_pages(monkeypatch, tier):
    """``FlattenConfig(host_huge_pages=False)`` builds the same flat buffers and master
    shards, bit for bit, without asking for a huge page anywhere; the default asks."""
    import flatzero.hostmem as hostmem
    from flatzero import FlattenConfig, flatten_parameters

    def flat(huge_pages: bool) -> tuple[list[torch.Tensor], int]:
        calls = []
        monkeypatch.setattr(hostmem, "_madvise", lambda: lambda *a: calls.append(a) or 0)
        torch.manual_seed(0)
        # Buffers of 8-11 MiB: over the huge-page minimum, under 16 MiB (see above).
        model = torch.nn.Sequential(torch.nn.Linear(512, 4200), torch.nn.Linear(4200, 7))
        config = FlattenConfig(
            tier=tier, device="cpu", bucket_numel=2**21, progress=False,
            host_huge_pages=huge_pages,
        )  # fmt: skip
        out = flatten_parameters(model, config=config)
        tensors = [t.clone() for g in out.groups for t in (*g.buckets, g.master)]
        return tensors, len(calls)

    plain, plain_calls = flat(False)
    huge, huge_calls = flat(True)
    assert plain_calls == 0 and huge_calls > 0
    assert len(plain) == len(huge)
    for a, b in zip(plain, huge, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
