"""``flatzero.initialize``: ``deepspeed.initialize`` for ZeRO stages 0, 1 and 2.

``initialize`` is a sequence of named steps (every user error is raised before anything
is flattened):

1. check the arguments (``_config_argument``);
2. the process group (``flatzero.process_group.ensure_process_group``);
3. the config, parsed once (``config.parse_config``); keys without effect are logged once;
4. the optimizer (``optimizer_choice``: the config's section or the client's) and the
   param groups (``params.collect_param_groups``: ``model_parameters``, the client
   optimizer's groups, or the model's params, named after the model); a probe of the
   scheduler (``lr_scheduler``);
5. the flatten config and its tier (``_flatten_config``, ``_gathering_tier``);
6. the weights in flat buckets (``weights.get_weights``: ``flatten_parameters``, or
   ``loading.load_flat`` for a meta-device model and a safetensors checkpoint), cast to
   the training dtype bucket by bucket;
7. the same weights on every rank (``param_sync``), frozen params and buffers moved to the
   device and dtype (as DeepSpeed's engine does);
8. the ``ZeroOptimizer``, the LR scheduler, the data loader, the ``Engine`` and its report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...comm import check_same_everywhere, rank_of, world_size_of
from ...config import FlattenConfig
from ...devices import activate, resolve_device
from ...flatten.registry import gathering_tier
from ...gcpause import paused_gc
from ...optim import ZeroOptimizer
from ...optim.inner import whole_groups
from ...optim.prepare import whole_setting
from ...own_groups import control_group
from ...params import ParamGroup, collect_param_groups
from ...process_group import ensure_process_group
from ...report import owns_report
from .client import link_client_optimizer
from .compiling import compile_in_place, uncompiled
from .config import EngineConfig, parse_config
from .deepspeed_compat import deepspeed_engine_class
from .door_optimizer import DoorOptimizer
from .engine import Engine
from .errors import UnsupportedFeatureError
from .full_values import register
from .live import release_engines_over, track
from .lr_scheduler import build_scheduler, check_client_scheduler, probe_scheduler
from .optimizer_choice import OptimizerChoice, choose_optimizer
from .param_sync import place_rest, sync_params
from .rank_agreement import agree_on_config, user_errors_agreed
from .report import EngineInitReport
from .safe_full import install
from .weights import Weights, check_checkpoint_argument, get_weights

__all__ = ["initialize"]

logger = logging.getLogger(__name__)


class _Phases:
    """Wall seconds of the named phases of ``initialize``, in order."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - t0


def _config_argument(
    model: Any, mpu: Any, mesh_param: Any, config: Any, config_params: Any, args: Any
) -> Any:
    """Check the arguments DeepSpeed's signature allows and flatzero refuses; the config
    from ``config``, ``config_params`` or ``args.deepspeed_config``."""
    if model is None:
        raise ValueError("flatzero.initialize needs model=; pass the nn.Module to train")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _refuse_wrapped(model)
    if mpu is not None or mesh_param is not None:
        raise UnsupportedFeatureError(
            "mpu/mesh_param ask for model parallelism, which flatzero does not implement: "
            "flatzero is data parallel (ZeRO 0-2) only; drop them",
            key="mpu" if mpu is not None else "mesh_param",
            feature="model parallelism",
        )
    if config is not None and config_params is not None:
        raise ValueError("pass the DeepSpeed config as config= or config_params=, not both")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and args is not None:
        from_args = getattr(args, "deepscale_config", None)  # DeepSpeed's older name
    if config is not None and from_args is not None:
        raise ValueError(
            f"two DeepSpeed configs: args.deepspeed_config={from_args!r} and config= (as "
            "DeepSpeed, flatzero refuses to pick one); drop one of them"
        )
    if config is None:
        config = from_args
    if config is None:
        raise ValueError(
            "flatzero.initialize needs a DeepSpeed config: pass config=dict(...) or the path "
            "of a JSON file (or args with a deepspeed_config attribute)"
        )
    return config


def _wrapper_fix(model: nn.Module) -> str | None:
    """What to pass instead of a model already wrapped for parallelism, or None for a plain
    module."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)):
        return "pass the module it wraps (model.module): flatzero does the data parallelism"
    if any(c.__module__.startswith("torch.distributed.fsdp") for c in type(model).__mro__):
        return "pass the unsharded module: flatzero shards the optimizer state itself (ZeRO)"
    return None


def _refuse_wrapped(model: nn.Module) -> None:
    """A ``TypeError`` for a model wrapped in DDP/DataParallel/FSDP (its all-reduce would run
    beside flatzero's), also under ``torch.compile``'s wrapper."""
    inner = uncompiled(model)
    fix = _wrapper_fix(inner)
    if fix is not None:
        raise TypeError(f"model is a {type(inner).__name__}, already wrapped: {fix}")


def _parsed(config: Any, world_size: int, rank: int, earlier: BaseException | None) -> EngineConfig:
    """The parsed config, the same on every rank: a rank whose config fails to parse (or
    whose arguments were refused: ``earlier``) raises its error and the others a
    ``ValueError`` naming it; configs that parse to different settings are a
    ``ValueError`` on every rank (``agree_on_config``)."""
    with user_errors_agreed("the DeepSpeed config (or initialize's arguments)", None):
        if earlier is not None:
            raise earlier
        cfg = parse_config(config, world_size=world_size)
    agree_on_config(cfg, None)
    if cfg.ignored and rank == 0:
        logger.warning(
            "flatzero.initialize: these config keys have no effect in flatzero: %s",
            cfg.ignored_summary(),
        )
    return cfg


def _optimizer_and_groups(
    optimizer: Any,
    cfg: EngineConfig,
    model: nn.Module,
    model_parameters: Any,
    lr_scheduler: Any,
    checkpoint: Any,
) -> tuple[OptimizerChoice, list[ParamGroup]]:
    """The optimizer, the param groups, a probe of the scheduler and the checkpoint
    argument, checked on every rank before the first collective that needs them: a user
    error on one rank (its client optimizer, an empty param group, a scheduler parameter)
    is an error on every rank (``user_errors_agreed``), never a hang in the flatten's
    collectives."""
    with user_errors_agreed("flatzero.initialize's optimizer, params or scheduler", None):
        choice = choose_optimizer(optimizer, cfg, model, model_parameters)
        groups = collect_param_groups(choice.params, names_from=model, where=choice.where)
        probe_scheduler(cfg.scheduler, [choice.lr_of(g) for g in groups])
        check_client_scheduler(lr_scheduler, choice.client)
        kind = check_checkpoint_argument(groups, checkpoint)
    what = "checkpoint= (every rank must load the same)"
    fix = "Pass the same checkpoint= on every rank, on a file system every rank shares"
    check_same_everywhere(what, {"kind": kind}, control_group(None), fix=fix)
    return choice, groups


def _gathering_tier(
    config: FlattenConfig, target: torch.device, param_sync: str, stage0: bool, world_size: int
) -> FlattenConfig:
    """The ``sharded`` tier for host buffers at several ranks when the weights are to be
    gathered anyway (``param_sync="gather"``): each rank then copies only its own slice of
    every bucket and the all-gather fills the rest, instead of copying the whole model
    and all-gathering it afterwards (a second pass over every byte). ``auto`` picks
    ``sharded`` on its own when the buffers go to a GPU."""
    sharded = (
        config.tier == "auto"
        and target.type == "cpu"
        and param_sync == "gather"
        and not stage0
        and world_size > 1
    )
    if not sharded:
        return config
    reason = (
        "the weights are all-gathered anyway (param_sync: gather): each rank fills only its "
        "own slice of every host bucket"
    )
    return dataclasses.replace(config, tier=gathering_tier(), tier_reason=reason)


def _flatten_config(cfg: EngineConfig) -> FlattenConfig:
    """The config's ``FlattenConfig`` and its tier, with this rank's device made current
    (as DeepSpeed's engine does: its GPU is ``LOCAL_RANK``'s, unless the script chose one,
    whoever created the process group)."""
    target = resolve_device(cfg.flatten.device, None)
    activate(target)
    return _gathering_tier(
        cfg.flatten, target, cfg.flatzero.param_sync, cfg.replicated, cfg.batch.world_size
    )


def _whole_where_stepped_whole(
    config: FlattenConfig, choice: OptimizerChoice, groups: list[ParamGroup]
) -> FlattenConfig:
    """``config`` with whole params in the groups the optimizer steps whole (Muon's)."""
    whole = whole_groups(choice.cls, [g.options for g in groups])
    if not any(whole):
        return config
    return dataclasses.replace(config, whole_params=whole_setting(whole))


def _agree_on_weights(model: nn.Module, weights: Weights, cfg: EngineConfig) -> str:
    """The same weights on every rank (unless all read them from a checkpoint), and the
    rest of the model on the device; returns what made the weights agree."""
    mode = cfg.flatzero.param_sync
    if weights.from_checkpoint:
        sync = "nothing (all ranks read the checkpoint)"
    else:
        sync = sync_params(weights.flat, mode, None, cfg.replicated)
    broadcast = not weights.from_checkpoint and mode != "none"
    place_rest(model, weights.flat, cfg.precision.torch_dtype, None, broadcast, cfg.buffer_dtype)
    return sync


def _dataloader(training_data: Any, collate_fn: Any, cfg: EngineConfig) -> Any:
    """DeepSpeed's loader: a ``DistributedSampler`` and the micro-batch size."""
    if training_data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    world_size = cfg.batch.world_size
    sampler = (
        DistributedSampler(training_data, num_replicas=world_size, rank=rank_of(None))
        if world_size > 1
        else None
    )
    return DataLoader(
        training_data,
        batch_size=cfg.batch.micro_batch_per_gpu,
        sampler=sampler,
        shuffle=sampler is None,
        collate_fn=collate_fn,
        drop_last=cfg.dataloader_drop_last,
    )


def _report(
    cfg: EngineConfig,
    weights: Weights,
    choice: OptimizerChoice,
    scheduler: Any,
    sync: str,
    phases: _Phases,
) -> EngineInitReport:
    flat = weights.flat
    return EngineInitReport(
        flatten=flat.report,
        stage=cfg.zero.stage,
        dtype=cfg.precision.dtype,
        world_size=cfg.batch.world_size,
        rank=rank_of(None),
        params=sum(g.layout.param_numel for g in flat.groups),
        tensors=sum(len(g.params) for g in flat.groups),
        optimizer=choice.name,
        scheduler=type(scheduler).__name__ if scheduler is not None else None,
        source=weights.source,
        param_sync=sync,
        phase_seconds=phases.seconds,
        wall_seconds=time.perf_counter() - phases.start,
        ignored_keys=tuple(k for k, _ in cfg.ignored),
    )


# Over 60 lines only by DeepSpeed's signature and its docstring; the body is the steps.
@paused_gc()
def _scheduler_and_loader(
    lr_scheduler: Any,
    cfg: EngineConfig,
    zero_opt: ZeroOptimizer,
    choice: OptimizerChoice,
    group_count: int,
    data: tuple[Any, Callable[..., Any] | None],
    phases: _Phases,
) -> tuple[Any, Any]:
    """The LR scheduler and the data loader (``data``: the dataset and ``collate_fn``),
    built after the optimizer; an error on one rank is an error on every rank, and the
    optimizer's hooks are then released so that the model stays usable."""
    try:
        with user_errors_agreed("flatzero.initialize's scheduler or data loader", None):
            with phases("scheduler"):
                scheduler = build_scheduler(
                    lr_scheduler, cfg.scheduler, zero_opt, choice.client, group_count
                )
            return scheduler, _dataloader(*data, cfg)
    except BaseException:
        zero_opt.close()
        raise


def _config_in_a_process_group(
    args: Any,
    model: nn.Module | None,
    mpu: Any,
    mesh_param: Any,
    config: Any,
    config_params: Any,
    dist_init_required: bool | None,
) -> tuple[Any, BaseException | None]:
    """The config argument and what refused the arguments (None: nothing), once the
    process group exists; ``args.local_rank`` is set from ``LOCAL_RANK`` as DeepSpeed
    does. A refusal is raised at once without a process group, else handed to every rank
    before its first collective (``_parsed``)."""
    refused: BaseException | None = None
    try:
        config = _config_argument(model, mpu, mesh_param, config, config_params, args)
    except Exception as e:
        if not dist.is_initialized():
            raise  # no process group: no rank can be waiting for this one
        refused = e
    ensure_process_group(dist_init_required)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return config, refused


@owns_report
def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_tag: str | None = None,
    key_map: Callable[[str], str] | None = None,
    init_buffers: Callable[[nn.Module], None] | None = None,
) -> tuple[Engine, ZeroOptimizer, Any, Any]:
    """``deepspeed.initialize`` for ZeRO stages 0, 1 and 2, with flatzero's fast init.

    Call it on every rank (under ``torchrun``, or alone for one rank). The model's
    trainable params become views of flat buckets on the device, cast to the config's
    dtype (``bf16``/``fp16``) as they are copied, bucket by bucket.

    Args:
        args: an ``argparse.Namespace``; its ``deepspeed_config`` is used when ``config``
            is not given (as DeepSpeed does).
        model: the model, on the host, on the GPU, or on the meta device with
            ``checkpoint``; or ``torch.compile(model)``: the engine then trains ``model``
            compiled in place with the same settings (``engine.module`` is ``model``).
        optimizer: a client optimizer: a ``torch.optim.Optimizer`` instance (its class and
            param groups are used; it must not have stepped), or a function params ->
            optimizer. It wins over the config's ``optimizer`` section (a warning), as in
            DeepSpeed.
        model_parameters: the params (or param groups) to train; default: the model's.
        training_data: a ``torch.utils.data.Dataset``; a ``DataLoader`` with a
            ``DistributedSampler`` and ``train_micro_batch_size_per_gpu`` is returned.
        lr_scheduler: a scheduler built over ``optimizer``, or a function optimizer ->
            scheduler. Otherwise the config's ``scheduler`` section, if any.
        distributed_port: unused (the process group comes from torchrun's environment).
        mpu: must be None (no model parallelism).
        dist_init_required: False: require an initialized process group.
        collate_fn: the data loader's ``collate_fn``.
        config: the DeepSpeed config (dict or path of a JSON file).
        mesh_param: must be None.
        config_params: an alias of ``config`` (DeepSpeed's older name).
        checkpoint: for a model on the meta device: a safetensors file or directory
            (``load_flat``: each rank reads only its slices), or a flatzero checkpoint
            directory (its weights are loaded after initialization).
        checkpoint_tag: the tag of a flatzero checkpoint (default: its ``latest``).
        key_map: maps a model param name to its safetensors key.
        init_buffers: computes buffers that a meta-device model needs and the checkpoint
            does not hold (e.g. rotary tables).

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``: the ``Engine``, its
        ``ZeroOptimizer``, the data loader (None without ``training_data``) and the LR
        scheduler (or None).

    Raises:
        UnsupportedFeatureError: the config or the arguments ask for a DeepSpeed feature
            flatzero does not implement (stage 3, NVMe or param offload, ``mpu``, no
            optimizer, an optimizer that is not elementwise, ...); a ``ValueError``.
            ``flatzero.patch_deepspeed()`` hands these to DeepSpeed.
        ValueError / TypeError: a bad config key, argument or model (the message names it
            and the fix).
        Nothing has been flattened when any of these is raised.
    """
    phases = _Phases()
    config, refused = _config_in_a_process_group(
        args, model, mpu, mesh_param, config, config_params, dist_init_required
    )
    wrapper, model = model, uncompiled(model) if isinstance(model, nn.Module) else model
    with phases("config"):
        cfg = _parsed(config, world_size_of(None), rank_of(None), refused)
        choice, groups = _optimizer_and_groups(
            optimizer, cfg, model, model_parameters, lr_scheduler, checkpoint
        )
    release_engines_over(model)  # a live engine over the same params: destroyed (see live.py)
    with phases("flatten"):
        weights = get_weights(
            model,
            groups,
            _whole_where_stepped_whole(_flatten_config(cfg), choice, groups),
            replicated=cfg.replicated,
            checkpoint=checkpoint,
            key_map=key_map,
            init_buffers=init_buffers,
        )
    with phases("sync"):
        sync = _agree_on_weights(model, weights, cfg)
    with phases("optimizer"):
        zero_opt = DoorOptimizer(
            weights.flat,
            choice.cls,
            config=cfg.zero_optimizer,
            elementwise_optimizer=cfg.flatzero.elementwise_optimizer or None,
            **choice.defaults,
        )
    if cfg.zero_optimizer.overlap_param_gather:  # zero_optimization.overlap_comm
        zero_opt.overlap_with(model)
    if choice.client is not None:
        link_client_optimizer(choice.client, zero_opt)  # its schedulers drive flatzero's
    scheduler, dataloader = _scheduler_and_loader(
        lr_scheduler, cfg, zero_opt, choice, len(groups), (training_data, collate_fn), phases
    )
    report = _report(cfg, weights, choice, scheduler, sync, phases)
    engine_class = deepspeed_engine_class() or Engine  # isinstance DeepSpeedEngine if imported
    engine = engine_class(
        model, zero_opt, scheduler, cfg, report, process_group=None,
        training_dataloader=dataloader, client_optimizer=choice.client,
    )  # fmt: skip
    track(engine)
    if not cfg.replicated:  # deepspeed.utils.safe_get_full_* answer for its params
        register(zero_opt)
    if "deepspeed" in sys.modules:
        install()
    if weights.checkpoint_dir is not None:
        engine.load_checkpoint(weights.checkpoint_dir, checkpoint_tag, load_module_only=True)
    if wrapper is not model:  # torch.compile(model): compiled in place (see compiling.py)
        compile_in_place(model, wrapper)
        engine._is_compiled = True
    if rank_of(None) == 0:
        logger.info("%s", report.summary())
    return engine, zero_opt, dataloader, scheduler
