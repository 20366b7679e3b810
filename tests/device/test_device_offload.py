"""Optimizer offload with the buckets on an accelerator: the copy path.

Two ranks train a case of ``tests/test_optimizer_offload.py`` with the model and buckets
on the device, with and without ``offload_optimizer``: the same losses and masters (the
host's fused kernel against the device's), the masters and optimizer state in host memory,
no fp32 master or optimizer state in device memory (the device holds at least their bytes
less than without offload), and the stream/event logic through the device seam: one
offload stream, an event recorded per bucket per step and waited on (stage 2: copies started
during backward, as each bucket's reductions land), never a device-wide synchronize inside
a step. The copies are pinned and asynchronous on CUDA; the emulated accelerator, which has
no pinned memory, gets host memory as if it were (the pageable fallback is tested on CPU).

``offload_problems`` runs inside the world-size-2 launch of
``test_device_optimizer.py::test_zero_1_and_2_on_the_device_match_adamw`` after its own
cases (a launch of two emulated ranks costs more than the work), which asserts it found
nothing wrong.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from flatzero import OffloadConfig, ZeroOptimizer, accel
from test_optimizer_offload import Case, train

from .harness import this_device

CASES = (Case(stage=2, dtype="fp16", overflow_step=1),)
"""One case (each emulated op costs ~40x its host time): the copies do not depend on the
stage (they start after the reductions), and fp16 takes the skip path too."""


class _Recorder:
    """Counts the device seam's stream and event calls (and forwards them)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.in_step = False
        self.originals = {n: getattr(accel, n) for n in ("new_stream", "new_event", "synchronize")}

    def bump(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def install(self) -> None:
        recorder = self

        class Event:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def record(self, stream: Any = None) -> None:
                recorder.bump("event.record")
                if not recorder.in_step:
                    recorder.bump("event.record during backward")
                self.inner.record(stream)

            def synchronize(self) -> None:
                recorder.bump("event.synchronize")
                self.inner.synchronize()

        def new_stream(device):
            self.bump("new_stream")
            return self.originals["new_stream"](device)

        def new_event(device, **kwargs):
            self.bump("new_event")
            return Event(self.originals["new_event"](device, **kwargs))

        def synchronize(device):
            self.bump("synchronize in a step" if self.in_step else "synchronize")
            return self.originals["synchronize"](device)

        accel.new_stream, accel.new_event, accel.synchronize = new_stream, new_event, synchronize
        step = ZeroOptimizer.step

        def recorded_step(optimizer: ZeroOptimizer, *args: Any, **kwargs: Any) -> Any:
            self.in_step = True
            try:
                return step(optimizer, *args, **kwargs)
            finally:
                self.in_step = False

        ZeroOptimizer.step = recorded_step  # type: ignore[method-assign]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def offload_problems(rank: int, world_size: int, kind: str) -> list[str]:
    """What went wrong with optimizer offload on this rank (empty: nothing). It replaces
    the device seam's stream/event functions and ``ZeroOptimizer.step`` by recorders for
    the rest of the process."""
    device = this_device(kind)
    recorder = _Recorder()
    recorder.install()
    warnings = _Warnings()
    logging.getLogger("flatzero.optim.offload").addHandler(warnings)
    problems = []
    for case in CASES:
        start = accel.memory_allocated(device)
        plain_losses, plain_masters, plain = train(case, rank, False, device)
        plain_bytes = accel.memory_allocated(device) - start
        plain.close()
        del plain
        recorder.counts.clear()
        warnings.messages.clear()
        start = accel.memory_allocated(device)
        pinned_empty = accel.pinned_empty
        if kind != "cuda":
            # The emulated device has no pinned memory: host memory stands in for it, so
            # that the copies that overlap backward (page-locked memory only) run here too.
            # The pageable fallback (warning, copies): tests/test_optimizer_offload.py.
            accel.pinned_empty = lambda nbytes: torch.empty(nbytes, dtype=torch.uint8)
        try:
            losses, masters, opt = train(case, rank, OffloadConfig(pin_memory=True), device)
        finally:
            accel.pinned_empty = pinned_empty
        off_bytes = accel.memory_allocated(device) - start
        if str(losses) != str(plain_losses):
            problems.append(f"{case}: losses {losses} != {plain_losses}")
        for name, value in plain_masters.items():
            if not torch.allclose(masters[name], value, rtol=1e-6, atol=1e-7):
                problems.append(f"{case}: master {name} differs")
        state = [v for s in opt.inner.state.values() for v in s.values() if v.dim() > 0]
        if {t.device.type for t in [*opt.master_shards, *state]} != {"cpu"}:
            problems.append(f"{case}: masters or state not in host memory")
        if {b.device.type for g in opt.flat.groups for b in g.buckets} != {device.type}:
            problems.append(f"{case}: buckets not on the device")
        shard = sum(g.layout.shard_numel for g in opt.flat.groups)
        if plain_bytes - off_bytes < (4 + 8) * shard:  # fp32 master + AdamW state
            problems.append(
                f"{case}: device holds {off_bytes} B with offload, {plain_bytes} without"
            )
        buckets = sum(len(g.buckets) for g in opt.flat.groups)
        steps = 3
        counts = recorder.counts
        if counts.get("new_stream") != 1 or counts.get("synchronize in a step", 0) != 0:
            problems.append(f"{case}: seam calls {counts}")
        # a bucket event per step (the clip coefficient's too, on steps that were not skipped)
        if not counts.get("event.record", 0) >= buckets * steps:
            problems.append(f"{case}: {counts} for {buckets} buckets x {steps} steps")
        if counts.get("event.synchronize", 0) < buckets * steps:
            problems.append(f"{case}: waits {counts}")
        if case.stage == 2 and not counts.get("event.record during backward"):
            problems.append(f"{case}: no copy started during backward: {counts}")
        if not opt._stepper.pinned or warnings.messages:
            problems.append(f"{case}: pinned {opt._stepper.pinned}, warnings {warnings.messages}")
        opt.close()
    return problems
