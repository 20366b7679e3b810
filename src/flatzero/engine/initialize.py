"""``flatzero.initialize``: ``deepspeed.initialize`` for ZeRO stages 0, 1 and 2.

Steps, in order (every user error is raised before anything is flattened):

1. the process group: the default one if initialized, else one from torchrun's
   environment (NCCL with CUDA, gloo without), else a one-process gloo group;
2. the config, parsed once (``parse_config``); keys without effect are logged once;
3. the params and their groups: ``model_parameters``, or the client optimizer's groups,
   or ``model.named_parameters()``; the optimizer class and arguments: the config's
   ``optimizer`` section or the client optimizer (an instance, a class or a function of
   the params); a probe of the scheduler;
4. flattening (``flatten_parameters``, or ``load_flat`` for a meta-device model with a
   safetensors checkpoint), casting params to the training dtype bucket by bucket;
5. making the ranks' weights equal (``flatzero.param_sync``), moving frozen params and
   buffers to the device and dtype (as DeepSpeed's engine does);
6. the ``ZeroOptimizer``, the LR scheduler, the data loader and the ``Engine``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import all_gather_into, rank_of, world_size_of
from ..config import FlattenConfig
from ..devices import activate, collective_device, local_cuda_index, resolve_device
from ..flatten import FlatParams, flatten_parameters
from ..gcpause import paused_gc
from ..launch import free_port
from ..loading import allocate_rest, materialize_rest
from ..optim import ZeroOptimizer
from ..optim.inner import check_optimizer_class
from ..safetensors_index import SafetensorsCheckpoint
from .client import link_client_optimizer
from .config import EngineConfig, parse_config
from .engine import Engine, EngineInitReport
from .errors import UnsupportedFeatureError

__all__ = ["initialize"]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------- process group
def _ensure_process_group(dist_init_required: bool | None) -> None:
    """Initialize the default process group the way ``deepspeed.initialize`` does."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ValueError(
            "dist_init_required=False but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first or drop dist_init_required"
        )
    cuda = torch.cuda.is_available()
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        # Not launched by torchrun (or deepspeed/mpirun): a world of one process.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if cuda:
        torch.cuda.set_device(local_cuda_index())
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=30))
    logger.info(
        "initialized torch.distributed (%s): rank %d of %d",
        dist.get_backend(),
        dist.get_rank(),
        dist.get_world_size(),
    )


# ------------------------------------------------------------------ params and groups
def _param_names(model: nn.Module) -> dict[int, str]:
    """``id(param) -> name`` (the first name of a tied param)."""
    return {id(p): n for n, p in model.named_parameters()}


def _named(items: Iterable[Any], names: dict[int, str], where: str) -> list[tuple[str, Any]]:
    out = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, p = item
        else:
            p = item
            name = names.get(id(p))
            if name is None:
                raise ValueError(
                    f"{where} item {i} (shape {tuple(getattr(p, 'shape', ()))}) is not a "
                    "parameter of model; pass the model's own parameters"
                )
        out.append((name, p))
    return out


def _named_groups(model: nn.Module, params: Any, where: str) -> list[dict[str, Any]]:
    """Param groups as dicts of ``(name, param)`` lists, named after ``model``."""
    names = _param_names(model)
    if params is None:
        return [{"params": list(model.named_parameters())}]
    if isinstance(params, torch.Tensor):
        params = [params]
    items = list(params)
    if items and all(isinstance(g, Mapping) for g in items):
        groups = []
        for gi, g in enumerate(items):
            if "params" not in g:
                raise ValueError(f"{where} group {gi} has no 'params' key")
            ps = g["params"]
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": _named(ps, names, where),
                }
            )
        return groups
    return [{"params": _named(items, names, where)}]


def _client_optimizer(
    optimizer: Any, model: nn.Module, model_parameters: Any
) -> tuple[type, list[dict[str, Any]], torch.optim.Optimizer]:
    """The class and named groups of a client optimizer (an instance, or a callable that
    builds one from the params, as DeepSpeed accepts)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, or a callable taking the params "
                f"and returning one, got {type(optimizer).__name__}"
            )
        params = model_parameters if model_parameters is not None else model.parameters()
        optimizer = optimizer(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"the optimizer callable returned a {type(optimizer).__name__}, not a "
                "torch.optim.Optimizer"
            )
    if isinstance(optimizer, ZeroOptimizer):
        raise TypeError(
            "optimizer is already a ZeroOptimizer; pass the model and a plain torch.optim "
            "optimizer (or a config 'optimizer' section) to flatzero.initialize"
        )
    if any(optimizer.state.values()):
        raise ValueError(
            f"the {type(optimizer).__name__} passed as optimizer already has state (it has "
            "stepped); flatzero builds its own optimizer over the flat shards and cannot carry "
            "that state over: pass a fresh optimizer, and restore state with "
            "engine.load_checkpoint"
        )
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(g["params"])}
        for g in optimizer.param_groups
    ]
    return type(optimizer), _named_groups(model, groups, "optimizer.param_groups"), optimizer


def _expand_per_group(
    kwargs: dict[str, Any], flat: FlatParams, user_groups: int, cls: type
) -> dict[str, Any]:
    """Lists given per user param group become lists per optimizer group (one per group
    and dtype)."""
    if user_groups == len(flat.groups):
        return kwargs
    out = dict(kwargs)
    for key, value in kwargs.items():
        if isinstance(value, list) and len(value) == user_groups:
            out[key] = [value[g.layout.group_index] for g in flat.groups]
    return out


def _probe_scheduler(config: EngineConfig, lrs: list[float]) -> None:
    """Build the config's scheduler on a dummy optimizer with the same groups' lrs, so a
    bad parameter fails before anything is flattened."""
    if config.scheduler is None:
        return
    dummy = torch.optim.SGD(
        [{"params": [nn.Parameter(torch.zeros(1))], "lr": lr} for lr in lrs], lr=lrs[0]
    )
    try:
        config.scheduler.scheduler_class(dummy, **config.scheduler.kwargs())
    except (TypeError, ValueError, KeyError) as error:
        raise ValueError(
            f"config key 'scheduler' ({config.scheduler.type} with params "
            f"{dict(config.scheduler.params)}) cannot be built: {error}"
        ) from error


def _track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` as torch's LR schedulers expect (so a scheduler moved onto
    it does not warn that step() was overridden)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(optimizer)
    step = type(optimizer).step

    @functools.wraps(step)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def _is_scheduler(value: Any) -> bool:
    return hasattr(value, "step") and hasattr(value, "optimizer")


def _check_client_scheduler(lr_scheduler: Any, client: torch.optim.Optimizer | None) -> None:
    """A scheduler instance must drive the client optimizer (checked before flattening)."""
    if lr_scheduler is None:
        return
    if _is_scheduler(lr_scheduler):
        if client is None or lr_scheduler.optimizer is not client:
            raise ValueError(
                "lr_scheduler is an instance built over another optimizer than the one passed "
                "to flatzero.initialize; pass a function optimizer -> scheduler instead "
                "(lr_scheduler=lambda opt: torch.optim.lr_scheduler.X(opt, ...))"
            )
    elif not callable(lr_scheduler):
        raise TypeError(
            f"lr_scheduler must be a scheduler or a function optimizer -> scheduler, got "
            f"{type(lr_scheduler).__name__}"
        )


def _build_scheduler(
    lr_scheduler: Any,
    config: EngineConfig,
    optimizer: ZeroOptimizer,
    client: torch.optim.Optimizer | None,
    user_groups: int,
) -> Any:
    if lr_scheduler is None:
        if config.scheduler is None:
            return None
        cls = config.scheduler.scheduler_class
        kwargs = _expand_per_group(config.scheduler.kwargs(), optimizer.flat, user_groups, cls)
        return cls(optimizer, **kwargs)
    if _is_scheduler(lr_scheduler):
        if len(optimizer.param_groups) != len(client.param_groups):
            raise ValueError(
                f"lr_scheduler was built over {len(client.param_groups)} param groups but "
                f"flatzero's optimizer has {len(optimizer.param_groups)} (one per group and "
                "dtype); pass a function optimizer -> scheduler instead"
            )
        # The groups were built from the client's (with the scheduler's lr and initial_lr).
        lr_scheduler.optimizer = optimizer
        _track_step_calls(optimizer)
        return lr_scheduler
    return lr_scheduler(optimizer)


# ----------------------------------------------------------------------- weights
def _is_flatzero_checkpoint(path: Path) -> bool:
    return path.is_dir() and ((path / "latest").is_file() or (path / "meta.json").is_file())


def _trainable_dtypes(groups: list[dict[str, Any]]) -> str:
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for g in groups for _, p in g["params"]})
    return "/".join(dtypes)


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
    return dataclasses.replace(config, tier="sharded") if sharded else config


_CHECKSUM_CHUNK = 2**24
"""Elements summed at a time by ``bitwise_sum`` (its scratch is 128 MiB of int64 at most)."""


def bitwise_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum of ``t``'s elements read as integers of the same width (an int64 scalar on
    ``t``'s device): equal on two ranks when their bits are, and computed chunk by chunk,
    never as a widened copy of the whole bucket."""
    words = t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])
    total = torch.zeros((), dtype=torch.int64, device=t.device)
    for lo in range(0, words.numel(), _CHECKSUM_CHUNK):
        total += words[lo : lo + _CHECKSUM_CHUNK].sum(dtype=torch.int64)
    return total


@torch.no_grad()
def _sync_params(flat: FlatParams, mode: str, group: Any, replicated: bool) -> str:
    """Make every rank's initial weights equal; returns what was done."""
    if world_size_of(group) == 1 or mode == "none":
        return "nothing (one rank)" if world_size_of(group) == 1 else "none"
    if mode == "check":
        sums = torch.stack([bitwise_sum(b) for g in flat.groups for b in g.buckets]).to(
            collective_device(group, flat.groups[0].device)
        )
        gathered = [torch.empty_like(sums) for _ in range(world_size_of(group))]
        dist.all_gather(gathered, sums, group=group)
        if any(not torch.equal(gathered[0], s) for s in gathered[1:]):
            raise ValueError(
                "the model's initial weights differ between ranks (flatzero.param_sync='check'); "
                "build the model with the same seed on every rank, or use param_sync='gather'"
            )
        return "check (equal on all ranks)"
    if replicated:
        works = [
            dist.broadcast(b, src=0, group=group, async_op=True)
            for g in flat.groups
            for b in g.buckets
        ]
        for work in works:
            work.wait()
        for g in flat.groups:  # the one-rank master is the whole bucket
            if g.master is not None:
                for b in range(len(g.buckets)):
                    g.master_slice(b).copy_(g.bucket_shard(b))
        return "broadcast from rank 0"
    if all(t == "sharded" for g in flat.report.groups for t in g.bucket_tiers):
        return "the sharded tier's all-gather"
    works = []
    for g in flat.groups:
        for b in range(len(g.buckets)):
            works.append(all_gather_into(g.buckets[b], g.bucket_shard(b), group, async_op=True))
    for work in works:
        work.wait()
    return "gather (each rank's slice of every bucket)"


@torch.no_grad()
def _place_rest(
    model: nn.Module,
    flat: FlatParams,
    device: torch.device,
    dtype: torch.dtype | None,
    group: Any,
    broadcast: bool,
) -> None:
    """Frozen params and buffers to ``device`` (floating ones to ``dtype``), as DeepSpeed's
    engine moves and casts the whole module; with ``broadcast``, rank 0's values win."""
    flattened = {id(p) for g in flat.groups for p in g.params}
    tensors = []
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in flattened:
                continue
            target = dtype if (dtype is not None and p.is_floating_point()) else p.dtype
            if p.device != device or p.dtype != target:
                p.data = p.data.to(device=device, dtype=target)
            tensors.append(p.data)
        for name, b in list(module._buffers.items()):
            if b is None:
                continue
            target = dtype if (dtype is not None and b.is_floating_point()) else b.dtype
            if b.device != device or b.dtype != target:
                module._buffers[name] = b = b.to(device=device, dtype=target)
            tensors.append(b)
    if broadcast and world_size_of(group) > 1:
        for t in tensors:
            dist.broadcast(t, src=0, group=group)


def _dataloader(
    training_data: Any, collate_fn: Any, cfg: EngineConfig, rank: int, world_size: int
) -> Any:
    """DeepSpeed's loader: a ``DistributedSampler`` and the micro-batch size."""
    if training_data is None:
        return None
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = (
        DistributedSampler(training_data, num_replicas=world_size, rank=rank)
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


# ------------------------------------------------------------------------ initialize
@paused_gc()
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
            ``checkpoint``.
        optimizer: a client optimizer: a ``torch.optim.Optimizer`` instance (its class and
            param groups are used; it must not have stepped), or a function params ->
            optimizer. Mutually exclusive with the config's ``optimizer`` section.
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
            flatzero does not implement (stage 3, offload, ``mpu``, no optimizer, an optimizer
            that is not elementwise, ...); a ``ValueError``. ``flatzero.patch_deepspeed()``
            hands these to DeepSpeed.
        ValueError / TypeError: a bad config key, argument or model (the message names it
            and the fix).
        Nothing has been flattened when any of these is raised.
    """
    t_start = time.perf_counter()
    phases: dict[str, float] = {}
    if model is None:
        raise ValueError("flatzero.initialize needs model=; pass the nn.Module to train")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if mpu is not None or mesh_param is not None:
        raise UnsupportedFeatureError(
            "mpu/mesh_param ask for model parallelism, which flatzero does not implement: "
            "flatzero is data parallel (ZeRO 0-2) only; drop them",
            key="mpu" if mpu is not None else "mesh_param",
            feature="model parallelism",
        )
    if config is None:
        config = config_params
    elif config_params is not None:
        raise ValueError("pass the DeepSpeed config as config= or config_params=, not both")
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None)
    if config is None:
        raise ValueError(
            "flatzero.initialize needs a DeepSpeed config: pass config=dict(...) or the path "
            "of a JSON file (or args with a deepspeed_config attribute)"
        )
    _ensure_process_group(dist_init_required)
    group = None
    rank, world_size = rank_of(group), world_size_of(group)
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))

    t0 = time.perf_counter()
    cfg = parse_config(config, world_size=world_size)
    if cfg.ignored and rank == 0:
        logger.warning(
            "flatzero.initialize: these config keys have no effect in flatzero: %s",
            cfg.ignored_summary(),
        )

    # Params, groups, the optimizer class and its arguments.
    client = None
    if optimizer is not None:
        if cfg.optimizer is not None:
            raise ValueError(
                "an optimizer was passed to flatzero.initialize and the config has an "
                "'optimizer' section; give one of them"
            )
        optimizer_cls, groups, client = _client_optimizer(optimizer, model, model_parameters)
        try:
            check_optimizer_class(
                optimizer_cls, elementwise=cfg.flatzero.elementwise_optimizer or None
            )
        except TypeError as error:
            raise UnsupportedFeatureError(
                f"optimizer: {error}", key="optimizer", feature=f"the {optimizer_cls.__name__}"
            ) from None
        defaults: dict[str, Any] = {}
        optimizer_name = f"{optimizer_cls.__name__} (client)"
    elif cfg.optimizer is not None:
        groups = _named_groups(model, model_parameters, "model_parameters")
        optimizer_cls = cfg.optimizer.torch_class
        defaults = cfg.optimizer.kwargs()
        optimizer_name = f"{optimizer_cls.__name__} (config {cfg.optimizer.type})"
    else:
        raise UnsupportedFeatureError(
            "flatzero.initialize needs an optimizer: add an 'optimizer' section to the config "
            "(e.g. {'type': 'AdamW', 'params': {'lr': 1e-4}}) or pass optimizer=",
            key="optimizer",
            feature="an engine without an optimizer",
        )
    lrs = [float(g.get("lr", defaults.get("lr", 1e-3))) for g in groups]
    _probe_scheduler(cfg, lrs)
    _check_client_scheduler(lr_scheduler, client)
    phases["config"] = time.perf_counter() - t0

    # Flatten.
    t0 = time.perf_counter()
    stage0 = cfg.zero.stage == 0 and world_size > 1
    opt_group = dist.new_subgroups(group_size=1)[0] if stage0 else group
    flatten_cfg = cfg.flatten_config()
    # As DeepSpeed's engine does: this rank's GPU (LOCAL_RANK, unless the script chose one)
    # becomes the current device, whoever created the process group.
    target = resolve_device(flatten_cfg.device, group)
    activate(target)
    flatten_cfg = _gathering_tier(flatten_cfg, target, cfg.flatzero.param_sync, stage0, world_size)
    flatten = functools.partial(
        flatten_parameters,
        process_group=opt_group,
        config=flatten_cfg,
        agreement_group=dist.group.WORLD if group is None else group,
    )
    on_meta = any(p.device.type == "meta" for g in groups for _, p in g["params"])
    ckpt_dir = None
    source = ""
    if on_meta:
        if checkpoint is None:
            raise ValueError(
                "the model's params are on the meta device; pass checkpoint= (a safetensors "
                "file or directory, or a flatzero checkpoint) to load them from"
            )
        path = Path(checkpoint)
        if _is_flatzero_checkpoint(path):
            # Buckets and the rest get storage (uninitialized, never a second copy of the
            # model); the weights are loaded into them once the engine exists.
            buffers_on_meta = any(b.device.type == "meta" for b in model.buffers())
            if buffers_on_meta and init_buffers is None:
                raise ValueError(
                    "the model has buffers on the meta device; pass init_buffers=fn to compute "
                    "them (a flatzero checkpoint holds only persistent buffers)"
                )
            ckpt_dir = path
            source = "meta+flatzero checkpoint"
            flat = flatten(groups, allocate_only=True)
            allocate_rest(model, flat.groups[0].device)
            if init_buffers is not None:
                init_buffers(model)
        else:
            ckpt = SafetensorsCheckpoint(path)
            source = "meta+safetensors"
            materialize_rest(model, ckpt, key_map or (lambda n: n), target, init_buffers)
            flat = flatten(groups, checkpoint=ckpt, key_map=key_map)
    else:
        if checkpoint is not None:
            raise ValueError(
                "checkpoint= is for models on the meta device; this model has its weights. "
                "Use engine.load_checkpoint(dir) to load a checkpoint into it"
            )
        devices = sorted({str(p.device) for g in groups for _, p in g["params"]})
        source = f"{','.join(devices)} {_trainable_dtypes(groups)}"
        flat = flatten(groups)
    phases["flatten"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    device = flat.groups[0].device
    from_checkpoint = on_meta
    sync = "nothing (all ranks read the checkpoint)" if from_checkpoint else ""
    if not from_checkpoint:
        sync = _sync_params(flat, cfg.flatzero.param_sync, group, stage0)
    _place_rest(
        model,
        flat,
        device,
        cfg.precision.torch_dtype,
        group,
        broadcast=not from_checkpoint and cfg.flatzero.param_sync != "none",
    )
    phases["sync"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    zero_opt = ZeroOptimizer(
        flat,
        optimizer_cls,
        config=cfg.zero_config(),
        elementwise_optimizer=cfg.flatzero.elementwise_optimizer or None,
        **defaults,
    )
    phases["optimizer"] = time.perf_counter() - t0
    if client is not None:
        link_client_optimizer(client, zero_opt)  # schedulers over the client drive flatzero's
    try:
        t0 = time.perf_counter()
        scheduler = _build_scheduler(lr_scheduler, cfg, zero_opt, client, len(groups))
        phases["scheduler"] = time.perf_counter() - t0
        dataloader = _dataloader(training_data, collate_fn, cfg, rank, world_size)
    except BaseException:
        zero_opt.close()  # release the params' hooks: the model stays usable
        raise

    report = EngineInitReport(
        flatten=flat.report,
        stage=cfg.zero.stage,
        dtype=cfg.precision.dtype,
        world_size=world_size,
        rank=rank,
        params=sum(g.layout.param_numel for g in flat.groups),
        tensors=sum(len(g.params) for g in flat.groups),
        optimizer=optimizer_name,
        scheduler=type(scheduler).__name__ if scheduler is not None else None,
        source=source,
        param_sync=sync,
        phase_seconds=phases,
        wall_seconds=time.perf_counter() - t_start,
        ignored_keys=tuple(k for k, _ in cfg.ignored),
    )
    engine = Engine(
        model,
        zero_opt,
        scheduler,
        cfg,
        report,
        process_group=group,
        training_dataloader=dataloader,
        client_optimizer=client,
    )
    if ckpt_dir is not None:
        engine.load_checkpoint(ckpt_dir, checkpoint_tag, load_module_only=True)
    if rank == 0:
        logger.info("%s", report.summary())
    return engine, zero_opt, dataloader, scheduler
