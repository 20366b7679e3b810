"""ZeroOptimizer on CUDA: parity, memory, and NCCL at world size 2 (skipped without CUDA).

Reuses the CPU parity harness (``tests/test_optimizer_parity.py``) with the model, the
flat buffers and the data on the GPU; references run on the CPU, so the tolerances allow
for CPU/GPU kernel differences (1e-4 relative for fp32).
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.optim import ZeroConfig, ZeroOptimizer
from test_optimizer_parity import (  # tests/ is on sys.path (rootdir of this package)
    Case,
    Harness,
    batches,
    check_fp16,
    initial_values,
    reference,
    rel_err,
    run_zero,
    update_err,
    use_aux,
)

pytestmark = pytest.mark.gpu

needs_two = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


def _check(world_size: int, case: Case, got) -> None:
    ref = reference(world_size, dataclasses.replace(case, device="cpu"))
    if case.dtype == "fp32":
        for name, value in ref.params.items():
            assert rel_err(got.params[name], value) <= 1e-4, (case, name)
        return
    assert got.skipped == ref.skipped, case
    assert update_err(got.masters, ref.masters, initial_values(case)) < 0.03, case


CUDA_CASES = [
    Case(stage=1, device="cuda"),
    Case(stage=2, device="cuda", bucket_numel=700),
    Case(stage=2, dtype="bf16", device="cuda"),
    Case(stage=1, dtype="bf16", device="cuda", reduce="bf16"),
    Case(stage=2, dtype="fp16", overflow_at=((3, 0),), growth_interval=4, device="cuda"),
]


@pytest.mark.parametrize("case", CUDA_CASES, ids=str)
def test_parity_on_one_gpu(case):
    got = run_zero(0, 1, case)
    _check(1, case, got)
    if case.dtype == "fp16":
        check_fp16(case, got)


def test_training_step_allocates_nothing_new_after_warmup():
    """Gradient memory on the GPU stays the shard plus the staging pool, step after step."""
    case = Case(stage=2, dtype="bf16", device="cuda")
    h = Harness(case)
    opt = ZeroOptimizer(
        h.groups(),
        config=ZeroConfig(max_grad_norm=1.0),
        flatten_config=FlattenConfig(bucket_numel=4000, device="cuda", progress=False),
    )
    data = batches(1)
    peaks = []
    for step in range(4):
        torch.cuda.reset_peak_memory_stats()
        h.loss(data[step, 0, 0].cuda(), use_aux(step, 0, 0)).backward()
        assert all(p.grad is None for p in h.parameters() if p.requires_grad)
        opt.step()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated())
    assert peaks[-1] <= peaks[1]


def _nccl_worker(rank: int, world_size: int) -> bytes:
    results = {}
    for case in (
        Case(stage=2, device="cuda", bucket_numel=700),
        Case(stage=1, device="cuda"),
        Case(stage=2, dtype="bf16", device="cuda"),
    ):
        results[case] = run_zero(rank, world_size, case)
    buffer = io.BytesIO()
    torch.save(results, buffer)
    return buffer.getvalue()


@needs_two
def test_parity_over_nccl_at_world_size_2():
    outputs = [
        torch.load(io.BytesIO(blob), weights_only=False)
        for blob in run_ranks(_nccl_worker, 2, backend="nccl", timeout_s=300)
    ]
    for case, got in outputs[0].items():
        for name, value in got.params.items():
            assert torch.equal(outputs[1][case].params[name], value), (case, name)
        _check(2, case, got)
