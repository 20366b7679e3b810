"""Page-locking host memory on the emulated device, whose ``cudart()`` keeps CUDA's rules
([Note: emulated registration]): a refused registration latches its error until
``cudaGetLastError``, and two registrations of one page fail with 712 (issue 41, item 3).
"""

from __future__ import annotations

from typing import Any

import torch

from flatzero import FlattenConfig, accel, flatten_parameters
from flatzero.hostmem import mapped_host
from flatzero.testing import emulated
from flatzero.testing.emulated.pinning import OUT_OF_MEMORY

from .harness import UnevenNet, host_copy, launch, this_device, unchanged


def _refused_worker(rank: int, world_size: int, kind: str) -> dict[str, Any]:
    registry = emulated.installed().host_registry
    registry.refuse = 1  # the system's page-locked limit, at the first slot
    model = UnevenNet()
    before = host_copy(model)
    flat = flatten_parameters(
        model, config=FlattenConfig(bucket_numel=1024, progress=False, device=kind, tier="host")
    )
    after_flatten = registry.last_error
    # then the next op on the device runs: nothing latched is left to raise there
    total = float(sum(b.float().sum() for g in flat.groups for b in g.buckets).cpu())
    page = mapped_host(3 * 4096)  # may reuse the flatten's freed slots' addresses
    first, overlapping, unaligned = page[:5000], page[4096:], page[100:200]
    probed_from = len(registry.calls)
    pinned = [accel.pin_host(first), accel.pin_host(overlapping), accel.pin_host(unaligned)]
    probe_registers = [c for c in registry.calls[probed_from:] if c[0] == "register"]
    accel.unpin_host(first)
    still_registered = registry.registered_bytes()
    registry.cudaHostRegister(first.data_ptr(), 10, 1)
    registry.cudaHostRegister(first.data_ptr(), 10, 1)  # the same page again: 712, latched
    try:
        torch.ones(2, device=this_device(kind)).add_(1)
        latched = "nothing raised"
    except RuntimeError as error:
        latched = str(error)
    return {
        "latched raised at the next op": latched,
        "tiers": flat.report.tiers,
        "changed": unchanged(model, before),
        "latched after the flatten": after_flatten,
        "finite": total == total,
        "registers": [c for c in registry.calls if c[0] == "register"],
        "probe registers": probe_registers,
        "first": first.data_ptr(),
        "pinned": pinned,
        "still registered": still_registered,
        "on": this_device(kind).type,
    }


def test_a_refused_registration_falls_back_without_a_latched_error():
    (r,) = launch("emu", _refused_worker, 1, host_registration=True)
    assert set(r["tiers"]) == {"host"} and r["changed"] == [] and r["finite"]
    assert r["latched after the flatten"] == 0
    # The ring's first slot was refused (out of memory); the others registered; all freed.
    assert len(r["registers"]) >= 2
    # Of the three ranges, only the first is asked for: the second shares its last page,
    # the third starts inside a page; neither reaches the runtime.
    assert r["pinned"] == [True, False, False]
    assert r["probe registers"] == [("register", r["first"], 5000)]
    assert r["still registered"] == 0
    assert OUT_OF_MEMORY == 2
    # and the emulated runtime does latch: the raw binding's 712 raises at the next op
    assert "712" in r["latched raised at the next op"]


def _snapshot_worker(rank: int, world_size: int, kind: str) -> dict[str, int]:
    """An asynchronous save of device state pins its snapshot; then the snapshot is
    unpinned by ``engine.destroy()`` and, without it, when the optimizer goes away."""
    import gc
    import tempfile
    from types import SimpleNamespace

    from flatzero.checkpoint import save_checkpoint
    from flatzero.checkpoint.checkpointer import wait_for_save
    from flatzero.deepspeed.engine.engine import Engine

    from .test_device_async_save import CASE, _step, build, make_model

    registry = emulated.installed().host_registry
    device = this_device(kind)
    seen = {}
    for how in ("destroy", "dropped"):
        model = make_model(torch.float32, device)
        opt = build(CASE, model, False, device)
        _step(model, opt, 0, rank, device)
        root = tempfile.mkdtemp(prefix="flatzero-snapshot-")
        save_checkpoint(root, opt, tag="a", asynchronous=True)
        wait_for_save(opt)
        seen[f"{how}: saved"] = registry.registered_bytes()
        if how == "destroy":
            engine = SimpleNamespace(
                _destroyed=False,
                wait_for_save=lambda: None,
                optimizer=opt,
                _user_backward=SimpleNamespace(close=lambda: None),
                _preemption=None,
                _unused_check=None,
            )
            Engine.destroy(engine)  # type: ignore[arg-type]
            seen["destroy: after"] = registry.registered_bytes()
        else:
            opt.close()
            del opt
            gc.collect()
            seen["dropped: after"] = registry.registered_bytes()
    return seen


def test_the_snapshot_is_unpinned_on_destroy_and_when_the_optimizer_goes():
    """Item 7 (reproduced: the snapshot stayed registered, its pages already unmapped,
    after the optimizer was freed; ``engine.destroy()`` kept it too)."""
    (seen,) = launch("emu", _snapshot_worker, 1, host_registration=True)
    assert seen["destroy: saved"] > 0 and seen["dropped: saved"] > 0, seen
    assert seen["destroy: after"] == 0 and seen["dropped: after"] == 0, seen
