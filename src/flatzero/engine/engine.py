"""``Engine``: what ``flatzero.initialize`` returns, with DeepSpeed's engine API for ZeRO 0-2.

The training loop is DeepSpeed's::

    for batch in loader:
        loss = engine(batch)           # the module's forward
        engine.backward(loss)          # loss / gradient_accumulation_steps, loss-scaled
        engine.step()                  # steps only every gradient_accumulation_steps calls

``engine.step()`` counts micro-batches; at every ``gradient_accumulation_steps``-th call (the
boundary) it steps the ``ZeroOptimizer`` (reduce, unscale/check/clip, inner step,
all-gather), then the LR scheduler unless the step was skipped for an overflow, and
increments ``global_steps``. Between boundaries gradients accumulate.

Stage 0 (plain data parallel) runs a ``ZeroOptimizer`` over a one-rank process group per
rank, so every rank holds the whole fp32 master and optimizer state; at the boundary the
engine all-reduces the fp32 gradient (sum, then divided by the world size) before the step,
and every rank then applies the same update.

What Hugging Face Accelerate and Trainer use of a DeepSpeed engine behaves as DeepSpeed's:
``set_gradient_accumulation_boundary`` (the caller decides where the boundary is and calls
``step()`` only there), ``get_global_grad_norm()`` after every optimizer step,
``optimizer.overflow``, ``engine.config`` as the raw config dict, attribute pass-through to
the module, DeepSpeed's checkpoint tags and return values. When ``deepspeed`` is imported
in the process, ``Engine(...)`` builds an instance of a subclass that also derives from
``deepspeed.DeepSpeedEngine`` (without running its ``__init__``; see
``deepspeed_compat.py``), so ``isinstance(engine, deepspeed.DeepSpeedEngine)`` holds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import rank_of, world_size_of
from ..control import agree_on_error, control_group, wait_for_host_work
from ..optim import ZeroOptimizer
from ..report import InitReport
from .config import EngineConfig

__all__ = ["Engine", "EngineInitReport"]

logger = logging.getLogger(__name__)

_ENGINE_STATE = "flatzero_engine"
"""Key of the engine's counters in a checkpoint's client state."""


@dataclass(frozen=True)
class EngineInitReport:
    """What ``flatzero.initialize`` did on this rank.

    Attributes:
        flatten: the flatten report (tier, phases, bytes moved, peak memory).
        stage: ZeRO stage (0, 1, 2).
        dtype: training dtype of the params (``"bf16"``, ``"fp16"``, ``"fp32"``).
        world_size: data-parallel ranks.
        rank: this rank.
        params: trainable elements.
        tensors: trainable tensors (tied weights once).
        optimizer: the inner ``torch.optim`` class and where it came from (config, client).
        scheduler: the LR scheduler's class name, or None.
        source: where the weights came from (``"cpu"``, ``"cuda:0"``, ``"meta+safetensors"``,
            ``"meta+checkpoint"``) and in which dtype(s).
        param_sync: what made the ranks' initial weights equal (``"gather"``,
            ``"broadcast"``, ``"check"``, ``"none"``, or why nothing was needed).
        phase_seconds: wall seconds of each phase of ``initialize`` (config, flatten, sync,
            optimizer, scheduler).
        wall_seconds: wall seconds of the whole ``initialize`` call.
        ignored_keys: config keys accepted without effect.
    """

    flatten: InitReport
    stage: int
    dtype: str
    world_size: int
    rank: int
    params: int
    tensors: int
    optimizer: str
    scheduler: str | None
    source: str
    param_sync: str
    phase_seconds: dict[str, float] = field(default_factory=dict)
    wall_seconds: float = 0.0
    ignored_keys: tuple[str, ...] = ()

    @property
    def tiers(self) -> tuple[str, ...]:
        """The flatten tier of each group."""
        return self.flatten.tiers

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return asdict(self)

    def summary(self) -> str:
        """A few lines for a human."""
        phases = " ".join(f"{k}={v:.3f}s" for k, v in self.phase_seconds.items())
        lines = [
            f"flatzero.initialize {self.wall_seconds:.3f}s: ZeRO stage {self.stage}, "
            f"{self.dtype}, {self.world_size} rank(s), {self.params / 1e6:.2f}M params in "
            f"{self.tensors} tensors from {self.source}",
            f"  phases: {phases}",
            f"  flatten: {self.flatten.summary()}",
            f"  tier: {'+'.join(self.tiers)} ({self.flatten.tier_reason})",
            f"  weights agreed by: {self.param_sync}; optimizer: {self.optimizer}; "
            f"scheduler: {self.scheduler or 'none'}",
        ]
        if self.ignored_keys:
            lines.append(f"  config keys without effect: {', '.join(self.ignored_keys)}")
        return "\n".join(lines)


class Engine(nn.Module):
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

    def __new__(cls, *args: Any, **kwargs: Any) -> Engine:
        if cls is Engine:
            from .deepspeed_compat import deepspeed_engine_class

            cls = deepspeed_engine_class() or Engine
        return super().__new__(cls)

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
        self._replicated = config.zero.stage == 0 and world_size_of(process_group) > 1
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._backwards_in_window = 0
        self._warned_zero_grad = False
        self._step_applied = False
        self._boundary: bool | None = None
        self._global_grad_norm: float | None = None
        self._destroyed = False
        self._last_loss_time = time.perf_counter()
        optimizer.overflow = False  # DeepSpeed's ZeRO optimizers carry it

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

    # --------------------------------------------------------------- DeepSpeed getters
    @property
    def world_size(self) -> int:
        """Data-parallel ranks."""
        return world_size_of(self._pg)

    @property
    def global_rank(self) -> int:
        """This rank."""
        return rank_of(self._pg)

    @property
    def device(self) -> torch.device:
        """Where the flat buffers (and the module) live."""
        return self.optimizer.flat.groups[0].device

    def train_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.parsed_config.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-batch on one rank."""
        return self.parsed_config.batch.micro_batch_per_gpu

    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per optimizer step."""
        return self.parsed_config.batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        """ZeRO stage (0, 1 or 2)."""
        return self.parsed_config.zero.stage

    def gradient_clipping(self) -> float:
        """Max gradient norm (0.0: no clipping), as DeepSpeed reports it."""
        return self.parsed_config.gradient_clipping or 0.0

    def fp16_enabled(self) -> bool:
        """Whether training runs in fp16."""
        return self.parsed_config.precision.dtype == "fp16"

    def bfloat16_enabled(self) -> bool:
        """Whether training runs in bf16."""
        return self.parsed_config.precision.dtype == "bf16"

    def fp16_auto_cast(self) -> bool:
        """``fp16.auto_cast``: forward casts floating-point positional inputs to fp16."""
        return self.parsed_config.precision.auto_cast

    def dynamic_loss_scale(self) -> bool:
        """Whether the fp16 loss scale is dynamic."""
        scale = self.parsed_config.precision.loss_scale
        return self.fp16_enabled() and scale is not None and scale.dynamic

    def steps_per_print(self) -> int | None:
        """Optimizer steps between progress lines (None: never)."""
        return self.parsed_config.steps_per_print

    def zero_optimization(self) -> bool:
        """Whether a ZeRO stage above 0 is on."""
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        """Whether gradients are partitioned (stage 2)."""
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Always False: params are never partitioned (no stage 3)."""
        return False

    def zero_offload_optimizer(self) -> bool:
        """Always False: no offload."""
        return False

    def zero_offload_param(self) -> bool:
        """Always False: no offload."""
        return False

    def zero_cpu_offload(self) -> bool:
        """Always False: no offload."""
        return False

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Always False: stage 3 only (the module holds whole weights)."""
        return False

    def zero_reduce_bucket_size(self) -> int:
        """Bucket size in elements."""
        return self.parsed_config.bucket_numel

    def zero_allgather_bucket_size(self) -> int:
        """Bucket size in elements (one size for both collectives)."""
        return self.parsed_config.bucket_numel

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are summed over ranks in."""
        return self.parsed_config.reduce_dtype

    def get_data_parallel_rank(self) -> int:
        """This rank in the data-parallel group."""
        return self.global_rank

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        return (
            self.train_batch_size(),
            self.train_micro_batch_size_per_gpu(),
            self.gradient_accumulation_steps(),
        )

    def dataloader_drop_last(self) -> bool:
        """``drop_last`` of the loader built from ``training_data``."""
        return self.parsed_config.dataloader_drop_last

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

    def get_lr(self) -> list[float]:
        """The lr of every param group of the optimizer."""
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the averaged, unscaled gradient at the last optimizer step
        (before clipping; inf/nan for an fp16 overflow), as DeepSpeed computes it at every
        step; None before the first step."""
        return self._global_grad_norm

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16)."""
        return self.optimizer.loss_scale

    # -------------------------------------------------------------------- training
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward (with ``fp16.auto_cast``, floating-point tensors among the
        positional arguments are cast to fp16 first, as DeepSpeed does)."""
        if self.parsed_config.precision.auto_cast:
            args = _cast_half(args)
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
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else ""
            raise TypeError(
                f"engine.backward(loss) needs a scalar loss tensor, got {type(loss).__name__}"
                f"{shape}; reduce the loss to one element (e.g. loss.mean())"
            )
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        self.optimizer.scale_loss(loss).backward(retain_graph=retain_graph)
        self._backwards_in_window += 1
        return loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """End a micro-batch; at the accumulation boundary, step the optimizer and the LR
        scheduler (the scheduler is not stepped when the step was skipped for inf/nan
        gradients). Collective at the boundary: every rank must call it."""
        self._step_applied = False
        if self.is_gradient_accumulation_boundary():
            if self._replicated:
                self._all_reduce_gradients()
            self._global_grad_norm = self._grad_norm_before_step()
            self.optimizer.step()
            norm = self.optimizer.last_grad_norm
            if norm is not None:
                self._global_grad_norm = norm
            self.optimizer.overflow = self.optimizer.last_step_skipped
            if self.optimizer.last_step_skipped:
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

    def _grad_norm_before_step(self) -> float | None:
        """The gradient norm when the optimizer's step will not compute it (no clipping, no
        loss scaling): one more scalar all-reduce per step, as DeepSpeed pays."""
        opt = self.optimizer
        if opt.config.max_grad_norm is not None or opt._scaler is not None:
            return None
        opt.reduce_gradients()
        return float(opt._norm())

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

    def destroy(self) -> None:
        """Remove the gradient hooks from the params (the engine cannot train after; the
        module stays usable). Calling it again does nothing."""
        if not self._destroyed:
            self._destroyed = True
            self.optimizer.close()

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The module's ``state_dict`` (without frozen params if asked), as DeepSpeed's."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        return sd

    def save_16bit_model(
        self,
        save_dir: str | Path,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Rank 0 writes the module's weights (in the training dtype) with ``torch.save``,
        as DeepSpeed does for stages 0-2; returns True. Call it on every rank."""
        if self.global_rank == 0:
            state = {
                k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                for k, v in self.module_state_dict(
                    exclude_frozen_parameters=exclude_frozen_parameters
                ).items()
            }
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(save_dir) / save_filename)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier(group=self._pg)
        return True

    save_fp16_model = save_16bit_model

    # ------------------------------------------------------------------ checkpoints
    def _engine_state(self) -> dict[str, int]:
        return {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "micro_steps": self.micro_steps,
            "skipped_steps": self.skipped_steps,
        }

    def save_checkpoint(
        self,
        save_dir: str | Path,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save a checkpoint loadable at any world size (``flatzero.checkpoint``).

        Collective: every rank calls it with the same directory and tag.

        Args:
            save_dir: the checkpoint directory; the checkpoint goes to ``save_dir/tag``.
            tag: default ``global_step<N>`` as DeepSpeed names it.
            client_state: JSON-able state returned by ``load_checkpoint``.
            save_latest: point ``save_dir/latest`` at this checkpoint.
            exclude_frozen_parameters: do not save frozen params and buffers.

        Returns:
            True, as DeepSpeed does. An existing checkpoint of the same tag is replaced (as
            DeepSpeed overwrites it) once the new one is complete.
        """
        from ..checkpoint import SaveConfig, save_checkpoint
        from ..checkpoint.save import save_nbytes

        if tag is None:
            tag = f"global_step{self.global_steps}"
        extra = {_ENGINE_STATE: self._engine_state(), "client_state": client_state or {}}
        model = None if exclude_frozen_parameters else self.module
        kwargs = {
            "scheduler": self.lr_scheduler,
            "model": model,
            "extra": extra,
            # DeepSpeed writes over an existing tag (Trainer re-saves checkpoint-N when a run
            # resumes into the directory it came from); flatzero replaces it atomically.
            "config": SaveConfig(update_latest=save_latest, overwrite=True),
        }
        if self._replicated:
            # Stage 0: every rank holds the same state; rank 0 writes a one-rank checkpoint
            # while the others wait on the control group (gloo: no NCCL watchdog), as long as
            # writing that many bytes may take.
            control_group(self._pg)  # created (collective) before rank 0 starts writing
            error: BaseException | None = None
            if self.global_rank == 0:
                try:
                    save_checkpoint(save_dir, self.optimizer, tag, **kwargs)
                except BaseException as e:
                    error = e
            wait_for_host_work(self._pg, save_nbytes(self.optimizer, model))
            agree_on_error(
                error, self._pg, "saving the checkpoint failed on rank 0 (see its error)"
            )
        else:
            save_checkpoint(save_dir, self.optimizer, tag, **kwargs)
        return True

    def load_checkpoint(
        self,
        load_dir: str | Path,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load a checkpoint saved at any world size.

        Collective: every rank calls it with the same directory and tag.

        Args:
            load_dir: the checkpoint directory.
            tag: which checkpoint; None follows ``load_dir/latest``.
            load_module_strict: every trainable param must be in the checkpoint and vice
                versa.
            load_optimizer_states: restore optimizer state and loss scaler.
            load_lr_scheduler_states: restore the LR scheduler.
            load_module_only: restore the weights only (no optimizer, scheduler or step
                counters).
            custom_load_fn: must be None (DeepSpeed's hook for a custom module loader).

        Returns:
            ``(path, client_state)``; ``(None, None)`` when ``tag`` is None and
            ``load_dir/latest`` does not exist (as DeepSpeed, which warns and returns).
        """
        from ..checkpoint import LoadConfig, load_checkpoint

        if custom_load_fn is not None:
            raise NotImplementedError(
                "engine.load_checkpoint(custom_load_fn=...) is not implemented by flatzero: it "
                "loads the module's weights itself; drop custom_load_fn"
            )
        if tag is None and not (Path(load_dir) / "latest").is_file():
            if self.global_rank == 0:
                logger.warning(
                    "no checkpoint to load: %s has no 'latest' file; pass tag= to load a "
                    "named checkpoint",
                    Path(load_dir) / "latest",
                )
            return None, None
        _refuse_deepspeed_checkpoint(Path(load_dir), tag)
        config = LoadConfig(
            strict=load_module_strict,
            load_optimizer_states=load_optimizer_states and not load_module_only,
            load_scheduler=load_lr_scheduler_states and not load_module_only,
        )
        result = load_checkpoint(
            load_dir,
            self.optimizer,
            tag,
            scheduler=self.lr_scheduler if config.load_scheduler else None,
            model=self.module,
            config=config,
        )
        extra = result.extra if isinstance(result.extra, dict) else {}
        state = extra.get(_ENGINE_STATE)
        if isinstance(state, dict) and not load_module_only:
            self.global_steps = int(state.get("global_steps", 0))
            self.global_samples = int(state.get("global_samples", 0))
            self.micro_steps = int(state.get("micro_steps", 0))
            self.skipped_steps = int(state.get("skipped_steps", 0))
        self._backwards_in_window = 0
        if self.client_optimizer is not None:
            from .client import link_client_optimizer

            # Loading replaced the optimizer's param groups: show the new ones.
            link_client_optimizer(self.client_optimizer, self.optimizer)
        return str(result.path), extra.get("client_state", {})

    def __repr__(self) -> str:
        cfg = self.parsed_config
        return (
            f"Engine(stage={cfg.zero.stage}, dtype={cfg.precision.dtype}, "
            f"world_size={self.world_size}, global_steps={self.global_steps}, "
            f"module={type(self.module).__name__})"
        )


def _refuse_deepspeed_checkpoint(load_dir: Path, tag: str | None) -> None:
    """A checkpoint DeepSpeed wrote (``*_model_states.pt``, no ``meta.json``) gets an error
    that says how to convert it, not "incomplete checkpoint"."""
    if tag is None:
        try:
            tag = (load_dir / "latest").read_text().strip()
        except OSError:
            return
    directory = load_dir / tag
    if (directory / "meta.json").is_file() or not directory.is_dir():
        return
    if any(directory.glob("*_model_states.pt")) or any(directory.glob("*optim_states.pt")):
        raise ValueError(
            f"{directory} is a DeepSpeed checkpoint; flatzero's engine loads flatzero "
            f"checkpoints: convert it with `python -m flatzero import-deepspeed {load_dir} OUT "
            "--tag " + tag + "` (docs/huggingface.md shows how for a Trainer checkpoint), or "
            "resume it without flatzero.patch_deepspeed() / flatzero.run"
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
