"""``ZeroOptimizer``: ZeRO stage 1 and 2 over flatzero's flat buffers, the PyTorch door.

Per (param group, dtype) the model's params are views of flat bucket buffers; this rank
owns an fp32 master shard (one flat tensor) and an fp32 gradient shard of the same
layout; the wrapped ``torch.optim`` optimizer sees the master shard as the one param of
its group. A step: reduce the gradients (``reducers``) -> unscale, check for overflow
(fp16), global norm and clipping with one all-reduce -> inner step -> cast the master
shard into this rank's slice of every bucket -> all-gather every bucket.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import (
    all_gather_into,
    all_reduce_max,
    check_same_everywhere,
    rank_of,
    world_size_of,
)
from ..config import FlattenConfig
from ..control import control_group
from ..devices import backend_of, buckets_may_use_cuda, collectives_run_on_cpu
from ..flatten import FlatParams, flatten_parameters
from ..flatten.alloc import allocate_agreed
from ..gcpause import paused_gc
from ..layout import GroupLayout
from .buckets import empty_buffer
from .config import LossScaleConfig, ZeroConfig
from .inner import (
    build_inner_optimizer,
    check_optimizer_class,
    takes_grad_scale,
    with_fused_default,
)
from .norm import global_sq_norm
from .reducers import GradReducer, check_unclaimed, make_reducer
from .scaler import LossScaler

__all__ = ["STATE_DICT_FORMAT", "ZeroOptimizer"]

logger = logging.getLogger(__name__)

STATE_DICT_FORMAT = "flatzero.ZeroOptimizer/1"
"""The ``"format"`` entry of ``ZeroOptimizer.state_dict()``."""


def _materialize_params(params: Any) -> Any:
    """``params`` with every iterator turned into a list (they are read twice)."""
    if isinstance(params, (nn.Module, FlatParams, torch.Tensor)):
        return params
    items = list(params)
    out = []
    for item in items:
        params_of = item.get("params") if isinstance(item, dict) else None
        if params_of is not None and not isinstance(params_of, torch.Tensor):
            item = {**item, "params": list(item["params"])}
        out.append(item)
    return out


def _group_options(params: Any) -> list[dict[str, Any]]:
    """The per-group hyperparameters the user passed (for probing the optimizer)."""
    if isinstance(params, FlatParams):
        return [g.options for g in params.groups]
    if isinstance(params, list) and params and all(isinstance(g, dict) for g in params):
        return [{k: v for k, v in g.items() if k != "params"} for g in params]
    return [{}]


def _tensors(params: Any) -> list[torch.Tensor]:
    """The tensors in ``params`` (module, params, pairs, group dicts or ``FlatParams``)."""
    if isinstance(params, FlatParams):
        return [p for g in params.groups for p in g.params]
    if isinstance(params, nn.Module):
        items: list[Any] = list(params.parameters())
    elif isinstance(params, list) and params and all(isinstance(g, dict) for g in params):
        items = [p for g in params for p in g.get("params", [])]
    else:
        items = list(params)
    tensors = [item[1] if isinstance(item, tuple) else item for item in items]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def _setup_fields(
    config: ZeroConfig, optimizer_cls: type, defaults: dict[str, Any]
) -> dict[str, str]:
    """What every rank's optimizer setup must agree on (see ``check_same_everywhere``)."""
    return {
        "ZeroConfig": repr(config),
        "optimizer": optimizer_cls.__qualname__,
        "optimizer arguments": repr(sorted(defaults.items())),
    }


def check_buckets_usable(flat: FlatParams) -> None:
    """Refuse buckets the optimizer's collectives cannot run on: every bucket and master
    shard on one device, which the process group's backend can reduce-scatter on.

    Raises:
        ValueError: naming the devices and the backend, and what to change.
    """
    devices = {str(b.device) for g in flat.groups for b in g.buckets}
    devices |= {str(g.master.device) for g in flat.groups if g.master is not None}
    if len(devices) > 1:
        raise ValueError(
            f"the flat buckets and master shards are on several devices ({sorted(devices)}); "
            "ZeroOptimizer needs them on one device. Flatten again with one tier "
            "(FlattenConfig(tier=...)) or with more free memory"
        )
    device = flat.groups[0].device
    if flat.world_size == 1:
        return
    pg = flat.process_group
    usable = buckets_may_use_cuda(pg) if device.type == "cuda" else collectives_run_on_cpu(pg)
    if not usable:
        raise ValueError(
            f"the flat buckets are on {device} but the process group's backend "
            f"{backend_of(pg)!r} cannot reduce-scatter {device.type} tensors; use a backend "
            f"for {device.type} tensors (nccl for cuda, gloo for cpu, or 'cpu:gloo,cuda:nccl') "
            "or flatten onto the device the backend serves (FlattenConfig(device=...))"
        )


def _allocate_grad_shards(flat: FlatParams) -> list[torch.Tensor]:
    """This rank's fp32 gradient shard of every group, beside its master shard (padding
    zeroed; see ``_zero_padding``).

    Raises:
        MemoryError: on every rank, when some rank could not allocate its shards (the
            params keep their values in the buckets).
    """
    grads = allocate_agreed(
        [
            lambda g=g: empty_buffer(g.layout.shard_numel, torch.float32, g.device)
            for g in flat.groups
        ],
        flat.groups[0].device,
        control_group(flat.deciders),
        what="the fp32 gradient shards",
        nbytes=sum(g.layout.shard_numel for g in flat.groups) * 4,
        after="the params keep their values",
    )
    for grad, g in zip(grads, flat.groups, strict=True):
        _zero_padding(grad, g.layout, flat.rank)
    return grads


def _zero_padding(shard: torch.Tensor, layout: GroupLayout, rank: int) -> None:
    """Zero the padding of a gradient shard; the rest is written (not added) by the first
    reduction of every accumulation window, so it needs no zeroing: a full memset would
    touch every page of the shard once more at init, on a fresh host buffer the slowest
    part of init."""
    gaps = []
    for index, bucket in enumerate(layout.buckets):
        lo, hi = bucket.rank_range(rank)
        base = bucket.shard_offset - lo
        gaps += [shard[base + start : base + end] for start, end in layout.gaps(index, lo, hi)]
    if gaps:
        torch._foreach_zero_(gaps)


def _probe_optimizer(
    optimizer: Callable[..., torch.optim.Optimizer],
    options: list[dict[str, Any]],
    defaults: dict[str, Any],
) -> None:
    """Build the optimizer on dummies so bad arguments fail before anything is flattened."""
    dummies = [nn.Parameter(torch.zeros(1)) for _ in options]
    build_inner_optimizer(optimizer, dummies, options, defaults)


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1/2 data parallelism around any elementwise ``torch.optim`` optimizer.

    Use it like a ``torch.optim`` optimizer (``loss.backward()``, ``opt.step()``,
    ``opt.zero_grad()``), on every rank of the process group, each rank with its own
    micro-batch. Gradients are averaged over ranks (as DDP does) and summed over the
    backward passes of an accumulation window (as plain PyTorch does): to average over
    ``k`` micro-batches, divide each micro-batch's loss by ``k``. ``step()`` ends the
    window: the next backward pass starts from zero gradients (``zero_grad()`` is accepted
    and cheap).

    A trainable param that got no gradient counts as a zero gradient: its elements are
    still stepped (momentum, weight decay), as in any flat-buffer optimizer.

    Construction flattens the params in place (``flatten_parameters``): afterwards each
    param's ``.data`` is a view of a flat bucket buffer; frozen params are untouched.
    Build the ``ZeroOptimizer`` after moving the model to its device and dtype.

    Args:
        params: an ``nn.Module``, its ``parameters()`` or ``named_parameters()``, a list
            of param-group dicts (with per-group ``lr``, ``weight_decay``, ...), or the
            ``FlatParams`` of an earlier ``flatten_parameters`` call (with master shards).
        optimizer: an elementwise ``torch.optim.Optimizer`` class (AdamW, Adam, SGD,
            Adagrad, RMSprop, ...) or a ``functools.partial`` of one.
        stage: ZeRO stage, 1 or 2 (overrides ``config.stage``; default 2).
        process_group: ranks to shard over; ``None``: the default group if
            ``torch.distributed`` is initialized, else this process alone.
        config: gradient reduction, clipping, loss scaling, ... (``ZeroConfig``).
        flatten_config: how to flatten (bucket size, tier, ...); by default
            ``FlattenConfig(device=<the params' device>)``: the params stay where they are.
        elementwise_optimizer: ``True`` vouches that an optimizer class flatzero does not
            know updates each element from its own gradient and state only.
        **defaults: keyword arguments of the optimizer (``lr=...``, ``betas=...``, ...).
            Unless they choose ``fused`` or ``foreach``, the optimizer's fused kernel is
            used where it has one for the device (Adam, AdamW, SGD, Adagrad): it steps
            the flat shard in one pass; pass ``fused=False`` to opt out.

    Attributes:
        flat: the ``FlatParams`` (buckets, layout, master shards).
        config: the ``ZeroConfig`` in use.
        inner: the wrapped optimizer; ``param_groups`` and ``state`` are its own.
    """

    @paused_gc()
    def __init__(
        self,
        params: Any,
        optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        stage: int | None = None,
        process_group: dist.ProcessGroup | None = None,
        config: ZeroConfig | None = None,
        flatten_config: FlattenConfig | None = None,
        elementwise_optimizer: bool | None = None,
        **defaults: Any,
    ) -> None:
        config = config or ZeroConfig()
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a ZeroConfig, got {type(config).__name__}")
        if stage is not None and stage != config.stage:
            config = dataclasses.replace(config, stage=stage)
        optimizer_cls = check_optimizer_class(optimizer, elementwise=elementwise_optimizer)
        params = _materialize_params(params)
        _probe_optimizer(optimizer, _group_options(params), defaults)
        check_unclaimed(t for t in _tensors(params) if isinstance(t, nn.Parameter))

        if isinstance(params, FlatParams):
            flat = params
            if process_group is not None and process_group is not flat.process_group:
                raise ValueError(
                    "process_group differs from the one the FlatParams were flattened over; "
                    "drop the process_group argument"
                )
            if any(g.master is None for g in flat.groups):
                raise ValueError(
                    "the FlatParams have no fp32 master shards (FlattenConfig.build_master="
                    "False); flatten with build_master=True"
                )
            check_same_everywhere(
                "the ZeroOptimizer setup",
                {
                    "layout digest": flat.layout.digest(),
                    **_setup_fields(config, optimizer_cls, defaults),
                },
                control_group(flat.deciders),
            )
        else:
            check_same_everywhere(
                "the ZeroOptimizer setup",
                _setup_fields(config, optimizer_cls, defaults),
                control_group(process_group),
            )
            if flatten_config is None:
                # Like torch.optim, leave the params where they are.
                tensors = sorted(_tensors(params), key=lambda t: not t.requires_grad)
                device = tensors[0].device if tensors else None
                flatten_config = FlattenConfig(
                    device=str(device) if device is not None and device.type != "meta" else None
                )
            flat = flatten_parameters(params, process_group=process_group, config=flatten_config)

        check_buckets_usable(flat)
        self.flat = flat
        self.config = config
        self._pg = flat.process_group
        self._world_size = world_size_of(self._pg)
        self._rank = rank_of(self._pg)
        self._grads = _allocate_grad_shards(flat)
        self._masters: list[nn.Parameter] = []
        for group, grad in zip(flat.groups, self._grads, strict=True):
            master = nn.Parameter(group.master, requires_grad=True)
            master.grad = grad
            self._masters.append(master)
        self.inner = build_inner_optimizer(
            optimizer,
            self._masters,
            [g.options for g in flat.groups],
            with_fused_default(optimizer, defaults, flat.groups[0].device),
        )

        scale_config = config.loss_scale
        if scale_config is None and any(g.dtype == torch.float16 for g in flat.groups):
            scale_config = LossScaleConfig()
        self._scaler = LossScaler(scale_config) if scale_config is not None else None
        self._reducer: GradReducer = make_reducer(flat, self._grads, config)
        self._write_back_plan = [
            (g.bucket_shard(b), g.master_slice(b), g.buckets[b])
            for g in flat.groups
            for b in range(len(g.buckets))
        ]
        self._clip_request: float | None = None
        self._norm_cache: tuple[int, torch.Tensor] | None = None
        self._last_norm: torch.Tensor | None = None
        self.last_step_skipped = False
        """Whether the last ``step()`` was skipped for an fp16 overflow."""

        # torch.optim.Optimizer plumbing, without its param bookkeeping: param_groups and
        # state are the inner optimizer's (see the properties below).
        self.defaults = self.inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self._patch_step_function()
        if self._rank == 0:
            logger.info(
                "ZeroOptimizer stage %d over %d ranks: %d group(s), %s, %d params",
                config.stage,
                self._world_size,
                len(flat.groups),
                type(self.inner).__name__,
                flat.layout.num_params,
            )

    # ----------------------------------------------------------------- torch.optim face
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's param groups: one per (user group, dtype), each holding
        this rank's master shard; change ``lr`` etc. here (LR schedulers do)."""
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's state, keyed by the master shards."""
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: all params are flattened at construction."""
        raise NotImplementedError(
            "ZeroOptimizer flattens all params at construction and cannot add a param group "
            "later; pass every group to the constructor (params=[{...}, {...}])"
        )

    # ----------------------------------------------------------------------- properties
    @property
    def world_size(self) -> int:
        """Ranks the optimizer is sharded over."""
        return self._world_size

    @property
    def rank(self) -> int:
        """This rank."""
        return self._rank

    @property
    def stage(self) -> int:
        """ZeRO stage, 1 or 2."""
        return self.config.stage

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        return self._scaler.scale if self._scaler is not None else 1.0

    @property
    def last_grad_norm(self) -> float | None:
        """Global norm of the averaged, unscaled gradient at the last step, when that step
        computed it (clipping or loss scaling on); inf/nan for an fp16 overflow."""
        return None if self._last_norm is None else float(self._last_norm)

    @property
    def master_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 master shard of every group (the inner optimizer's params)."""
        return [m.detach() for m in self._masters]

    @property
    def grad_shards(self) -> list[torch.Tensor]:
        """This rank's fp32 gradient shard of every group, after ``reduce_gradients()``:
        the sum over ranks and micro-batches of the (loss-scaled) gradients."""
        return list(self._grads)

    @property
    def flat_grad_buffers(self) -> list[torch.Tensor]:
        """Stage 1: the flat gradient buffer of every group (params' ``.grad`` are views of
        it; at world size 1 an fp32 group's buffer is its gradient shard). Stage 2: empty
        (gradients live only in staging buffers and the shards)."""
        return list(getattr(self._reducer, "flat_grads", []))

    def gradient_bytes(self) -> int:
        """Bytes of gradient storage this optimizer holds now: gradient shards, staging
        buffers and (stage 1) the flat gradient buffers."""
        buffers = {t.data_ptr(): t.nbytes for t in [*self._grads, *self.flat_grad_buffers]}
        pool = self._reducer.pool
        return (
            sum(buffers.values())
            + pool.created * (pool.stage_numel + pool.out_numel) * pool.dtype.itemsize
        )

    # ---------------------------------------------------------------------- the step
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (fp16); ``loss`` itself without loss scaling."""
        return loss * self._scaler.scale if self._scaler is not None else loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scale_loss(loss).backward(**kwargs)``."""
        self.scale_loss(loss).backward(**kwargs)

    def reduce_gradients(self) -> None:
        """Finish reducing the gradients of the window so far into ``grad_shards``.

        ``step()`` does this itself; call it to time or inspect the reduction. Stage 1
        reduce-scatters here; stage 2 waits for the reductions started during backward.
        Collective: every rank must call it.
        """
        self._reducer.finish()

    def _norm(self) -> torch.Tensor:
        """The global norm of the averaged, unscaled gradient (0-d float64 tensor)."""
        key = self._reducer.generation
        if self._norm_cache is not None and self._norm_cache[0] == key:
            return self._norm_cache[1]
        sq = global_sq_norm(self._grads, self._pg)
        norm = sq.sqrt() / (self._world_size * self.loss_scale)
        self._norm_cache = (key, norm)
        return norm

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the global gradient norm at the next ``step()``; returns the norm now.

        Use it in place of ``torch.nn.utils.clip_grad_norm_`` (stage 2 params hold no
        ``.grad``): between the last backward pass and ``step()``. The norm is that of the
        averaged, unscaled gradient over all ranks (one all-reduce; collective). With
        ``ZeroConfig.max_grad_norm`` also set, the smaller bound applies.
        """
        if norm_type != 2.0:
            raise ValueError(
                f"ZeroOptimizer.clip_grad_norm_ supports the L2 norm only (norm_type=2.0), "
                f"got norm_type={norm_type}"
            )
        if not max_norm > 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm!r}")
        self._reducer.finish()
        self._clip_request = (
            float(max_norm)
            if self._clip_request is None
            else min(self._clip_request, float(max_norm))
        )
        return self._norm().to(torch.float32)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Reduce, unscale/check/clip, step the inner optimizer, update the params.

        Collective: every rank must call it. Raises ``RuntimeError`` (nothing changed)
        when no backward pass reached the params since the last step.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        reducer = self._reducer
        reducer.finish()
        if not reducer.backward_seen:
            raise RuntimeError(
                "ZeroOptimizer.step() was called but no backward pass reached the params "
                "since the last step or zero_grad(); call loss.backward() first (step() ends "
                "the accumulation window, so every step needs its own backward pass)"
            )
        reducer.agree_order()
        max_norm = self.config.max_grad_norm
        if self._clip_request is not None:
            max_norm = self._clip_request if max_norm is None else min(max_norm, self._clip_request)
        inv = 1.0 / (self._world_size * self.loss_scale)
        coef: float | torch.Tensor = inv
        self.last_step_skipped = False
        self._last_norm = None
        if max_norm is not None or self._scaler is not None:
            norm = self._last_norm = self._norm()
            if self._scaler is not None and not math.isfinite(float(norm)):
                self._scaler.update(found_inf=True)
                self.last_step_skipped = True
                self._end_window()
                return loss
            if max_norm is not None:
                clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)
                coef = (clip * inv).to(device=self._grads[0].device, dtype=torch.float32)
        scaled = isinstance(coef, torch.Tensor) or coef != 1.0
        if scaled and takes_grad_scale(self.inner):
            # The fused kernel divides by grad_scale as it reads the gradient: no extra pass.
            device = self._grads[0].device
            scale = torch.as_tensor(coef, dtype=torch.float32, device=device).reciprocal()
            self.inner.grad_scale = scale  # type: ignore[attr-defined]
            try:
                self.inner.step()
            finally:
                self.inner.grad_scale = None  # type: ignore[attr-defined]
        else:
            if scaled:
                torch._foreach_mul_(self._grads, coef)
            self.inner.step()
        if self._scaler is not None:
            self._scaler.update(found_inf=False)
        self._write_back()
        self._end_window()
        return loss

    def _end_window(self) -> None:
        self._reducer.reset_window()
        self._clip_request = None
        self._norm_cache = None

    def _write_back(self) -> None:
        """Cast the master shards into this rank's bucket slices; all-gather every bucket."""
        works = []
        for shard, master, bucket in self._write_back_plan:
            shard.copy_(master)
            works.append(all_gather_into(bucket, shard, self._pg, async_op=True))
        for work in works:
            if work is not None:
                work.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation window (gradients so far are dropped).

        Stage 2 params never hold ``.grad``. In stage 1 the ``.grad`` of every param stays
        a view of the flat gradient buffer, which is zeroed in place whatever
        ``set_to_none`` says (freeing it would free nothing: the buffer stays).
        """
        self._end_window()

    # -------------------------------------------------------------- reading full params
    def _locate(self, name: str) -> tuple[int, int]:
        for gi, group in enumerate(self.flat.groups):
            if name in group.names:
                return gi, group.names.index(name)
        raise ValueError(
            f"no trainable flattened param is named {name!r} (frozen params and second "
            "names of tied params are not flattened); known names: "
            + ", ".join(n for g in self.flat.groups for n in g.names[:8])
            + ", ..."
        )

    def _gather_bucket(self, gi: int, bucket: int) -> torch.Tensor:
        group = self.flat.groups[gi]
        full = torch.empty(
            group.layout.buckets[bucket].numel, dtype=torch.float32, device=group.device
        )
        all_gather_into(full, group.master_slice(bucket), self._pg)
        return full

    @torch.no_grad()
    def full_param(self, name: str) -> torch.Tensor:
        """The fp32 master value of param ``name``, gathered from all ranks (a new tensor
        shaped like the param). Collective: every rank must call it with the same name."""
        gi, slot_index = self._locate(name)
        slot = self.flat.groups[gi].layout.slots[slot_index]
        full = self._gather_bucket(gi, slot.bucket)
        return full[slot.offset : slot.end].view(slot.spec.shape).clone()

    @torch.no_grad()
    def full_params(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """``{name: fp32 master value}`` of ``names`` (default: every flattened param),
        gathering each bucket once. Collective: every rank must call it with the same
        names."""
        wanted = set(self.flat.named_params()) if names is None else set(names)
        for name in wanted:
            self._locate(name)
        out: dict[str, torch.Tensor] = {}
        for gi, group in enumerate(self.flat.groups):
            for b in range(len(group.buckets)):
                members = [
                    (group.names[i], group.layout.slots[i])
                    for i in group.layout.buckets[b].slots
                    if group.names[i] in wanted
                ]
                if not members:
                    continue
                full = self._gather_bucket(gi, b)
                for name, slot in members:
                    out[name] = full[slot.offset : slot.end].view(slot.spec.shape).clone()
        return out

    # ------------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's shard of the optimizer: master shards, inner optimizer state and
        hyperparameters, loss scaler, and the layout they belong to. Tensors are
        references (as in ``torch.optim``); copy them to keep a snapshot."""
        return {
            "format": STATE_DICT_FORMAT,
            "layout_digest": self.flat.layout.digest(),
            "world_size": self._world_size,
            "rank": self._rank,
            "stage": self.config.stage,
            "master": [m.detach() for m in self._masters],
            "optimizer": self.inner.state_dict(),
            "loss_scaler": self._scaler.state_dict() if self._scaler is not None else None,
            "bucket_order": list(self._reducer.order),
        }

    def _check_state_dict(self, state_dict: Any) -> None:
        if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(
                "not a ZeroOptimizer state dict (its 'format' entry is not "
                f"{STATE_DICT_FORMAT!r}); pass the output of ZeroOptimizer.state_dict()"
            )
        if state_dict.get("layout_digest") != self.flat.layout.digest():
            raise ValueError(
                f"the state dict was saved with another layout (world size "
                f"{state_dict.get('world_size')}; this optimizer has world size "
                f"{self._world_size}), or for other params, groups, dtypes or bucket size. A "
                "shard can only be loaded into the same layout; load a checkpoint at another "
                "world size with flatzero's checkpoint loader, which reshards"
            )
        if state_dict.get("rank") != self._rank:
            raise ValueError(
                f"the state dict holds rank {state_dict.get('rank')}'s shard but this is rank "
                f"{self._rank}; every rank must load its own shard"
            )
        masters = state_dict.get("master")
        if not isinstance(masters, (list, tuple)) or len(masters) != len(self._masters):
            raise ValueError(
                f"the state dict has {len(masters) if isinstance(masters, (list, tuple)) else 0}"
                f" master shards; this optimizer has {len(self._masters)}"
            )
        for i, (saved, mine) in enumerate(zip(masters, self._masters, strict=True)):
            if not isinstance(saved, torch.Tensor) or saved.shape != mine.shape:
                raise ValueError(
                    f"master shard {i} in the state dict has shape "
                    f"{getattr(saved, 'shape', None)}; expected {tuple(mine.shape)}"
                )
        inner = state_dict.get("optimizer")
        if not isinstance(inner, dict) or "param_groups" not in inner or "state" not in inner:
            raise ValueError("the state dict has no valid 'optimizer' entry")
        if len(inner["param_groups"]) != len(self._masters):
            raise ValueError(
                f"the state dict's optimizer has {len(inner['param_groups'])} param groups; "
                f"this optimizer has {len(self._masters)}"
            )
        for key, value in inner["state"].items():
            if not isinstance(key, int) or not 0 <= key < len(self._masters):
                raise ValueError(f"the state dict's optimizer state has an unknown key {key!r}")
            numel = self._masters[key].numel()
            for name, item in value.items():
                if isinstance(item, torch.Tensor) and item.dim() > 0 and item.numel() != numel:
                    raise ValueError(
                        f"optimizer state {name!r} of group {key} has {item.numel()} elements; "
                        f"this rank's shard has {numel}"
                    )
        scaler_state = state_dict.get("loss_scaler")
        if self._scaler is not None:
            LossScaler.check_state_dict(scaler_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load ``state_dict()``'s output of the same rank and layout, and update the params.

        Collective (the params are all-gathered): every rank loads its own shard. Every
        rank checks its shard first and all agree; on any error every rank raises
        ``ValueError`` and nothing is changed.
        """
        error: ValueError | None = None
        try:
            self._check_state_dict(state_dict)
        except ValueError as e:
            error = e
        if all_reduce_max(int(error is not None), control_group(self.flat.deciders)):
            if error is not None:
                raise error
            raise ValueError(
                "load_state_dict failed on another rank (see its error); nothing changed"
            )
        with torch.no_grad():
            for saved, master in zip(state_dict["master"], self._masters, strict=True):
                master.copy_(saved)
            self.inner.load_state_dict(state_dict["optimizer"])
            for master, grad in zip(self._masters, self._grads, strict=True):
                master.grad = grad
            if self._scaler is not None:
                self._scaler.load_state_dict(state_dict["loss_scaler"])
            self._reducer.set_order(state_dict.get("bucket_order"))
            self._end_window()
            self._write_back()

    def close(self) -> None:
        """Remove the gradient hooks from the params and release them, so that another
        ``ZeroOptimizer`` may manage them; this one cannot reduce gradients after."""
        self._reducer.close()
