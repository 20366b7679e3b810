"""The DeepSpeed run an export is written for, checked before anything is written.

``deepspeed_target`` reads what a DeepSpeed ZeRO-1/2 checkpoint must agree on from the
flatzero checkpoint (training dtype, stage, optimizer, groups) and, when given, from the
DeepSpeed config the run will use (stage, ``bf16``/``fp16``, ``gradient_clipping``, the
``fp16`` loss-scaler keys, ``round_robin_gradients``, ``parameter_alignment``, batch
sizes, the ``optimizer`` section and optimizer offload, which choose the base optimizer whose
state format is written: ``flatzero.deepspeed.base_optimizer``), and refuses what DeepSpeed
would not load, saying what DeepSpeed needs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint.format import CheckpointMeta, decode_value
from ..optim import ELEMENTWISE_OPTIMIZERS
from .base_optimizer import (
    MUON,
    BaseOptimizer,
    configured_optimizer,
    default_optimizer,
    kernel_hyper_problem,
    offloaded,
)

__all__ = ["GRADIENT_CLIPPING_DEFAULT", "DeepSpeedTarget", "deepspeed_target"]

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TORCH_OPTIMIZERS = tuple(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
_DEEPSPEED_ONLY = (
    "lamb",
    "lion",
    "muadam",
    "muadamw",
    "musgd",
    "onebitadam",
    "zerooneadam",
    "onebitlamb",
)
"""Config optimizer types DeepSpeed builds from its own kernels (not ``torch.optim``)."""

GRADIENT_CLIPPING_DEFAULT = 1.0
"""DeepSpeed's clipping when the config has no ``gradient_clipping`` key (its
``GRADIENT_CLIPPING_DEFAULT``): the global gradient norm is clipped at 1.0; 0 turns it off."""

_FP32_NAMES = ("fp32", "float32", "float", "torch.float32")
"""``data_types.grad_accum_dtype`` values DeepSpeed reads as fp32."""


@dataclass(frozen=True)
class DeepSpeedTarget:
    """What the exported checkpoint is for.

    Attributes:
        world_size: data-parallel ranks of the DeepSpeed run (one optimizer file each).
        stage: ZeRO stage (1 or 2) written as ``zero_stage``.
        dtype: the training dtype (of the params in ``module`` and of the flat groups).
        fp16: the config's ``fp16`` section (loss-scaler keys) when training in fp16,
            else None.
        clip_grad: the config's ``gradient_clipping``; None without a config or for
            ``"auto"`` (the key is then left out and the run's own config applies).
        round_robin: ``zero_optimization.round_robin_gradients``.
        parameter_alignment: ``zero_optimization.parameter_alignment``.
        config: the DeepSpeed config stored as ``ds_config``.
        optimizer: the base optimizer DeepSpeed builds, whose state format is written
            (``flatzero.deepspeed.base_optimizer``); None: the state as the checkpoint
            holds it (torch's, or an imported DeepSpeed checkpoint's own).
    """

    world_size: int
    stage: int
    dtype: torch.dtype
    fp16: Mapping[str, Any] | None
    clip_grad: float | None
    round_robin: bool
    parameter_alignment: bool
    config: Mapping[str, Any]
    optimizer: BaseOptimizer | None = None


def _training_dtype(meta: CheckpointMeta) -> torch.dtype:
    dtypes = sorted({g.dtype for g in meta.layout.groups})
    if len(dtypes) != 1 or dtypes[0] not in _DTYPES:
        raise ValueError(
            f"the checkpoint's params are {dtypes or 'none'}; DeepSpeed trains every param in "
            "one of float32, bfloat16 or float16, so it cannot load this checkpoint"
        )
    return _DTYPES[dtypes[0]]


def _check_groups(meta: CheckpointMeta) -> None:
    indices = [g.group_index for g in meta.layout.groups]
    if indices != list(range(len(indices))):
        raise ValueError(
            f"the checkpoint's layout groups come from param groups {indices}: DeepSpeed "
            "flattens each optimizer param group into one buffer of one dtype and cannot "
            "hold a group without trainable params or with params of two dtypes"
        )


def _check_optimizer(name: str | None, any_optimizer: bool) -> None:
    if name == "Muon":  # torch's, not the DeepSpeed door's DeepSpeedMuon
        raise ValueError(
            "the checkpoint's optimizer is torch.optim.Muon: a DeepSpeed ZeRO-1/2 run cannot "
            "continue it. DeepSpeed's base optimizer steps one flat 1-D partition per group, "
            "which torch's Muon refuses (it steps 2-D params only), and DeepSpeed's own Muon "
            "(optimizer type Muon, MuonWithAuxAdam) runs another update (Newton-Schulz in "
            "fp16/fp32 with its Gram iteration, its own learning-rate scaling). Train with "
            "the DeepSpeed door's Muon config (flatzero.initialize with optimizer.type "
            "Muon), whose checkpoints export to DeepSpeed"
        )
    if name is None or name in _TORCH_OPTIMIZERS or name == "DeepSpeedMuon" or any_optimizer:
        return
    raise ValueError(
        f"the checkpoint's optimizer is {name!r}: DeepSpeed restores the base optimizer with "
        "torch's Optimizer.load_state_dict into the optimizer of its run, which only "
        "torch.optim's elementwise optimizers ("
        + ", ".join(_TORCH_OPTIMIZERS)
        + ") are known to accept from a flatzero checkpoint. If the DeepSpeed run uses "
        f"{name} itself, pass any_optimizer=True (--any-optimizer)"
    )


def _config_optimizer(config: Mapping[str, Any]) -> BaseOptimizer | None:
    """The base optimizer DeepSpeed builds for the config's ``optimizer`` section; None
    without one (the run passes its own, taken to be the checkpoint's class)."""
    section = config.get("optimizer")
    if not isinstance(section, Mapping) or "type" not in section:
        return None
    built = configured_optimizer(config)
    if built is not None:
        return built
    kind = str(section["type"])
    lower = kind.lower()
    if lower == "muon":
        return _muon_optimizer(config)
    if lower in _DEEPSPEED_ONLY or (lower == "adagrad" and offloaded(config)):
        raise ValueError(
            f"ds_config optimizer.type is {kind!r}, which DeepSpeed builds from its own "
            "kernels here: it cannot load a torch.optim optimizer's state from a flatzero "
            "checkpoint; use the optimizer flatzero trained with"
        )
    name = "Adagrad" if lower == "adagrad" else kind
    return BaseOptimizer(name, name)


def _muon_optimizer(config: Mapping[str, Any]) -> BaseOptimizer:
    """DeepSpeed's Muon (``MuonWithAuxAdam``), when the config's run keeps its state in the
    format the export writes (``flatzero.deepspeed.muon_state``)."""
    params = (config.get("optimizer") or {}).get("params") or {}
    if offloaded(config):
        raise ValueError(
            "ds_config has optimizer.type Muon with zero_optimization.offload_optimizer: "
            "DeepSpeed then keeps Muon's momentum per flat partition and steps the Adam "
            "groups with DeepSpeedCPUAdam, and flatzero (which trains Muon without "
            "optimizer offload) does not write that format; drop offload_optimizer"
        )
    if params.get("per_head_muon", False):
        raise ValueError(
            "ds_config optimizer.params.per_head_muon is true: flatzero's Muon "
            "orthogonalizes whole matrices, so its momentum does not continue a per-head "
            "run; remove the key"
        )
    return BaseOptimizer(MUON, "DeepSpeedMuon")


def _check_kernel(meta: CheckpointMeta, built: BaseOptimizer | None) -> None:
    """Every group can continue in DeepSpeed's Adam kernel ``built`` (when it is one)."""
    if built is None or not built.kernel:
        return
    for gi, record in enumerate(meta.groups):
        hyper = {k: decode_value(v) for k, v in record.hyperparams.items()}
        problem = kernel_hyper_problem(hyper, record.states[1:], built.torch_name)
        if problem is not None:
            raise ValueError(
                f"the DeepSpeed run builds {built.describe()}, but the checkpoint's param "
                f"group {gi} has {problem}; give the run's config with optimizer.params."
                f"torch_adam true (DeepSpeed then builds torch.optim.{built.torch_name})"
            )


def _concrete(section: Any) -> dict[str, Any]:
    """A config section without Hugging Face's unresolved ``"auto"`` values."""
    return {k: v for k, v in (section or {}).items() if v != "auto"}


def _configured_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The training dtype the config asks for; None when ``"auto"`` leaves it open."""
    flags = {
        torch.bfloat16: [(config.get(n) or {}).get("enabled", False) for n in ("bf16", "bfloat16")],
        torch.float16: [(config.get("fp16") or {}).get("enabled", False)],
    }
    for dtype, values in flags.items():
        if any(v is True for v in values):
            return dtype
    if any(v == "auto" for values in flags.values() for v in values):
        return None
    return torch.float32


def _clip_grad(value: Any) -> float | None:
    """``gradient_clipping`` as DeepSpeed's ``clip_grad``; None for ``"auto"`` (left out,
    so the run's resolved value applies)."""
    if value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"ds_config gradient_clipping is {value!r}; use a number >= 0")
    return float(value)


def _check_batch(config: Mapping[str, Any], world_size: int) -> None:
    """DeepSpeed needs ``train_batch_size = micro batch * accumulation * world size``."""

    def number(key: str) -> int | None:
        value = config.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    total = number("train_batch_size")
    micro = number("train_micro_batch_size_per_gpu")
    accumulation = number("gradient_accumulation_steps")
    if total is None:
        return
    if micro is not None and accumulation is not None:
        product = micro * accumulation * world_size
        fits, need = total == product, f"{micro} * {accumulation} * {world_size} = {product}"
    else:
        divisor = world_size * (micro or 1) * (accumulation or 1)
        fits, need = total % divisor == 0, f"a multiple of {divisor}"
    if not fits:
        raise ValueError(
            f"world size {world_size} does not fit ds_config's batch sizes: DeepSpeed needs "
            "train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps "
            f"* world size, and train_batch_size {total} is not {need}; export for a world "
            "size that fits, or change the batch sizes in the config"
        )


def _default_target(meta: CheckpointMeta, world_size: int, dtype: torch.dtype) -> DeepSpeedTarget:
    """The target without a DeepSpeed config: the checkpoint's stage and precision,
    DeepSpeed's default optimizer for the checkpoint's (``default_optimizer``)."""
    stage = meta.stage if meta.stage in (1, 2) else 2
    if dtype == torch.float16:
        logger.warning(
            "no ds_config: the fp16 loss scaler is written with DeepSpeed's defaults "
            "(loss_scale_window 1000, hysteresis 2, min_loss_scale 1); pass the config "
            "of the DeepSpeed run to carry its own"
        )
    built = default_optimizer(meta.optimizer)
    _check_kernel(meta, built)
    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
    }
    if built is not None and (built.kernel or built.muon):
        config["optimizer"] = built.config_section()
    fp16 = {} if dtype == torch.float16 else None
    return DeepSpeedTarget(world_size, stage, dtype, fp16, None, False, False, config, built)


def deepspeed_target(
    meta: CheckpointMeta,
    world_size: int,
    ds_config: Mapping[str, Any] | None = None,
    *,
    any_optimizer: bool = False,
) -> DeepSpeedTarget:
    """What to write for a DeepSpeed run of ``world_size`` ranks (and ``ds_config``).

    Raises:
        ValueError: DeepSpeed would not load the result: a bad world size, params of
            several dtypes, a config whose stage, precision, batch sizes or optimizer do
            not fit the checkpoint, an optimizer DeepSpeed cannot restore (each named).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (ranks), got {world_size!r}")
    dtype = _training_dtype(meta)
    _check_groups(meta)
    _check_optimizer(meta.optimizer, any_optimizer)
    if ds_config is None:
        return _default_target(meta, world_size, dtype)
    if not isinstance(ds_config, Mapping):
        raise TypeError(f"ds_config must be a dict (DeepSpeed's config), got {type(ds_config)}")
    zero = ds_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (1, 2):
        raise ValueError(
            f"ds_config zero_optimization.stage is {stage!r}: the export writes a ZeRO stage "
            "1 or 2 checkpoint; set the stage to 1 or 2"
        )
    configured = _configured_dtype(ds_config)
    if configured not in (None, dtype):
        raise ValueError(
            f"the checkpoint trained in {dtype} but ds_config trains in {configured}: enable "
            "the same precision (bf16.enabled / fp16.enabled) in the DeepSpeed config"
        )
    accumulation = str((ds_config.get("data_types") or {}).get("grad_accum_dtype", ""))
    if dtype == torch.bfloat16 and stage == 1 and accumulation in _FP32_NAMES:
        raise ValueError(
            "ds_config trains bf16 ZeRO-1 with data_types.grad_accum_dtype fp32, which "
            "DeepSpeed runs with its BF16_Optimizer: its checkpoint format is not the ZeRO "
            "optimizer's that the export writes; drop grad_accum_dtype or use stage 2"
        )
    built = _config_optimizer(ds_config)
    if built is not None and meta.optimizer is not None and built.torch_name != meta.optimizer:
        raise ValueError(
            f"ds_config's optimizer section builds {built.describe()} but the checkpoint's "
            f"optimizer is {meta.optimizer}: DeepSpeed would load {meta.optimizer}'s state "
            f"into {built.torch_name}; configure {meta.optimizer}"
        )
    if meta.optimizer is None:
        built = None  # an imported checkpoint's state is written as it was read
    _check_kernel(meta, built)
    _check_batch(ds_config, world_size)
    return DeepSpeedTarget(
        world_size=world_size,
        stage=int(stage),
        dtype=dtype,
        fp16=_concrete(ds_config.get("fp16")) if dtype == torch.float16 else None,
        clip_grad=_clip_grad(ds_config.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)),
        round_robin=bool(zero.get("round_robin_gradients", False)),
        parameter_alignment=bool(zero.get("parameter_alignment", False)),
        config=dict(ds_config),
        optimizer=built,
    )
