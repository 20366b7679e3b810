"""The optimizer's setup compared by meaning, the fused default of a
client optimizer, the gradient accumulation dtype, and reentrant activation checkpointing.

One run of 2 gloo ranks (a module fixture) serves the setup, accumulation and checkpointing
tests; the references and
the world-size-1 runs are computed in this process.
"""

from __future__ import annotations

import io
import math
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import flatzero.comm
from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.optim import ZeroConfig, ZeroOptimizer
from flatzero.optim.agreement import meaning, setup_fields

WS = 2  # ranks of the multi-process run
WIDTH = 16
BATCH = 8
MICRO = 4  # micro-batches per step (gradient accumulation)
STEPS = 3
LR = 1e-2
FLAT = FlattenConfig(bucket_numel=300, device="cpu", progress=False)


def _block(block: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(block(x))


class Blocks(nn.Module):
    """Four ``tanh(Linear)`` blocks and a head, built in fp32 from one seed, then cast.

    ``reentrant=True`` runs blocks 0, 2 and 3 under ``torch.utils.checkpoint`` with
    ``use_reentrant=True``: each is a backward pass of its own inside the outer one, and
    block 0's is the last thing backward does. With a frozen head (as with LoRA) the first
    gradient of a backward pass arrives inside block 3's.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, frozen_head: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 4)
        self.head.requires_grad_(not frozen_head)
        self.to(dtype)

    def forward(self, x: torch.Tensor, reentrant: bool = False) -> torch.Tensor:
        if reentrant:
            x = x.detach().requires_grad_()  # a reentrant segment needs an input with grad
        for i, block in enumerate(self.blocks):
            if reentrant and i != 1:
                x = checkpoint(_block, block, x, use_reentrant=True)
            else:
                x = _block(block, x)
        return self.head(x)


def batches() -> torch.Tensor:
    """Inputs ``[step, micro, rank, batch, width]``, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(STEPS, MICRO, WS, BATCH, WIDTH, generator=g)


def micro_loss(model: Blocks, x: torch.Tensor, reentrant: bool = False) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return model(x.to(dtype), reentrant).float().pow(2).mean() / MICRO


def rel_err(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """``||ours - ref|| / ||ref||`` over every param of ``ref``."""
    num = sum(float((ours[n].double() - r.double()).norm() ** 2) for n, r in ref.items())
    den = sum(float(r.double().norm() ** 2) for r in ref.values())
    return math.sqrt(num / den)


def fp32(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in params.items()}


# --------------------------------------------------------------------- setup by meaning
@contextmanager
def tensors_printed_on_cuda(index: int) -> Iterator[None]:
    """Make every tensor's ``repr`` end in ``device='cuda:<index>'``, as a tensor on that
    GPU prints: the text differs by rank, the value does not."""
    real = torch.Tensor.__repr__

    def on_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
        return real(self, *args, **kwargs)[:-1] + f", device='cuda:{index}')"

    torch.Tensor.__repr__ = on_cuda
    try:
        yield
    finally:
        torch.Tensor.__repr__ = real


class _Opaque:
    """An object whose ``repr`` holds its address."""


def test_setup_fields_compare_meaning_not_text():
    arguments = {"lr": torch.tensor(LR), "betas": (torch.tensor(0.9), 0.999), "x": _Opaque()}
    with tensors_printed_on_cuda(0):
        on_0 = setup_fields(ZeroConfig(), torch.optim.AdamW, arguments)
        text_0 = repr(arguments["lr"])
    with tensors_printed_on_cuda(1):
        on_1 = setup_fields(ZeroConfig(), torch.optim.AdamW, {**arguments, "x": _Opaque()})
        assert repr(arguments["lr"]) != text_0  # the emulation does what it says
    assert on_0 == on_1
    other = setup_fields(ZeroConfig(), torch.optim.AdamW, {**arguments, "lr": torch.tensor(2e-2)})
    assert other["optimizer arguments"] != on_0["optimizer arguments"]
    assert meaning(torch.tensor(2e-2, dtype=torch.float64)) != meaning(torch.tensor(2e-2))
    assert meaning(torch.device("cuda", 3)) == meaning(torch.device("cuda", 0))


def _setup_by_meaning(rank: int) -> dict[str, Any]:
    """A tensor ``lr`` that prints differently on each rank builds; different values do not."""
    out: dict[str, Any] = {}
    data = batches()
    with tensors_printed_on_cuda(rank):
        out["repr"] = repr(torch.tensor(LR))
        model = Blocks()
        try:
            opt = ZeroOptimizer(model.named_parameters(), lr=torch.tensor(LR), flatten_config=FLAT)
        except ValueError as error:
            out["same_lr"] = str(error)
        else:
            out["same_lr"] = "built"
            micro_loss(model, data[0, 0, rank]).backward()
            opt.step()
            out["same_lr_params"] = fp32(dict(model.named_parameters()))
            opt.close()
        model = Blocks()
        before = [p.data_ptr() for p in model.parameters()]
        try:
            ZeroOptimizer(model.parameters(), lr=torch.tensor(LR * (1 + rank)), flatten_config=FLAT)
            out["different_lr"] = "no error"
        except ValueError as error:
            out["different_lr"] = str(error)
        out["different_lr_unchanged"] = before == [p.data_ptr() for p in model.parameters()]
    return out


def test_tensor_lr_agrees_across_ranks(ranks):
    for out in ranks:
        assert "error" not in out["setup"], out["setup"]["error"]
    reprs = [r["setup"]["repr"] for r in ranks]
    assert reprs[0] != reprs[1], reprs  # the ranks' texts differ, as on two GPUs
    for rank, out in enumerate(ranks):
        item = out["setup"]
        assert item["same_lr"] == "built", (rank, item["same_lr"])
        assert "the ZeroOptimizer setup differs between ranks" in item["different_lr"], rank
        assert "optimizer arguments" in item["different_lr"], item["different_lr"]
        assert item["different_lr_unchanged"]
    first, second = (r["setup"]["same_lr_params"] for r in ranks)
    assert all(torch.equal(first[n], second[n]) for n in first)


# ------------------------------------------------------------------- grad_accum_dtype
def accumulate(rank: int, world_size: int, grad_accum_dtype: torch.dtype | None) -> dict:
    """Stage 1, bf16 params, ``MICRO`` micro-batches per step: the fp32 masters after
    ``STEPS`` steps."""
    data = batches()
    model = Blocks(torch.bfloat16)
    opt = ZeroOptimizer(
        model.named_parameters(),
        stage=1,
        config=ZeroConfig(stage=1, grad_accum_dtype=grad_accum_dtype),
        flatten_config=FLAT,
        lr=LR,
    )
    for step in range(STEPS):
        for micro in range(MICRO):
            micro_loss(model, data[step, micro, rank]).backward()
        if grad_accum_dtype is not None:
            assert all(p.grad is None for p in model.parameters())
        opt.step()
    masters = opt.full_params()
    opt.close()
    return masters


def fp32_accumulating_reference(world_size: int) -> dict[str, torch.Tensor]:
    """One process: each rank's bf16 micro-batch gradients summed in fp32, ranks summed in
    fp32 and averaged; fused AdamW on fp32 masters, cast into the bf16 params."""
    data = batches()
    model = Blocks(torch.bfloat16)
    named = list(model.named_parameters())
    masters = {n: p.detach().float().clone().requires_grad_() for n, p in named}
    opt = torch.optim.AdamW(list(masters.values()), lr=LR, fused=True)
    for step in range(STEPS):
        total = {n: torch.zeros_like(m) for n, m in masters.items()}
        for rank in range(world_size):
            summed = {n: torch.zeros_like(m) for n, m in masters.items()}
            for micro in range(MICRO):
                micro_loss(model, data[step, micro, rank]).backward()
                for n, p in named:
                    summed[n] += p.grad.float()
                    p.grad = None
            for n in total:
                total[n] += summed[n]
        for n, m in masters.items():
            m.grad = total[n] / world_size
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in named:
                p.copy_(masters[n])
    return {n: m.detach() for n, m in masters.items()}


def _engine_accumulate(rank: int, world_size: int) -> dict[str, Any]:
    """The same training through ``flatzero.initialize`` and a DeepSpeed config with
    ``data_types.grad_accum_dtype: fp32``."""
    import flatzero

    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": MICRO,
        "zero_optimization": {"stage": 1, "reduce_bucket_size": 300},
        "bf16": {"enabled": True},
        "data_types": {"grad_accum_dtype": "fp32"},
        # the ranks' sum in fp32 too, as the reference (unset, it is bf16, as DeepSpeed's)
        "communication_data_type": "fp32",
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "flatzero": {"progress": False},
    }
    engine, opt, _, _ = flatzero.initialize(model=Blocks(), config=config)
    buffer_dtypes = [b.dtype for b in opt.flat_grad_buffers]
    data = batches()
    for step in range(STEPS):
        for micro in range(MICRO):
            out = engine(data[step, micro, rank].to(torch.bfloat16))
            engine.backward(out.float().pow(2).mean())
            engine.step()
    masters = opt.full_params()
    engine.destroy()
    return {"masters": masters, "buffer_dtypes": buffer_dtypes}


def _grad_accum(rank: int) -> dict[str, Any]:
    return {
        "engine": _guarded(_engine_accumulate, rank, WS),
        "fp32": _guarded(accumulate, rank, WS, torch.float32),
        "none": _guarded(accumulate, rank, WS, None),
    }


def test_grad_accum_fp32_at_world_size_1():
    ref = fp32_accumulating_reference(1)
    honoured = rel_err(accumulate(0, 1, torch.float32), ref)
    in_bf16 = rel_err(accumulate(0, 1, None), ref)
    print(f"world size 1: fp32 accumulation {honoured:.2e}, bf16 {in_bf16:.2e} relative error")
    assert honoured <= 1e-6, honoured  # the same sums, in the same order: fp32 rounding
    assert in_bf16 >= 5e-5, in_bf16  # bf16 accumulation is measurably off: the test can fail


def test_grad_accum_fp32_at_world_size_2(ranks):
    ref = fp32_accumulating_reference(WS)
    for out in ranks:
        item = out["grad_accum"]
        assert "error" not in item["engine"], item["engine"]["error"]
        engine = rel_err(item["engine"]["masters"], ref)
        print(f"engine with data_types.grad_accum_dtype fp32: relative error {engine:.2e}")
        assert engine <= 1e-6, engine
        assert item["engine"]["buffer_dtypes"] == [torch.float32]
        for name in ("fp32", "none"):
            assert "error" not in item[name], item[name]["error"]
        honoured, in_bf16 = rel_err(item["fp32"], ref), rel_err(item["none"], ref)
        print(f"world size 2: fp32 accumulation {honoured:.2e}, bf16 {in_bf16:.2e} relative error")
        assert honoured <= 1e-6, honoured
        assert in_bf16 >= 5e-5, in_bf16


# -------------------------------------------------------- reentrant checkpointing
@contextmanager
def counted_reductions() -> Iterator[list[int]]:
    """Record the elements every gradient reduction takes in: a reduce-scatter (of a
    bucket) or a reduce (of a chunk of one rank's slice)."""
    numels: list[int] = []
    scatter, reduce = flatzero.comm._reduce_scatter_single, dist.reduce

    def counted_scatter(output: torch.Tensor, full: torch.Tensor, **kwargs: Any) -> Any:
        numels.append(full.numel())
        return scatter(output, full, **kwargs)

    def counted_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        numels.append(tensor.numel())
        return reduce(tensor, *args, **kwargs)

    flatzero.comm._reduce_scatter_single, dist.reduce = counted_scatter, counted_reduce
    try:
        yield numels
    finally:
        flatzero.comm._reduce_scatter_single, dist.reduce = scatter, reduce


def _train_reentrant(rank: int, stage: int) -> dict[str, Any]:
    """``STEPS`` steps of ``MICRO`` micro-batches under reentrant checkpointing, with the
    elements reduced in each backward pass and in each step."""
    data = batches()
    model = Blocks(frozen_head=True)
    opt = ZeroOptimizer(model.named_parameters(), stage=stage, flatten_config=FLAT, lr=LR)
    per_backward, per_step = [], []
    with counted_reductions() as numels:
        for step in range(STEPS):
            for micro in range(MICRO):
                mark = len(numels)
                micro_loss(model, data[step, micro, rank], reentrant=True).backward()
                per_backward.append(sum(numels[mark:]))
            mark = len(numels)
            opt.step()
            per_step.append(sum(numels[mark:]))
    out = {
        "bucket_numel": sum(b.numel for g in opt.flat.groups for b in g.layout.buckets),
        "buckets": sum(len(g.layout.buckets) for g in opt.flat.groups),
        "calls": len(numels),
        "per_backward": per_backward,
        "per_step": per_step,
        "masters": opt.full_params(),
    }
    opt.close()
    return out


def _two_segments_forward(model: Blocks, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
    """Block 0 in two segments (reentrant: two gradient deliveries in one backward pass),
    then block 1 and the frozen head."""
    first = model.blocks[0]
    if not reentrant:
        return model.head(_block(model.blocks[1], _block(first, _block(first, x))))
    x = x.detach().requires_grad_()
    h = checkpoint(_block, first, x, use_reentrant=True)
    h = checkpoint(lambda t: _block(model.blocks[1], _block(first, t)), h, use_reentrant=True)
    return model.head(h)


def _param_in_two_segments(rank: int) -> dict[str, Any]:
    """Stage 2: a param used in two reentrant segments gets two gradients in one backward
    pass; ``STEPS`` steps of ``MICRO`` micro-batches take both (DeepSpeed's ZeRO-2
    refuses it, and flatzero did before issue 42)."""
    data = batches()
    model = Blocks(frozen_head=True)
    opt = ZeroOptimizer(model.named_parameters(), stage=2, flatten_config=FLAT, lr=LR)
    for step in range(STEPS):
        for micro in range(MICRO):
            x = data[step, micro, rank]
            (_two_segments_forward(model, x, True).pow(2).mean() / MICRO).backward()
        opt.step()
    masters = opt.full_params()
    opt.close()
    return {"masters": masters}


def test_param_in_two_reentrant_segments_is_taken_at_stage_2(ranks):
    """Issue 42 part 2: before, every rank raised "a gradient arrived twice for one param
    in one backward pass"; now the params equal plain AdamW's without checkpointing."""
    data = batches()
    model = Blocks(frozen_head=True)
    trainable = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(list(trainable.values()), lr=LR)
    for step in range(STEPS):
        for micro in range(MICRO):
            for rank in range(WS):
                out = _two_segments_forward(model, data[step, micro, rank], False)
                (out.pow(2).mean() / MICRO / WS).backward()
        opt.step()
        opt.zero_grad()
    # blocks 2 and 3 get no gradient: AdamW skips them, flatzero decays them
    ref = {n: p for n, p in fp32(trainable).items() if n.startswith(("blocks.0.", "blocks.1."))}
    for out in ranks:
        item = out["reentrant"]["two_segments"]
        assert "error" not in item, item["error"]
        assert rel_err(item["masters"], ref) <= 1e-5, rel_err(item["masters"], ref)


def plain_adamw_reference() -> dict[str, torch.Tensor]:
    """Plain torch AdamW on one process over the global batch (no checkpointing)."""
    data = batches()
    model = Blocks(frozen_head=True)
    trainable = dict((n, p) for n, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.AdamW(list(trainable.values()), lr=LR)
    for step in range(STEPS):
        for micro in range(MICRO):
            for rank in range(WS):
                (micro_loss(model, data[step, micro, rank]) / WS).backward()
        opt.step()
        opt.zero_grad()
    return fp32(trainable)


@pytest.mark.parametrize("stage", [1, 2])
def test_reentrant_checkpointing_reduces_once(ranks, stage):
    ref = plain_adamw_reference()
    for out in ranks:
        got = out["reentrant"][stage]
        assert "error" not in got, got["error"]
        total = got["bucket_numel"]
        print(
            f"stage {stage}: {got['buckets']} buckets, {got['calls']} reduction calls in "
            f"{STEPS} steps, elements per backward {got['per_backward']}, per step "
            f"{got['per_step']} (buckets hold {total})"
        )
        # Every element of every bucket is reduced exactly once: in each backward pass at
        # stage 2, at the step at stage 1.
        if stage == 2:
            assert got["per_backward"] == [total] * (STEPS * MICRO)
            assert got["per_step"] == [0] * STEPS
        else:
            assert got["per_backward"] == [0] * (STEPS * MICRO)
            assert got["per_step"] == [total] * STEPS
        assert rel_err(got["masters"], ref) <= 1e-5, rel_err(got["masters"], ref)


# ----------------------------------------------------------------- the 2-rank run
def _guarded(fn: Callable[..., dict], *args: Any) -> dict:
    """``fn(*args)``, or ``{"error": traceback}``: one item failing fails its own test."""
    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


def _worker(rank: int, world_size: int) -> bytes:
    torch.set_num_threads(1)
    out = {
        "setup": _guarded(_setup_by_meaning, rank),
        "grad_accum": _guarded(_grad_accum, rank),
        "reentrant": {
            **{stage: _guarded(_train_reentrant, rank, stage) for stage in (1, 2)},
            "two_segments": _guarded(_param_in_two_segments, rank),
        },
    }
    buffer = io.BytesIO()  # tensors through a queue would need the child alive: serialize
    torch.save(out, buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    blobs = run_ranks(_worker, WS, timeout_s=120)
    return [torch.load(io.BytesIO(blob), weights_only=False) for blob in blobs]
