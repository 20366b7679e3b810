"""The flatten tiers, declared once.

Each tier is one ``TierSpec``: how it is built, what it can read, where its buffers
live, how much accelerator memory it needs, whether its fill is a collective, where it
goes when memory runs out, and how many host threads it may use. Everything that asks a
question about tiers (``FlattenConfig.tier``'s check, ``choice.choose_tier``, the
fallback driver in ``flatten.driver``, the DeepSpeed door, the planner) reads it here.
Adding a tier is one entry in ``REGISTRY`` plus its class in ``flatten.tiers``.

Fallback chains (out of memory moves the remaining buckets one step down)::

    buffers in host memory:  device -> host_park -> cpu;  host -> cpu;  sharded -> cpu
    buffers on a GPU:        device -> host_park  (then MemoryError on every rank)

On a GPU the chain never ends in host memory: the optimizer needs every bucket on the
device, so the other tiers end their chain there.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from .. import accel
from ..config import FlattenConfig, register_check
from ..cores import host_threads
from .tiers import DirectTier, HostParkTier, Tier, TierContext, UploadTier

__all__ = [
    "REGISTRY",
    "SOURCES",
    "TIERS",
    "TIER_ALIASES",
    "TierSpec",
    "canonical_tier",
    "chain",
    "check_tier",
    "gathering_tier",
    "make_tier",
    "next_tier_down",
    "spec",
    "tiers_reading",
]

SOURCES = ("params", "checkpoint", "nothing")
"""Where a tier may take bucket values from: the params themselves, a safetensors
checkpoint, or nothing at all (``allocate_only``: buffers are allocated, not filled)."""


def _peak_one_bucket(largest_bucket: int, total: int, shards: int) -> int:
    """The params already occupy the device: buckets replace them one at a time."""
    return largest_bucket + shards


def _peak_shards_only(largest_bucket: int, total: int, shards: int) -> int:
    """Each bucket's params leave the device before the bucket is allocated."""
    return shards


def _peak_all_buckets(largest_bucket: int, total: int, shards: int) -> int:
    """The params are elsewhere: every bucket is new memory on the device."""
    return total + shards


def _peak_nothing(largest_bucket: int, total: int, shards: int) -> int:
    """Buffers and shards live in host memory."""
    return 0


@dataclass(frozen=True)
class TierSpec:
    """One flatten tier.

    Attributes:
        name: the tier's name (``FlattenConfig.tier``).
        level: how far down a fallback chain the tier sits (0: a starting tier); a
            tier's fallback has a higher level. Ranks agree on a bucket's tier by taking
            the highest level any rank reached.
        fallback_on_host: the next tier down when buffers are in host memory (None: last).
        fallback_on_accelerator: the next tier down when buffers are on an
            accelerator (None: last).
        collective_fill: the fill all-gathers across the ranks at world size > 1, so
            every rank must allocate each bucket before any rank fills it.
        sources: what the tier may read bucket values from (see ``SOURCES``).
        buffers_on_host: the buckets live in host memory whatever the target device.
        threads: ``(config, share) -> threads``: intra-op host threads the tier may use
            per rank, from the config and the rank's share of the cores
            (``CoreShare.threads``).
        peak_device_bytes: ``(largest_bucket, total_buckets, shards) -> bytes`` of free
            accelerator memory the tier needs on each rank (all arguments in bytes).
        build: ``TierContext -> Tier``: the tier object of one flatten call.
    """

    name: str
    level: int
    fallback_on_host: str | None
    fallback_on_accelerator: str | None
    collective_fill: bool
    sources: frozenset[str]
    buffers_on_host: bool
    threads: Callable[[FlattenConfig, int], int]
    peak_device_bytes: Callable[[int, int, int], int]
    build: Callable[[TierContext], Tier]

    def fallback(self, device: torch.device) -> str | None:
        """The next tier down for buffers on ``device``."""
        if accel.is_accelerator(device):
            return self.fallback_on_accelerator
        return self.fallback_on_host

    def fill_is_collective(self, world_size: int) -> bool:
        """Whether every rank takes part in each bucket's fill."""
        return self.collective_fill and world_size > 1


REGISTRY: dict[str, TierSpec] = {
    spec.name: spec
    for spec in (
        TierSpec(
            name="device",
            level=0,
            fallback_on_host="host_park",
            fallback_on_accelerator="host_park",
            collective_fill=False,
            sources=frozenset({"params", "nothing"}),
            buffers_on_host=False,
            threads=host_threads,
            peak_device_bytes=_peak_one_bucket,
            build=lambda ctx: DirectTier("device", ctx, on_host=False),
        ),
        TierSpec(
            name="host",
            level=0,
            fallback_on_host="cpu",
            fallback_on_accelerator=None,
            collective_fill=False,
            sources=frozenset({"params", "checkpoint"}),
            buffers_on_host=False,
            threads=host_threads,
            peak_device_bytes=_peak_all_buckets,
            build=lambda ctx: UploadTier("host", ctx, own_slice=False),
        ),
        TierSpec(
            name="sharded",
            level=0,
            fallback_on_host="cpu",
            fallback_on_accelerator=None,
            collective_fill=True,
            sources=frozenset({"params", "checkpoint"}),
            buffers_on_host=False,
            threads=host_threads,
            peak_device_bytes=_peak_all_buckets,
            build=lambda ctx: UploadTier("sharded", ctx, own_slice=ctx.world_size > 1),
        ),
        TierSpec(
            name="host_park",
            level=1,
            fallback_on_host="cpu",
            fallback_on_accelerator=None,
            collective_fill=False,
            sources=frozenset({"params"}),
            buffers_on_host=False,
            threads=host_threads,
            peak_device_bytes=_peak_shards_only,
            build=lambda ctx: HostParkTier("host_park", ctx),
        ),
        TierSpec(
            name="cpu",
            level=2,
            fallback_on_host=None,
            fallback_on_accelerator=None,
            collective_fill=False,
            sources=frozenset(SOURCES),
            buffers_on_host=True,
            threads=host_threads,
            peak_device_bytes=_peak_nothing,
            build=lambda ctx: DirectTier("cpu", ctx, on_host=True),
        ),
    )
}
"""Every flatten tier, by name, in the order the docs list them."""

TIERS = ("auto", *REGISTRY)
"""What ``FlattenConfig.tier`` accepts: ``auto`` or a registered tier."""


TIER_ALIASES: Mapping[str, str] = {"offload": "host_park"}
"""Deprecated tier names still accepted, and the tier each names (``offload`` was the
``host_park`` tier's name, too easily taken for optimizer offload)."""

_warned_aliases: set[str] = set()


def canonical_tier(name: str) -> str:
    """``name``, or the tier a deprecated alias names (``TIER_ALIASES``; one
    ``FutureWarning`` per alias and process)."""
    if not isinstance(name, str) or name not in TIER_ALIASES:
        return name
    new = TIER_ALIASES[name]
    if name not in _warned_aliases:
        _warned_aliases.add(name)
        warnings.warn(
            f"flatten tier {name!r} is now called {new!r}; {name!r} still works for now, "
            f"write tier {new!r} instead",
            FutureWarning,
            stacklevel=3,
        )
    return new


def check_tier(config: FlattenConfig) -> None:
    """Raise ``ValueError`` unless ``config.tier`` is ``auto`` or a registered tier (a
    deprecated alias becomes the tier it names: ``canonical_tier``). Run by every
    ``FlattenConfig`` at construction (registered with ``config.register_check``)."""
    if config.tier in TIER_ALIASES:
        object.__setattr__(config, "tier", canonical_tier(config.tier))
    if config.tier != "auto" and config.tier not in REGISTRY:
        raise ValueError(
            f"FlattenConfig.tier is {config.tier!r}; it must be one of "
            f"{', '.join(('auto', *REGISTRY))}"
        )


register_check(check_tier)


def spec(name: str) -> TierSpec:
    """The spec of tier ``name``.

    Raises:
        ValueError: ``name`` is not a registered tier.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown tier {name!r}; registered tiers: {', '.join(REGISTRY)}"
        ) from None


def make_tier(name: str, ctx: TierContext) -> Tier:
    """The tier object for ``name`` in one flatten call."""
    return spec(name).build(ctx)


def next_tier_down(tier: str, device: torch.device) -> str | None:
    """The tier that takes over the remaining buckets after ``tier`` ran out of memory
    while building buffers for ``device`` (None: nothing below)."""
    return spec(tier).fallback(device)


def tiers_reading(source: str) -> tuple[str, ...]:
    """``auto`` and the tiers that can take bucket values from ``source``."""
    return ("auto", *(s.name for s in REGISTRY.values() if source in s.sources))


def chain(name: str, device: torch.device) -> tuple[str, ...]:
    """``name`` and every tier below it for buffers on ``device``, in fallback order."""
    names = [name]
    while (lower := spec(names[-1]).fallback(device)) is not None:
        names.append(lower)
    return tuple(names)


def gathering_tier() -> str:
    """The tier whose fill leaves every bucket all-gathered from each rank's own slice
    (its fill is collective): initial weights are then equal on every rank by
    construction."""
    (name,) = (s.name for s in REGISTRY.values() if s.collective_fill)
    return name
