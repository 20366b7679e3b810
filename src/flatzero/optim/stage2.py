"""ZeRO stage 2 reducers: gradients reduced chunk by chunk during backward, ``.grad`` freed.

``Stage2Reducer`` over several ranks; ``LocalStage2Reducer`` at world size 1, where there is
nothing to reduce. Their accumulation window is a ``reducers.WindowState``.
"""

from __future__ import annotations

import enum
import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge

from ..devices import collective_device
from ..flatten.buffers import FlatParams
from ..roll_call import raise_naming_ranks
from .buckets import BackwardPass, ReduceChunk
from .config import ZeroConfig
from .reducers import AGAIN, LATE, UNFINISHED, GradReducer, WindowState

__all__ = ["LocalStage2Reducer", "OrderState", "Stage2Reducer", "UnusedRule"]

logger = logging.getLogger(__name__)


class OrderState(enum.Enum):
    """Where ``Stage2Reducer``'s bucket launch order stands.

    ``RECORDING`` -(the first backward pass ends: ``_learn_order``)-> ``RECORDED``
    -(the first step: ``agree_order``, or a loaded order: ``set_order``)-> ``AGREED``.
    Without ``ZeroConfig.learn_bucket_order`` it starts ``AGREED`` (the layout order).
    """

    RECORDING = "recording"
    """The first backward pass runs: the arrival of each bucket's last gradient is noted."""
    RECORDED = "recorded"
    """This rank's order is learnt; the ranks have not agreed on one yet."""
    AGREED = "agreed"
    """Every rank launches in the same order, for good."""


class UnusedRule(enum.Enum):
    """When ``Stage2Reducer`` counts the params a backward pass will not reach as zero.

    ``WATCHING`` -(a pass ends with no backward inside backward seen)-> ``AT_START``;
    ``WATCHING`` or ``AT_START`` -(a pass ends that saw one)-> ``AT_END``, for good.
    """

    WATCHING = "watching"
    """The first pass: unreached params count at its end; gradients from another graph
    task (a backward inside backward) are watched for."""
    AT_START = "at start"
    """Unreached params count as zero at a pass's first gradient (they hold nothing up)."""
    AT_END = "at end"
    """A backward inside backward was seen: unreached params count only at a pass's end."""

    def after(self, nested: bool) -> UnusedRule:
        """The rule once a pass ended that did (``nested``) or did not see a backward inside
        backward."""
        if self is UnusedRule.AT_END or nested:
            return UnusedRule.AT_END
        return UnusedRule.AT_START


class LocalStage2Reducer(GradReducer):
    """ZeRO stage 2 at world size 1: nothing to reduce and nothing to stage.

    Each hook writes its gradient straight into the fp32 gradient shard (copied in the
    window's first backward pass, added afterwards and when a param's gradient is delivered
    again in one pass) and frees ``.grad``; the end of the
    window's first backward pass zero-fills the params that got no gradient.
    """

    def __init__(self, flat: FlatParams, grads: list[torch.Tensor], config: ZeroConfig) -> None:
        super().__init__(flat, grads, config)
        self._views = [
            grad[b.shard_offset + s.offset : b.shard_offset + s.end].view(s.spec.shape)
            for group, grad in zip(flat.groups, grads, strict=True)
            for s in group.layout.slots
            for b in (group.layout.buckets[s.bucket],)
        ]
        self._arrived: set[int] = set()
        self.window = WindowState.EMPTY
        self._register(lambda gi, slot, _: (self._first_param[gi] + slot,))

    def _hook(self, pid: int, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        if not self.window.running:
            Variable._execution_engine.queue_callback(self._end_of_backward)
            self.window = self.window.begin()
        if self.window.landed or pid in self._arrived:  # a later pass, or delivered again
            self._views[pid].add_(grad)
        else:
            self._views[pid].copy_(grad)
        self._arrived.add(pid)
        param.grad = None

    @property
    def backward_seen(self) -> bool:
        return self.window.landed

    def _end_of_backward(self) -> None:
        if not self.window.landed:
            missing = [
                v for pid, v in enumerate(self._views) if pid not in self._arrived and v.numel()
            ]
            if missing:
                torch._foreach_zero_(missing)
        self._arrived.clear()
        self.window = self.window.end()
        self.generation += 1

    def finish(self) -> None:
        if self.window.running:
            raise RuntimeError(UNFINISHED)

    def reset_window(self) -> None:
        self._arrived.clear()
        self.window = WindowState.EMPTY
        self.generation += 1


class Stage2Reducer(GradReducer):
    """ZeRO stage 2 over several ranks: hooks stage gradients chunk by chunk, free ``.grad``.

    The chunks are launched in one order on every rank (``order``'s buckets, each bucket's
    chunks in layout order). A gradient that arrives is held (autograd's own tensor, nothing
    copied) until every chunk it overlaps comes up: a chunk is launched as soon as every
    param overlapping it got its gradient or will get none, and every chunk before it was
    launched. Launching copies the chunk into a staging slot and reduces it onto its owner.
    The end-of-backward callback (``queue_callback``) counts the params that got no
    gradient as zero and launches every chunk left.

    Params this backward pass will not reach (an expert no token was routed to, a branch
    not taken) are known from autograd's graph at the pass's first gradient
    (``torch._C._will_engine_execute_node`` on each param's ``AccumulateGrad`` node) and
    count as zero at once, so they hold nothing up, on each rank its own. That is only
    sound when every gradient comes from the graph the pass started in: the first backward
    pass watches for gradients from another graph task (reentrant activation checkpointing
    runs a backward inside backward); once any was seen, never again. In the first pass the
    unreached params are *tentative*: they count as zero only once every gradient of some
    bucket behind the next chunk has arrived and waits, and only until a gradient from
    another graph task shows up (a checkpointed segment's gradients come before a whole
    bucket waits for them). So an unused param early in launch order (an expert with no
    tokens, registered last) holds back about one bucket in the first pass too, not every
    gradient. Which chunks are launched, and their contents, are the same either way; only
    the moment differs, on each rank its own. In the first pass a gradient that arrives
    after its chunk was reduced without it is reduced again at the pass's end (see
    ``_reduce_late``); in a later pass it raises ``RuntimeError``. A param's gradient may
    arrive more than once in a pass (see ``_again``).
    """

    def __init__(self, flat: FlatParams, grads: list[torch.Tensor], config: ZeroConfig) -> None:
        super().__init__(flat, grads, config)
        params = [p for g in flat.groups for p in g.params]
        self._nodes = [get_gradient_edge(p).node for p in params]
        """Each param's ``AccumulateGrad`` node (held, as DDP does, so it stays the one)."""
        self._bucket_of = [0] * len(params)
        for chunks in self._chunks_by_bucket:
            for chunk in chunks:
                for pid, *_ in chunk.params:
                    self._bucket_of[pid] = chunk.bucket
        self._schedule()
        self._bucket_params = [0] * len(self.buckets)
        """Per bucket: its params that have chunks (a pass waits for each one's gradient)."""
        for pid, positions in enumerate(self._chunks_of):
            if positions:
                self._bucket_params[self._bucket_of[pid]] += 1
        self.window = WindowState.EMPTY
        self.order_state = OrderState.RECORDING if config.learn_bucket_order else OrderState.AGREED
        self._last_arrival: dict[int, int] = {}
        self.recorded: list[int] = []
        self.unused_rule = UnusedRule.WATCHING
        self.repeats: dict[int, int] = {}
        """Params whose gradient some pass delivered more than once (reentrant checkpointed
        segments sharing them), by param id: the most deliveries in one pass."""
        self.held_peak = 0
        """Most bytes of gradients held at once, waiting for their chunks."""
        self._own_chunks = [
            sum(1 for c in chunks if c.owner == self.rank) for chunks in self._chunks_by_bucket
        ]
        """Per bucket: its chunks that land in this rank's gradient shard in every pass."""
        self._chunks_landed = [0] * len(self.buckets)
        self._pass = self._new_pass()
        self._register(lambda gi, slot, _: (self._first_param[gi] + slot,))

    def _schedule(self) -> None:
        """The chunks in launch order, and where each param's chunks are in it."""
        self.chunks = [c for b in self.order for c in self._chunks_by_bucket[b]]
        self._chunks_of: list[list[int]] = [[] for _ in self._nodes]
        for pos, chunk in enumerate(self.chunks):
            for pid, *_ in chunk.params:
                self._chunks_of[pid].append(pos)
        self._expected = [len(c.params) for c in self.chunks]
        self._last_pos = {chunk.bucket: pos for pos, chunk in enumerate(self.chunks)}
        """Per bucket: the launch position of its last chunk."""

    def _new_pass(self) -> BackwardPass:
        return BackwardPass(
            list(self._expected),
            [len(c) for c in self._chunks_of],
            missing=list(self._bucket_params),
        )

    def _hook(self, pid: int, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        state = self._pass
        if not self.window.running:
            self._begin(state)
        elif torch._C._current_graph_task_id() != state.task:
            state.nested = True
            state.tentative.clear()  # a backward inside backward may still reach them
        param.grad = None
        if pid in state.arrived:
            self._again(state, pid, grad)
            return
        state.arrived.add(pid)
        positions = self._chunks_of[pid]
        if not positions:
            return
        state.tentative.discard(pid)
        bucket = self._bucket_of[pid]
        state.missing[bucket] -= 1
        if state.missing[bucket] == 0:
            state.complete.append(bucket)
        # Flat without a view op where it is flat already, and staged whole without a slice
        # where a chunk holds all of it (_launch): host ops per param are pinned by
        # tests/test_host_ops.py.
        flat = grad if grad.dim() == 1 else grad.reshape(-1)
        if pid in state.unused:
            reduced = len(positions) - state.unstaged[pid]
            if reduced and self.unused_rule is not UnusedRule.WATCHING:
                raise RuntimeError(LATE)
            state.unused.discard(pid)  # its chunks not staged yet still wait: it counts
            state.nested = True
            if reduced:
                state.keep_late(pid, flat, reduced, held=reduced < len(positions))
        elif pid in self.repeats:
            state.deliveries[pid] = 1  # its chunks wait for its other deliveries (_again)
        else:
            for pos in positions:
                state.pending[pos] -= 1
        if state.unstaged[pid]:
            state.hold(pid, flat)
        self.held_peak = max(self.held_peak, state.held_bytes)
        if self.order_state is OrderState.RECORDING:
            self._last_arrival[self._bucket_of[pid]] = len(state.arrived)
        self._pump(state)

    def _again(self, state: BackwardPass, pid: int, grad: torch.Tensor) -> None:
        """Another delivery of ``pid``'s gradient in this pass.

        [Note: gradients delivered more than once] Autograd runs a param's
        ``AccumulateGrad`` node, and so its post-accumulate-grad hook, once per graph task
        that reaches it: once per backward pass however often the forward used the param
        (a shared encoder called twice), but once per *segment* of reentrant activation
        checkpointing (``use_reentrant=True``: each segment's backward is a graph task of
        its own) that uses it, and once more if the outer graph uses it too. Each delivery
        holds only what its task computed (the hook cleared ``.grad``). A delivery adds to
        the gradient held for the chunks not staged yet (one out-of-place add). Chunks
        already reduced without it: in the first pass its gradient is kept and reduced
        once more at the pass's end (``_reduce_late``); a pass's end notes each param's
        most deliveries in ``repeats``, and from then on such a param's chunks wait until
        it got that many (or the pass ended), so they are reduced once, holding its whole
        gradient (in its dtype) from the first delivery to the last, and the chunks behind
        it in launch order wait too. More deliveries than any earlier pass had, after a
        chunk was reduced, raise ``RuntimeError`` (``AGAIN``): a later pass has no
        collective to tell the other ranks about another reduction.
        """
        positions = self._chunks_of[pid]
        if not positions:
            return
        flat = grad if grad.dim() == 1 else grad.reshape(-1)
        count = state.deliveries.get(pid, 1) + 1
        state.deliveries[pid] = count
        expected = self.repeats.get(pid, 1)
        reduced = len(positions) - state.unstaged[pid]
        if reduced:
            if self.unused_rule is not UnusedRule.WATCHING:
                raise RuntimeError(AGAIN.format(name=self._name(pid), count=count, most=expected))
            state.keep_late(pid, flat, reduced, held=False)
        if state.unstaged[pid]:
            state.add_held(pid, flat)
        if count == expected:
            for pos in positions:
                state.pending[pos] -= 1
        self.held_peak = max(self.held_peak, state.held_bytes)
        if self.order_state is OrderState.RECORDING:
            self._last_arrival[self._bucket_of[pid]] = len(state.arrived)
        self._pump(state)

    def _name(self, pid: int) -> str:
        """Param ``pid``'s name."""
        group = next(g for g in range(len(self.flat.groups)) if self._first_param[g + 1] > pid)
        return self.flat.groups[group].layout.slots[pid - self._first_param[group]].spec.name

    def _begin(self, state: BackwardPass) -> None:
        """The pass's first gradient: queue its end, note its graph task, and (unless a
        backward inside backward was seen) count the params it will not reach as zero: at
        once, or in the first pass as ``tentative`` (see the class docstring)."""
        Variable._execution_engine.queue_callback(self._end_of_backward)
        self.window = self.window.begin()
        state.task = torch._C._current_graph_task_id()
        if self.unused_rule is UnusedRule.AT_END:
            return
        will_run = torch._C._will_engine_execute_node
        unreached = [
            pid
            for pid, node in enumerate(self._nodes)
            if self._chunks_of[pid] and not will_run(node)
        ]
        if not self.skip_unused:
            state.tentative.update(unreached)
            return
        for pid in unreached:
            self._count_unused(state, pid)

    def _count_unused(self, state: BackwardPass, pid: int) -> None:
        """Count ``pid``'s gradient as zero in this pass: its chunks no longer wait for it."""
        state.unused.add(pid)
        for pos in self._chunks_of[pid]:
            state.pending[pos] -= 1

    def _pump(self, state: BackwardPass) -> None:
        """Launch chunks, in order, while the next one has all it waits for."""
        while state.cursor < len(self.chunks) and (
            state.pending[state.cursor] == 0 or self._count_tentative(state)
        ):
            self._launch(state, self.chunks[state.cursor])
            state.cursor += 1

    def _count_tentative(self, state: BackwardPass) -> bool:
        """The first pass: when a whole bucket's gradients wait behind the next chunk,
        count the tentative params that chunk waits for as zero. Whether the chunk is
        ready now."""
        if not state.tentative or not any(
            self._last_pos[b] >= state.cursor for b in state.complete
        ):
            return False
        chunk = self.chunks[state.cursor]
        waiting = [pid for pid, *_ in chunk.params if pid in state.tentative]
        for pid in waiting:
            state.tentative.discard(pid)
            self._count_unused(state, pid)
        return state.pending[state.cursor] == 0

    def _launch(self, state: BackwardPass, chunk: ReduceChunk) -> None:
        """Stage ``chunk`` from the held gradients (zeros where there are none) and start
        its reduction."""
        slot = self.pool.acquire()
        staged = slot[: chunk.numel]
        zeros = [staged[start:end] for start, end in chunk.gaps]
        dsts, srcs = [], []
        for pid, first, offset, numel in chunk.params:
            view = staged[offset : offset + numel]
            grad = state.held.get(pid)
            if grad is None:
                zeros.append(view)
            else:
                dsts.append(view)
                srcs.append(grad if numel == grad.numel() else grad[first : first + numel])
            state.unstaged[pid] -= 1
        if zeros:
            torch._foreach_zero_(zeros)
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        for pid, *_ in chunk.params:
            if state.unstaged[pid] == 0:
                state.release(pid)
        self._reduce_chunk(chunk, slot, staged, self.window.landed)

    def _landed_chunk(self, bucket: int) -> None:
        count = self._chunks_landed[bucket] + 1
        self._chunks_landed[bucket] = count % self._own_chunks[bucket]
        if self.on_chunk_landed is not None:
            self.on_chunk_landed(bucket, count == self._own_chunks[bucket])

    def _end_of_backward(self) -> None:
        """Count what got no gradient as zero, launch every chunk left.

        At the end of a backward pass run inside another one's node (reentrant activation
        checkpointing), defer to the end of the outer pass: ending here would reduce every
        bucket once per checkpointed segment.
        """
        node = torch._C._current_autograd_node()
        if node is not None:
            node.register_hook(self._queue_on_outer_backward)
            return
        state = self._pass
        for pos in range(state.cursor, len(self.chunks)):
            state.pending[pos] = 0
        self._pump(state)
        if self.unused_rule is UnusedRule.WATCHING:
            self._reduce_late(state)
        if self.order_state is OrderState.RECORDING:
            self._learn_order()
        self._learn_repeats(state)
        self.unused_rule = self.unused_rule.after(state.nested)
        self._pass = self._new_pass()
        self.window = self.window.end()
        self.generation += 1

    def _reduce_late(self, state: BackwardPass) -> None:
        """The first pass's end: reduce again, added, every bucket in which some rank got
        a gradient after its chunk was reduced with that param counted as zero
        (``BackwardPass.late``), staging only those late gradients (zeros elsewhere).

        [Note: late gradients in the first pass] A reentrant checkpointed segment's params
        are not in the graph a pass starts with; its gradients come from a backward inside
        backward, which can start after a whole bucket (a head registered first, used
        last) waited and so made them count as zero. Recovering costs one all-reduce of
        one int per bucket at the end of the first pass (and a host read of it), plus one
        more reduction of each affected bucket; the late gradients are held until then.
        Every rank takes part, so ranks that differ (MoE routing) neither raise nor hang.
        """
        device = collective_device(self.pg, self.flat.groups[0].device)
        late = [0] * len(self.buckets)
        for pid, kept in state.late.items():
            for pos in self._chunks_of[pid][: max(reduced for _, reduced in kept)]:
                late[self.chunks[pos].bucket] = 1
        counts = [0] * len(self._nodes)
        for pid, count in state.deliveries.items():
            counts[pid] = count
        flags = torch.tensor(late + counts, dtype=torch.int32).to(device)
        try:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.pg)
        except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
            raise_naming_ranks(error, self.pg, "agreeing on late gradients after backward")
        agreed = flags.tolist()
        buckets = agreed[: len(self.buckets)]
        # Every rank learns the most deliveries any rank saw (``_learn_repeats``): a rank
        # that saw fewer (data-dependent reuse) would otherwise reduce after the first
        # delivery and raise alone in a later pass, leaving the others in a collective.
        state.deliveries = {
            pid: count for pid, count in enumerate(agreed[len(self.buckets) :]) if count > 1
        }
        for pos, chunk in enumerate(self.chunks):
            if not buckets[chunk.bucket]:
                continue
            slot = self.pool.acquire()
            staged = slot[: chunk.numel]
            staged.zero_()
            for pid, first, offset, numel in chunk.params:
                for grad, reduced in state.late.get(pid, ()):
                    if pos in self._chunks_of[pid][:reduced]:
                        staged[offset : offset + numel].add_(grad[first : first + numel])
            self._reduce_chunk(chunk, slot, staged, True)

    def _learn_repeats(self, state: BackwardPass) -> None:
        """A pass's end: note the params whose gradient it delivered more often than any
        pass before (``repeats``)."""
        for pid, count in state.deliveries.items():
            if count > self.repeats.get(pid, 1):
                self.repeats[pid] = count

    def _queue_on_outer_backward(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        """Post-hook of the node whose inner backward pass just ended: queue the end of the
        pass on the backward pass running that node."""
        Variable._execution_engine.queue_callback(self._end_of_backward)

    def _learn_order(self) -> None:
        """The buckets in the order their last gradient arrived; one that got none stays
        right after the bucket before it in the current order."""
        key, previous = {}, -1
        for b in self.order:
            previous = key[b] = self._last_arrival.get(b, previous)
        self.recorded = sorted(self.order, key=key.__getitem__)
        self.order_state = OrderState.RECORDED

    def _adopt(self, order: list[int]) -> None:
        """Launch in ``order`` from the next backward pass on (between passes only)."""
        self.order = order
        self._schedule()
        self._pass = self._new_pass()
        self.order_state = OrderState.AGREED

    def set_order(self, order: list[int] | None) -> None:
        super().set_order(order)
        if order is not None and self.order == list(order):
            self._adopt(self.order)

    def agree_order(self) -> None:
        """At the first step, adopt rank 0's order of the first backward pass (one
        broadcast, and one host read of it, once)."""
        if self.order_state is OrderState.AGREED:
            return
        n = len(self.buckets)
        device = collective_device(self.pg, self.flat.groups[0].device)
        if self.rank == 0:
            order = torch.tensor(self.recorded or self.order, dtype=torch.int64).to(device)
        else:
            order = torch.empty(n, dtype=torch.int64, device=device)
        src = 0 if self.pg is None else dist.get_global_rank(self.pg, 0)
        try:
            dist.broadcast(order, src=src, group=self.pg)
        except RuntimeError as error:  # [Note: nothing on the happy path] (roll_call.py)
            raise_naming_ranks(error, self.pg, "agreeing on the reductions' order at the step")
        self._adopt(order.tolist())
        logger.debug("stage 2 bucket launch order: %s", self.order)

    @property
    def backward_seen(self) -> bool:
        return self.window.landed

    def _doing(self) -> str:
        if self.window.running:
            return "reducing gradients during backward"
        return super()._doing()

    @property
    def skip_unused(self) -> bool:
        """Unreached params count as zero at a pass's start (see the class docstring)."""
        return self.unused_rule is UnusedRule.AT_START

    def finish(self) -> None:
        if self.window.running:
            raise RuntimeError(UNFINISHED)
        self.pool.finish_all()
        self._check_landed()

    def reset_window(self) -> None:
        self.pool.finish_all()
        self._chunks_landed = [0] * len(self.buckets)  # a failed pass launched only some
        self._pass = self._new_pass()
        self.window = WindowState.EMPTY
        self._check_reset()
        if self.order_state is OrderState.RECORDING:
            self._last_arrival.clear()  # a failed first pass: record the next one
        self.generation += 1
