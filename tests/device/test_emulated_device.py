"""The emulated accelerator itself: the device tests are only as good as its semantics."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from flatzero import accel
from flatzero.testing import emulated

from .harness import launch


def _semantics_worker(rank: int, world_size: int, kind: str) -> dict:
    dev = torch.device("emu", 0)
    state = emulated.installed()
    checks: dict[str, bool] = {}
    x = torch.arange(12.0).reshape(3, 4)
    e = x.to(dev)
    checks["round trip"] = torch.equal(e.cpu(), x) and e.device == dev
    view = e[1:, ::2]
    view.mul_(-1)  # in place through a strided view: the base sees it
    expected = x.clone()
    expected[1:, ::2] *= -1
    checks["views write through"] = torch.equal(e.cpu(), expected) and view._base is e
    out = torch.empty(0, device=dev)
    torch.add(e, 1, out=out)  # out= resized by the kernel
    checks["out= resized"] = torch.equal(out.cpu(), expected + 1)
    values, indices = torch.empty(0, device=dev), torch.empty(0, dtype=torch.long, device=dev)
    torch.max(e, 1, out=(values, indices))
    checks["named outs"] = torch.equal(indices.cpu(), expected.max(1).indices)
    try:
        e + x
        checks["mixed devices refused"] = False
    except RuntimeError as error:
        checks["mixed devices refused"] = "same device" in str(error)
    checks["host indices allowed"] = torch.equal(e[torch.tensor([0, 2])].cpu(), expected[[0, 2]])
    gc.collect()
    before = accel.memory_allocated(dev)
    accel.reset_peak_memory_stats(dev)
    big = torch.empty(1000, device=dev)
    checks["counted"] = accel.memory_allocated(dev) - before == 4000
    del big
    gc.collect()
    checks["freed"] = accel.memory_allocated(dev) == before
    checks["peak kept"] = accel.max_memory_allocated(dev) - before == 4000
    state.set_capacity(before + 100)
    try:
        torch.empty(26, device=dev)
        checks["capacity"] = False
    except torch.OutOfMemoryError:
        checks["capacity"] = accel.mem_get_info(dev)[0] == 100
    state.set_capacity(1 << 30)
    stream, event = accel.new_stream(dev), accel.new_event(dev)
    with accel.use_stream(stream):
        y = e * 2
    event.record(stream)
    accel.current_stream(dev).wait_event(event)
    y.record_stream(stream)
    checks["streams run"] = isinstance(stream, torch.Stream) and torch.equal(y.cpu(), expected * 2)
    t = torch.full((5,), float(rank + 1), device=dev)
    dist.all_reduce(t)
    gathered = torch.empty(5 * world_size, device=dev)
    dist.all_gather_into_tensor(gathered, torch.full((5,), float(rank), device=dev))
    shard = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(shard, torch.arange(2.0 * world_size, device=dev))
    total = world_size * (world_size + 1) / 2
    checks["all_reduce"] = torch.equal(t.cpu(), torch.full((5,), total))
    checks["all_gather"] = torch.equal(
        gathered.cpu(), torch.arange(world_size).repeat_interleave(5).float()
    )
    checks["reduce_scatter"] = torch.equal(
        shard.cpu(), torch.arange(2.0 * rank, 2.0 * rank + 2) * world_size
    )
    linear = torch.nn.Linear(4, 4)
    linear.weight = torch.nn.Parameter(linear.weight.detach().clone())
    tied = torch.nn.Sequential(linear, torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    tied.to(dev)
    checks["ties kept by module.to"] = tied[0].weight is tied[1].weight
    return checks


def test_emulated_device_semantics_memory_streams_and_collectives():
    for checks in launch("emu", _semantics_worker, 2, capacity_bytes=1 << 30):
        assert all(checks.values()), [name for name, ok in checks.items() if not ok]
