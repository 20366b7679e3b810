"""``Engine``: what ``flatzero.initialize`` returns, with DeepSpeed's engine API for ZeRO 0-2.

See the note beside ``Engine``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...checkpoint.atomic import wait_for_removals
from ...optim import ZeroOptimizer
from .checkpointing import EngineCheckpoints
from .compiling import EngineCompile
from .config import EngineConfig
from .full_values import unregister
from .getters import DeepSpeedGetters
from .preemption import check_at_boundary, engine_watch
from .report import EngineInitReport
from .unused_check import UnusedCheck
from .user_backward import UserBackward

__all__ = ["Engine"]

logger = logging.getLogger(__name__)


# [Note: the engine's training loop, stage 0, and what Accelerate and Trainer use.
# The training loop is DeepSpeed's::
#
#     for batch in loader:
#         loss = engine(batch)           # the module's forward
#         engine.backward(loss)          # loss / gradient_accumulation_steps, loss-scaled
#         engine.step()                  # steps only every gradient_accumulation_steps calls
#
# ``engine.step()`` counts micro-batches; at every ``gradient_accumulation_steps``-th call (the
# boundary) it steps the ``ZeroOptimizer`` (reduce, unscale/check/clip, inner step,
# all-gather), then the LR scheduler unless the step was skipped for an overflow, and
# increments ``global_steps``. Between boundaries gradients accumulate.
#
# Stage 0 (plain data parallel) runs a ``ZeroOptimizer`` over a one-rank process group per
# rank, so every rank holds the whole fp32 master and optimizer state; at the boundary the
# engine all-reduces the fp32 gradient (sum, then divided by the world size) before the step,
# and every rank then applies the same update.
#
# What Hugging Face Accelerate and Trainer use of a DeepSpeed engine behaves as DeepSpeed's:
# ``set_gradient_accumulation_boundary`` (the caller decides where the boundary is and calls
# ``step()`` only there), ``get_global_grad_norm()`` after every optimizer step,
# ``optimizer.overflow``, ``engine.config`` as the raw config dict, attribute pass-through to
# the module, DeepSpeed's checkpoint tags and return values. When ``deepspeed`` is imported
# in the process, ``initialize`` (the door, not this class) builds an instance of a subclass
# that also derives from ``deepspeed.DeepSpeedEngine`` (without running its ``__init__``; see
# ``deepspeed_compat.py``), so ``isinstance(engine, deepspeed.DeepSpeedEngine)`` holds. This
# module does not know DeepSpeed's engine exists.
#
# The getters DeepSpeed's engine has come from ``DeepSpeedGetters`` (``getters.py``), the
# checkpoint methods from ``EngineCheckpoints`` (``checkpointing.py``), ``compile`` and
# ``is_compiled`` from ``EngineCompile`` (``compiling.py``).]
class Engine(DeepSpeedGetters, EngineCheckpoints, EngineCompile, nn.Module):
    """The training engine of the DeepSpeed door (ZeRO stages 0, 1, 2).

    Built by ``flatzero.initialize``; not meant to be constructed directly.

    Attributes:
        module: the user's model (its trainable params are views of the flat buckets).
            Attributes the engine does not have are looked up on it (as DeepSpeed's engine
            does: ``engine.generate``, ``engine.config`` excepted).
        optimizer: the ``ZeroOptimizer``; its ``overflow`` says whether the last optimizer
            step was skipped for inf/nan gradients (DeepSpeed's attribute).
        lr_scheduler: the LR scheduler, or None.
        config: the DeepSpeed config as a dict (what DeepSpeed's ``engine.config`` is).
        parsed_config: the parsed config (``EngineConfig``).
        client_optimizer: the optimizer passed to ``initialize``, or None; its
            ``param_groups`` show (and set) the hyperparameters of flatzero's optimizer.
        init_report: what ``initialize`` did (``EngineInitReport``).
        training_dataloader: the data loader built from ``training_data``, or None.
        global_steps: optimizer steps taken (skipped fp16 overflow steps included).
        global_samples: samples consumed by those steps (``train_batch_size`` each).
        micro_steps: ``step()`` calls (micro-batches).
        skipped_steps: optimizer steps skipped for inf/nan gradients.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: ZeroOptimizer,
        lr_scheduler: Any,
        config: EngineConfig,
        init_report: EngineInitReport,
        *,
        process_group: dist.ProcessGroup | None,
        training_dataloader: Any = None,
        client_optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        nn.Module.__init__(self)  # never DeepSpeedEngine.__init__ (see deepspeed_compat.py)
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.config = dict(config.source)
        self.parsed_config = config
        self.client_optimizer = client_optimizer
        self.init_report = init_report
        self.training_dataloader = training_dataloader
        self._pg = process_group
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._backwards_in_window = 0
        self._warned_zero_grad = False
        self._step_applied = False
        self._boundary: bool | None = None
        self._global_grad_norm: torch.Tensor | float | None = None
        self._destroyed = False
        self._is_compiled = False
        self._last_loss_time = time.perf_counter()
        optimizer.overflow = False  # DeepSpeed's ZeRO optimizers carry it
        self._preemption = engine_watch(config.flatzero, process_group)
        self._user_backward = UserBackward(
            [p for g in optimizer.flat.groups for p in g.params],
            self.gradient_accumulation_steps(),
            needs_scale=config.precision.dtype == "fp16",  # a fixed scale of 1 needs none
        )
        self._unused_check = (
            UnusedCheck(list(optimizer.flat.named_params().items()))
            if config.zero.check_unused
            else None
        )

    def __getattr__(self, name: str) -> Any:
        """Attributes the engine does not have come from the module, as with DeepSpeed."""
        try:
            return nn.Module.__getattr__(self, name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is not None:
                try:
                    return getattr(module, name)
                except AttributeError:
                    pass
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}' (nor has its module)"
            ) from None

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` call steps the optimizer: the value given to
        ``set_gradient_accumulation_boundary`` if any, else every
        ``gradient_accumulation_steps``-th ``step()`` call."""
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Decide the boundary yourself (what Hugging Face Accelerate does): with
        ``is_boundary`` True the next ``step()`` steps the optimizer, with False it only
        counts a micro-batch, whatever ``gradient_accumulation_steps`` says. Gradients
        accumulate over every ``backward`` until the step, and each ``backward`` still divides
        its loss by ``gradient_accumulation_steps`` (as DeepSpeed does)."""
        self._boundary = bool(is_boundary)

    def was_step_applied(self) -> bool:
        """Whether the last boundary ``step()`` changed the weights (no overflow)."""
        return self._step_applied

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the averaged, unscaled gradient at the last optimizer step
        (before clipping; inf for a step skipped for inf/nan), as DeepSpeed computes it at every
        step; None before the first step. The step keeps it on the device: reading it here
        is the host sync, paid only when it is asked for."""
        norm = self._global_grad_norm
        return None if norm is None else float(norm)

    # -------------------------------------------------------------------- training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward (with ``fp16.auto_cast``, floating-point tensors among the
        positional arguments are cast to fp16 first, as DeepSpeed does)."""
        if self.parsed_config.precision.auto_cast:
            args = _cast_half(args)
        self._user_backward.forward_started()
        return self.module(*args, **kwargs)

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backward of ``loss / gradient_accumulation_steps`` (times the loss scale).

        Args:
            loss: the micro-batch's scalar loss.
            retain_graph: passed to ``backward``.
            scale_wrt_gas: divide by ``gradient_accumulation_steps`` (DeepSpeed's default).

        Returns:
            The loss divided by ``gradient_accumulation_steps`` (not loss-scaled).
        """
        _check_scalar(loss, "backward")
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        with self._user_backward.engine_backward():
            self.optimizer.scale_loss(loss).backward(retain_graph=retain_graph)
        self._backwards_in_window += 1
        return loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (``loss`` itself without loss scaling), for a
        plain ``engine.scale(loss).backward()`` (DeepSpeed's method): that backward's
        gradients are still divided by ``gradient_accumulation_steps``
        (``user_backward.py``)."""
        _check_scalar(loss, "scale")
        self._user_backward.scaled()
        return self.optimizer.scale_loss(loss)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End a micro-batch; at the accumulation boundary, step the optimizer and the LR
        scheduler (the scheduler is not stepped when the step was skipped for inf/nan
        gradients). Collective at the boundary: every rank must call it."""
        self._step_applied = False
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            if self.parsed_config.replicated:
                self._all_reduce_gradients()
            if self._unused_check is not None:
                self._unused_check.verify(self._pg)
            self._global_grad_norm = self._grad_norm_before_step()
            self.optimizer.step()
            norm = self.optimizer.last_grad_norm_tensor
            if norm is not None:
                self._global_grad_norm = norm
            self.optimizer.overflow = self.optimizer.last_step_skipped
            if self.optimizer.last_step_skipped:
                self._global_grad_norm = math.inf  # DeepSpeed's norm of a skipped step
                self.skipped_steps += 1
                if self.global_rank == 0:
                    logger.info(
                        "step %d skipped: inf/nan gradients (loss scale now %g)",
                        self.global_steps,
                        self.loss_scale,
                    )
            else:
                self._step_applied = True
                if self.client_optimizer is not None:
                    # torch's LR schedulers check that their optimizer stepped before them.
                    self.client_optimizer._opt_called = True  # type: ignore[attr-defined]
                if self.lr_scheduler is not None:
                    self.lr_scheduler.step(**(lr_kwargs or {}))
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
            self._backwards_in_window = 0
            self._report_progress()
        self.micro_steps += 1
        if boundary and self._preemption is not None:
            check_at_boundary(self._preemption, self)  # may save and raise Preempted

    def _grad_norm_before_step(self) -> torch.Tensor | None:
        """The gradient norm (on the device) when the optimizer's step will not compute it
        (no clipping, no loss scaling): the step's one scalar all-reduce, as DeepSpeed
        pays."""
        opt = self.optimizer
        if opt.config.max_grad_norm is not None or opt._scaler is not None:
            return None
        opt.reduce_gradients()
        return opt._norm()

    def _all_reduce_gradients(self) -> None:
        """Stage 0: average the fp32 gradients of the window over all ranks."""
        self.optimizer.reduce_gradients()
        grads = self.optimizer.grad_shards
        works = [dist.all_reduce(g, group=self._pg, async_op=True) for g in grads]
        for work in works:
            work.wait()
        torch._foreach_mul_(grads, 1.0 / self.world_size)

    def _report_progress(self) -> None:
        every = self.parsed_config.steps_per_print
        if every is None or self.global_steps % every or self.global_rank != 0:
            return
        now = time.perf_counter()
        norm = self.get_global_grad_norm()
        logger.info(
            "step=%d skipped=%d lr=%s grad_norm=%s loss_scale=%g samples/s=%.1f",
            self.global_steps,
            self.skipped_steps,
            [f"{lr:.3g}" for lr in self.get_lr()],
            "-" if norm is None else f"{norm:.4g}",
            self.loss_scale,
            every * self.train_batch_size() / max(now - self._last_loss_time, 1e-9),
        )
        self._last_loss_time = now

    def zero_grad(self) -> None:
        """Nothing to do: ``step()`` at the boundary starts the next window with zero
        gradients. Called in the middle of a window, the gradients accumulated so far are
        kept, as with DeepSpeed's ZeRO stage 2 (they already left the params)."""
        if self._backwards_in_window and not self._warned_zero_grad:
            self._warned_zero_grad = True
            logger.warning(
                "engine.zero_grad() in the middle of an accumulation window (%d of %d "
                "micro-batches done) keeps the gradients accumulated so far; the window ends "
                "at the boundary engine.step()",
                self._backwards_in_window,
                self.gradient_accumulation_steps(),
            )

    def train(self, mode: bool = True) -> Engine:
        """Put the module in training (or eval) mode."""
        self.module.train(mode)
        self.training = mode
        return self

    def eval(self) -> Engine:
        """Put the module in eval mode."""
        return self.train(False)

    def empty_partition_cache(self) -> None:
        """Nothing to release: DeepSpeed's engine frees ZeRO-3's gathered-parameter cache
        here, and at stages 1 and 2 does nothing, as this does."""

    def destroy(self) -> None:
        """Wait for an asynchronous save still being written (``wait_for_save``) and for
        old checkpoints still being deleted (``atomic.wait_for_removals``), free the
        asynchronous saves' snapshot buffer (unpinned: ``release_snapshot``), then remove
        the gradient hooks from the params (the engine cannot train after; the module stays
        usable). Calling it again does nothing."""
        if not self._destroyed:
            from ...checkpoint.checkpointer import release_snapshot

            self.wait_for_save()
            release_snapshot(self.optimizer)
            wait_for_removals()
            self._destroyed = True
            self._user_backward.close()
            if self._unused_check is not None:
                self._unused_check.close()
            unregister(self.optimizer)
            self.optimizer.close()
            if self._preemption is not None:
                self._preemption.uninstall()

    def __repr__(self) -> str:
        cfg = self.parsed_config
        return (
            f"Engine(stage={cfg.zero.stage}, dtype={cfg.precision.dtype}, "
            f"world_size={self.world_size}, global_steps={self.global_steps}, "
            f"module={type(self.module).__name__})"
        )


def _check_scalar(loss: Any, method: str) -> None:
    """A ``TypeError`` unless ``loss`` is a one-element tensor."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
        raise TypeError(
            f"engine.{method}(loss) needs a scalar loss tensor, got {type(loss).__name__}"
            f"{shape}; reduce the loss to one element (e.g. loss.mean())"
        )


def _cast_half(inputs: Any) -> Any:
    """DeepSpeed's ``_cast_inputs_half``: floating-point tensors in nested lists, tuples and
    dicts to fp16."""
    if isinstance(inputs, (list, tuple)):
        return inputs.__class__(_cast_half(v) for v in inputs)
    if isinstance(inputs, dict):
        return {k: _cast_half(v) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor) and inputs.is_floating_point():
        return inputs.half()
    return inputs
