"""The training step's memory and host syncs.

- staging: gradient staging stays within ``ZeroConfig.reduce_staging_bytes`` when buckets
  (and a param) are larger than it, with the same results bit for bit as a budget that
  holds every bucket, and parity with plain AdamW;
- unused params: ranks that leave different params without gradient neither hang nor hold
  gradients back: a chunk whose params this backward pass will not reach is reduced at
  once, so only about one layer's gradients wait at any time;
- host syncs: a step reads nothing from the device (bf16/fp32; one read with fp16 loss
  scaling) and issues one all-reduce, for the norm, on the gradients' device.

Two spawns: 2 gloo ranks for staging and host syncs, 3 for unused params. References run
in the ranks.
"""

from __future__ import annotations

import io
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import flatzero.comm as comm
import flatzero.optim.buckets as buckets
from flatzero import FlattenConfig
from flatzero.launch import run_ranks
from flatzero.optim import LossScaleConfig, ZeroConfig, ZeroOptimizer
from flatzero.plan.memory_model import held_gradient_bytes

LR = 1e-2
WIDTH = 32
BUDGET = 4096
"""The staging test's budget (bytes): 1024 fp32 elements, chunks of 512."""
UNUSED_BUDGET = 6144
"""The unused-params test's staging budget (bytes)."""


def _pack(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _unpack(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=False)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------- staging
class Wide(nn.Module):
    """An embedding of 12,800 elements (a bucket of its own, 25 chunks of the budget's 512)
    and three layers sharing buckets of up to 4,096 elements (more than the budget)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(400, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.head = nn.Linear(WIDTH, 400)
        self.to(dtype)

    def loss(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return nn.functional.cross_entropy(self.head(x).float().flatten(0, 1), ids.flatten())


def _ids(step: int, micro: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 400, (2, 6), generator=gen)


@contextmanager
def _staging_allocations() -> Iterator[dict[str, int]]:
    """Record what the staging pool allocates (``buckets.empty_buffer``): the most bytes
    alive at once."""
    seen = {"live": 0, "peak": 0}
    original = buckets.empty_buffer

    def freed(nbytes: int) -> None:
        seen["live"] -= nbytes

    def recording(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = original(numel, dtype, device)
        nbytes = numel * dtype.itemsize
        seen["live"] += nbytes
        seen["peak"] = max(seen["peak"], seen["live"])
        weakref.finalize(tensor.untyped_storage(), freed, nbytes)
        return tensor

    with mock.patch.object(buckets, "empty_buffer", recording):
        yield seen


def _train_wide(
    rank: int, stage: int, dtype: torch.dtype, budget: int, steps: int = 3
) -> dict[str, Any]:
    """Three steps of two micro-batches with clipping; the params and staging seen."""
    model = Wide(dtype)
    with _staging_allocations() as staging:
        opt = ZeroOptimizer(
            model.parameters(),
            stage=stage,
            config=ZeroConfig(max_grad_norm=0.5, reduce_staging_bytes=budget),
            flatten_config=FlattenConfig(bucket_numel=4096, device="cpu", progress=False),
            lr=LR,
        )
        for step in range(steps):
            for micro in range(2):
                opt.backward(model.loss(_ids(step, micro, rank)) / 2)
            opt.step()
        largest_bucket = max(b.numel for g in opt.flat.groups for b in g.layout.buckets)
        out = {
            "params": _snapshot(model),
            "staging_peak": staging["peak"],
            "staging_bytes": opt._reducer.staging_bytes,
            "bucket_fp32_bytes": largest_bucket * 4,
        }
        opt.close()
    return out


def _adamw_reference(world_size: int, steps: int = 3) -> dict[str, torch.Tensor]:
    """Plain AdamW on one process over every rank's micro-batches (the mean over ranks of
    the sum over micro-batches), clipped as the optimizer clips."""
    model = Wide(torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(steps):
        for rank in range(world_size):
            for micro in range(2):
                (model.loss(_ids(step, micro, rank)) / (2 * world_size)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return _snapshot(model)


def _staging(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    for stage, dtype in (
        (2, torch.float32),
        (2, torch.bfloat16),
        (1, torch.bfloat16),
        (1, torch.float32),  # on gloo in host memory: through the slots too
    ):
        key = f"stage{stage}_{str(dtype)[6:]}"
        out[key] = {
            "chunked": _train_wide(rank, stage, dtype, BUDGET),
            "whole": _train_wide(rank, stage, dtype, ZeroConfig().reduce_staging_bytes),
        }
    if rank == 0:
        out["reference"] = _adamw_reference(world_size)
    return out


def _check_staging(results: list[dict[str, Any]]) -> None:
    for key in ("stage2_float32", "stage2_bfloat16", "stage1_bfloat16", "stage1_float32"):
        for rank, result in enumerate(results):
            chunked, whole = result[key]["chunked"], result[key]["whole"]
            # The buckets in fp32 are larger than the budget; staging never exceeds it.
            assert chunked["bucket_fp32_bytes"] > BUDGET, key
            assert 0 < chunked["staging_peak"] <= BUDGET, (key, rank, chunked["staging_peak"])
            assert chunked["staging_bytes"] <= BUDGET, key
            # Bit for bit what one chunk per slice gives.
            for name, value in whole["params"].items():
                assert torch.equal(chunked["params"][name], value), (key, rank, name)
    reference = results[0]["reference"]
    ours = results[0]["stage2_float32"]["chunked"]["params"]
    for name, value in reference.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_staging_bounded_by_budget(two_ranks):
    _check_staging([r["staging"] for r in two_ranks])


# ---------------------------------------------------------------- unused params
LAYERS = 8


class Chain(nn.Module):
    """``LAYERS`` residual ``tanh(Linear)`` layers (one bucket each) and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, 1)

    def loss(self, x: torch.Tensor, skip: set[int]) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i not in skip:  # an expert no token was routed to: not in the graph at all
                x = x + torch.tanh(layer(x))
        return self.head(x).square().mean()


def _skipped(step: int, rank: int) -> set[int]:
    """Different layers without gradient on different ranks, changing with the step."""
    return [{6, step % 3}, {2, 5}, set() if step % 2 else {7}][rank]


def _inputs(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


UNUSED_STEPS = 5


def _unused_params(rank: int, world_size: int) -> dict[str, Any]:
    model = Chain()
    opt = ZeroOptimizer(
        model.parameters(),
        config=ZeroConfig(reduce_staging_bytes=UNUSED_BUDGET),
        flatten_config=FlattenConfig(bucket_numel=1100, device="cpu", progress=False),
        lr=LR,
    )
    reducer = opt._reducer
    held = []
    with _staging_allocations() as staging:
        for step in range(UNUSED_STEPS):
            model.loss(_inputs(step, rank), _skipped(step, rank)).backward()
            opt.step()
            held.append(opt.held_gradient_peak_bytes())
            reducer.held_peak = 0
    out = {
        "params": _snapshot(model),
        "held": held,
        "skip_unused": reducer.skip_unused,
        "staging_peak": staging["peak"],
        "layer_grad_bytes": (WIDTH * WIDTH + WIDTH) * 4,
        "buckets": len(opt.flat.groups[0].layout.buckets),
    }
    opt.close()
    if rank == 0:
        ref = Chain()
        adamw = torch.optim.AdamW(ref.parameters(), lr=LR)
        for step in range(UNUSED_STEPS):
            for r in range(world_size):  # unused params: zero gradient on that rank
                (ref.loss(_inputs(step, r), _skipped(step, r)) / world_size).backward()
            for p in ref.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            adamw.step()
            adamw.zero_grad(set_to_none=False)
        out["reference"] = _snapshot(ref)
    return out


class ChainWithExpert(Chain):
    """``Chain`` and an expert no token is routed to, registered last: first in launch
    order, so every chunk waits for it until its params count as zero."""

    def __init__(self, expert_trains: bool = True) -> None:
        super().__init__()
        self.expert = nn.Linear(WIDTH, WIDTH)
        self.expert.requires_grad_(expert_trains)


def _first_pass_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Issue 41 item 1: the held gradients of each step with an unused expert, and the
    layers' params against the same run without the expert among the trained params."""
    out: dict[str, Any] = {"layer_grad_bytes": (WIDTH * WIDTH + WIDTH) * 4}
    for expert_trains in (True, False):
        model = ChainWithExpert(expert_trains)
        opt = ZeroOptimizer(
            model.parameters(),
            flatten_config=FlattenConfig(bucket_numel=1100, device="cpu", progress=False),
            lr=LR,
        )
        held = []
        for step in range(3):
            model.loss(_inputs(step, rank), set()).backward()
            opt.step()
            held.append(opt.held_gradient_peak_bytes())
            opt._reducer.held_peak = 0
        out[expert_trains] = {
            "held": held,
            "plan_held": held_gradient_bytes(opt.flat.layout, stage=2),
            "layers": {
                n: p.detach().clone() for n, p in model.named_parameters() if "expert" not in n
            },
        }
        opt.close()
    return _pack(out)


def test_first_pass_holds_no_more_than_later_passes_with_an_unused_param():
    for result in map(_unpack, run_ranks(_first_pass_worker, 2, timeout_s=60)):
        held = result[True]["held"]
        # Before: [all 8 layers, one layer, one layer] held: the expert's chunk, first in
        # launch order, waited for the end of the first backward pass.
        assert 0 < held[0] <= max(held[1:]) <= result["layer_grad_bytes"], held
        # flatzero plan counts what backward holds: one bucket (here about one layer), in
        # every pass (before: 8 layers held in the first, beyond what it counted).
        assert max(held) <= result[True]["plan_held"] < 2 * result["layer_grad_bytes"]
        for name, value in result[False]["layers"].items():  # the same numbers, bitwise
            assert torch.equal(result[True]["layers"][name], value), name


def _late_gradient_worker(rank: int, world_size: int) -> str:
    """Reentrant checkpointing turned on after the first step: the gradients it delivers
    from inside backward come after their chunks were reduced as zero; every rank raises."""
    model = Chain()
    opt = ZeroOptimizer(
        model.parameters(),
        flatten_config=FlattenConfig(bucket_numel=1100, device="cpu", progress=False),
        lr=LR,
    )
    model.loss(_inputs(0, rank), set()).backward()
    opt.step()
    x = _inputs(1, rank).requires_grad_(True)
    x = x + torch.tanh(model.layers[0](x))
    x = checkpoint(lambda t: t + torch.tanh(model.layers[1](t)), x, use_reentrant=True)
    try:
        model.head(x).square().mean().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return [_unpack(b) for b in run_ranks(_three_rank_worker, 3, timeout_s=120)]


def test_unused_params_do_not_hold_back_reduction(three_ranks):
    reference = three_ranks[0]["reference"]
    for rank, result in enumerate(three_ranks):
        assert result["buckets"] == LAYERS + 1
        for name, value in reference.items():  # every rank: the same, as the reference
            torch.testing.assert_close(result["params"][name], value, rtol=1e-5, atol=1e-6)
        # Staging within its budget; from the second backward pass on (the first learns
        # whether a backward runs inside backward) at most one layer's gradients wait for
        # their chunks, however many layers this rank left without gradient.
        assert 0 < result["staging_peak"] <= UNUSED_BUDGET, (rank, result["staging_peak"])
        assert result["skip_unused"]
        assert max(result["held"][1:]) <= result["layer_grad_bytes"], (rank, result["held"])
        assert result["held"][0] > 0, rank  # the first pass waits for the unused layers


def test_gradient_after_its_chunk_was_reduced_raises():
    errors = run_ranks(_late_gradient_worker, 2, timeout_s=60)
    for error in errors:
        assert "counted as unused and already reduced as zero" in error, error


class HeadFirst(nn.Module):
    """A head registered first but used last (launched last, its bucket complete first)
    and four layers of one bucket each, checkpointed reentrantly where ``reentrant``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))

    def loss(self, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
        for layer in self.layers:
            block = lambda t, layer=layer: t + torch.tanh(layer(t))  # noqa: E731
            x = checkpoint(block, x, use_reentrant=True) if reentrant else block(x)
        return self.head(x).square().mean()


def _reentrant_first_pass_worker(rank: int, world_size: int) -> bytes:
    """Review of issue 41, finding 1: reentrant checkpointing from the first backward pass
    on, the head's bucket complete before any segment recomputes (on rank 0 only: rank 1
    runs the same numbers without checkpointing), against a run with no checkpointing."""
    out = {}
    for reentrant in (True, False):
        model = HeadFirst()
        opt = ZeroOptimizer(
            model.parameters(),
            flatten_config=FlattenConfig(
                bucket_numel=WIDTH * WIDTH + WIDTH, device="cpu", progress=False
            ),
            lr=LR,
        )
        for step in range(3):
            x = _inputs(step, rank).requires_grad_(True)
            model.loss(x, reentrant and rank == 0).backward()
            opt.step()
        out[reentrant] = _snapshot(model)
        opt.close()
    return _pack(out)


def test_reentrant_checkpointing_from_the_first_pass_matches_no_checkpointing():
    # Before: both ranks raised "counted as unused and already reduced as zero" at step 1
    # (the layers' params were tentative, and counted as zero once the head's bucket waited).
    for result in map(_unpack, run_ranks(_reentrant_first_pass_worker, 2, timeout_s=60)):
        for name, value in result[False].items():
            torch.testing.assert_close(result[True][name], value, rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------- host syncs
_HOST_READS = ("item", "__float__", "__bool__", "__int__", "tolist")


@contextmanager
def _host_syncs() -> Iterator[dict[str, list]]:
    """Record, while active, every read of a tensor's value into Python (``item``,
    ``float``, ``bool``, ``int``, ``tolist``), every Python number sent to a tensor
    (``torch.as_tensor`` / ``torch.tensor`` of a number: a host-to-device copy), and the
    collectives issued (name, device, dtype, numel)."""
    seen: dict[str, list] = {"reads": [], "uploads": [], "collectives": []}

    def read(name: str, original: Callable) -> Callable:
        def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            seen["reads"].append((name, self.device.type))
            return original(self, *args, **kwargs)

        return wrapped

    def upload(name: str, original: Callable) -> Callable:
        def wrapped(data: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(data, (int, float, bool)):
                seen["uploads"].append((name, data))
            return original(data, *args, **kwargs)

        return wrapped

    gathering = [False]

    def collective(name: str, original: Callable) -> Callable:
        def wrapped(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not gathering[0]:
                seen["collectives"].append((name, tensor.device.type, tensor.dtype, tensor.numel()))
            return original(tensor, *args, **kwargs)

        return wrapped

    def all_gather(original: Callable) -> Callable:
        """``comm.all_gather_into``, recorded as one collective (on gloo it is broadcasts)."""

        def wrapped(output: Any, *args: Any, **kwargs: Any) -> Any:
            seen["collectives"].append(
                ("all_gather_into", output.device.type, output.dtype, output.numel())
            )
            gathering[0] = True
            try:
                return original(output, *args, **kwargs)
            finally:
                gathering[0] = False

        return wrapped

    patches = [
        mock.patch.object(torch.Tensor, n, read(n, getattr(torch.Tensor, n))) for n in _HOST_READS
    ]
    patches += [
        mock.patch.object(torch, n, upload(n, getattr(torch, n))) for n in ("as_tensor", "tensor")
    ]
    patches += [
        mock.patch.object(dist, n, collective(n, getattr(dist, n)))
        for n in ("all_reduce", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor")
    ]
    patches.append(mock.patch.object(comm, "all_gather_into", all_gather(comm.all_gather_into)))
    for patch in patches:
        patch.start()
    try:
        yield seen
    finally:
        for patch in patches:
            patch.stop()


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)).to(dtype)


def _step_syncs(rank: int, dtype: torch.dtype, config: ZeroConfig) -> dict[str, list]:
    """What the second ``step()`` of a ``ZeroOptimizer`` reads and issues (the first
    agrees on the bucket order once)."""
    model = _mlp(dtype)
    opt = ZeroOptimizer(
        model.parameters(),
        config=config,
        flatten_config=FlattenConfig(bucket_numel=600, device="cpu", progress=False),
        lr=LR,
    )
    for step in range(2):
        opt.backward(model(_inputs(step, rank).to(dtype)).float().square().mean())
        if step == 0:
            opt.step()
            continue
        with _host_syncs() as seen:
            opt.step()
    opt.close()
    return seen


def _engine_syncs(rank: int, world_size: int, clipping: float) -> dict[str, Any]:
    """What the engine's second boundary ``step()`` reads and issues, and its norm."""
    import flatzero

    model = _mlp(torch.float32)
    config = {
        "train_batch_size": 4 * world_size,
        "train_micro_batch_size_per_gpu": 4,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "gradient_clipping": clipping,
        "flatzero": {"progress": False, "bucket_numel": 600},
    }
    engine, opt, _, _ = flatzero.initialize(model=model, config=config)
    for step in range(2):
        engine.backward(engine(_inputs(step, rank)).square().mean())
        if step == 0:
            engine.step()
            continue
        with _host_syncs() as seen:
            engine.step()
    seen["norm"] = engine.get_global_grad_norm()
    seen["optimizer_norm"] = opt.last_grad_norm
    engine.destroy()
    return seen


def _syncs_per_case(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "fp32": _step_syncs(rank, torch.float32, ZeroConfig()),
        "fp32_clip": _step_syncs(rank, torch.float32, ZeroConfig(max_grad_norm=0.1)),
        "bf16_clip": _step_syncs(rank, torch.bfloat16, ZeroConfig(max_grad_norm=0.1)),
        "fp16": _step_syncs(
            rank, torch.float16, ZeroConfig(max_grad_norm=0.1, loss_scale=LossScaleConfig())
        ),
        "engine": _engine_syncs(rank, world_size, clipping=0.0),
        "engine_clip": _engine_syncs(rank, world_size, clipping=0.1),
    }


def _two_rank_worker(rank: int, world_size: int) -> bytes:
    torch.set_num_threads(1)
    return _pack(
        {"staging": _staging(rank, world_size), "host_syncs": _syncs_per_case(rank, world_size)}
    )


def _three_rank_worker(rank: int, world_size: int) -> bytes:
    torch.set_num_threads(1)
    return _pack(_unused_params(rank, world_size))


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return [_unpack(b) for b in run_ranks(_two_rank_worker, 2, timeout_s=180)]


NORM_ALL_REDUCE = ("all_reduce", "cpu", torch.float64, 1)
"""The step's one collective besides the all-gather of the buckets: the squared norm."""


def test_no_host_sync_in_step(two_ranks):
    for result in two_ranks:
        item = result["host_syncs"]
        for case in ("fp32", "fp32_clip", "bf16_clip", "engine", "engine_clip"):
            seen = item[case]
            # The DeepSpeed door at fp32, stages 1 and 2, reads the inf/nan verdict once a
            # step, as DeepSpeed's ZeRO-1/2 does: a step with inf/nan gradients is skipped,
            # and so is the LR scheduler's step (the host must know). The PyTorch door never.
            expected = [("__bool__", "cpu")] if case.startswith("engine") else []
            assert seen["reads"] == expected, (case, seen["reads"])
            assert seen["uploads"] == [], (case, seen["uploads"])
            assert "all_gather_into" in {c[0] for c in seen["collectives"]}, case
            reductions = [c for c in seen["collectives"] if c[0] != "all_gather_into"]
            if case == "fp32":  # no clipping, no loss scaling: no norm at all
                assert reductions == [], (case, reductions)
            else:
                assert reductions == [NORM_ALL_REDUCE], (case, reductions)
        # fp16 loss scaling: one read, the inf/nan verdict that decides the skip.
        fp16 = item["fp16"]
        assert fp16["reads"] == [("__bool__", "cpu")], fp16["reads"]
        assert fp16["uploads"] == []
        assert [c for c in fp16["collectives"] if c[0] != "all_gather_into"] == [NORM_ALL_REDUCE]
    # The engine's norm is read when asked for: the global one (the same on every rank),
    # the optimizer's own when the step clips.
    for case in ("engine", "engine_clip"):
        norms = [r["host_syncs"][case]["norm"] for r in two_ranks]
        assert norms[0] > 0 and norms == [norms[0]] * len(norms), (case, norms)
    engine = two_ranks[0]["host_syncs"]["engine"]
    assert engine["optimizer_norm"] == engine["norm"]  # computed for the verdict
    assert two_ranks[0]["host_syncs"]["engine_clip"]["optimizer_norm"] == norms[0]


def test_norm_all_reduced_on_the_shards_device(monkeypatch):
    """The squared norm stays where the gradient shards are (here the meta device, as a
    stand-in for a GPU of a ``cpu:gloo,cuda:nccl`` group) and is all-reduced there."""
    import flatzero.optim.norm as norm

    issued = []
    monkeypatch.setattr(norm, "world_size_of", lambda group: 2)
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: issued.append((t.device, t.dtype)))
    shards = [torch.empty(100, device="meta"), torch.empty(7, device="meta")]
    sq = norm.global_sq_norm(shards, group=None)
    assert issued == [(torch.device("meta"), torch.float64)]
    assert sq.device == torch.device("meta") and sq.shape == ()
