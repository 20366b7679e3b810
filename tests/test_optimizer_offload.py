"""Optimizer offload (``ZeroConfig.offload_optimizer``, ZeRO-Offload) on CPU, gloo ranks.

Without an accelerator the offloaded optimizer's master shards and state are host memory
either way, so an offload run must give bitwise the losses and params of the same run
without offload: stages 1 and 2, bf16 and fp16 (loss scaling, an overflow skipped),
gradient accumulation, clipping, a model whose sizes divide by nothing, several buckets;
world sizes 1 and 2, one launch each. Checkpoints saved with offload load without it and
the reverse, at another world size. The device path (copies, streams, events) runs in
``tests/device/test_device_offload.py`` on the emulated accelerator (and CUDA); the router
sends the offload config to flatzero in ``tests/test_hf_patch.py``.
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import flatzero
from flatzero import FlattenConfig, OffloadConfig, ZeroConfig, ZeroOptimizer
from flatzero.launch import run_ranks
from flatzero.optim.offload import offload_host_bytes, state_floats

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
STEPS = 3
BUCKET = 320  # elements: several buckets, uneven slices


@dataclass(frozen=True)
class Case:
    """One training run, with and without optimizer offload."""

    stage: int
    dtype: str
    accumulation: int = 2
    clip: float | None = 0.5
    overflow_step: int | None = None  # fp16: this step's first micro-batch is inf, last rank
    optimizer: str = "AdamW"


WS1_CASES = (
    Case(stage=1, dtype="bf16"),
    Case(stage=2, dtype="fp16", overflow_step=1),
)
WS2_CASES = (
    Case(stage=1, dtype="fp16", overflow_step=1),
    Case(stage=2, dtype="bf16", accumulation=3),
    Case(stage=2, dtype="fp32", clip=None, optimizer="SGD"),
)


def make_model(dtype: torch.dtype, device: str | torch.device = "cpu") -> nn.Module:
    """An MLP whose sizes share no factor with the world size or the alignment."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 29), nn.Tanh(), nn.Linear(29, 31), nn.Tanh())
    model.append(nn.Linear(31, 7))
    return model.to(device=device, dtype=dtype)


def batch(step: int, micro: int, rank: int, dtype: torch.dtype, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(5, 13, generator=g).to(device=device, dtype=dtype)


def build(case: Case, model: nn.Module, offload: bool | OffloadConfig, device) -> ZeroOptimizer:
    optimizer = getattr(torch.optim, case.optimizer)
    kwargs = {"lr": 1e-2, "weight_decay": 0.01}
    if case.optimizer == "SGD":
        kwargs["momentum"] = 0.9
    return ZeroOptimizer(
        model,
        optimizer,
        stage=case.stage,
        config=ZeroConfig(max_grad_norm=case.clip, reduce_staging_bytes=2**12),
        flatten_config=FlattenConfig(device=str(device), bucket_numel=BUCKET, progress=False),
        offload_optimizer=offload,
        **kwargs,
    )


def train(
    case: Case, rank: int, offload: bool | OffloadConfig, device="cpu"
) -> tuple[list[float], dict[str, torch.Tensor], ZeroOptimizer]:
    """Losses (summed over micro-batches), the fp32 masters and the optimizer."""
    dtype = DTYPES[case.dtype]
    model = make_model(dtype, device)
    opt = build(case, model, offload, device)
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(case.accumulation):
            loss = model(batch(step, micro, rank, dtype, device)).float().pow(2).mean()
            loss = loss / case.accumulation
            if step == case.overflow_step and micro == 0 and rank == dist_last():
                loss = loss * float("inf")
            opt.backward(loss)
            total += float(loss.detach())
        opt.step()
        losses.append(float("nan") if opt.last_step_skipped else total)
    masters = {k: v.cpu() for k, v in opt.full_params().items()}
    return losses, masters, opt


def dist_last() -> int:
    import torch.distributed as dist

    return dist.get_world_size() - 1 if dist.is_initialized() else 0


def compare_worker(rank: int, world_size: int, cases: tuple[Case, ...]) -> list[str]:
    """Every case with and without offload; returns what differed (empty: nothing)."""
    problems = []
    for case in cases:
        plain = train(case, rank, False)
        off = train(case, rank, OffloadConfig(pin_memory=True, threads=1))
        opt = off[2]
        if str(plain[0]) != str(off[0]):  # nan for a skipped step
            problems.append(f"{case}: losses {plain[0]} != {off[0]}")
        for name, value in plain[1].items():
            if not torch.equal(value, off[1][name]):
                problems.append(f"{case}: master {name} differs")
        skipped = [step for step, loss in enumerate(off[0]) if loss != loss]
        if skipped != ([] if case.overflow_step is None else [case.overflow_step]):
            problems.append(f"{case}: skipped steps {skipped}")
        if opt.master_shards[0].device.type != "cpu" or opt.offload_optimizer is None:
            problems.append(f"{case}: master not in host memory")
        if opt.inner.param_groups[0].get("fused") is not True:
            problems.append(f"{case}: the host step is not torch's fused CPU kernel")
        measured = opt.offload_host_bytes()
        options = {"momentum": 0.9} if case.optimizer == "SGD" else {}
        predicted = offload_host_bytes(
            [g.layout.shard_numel for g in opt.flat.groups],
            state_floats(case.optimizer, options),
            pinned=False,
        )
        if measured != predicted:
            problems.append(f"{case}: host bytes {measured} != formula {predicted}")
        opt.close()
        plain[2].close()
    return problems


def test_offload_same_as_without_world_size_1():
    """In this process (no process group): bitwise."""
    assert compare_worker(0, 1, WS1_CASES) == []


def ws2_worker(rank: int, world_size: int, root: str) -> tuple[list[str], bytes]:
    """World size 2, one launch: the parity cases, then the checkpoints (the final masters
    as ``torch.save`` bytes: tensors cannot outlive their process in a queue)."""
    problems = compare_worker(rank, world_size, WS2_CASES)
    buffer = io.BytesIO()
    torch.save(save_worker(rank, world_size, root), buffer)
    return problems, buffer.getvalue()


@pytest.fixture(scope="module")
def ws2(tmp_path_factory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("offload")
    return root, run_ranks(ws2_worker, 2, str(root), timeout_s=90)


def test_offload_same_as_without_world_size_2(ws2):
    """Two gloo ranks: bitwise."""
    _, results = ws2
    assert [problems for problems, _ in results] == [[], []]


# --------------------------------------------------------------------- checkpoints
CKPT = Case(stage=2, dtype="fp32", accumulation=1, clip=1.0)


def save_worker(rank: int, world_size: int, root: str) -> dict[str, dict[str, torch.Tensor]]:
    """At world size 2: train 2 steps with and without offload, save each, train 2 more;
    returns the final masters of both."""
    out = {}
    for name, offload in (("offload", True), ("plain", False)):
        model = make_model(torch.float32)
        opt = build(CKPT, model, offload, "cpu")
        for step in range(4):
            if step == 2:
                flatzero.save_checkpoint(Path(root) / name, opt, tag="t")
            model(batch(step, 0, rank, torch.float32, "cpu")).pow(2).mean().backward()
            opt.step()
        out[name] = opt.full_params()
        opt.close()
    return out


def load_and_continue(root: Path, saved: str, offload: bool) -> dict[str, torch.Tensor]:
    """At world size 1: load ``saved``, train the last 2 steps on both ranks' data at once
    (the mean over 2 ranks' equal micro-batches is the mean over their concatenation)."""
    model = make_model(torch.float32)
    opt = build(CKPT, model, offload, "cpu")
    flatzero.load_checkpoint(root / saved, opt, tag="t")
    for step in (2, 3):
        data = torch.cat([batch(step, 0, r, torch.float32, "cpu") for r in (0, 1)])
        model(data).pow(2).mean().backward()
        opt.step()
    params = opt.full_params()
    opt.close()
    return params


def test_checkpoint_loads_across_offload_and_world_size(ws2):
    """Saved at world size 2 with offload, loaded at 1 without, and the reverse: the run
    continues as the world-size-2 run did (fp32 reduction-order tolerance)."""
    root, results = ws2
    finals = torch.load(io.BytesIO(results[0][1]))
    for saved, offload in (("offload", False), ("plain", True)):
        got = load_and_continue(root, saved, offload)
        for name, value in finals[saved].items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


# --------------------------------------------------------------------- bad input
class _DeviceOnly(torch.optim.SGD):
    """An optimizer whose kernel refuses host tensors (as a CUDA-only fused one does)."""

    def step(self, closure=None):
        if any(p.device.type == "cpu" for g in self.param_groups for p in g["params"]):
            raise RuntimeError("this kernel runs on CUDA tensors only")
        return super().step(closure)


def test_optimizer_without_a_host_kernel_is_refused_before_flattening():
    model = make_model(torch.float32)
    before = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(TypeError, match="_DeviceOnly cannot step tensors in host memory"):
        ZeroOptimizer(
            model, _DeviceOnly, lr=0.1, offload_optimizer=True, elementwise_optimizer=True
        )
    assert [p.data_ptr() for p in model.parameters()] == before  # nothing flattened
    ZeroOptimizer(model, _DeviceOnly, lr=0.1, elementwise_optimizer=True).close()  # no offload


def _offload_config(device: str = "cpu", stage: int = 2) -> dict:
    return {
        "train_batch_size": 2,
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": device}},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }


def test_client_optimizer_without_a_host_kernel_is_refused_by_initialize():
    model = make_model(torch.float32)
    client = _DeviceOnly(model.parameters(), lr=0.1)
    config = {**_offload_config(), "flatzero": {"elementwise_optimizer": True}}
    del config["optimizer"]
    with pytest.raises(TypeError, match="cannot step tensors in host memory"):
        flatzero.initialize(model=model, optimizer=client, config=config)


def test_nvme_is_deepspeeds_and_says_so_when_it_is_missing(monkeypatch):
    with pytest.raises(flatzero.UnsupportedFeatureError, match="patch_deepspeed") as found:
        flatzero.initialize(model=make_model(torch.float32), config=_offload_config("nvme"))
    assert found.value.key == "zero_optimization.offload_optimizer.device"
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # not installed
    with pytest.raises(flatzero.UnsupportedFeatureError, match="pip install deepspeed"):
        flatzero.initialize(model=make_model(torch.float32), config=_offload_config("nvme"))


def test_deepspeed_door_offload_config_and_getters():
    """The DeepSpeed door takes offload_optimizer (and the older cpu_offload) at stages 1
    and 2; the getters say so; param offload stays refused."""
    model = make_model(torch.float32)
    config = _offload_config()
    config["zero_optimization"]["offload_optimizer"].update(pin_memory=True, buffer_count=4)
    engine, opt, *_ = flatzero.initialize(model=model, config=config)
    assert engine.zero_offload_optimizer() == OffloadConfig(pin_memory=True)
    assert engine.zero_cpu_offload() is True and engine.zero_offload_param() is False
    assert opt.master_shards[0].device.type == "cpu" and opt.offload_optimizer is not None
    assert any("buffer_count" in k for k, _ in engine.parsed_config.ignored)
    engine.destroy()
    legacy = {**config, "zero_optimization": {"stage": 1, "cpu_offload": True}}
    engine, opt, *_ = flatzero.initialize(model=make_model(torch.float32), config=legacy)
    assert engine.zero_offload_optimizer() == OffloadConfig(pin_memory=False)
    engine.destroy()
    plain = {**config, "zero_optimization": {"stage": 2}}
    engine, *_ = flatzero.initialize(model=make_model(torch.float32), config=plain)
    assert engine.zero_offload_optimizer() is None and engine.zero_cpu_offload() is False
    engine.destroy()
    param = {**config, "zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
    with pytest.raises(flatzero.UnsupportedFeatureError, match="offload the params"):
        flatzero.initialize(model=make_model(torch.float32), config=param)
    with pytest.raises(flatzero.UnsupportedFeatureError, match="stage 1 or 2"):
        flatzero.initialize(model=make_model(torch.float32), config=_offload_config(stage=0))


def test_offload_argument_is_checked():
    with pytest.raises(TypeError, match="offload_optimizer must be"):
        ZeroOptimizer(make_model(torch.float32), offload_optimizer="cpu")
    with pytest.raises(ValueError, match=r"OffloadConfig\.threads"):
        OffloadConfig(threads=0)
    with pytest.raises(TypeError, match=r"ZeroConfig\.offload_optimizer"):
        ZeroConfig(offload_optimizer=True)


# ------------------------------------------------- copy ordering through a fake device
class _AsyncDevice:
    """Stand-ins for the device seam's streams, events and pinning that play CUDA's rules
    for host memory: a ``non_blocking`` copy is in flight until an event recorded after it
    on its stream is synchronized; a host write or an unpin touching the bytes of a copy
    still in flight is a hazard (copies happen at once on the CPU)."""

    def __init__(self) -> None:
        self.stream = "current"
        self.inflight: list[tuple[str, list[tuple[int, int]]]] = []
        self.hazards: list[str] = []
        self.unpinned = 0
        self.copies: list[tuple[str, bool]] = []  # (stream, non_blocking) of every copy_

    @staticmethod
    def span(t: torch.Tensor) -> tuple[int, int]:
        return t.data_ptr(), t.data_ptr() + t.nbytes

    def touching(self, lo: int, hi: int) -> list[str]:
        return [s for s, spans in self.inflight if any(a < hi and lo < b for a, b in spans)]

    def install(self, monkeypatch) -> None:
        import contextlib

        from flatzero import accel
        from flatzero.optim import offload as offload_module

        dev = self

        class Stream:
            name = "side"

            def wait_stream(self, other: str) -> None:
                pass  # device-side order; this fake checks the host's

        class Event:
            def __init__(self, device=None, blocking: bool = False) -> None:
                self.ops: list = []

            def record(self, stream) -> None:
                name = getattr(stream, "name", stream)
                self.ops = [op for op in dev.inflight if op[0] == name]

            def synchronize(self) -> None:
                dev.inflight = [op for op in dev.inflight if all(op is not o for o in self.ops)]

        @contextlib.contextmanager
        def use_stream(stream):
            dev.stream = stream.name
            try:
                yield
            finally:
                dev.stream = "current"

        real_copy = torch.Tensor.copy_

        def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False):
            dev.copies.append((dev.stream, non_blocking))
            if non_blocking:
                dev.inflight.append((dev.stream, [dev.span(dst), dev.span(src)]))
            elif dev.touching(*dev.span(dst)):
                dev.hazards.append(f"host write while {dev.touching(*dev.span(dst))} copy")
            return real_copy(dst, src, non_blocking=non_blocking)

        def unpin_host(t: torch.Tensor) -> None:
            dev.unpinned += 1
            if dev.touching(*dev.span(t)):
                dev.hazards.append(f"unpinned while a {dev.touching(*dev.span(t))} copy")

        monkeypatch.setattr(offload_module, "_REGISTER_MIN_BYTES", 0)
        monkeypatch.setattr(accel, "is_accelerator", lambda device: True)
        monkeypatch.setattr(accel, "has_streams", lambda device: True)
        monkeypatch.setattr(accel, "new_stream", lambda device: Stream())
        monkeypatch.setattr(accel, "new_event", Event)
        monkeypatch.setattr(accel, "current_stream", lambda device=None: "current")
        monkeypatch.setattr(accel, "use_stream", use_stream)
        monkeypatch.setattr(accel, "pin_host", lambda t: True)
        monkeypatch.setattr(accel, "unpin_host", unpin_host)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)


def _flat_for_offload() -> tuple:
    """CPU ``FlatParams`` (several buckets), gradient shards, masters and master slices."""
    flat = flatzero.flatten_parameters(
        make_model(torch.bfloat16),
        config=FlattenConfig(device="cpu", bucket_numel=BUCKET, progress=False),
    )
    grads = [torch.randn(g.layout.shard_numel) for g in flat.groups]
    masters = [g.master for g in flat.groups]
    slices = [g.master_slice(b) for g in flat.groups for b in range(len(g.buckets))]
    return flat, grads, masters, slices


def test_offload_host_copies_are_waited_for_before_host_writes_and_unpinning(monkeypatch):
    """Against CUDA's rules for page-locked memory (``_AsyncDevice``): the step's order is
    clean; a load right after a backward pass (``ZeroOptimizer._load``: the window's reset
    lands the last reductions, whose buckets' copies to the host start, then ``upload``
    rewrites the host gradient shards' memory) waits for those copies first; and dropping
    the optimizer while its upload is in flight unpins nothing before the upload is done."""
    import gc

    from flatzero.optim.offload import HostOffload

    flat, grads, masters, slices = _flat_for_offload()
    dev = _AsyncDevice()
    dev.install(monkeypatch)
    offload = HostOffload(flat, grads, OffloadConfig(pin_memory=True), threads=1)
    buckets = len(slices)
    assert offload.pinned and buckets > 1
    # A step: copies during backward and at the step, the coefficient, wait, upload.
    for b in range(buckets - 1):
        offload.chunk_landed(b, complete=True)
    assert dev.copies == [("side", True)] * (buckets - 1)  # overlapping backward
    offload.download()
    assert dev.copies == [("side", True)] * buckets  # only the bucket not copied yet
    offload.to_host(torch.tensor(0.5))
    offload.wait()
    assert all(torch.equal(h, g) for h, g in zip(offload.host_grads, grads, strict=True))
    host = [dev.span(g) for g in offload.host_grads]
    assert not [s for lo, hi in host for s in dev.touching(lo, hi)]  # the inner step reads
    offload.upload(masters, slices)
    assert dev.hazards == []
    # A load after the next backward pass: every bucket's copy in flight, then the upload.
    for b in range(buckets):
        offload.chunk_landed(b, complete=True)
    offload.upload(masters, slices)
    assert dev.hazards == []
    # Dropped with the upload in flight (it reads the page-locked staging).
    assert dev.touching(*host[0])
    del offload
    gc.collect()
    assert dev.unpinned > 0 and dev.hazards == []


def test_offload_pageable_fallback_copies_at_the_step_with_one_warning(monkeypatch, caplog):
    """Pinning refused: pageable host memory, one warning, and no copy during backward (a
    copy to pageable memory would block the host until the device drained its queue, per
    bucket and backward pass): every bucket is copied at the step, synchronously."""
    from flatzero import accel
    from flatzero.optim.offload import HostOffload

    flat, grads, *_ = _flat_for_offload()
    dev = _AsyncDevice()
    dev.install(monkeypatch)
    monkeypatch.setattr(accel, "pin_host", lambda t: False)
    monkeypatch.setattr(accel, "pinned_empty", lambda nbytes: None)
    with caplog.at_level("WARNING", logger="flatzero.optim.offload"):
        offload = HostOffload(flat, grads, OffloadConfig(pin_memory=True), threads=1)
    assert not offload.pinned and len(caplog.records) == 1
    buckets = sum(len(g.buckets) for g in flat.groups)
    for _ in range(2):  # two backward passes of an accumulation window
        for b in range(buckets):
            offload.chunk_landed(b, complete=True)
    assert dev.copies == []
    offload.download()
    offload.wait()
    assert dev.copies == [("side", False)] * buckets
    assert all(torch.equal(h, g) for h, g in zip(offload.host_grads, grads, strict=True))
