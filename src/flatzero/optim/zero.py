"""``ZeroOptimizer``: ZeRO stage 1 and 2 over flatzero's flat buffers, the PyTorch door.

Per (param group, dtype) the model's params are views of flat bucket buffers; this rank
owns an fp32 master shard (one flat tensor) and an fp32 gradient shard of the same
layout; the wrapped ``torch.optim`` optimizer sees the master shard as the one param of
its group. A step: reduce the gradients (``reducers``) -> unscale, check for overflow
(fp16), global norm and clipping with one all-reduce -> inner step -> cast the master
shard into this rank's slice of every bucket -> all-gather every bucket.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import check_same_everywhere, rank_of, world_size_of
from ..config import FlattenConfig
from ..control import every_rank_or_none
from ..gcpause import paused_gc
from ..own_groups import collective_group, control_group
from ..report import report_is_owned
from ..roll_call import progress_of
from ..words import plural
from . import torch_clip
from .agreement import meaning, setup_fields
from .config import OffloadConfig, ZeroConfig, zero_config_for
from .gather import full_param, full_params
from .inner import (
    build_inner_optimizer,
    check_optimizer_class,
    optimizer_class_of,
    with_fused_default,
)
from .offload import OffloadHostBytes
from .overlap import ParamGather, param_gather_for
from .prepare import (
    allocate_grad_shards,
    check_buckets_usable,
    flat_params_for,
    make_reducer,
    whole_pieces,
)
from .reducers import GradReducer
from .scaler import loss_scaler_for
from .state import GroupState, ShardedOptimizerState, check_loadable, check_options
from .stepper import ShardStepper, make_stepper, masters_to_host

__all__ = ["ZeroOptimizer"]

logger = logging.getLogger(__name__)


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
        process_group: ranks to shard over; ``None``: the default group (made from the
            launcher's environment, as ``flatzero.initialize`` does, when torchrun started
            several processes and none made it), else this process alone.
        config: gradient reduction, clipping, loss scaling, ... (``ZeroConfig``).
        flatten_config: how to flatten (bucket size, tier, ...); by default
            ``FlattenConfig(device=<the params' device>)``: the params stay where they are.
        elementwise_optimizer: ``True`` vouches that an optimizer class flatzero does not
            know updates each element from its own gradient and state only.
        offload_optimizer: ``True`` or an ``OffloadConfig``: optimizer offload (ZeRO-Offload;
            overrides ``config.offload_optimizer``): master shards, optimizer state and a
            gradient shard in host memory, the optimizer stepping there with torch's fused
            CPU kernel; the master shards are built in host memory straight from the
            buckets. The optimizer must be able to step host tensors.
        **defaults: keyword arguments of the optimizer (``lr=...``, ``betas=...``, ...).
            Unless they (or a group's options) give ``fused`` or ``foreach`` a value other
            than ``None``, the optimizer's fused kernel is used where it has one for the
            device (Adam, AdamW, SGD, Adagrad): it steps the flat shard in one pass; pass
            ``fused=False`` to opt out.

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
        offload_optimizer: bool | OffloadConfig | None = None,
        **defaults: Any,
    ) -> None:
        refused: BaseException | None = None  # raised on every rank by flat_params_for
        setup: dict[str, str] = {}
        try:
            config = zero_config_for(config, stage, offload_optimizer)
            optimizer_cls = check_optimizer_class(optimizer, elementwise=elementwise_optimizer)
            keywords = {**getattr(optimizer, "keywords", {}), **defaults}
            setup = setup_fields(config, optimizer_cls, keywords)
        except (ValueError, TypeError) as e:
            refused = e
        offload = config.offload_optimizer if refused is None else None
        flat = flat_params_for(
            params,
            optimizer,
            defaults,
            setup,
            process_group=process_group,
            flatten_config=flatten_config,
            offload=offload is not None,
            refused=refused,
        )
        check_buckets_usable(flat, offload=offload is not None)
        if offload is not None:
            masters_to_host(flat)
        self.flat = flat
        self.config = config
        self._pg = collective_group(flat.process_group)  # reductions, gathers, the norm
        self._world_size = world_size_of(self._pg)
        self._rank = rank_of(self._pg)
        self._progress = progress_of(self._pg)  # steps taken, for a failed collective's roll call
        self._grads = allocate_grad_shards(flat)
        self._stepper: ShardStepper = make_stepper(flat, self._grads, offload)
        """Where the inner optimizer steps: beside the buckets, or on the host (offload)."""
        self._masters: list[nn.Parameter] = []
        for group, grad in zip(flat.groups, self._stepper.step_grads, strict=True):
            master = nn.Parameter(group.master, requires_grad=True)
            master.grad = grad
            self._masters.append(master)
        options = [g.options for g in flat.groups]
        self.inner = build_inner_optimizer(
            optimizer,
            self._masters,
            options,
            with_fused_default(optimizer, defaults, options, self._stepper.step_device),
            whole_pieces(flat, optimizer),
        )
        self._scaler = loss_scaler_for(config.loss_scale, [g.dtype for g in flat.groups])
        self._gather: ParamGather | None = None  # overlapped gathers (overlap_with)
        if isinstance(params, nn.Module) and config.overlap_param_gather:
            self.overlap_with(params)
        self._reducer: GradReducer = make_reducer(flat, self._grads, config)
        self._reducer.on_chunk_landed = self._stepper.chunk_hook
        self._clip_request: float | None = None
        self._norm_cache: tuple[int, torch.Tensor] | None = None
        self._last_norm: torch.Tensor | None = None
        self.last_step_skipped = False
        """Whether the last ``step()`` was skipped for an fp16 overflow."""
        self._init_optimizer_plumbing()
        torch_clip.register(self, (p for g in flat.groups for p in g.params))
        if self._rank == 0 and not report_is_owned():  # the door's report holds it
            logger.info(
                "ZeroOptimizer stage %d over %s: %s, %s, %s%s",
                config.stage,
                plural(self._world_size, "rank"),
                plural(len(flat.groups), "group"),
                optimizer_class_of(self.inner).__name__,
                plural(flat.layout.num_params, "param"),
                self._stepper.describe(),
            )

    def _init_optimizer_plumbing(self) -> None:
        """``torch.optim.Optimizer``'s hooks and step patching, without its param
        bookkeeping: ``param_groups`` and ``state`` are the inner optimizer's."""
        self.defaults = self.inner.defaults
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self._patch_step_function()

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
    def offload_optimizer(self) -> OffloadConfig | None:
        """The optimizer offload settings (None: the optimizer steps beside the buckets)."""
        return self.config.offload_optimizer

    def offload_host_bytes(self) -> OffloadHostBytes | None:
        """Host bytes of optimizer offload on this rank now (master shards, host gradient
        shards, optimizer state), measured from the tensors; None without offload."""
        return self._stepper.host_bytes(self.inner, self.master_shards)

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss scaling)."""
        return self._scaler.scale if self._scaler is not None else 1.0

    @property
    def last_grad_norm(self) -> float | None:
        """Global norm of the averaged, unscaled gradient at the last step, when that step
        computed it (clipping or loss scaling on); inf/nan for an fp16 overflow. Reading it
        waits for the device (``last_grad_norm_tensor`` does not)."""
        return None if self._last_norm is None else float(self._last_norm)

    @property
    def last_grad_norm_tensor(self) -> torch.Tensor | None:
        """``last_grad_norm`` as the step's 0-d float64 tensor, on its device (no sync)."""
        return self._last_norm

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
        """Stage 1: the flat gradient buffer of every group, in
        ``config.accumulation_dtype`` of its params' dtype (params' ``.grad`` are views of it
        when that is their dtype; at world size 1 an fp32 buffer is the group's gradient
        shard). Stage 2: empty (gradients live only in staging buffers and the shards)."""
        return list(getattr(self._reducer, "flat_grads", []))

    def gradient_bytes(self) -> int:
        """Bytes of gradient storage this optimizer holds now: gradient shards, staging
        buffers and (stage 1) the flat gradient buffers."""
        buffers = {t.data_ptr(): t.nbytes for t in [*self._grads, *self.flat_grad_buffers]}
        return sum(buffers.values()) + self._reducer.staging_bytes

    def held_gradient_peak_bytes(self) -> int:
        """Most bytes of autograd's own gradients this rank held at once, each waiting for
        the last gradient of its reduction chunk (stage 2 over several ranks, since the
        optimizer was built; 0 where gradients are written on arrival). Device memory,
        beside ``gradient_bytes()``: host memory on a machine without an accelerator."""
        return int(getattr(self._reducer, "held_peak", 0))

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
        sq = self._reducer.sq_norm(self._grads, self._pg)
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
        when no backward pass reached the params since the last step. The norm and the
        clip coefficient stay on the device: no host sync, except the one read of the
        inf/nan verdict with loss scaling (fp16), which decides whether to skip. With
        optimizer offload the host also waits for the gradients' (and the coefficient's)
        copies, on their events, before it steps them (``stepper.py``, ``offload.py``).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.wait_for_params()
        reducer = self._reducer
        reducer.finish()
        if not reducer.backward_seen:
            raise RuntimeError(
                "ZeroOptimizer.step() was called but no backward pass reached the params "
                "since the last step or zero_grad(); call loss.backward() first (step() ends "
                "the accumulation window, so every step needs its own backward pass)"
            )
        reducer.agree_order()
        if self._gather is not None:
            self._gather.agree()  # the order learned from the first forward, once
        self._stepper.after_backward()  # overlaps the norm's all-reduce
        max_norm = self.config.max_grad_norm
        if self._clip_request is not None:
            max_norm = self._clip_request if max_norm is None else min(max_norm, self._clip_request)
        inv = 1.0 / (self._world_size * self.loss_scale)
        coef: float | torch.Tensor = inv
        if hasattr(self.inner, "grads_to_updates"):  # [Note: updates before the norm]
            self.inner.grads_to_updates(inv)
            self._norm_cache = None
        self.last_step_skipped = False
        self._last_norm = None
        if max_norm is not None or self._scaler is not None:
            norm = self._last_norm = self._norm()
            if self._scaler is not None and not bool(norm.isfinite()):
                self._stepper.abandon()  # the next backward pass rewrites what it reads
                self._progress.steps += 1
                self._scaler.update(found_inf=True)
                self.last_step_skipped = True
                self._end_window()
                return loss
            if max_norm is not None:
                clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)
                coef = (clip * inv).to(device=self._grads[0].device, dtype=torch.float32)
        reducer.settle_check()  # before the update; no-op when the norm carried it
        self.flat.before_state_changes()  # a pending snapshot's copies
        self._stepper.step(self.inner, coef)
        self._progress.steps += 1
        if self._scaler is not None:
            self._scaler.update(found_inf=False)
        if self._gather is not None:
            self._gather.launch()  # waited for by the next forward, bucket by bucket
        else:
            self._stepper.write_back(self.master_shards)
        self._end_window()
        return loss

    def _end_window(self) -> None:
        self._reducer.reset_window()
        self._clip_request = None
        self._norm_cache = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a new accumulation window (gradients so far are dropped).

        Stage 2 params never hold ``.grad``, nor do stage 1 params whose gradients
        accumulate in another dtype (``ZeroConfig.grad_accum_dtype``). Otherwise in stage 1
        the ``.grad`` of every param stays a view of the flat gradient buffer, zeroed in
        place whatever ``set_to_none`` says (freeing it would free nothing)."""
        self.wait_for_params()
        self._end_window()

    # ------------------------------------------------------------------ overlap
    def overlap_with(self, module: nn.Module) -> None:
        """Overlap later steps' parameter all-gathers with ``module``'s forward
        (``ZeroConfig.overlap_param_gather``, ``optim/overlap.py``); once, before a forward.
        Raises ``ValueError`` with optimizer offload."""
        if self._gather is None:
            self._gather = param_gather_for(self.flat, self._pg, module, self.config)

    def wait_for_params(self) -> None:
        """Wait for the param all-gathers ``step()`` left running; call it before reading
        ``p.data`` outside a forward (an EMA copy). State dicts, saves, steps wait anyway."""
        self.flat.wait_for_params()

    # -------------------------------------------------------------- reading full params
    def full_param(self, name: str) -> torch.Tensor:
        """The fp32 master value of param ``name``, gathered from all ranks (a new tensor
        shaped like the param). Collective: every rank must call it with the same name."""
        self.wait_for_params()
        return full_param(self.flat, name)

    def full_params(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """``{name: fp32 master value}`` of ``names`` (default: every flattened param),
        gathering each bucket once. Collective: every rank must call it with the same
        names."""
        self.wait_for_params()
        return full_params(self.flat, names)

    # ------------------------------------------------------------------ state
    def sharded_state(self) -> ShardedOptimizerState:
        """This rank's shard of the optimizer (what checkpoints save): master shards, inner
        optimizer state and hyperparameters, loss scaler, bucket order, and the layout they
        belong to. Tensors are references; copy them to keep a snapshot."""
        self.wait_for_params()
        inner = self.inner.state_dict()
        groups = tuple(
            GroupState(
                master.detach(),
                inner["state"].get(gi, {}),
                {k: v for k, v in options.items() if k != "params"},
            )
            for gi, (master, options) in enumerate(
                zip(self._masters, inner["param_groups"], strict=True)
            )
        )
        return ShardedOptimizerState(
            layout_digest=self.flat.layout.digest(),
            world_size=self._world_size,
            rank=self._rank,
            stage=self.config.stage,
            groups=groups,
            loss_scaler=self._scaler.state_dict() if self._scaler is not None else None,
            bucket_order=tuple(self._reducer.order),
            optimizer=optimizer_class_of(self.inner).__name__,
        )

    def load_sharded_state(self, state: ShardedOptimizerState) -> None:
        """Load ``sharded_state()``'s output of the same rank and layout; update the params.

        Collective (the params are all-gathered): every rank loads its own shard. Every
        rank checks its shard first and all agree; on any error every rank raises
        ``ValueError`` and nothing is changed.
        """
        self._load(lambda: state)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``sharded_state()`` as a dict (``ShardedOptimizerState.to_state_dict``): this
        rank's shard. Tensors are references (as in ``torch.optim``)."""
        return self.sharded_state().to_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load ``state_dict()``'s output of the same rank and layout, and update the params
        (collective, checked on every rank first: see ``load_sharded_state``)."""
        self._load(lambda: ShardedOptimizerState.from_state_dict(state_dict))

    def _load(self, parse: Callable[[], ShardedOptimizerState]) -> None:
        with every_rank_or_none(
            self.flat.deciders,
            "load_state_dict failed on another rank (see its error); nothing changed",
            catch=(ValueError,),
            error_type=ValueError,
        ):
            state = parse()
            check_loadable(state, self.sharded_state())
            check_options(optimizer_class_of(self.inner), state)
        options = {f"param group {i}": meaning(g.options) for i, g in enumerate(state.groups)}
        check_same_everywhere(  # hyperparameters are not sharded: one rank's would diverge
            "the loaded hyperparameters (every rank must load the same)",
            {k: json.dumps(v, sort_keys=True, default=str) for k, v in options.items()},
            control_group(self.flat.deciders),
            fix="Load on every rank the state dict that rank saved",
        )
        assert state is not None
        self.flat.before_state_changes()  # a pending snapshot's copies
        with torch.no_grad():
            for group, master in zip(state.groups, self._masters, strict=True):
                master.copy_(group.master)
            self.inner.load_state_dict(state.inner_state_dict())
            for master, grad in zip(self._masters, self._stepper.step_grads, strict=True):
                master.grad = grad
            if self._scaler is not None and state.loss_scaler is not None:
                self._scaler.load_state_dict(dict(state.loss_scaler))
            order = state.bucket_order
            self._reducer.set_order(list(order) if order is not None else None)
            self._end_window()
            self._stepper.write_back(self.master_shards)

    def close(self) -> None:
        """Remove the gradient hooks from the params and release them, so that another
        ``ZeroOptimizer`` may manage them; this one cannot reduce gradients after."""
        torch_clip.unregister(p for g in self.flat.groups for p in g.params)
        self._reducer.close()
        if self._gather is not None:
            self._gather.close()  # waits first
