"""Huge-page host buffers behave like torch.empty."""

from __future__ import annotations

import sys

import pytest
import torch

from flatzero.hostmem import empty_host, mapped_host


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


def test_mapped_buffers_are_advised_for_huge_pages_from_a_huge_page_boundary(monkeypatch):
    """A large ``mapped_host`` buffer (an asynchronous save's snapshot) starts on a 2 MiB
    boundary, is kept from forked children and advised for huge pages over its whole 2 MiB
    pages before anything touches it, and holds what is written to it; a small one and a
    declined one are kept from children but not advised for huge pages."""
    import flatzero.hostmem as hostmem

    calls = []
    real = hostmem._madvise()
    if real is None:
        pytest.skip("no madvise on this platform")

    def spy(address, length, advice):
        calls.append((address, length, advice))
        return real(address, length, advice)

    monkeypatch.setattr(hostmem, "_madvise", lambda: spy)
    nbytes = 9 * 2**20 + 4096
    t = mapped_host(nbytes)
    assert t.dtype == torch.uint8 and t.shape == (nbytes,)
    assert t.data_ptr() % (2 * 2**20) == 0
    huge = [c for c in calls if c[2] == hostmem._MADV_HUGEPAGE]
    assert huge == [(t.data_ptr(), 8 * 2**20, hostmem._MADV_HUGEPAGE)]
    assert [c[2] for c in calls] == [hostmem._MADV_DONTFORK, hostmem._MADV_HUGEPAGE]
    values = torch.arange(nbytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    t.copy_(values)
    assert torch.equal(t, values)
    small, declined = mapped_host(4096), mapped_host(nbytes, huge_pages=False)
    assert small.shape == (4096,) and declined.shape == (nbytes,)
    assert small.data_ptr() % 4096 == 0 and declined.data_ptr() % 4096 == 0
    assert [c[2] for c in calls[2:]] == [hostmem._MADV_DONTFORK] * 2  # no huge pages


@pytest.mark.parametrize("tier", ["cpu", "host_park"])
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


_MIB = 2**20
_LINUX = sys.platform.startswith("linux")


@pytest.mark.parametrize(
    ("factory", "args", "expect"),
    [
        (torch.zeros_like, (), 0.0),
        (torch.full_like, (0.5,), 0.5),
        (torch.empty_like, (), None),
    ],
)
def test_huge_page_factories_put_large_host_tensors_on_huge_pages(factory, args, expect):
    """Within the mode, a ``*_like`` factory of a large contiguous host tensor returns memory
    on a 2 MiB boundary (``empty_host``) with the factory's shape, dtype and values."""
    from flatzero.hostmem import HugePageFactories

    like = torch.ones(3, 3 * _MIB // 3, dtype=torch.float32)  # 9 MiB, 2-D
    with HugePageFactories():
        out = factory(like, *args, memory_format=torch.preserve_format)
    assert out.shape == like.shape and out.dtype == like.dtype and not out.requires_grad
    if _LINUX:
        assert out.data_ptr() % (2 * _MIB) == 0
    if expect is not None:
        assert torch.equal(out, torch.full_like(like, expect))


@pytest.mark.parametrize(
    ("like", "kwargs"),
    [
        (torch.ones(16), {}),  # small
        (torch.ones(3 * _MIB), {"dtype": torch.float64}),  # another dtype asked for
        (torch.ones(3 * _MIB), {"requires_grad": True}),
        (torch.ones(2, 3 * _MIB // 2).t(), {}),  # not contiguous
    ],
)
def test_huge_page_factories_leave_other_calls_alone(monkeypatch, like, kwargs):
    """What the mode does not redirect runs as torch runs it: no ``empty_host`` call, and
    the result is what the plain factory gives."""
    import flatzero.hostmem as hostmem

    calls = []
    real = hostmem.empty_host
    monkeypatch.setattr(hostmem, "empty_host", lambda *a, **k: calls.append(a) or real(*a, **k))
    with hostmem.HugePageFactories():
        out = torch.zeros_like(like, **kwargs)
    plain = torch.zeros_like(like, **kwargs)
    assert calls == []
    assert out.dtype == plain.dtype and out.stride() == plain.stride()
    assert out.requires_grad == plain.requires_grad and torch.equal(out, plain)


@pytest.mark.parametrize(
    ("optimizer", "options", "state_keys"),
    [
        (torch.optim.AdamW, {"fused": True}, ("exp_avg", "exp_avg_sq")),
        (torch.optim.Adam, {"foreach": False, "fused": False}, ("exp_avg", "exp_avg_sq")),
        (torch.optim.SGD, {"momentum": 0.9, "fused": True}, ("momentum_buffer",)),
        (torch.optim.Adagrad, {"fused": True}, ("sum",)),
    ],
)
def test_inner_optimizer_state_of_host_shards_is_on_huge_pages(optimizer, options, state_keys):
    """flatzero's inner step makes the state of a host shard on huge pages (at construction
    or at the first step), and steps exactly as the same optimizer built and stepped plainly:
    the same params and state, bit for bit, over three steps."""
    from flatzero.optim.inner import build_inner_optimizer, step_with_grad_scale

    numel = 3 * _MIB  # 12 MiB of fp32
    g = torch.Generator().manual_seed(0)
    init = torch.randn(numel, generator=g)
    grads = [torch.randn(numel, generator=g) for _ in range(3)]
    ours, plain = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    inner = build_inner_optimizer(optimizer, [ours], [{}], {"lr": 0.01, **options})
    reference = optimizer([plain], lr=0.01, **options)
    for grad in grads:
        ours.grad, plain.grad = grad.clone(), grad.clone()
        step_with_grad_scale(inner, None)
        reference.step()
    assert torch.equal(ours, plain)
    for key in state_keys:
        state = inner.state[ours][key]
        assert torch.equal(state, reference.state[plain][key])
        if _LINUX:
            assert state.data_ptr() % (2 * _MIB) == 0, key


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTFORK is Linux's")
def test_a_forked_child_gets_no_copy_of_a_mapped_buffer():
    """The child of a fork (a DataLoader worker) does not have the buffer mapped: reading it
    there faults, where the parent reads it fine."""
    import ctypes
    import faulthandler
    import os
    import signal

    t = mapped_host(9 * 2**20)
    t[0] = 7
    pid = os.fork()
    if pid == 0:  # the child: a segmentation fault ends it (quietly)
        faulthandler.disable()
        os._exit(ctypes.c_ubyte.from_address(t.data_ptr()).value)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    assert t[0].item() == 7
