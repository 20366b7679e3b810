"""This machine's measured rates, for the planner: ``flatzero info --measure``.

``measure()`` times host copies, writes into new host memory with both allocators an init
uses, device copies where there is a device, and the per-tensor cost of each flatten
method ([Note: what measure() times]). The result is a ``Calibration``;
``to_dict``/``from_dict`` store it as JSON for ``flatzero plan --calibration FILE``.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue as queue_module
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .. import accel
from ..cores import usable_cores
from ..hostmem import empty_host
from ..memory import meminfo_bytes
from .hardware import HostSpec
from .names import DEFAULT_FILL_BYTES

MAX_PROBE_BYTES = 2 * 2**30
"""The largest write of new memory a calibration makes (bytes): a job's master shard can be
tens of GB, and every rank's process writes one at once."""

__all__ = [
    "ALLOCATORS",
    "DEFAULT_FILL_BYTES",
    "MAX_PROBE_BYTES",
    "Calibration",
    "measure",
    "measure_fresh_write",
    "measure_new_memory",
    "measure_tensor_seconds",
]


@dataclass(frozen=True)
class Calibration:
    """Rates measured on one machine.

    Attributes:
        cores: usable cores of the process.
        memory_bytes: the machine's RAM (``MemTotal``), bytes; 0 when unknown.
        memcpy_gbps: host copy, every core (GB/s of bytes copied).
        thread_memcpy_gbps: host copy, one thread (GB/s).
        first_touch_gbps: writing new host memory (flatzero's host allocator), every core.
        thread_first_touch_gbps: the same, one thread (GB/s).
        cast_gbps: a bf16 -> fp32 cast into new host memory (flatzero's allocator), every
            core (GB/s of fp32 written).
        thread_cast_gbps: the same, one thread (GB/s).
        plain_first_touch_gbps: writing new host memory from torch's allocator, every core
            (GB/s); None in a calibration from before it was measured (the plan then uses
            ``first_touch_gbps``).
        plain_cast_gbps: a bf16 -> fp32 cast into such memory, every core (GB/s); None
            likewise (``cast_gbps``).
        fill_bytes: the size of each copy into new memory, bytes (0: not recorded).
        cast_bytes: the size of each cast into new memory, bytes (0: not recorded).
        ranks: the processes that wrote new memory at once for the every-core figures,
            each with ``cores // ranks`` threads, as the ranks of a node do; the plan of a
            node with that many ranks uses those figures as they are.
        device_copy_gbps: device-to-device copy (GB/s); None without CUDA.
        h2d_gbps: pinned host-to-device copy (GB/s); None without CUDA.
        tensor_seconds: per-tensor seconds of ``flatzero``, ``torch_cat``, ``legacy_cpu``.
        machine: what was measured (host name, torch version, device), for the record.
    """

    cores: int
    memory_bytes: int
    memcpy_gbps: float
    thread_memcpy_gbps: float
    first_touch_gbps: float
    thread_first_touch_gbps: float
    cast_gbps: float
    thread_cast_gbps: float
    plain_first_touch_gbps: float | None = None
    plain_cast_gbps: float | None = None
    fill_bytes: int = 0
    cast_bytes: int = 0
    ranks: int = 1
    device_copy_gbps: float | None = None
    h2d_gbps: float | None = None
    tensor_seconds: dict[str, float] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.cores, int) or self.cores < 1:
            raise ValueError(f"Calibration.cores must be a positive int, got {self.cores!r}")
        if not isinstance(self.ranks, int) or not 1 <= self.ranks <= self.cores:
            raise ValueError(
                f"Calibration.ranks must be an int in [1, cores={self.cores}], got {self.ranks!r}"
            )
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < 0:
            raise ValueError(
                f"Calibration.memory_bytes must be an int >= 0, got {self.memory_bytes!r}"
            )
        for name in (
            "memcpy_gbps",
            "thread_memcpy_gbps",
            "first_touch_gbps",
            "thread_first_touch_gbps",
            "cast_gbps",
            "thread_cast_gbps",
            "plain_first_touch_gbps",
            "plain_cast_gbps",
            "device_copy_gbps",
            "h2d_gbps",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Calibration.{name} must be > 0 GB/s, got {value!r}")

    def host_spec(self, base: HostSpec) -> HostSpec:
        """``base`` with this machine's measured host figures (cores, copy, new memory by
        both allocators)."""
        return dataclasses.replace(
            base,
            name="measured",
            cores=self.cores,
            memory_bytes=self.memory_bytes or base.memory_bytes,
            memcpy_gbps=self.memcpy_gbps,
            thread_memcpy_gbps=self.thread_memcpy_gbps,
            first_touch_gbps=self.first_touch_gbps,
            thread_first_touch_gbps=self.thread_first_touch_gbps,
            cast_gbps=self.cast_gbps,
            thread_cast_gbps=self.thread_cast_gbps,
            plain_first_touch_gbps=self.plain_first_touch_gbps or self.first_touch_gbps,
            plain_cast_gbps=self.plain_cast_gbps or self.cast_gbps,
            source=f"measured on {self.machine.get('host', 'this machine')}",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """Rebuild from ``to_dict`` (or the ``calibration`` entry of a plan JSON).

        Raises:
            ValueError: unknown fields, or a ``flatzero bench plan`` result, which holds
                one calibration per world size (``calibrations``): pass one of those.
        """
        if "calibrations" in data:
            raise ValueError(
                "this is a flatzero bench plan result, with one calibration per world size "
                f"({', '.join(sorted(data['calibrations']))}); pass one of its "
                "'calibrations' entries, or a flatzero info --measure --json file"
            )
        data = data.get("calibration") or data
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown calibration field(s) {sorted(unknown)}")
        return cls(**data)


def _best(run: Callable[[], float], repeats: int) -> float:
    return min(run() for _ in range(repeats))


ALLOCATORS: dict[str, Callable[[int, torch.dtype], torch.Tensor]] = {
    "flatzero": empty_host,
    "torch": lambda numel, dtype: torch.empty(numel, dtype=dtype),
}
"""The host allocators an init uses: flatzero's buffers and torch's own (DeepSpeed's)."""


def _timed_writes(
    nbytes: int,
    threads: int,
    src_dtype: torch.dtype,
    dst_dtype: torch.dtype,
    allocator: str,
    passes: int,
    settle_s: float,
    barrier: Any = None,
) -> list[float]:
    """Seconds of each of ``passes`` writes of a new buffer (see ``measure_fresh_write``);
    with ``barrier``, every process starts each pass together."""
    alloc = ALLOCATORS[allocator]
    numel = max(1, nbytes // dst_dtype.itemsize)
    src = torch.ones(numel, dtype=src_dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    seconds = []
    try:
        for _ in range(passes):
            if barrier is not None:
                barrier.wait()
            time.sleep(settle_s)
            t0 = time.perf_counter()
            buf = alloc(numel, dst_dtype)
            buf.copy_(src)
            seconds.append(time.perf_counter() - t0)
            del buf
    finally:
        torch.set_num_threads(before)
    return seconds


_WRITER_TIMEOUT_S = 600.0
"""Seconds a pass of concurrent writes may take beyond its settling before it is abandoned."""


def _writer(queue: Any, barrier: Any, args: tuple) -> None:
    """A process of ``measure_fresh_write``: its seconds per pass, or its error (after
    breaking the barrier, so that the other processes stop waiting for it)."""
    try:
        queue.put(_timed_writes(*args, barrier=barrier))
    except BaseException as error:
        barrier.abort()
        queue.put(RuntimeError(f"a calibration process failed: {error!r}"))


def _concurrent_writes(processes: int, args: tuple, passes: int, settle_s: float) -> list[float]:
    """The slowest process's seconds of each pass, ``processes`` processes writing at once;
    a process that fails or does not report in time fails the measurement, and no process
    is left behind."""
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(processes, timeout=settle_s + _WRITER_TIMEOUT_S)
    workers = [
        ctx.Process(target=_writer, args=(queue, barrier, args), daemon=True)
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    deadline = time.monotonic() + passes * (settle_s + _WRITER_TIMEOUT_S)
    per_process: list[Any] = []
    try:
        while len(per_process) < processes:
            try:
                per_process.append(queue.get(timeout=1.0))
            except queue_module.Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"exit codes {dead}" if dead else "no report in time"
                    raise RuntimeError(f"a calibration process failed ({why})") from None
    finally:
        barrier.abort()  # a process still waiting for a failed one stops waiting
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.terminate()
    failed = [r for r in per_process if isinstance(r, BaseException)]
    if failed:  # the process that failed first, not one the broken barrier released
        raise min(failed, key=lambda e: "BrokenBarrierError" in str(e))
    return [max(times) for times in zip(*per_process, strict=True)]


def measure_fresh_write(
    nbytes: int,
    threads: int,
    *,
    src_dtype: torch.dtype = torch.bfloat16,
    dst_dtype: torch.dtype = torch.bfloat16,
    allocator: str = "flatzero",
    processes: int = 1,
    passes: int = 3,
    settle_s: float = 0.0,
) -> float:
    """GB/s written copying a ``src_dtype`` tensor into a new buffer of ``nbytes`` in
    ``dst_dtype`` from ``allocator`` (a key of ``ALLOCATORS``): what filling a new host
    bucket, or casting into a new fp32 master shard, costs, with ``threads`` threads in
    each of ``processes`` processes writing at once (as the ranks of a node do: page
    faults of separate processes contend less than those of one process's threads). The
    rate is all processes' bytes over the slowest one's seconds, the median of ``passes``
    passes, each on a new buffer, freed after it, and each after sleeping ``settle_s`` (10 s
    on the development VM: memory freed before is handed back to the host and cold again,
    as at a job's start; 0: back to back, pages just freed are still backed)."""
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {sorted(ALLOCATORS)}, got {allocator!r}")
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    args = (nbytes, threads, src_dtype, dst_dtype, allocator, passes, settle_s)
    if processes == 1:
        slowest = _timed_writes(*args)
    else:
        slowest = _concurrent_writes(processes, args, passes, settle_s)
    numel = max(1, nbytes // dst_dtype.itemsize)
    return processes * numel * dst_dtype.itemsize / statistics.median(slowest) / 1e9


def _tiny_params(count: int, numel: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.full((numel,), float(i % 7))) for i in range(count)]


def measure_tensor_seconds(
    count: int = 2000, numel: int = 64, repeats: int = 3
) -> dict[str, float]:
    """Per-tensor seconds of each flatten method on ``count`` tensors of ``numel`` fp32
    elements (bytes negligible), one rank, best of ``repeats`` after a warm-up."""
    from ..config import FlattenConfig
    from ..flatten import flatten_parameters
    from ..measure.baselines import flatten_legacy_cpu, flatten_torch_cat

    config = FlattenConfig(tier="cpu", device="cpu", progress=False)
    methods: dict[str, Callable[[list[nn.Parameter]], Any]] = {
        "flatzero": lambda ps: flatten_parameters(ps, config=config),
        "torch_cat": lambda ps: flatten_torch_cat([ps], rank=0, world_size=1, device="cpu"),
        "legacy_cpu": lambda ps: flatten_legacy_cpu([ps], rank=0, world_size=1, device="cpu"),
    }
    out = {}
    for name, method in methods.items():

        def one(method=method) -> float:
            params = _tiny_params(count, numel)
            t0 = time.perf_counter()
            method(params)
            return time.perf_counter() - t0

        one()
        out[name] = _best(one, repeats) / count
    return out


def measure_new_memory(
    fill_bytes: int = DEFAULT_FILL_BYTES,
    cast_bytes: int = 512 * 2**20,
    *,
    ranks: int = 1,
    settle_s: float = 0.0,
    passes: int = 3,
) -> dict[str, float | int]:
    """The six rates of writing new host memory (``Calibration`` field names, with the
    sizes and ``ranks``): with flatzero's allocator a copy of ``fill_bytes`` (a bucket) and
    a cast into ``cast_bytes`` of fp32 (a master shard), by every core (``ranks``
    processes with ``cores // ranks`` threads each, at once) and by one thread alone; with
    torch's, the copy and the cast of ``cast_bytes`` (DeepSpeed's flat buffer and master)
    by every core. Each rate is the median of ``passes`` passes; sizes above
    ``MAX_PROBE_BYTES`` are measured at that size."""
    cores = usable_cores()
    fill_bytes, cast_bytes = min(fill_bytes, MAX_PROBE_BYTES), min(cast_bytes, MAX_PROBE_BYTES)
    if not 1 <= ranks <= cores:
        raise ValueError(f"ranks must be in [1, {cores}] (this machine's cores), got {ranks}")

    def write(nbytes: int, dst: torch.dtype, *, alone: bool, allocator: str = "flatzero") -> float:
        return measure_fresh_write(
            nbytes,
            1 if alone else cores // ranks,
            dst_dtype=dst,
            allocator=allocator,
            processes=1 if alone else ranks,
            passes=passes,
            settle_s=settle_s,
        )

    return {
        "first_touch_gbps": write(fill_bytes, torch.bfloat16, alone=False),
        "thread_first_touch_gbps": write(fill_bytes, torch.bfloat16, alone=True),
        "cast_gbps": write(cast_bytes, torch.float32, alone=False),
        "thread_cast_gbps": write(cast_bytes, torch.float32, alone=True),
        "plain_first_touch_gbps": write(cast_bytes, torch.bfloat16, alone=False, allocator="torch"),
        "plain_cast_gbps": write(cast_bytes, torch.float32, alone=False, allocator="torch"),
        "fill_bytes": fill_bytes,
        "cast_bytes": cast_bytes,
        "ranks": ranks,
    }


# [Note: what measure() times]
# ``measure()`` times, with ``measure.limits`` and the allocators the job uses:
#
# - host memcpy with one thread and with every core (``limits.memcpy_seconds``);
# - writing new host memory, page faults included (so on a VM this also measures the host
#   backing the guest's pages), with both allocators an init uses:
#
#   - flatzero's (``hostmem.empty_host``: 2 MiB pages where the OS allows), by a copy of
#     the same dtype at the size of one bucket (filling a bucket) and by a bf16 -> fp32 cast
#     at the size of the master shard, one thread and every core;
#   - torch's own (``torch.empty``: what ``torch.cat``, ``clone`` and ``.to`` allocate, so
#     DeepSpeed's buffers), the same copy and cast with every core.
#
#   Each pass writes a buffer of its own after sleeping ``settle_s`` (cold or warm);
# - with CUDA: a device-to-device copy and a pinned upload (``limits.device_copy_seconds``,
#   ``limits.pinned_h2d_seconds``);
# - the per-tensor cost of each flatten method: ``flatten_parameters`` (``cpu`` tier) and the
#   two DeepSpeed algorithms of ``measure.baselines`` on many tiny tensors, whose bytes are
#   negligible.
#
# Measure at the sizes the job allocates and in the regime it runs in: the two allocators'
# rates differ, the rate of 2 MiB pages depends on the buffer's size, and memory freed a few
# seconds earlier is still backed and written faster than cold memory (figures:
# docs/benchmarks.md, "Figures behind the code's docstrings"; docs/plan.md).


def measure(
    nbytes: int = 512 * 2**20,
    *,
    fill_bytes: int = DEFAULT_FILL_BYTES,
    cast_bytes: int | None = None,
    ranks: int = 1,
    settle_s: float = 0.0,
    tensors: int = 2000,
) -> Calibration:
    """Measure this machine ([Note: what measure() times]): copies of ``nbytes``, new memory
    filled ``fill_bytes`` (a bucket) and cast ``cast_bytes`` (a master shard; default
    ``nbytes``) at a time by ``ranks`` processes at once (``measure_new_memory``). Takes a
    few seconds, plus ``settle_s`` before each of the 18 passes that write new memory."""
    import platform

    from ..measure import limits

    cores = usable_cores()
    device_copy = h2d = None
    device = "cpu"
    device_type = accel.accelerator_type()
    if device_type is not None:
        dev = torch.device(device_type, accel.current_index(device_type))
        device = accel.device_name(dev)
        device_copy = limits.device_copy_seconds(nbytes, dev).gbps
        pinned = limits.pinned_h2d_seconds(nbytes, dev)
        h2d = pinned.gbps if pinned is not None else None
    return Calibration(
        cores=cores,
        memory_bytes=meminfo_bytes("MemTotal") or 0,
        memcpy_gbps=limits.memcpy_seconds(nbytes, threads=cores).gbps,
        thread_memcpy_gbps=limits.memcpy_seconds(nbytes, threads=1).gbps,
        **measure_new_memory(fill_bytes, cast_bytes or nbytes, ranks=ranks, settle_s=settle_s),
        device_copy_gbps=device_copy,
        h2d_gbps=h2d,
        tensor_seconds=measure_tensor_seconds(tensors) if tensors else {},
        machine={"host": platform.node(), "torch": torch.__version__, "device": device},
    )
