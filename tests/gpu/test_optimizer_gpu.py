"""ZeroOptimizer on CUDA: parity, memory, and NCCL at world size 2 (skipped without CUDA;
run with ``FLATZERO_TEST_GPU=1``, as the CPU suite hides the GPUs).

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
    ADAMW,
    MICRO,
    STEPS,
    Case,
    Harness,
    Result,
    batches,
    check_fp16,
    initial_values,
    micro_loss,
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


def _without_set_device_worker(rank: int, world_size: int) -> bytes:
    """The PyTorch door as most scripts use it: ``model.to(f"cuda:{rank}")`` and no
    ``torch.cuda.set_device``, so the current device is cuda:0 on every rank."""
    torch.cuda.set_device(0)  # undo run_ranks' set_device(rank)
    case = Case(stage=2)
    torch.manual_seed(0)
    data = batches(world_size)
    h = Harness(case).to(f"cuda:{rank}")
    # No flatten_config: the buckets go where the params are ("cuda:0" on rank 0,
    # "cuda:1" on rank 1), and the ranks compare those configs by meaning.
    opt = ZeroOptimizer(
        h.groups(),
        torch.optim.AdamW,
        stage=case.stage,
        config=ZeroConfig(max_grad_norm=case.clip, reduce_dtype=torch.float32),
        **ADAMW,
    )
    where = sorted({str(t.device) for g in opt.flat.groups for t in (*g.buckets, g.master)})
    for step in range(STEPS):
        for micro in range(MICRO):
            opt.backward(micro_loss(h, data, case, step, micro, rank))
        opt.step()
        opt.zero_grad()
    masters = {n: m.cpu() for n, m in opt.full_params().items()}
    params = {n: p.detach().cpu() for n, p in h.named_parameters()}
    opt.close()
    torch.cuda.synchronize(rank)
    others = [d for d in range(torch.cuda.device_count()) if d != rank]
    buffer = io.BytesIO()
    torch.save(
        {
            "result": Result(masters, params, [], []),
            "where": where,
            # bytes this rank's process ever allocated on another rank's GPU
            "elsewhere": {d: torch.cuda.max_memory_allocated(d) for d in others},
        },
        buffer,
    )
    return buffer.getvalue()


@needs_two
def test_pytorch_door_over_nccl_without_set_device():
    """Each rank's buckets, masters and control tensors live on its own GPU (LOCAL_RANK),
    although the script never called ``torch.cuda.set_device``; training matches the
    reference and the ranks end with the same params."""
    outputs = [
        torch.load(io.BytesIO(blob), weights_only=False)
        for blob in run_ranks(_without_set_device_worker, 2, backend="nccl", timeout_s=300)
    ]
    for rank, out in enumerate(outputs):
        assert out["where"] == [f"cuda:{rank}"], rank
        assert all(n == 0 for n in out["elsewhere"].values()), (rank, out["elsewhere"])
    got = outputs[0]["result"]
    for name, value in got.params.items():
        assert torch.equal(outputs[1]["result"].params[name], value), name
    _check(2, Case(stage=2), got)
