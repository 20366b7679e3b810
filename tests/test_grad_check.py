"""The gradient check (``ZeroConfig.check_gradients``, issue 42 part 2).

Each fault is injected in one rank process by monkeypatching the reduction path, after the
check noted what the rank staged; every one must raise ``GradientMismatch`` on every rank,
naming the bucket, the params and the owner. Without a fault the check must stay quiet over
a long bf16 run.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.optim import GradientMismatch, ZeroConfig, ZeroOptimizer
from flatzero.optim import reducers as reducers_module

FAULTS = ("none", "dropped", "duplicated", "scaled", "delayed", "corrupted", "skipped")


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8)).to(dtype)


def _inject(fault: str, rank: int) -> None:
    """Patch this process's reduction path with ``fault``, once, at the first reduction of
    a nonzero chunk from the 3rd on (undone by ``_restore``)."""
    calls = {"n": 0, "armed": True}
    finish, reduce = reducers_module.GradReducer._finish, dist.reduce
    held: list = []

    def fires(tensor: torch.Tensor) -> bool:
        calls["n"] += 1
        hit = calls["armed"] and calls["n"] >= 3 and bool(tensor.abs().sum() > 0)
        calls["armed"] &= not hit
        return hit

    def faulty_finish(self, item):  # the owner's landing of a chunk
        if item.dst is not None:
            item.work.wait()
        if item.dst is None or not fires(item.src):
            finish(self, item)
            if held and self.check.verified > held[0][1]:  # after its step's check
                finish(self, held.pop()[0])
            return
        if fault == "dropped":
            self.pool.release(item.slot)
        elif fault == "delayed":
            held.append((item, self.check.verified))
        else:
            finish(self, item)
            if fault == "duplicated":
                item.dst.add_(item.src)
            else:  # scaled
                item.dst.mul_(1.5)

    def faulty_reduce(tensor, *args, **kwargs):  # a rank's contribution, after staging
        if rank == 1 and fires(tensor):
            if fault == "corrupted":  # a garbled copy: every other element's sign
                tensor[::2].neg_()
            else:  # skipped: the rank's contribution never counts
                tensor.zero_()
        return reduce(tensor, *args, **kwargs)

    if fault in ("corrupted", "skipped"):
        dist.reduce = faulty_reduce
    elif fault != "none":
        reducers_module.GradReducer._finish = faulty_finish


_ORIGINAL = (reducers_module.GradReducer._finish, dist.reduce)


def _restore() -> None:
    reducers_module.GradReducer._finish, dist.reduce = _ORIGINAL


def _train(
    rank: int, world: int, stage: int, fault: str, steps: int, dtype: str, clip: bool
) -> str:
    """``clip``: a gradient norm is all-reduced every step and the check rides on it."""
    model = _model(getattr(torch, dtype))
    config = ZeroConfig(
        stage=stage,
        check_gradients=True,
        reduce_staging_bytes=4096,
        max_grad_norm=1.0 if clip else None,
    )
    flatten = FlattenConfig(device="cpu", progress=False, bucket_numel=256)
    _inject(fault, rank)  # before the optimizer: its staging pool binds _finish
    opt = ZeroOptimizer(model, lr=1e-2, config=config, flatten_config=flatten)
    gen = torch.Generator().manual_seed(rank)
    try:
        for _ in range(steps):
            for _ in range(2):  # two micro-batches: the check sees accumulation
                x = torch.randn(4, 16, generator=gen).to(model[0].weight.dtype)
                model(x).float().square().mean().backward()
            opt.step()
            opt.zero_grad()
    except GradientMismatch as err:
        return str(err)
    finally:
        _restore()
    return f"quiet after {opt._reducer.check.verified} checks"


def _every_fault(rank: int, world: int, stage: int, clip: bool) -> list[str]:
    return [_train(rank, world, stage, fault, 3, "float32", clip) for fault in FAULTS]


@pytest.mark.parametrize(("stage", "world", "clip"), [(2, 3, True), (1, 2, False)])
def test_every_fault_is_detected(stage: int, world: int, clip: bool) -> None:
    """With clipping the check's all-reduce is the norm's; without, its own."""
    per_rank = run_ranks(_every_fault, world, stage, clip)
    for fault, out in zip(FAULTS, zip(*per_rank, strict=True), strict=True):
        if fault == "none":
            assert out == ("quiet after 3 checks",) * world
            continue
        for message in out:
            assert message.startswith("flatzero gradient check"), (fault, message)
            assert "of group 0 elements [" in message and "(params " in message, message
            assert "held by rank" in message
        assert len(set(out)) == 1, fault  # every rank raises the same error
        if fault == "skipped":
            assert "rank 1's contribution" in out[0]


def test_no_false_alarm_over_many_bf16_steps() -> None:
    out = run_ranks(_train, 2, 2, "none", 1000, "bfloat16", True)
    assert out == ["quiet after 1000 checks"] * 2


def _collectives_per_step(rank: int, world: int) -> dict[str, list[int]]:
    counted: dict[str, int] = {}
    originals = {n: getattr(dist, n) for n in ("all_reduce", "reduce", "broadcast")}

    def counting(name, fn):
        def call(*args, **kwargs):
            counted[name] = counted.get(name, 0) + 1
            return fn(*args, **kwargs)

        return call

    out: dict[str, list[int]] = {}
    for check in (False, True):
        model = _model(torch.float32)
        config = ZeroConfig(check_gradients=check, max_grad_norm=1.0)
        flatten = FlattenConfig(device="cpu", progress=False, bucket_numel=256)
        opt = ZeroOptimizer(model, lr=1e-2, config=config, flatten_config=flatten)
        model(torch.randn(4, 16)).square().mean().backward()
        opt.step()  # the first step agrees on the order: not counted
        counted.clear()
        for name, fn in originals.items():
            setattr(dist, name, counting(name, fn))
        try:
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        verified = opt._reducer.check.verified if check else 0
        out[str(check)] = [counted.get(n, 0) for n in originals] + [verified]
        opt.close()
    return out


def test_with_clipping_the_check_adds_no_collective() -> None:
    """The check's scalars ride on the norm's all-reduce ([Note: the check rides on the
    norm]): a checked step makes exactly the collectives of an unchecked one."""
    for out in run_ranks(_collectives_per_step, 2):
        assert out["True"][:3] == out["False"][:3], out
        assert out["True"][0] == 1 and out["True"][3] == 2, out  # the norm's; both checked


def test_the_deepspeed_door_key_turns_it_on() -> None:
    from flatzero.deepspeed.engine.config import parse_config

    base = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    assert not parse_config(base, world_size=2).zero_optimizer.check_gradients
    given = {**base, "flatzero": {"check_gradients": True}}
    assert parse_config(given, world_size=2).zero_optimizer.check_gradients
    with pytest.raises(TypeError, match=r"flatzero\.check_gradients"):
        parse_config({**base, "flatzero": {"check_gradients": "yes"}}, world_size=2)
