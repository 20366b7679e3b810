"""The init report: what flattening did, how long each phase took, what it cost."""

from __future__ import annotations

import functools
import os
import resource
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from . import accel
from .words import plural

if TYPE_CHECKING:
    from .cores import CoreShare

__all__ = [
    "LINE_WIDTH",
    "GroupReport",
    "InitReport",
    "ReportBuilder",
    "fit",
    "owns_report",
    "report_is_owned",
]

LINE_WIDTH = 99
"""The most characters a line of a report takes (longer facts wrap, indented)."""

_OWNED: ContextVar[bool] = ContextVar("flatzero_init_report_owned", default=False)
_F = TypeVar("_F", bound=Callable[..., Any])


def owns_report(function: _F) -> _F:
    """Decorate an init that logs one report holding the facts of the inits it calls.

    [Note: one init report per job] ``flatten_parameters`` logs its report, and so does
    ``ZeroOptimizer``, when a user calls them; ``flatzero.initialize`` calls both and logs
    one report that holds their facts. While an ``owns_report`` function runs, the inits
    it calls ask ``report_is_owned()`` and stay silent, so no fact is logged twice
    (``python -m flatzero.run`` shows flatzero's INFO lines: it printed the flatten report
    twice before)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        token = _OWNED.set(True)
        try:
            return function(*args, **kwargs)
        finally:
            _OWNED.reset(token)

    return wrapper  # type: ignore[return-value]


def report_is_owned() -> bool:
    """Whether an enclosing init (``owns_report``) logs this init's facts in its report."""
    return _OWNED.get()


def fit(lines: list[str], width: int = LINE_WIDTH) -> str:
    """``lines`` joined, each wrapped at ``width`` characters (continuations indented four
    spaces more than the line)."""
    out = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip()) + 4)
        out.extend(
            textwrap.wrap(
                line,
                width,
                subsequent_indent=indent,
                break_on_hyphens=False,
                break_long_words=False,
            )
            or [line]
        )
    return "\n".join(out)


PHASES = ("plan", "flatten", "master", "sync")
"""Init phases, in order."""


@dataclass(frozen=True)
class GroupReport:
    """One (param group, dtype) layout after flattening.

    Attributes:
        group_index: the user's param group.
        dtype: the params' dtype, e.g. ``"bfloat16"``.
        tier: the tier that started the group ("device", "host", ...).
        bucket_tiers: the tier that built each bucket (differs after an out-of-memory fallback).
        params: number of params.
        elements: elements of the params themselves.
        padding: elements of alignment and tail padding.
        buckets: number of buckets.
        device: where the buckets live (``"mixed"`` after a fallback to host memory).
    """

    group_index: int
    dtype: str
    tier: str
    bucket_tiers: tuple[str, ...]
    params: int
    elements: int
    padding: int
    buckets: int
    device: str


@dataclass(frozen=True)
class InitReport:
    """What ``flatten_parameters`` did on this rank.

    Attributes:
        rank: this process's rank.
        world_size: number of ranks.
        device: where the flat buffers were meant to go.
        tier_reason: why the starting tier was chosen.
        groups: one entry per (param group, dtype) layout.
        phase_seconds: wall seconds per phase (plan, flatten, master, sync).
        wall_seconds: wall seconds of the whole init.
        cpu_seconds: process CPU seconds (user + system, all threads) spent in init.
        bytes_moved: bytes copied, by kind: ``device_copy``, ``host_copy``, ``h2d``, ``d2h``,
            ``all_gather`` (bytes received by this rank).
        peak_device_bytes: peak CUDA memory allocated during init above what was allocated
            when it started (bytes); ``None`` without CUDA. flatzero never resets the
            process's peak statistics (they are the user's): when an earlier peak of the
            process was higher than any point of the init, this is that earlier peak above
            the start, an upper bound.
        host_peak_rss_bytes: the process's peak resident set size so far (bytes).
        events: notable things that happened, e.g. an out-of-memory fallback.
        core_share: this rank's share of its host's cores and what it was derived from
            (affinity, cgroup quota, ranks on the host); None in a report built without
            flattening.
        host_threads: intra-op threads init ran with (torch's count inside init: the
            share, or ``FlattenConfig.host_threads``); None as ``core_share``.
    """

    rank: int
    world_size: int
    device: str
    tier_reason: str
    groups: tuple[GroupReport, ...]
    phase_seconds: dict[str, float]
    wall_seconds: float
    cpu_seconds: float
    bytes_moved: dict[str, int]
    peak_device_bytes: int | None
    host_peak_rss_bytes: int
    events: tuple[str, ...] = ()
    core_share: CoreShare | None = None
    host_threads: int | None = None

    @property
    def tiers(self) -> tuple[str, ...]:
        """Starting tier per group."""
        return tuple(g.tier for g in self.groups)

    def to_dict(self) -> dict:
        """JSON-serializable form."""
        return asdict(self)

    def facts(self) -> list[str]:
        """The report's facts, one line each (unindented; ``summary`` wraps them)."""
        gib = 2**30
        lines = [f"tier: {'+'.join(self.tiers)} ({self.tier_reason})"]
        lines += [
            f"group {g.group_index} {g.dtype}: tier {g.tier}, {plural(g.params, 'param')}, "
            f"{g.elements / 1e6:.2f}M elements, {plural(g.buckets, 'bucket')}"
            for g in self.groups
        ]
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in self.phase_seconds.items())
        lines.append(f"phases: {phases}; CPU {self.cpu_seconds:.2f}s")
        moved = ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in self.bytes_moved.items() if v)
        lines.append(f"moved: {moved or 'nothing'}")
        memory = f"memory: host peak RSS {self.host_peak_rss_bytes / gib:.2f} GiB"
        if self.peak_device_bytes is not None:
            memory += f", device peak {self.peak_device_bytes / gib:.2f} GiB above the start"
        lines.append(memory)
        if self.core_share is not None:
            lines.append(f"threads: {self.host_threads} (share: {self.core_share.describe()})")
        lines += [f"event: {event}" for event in self.events]
        return lines

    def summary(self) -> str:
        """The report for a human: a headline, then one line per fact, each line under
        ``LINE_WIDTH`` characters."""
        head = f"flatzero init {self.wall_seconds:.3f}s on {plural(self.world_size, 'rank')}"
        return fit([head, *(f"  {fact}" for fact in self.facts())])


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class ReportBuilder:
    """Collects timings, bytes and events while init runs; ``build()`` freezes them."""

    rank: int
    world_size: int
    device: torch.device
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    bytes_moved: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("device_copy", "host_copy", "h2d", "d2h", "all_gather"), 0
        )
    )
    events: list[str] = field(default_factory=list)
    core_share: CoreShare | None = None
    host_threads: int | None = None
    _wall0: float = field(default_factory=time.perf_counter)
    _cpu0: float = field(default_factory=_cpu_seconds)
    _device_base: int = 0

    def __post_init__(self) -> None:
        accel.synchronize(self.device)
        self._device_base = accel.memory_allocated(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase (wall seconds; CUDA work is synchronized at its end)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            accel.synchronize(self.device)
            self.phase_seconds[name] += time.perf_counter() - t0

    def moved(self, kind: str, nbytes: int) -> None:
        """Count ``nbytes`` copied of ``kind``."""
        self.bytes_moved[kind] += int(nbytes)

    def threads(self, share: CoreShare, used: int) -> None:
        """Record the rank's core ``share`` and the intra-op threads init ``used``."""
        self.core_share = share
        self.host_threads = used

    def build(self, tier_reason: str, groups: list[GroupReport]) -> InitReport:
        """Freeze the report."""
        peak = None
        if accel.is_accelerator(self.device):
            peak = max(0, accel.max_memory_allocated(self.device) - self._device_base)
        return InitReport(
            rank=self.rank,
            world_size=self.world_size,
            device=str(self.device),
            tier_reason=tier_reason,
            groups=tuple(groups),
            phase_seconds=dict(self.phase_seconds),
            wall_seconds=time.perf_counter() - self._wall0,
            cpu_seconds=_cpu_seconds() - self._cpu0,
            bytes_moved=dict(self.bytes_moved),
            peak_device_bytes=peak,
            host_peak_rss_bytes=_peak_rss_bytes(),
            events=tuple(self.events),
            core_share=self.core_share,
            host_threads=self.host_threads,
        )
