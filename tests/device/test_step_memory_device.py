"""Issue 23, item 13 on an accelerator: a step reads nothing back from the device and the
gradient norm is all-reduced on the device, by the device's backend of a mixed group
(``cpu:gloo,emu:emu-gloo`` here, what ``cpu:gloo,cuda:nccl`` is on a GPU node).

On the emulated accelerator every copy between it and the host is seen too (the emulator's
one copy routine is wrapped): a step makes none.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import test_step_memory as step_tests  # tests/ is on sys.path (rootdir of this package)
from flatzero import FlattenConfig
from flatzero.optim import LossScaleConfig, ZeroConfig, ZeroOptimizer
from flatzero.testing.emulated import kernels

from .harness import launch, this_device


def _host_copies(kind: str, copies: list) -> object:
    """Wrap the emulator's copy routine to record copies that cross host and device."""
    original = kernels.copy_bytes

    def recording(dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.device.type != src.device.type:
            copies.append((src.device.type, dst.device.type, src.numel()))
        original(dst, src)

    if kind == "emu":
        kernels.copy_bytes = recording
    return original


def _worker(rank: int, world_size: int, kind: str) -> dict:
    device = this_device(kind)
    out = {}
    for name, dtype, scale in (
        ("fp32", torch.float32, None),
        ("bf16", torch.bfloat16, None),
        ("fp16", torch.float16, LossScaleConfig(init_scale=2.0**4)),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)).to(device, dtype)
        opt = ZeroOptimizer(
            model.parameters(),
            config=ZeroConfig(max_grad_norm=0.1, loss_scale=scale),
            flatten_config=FlattenConfig(bucket_numel=300, device=str(device), progress=False),
            lr=1e-2,
        )
        for step in range(2):
            x = step_tests._inputs(step, rank)[:, :16].to(device, dtype)
            opt.backward(model(x).float().square().mean())
            if step == 0:
                opt.step()  # the first step agrees on the bucket order, once
                continue
            copies: list = []
            original = _host_copies(kind, copies)
            try:
                with step_tests._host_syncs() as seen:
                    opt.step()
            finally:
                kernels.copy_bytes = original
        seen["copies"] = copies
        seen["norm"] = opt.last_grad_norm
        out[name] = seen
        opt.close()
    return out


def test_no_host_sync_in_step_on_the_device(kind):
    results = launch(kind, _worker, 2, timeout_s=300)
    for result in results:
        for name, seen in result.items():
            device_reads = [r for r in seen["reads"] if r[1] != "cpu"]
            if name == "fp16":  # the inf/nan verdict that decides the skip: one read
                assert device_reads == [("__bool__", kind)], device_reads
            else:
                assert device_reads == [], (name, device_reads)
            assert seen["uploads"] == [], (name, seen["uploads"])
            assert seen["copies"] == [], (name, seen["copies"])
            norm_reduces = [c for c in seen["collectives"] if c[0] == "all_reduce"]
            assert norm_reduces == [("all_reduce", kind, torch.float64, 1)], (name, norm_reduces)
            assert seen["norm"] == pytest.approx(results[0][name]["norm"], rel=0)
            assert seen["norm"] > 0
