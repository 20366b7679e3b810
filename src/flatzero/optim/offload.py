"""Optimizer offload (ZeRO-Offload): the host half of a ``ZeroOptimizer`` step.

With ``ZeroConfig.offload_optimizer`` the fp32 master shards and the inner optimizer's state
live in host memory, beside a host fp32 gradient shard per group; ``HostOffload`` is the
host implementation of ``stepper.ShardStepper`` (see [Note: an offloaded step]).

Not the flatten tier ``host_park`` (params parked in host memory while a full device makes
room at init): this module is about where the optimizer steps.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import accel
from ..comm import all_gather_buckets_from_own_slices
from ..cores import init_threads
from ..flatten.buffers import FlatParams
from ..hostmem import StagingBuffer, empty_host, page_locked
from ..own_groups import collective_group
from ..roll_call import GATHERING, raise_naming_ranks
from .config import OffloadConfig
from .inner import build_inner_optimizer, scale_grads, step_with_grad_scale, with_fused_default

__all__ = [
    "HostOffload",
    "OffloadHostBytes",
    "check_host_kernel",
    "host_step",
    "offload_host_bytes",
    "state_floats",
]

logger = logging.getLogger(__name__)

HOST = torch.device("cpu")
"""Where an offloaded optimizer steps."""

_REGISTER_MIN_BYTES = 2**23
"""Host buffers from this size on are page-locked in place (``hostmem.page_locked``: a
mapping of their own, ``MADV_DONTFORK``); smaller ones come from torch's pinned
allocator."""


def check_host_kernel(
    optimizer: Callable[..., torch.optim.Optimizer],
    group_options: Sequence[Mapping[str, Any]],
    defaults: dict[str, Any],
) -> None:
    """Raise ``TypeError`` when ``optimizer`` cannot step tensors in host memory (a
    CUDA-only fused optimizer, say): one step over one dummy host shard per group, with the
    arguments the offloaded inner optimizer gets (``with_fused_default`` for the host).

    Raises:
        TypeError: naming the optimizer, what failed, and the fix.
    """
    options = [dict(o) for o in group_options]
    host_defaults = with_fused_default(optimizer, defaults, options, HOST)
    dummies = [nn.Parameter(torch.zeros(4)) for _ in options]
    for dummy in dummies:
        dummy.grad = torch.zeros(4)
    probe = build_inner_optimizer(optimizer, dummies, options, host_defaults)
    try:
        probe.step()
    except Exception as error:  # whatever the kernel raises, the answer is the same
        name = type(probe).__name__
        raise TypeError(
            f"{name} cannot step tensors in host memory ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else 'no message'}); optimizer offload "
            "(offload_optimizer device 'cpu') runs the optimizer on the host: use "
            "torch.optim.AdamW, Adam, SGD or Adagrad (fused CPU kernels) or another optimizer "
            "with a CPU implementation, or turn optimizer offload off"
        ) from error


def host_step(
    inner: torch.optim.Optimizer, *, threads: int, grad_scale: torch.Tensor | None = None
) -> None:
    """One ``inner.step()`` over host shards with exactly ``threads`` intra-op threads (the
    previous count restored after, also on error).

    Args:
        inner: the optimizer over the host master shards (their ``.grad`` set).
        threads: intra-op CPU threads for the step (the rank's core share).
        grad_scale: a 0-d fp32 host tensor the fused kernel divides every gradient by as
            it reads it (``torch.optim``'s ``grad_scale``; fused Adam, AdamW, SGD, Adagrad
            only); None: the gradients are used as they are.
    """
    with init_threads(threads):
        step_with_grad_scale(inner, grad_scale)


_STATE_FLOATS: Mapping[str, Callable[[Mapping[str, Any]], int]] = {
    "Adam": lambda o: 2 + int(bool(o.get("amsgrad"))),
    "AdamW": lambda o: 2 + int(bool(o.get("amsgrad"))),
    "Adamax": lambda o: 2,
    "NAdam": lambda o: 2,
    "RAdam": lambda o: 2,
    "Adadelta": lambda o: 2,
    "Rprop": lambda o: 2,
    "SGD": lambda o: int(bool(o.get("momentum", 0))),
    "Adagrad": lambda o: 1,
    "ASGD": lambda o: 1,
    "RMSprop": lambda o: 1 + int(bool(o.get("centered"))) + int(bool(o.get("momentum", 0))),
}
"""Per ``torch.optim`` class: fp32 state tensors of the param's size it keeps."""


def state_floats(optimizer: str | type, options: Mapping[str, Any] | None = None) -> int:
    """How many param-sized fp32 state tensors the ``torch.optim`` class ``optimizer`` (or
    its name) keeps with ``options`` (AdamW: 2, with ``amsgrad`` 3; SGD: 1 with momentum,
    else 0; Adagrad: 1).

    Raises:
        ValueError: a class this table does not know.
    """
    name = optimizer if isinstance(optimizer, str) else optimizer.__name__
    count = _STATE_FLOATS.get(name)
    if count is None:
        raise ValueError(
            f"state_floats does not know {name}; known: {', '.join(sorted(_STATE_FLOATS))}"
        )
    return count(options or {})


@dataclass(frozen=True)
class OffloadHostBytes:
    """Host memory one rank's offloaded optimizer holds, in bytes.

    Attributes:
        master: the fp32 master shards (4 bytes per shard element).
        grads: the host fp32 gradient shards (4 bytes per shard element); their memory is
            also the upload's source (the params' dtype fits in it).
        state: the inner optimizer's per-element state (4 bytes per element per state
            tensor: 8 for Adam/AdamW).
        pinned: of ``grads``, the page-locked bytes (all of it with ``pin_memory`` on a
            machine with an accelerator, else 0).
    """

    master: int
    grads: int
    state: int
    pinned: int

    @property
    def total(self) -> int:
        """All of it, in bytes (``pinned`` is part of ``grads``)."""
        return self.master + self.grads + self.state


def offload_host_bytes(
    shard_numels: Sequence[int], state_per_element: int, *, pinned: bool
) -> OffloadHostBytes:
    """The host bytes of optimizer offload on one rank, from its shard lengths.

    Args:
        shard_numels: this rank's shard length of every group in elements
            (``GroupLayout.shard_numel``: the same on every rank).
        state_per_element: fp32 state tensors per element (``state_floats``).
        pinned: whether the gradient shards are page-locked (``pin_memory`` and an
            accelerator).

    Without an accelerator the gradient shard is the one the reductions write (it is in
    host memory either way), counted here all the same.
    """
    numel = sum(int(n) for n in shard_numels)
    grads = 4 * numel
    return OffloadHostBytes(
        master=4 * numel,
        grads=grads,
        state=4 * state_per_element * numel,
        pinned=grads if pinned else 0,
    )


def _unpin_all(buffers: list[StagingBuffer], fences: list[Any]) -> None:
    if buffers:
        for event in fences:  # a copy may still read or write the pages (an upload)
            event.synchronize()
    for buffer in buffers:
        buffer.release()
    buffers.clear()


# [Note: an offloaded step]
# 1. Each bucket's reduced gradient shard slice is copied from the device gradient shard
#    into the host gradient shard on a stream of its own (after the reductions), with an
#    event recorded per bucket: at ZeRO stage 2 over several ranks as soon as the bucket's
#    last reduction of a backward pass landed (``chunk_landed``, while backward goes on),
#    else (and for any bucket changed since) at the step (``download``).
# 2. The norm, the inf/nan verdict and the clip coefficient are computed on the device as
#    without offload; ``to_host`` brings the coefficient over on the same stream.
# 3. The host waits on the events (never a device-wide synchronize), and ``host_step``
#    runs the inner optimizer over the host shards with torch's fused CPU kernel (Adam,
#    AdamW, SGD, Adagrad) on the rank's share of the cores.
# 4. ``upload``: the master shard is cast to the params' dtype into the (page-locked) host
#    gradient shard's memory, which is no longer needed, and copied asynchronously into
#    this rank's slice of every bucket on the current stream, so the all-gather that
#    follows is ordered after it.
# Without an accelerator (buckets in host memory) the device gradient shard *is* the host
# one and the cast goes straight into the buckets: nothing is copied twice.


class HostOffload:
    """Host gradient shards, the gradient download and the parameter upload of one
    offloaded ``ZeroOptimizer`` (see [Note: an offloaded step]): the host implementation
    of ``stepper.ShardStepper``.

    Args:
        flat: the flattened params (buckets on the device, masters in host memory).
        device_grads: per group, the fp32 gradient shard the reductions write.
        config: ``pin_memory`` and ``threads``.
        threads: the host step's intra-op threads (``config.threads`` or the core share).

    Attributes:
        host_grads: per group, the host fp32 gradient shard the inner optimizer reads
            (``device_grads`` themselves when the buckets are in host memory).
        copies: whether gradients and params cross to an accelerator (else nothing moves).
        pinned: whether the host gradient shards are page-locked.
        threads: the host step's intra-op threads.
    """

    def __init__(
        self,
        flat: FlatParams,
        device_grads: list[torch.Tensor],
        config: OffloadConfig,
        threads: int,
    ) -> None:
        self.threads = threads
        self.device = flat.groups[0].device
        self.step_device = HOST
        self._pg = collective_group(flat.process_group)
        self.copies = accel.is_accelerator(self.device)
        self.pinned = self.copies and config.pin_memory
        self._registered: list[StagingBuffer] = []
        self._fences: list[Any] = []
        """Every event of this object: waited on before the pages are unpinned."""
        weakref.finalize(self, _unpin_all, self._registered, self._fences)
        pairs = [(g, b) for g in flat.groups for b in range(len(g.buckets))]
        self._own_slices = [g.bucket_shard(b) for g, b in pairs]
        self._buckets = [g.buckets[b] for g, b in pairs]
        self._master_slices = [g.master_slice(b) for g, b in pairs]
        self._stream: Any = None
        self._events: list[Any] = []
        self._scalar_event: Any = None
        self._upload_event: Any = None
        self._fresh: list[bool] = []
        """Per bucket: its host gradient slice was copied after the last change to it."""
        if not self.copies:
            self.host_grads = list(device_grads)
            return
        self.host_grads = [self._host_buffer(g.numel(), torch.float32) for g in device_grads]
        self._scalar = self._host_buffer(1, torch.float32).view(())
        # The upload's source: the master cast to the params' dtype, in the host gradient
        # shard's memory (free once the inner step has read it), unless the dtype is wider.
        self._staging = [
            host.view(torch.uint8)[: g.layout.shard_numel * g.dtype.itemsize].view(g.dtype)
            if g.dtype.itemsize <= host.itemsize
            else self._host_buffer(g.layout.shard_numel, g.dtype)
            for g, host in zip(flat.groups, self.host_grads, strict=True)
        ]
        self._downloads: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._upload_sources: list[torch.Tensor] = []
        for gi, group in enumerate(flat.groups):
            for bucket in group.layout.buckets:
                lo, hi = bucket.shard_offset, bucket.shard_offset + bucket.slice_numel
                self._downloads.append((self.host_grads[gi][lo:hi], device_grads[gi][lo:hi]))
                self._upload_sources.append(self._staging[gi][lo:hi])
        self._fresh = [False] * len(self._downloads)
        if accel.has_streams(self.device):
            self._stream = accel.new_stream(self.device)
            # blocking: the host sleeps in their waits rather than spin a core that the
            # host step (this rank's or a neighbour's) would use
            self._events = [accel.new_event(self.device, blocking=True) for _ in pairs]
            self._scalar_event = accel.new_event(self.device, blocking=True)
            self._upload_event = accel.new_event(self.device, blocking=True)
            self._fences += [*self._events, self._scalar_event, self._upload_event]

    # ----------------------------------------------------------- stepper.ShardStepper
    @property
    def step_grads(self) -> list[torch.Tensor]:
        """The gradient shards the inner optimizer reads: ``host_grads``."""
        return self.host_grads

    @property
    def chunk_hook(self) -> Callable[[int, bool], None]:
        """``chunk_landed``, for ``GradReducer.on_chunk_landed``."""
        return self.chunk_landed

    def describe(self) -> str:
        """The log line's suffix: threads and whether the copies are pinned."""
        kind = "pinned" if self.pinned else "pageable"
        return f", optimizer offloaded to the host ({self.threads} threads, {kind} copies)"

    def after_backward(self) -> None:
        """``download``: it overlaps the norm's all-reduce."""
        self.download()

    def abandon(self) -> None:
        """``wait``: the next backward pass rewrites what the copies read."""
        self.wait()

    def step(self, inner: torch.optim.Optimizer, coef: float | torch.Tensor) -> None:
        """Bring ``coef`` over, wait for the gradients' copies (their events), and step
        ``inner`` over the host shards with ``threads`` threads (``host_step``)."""
        if isinstance(coef, torch.Tensor):
            coef = self.to_host(coef)
        self.wait()
        with init_threads(self.threads):
            grad_scale = scale_grads(inner, self.host_grads, coef)
            host_step(inner, threads=self.threads, grad_scale=grad_scale)

    def write_back(self, masters: Sequence[torch.Tensor]) -> None:
        """``upload`` the masters into this rank's bucket slices; all-gather every bucket."""
        with init_threads(self.threads):
            self.upload(masters, self._master_slices)
        try:
            all_gather_buckets_from_own_slices(self._buckets, self._own_slices, self._pg)
        except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
            raise_naming_ranks(error, self._pg, GATHERING)

    def _host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An empty host tensor, page-locked while ``self.pinned`` (registered in place,
        else from torch's pinned allocator); on the first failure every later buffer is
        pageable too and one warning says so."""
        if not self.pinned:
            return empty_host(numel, dtype)
        nbytes = numel * dtype.itemsize
        if nbytes >= _REGISTER_MIN_BYTES:  # a mapping of its own, registered in place
            buffer = page_locked(nbytes, device=self.device)
            host = buffer.data.view(dtype)
            if buffer.registered:
                self._registered.append(buffer)
            if buffer.pinned:
                return host
        else:  # a page of its own would be mostly waste: torch's pinned allocator
            host = empty_host(numel, dtype)
            with accel.on_device(self.device):
                cached = accel.pinned_empty(nbytes)
            if cached is not None:
                return cached.view(dtype)
        self.pinned = False
        logger.warning(
            "optimizer offload: pin_memory is on but host memory could not be page-locked; "
            "the gradient and parameter copies between host and %s use pageable memory and "
            "are synchronous (slower, not wrong)",
            self.device.type,
        )
        return host

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        """Queue the block on the offload stream after everything queued so far on the
        current stream (nothing happens without streams: copies are synchronous)."""
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(accel.current_stream(self.device))
        with accel.use_stream(self._stream):
            yield

    def chunk_landed(self, bucket: int, complete: bool) -> None:
        """A reduction changed ``bucket``'s gradient shard slice; ``complete``: it was the
        last of a backward pass, so start its copy to the host now, while backward goes on
        (``GradReducer.on_chunk_landed``; a later change makes it stale again). Only into
        page-locked memory: a copy to pageable memory blocks the host until the device has
        run everything queued before it, once per bucket and backward pass (with gradient
        accumulation, every pass): those buckets are copied at the step, once."""
        if not self.copies:
            return
        self._fresh[bucket] = False
        if complete and self.pinned:
            with self._side_stream():
                self._copy(bucket)

    def _copy(self, bucket: int) -> None:
        dst, src = self._downloads[bucket]
        dst.copy_(src, non_blocking=self.pinned)
        if self._events:
            self._events[bucket].record(self._stream)
        self._fresh[bucket] = True

    def download(self) -> None:
        """Start copying every bucket's reduced gradient shard slice that was not copied
        since its last change to the host gradient shard (after the reductions queued so
        far), an event recorded after each."""
        if not self.copies:
            return
        stale = [b for b, fresh in enumerate(self._fresh) if not fresh]
        if not stale:
            return
        with self._side_stream():
            for bucket in stale:
                self._copy(bucket)

    def wait(self) -> None:
        """Block the host until every bucket's copy has landed (its event); the next
        window's gradients are then not copied yet."""
        for event in self._events:
            event.synchronize()
        self._fresh = [False] * len(self._fresh)

    def to_host(self, value: torch.Tensor) -> torch.Tensor:
        """The 0-d fp32 tensor ``value`` in host memory, copied on the offload stream after
        the work queued so far; waits on that copy's event only."""
        if not self.copies:
            return value
        with self._side_stream():
            self._scalar.copy_(value, non_blocking=self.pinned)
            if self._scalar_event is not None:
                self._scalar_event.record(self._stream)
        if self._scalar_event is not None:
            self._scalar_event.synchronize()
        return self._scalar

    def upload(
        self, masters: Sequence[torch.Tensor], master_slices: Sequence[torch.Tensor]
    ) -> None:
        """Cast the master shards to the params' dtype and write them into this rank's
        slice of every bucket (through the host gradient shards' memory, asynchronously
        on the current stream when it is page-locked). Call it with ``threads`` set."""
        if not self.copies:
            torch._foreach_copy_(self._own_slices, list(master_slices))
            return
        # The staging is the host gradient shards' memory: no copy to the host may still
        # write it (a load right after a backward pass: its buckets' copies are in flight).
        self.wait()
        if self._upload_event is not None:
            self._upload_event.synchronize()  # the last upload no longer reads the staging
        for staging, master in zip(self._staging, masters, strict=True):
            staging.copy_(master)
        for own, source in zip(self._own_slices, self._upload_sources, strict=True):
            own.copy_(source, non_blocking=self.pinned)
        if self._upload_event is not None:
            self._upload_event.record(accel.current_stream(self.device))

    def host_bytes(
        self, inner: torch.optim.Optimizer, masters: Sequence[torch.Tensor]
    ) -> OffloadHostBytes:
        """The host bytes held now: masters, host gradient shards, the inner optimizer's
        per-element state (``OffloadHostBytes``; measured from the tensors)."""
        state = sum(
            v.nbytes
            for s in inner.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
        grads = sum(g.nbytes for g in self.host_grads)
        return OffloadHostBytes(
            master=sum(m.nbytes for m in masters),
            grads=grads,
            state=state,
            pinned=grads if self.pinned else 0,
        )
