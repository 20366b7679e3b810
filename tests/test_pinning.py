"""Page-locked host buffers (``hostmem.page_locked``, the seam's ``pin_host``) against a
recording fake of the runtime (issue 41, items 3, 4 and 8): registered in the context of
the device they serve, never inherited by a forked child, a refused registration's latched
error cleared."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest
import torch

from flatzero import OffloadConfig, accel
from flatzero.hostmem import page_locked
from test_optimizer_offload import _AsyncDevice, _flat_for_offload


class _Runtime:
    """``torch.cuda.cudart()`` and ``torch.cuda`` as the seam sees them: each register and
    unregister call logged with the device current at the call."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.current = 0
        self.calls: list[tuple[str, int]] = []
        self.cleared = 0

    def cudart(self) -> _Runtime:
        return self

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.calls.append(("register", self.current))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.calls.append(("unregister", self.current))
        return 0

    def current_device(self) -> int:
        return self.current

    def synchronize(self, device: torch.device | None = None) -> None:
        self.calls.append(("synchronize", self.current))

    @contextlib.contextmanager
    def device(self, device: torch.device) -> Iterator[None]:
        before, self.current = self.current, device.index
        try:
            yield
        finally:
            self.current = before


@pytest.fixture
def runtime(monkeypatch) -> _Runtime:
    fake = _Runtime()
    monkeypatch.setattr(accel, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(accel, "device_module", lambda device: fake)
    monkeypatch.setattr(accel, "pinned_empty", lambda nbytes: None)
    return fake


def test_host_memory_is_registered_in_the_context_of_the_device_it_serves(runtime):
    """Item 8: rank 3 of a script that never called ``set_device`` (current device 0)
    registers its buffers with device 3 current, never creating a context on device 0."""
    buffer = page_locked(1 << 16, device=torch.device("cuda", 3))
    assert buffer.registered
    buffer.release()
    assert runtime.calls == [("register", 3), ("synchronize", 3), ("unregister", 3)]
    assert accel.pinned_bytes() == 0


def test_a_dropped_buffer_is_unregistered_before_its_pages_go(runtime):
    """Item 7's mechanism: a registered buffer nobody released is unregistered when its
    ``StagingBuffer`` goes (before the mapping is unmapped)."""
    buffer = page_locked(1 << 16, device=torch.device("cuda", 1))
    assert accel.pinned_bytes() == 1 << 16
    del buffer
    assert runtime.calls == [("register", 1), ("synchronize", 1), ("unregister", 1)]
    assert accel.pinned_bytes() == 0


def test_a_refused_registration_clears_the_latched_error(runtime, monkeypatch):
    """Item 3: the runtime's error is cleared at once (torch's binding leaves it latched,
    and the next kernel launch would raise it), through the loaded runtime library's
    ``cudaGetLastError`` where the runtime object has none."""
    runtime.code = 712
    cleared: list[int] = []
    monkeypatch.setattr(accel, "_loaded_get_last_error", lambda: lambda: cleared.append(1))
    buffer = page_locked(1 << 16, device=torch.device("cuda", 0))
    assert not buffer.pinned and cleared == [1]
    assert accel.pinned_bytes() == 0


def _mapped_in_child(addresses: list[int]) -> list[bool]:
    """For each address: whether a forked child has it mapped (``/proc/self/maps``)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: answer and leave at once
        ranges = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi))
        answer = "".join("1" if any(lo <= a < hi for lo, hi in ranges) else "0" for a in addresses)
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    answer = os.read(read, 4096).decode()
    os.close(read)
    os.waitpid(pid, 0)
    return [c == "1" for c in answer]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux only")
def test_offload_gradient_shards_are_not_inherited_by_a_forked_child(monkeypatch):
    """Item 4: optimizer offload's page-locked host gradient shards are ``MADV_DONTFORK``
    (a DataLoader worker forked after would copy every page-locked page), as the staging
    slots and the snapshot are: all come from ``hostmem.page_locked``."""
    from flatzero.optim import offload as offload_module

    flat, grads, *_ = _flat_for_offload()
    _AsyncDevice().install(monkeypatch)
    off = offload_module.HostOffload(flat, grads, OffloadConfig(pin_memory=True), threads=1)
    assert off.pinned
    addresses = [g.data_ptr() for g in off.host_grads]
    mine = torch.empty(1 << 20, dtype=torch.uint8)  # ordinary memory: the child has it
    assert _mapped_in_child([*addresses, mine.data_ptr()]) == [False] * len(addresses) + [True]


def test_every_registration_goes_through_page_locked():
    """Item 4, in one place: no module but the seam and ``hostmem`` calls ``pin_host``."""
    from pathlib import Path

    import flatzero

    root = Path(flatzero.__file__).parent
    callers = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "pin_host(" in p.read_text() and p.name not in ("accel.py", "hostmem.py")
    )
    assert callers == [], callers


def test_frozen_params_are_snapshotted_like_the_shards_not_before_the_save_returns():
    """Item 9: in an asynchronous save, the model's frozen params are copied as the master
    and state shards are (by the background thread, or the next step's fence), not before
    ``save_checkpoint`` returns; its buffers (a forward pass changes them) are."""
    from flatzero.checkpoint.async_save import snapshot
    from flatzero.checkpoint.checkpointer import Checkpointer

    shard, frozen, buffer = torch.ones(1000), torch.full((1000,), 2.0), torch.full((10,), 3.0)
    files = [
        ("rank", [("master", shard)], None),
        ("rest", [("frozen.weight", frozen), ("norm.running_mean", buffer)], None),
    ]
    images, staging = snapshot(Checkpointer(), files, deferrable=[True, {"frozen.weight"}])
    rest = images[1].data

    def values(image_data: torch.Tensor, start: int, numel: int) -> torch.Tensor:
        return image_data[4 * start : 4 * (start + numel)].view(torch.float32)

    assert torch.equal(values(rest, 1000, 10), buffer)  # copied before the save returned
    assert not values(rest, 0, 1000).any() and not values(images[0].data, 0, 1000).any()
    staging.copy_host()  # the background thread's part
    assert torch.equal(values(rest, 0, 1000), frozen)
    assert torch.equal(values(images[0].data, 0, 1000), shard)


def test_offload_waits_sleep_rather_than_spin(monkeypatch):
    """Item 10: the offload's events are blocking (a host wait on one sleeps; a spinning
    wait takes a core from the host step of this rank or a neighbour)."""
    from flatzero.optim import offload as offload_module

    flat, grads, *_ = _flat_for_offload()
    _AsyncDevice().install(monkeypatch)
    inner, made = accel.new_event, []

    def new_event(device: torch.device, **kwargs: bool):
        made.append(kwargs.get("blocking", False))
        return inner(device, **kwargs)

    monkeypatch.setattr(accel, "new_event", new_event)
    offload_module.HostOffload(flat, grads, OffloadConfig(pin_memory=True), threads=1)
    assert made and all(made), made


def test_the_latched_error_is_cleared_in_torchs_own_runtime(monkeypatch):
    """Review of issue 41, finding 7: with a conda copy of the CUDA runtime mapped beside
    torch's, the error is cleared through torch's library (whose handle's lookup reaches the
    runtime torch uses), not the first ``libcudart`` in sorted order."""
    opened: list[str] = []

    class _Library:
        def __init__(self, path: str, mode: int) -> None:
            opened.append(path)
            self.cudaGetLastError = path

    monkeypatch.setattr(
        accel,
        "_mapped_libraries",
        lambda: {
            "/conda/lib/libcudart.so.12",
            "/venv/torch/lib/libtorch_cuda.so",
            "/venv/nvidia/cuda_runtime/lib/libcudart.so.12",
        },
    )
    monkeypatch.setattr(accel.ctypes, "CDLL", _Library)
    accel._loaded_get_last_error.cache_clear()
    try:
        assert accel._loaded_get_last_error() == "/venv/torch/lib/libtorch_cuda.so"
    finally:
        accel._loaded_get_last_error.cache_clear()


def test_a_sticky_error_is_raised_not_taken_for_a_refusal(runtime):
    """Review of issue 41, finding 7: only a refusal (1, 2, 712, 801) falls back to
    pageable memory; an illegal address (700, sticky: the device is unusable) raises."""
    runtime.code = 700
    with pytest.raises(RuntimeError, match="runtime error 700"):
        page_locked(1 << 16, device=torch.device("cuda", 0))
    assert accel.pinned_bytes() == 0


def test_a_buffer_is_unregistered_only_after_the_copies_queued_before(runtime):
    """Review of issue 41, finding 8: a copy still in flight when the buffer is dropped
    would use pages no longer page-locked (then unmapped): the device's queued work is
    waited for first."""
    buffer = page_locked(1 << 16, device=torch.device("cuda", 2))
    del buffer
    assert runtime.calls == [("register", 2), ("synchronize", 2), ("unregister", 2)]


def test_a_forked_child_dropping_a_buffer_leaves_the_runtime_alone(runtime, monkeypatch):
    """Review of issue 41, finding 9: the finalizer runs in a forked child too (its copy of
    the object is dropped there); it must not call CUDA nor unregister the parent's range."""
    buffer = page_locked(1 << 16, device=torch.device("cuda", 1))
    real = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: real + 1)  # as in the child
    del buffer
    assert runtime.calls == [("register", 1)]
    monkeypatch.undo()
    accel._pinned_pages.clear()  # the fake's range: the parent would unpin it
