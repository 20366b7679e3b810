"""Host ops per training step: how many torch operators the host dispatches in backward and in
the optimizer step, for plain torch, ``ZeroOptimizer`` stage 1/2 and DeepSpeed ZeRO-1/2.

The model is a stack of small ``nn.Linear`` layers (many params, little arithmetic), so the
count is dominated by per-param work: a method whose step is proportional to its buckets
counts the same for 50 layers as for 200.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "METHODS",
    "HostOps",
    "HostOpsSpec",
    "OpCounter",
    "count_all",
    "count_host_ops",
    "linear_stack",
]

LR = 1e-3
"""AdamW's learning rate, every method."""

# [Note: what a host op is] Every operator call the dispatcher hands to Python's
# ``TorchDispatchMode``: each aten op (``aten.mm``, ``aten._foreach_add_``, a view), each
# c10d collective (``c10d.allreduce_``) and each ``_foreach``/fused kernel counts once,
# whichever layer issued it (Python, C++ autograd, an autograd hook). The mode is entered
# around ``loss.backward()``: dispatch modes are part of the thread-local state the autograd
# engine carries into backward (including its worker threads), so the counter sees the
# ops autograd runs for the graph's nodes, ``AccumulateGrad``, and every hook's ops alike,
# for plain torch and for flatzero and DeepSpeed. Ops issued below the dispatcher (inside a
# kernel, inside gloo) are not host ops here: they are one call's work.


class OpCounter(TorchDispatchMode):
    """Counts every operator dispatched while active (see [Note: what a host op is])."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(
        self, func: OpOverload, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        """Operator calls counted so far."""
        return sum(self.counts.values())


@contextmanager
def counting() -> Iterator[OpCounter]:
    """An ``OpCounter`` active for the ``with`` block."""
    counter = OpCounter()
    with counter:
        yield counter


def linear_stack(layers: int, width: int, seed: int = 0) -> nn.Sequential:
    """``layers`` ``nn.Linear(width, width)`` (2 params each: weight, bias), fp32, seeded."""
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


@dataclass(frozen=True)
class HostOpsSpec:
    """One count's settings (identical on every rank).

    Attributes:
        method: a key of ``METHODS``.
        layers: ``nn.Linear`` layers in the model (2 params each).
        width: each layer's in and out features.
        batch: rows per rank and step.
        steps: counted steps (after one uncounted step that sets everything up).
        bucket_numel: flatzero's and DeepSpeed's bucket size, in elements.
    """

    method: str
    layers: int
    width: int = 8
    batch: int = 4
    steps: int = 2
    bucket_numel: int = 2**20


@dataclass(frozen=True)
class HostOps:
    """Operator calls per step (the mean over the counted steps) on one rank.

    Attributes:
        params: param tensors in the model.
        buckets: flatzero's buckets (``None`` for the other methods).
        backward: ops in backward, with the gradient reduction complete.
        step: ops in the optimizer step (clipping, update, all-gather, zeroing the grads).
        backward_ops: per operator name, backward's ops over all counted steps.
        step_ops: per operator name, the step's ops over all counted steps.
    """

    params: int
    buckets: int | None
    backward: float
    step: float
    backward_ops: dict[str, int]
    step_ops: dict[str, int]


class _Method:
    """A model and its optimizer, in two counted phases."""

    buckets: int | None = None
    """flatzero's buckets; ``None`` for the other methods."""

    def __init__(self, model: nn.Module, spec: HostOpsSpec) -> None:
        self.model = model

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """The forward pass and its loss (not counted)."""
        return self.model(x).square().mean()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward with the gradient reduction complete."""
        loss.backward()

    def step(self) -> None:
        """The optimizer step and zeroing the grads."""
        raise NotImplementedError


class _Torch(_Method):
    def __init__(self, model: nn.Module, spec: HostOpsSpec, fused: bool) -> None:
        super().__init__(model, spec)
        self.opt = torch.optim.AdamW(
            model.parameters(), lr=LR, foreach=not fused or None, fused=fused or None
        )

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _Flatzero(_Method):
    def __init__(self, model: nn.Module, spec: HostOpsSpec, stage: int) -> None:
        from ..config import FlattenConfig
        from ..optim import ZeroOptimizer

        super().__init__(model, spec)
        self.opt = ZeroOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            stage=stage,
            flatten_config=FlattenConfig(bucket_numel=spec.bucket_numel, progress=False),
            lr=LR,
        )
        self.buckets = sum(len(g.layout.buckets) for g in self.opt.flat.groups)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.opt.reduce_gradients()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


class _DeepSpeed(_Method):
    def __init__(self, model: nn.Module, spec: HostOpsSpec, stage: int) -> None:
        from .deepspeed import deepspeed_config, prepare_deepspeed

        super().__init__(model, spec)
        prepare_deepspeed()
        import deepspeed

        config = deepspeed_config(stage=stage, dtype="fp32", bucket_numel=spec.bucket_numel)
        config["train_micro_batch_size_per_gpu"] = spec.batch
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.engine(x).square().mean()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


METHODS: dict[str, Callable[[nn.Module, HostOpsSpec], _Method]] = {
    "torch-adamw": lambda m, s: _Torch(m, s, fused=False),
    "torch-adamw-fused": lambda m, s: _Torch(m, s, fused=True),
    "flatzero-z1": lambda m, s: _Flatzero(m, s, stage=1),
    "flatzero-z2": lambda m, s: _Flatzero(m, s, stage=2),
    "deepspeed-z1": lambda m, s: _DeepSpeed(m, s, stage=1),
    "deepspeed-z2": lambda m, s: _DeepSpeed(m, s, stage=2),
}
"""Each method's name and how it is built around a model."""


def count_host_ops(rank: int, world_size: int, spec: HostOpsSpec) -> dict[str, Any]:
    """This rank's ``HostOps`` (as a dict) for ``spec.method``: one uncounted step, then
    ``spec.steps`` steps whose backward and step are counted apart. A ``run_ranks`` target
    (the process group is up); at world size 1 it runs in the calling process as well."""
    model = linear_stack(spec.layers, spec.width)
    params = sum(1 for p in model.parameters() if p.requires_grad)
    method = METHODS[spec.method](model, spec)
    g = torch.Generator().manual_seed(1000 + rank)
    backward: collections.Counter[str] = collections.Counter()
    step: collections.Counter[str] = collections.Counter()
    for i in range(spec.steps + 1):
        loss = method.loss(torch.randn(spec.batch, spec.width, generator=g))
        if dist.is_initialized():
            dist.barrier()
        with counting() as bwd:
            method.backward(loss)
        with counting() as stp:
            method.step()
        if i:
            backward.update(bwd.counts)
            step.update(stp.counts)
    return dataclasses.asdict(
        HostOps(
            params=params,
            buckets=method.buckets,
            backward=sum(backward.values()) / spec.steps,
            step=sum(step.values()) / spec.steps,
            backward_ops=dict(backward),
            step_ops=dict(step),
        )
    )


def count_all(rank: int, world_size: int, specs: tuple[HostOpsSpec, ...]) -> list[dict[str, Any]]:
    """``count_host_ops`` for each of ``specs`` in turn, in one launch of the ranks."""
    return [count_host_ops(rank, world_size, spec) for spec in specs]
