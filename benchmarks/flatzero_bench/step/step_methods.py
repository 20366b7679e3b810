"""The methods ``flatzero bench step`` times: a model copy each, with its optimizer, stepping
in three timed phases (forward, backward with the reduction, optimizer step)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from flatzero.config import FlattenConfig
from flatzero.optim import ZeroConfig, ZeroOptimizer
from flatzero_bench.common.ranks import sync

__all__ = ["LR", "MAX_GRAD_NORM", "StepMethod", "StepSpec", "make_method", "stage_of"]

LR = 1e-4
"""AdamW's learning rate, every method."""
MAX_GRAD_NORM = 1.0
"""Global-norm clipping, every method."""


@dataclass(frozen=True)
class StepSpec:
    """One benchmark run's settings (identical on every rank).

    Attributes:
        model: a key of ``models.bench_models.STEP_MODELS``.
        dtype: ``"fp32"`` or ``"bf16"`` (params; masters and optimizer state are fp32,
            except ``torch-adamw`` which keeps everything in the params' dtype).
        methods: the methods to run at this world size, the first one being the baseline.
        batch: sequences per rank and step.
        seq: tokens per sequence.
        warmup: untimed steps per method before timing.
        steps: timed steps per method; the methods alternate step by step.
        bucket_numel: gradient/all-gather bucket size in elements (flatzero and DeepSpeed).
        device: ``"cpu"`` or ``"cuda"``.
    """

    model: str
    dtype: str
    methods: tuple[str, ...]
    batch: int
    seq: int
    warmup: int
    steps: int
    bucket_numel: int
    device: str


def stage_of(name: str) -> int:
    """``"deepspeed-z2-fused"`` -> 2."""
    return int(name.split("-")[1][1])


def _fused(name: str) -> bool:
    return name.endswith("-fused")


class StepMethod:
    """A model copy and its optimizer, stepping in three timed phases."""

    def __init__(self, name: str, model: nn.Module, device: torch.device) -> None:
        self.name = name
        self.model = model
        self.device = device
        self.times: list[tuple[float, float, float]] = []
        self.losses: list[float] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The forward pass on ``ids`` (tokens ``[batch, seq]``) and its loss."""
        return self.model(ids, labels=ids).loss

    def backward(self, loss: torch.Tensor) -> None:
        """Backward with the gradient reduction complete."""
        raise NotImplementedError

    def step(self) -> None:
        """Clipping, the optimizer step, the parameter all-gather, zeroing the grads."""
        raise NotImplementedError

    def train_step(self, ids: torch.Tensor, record: bool) -> None:
        """One step after a barrier; with ``record``, keep its three phases' seconds in
        ``times`` and its loss in ``losses``."""
        if dist.is_initialized():
            dist.barrier()
        sync(self.device)
        t0 = time.perf_counter()
        loss = self.forward(ids)
        sync(self.device)
        t1 = time.perf_counter()
        self.backward(loss)
        sync(self.device)
        t2 = time.perf_counter()
        self.step()
        sync(self.device)
        t3 = time.perf_counter()
        if record:
            self.times.append((t1 - t0, t2 - t1, t3 - t2))
            self.losses.append(float(loss.detach()))


class _Flatzero(StepMethod):
    def __init__(self, name: str, model: nn.Module, device: torch.device, spec: StepSpec):
        super().__init__(name, model, device)
        self.opt = ZeroOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            stage=stage_of(name),
            config=ZeroConfig(max_grad_norm=MAX_GRAD_NORM),
            flatten_config=FlattenConfig(
                bucket_numel=spec.bucket_numel, device=str(device), progress=False
            ),
            lr=LR,
        )

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.opt.reduce_gradients()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()


class _TorchAdamW(StepMethod):
    def __init__(self, name: str, model: nn.Module, device: torch.device, spec: StepSpec):
        super().__init__(name, model, device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=LR, fused=_fused(name) or None)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, MAX_GRAD_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _DeepSpeed(StepMethod):
    def __init__(self, name: str, model: nn.Module, device: torch.device, spec: StepSpec):
        from flatzero.testing.deepspeed import deepspeed_config, prepare_deepspeed

        super().__init__(name, model, device)
        prepare_deepspeed()
        import deepspeed

        config = deepspeed_config(
            stage=stage_of(name), dtype=spec.dtype, bucket_numel=spec.bucket_numel
        )
        config["gradient_clipping"] = MAX_GRAD_NORM
        config["train_micro_batch_size_per_gpu"] = spec.batch
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, fused=_fused(name) or None)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.engine(ids, labels=ids).loss

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


_KINDS: dict[str, type[StepMethod]] = {
    "flatzero": _Flatzero,
    "torch": _TorchAdamW,
    "deepspeed": _DeepSpeed,
}


def make_method(name: str, model: nn.Module, device: torch.device, spec: StepSpec) -> StepMethod:
    """Method ``name`` (``flatzero-z2``, ``torch-adamw-fused``, ...) training ``model``."""
    return _KINDS[name.split("-")[0]](name, model, device, spec)
