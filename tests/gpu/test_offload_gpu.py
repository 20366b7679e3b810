"""Optimizer offload on CUDA (skipped without CUDA; run with ``FLATZERO_TEST_GPU=1``).

One rank, the model and buckets on the GPU: the offload path copies the reduced gradients
to pinned host memory on its own CUDA stream (an event per bucket), steps torch's fused
CPU AdamW there and uploads the cast shard; it trains as the same run without offload does
(the GPU's fused kernel against the CPU's: fp32 rounding), never calls
``torch.cuda.synchronize`` inside a step, and holds no fp32 master or optimizer state on the
GPU. ``tests/device/test_device_offload.py`` runs the two-rank case on CUDA (NCCL) too.
"""

from __future__ import annotations

import pytest
import torch

from flatzero import OffloadConfig, ZeroOptimizer
from test_optimizer_offload import Case, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    "case",
    [Case(stage=2, dtype="bf16"), Case(stage=1, dtype="fp16", overflow_step=1)],
    ids=["stage2-bf16", "stage1-fp16"],
)
def test_offload_on_cuda_streams(case, monkeypatch):
    device = torch.device("cuda", torch.cuda.current_device())
    base = torch.cuda.memory_allocated(device)
    plain_losses, plain_masters, plain = train(case, 0, False, device)
    plain_bytes = torch.cuda.memory_allocated(device) - base
    plain.close()
    del plain
    syncs, in_step = [], [False]
    real = torch.cuda.synchronize
    # Only a step's: building the optimizer synchronizes (init's phase timings).
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a: (in_step[0] and syncs.append(a), real(*a))[1]
    )
    step = ZeroOptimizer.step

    def recorded_step(optimizer, *args, **kwargs):
        in_step[0] = True
        try:
            return step(optimizer, *args, **kwargs)
        finally:
            in_step[0] = False

    monkeypatch.setattr(ZeroOptimizer, "step", recorded_step)
    start = torch.cuda.memory_allocated(device)
    losses, masters, opt = train(case, 0, OffloadConfig(pin_memory=True), device)
    assert syncs == [] and len(losses) == 3  # the steps ran through the recorder
    offload = opt._stepper
    assert offload.pinned and all(g.is_pinned() for g in offload.host_grads)
    assert isinstance(offload._stream, torch.cuda.Stream)
    assert offload._stream != torch.cuda.current_stream(device)
    assert {m.device.type for m in opt.master_shards} == {"cpu"}
    shard = sum(g.layout.shard_numel for g in opt.flat.groups)
    offload_bytes = torch.cuda.memory_allocated(device) - start
    assert offload_bytes <= plain_bytes - 12 * shard  # no fp32 master, no AdamW state
    for got, want in zip(losses, plain_losses, strict=True):
        assert got == pytest.approx(want, rel=1e-3, nan_ok=True)
    for name, value in plain_masters.items():
        torch.testing.assert_close(masters[name], value, rtol=1e-4, atol=1e-5, msg=name)
    opt.close()


def test_offload_host_memory_is_the_formula_on_cuda():
    """Issue 25's item 4 where the host holds only offload's memory: on CUDA the resident
    set a ZeroOptimizer with offload gains, from before it is built (the model, the CUDA
    context and the kernels of a backward pass already up, the heap trimmed) to the
    high-water mark of three steps after it (the mark reset once it is built), is its
    ``offload_host_bytes()`` (master, pinned gradient shard, AdamW state: 16 bytes a
    param) within 10 %. (On the CPU-only VM the device's memory is host memory too, so
    the same check there includes gloo's buffers and autograd's gradients.)"""
    from flatzero import FlattenConfig
    from flatzero.procmem import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_host_memory

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    width, layers = 2048, 12  # 100.7M params: 1.6 GB of offloaded host memory
    model = torch.nn.Sequential(
        *(torch.nn.Linear(width, width, dtype=torch.bfloat16, device=device) for _ in range(layers))
    )
    x = torch.randn(8, width, dtype=torch.bfloat16, device=device)
    # One backward pass first: cuBLAS and lazily loaded kernels take host memory of their
    # own at their first use, which is not offload's.
    model(x).float().pow(2).mean().backward()
    for param in model.parameters():
        param.grad = None
    torch.cuda.synchronize(device)
    trim_host_memory()
    before = rss_bytes()
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        stage=2,
        lr=1e-4,
        flatten_config=FlattenConfig(device=str(device), progress=False),
        offload_optimizer=OffloadConfig(pin_memory=True),
    )
    trim_host_memory()  # what init used and freed is not the steps' peak
    reset_peak_rss()
    for _ in range(3):
        opt.backward(model(x).float().pow(2).mean())
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(device)
    gained = peak_rss_bytes() - before
    formula = opt.offload_host_bytes()
    assert formula is not None and formula.pinned == formula.grads
    assert formula.total >= 16 * sum(p.numel() for p in model.parameters())
    assert 0.9 * formula.total <= gained <= 1.1 * formula.total, (gained, formula)
    opt.close()
