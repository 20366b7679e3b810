"""An asynchronous save of state on an accelerator: the snapshot's copies and their fence.

With the master and optimizer state in device memory, ``save_checkpoint(...,
asynchronous=True)`` copies them into its host buffer on a side stream of the device and
returns without a device-wide synchronize (the old snapshot synchronized once per device);
the background thread waits on the copies' event, and the next step's inner update is
queued after them (``Staging.fence``: the current stream waits on the event, no host
sync). The step right after the save must not reach the snapshot: the checkpoint loads
back bit for bit as the state was at the call.

``async_save_problems`` runs inside the world-size-1 launch of
``test_device_optimizer.py::test_zero_1_and_2_on_the_device_match_adamw`` (a launch costs
more than the work), which asserts it found nothing wrong. One rank: the save's rank
meetings are point-to-point messages on the control group, which the emulated backend's
group does not pass (they hang there); the copies and the fence are per rank.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from flatzero import accel
from flatzero.checkpoint import load_checkpoint, save_checkpoint
from flatzero.checkpoint.checkpointer import wait_for_save
from test_optimizer_offload import Case, batch, build, make_model

from .harness import this_device

CASE = Case(stage=2, dtype="fp32", clip=None)


def _state(opt: Any) -> dict[str, torch.Tensor]:
    """Host copies of this rank's master and state shards."""
    out = {}
    for gi, group in enumerate(opt.sharded_state().groups):
        out[f"{gi}.master"] = group.master.cpu().clone()
        out |= {f"{gi}.{k}": v.cpu().clone() for k, v in group.shards.items()}
    return out


def _step(model: torch.nn.Module, opt: Any, step: int, rank: int, device: torch.device) -> None:
    opt.backward(model(batch(step, 0, rank, torch.float32, device)).pow(2).mean())
    opt.step()


def async_save_problems(rank: int, world_size: int, kind: str) -> list[str]:
    """What went wrong with an asynchronous save of device state on this rank (empty:
    nothing). Restores the device seam functions it wraps."""
    device = this_device(kind)
    root = Path(tempfile.mkdtemp(prefix="flatzero-device-async-"))
    model = make_model(torch.float32, device)
    opt = build(CASE, model, False, device)
    for step in range(2):
        _step(model, opt, step, rank, device)
    problems = []
    if {t.device.type for t in opt.master_shards} != {device.type}:
        problems.append(f"masters not on {device.type}: the test would not test the device path")
    at_save = _state(opt)
    calls: dict[str, int] = {}
    originals = {n: getattr(accel, n) for n in ("synchronize", "new_event")}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return originals[name](*args, **kwargs)

        return call

    accel.synchronize, accel.new_event = counted("synchronize"), counted("new_event")
    try:
        save_checkpoint(root, opt, tag="a", asynchronous=True)
    finally:
        accel.synchronize, accel.new_event = originals["synchronize"], originals["new_event"]
    if calls != {"new_event": 1}:
        problems.append(f"the save call's seam calls: {calls} (one event, no synchronize)")
    _step(model, opt, 2, rank, device)  # at once: the fence orders it after the copies
    wait_for_save(opt)
    if _state(opt).keys() != at_save.keys() or all(
        torch.equal(v, at_save[k]) for k, v in _state(opt).items()
    ):
        problems.append("the step after the save changed nothing: the test tests nothing")
    fresh = build(CASE, make_model(torch.float32, device), False, device)
    load_checkpoint(root, fresh, "a")
    loaded = _state(fresh)
    differ = [k for k, v in at_save.items() if not torch.equal(loaded.get(k), v)]
    if differ or loaded.keys() != at_save.keys():
        problems.append(f"the checkpoint is not the state at the call: {differ or loaded.keys()}")
    opt.close()
    fresh.close()
    shutil.rmtree(root, ignore_errors=True)
    return problems
