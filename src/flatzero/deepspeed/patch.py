"""``flatzero.patch_deepspeed()``: ``deepspeed.initialize`` routed through flatzero.

Hugging Face Trainer and Accelerate never call ``flatzero.initialize``: Accelerate looks up
``deepspeed.initialize`` when it prepares the model (``Accelerator._prepare_deepspeed``).
``patch_deepspeed()`` replaces that one function with a router:

- ZeRO stage 1 or 2 with an optimizer flatzero supports: ``flatzero.initialize`` builds the
  engine (an instance of ``deepspeed.DeepSpeedEngine`` for ``isinstance``, with the API
  Accelerate and Trainer use).
- ZeRO stage 0 with DeepSpeed's ``Muon`` optimizer config: flatzero too (Muon, not SGD).
- Everything else goes to the real ``deepspeed.initialize``: stage 0 or 3, NVMe optimizer
  offload (``offload_optimizer.device: cpu`` is flatzero's own), param offload,
  ``mpu``/``mesh_param``, a pipeline module, no optimizer (a frozen reference model),
  optimizers that are not elementwise, and every other config key flatzero refuses with an
  ``UnsupportedFeatureError``.
- A user error (bad value, misspelled key, inconsistent batch sizes) is raised as it is,
  whoever would have run the config.

It also makes ``deepspeed.utils.safe_get_full_*`` answer for flatzero's params
(``engine.safe_full``) and ``deepspeed.utils.zero_to_fp32`` consolidate flatzero's
checkpoints (``zero_to_fp32``).

Every call logs one line on rank 0 (this module's logger) saying which engine runs and
why: INFO for flatzero, WARNING when DeepSpeed takes it. ``python -m flatzero.run``
applies the patch and runs a script unchanged.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..words import plural

__all__ = ["DeepSpeedPatch", "patch_deepspeed", "routing_reason"]

logger = logging.getLogger(__name__)

STAGES = (1, 2)
"""ZeRO stages the router gives to flatzero."""

_ROUTER_MARK = "__flatzero_router__"


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _log(level: int, message: str, *args: Any) -> None:
    if _rank() == 0:
        logger.log(level, message, *args)


def _raw_config(kwargs: dict[str, Any]) -> Mapping[str, Any] | None:
    """The config dict as ``deepspeed.initialize`` would read it, or None when it cannot be
    read (``flatzero.initialize`` then names the problem)."""
    from .engine.config import load_config_dict

    config = kwargs.get("config")
    if config is None:
        config = kwargs.get("config_params")
    if config is None and kwargs.get("args") is not None:
        config = getattr(kwargs["args"], "deepspeed_config", None)
    if config is None:
        return None
    try:
        return load_config_dict(config)
    except (ValueError, TypeError):
        return None


# [Note: Muon at stage 0] DeepSpeed's Muon has silently run plain SGD at stage 0
# (DeepSpeed #8441): its stage 0 optimizers flattened the matrices before Muon saw them.
# flatzero runs stage 0 itself (a stage 1 optimizer over one-rank groups), with each matrix
# whole, so a stage 0 ``Muon`` config goes to flatzero, which orthogonalizes
# (tests/test_deepspeed_muon.py).
def _is_muon(data: Mapping[str, Any]) -> bool:
    """Whether the config's ``optimizer.type`` is DeepSpeed's ``Muon``."""
    section = data.get("optimizer")
    return isinstance(section, Mapping) and str(section.get("type", "")).lower() == "muon"


def routing_reason(**kwargs: Any) -> str | None:
    """Why the router gives a ``deepspeed.initialize`` call to DeepSpeed before asking
    flatzero (the stage, a pipeline module), or None. Reads the arguments only.

    Args:
        **kwargs: the call's keyword arguments (``model``, ``config``, ...).
    """
    try:
        from deepspeed.pipe import PipelineModule as pipeline_module
    except Exception:  # no deepspeed.pipe: nothing to compare with
        pipeline_module = None
    if pipeline_module is not None and isinstance(kwargs.get("model"), pipeline_module):
        return "the model is a deepspeed.pipe.PipelineModule (pipeline parallelism)"
    data = _raw_config(kwargs)
    if data is None:
        return None
    zero = data.get("zero_optimization")
    if zero is None or zero is False:
        stage: Any = 0
    elif zero is True:
        stage = 1
    elif isinstance(zero, Mapping):
        stage = zero.get("stage", 0)
    else:
        return None  # flatzero names the bad value
    if stage == 0 and not isinstance(stage, bool):
        if _is_muon(data):
            return None  # [Note: Muon at stage 0]
        return (
            "ZeRO stage 0 (no 'zero_optimization.stage' 1 or 2): flatzero takes stages "
            f"{' and '.join(map(str, STAGES))}"
        )
    return None


def _flatzero_summary(engine: Any) -> str:
    report = engine.init_report
    offload = ", optimizer offloaded to the host" if engine.zero_cpu_offload() else ""
    return (
        f"ZeRO stage {report.stage}, {report.dtype}, {report.optimizer}{offload}, "
        f"{plural(report.world_size, 'rank')}, {report.params / 1e6:.2f}M params, initialize "
        f"{report.wall_seconds:.2f}s"
    )


def _init_deepspeed_comm() -> None:
    """What ``deepspeed.initialize`` does first: wrap the process group in ``deepspeed.comm``
    (a no-op when Accelerate or the script already did), so ``deepspeed.comm`` calls work."""
    try:
        import deepspeed.comm as ds_comm
        import torch.distributed as dist

        if not ds_comm.is_initialized() and dist.is_initialized():
            ds_comm.init_distributed(dist_backend=dist.get_backend())
    except Exception as error:  # the engine works without it; say so once
        _log(logging.WARNING, "flatzero: deepspeed.comm could not be initialized: %s", error)


def _make_router(original: Callable[..., Any]) -> Callable[..., Any]:
    from . import engine as engine_module
    from .engine.errors import UnsupportedFeatureError

    version = ""
    try:
        import deepspeed

        version = f" {deepspeed.__version__}"
    except Exception:
        pass

    @functools.wraps(original)
    def initialize(
        args: Any = None,
        model: Any = None,
        optimizer: Any = None,
        model_parameters: Any = None,
        training_data: Any = None,
        lr_scheduler: Any = None,
        distributed_port: Any = None,
        mpu: Any = None,
        dist_init_required: bool | None = None,
        collate_fn: Any = None,
        config: Any = None,
        mesh_param: Any = None,
        config_params: Any = None,
    ) -> tuple[Any, Any, Any, Any]:
        kwargs = {
            "args": args,
            "model": model,
            "optimizer": optimizer,
            "model_parameters": model_parameters,
            "training_data": training_data,
            "lr_scheduler": lr_scheduler,
            "mpu": mpu,
            "dist_init_required": dist_init_required,
            "collate_fn": collate_fn,
            "config": config,
            "mesh_param": mesh_param,
            "config_params": config_params,
        }
        reason = routing_reason(**kwargs)
        if reason is None:
            try:
                result = engine_module.initialize(**kwargs, distributed_port=distributed_port)
            except UnsupportedFeatureError as error:
                reason = str(error)
            else:
                summary = _flatzero_summary(result[0])
                _log(logging.INFO, "deepspeed.initialize -> flatzero: %s", summary)
                _init_deepspeed_comm()  # as deepspeed.initialize would; a no-op under Accelerate
                return result
        _log(logging.WARNING, "deepspeed.initialize -> DeepSpeed%s: %s", version, reason)
        if distributed_port is not None:
            kwargs["distributed_port"] = distributed_port
        return original(**kwargs)

    setattr(initialize, _ROUTER_MARK, True)
    return initialize


class DeepSpeedPatch:
    """The handle ``patch_deepspeed()`` returns; ``undo()`` restores ``deepspeed.initialize``.

    Also a context manager: ``with flatzero.patch_deepspeed(): ...`` undoes on exit.

    Attributes:
        original: the ``deepspeed.initialize`` this patch replaced (None for a handle of a
            patch that was already active: undoing it does nothing).
        router: the function ``deepspeed.initialize`` is while the patch is active.
    """

    def __init__(self, module: Any, original: Callable[..., Any] | None, router: Any) -> None:
        self._module = module
        self.original = original
        self.router = router

    @property
    def active(self) -> bool:
        """Whether ``deepspeed.initialize`` is this patch's router now."""
        return self.original is not None and self._module.initialize is self.router

    def undo(self) -> None:
        """Put the original ``deepspeed.initialize`` back (idempotent). If something else
        replaced ``deepspeed.initialize`` after this patch, that is left alone."""
        if self.original is None:
            return
        if self._module.initialize is self.router:
            self._module.initialize = self.original
        elif _rank() == 0:
            logger.warning(
                "flatzero: deepspeed.initialize was replaced after patch_deepspeed(); undo() "
                "leaves it as it is"
            )
        self.original = None

    def __enter__(self) -> DeepSpeedPatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"DeepSpeedPatch(active={self.active})"


def patch_deepspeed() -> DeepSpeedPatch:
    """Route ``deepspeed.initialize`` through flatzero for ZeRO stages 1 and 2.

    Call it once, before the Trainer or Accelerator prepares the model (anywhere before
    ``trainer.train()`` / ``accelerator.prepare()``). Code that did ``from deepspeed import
    initialize`` before the call keeps the original function; Accelerate and Trainer look it
    up at call time. Calling it again while it is active changes nothing (the new handle's
    ``undo()`` does nothing).

    Returns:
        A ``DeepSpeedPatch``; ``undo()`` restores the original ``deepspeed.initialize``.

    Raises:
        ModuleNotFoundError: DeepSpeed is not installed (Trainer and Accelerate need it for
            their DeepSpeed path; without it, call ``flatzero.initialize`` yourself).
    """
    try:
        import deepspeed
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "flatzero.patch_deepspeed() needs DeepSpeed installed (Hugging Face Trainer and "
            "Accelerate only take their DeepSpeed path with it): pip install deepspeed; or "
            "call flatzero.initialize(model=..., config=...) directly",
            name=error.name,
        ) from error
    from . import zero_to_fp32
    from .engine.safe_full import install

    install()  # deepspeed.utils.safe_get_full_* answer for flatzero's params
    zero_to_fp32.install()  # deepspeed.utils.zero_to_fp32 reads flatzero's checkpoints
    current = deepspeed.initialize
    if getattr(current, _ROUTER_MARK, False):
        return DeepSpeedPatch(deepspeed, None, current)
    router = _make_router(current)
    deepspeed.initialize = router
    return DeepSpeedPatch(deepspeed, current, router)
