"""Issue 42 part 1: the parameter all-gathers of a step overlap the next forward.

Multi-process gloo tests: overlap on and off give bitwise equal losses and weights
(stage 1 and 2, a forward order unlike the registration order, a param used twice);
whatever reads params after ``step()`` sees the gathered values; on a slow link
(``testing.slowlink``) ``step()`` returns before the gathers are through and the forward
waits for them bucket by bucket.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from flatzero import FlattenConfig, ZeroConfig, ZeroOptimizer
from flatzero.launch import run_ranks
from flatzero.testing.slowlink import slow_link


class _Shuffled(nn.Module):
    """Runs its layers in an order unlike their registration order (Megatron #950), the
    first one twice (a param used in two places), and holds a parent-owned scale."""

    def __init__(self, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.scale = nn.Parameter(torch.ones(width))
        self.order = [3, 0, 2, 1, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = torch.tanh(self.layers[i](x))
        return (x * self.scale).pow(2).mean()


class _ReadsChildParam(_Shuffled):
    """Reads a child's weight from the parent's forward: no pre-hook of the child runs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.linear(x, self.layers[2].weight)
        return super().forward(x)


def _train(rank: int, world: int, stage: int, overlap: bool, model_cls: type, steps: int):
    torch.manual_seed(0)
    model = model_cls()
    opt = ZeroOptimizer(
        model,
        torch.optim.AdamW,
        lr=1e-2,
        config=ZeroConfig(stage=stage, overlap_param_gather=overlap),
        flatten_config=FlattenConfig(device="cpu", bucket_numel=300),
    )
    losses, outstanding = [], []
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        loss = model(torch.randn(8, 16, generator=gen))
        loss.backward()
        opt.step()
        outstanding.append(opt._gather.outstanding if opt._gather is not None else 0)
        losses.append(loss.item())
    with torch.no_grad():  # evaluation right after a step: hooks still wait
        losses.append(model(torch.ones(8, 16)).item())
    weights = {k: v.numpy().tobytes() for k, v in model.state_dict().items()}
    enabled = opt._gather.enabled if opt._gather is not None else False
    # No extra memory: every param is still a view of its bucket, which the gathers fill.
    buckets = {b.untyped_storage().data_ptr() for g in opt.flat.groups for b in g.buckets}
    assert all(p.untyped_storage().data_ptr() in buckets for p in model.parameters())
    opt.close()
    return losses, weights, outstanding, enabled


def _on_and_off(rank: int, world: int, model_cls: type, steps: int):
    """For stages 1 and 2: overlap off, then on, in the same processes."""
    return [
        (
            _train(rank, world, stage, False, model_cls, steps),
            _train(rank, world, stage, True, model_cls, steps),
        )
        for stage in (1, 2)
    ]


def _door(overlap: bool, rank: int):
    """Three steps through the DeepSpeed door with ``overlap_comm: overlap``."""
    import flatzero

    torch.manual_seed(0)
    model = _Shuffled()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 2, "overlap_comm": overlap, "reduce_bucket_size": 300},
    }
    engine, opt, _, _ = flatzero.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(100 + rank)
    losses, outstanding = [], []
    for _ in range(3):
        loss = engine(torch.randn(8, 16, generator=gen))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        outstanding.append(opt._gather.outstanding if opt._gather is not None else 0)
    weights = {k: v.numpy().tobytes() for k, v in model.state_dict().items()}
    engine.destroy()
    return losses, weights, outstanding


def _both_models(rank: int, world: int):
    return (
        _on_and_off(rank, world, _Shuffled, 4),
        _on_and_off(rank, world, _ReadsChildParam, 3),
        (_door(False, rank), _door(True, rank)),
    )


@pytest.fixture(scope="module")
def trained():
    """Per rank: (shuffled model, parent-reads-child model) results; one launch for both."""
    return run_ranks(_both_models, 2)


def test_overlap_bitwise_equal_to_waiting_in_step(trained):
    for per_stage, _, _ in trained:
        for (l_off, w_off, _, _), (l_on, w_on, pending, enabled) in per_stage:
            assert enabled
            assert l_off == l_on
            assert w_off == w_on
            assert all(n > 0 for n in pending)  # step() returned with gathers outstanding


def test_overlap_turns_itself_off_for_a_parent_reading_a_child_param(trained):
    for _, per_stage, _ in trained:
        for (l_off, w_off, _, _), (l_on, w_on, pending, enabled) in per_stage:
            assert not enabled
            assert pending[1:] == [0, 0]
            assert l_off == l_on
            assert w_off == w_on


def test_deepspeed_door_maps_overlap_comm(trained):
    for _, _, ((l_off, w_off, p_off), (l_on, w_on, p_on)) in trained:
        assert p_off == [0, 0, 0] and all(n > 0 for n in p_on)
        assert l_off == l_on
        assert w_off == w_on


def _reads_after_step(rank: int, world: int, tmp: str):
    from flatzero.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(0)
    model = _Shuffled()
    opt = ZeroOptimizer(
        model,
        lr=1e-2,
        config=ZeroConfig(overlap_param_gather=True),
        flatten_config=FlattenConfig(device="cpu", bucket_numel=300),
    )
    model(torch.randn(8, 16)).backward()  # the learning forward
    opt.step()
    model(torch.randn(8, 16)).backward()
    with slow_link(2e5):  # ~1 ms per KB: the gathers are still running when step returns
        opt.step()
        assert opt._gather.outstanding > 0
        sd = {k: v.clone() for k, v in model.state_dict().items()}  # waits
        assert opt._gather.outstanding == 0
    expected = opt.full_params()
    for name, value in expected.items():
        assert torch.equal(sd[name], value), name
    model(torch.randn(8, 16)).backward()
    with slow_link(2e5):
        opt.step()
        path = save_checkpoint(tmp, opt, tag="t")  # waits, saves the stepped values
        assert opt._gather.outstanding == 0
    saved = {k: v.clone() for k, v in opt.full_params().items()}
    model(torch.randn(8, 16)).backward()
    opt.step()
    load_checkpoint(path.parent, opt, tag="t")
    for name, value in opt.full_params().items():
        assert torch.equal(value, saved[name]), name
    with torch.no_grad():
        for name, p in model.named_parameters():
            assert torch.equal(p, saved[name].to(p.dtype)), name
    opt.close()
    return _guarded()


def test_state_dict_and_checkpoint_right_after_step_see_gathered_values(tmp_path):
    """And the debug guard catches a read before the wait (``_guarded``)."""
    assert run_ranks(_reads_after_step, 2, str(tmp_path)) == [(True, True), (True, True)]


def _timed(rank: int, world: int, bytes_per_s: float):
    return [_timed_one(overlap, bytes_per_s) for overlap in (True, False)]


def _timed_one(overlap: bool, bytes_per_s: float):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
    opt = ZeroOptimizer(
        model,
        lr=1e-2,
        config=ZeroConfig(overlap_param_gather=overlap),
        flatten_config=FlattenConfig(device="cpu", bucket_numel=64 * 65),
    )
    nbuckets = len(opt.flat.groups[0].buckets)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    waits: list[float] = []
    with slow_link(bytes_per_s):
        model(torch.randn(4, 64)).sum().backward()
        opt.reduce_gradients()  # the reductions through the link, not timed here
        t0 = time.perf_counter()
        opt.step()
        step_s = time.perf_counter() - t0
        for layer in model:
            t1 = time.perf_counter()
            layer(torch.randn(4, 64))
            waits.append(time.perf_counter() - t1)
        opt.wait_for_params()
    opt.close()
    return nbuckets, step_s, waits


def test_step_returns_before_the_gathers_and_the_forward_waits_per_bucket():
    # a bucket is ~16.6 KB of fp32: ~83 ms through the 200 KB/s link; 4 buckets ~0.33 s
    for on, off in run_ranks(_timed, 2, 2e5):
        nbuckets, step_s, waits = on
        assert nbuckets == 4
        assert step_s < 0.06  # returned before one bucket was through
        assert waits[0] > 0.05  # the first layer waited for its bucket ...
        assert sum(waits) > 0.25  # ... and each later one for the next, in turn
        assert max(waits) < 0.2  # no layer waited for all of them
        _, step_s, waits = off
        assert step_s > 0.3  # without overlap step() waits for every bucket
        assert sum(waits) < 0.05


def _guarded():
    model = _Shuffled()
    opt = ZeroOptimizer(
        model,
        lr=1e-2,
        config=ZeroConfig(overlap_param_gather=True, overlap_guard=True),
        flatten_config=FlattenConfig(device="cpu", bucket_numel=300),
    )
    model(torch.randn(8, 16)).backward()
    opt.step()
    model(torch.randn(8, 16)).backward()
    with slow_link(2e5):
        opt.step()
        try:
            torch.clone(model.layers[0].weight.data)  # an EMA copy, not waited for
        except RuntimeError as e:
            caught = "overlap guard" in str(e)
        else:
            caught = False
        opt.wait_for_params()
        ema = torch.clone(model.layers[0].weight.data)  # after the wait: allowed
    opt.close()
    return caught, bool(torch.isfinite(ema).all())


class _CountedWork:
    """A gather's Work that counts its waits."""

    def __init__(self, work) -> None:
        self.work, self.waits = work, 0

    def wait(self) -> None:
        self.waits += 1
        self.work.wait()


def _reads_between_step_and_forward(rank: int, world: int):
    torch.manual_seed(0)
    model = _Shuffled()
    opt = ZeroOptimizer(
        model,
        lr=1e-2,
        config=ZeroConfig(overlap_param_gather=True),
        flatten_config=FlattenConfig(device="cpu", bucket_numel=300),
    )
    model(torch.randn(8, 16)).backward()  # the learning forward
    opt.step()
    model(torch.randn(8, 16)).backward()
    weight = model.layers[0].weight
    with slow_link(2e5):
        opt.step()
        launched = opt._gather.outstanding
        works = opt._gather._works
        counted = {b: _CountedWork(w) for b, w in works.items()}
        works.update(counted)
        ema = torch.zeros(16, 16)
        ema.add_(weight.data)  # an EMA update: no hook sees it, the mode waits for its bucket
        waited = sum(w.waits > 0 for w in counted.values())
        # the Work stays for the forward's own wait (on NCCL each wait orders one stream)
        assert opt._gather.outstanding == launched
        model(torch.randn(8, 16))  # the forward turns the mode off (its pre-hooks wait)
        mode_after_forward = opt._gather._mode is not None
        opt.wait_for_params()
    expected = opt.full_params()["layers.0.weight"]
    model(torch.randn(8, 16)).backward()
    with slow_link(2e5):
        opt.step()
        with torch.device("cpu"):  # a mode entered after flatzero's, still on top
            model(torch.randn(8, 16))
        opt.wait_for_params()
    stack_clean = torch.overrides._get_current_function_mode() is None
    opt.close()
    return launched, waited, mode_after_forward, bool(torch.equal(ema, expected)), stack_clean


def test_a_read_between_step_and_forward_waits_for_its_bucket_only():
    """[Note: reads between step and forward]: an EMA copy right after ``step()`` sees the
    gathered values, having waited for its own bucket's gather and no other."""
    for out in run_ranks(_reads_between_step_and_forward, 2):
        launched, waited, mode_after_forward, equal, stack_clean = out
        assert launched > 2 and waited == 1
        assert not mode_after_forward
        assert equal
        assert stack_clean  # a user's mode above flatzero's: both left the stack in turn


class _OpCounter(torch.overrides.TorchFunctionMode):
    """A user's torch-function mode (an op counter, a profiler)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _user_mode_around_step(rank: int, world: int):
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(4)))
    opt = ZeroOptimizer(
        model,
        lr=1e-2,
        config=ZeroConfig(overlap_param_gather=True),
        flatten_config=FlattenConfig(device="cpu", bucket_numel=300),
    )
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    model(torch.randn(4, 16)).sum().backward()
    with slow_link(2e5):
        counter = _OpCounter()
        with counter:  # entered before step(), left after it: flatzero's mode came later
            opt.step()
        stack = [type(m).__name__ for m in torch.overrides._get_current_function_mode_stack()]
        counted = {b: _CountedWork(w) for b, w in opt._gather._works.items()}
        opt._gather._works.update(counted)
        model[0].weight.detach().clone()  # an EMA copy after the user's block
        waited = sum(w.waits > 0 for w in counted.values())
        before = counter.ops
        torch.zeros(1)
        counted_after_exit = counter.ops - before
        opt.wait_for_params()
    model(torch.randn(4, 16))
    clean = torch.overrides._get_current_function_mode() is None
    opt.close()
    return stack, waited, counted_after_exit, clean


def test_a_user_mode_around_step_leaves_the_stack_and_reads_still_wait():
    """[Note: the waiting mode's place on the stack]: a user's mode entered before
    ``step()`` and left after it is the one that leaves; flatzero's still waits."""
    for stack, waited, counted_after_exit, clean in run_ranks(_user_mode_around_step, 2):
        assert "_OpCounter" not in stack  # was: the user's mode stayed on for good
        assert waited == 1  # was 0: flatzero's mode had been popped in its place
        assert counted_after_exit == 0
        assert clean
