"""Launching ranks on an accelerator kind, and what the device tests measure with."""

from __future__ import annotations

import functools
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from flatzero import accel
from flatzero.launch import run_ranks
from flatzero.testing.emulated import install

EMU_BACKEND = "cpu:gloo,emu:emu-gloo"
"""The emulated node's group: gloo for host tensors, the emulated backend for device ones
(what ``cpu:gloo,cuda:nccl`` is on a GPU node)."""

GiB = 2**30


def launch(
    kind: str,
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    capacity_bytes: int = GiB,
    backend: str | None = None,
    host_collectives: bool = True,
    host_registration: bool | None = None,
    timeout_s: float = 120.0,
) -> list[Any]:
    """``fn(rank, world_size, kind, *args)`` on ``world_size`` fresh rank processes whose
    accelerator is ``kind``: the emulated one (with ``capacity_bytes`` of memory per rank)
    or CUDA (NCCL); ``host_registration``: the emulated device's ``cudart()`` (None: as
    its deferred-stream mode). Skips when the emulator cannot be installed on this torch."""
    if kind == "emu":
        prepare = functools.partial(
            install,
            "emu",
            capacity_bytes=capacity_bytes,
            host_collectives=host_collectives,
            host_registration=host_registration,
        )
        backend = backend or EMU_BACKEND
    else:
        prepare, backend = None, backend or "nccl"
    try:
        return run_ranks(
            fn, world_size, kind, *args, backend=backend, prepare=prepare, timeout_s=timeout_s
        )
    except RuntimeError as error:
        if "EmulationUnavailable" in str(error):
            pytest.skip(f"no emulated accelerator on torch {torch.__version__}: {error}")
        raise


def this_device(kind: str) -> torch.device:
    """This rank's accelerator (the current device of ``kind``)."""
    return torch.device(kind, accel.current_index(kind))


class UnevenNet(nn.Module):
    """Sizes that no world size from 2 to 4 divides, several buckets at 64-element
    alignment, and a tied weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(37, 24)
        self.blocks = nn.ModuleList(nn.Linear(24, 24) for _ in range(5))
        self.norm = nn.LayerNorm(24)
        self.head = nn.Linear(24, 37, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return self.head(self.norm(x))


def host_copy(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter of ``model`` copied to host memory, by name."""
    return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> list[str]:
    """Names of the params whose values differ (bitwise) from ``before``."""
    return [n for n, p in model.named_parameters() if not torch.equal(p.detach().cpu(), before[n])]


def packed(obj: Any) -> bytes:
    """``obj`` (tensors included) as bytes a rank process can return (``torch.save``)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpacked(blob: bytes) -> Any:
    """What ``packed`` packed."""
    return torch.load(io.BytesIO(blob), weights_only=False)
