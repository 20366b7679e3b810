"""The device seam against backend modules that offer less than ``torch.cuda``: what it
calls, what it answers without a function, and how it reads a group's backends."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from flatzero import accel, devices


class _SparseModule:
    """A backend module as a small out-of-tree accelerator may ship it: memory counters
    that take a device, a ``synchronize`` that takes none, no caching allocator, no
    streams."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))

    def memory_allocated(self, device=None) -> int:
        self.calls.append(("memory_allocated", device))
        return 300

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return 700, 1000


@pytest.fixture
def sparse(monkeypatch) -> _SparseModule:
    module = _SparseModule()
    monkeypatch.setattr(accel, "device_module", lambda device: module)
    return module


def test_functions_are_called_with_the_device_only_where_they_take_one(sparse):
    device = torch.device("cuda", 1)  # any accelerator type: the module is faked
    accel.synchronize(device)
    assert accel.memory_allocated(device) == 300
    assert sparse.calls == [("synchronize",), ("memory_allocated", device)]


def test_missing_functions_answer_what_is_true_without_them(sparse):
    device = torch.device("cuda", 0)
    assert accel.memory_reserved(device) == 300  # no caching allocator: reserved == allocated
    assert accel.max_memory_allocated(device) == 0
    accel.reset_peak_memory_stats(device)
    accel.empty_cache(device)
    assert accel.total_memory(device) == 1000
    assert accel.device_name(device) == "cuda"
    assert not accel.has_streams(device)


def test_host_devices_never_reach_a_device_module(monkeypatch):
    def refuse(device):
        raise AssertionError(f"device module asked for {device}")

    monkeypatch.setattr(accel, "device_module", refuse)
    cpu = torch.device("cpu")
    accel.synchronize(cpu)
    accel.empty_cache(cpu)
    accel.reset_peak_memory_stats(cpu)
    assert accel.memory_allocated(cpu) == accel.max_memory_allocated(cpu) == 0


def test_pinning_refused_by_a_backend_warns_once_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(accel, "accelerator_type", lambda: "acc")
    monkeypatch.setattr(accel, "_pin_refused", set())

    def no_pinned_allocator(*args, **kwargs):
        raise NotImplementedError("no getPinnedMemoryAllocator for PrivateUse1")

    monkeypatch.setattr(torch, "empty", no_pinned_allocator)
    with caplog.at_level(logging.WARNING):
        assert accel.pinned_empty(4096) is None
        assert accel.pinned_empty(4096) is None
    assert caplog.text.count("has no pinned host memory") == 1


@pytest.mark.parametrize(
    ("backend", "expected"),
    [
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
        ("nccl", {"cuda": "nccl"}),
        ("xccl", {"xpu": "xccl"}),
        ("gloo", {"cpu": "gloo"}),  # torch lists cuda for gloo; flatzero keeps it on the host
        ("", {}),
    ],
)
def test_a_groups_devices_come_from_its_backend_string_and_torchs_registry(backend, expected):
    assert devices.device_backends(backend) == expected


def test_a_registered_backend_serves_the_devices_it_declared(monkeypatch):
    monkeypatch.setitem(dist.Backend.backend_capability, "hccl", ["npu"])
    assert devices.device_backends("hccl") == {"npu": "hccl"}
