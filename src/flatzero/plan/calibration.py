"""This machine's measured rates, for the planner: ``flatzero info --measure``.

``measure()`` times, with ``bench.limits`` and the library's own host allocator:

- host memcpy with one thread and with every core (``limits.memcpy_seconds``);
- writing new host memory allocated as flatzero allocates its host buffers
  (``hostmem.empty_host``: 2 MiB pages where the OS allows), by a copy of the same dtype
  (filling a bucket) and by a bf16 -> fp32 cast (building the master shard), one thread and
  every core: page faults included, so on a VM this also measures the host backing the
  guest's pages (cold or warm: ``settle_s``);
- with CUDA: a device-to-device copy and a pinned upload (``limits.device_copy_seconds``,
  ``limits.pinned_h2d_seconds``);
- the per-tensor cost of each flatten method: ``flatten_parameters`` (``cpu`` tier) and the
  two DeepSpeed algorithms of ``bench.baselines`` on many tiny tensors, whose bytes are
  negligible.

The result is a ``Calibration``; ``to_dict``/``from_dict`` store it as JSON for
``flatzero plan --calibration FILE``.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..memory import meminfo_bytes
from .hardware import HostSpec

__all__ = [
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
        cast_gbps: a bf16 -> fp32 cast into new host memory, every core (GB/s of fp32
            written).
        thread_cast_gbps: the same, one thread (GB/s).
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
    device_copy_gbps: float | None = None
    h2d_gbps: float | None = None
    tensor_seconds: dict[str, float] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.cores, int) or self.cores < 1:
            raise ValueError(f"Calibration.cores must be a positive int, got {self.cores!r}")
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
            "device_copy_gbps",
            "h2d_gbps",
        ):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"Calibration.{name} must be > 0 GB/s, got {value!r}")

    def host_spec(self, base: HostSpec) -> HostSpec:
        """``base`` with this machine's measured host figures (cores, copy, first touch)."""
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
            source=f"measured on {self.machine.get('host', 'this machine')}",
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        """Rebuild from ``to_dict`` (or the ``calibration`` entry of a plan or bench JSON)."""
        data = data.get("calibration", data)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown calibration field(s) {sorted(unknown)}")
        return cls(**data)


def _best(run: Callable[[], float], repeats: int) -> float:
    return min(run() for _ in range(repeats))


def measure_fresh_write(
    nbytes: int,
    threads: int,
    *,
    src_dtype: torch.dtype = torch.bfloat16,
    dst_dtype: torch.dtype = torch.bfloat16,
    passes: int = 3,
    settle_s: float = 0.0,
) -> float:
    """GB/s written copying a ``src_dtype`` tensor into a new ``hostmem.empty_host`` buffer
    of ``nbytes`` in ``dst_dtype`` (what filling a new host bucket, or casting into a new
    fp32 master shard, costs), with ``threads`` threads: the median of ``passes`` passes,
    each on a new buffer, freed after it, and each after sleeping ``settle_s`` (3 s: the
    memory freed before is cold again on a VM that hands freed pages back, as at a job's
    start; 0: back to back, pages just freed may still be backed)."""
    from ..hostmem import empty_host

    numel = max(1, nbytes // dst_dtype.itemsize)
    src = torch.ones(numel, dtype=src_dtype)

    def one() -> float:
        time.sleep(settle_s)
        t0 = time.perf_counter()
        buf = empty_host(numel, dst_dtype)
        buf.copy_(src)
        seconds = time.perf_counter() - t0
        del buf
        return seconds

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seconds = statistics.median(one() for _ in range(passes))
        return numel * dst_dtype.itemsize / seconds / 1e9
    finally:
        torch.set_num_threads(before)


def _tiny_params(count: int, numel: int) -> list[nn.Parameter]:
    return [nn.Parameter(torch.full((numel,), float(i % 7))) for i in range(count)]


def measure_tensor_seconds(
    count: int = 2000, numel: int = 64, repeats: int = 3
) -> dict[str, float]:
    """Per-tensor seconds of each flatten method on ``count`` tensors of ``numel`` fp32
    elements (bytes negligible), one rank, best of ``repeats`` after a warm-up."""
    from ..bench.baselines import flatten_legacy_cpu, flatten_torch_cat
    from ..config import FlattenConfig
    from ..flatten import flatten_parameters

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


def _cores() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def measure_new_memory(
    nbytes: int = 512 * 2**20, *, settle_s: float = 0.0, passes: int = 3
) -> dict[str, float]:
    """The four rates of writing new host memory (``Calibration`` field names: copy and
    cast, every core and one thread), each the median of ``passes`` passes."""
    cores = _cores()

    def write(threads: int, dst: torch.dtype) -> float:
        return measure_fresh_write(nbytes, threads, dst_dtype=dst, passes=passes, settle_s=settle_s)

    return {
        "first_touch_gbps": write(cores, torch.bfloat16),
        "thread_first_touch_gbps": write(1, torch.bfloat16),
        "cast_gbps": write(cores, torch.float32),
        "thread_cast_gbps": write(1, torch.float32),
    }


def measure(
    nbytes: int = 512 * 2**20, *, settle_s: float = 0.0, tensors: int = 2000
) -> Calibration:
    """Measure this machine (see the module docstring); takes a few seconds (plus
    ``settle_s`` before each of the 12 passes that write new memory)."""
    import platform

    from ..bench import limits

    cores = _cores()
    device_copy = h2d = None
    device = "cpu"
    if torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
        device = torch.cuda.get_device_name(dev)
        device_copy = limits.device_copy_seconds(nbytes, dev).gbps
        pinned = limits.pinned_h2d_seconds(nbytes, dev)
        h2d = pinned.gbps if pinned is not None else None
    return Calibration(
        cores=cores,
        memory_bytes=meminfo_bytes("MemTotal") or 0,
        memcpy_gbps=limits.memcpy_seconds(nbytes, threads=cores).gbps,
        thread_memcpy_gbps=limits.memcpy_seconds(nbytes, threads=1).gbps,
        **measure_new_memory(nbytes, settle_s=settle_s),
        device_copy_gbps=device_copy,
        h2d_gbps=h2d,
        tensor_seconds=measure_tensor_seconds(tensors) if tensors else {},
        machine={"host": platform.node(), "torch": torch.__version__, "device": device},
    )
