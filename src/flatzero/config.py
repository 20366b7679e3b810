"""Frozen configuration objects of flatzero, validated on construction."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .layout import DEFAULT_BUCKET_NUMEL

__all__ = ["FlattenConfig", "register_check"]


_CHECKS: list[Callable[[FlattenConfig], None]] = []
"""Checks run on every ``FlattenConfig`` at construction, registered by the rooms above
that own what they check (``register_check``). This module is data at the bottom of the
package and imports none of them: ``flatten.registry`` registers its tier check when it is
imported, which ``import flatzero`` (and so any ``flatzero.*`` import) does first."""


def register_check(check: Callable[[FlattenConfig], None]) -> None:
    """Run ``check(config)`` in every ``FlattenConfig.__post_init__`` from now on; it raises
    ``ValueError`` naming the field for a config it refuses. Registering twice is a no-op."""
    if check not in _CHECKS:
        _CHECKS.append(check)


def _check_positive_int(
    name: str, value: object, *, allow_none: bool = False, maximum: int | None = None
) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"FlattenConfig.{name} must be a positive int, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(
            f"FlattenConfig.{name} is {value:,}, more than {maximum:,}: it sizes allocations "
            "or loops; use a smaller value"
        )


def _check_whole_params(config: FlattenConfig) -> None:
    """``whole_params`` is a bool or param group indices (made a sorted tuple)."""
    value = config.whole_params
    if isinstance(value, bool):
        return
    if isinstance(value, (list, tuple, set, frozenset)) and all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        object.__setattr__(config, "whole_params", tuple(sorted(set(value))))
        return
    raise ValueError(
        "FlattenConfig.whole_params must be True, False or a tuple of param group indices, "
        f"got {value!r}"
    )


@dataclass(frozen=True)
class FlattenConfig:
    """How to build the flat buffers.

    Attributes:
        tier: ``"auto"`` or a tier of ``flatten.registry.REGISTRY``; ``"auto"`` picks
            from where the params are and the minimum free device memory over all ranks.
        device: where the flat buffers live (``"cuda"``, ``"cuda:1"``, ``"cpu"``); ``None``
            means the current CUDA device when CUDA is available, else the CPU.
        bucket_numel: target bucket size in elements; a bigger param gets its own bucket.
        alignment: every param starts on a multiple of this many elements.
        staging_buffers: number of pinned host staging buffers the ``host`` and
            ``host_park`` tiers cycle through (>= 2 overlaps the host fill with the copy).
        host_threads: intra-op CPU threads per rank while flattening; ``None`` means the
            rank's share of its host's cores (``cores.core_share``: usable
            cores over the ranks on the host, counted through the process group).
        build_master: also build this rank's fp32 master shard of every group.
        master_on_host: build the master shards in host memory whatever the tier, straight
            from the buckets (optimizer offload: the optimizer steps on the host).
        progress: show a progress bar on rank 0 when init takes more than two seconds (where
            ``flatzero.progress`` shows bars: a terminal, ``FLATZERO_PROGRESS``).
        dtype: cast every trainable param to this floating dtype (``"bfloat16"``, a
            ``torch.dtype``, ...) as it is copied into its bucket: no separate cast pass, and
            in the ``sharded`` tier each rank casts only its own slices. ``None`` keeps each
            param's dtype.
        host_huge_pages: ask the OS for 2 MiB pages for the flat buffers and master
            shards in host memory (tier ``cpu``) and the ``host_park`` tier's host images;
            ``False`` takes torch's allocator. Which writes new memory faster depends on
            the machine: ``flatzero info --measure`` shows both.
        tier_reason: why ``tier`` was set, when a caller chose it for the user (the
            DeepSpeed door does on CPU), for the init report; ``None``: the user asked.
        whole_params: lay every param whole inside one rank's slice (``flatzero.owners``),
            for an optimizer that steps whole tensors (Muon); ``ZeroOptimizer`` sets it.
            ``True``: every param group; a tuple of param group indices: those groups only
            (DeepSpeed's Muon steps its Adam half elementwise on flat slices).
    """

    tier: str = "auto"
    device: str | None = None
    bucket_numel: int = DEFAULT_BUCKET_NUMEL
    alignment: int = 64
    staging_buffers: int = 2
    host_threads: int | None = None
    build_master: bool = True
    master_on_host: bool = False
    progress: bool = True
    dtype: str | None = None
    host_huge_pages: bool = True
    tier_reason: str | None = None
    whole_params: bool | tuple[int, ...] = False

    def __post_init__(self) -> None:
        for check in _CHECKS:  # the tier registry's: ``tier`` is one of its tiers
            check(self)
        _check_positive_int("bucket_numel", self.bucket_numel, maximum=2**40)
        _check_positive_int("alignment", self.alignment, maximum=2**20)
        _check_positive_int("staging_buffers", self.staging_buffers, maximum=1024)
        _check_positive_int("host_threads", self.host_threads, allow_none=True)
        _check_whole_params(self)
        for name in ("build_master", "master_on_host"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"FlattenConfig.{name} must be True or False, got {getattr(self, name)!r}"
                )
        if not isinstance(self.host_huge_pages, bool):
            raise ValueError(
                f"FlattenConfig.host_huge_pages must be True or False, got {self.host_huge_pages!r}"
            )
        if self.device is not None and not isinstance(self.device, str):
            object.__setattr__(self, "device", str(self.device))
        if self.dtype is not None:
            name = str(self.dtype).removeprefix("torch.")
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(
                    f"FlattenConfig.dtype is {self.dtype!r}; use a floating dtype such as "
                    "'bfloat16', 'float16' or 'float32', or None to keep each param's dtype"
                )
            object.__setattr__(self, "dtype", name)

    def compared_text(self) -> str:
        """What every rank's config must agree on, as text: the fields with ``device``
        reduced to its type (each rank has its own GPU) and ``progress`` dropped (only rank
        0 shows a bar)."""
        device = None if self.device is None else torch.device(self.device).type
        return repr(dataclasses.replace(self, device=device, progress=True))
