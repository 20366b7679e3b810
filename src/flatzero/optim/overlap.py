"""The parameter all-gather of a step, overlapped with the next forward pass.

``step()`` ends by casting each rank's master slice into its slice of every bucket and
launching every bucket's all-gather asynchronously (``ParamGather.launch``); it returns
without waiting. A forward pre-hook on every module that owns flattened params waits for
the gathers of those params' buckets just before the module runs, so bucket ``k``'s
gather hides behind the compute of the modules before its first use. Everything else
that reads the params waits for all of them first (``wait_all``): the next step,
``zero_grad``, state dicts, checkpoints, loads, ``close``, ``module.state_dict()``.

[Note: learned order, checked first forward] Gathers run in the order they are launched,
so the launch order is the order the forward first reads the buckets, recorded during
the forward passes before the first step (rank 0's, broadcast once: every rank launches
the same collectives in the same order). During those passes a torch-function mode
watches every op of the root module's forward: an op that reads a bucket no pre-hook has
waited for yet (a parent reading a child's param, ``F.linear(x, self.child.weight)``)
makes overlap unsafe for this model; all ranks then agree to wait for every gather in
``step()`` as before (one warning).

[Note: reads between step and forward] Code that reads the params between ``step()``
and the next forward (an EMA copy, a reference model's sync, a weight-norm log line) is
seen by no hook. From ``step()`` until the next forward starts (the root module's
pre-hook), and again after a forward while gathers are still outstanding (buckets it did
not read), a torch-function mode waits for the gathers of any bucket an op of this thread
reads, then lets the op run: such a reader gets the gathered values and pays only for
what it reads. Inside the forward the mode is off (the pre-hooks wait; the first forward
proved they cover every read), so the forward pays nothing per op. What no mode sees: a
read from another thread (modes are per thread) or from outside torch (a C++ extension
given ``data_ptr()``); those must call ``ZeroOptimizer.wait_for_params()`` first. The
debug guard (``ZeroConfig.overlap_guard``) instead keeps the mode on from ``step()`` until
every gather was waited for and raises on any op that reads a bucket still being
gathered, to find such readers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C import _len_torch_function_stack
from torch.overrides import TorchFunctionMode, _pop_mode, _push_mode
from torch.utils._device import DeviceContext
from torch.utils._pytree import tree_leaves

from ..comm import all_gather_into
from ..devices import collective_device
from ..flatten.buffers import FlatParams
from ..roll_call import GATHERING, raise_naming_ranks
from .config import ZeroConfig

__all__ = ["ParamGather", "param_gather_for"]

logger = logging.getLogger(__name__)


_REAL = (torch.Tensor, nn.Parameter)


# [Note: the waiting mode's place on the stack] The waiting mode lives from ``step()`` to
# the next forward, across the user's own ``with SomeMode():`` blocks, and a mode leaves by
# popping the top of its thread's stack. Pushed on top, it would be the one popped when a
# block that began before ``step()`` ends (``with OpCounter(): ...; opt.step()``): the
# user's mode would stay on for good and reads would no longer wait. So it goes in at the
# bottom (above a ``torch.device`` context, which keeps itself there) and is taken out
# from wherever it is.
def _push_below(mode: TorchFunctionMode) -> None:
    """Push ``mode`` under this thread's other torch-function modes (a bottom
    ``DeviceContext`` stays at the bottom)."""
    above = [_pop_mode() for _ in range(_len_torch_function_stack())]  # top first
    if above and isinstance(above[-1], DeviceContext):
        _push_mode(above.pop())
    _push_mode(mode)
    for other in reversed(above):
        _push_mode(other)


def _take_out(mode: TorchFunctionMode) -> None:
    """Remove ``mode`` from this thread's torch-function mode stack, wherever it is."""
    stack = [_pop_mode() for _ in range(_len_torch_function_stack())]  # top first
    for other in reversed(stack):
        if other is not mode:
            _push_mode(other)


class _BucketReads(TorchFunctionMode):
    """Calls ``on_read(func, buckets)`` for every torch function whose tensor arguments
    live in flattened buckets (matched by storage)."""

    def __init__(self, storages: dict[int, list[int]], on_read: Callable[[Any, list[int]], None]):
        super().__init__()
        self._storages = storages
        self._on_read = on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            # Only real tensors: dynamo's fake ones have no storage to match.
            if type(leaf) in _REAL:
                buckets = self._storages.get(leaf.untyped_storage().data_ptr())
                if buckets:
                    self._on_read(func, buckets)
        return func(*args, **kwargs)


class ParamGather:
    """Every bucket's all-gather, launched at the end of a step and waited for per bucket.

    Args:
        flat: the flattened params (buckets, master slices).
        pg: the group the gathers run on.
        module: the model whose forward reads the params; its modules get pre-hooks.
        guard: the debug guard (see the module docstring).
    """

    def __init__(
        self, flat: FlatParams, pg: dist.ProcessGroup | None, module: nn.Module, guard: bool
    ) -> None:
        pairs = [(g, b) for g in flat.groups for b in range(len(g.buckets))]
        self._pg = pg
        self._device = flat.groups[0].device
        self._buckets = [g.buckets[b] for g, b in pairs]
        self._own = [g.bucket_shard(b) for g, b in pairs]
        self._sources = [g.master_slice(b) for g, b in pairs]
        self._of_param: dict[int, int] = {}
        offset = 0
        for group in flat.groups:
            for param, slot in zip(group.params, group.layout.slots, strict=True):
                self._of_param[id(param)] = offset + slot.bucket
            offset += len(group.buckets)
        self._storages: dict[int, list[int]] = {}
        for i, bucket in enumerate(self._buckets):
            self._storages.setdefault(bucket.untyped_storage().data_ptr(), []).append(i)
        self.order = list(range(len(self._buckets)))
        """Launch order of the gathers (bucket indices over all groups)."""
        self._works: dict[int, Any] = {}
        self._guard = guard
        self._mode: _BucketReads | None = None
        self._mode_thread = 0
        """The thread the waiting mode (or the guard) was pushed on."""
        self._learning = True
        self._seen: list[int] = []
        self._unsafe: str | None = None
        self.enabled = True
        """False once the first forward showed a read no pre-hook covers (then ``step()``
        waits for every gather itself)."""
        self._handles = self._install(module)

    def _install(self, module: nn.Module) -> list[Any]:
        """Pre-hooks on every module owning flattened params; the first-forward watch."""
        handles = []
        for sub in module.modules():
            mine = [p for p in sub.parameters(recurse=False) if id(p) in self._of_param]
            owned = sorted({self._of_param[id(p)] for p in mine})
            if owned:
                handles.append(sub.register_forward_pre_hook(self._pre_hook(owned)))
        handles.append(module.register_forward_pre_hook(self._watch_enter))
        handles.append(module.register_forward_hook(self._watch_exit, always_call=True))
        handles.append(module.register_state_dict_pre_hook(lambda *_: self.wait_all()))
        return handles

    def _pre_hook(self, owned: list[int]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            for b in owned:
                self.wait(b)
                if self._learning and b not in self._seen:
                    self._seen.append(b)

        return hook

    # ------------------------------------------------------------ first-forward watch
    def _watch_enter(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            # [Note: compiled forward] dynamo traces these hooks into the graph, where
            # neither a mode nor a wait on a gather can live: overlap is off for a model
            # compiled before its first step (agree() tells every rank).
            if self._learning:
                self._unsafe = "its forward is compiled by torch.compile"
            return
        if self._learning and self._mode is None:
            self._mode = _BucketReads(self._storages, self._check_learning)
            self._mode.__enter__()
        elif not self._learning and not self._guard:
            self._end_mode()  # the pre-hooks wait inside the forward

    def _watch_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._learning and self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        elif not self._learning:
            self._start_mode()  # buckets the forward did not read: still gathering

    def _check_learning(self, func: Any, buckets: list[int]) -> None:
        if self._unsafe is None and any(b not in self._seen for b in buckets):
            name = getattr(func, "__name__", repr(func))
            self._unsafe = (
                f"its forward reads flattened params outside the modules that own them ({name})"
            )

    def _wait_for_read(self, func: Any, buckets: list[int]) -> None:
        # The mode stays (it is running this): ended by the next forward. The Work stays
        # too: on NCCL wait() orders only the current stream, so a reader on a side stream
        # must not spare the forward's own wait on the default one.
        for b in buckets:
            work = self._works.get(b)
            if work is not None:
                work.wait()

    def _check_guard(self, func: Any, buckets: list[int]) -> None:
        pending = [b for b in buckets if b in self._works]
        if pending:
            name = getattr(func, "__name__", repr(func))
            raise RuntimeError(
                f"flatzero overlap guard: {name} read bucket {pending[0]} while its parameter "
                "all-gather was still running; call ZeroOptimizer.wait_for_params() before "
                "reading params outside the model's forward (an EMA copy, logging)"
            )

    # ------------------------------------------------------------------ the gathers
    def agree(self) -> None:
        """At the first step: adopt rank 0's learned order and turn overlap off on every
        rank if any rank saw an unsafe read (two collectives, once)."""
        if not self._learning:
            return
        self._learning = False
        if self._mode is not None:  # a forward that raised past the exit hook
            self._mode.__exit__(None, None, None)
            self._mode = None
        n = len(self._buckets)
        device = collective_device(self._pg, self._device)
        learned = self._seen + [b for b in range(n) if b not in self._seen]
        order = torch.tensor(learned, dtype=torch.int64, device=device)
        unsafe = torch.tensor([int(self._unsafe is not None)], dtype=torch.int64, device=device)
        if dist.is_initialized() and dist.get_world_size(self._pg) > 1:
            src = 0 if self._pg is None else dist.get_global_rank(self._pg, 0)
            try:
                dist.broadcast(order, src=src, group=self._pg)
                dist.all_reduce(unsafe, op=dist.ReduceOp.MAX, group=self._pg)
            except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
                raise_naming_ranks(error, self._pg, "agreeing on the gathers' order at the step")
        self.order = [int(b) for b in order.tolist()]
        if int(unsafe.item()):
            self.enabled = False
            logger.warning(
                "flatzero: overlap_param_gather is off for this model: %s; step() waits "
                "for the parameter all-gathers itself",
                self._unsafe or "another rank saw a read no module hook covers",
            )

    def launch(self) -> None:
        """Cast the master slices into this rank's bucket slices and launch every bucket's
        all-gather in ``order``; waits for none of them unless overlap is off."""
        self.wait_all()
        for b in self.order:
            self._own[b].copy_(self._sources[b])
            try:
                work = all_gather_into(self._buckets[b], self._own[b], self._pg, async_op=True)
            except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
                raise_naming_ranks(error, self._pg, GATHERING)
            if work is not None:
                self._works[b] = work
        if not self.enabled:
            self.wait_all()
        self._start_mode()

    def _start_mode(self) -> None:
        """While gathers are outstanding: the guard, else the waiting reads (see the
        note on reads between step and forward)."""
        if self._works and self._mode is None and self.enabled:
            on_read = self._check_guard if self._guard else self._wait_for_read
            self._mode = _BucketReads(self._storages, on_read)
            self._mode_thread = threading.get_ident()
            _push_below(self._mode)

    def wait(self, b: int) -> None:
        """Wait for bucket ``b``'s gather, if it is still outstanding."""
        work = self._works.pop(b, None)
        if work is not None:
            try:
                work.wait()
            except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
                raise_naming_ranks(error, self._pg, GATHERING)
        if not self._works:
            self._end_mode()

    def wait_all(self) -> None:
        """Wait for every outstanding gather, in launch order."""
        for b in list(self._works):
            self.wait(b)
        self._end_mode()

    @property
    def outstanding(self) -> int:
        """Gathers launched and not waited for yet."""
        return len(self._works)

    def _end_mode(self) -> None:
        """End the waiting mode (or the guard), from the thread it was pushed on (see the
        note on the waiting mode's place on the stack); another thread's call leaves it."""
        if self._mode is not None and not self._learning:
            if threading.get_ident() != self._mode_thread:
                return
            _take_out(self._mode)
            self._mode = None

    def close(self) -> None:
        """Wait for every gather; remove the hooks."""
        self.wait_all()
        for handle in self._handles:
            handle.remove()
        self._handles = []


def param_gather_for(
    flat: FlatParams,
    pg: dist.ProcessGroup | None,
    module: nn.Module,
    config: ZeroConfig,
) -> ParamGather:
    """A ``ParamGather`` over ``module``'s modules (debug guard: ``config.overlap_guard``),
    registered as ``flat``'s param waiter.

    Raises:
        ValueError: optimizer offload is on (its write-back uploads from the host first).
    """
    if config.offload_optimizer is not None:
        raise ValueError(
            "ZeroConfig.overlap_param_gather=True with offload_optimizer: the offloaded "
            "step uploads the master shards before gathering and is not overlapped; pass "
            "overlap_param_gather=None or False"
        )
    gather = ParamGather(flat, pg, module, config.overlap_guard)
    flat.wait_params_with(gather.wait_all)
    return gather
