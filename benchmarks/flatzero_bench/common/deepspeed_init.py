"""Time the real ``deepspeed.initialize`` (ZeRO-1/2, DeepSpeed 0.19.8) on the CPU, set up
by ``flatzero.testing.deepspeed`` (what it takes to run DeepSpeed cleanly there).

The timed region is the ``deepspeed.initialize`` call alone (after a barrier): engine
setup, the broadcast of every param from rank 0, the ZeRO flatten, partitioning and the
fp32 master partition. Peak RSS is per process (the Linux high-water mark, reset before
the call through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from flatzero.deepspeed.layout import partition_range as deepspeed_partition_range
from flatzero.procmem import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_host_memory
from flatzero.testing.deepspeed import deepspeed_config, prepare_deepspeed, release_engine
from flatzero_bench.common.settings import BENCH_DTYPES

__all__ = ["DeepSpeedInitResult", "time_deepspeed_initialize"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepSpeedInitResult:
    """One timed ``deepspeed.initialize`` on one rank.

    Attributes:
        wall_s: wall-clock seconds of the ``deepspeed.initialize`` call on this rank.
        cpu_s: CPU seconds (user + system, all threads) of this process during the call.
        rss_before_bytes: resident set size just before the call, in bytes.
        peak_rss_bytes: highest resident set size during the call, in bytes (the process
            lifetime peak if ``peak_rss_reset`` is False).
        rss_after_bytes: resident set size right after the call, in bytes.
        peak_rss_reset: whether the kernel's high-water mark could be reset before the call.
        stage: ZeRO stage, 1 or 2.
        dtype: ``"bf16"`` or ``"fp32"``.
        bucket_numel: reduce and allgather bucket sizes, in elements.
        rank: this process's rank.
        world_size: ranks in the process group.
        flat_numel: per param group, elements of DeepSpeed's flat bit16 buffer (padded).
        partition_numel: per param group, elements of this rank's fp32 partition.
        partition_matches_flat: every fp32 partition equals this rank's slice of its flat
            buffer (as ``float32``) and every param is a view of a flat buffer.
        fp32_partitions: DeepSpeed's ``single_partition_of_fp32_groups`` (kept only with
            ``keep_partitions=True``; 4 bytes per element).
        engine: the engine (only with ``keep_engine=True``; call ``release_engine`` on it).
    """

    wall_s: float
    cpu_s: float
    rss_before_bytes: int
    peak_rss_bytes: int
    rss_after_bytes: int
    peak_rss_reset: bool
    stage: int
    dtype: str
    bucket_numel: int
    rank: int
    world_size: int
    flat_numel: tuple[int, ...]
    partition_numel: tuple[int, ...]
    partition_matches_flat: bool
    fp32_partitions: tuple[torch.Tensor, ...] | None = field(default=None, repr=False)
    engine: Any = field(default=None, repr=False, compare=False)


def _check_partitions(optimizer: Any, model: nn.Module) -> bool:
    flats = list(optimizer.bit16_groups_flat)
    parts = list(optimizer.single_partition_of_fp32_groups)
    world = dist.get_world_size()
    rank = dist.get_rank()
    for flat, part in zip(flats, parts, strict=True):
        start, _ = deepspeed_partition_range(flat.numel(), rank, world)
        if not torch.equal(part.detach(), flat.narrow(0, start, part.numel()).float()):
            return False
    storages = {f.untyped_storage().data_ptr() for f in flats}
    return all(
        p.untyped_storage().data_ptr() in storages
        for p in model.parameters()
        if p.requires_grad and p.numel() > 0
    )


def time_deepspeed_initialize(
    model: nn.Module,
    *,
    stage: int,
    dtype: Literal["bf16", "fp32"],
    bucket_numel: int,
    lr: float = 1e-3,
    keep_partitions: bool = False,
    keep_engine: bool = False,
) -> DeepSpeedInitResult:
    """Run and time ``deepspeed.initialize`` on ``model`` with a ZeRO-1/2 config.

    Call on every rank of an initialized process group (gloo on CPU), with the model on
    the CPU and already in ``dtype``. A ``torch.optim.AdamW(model.parameters(), lr=lr)`` is
    built before timing and passed as ``optimizer=``. Afterwards the model's params are
    views of DeepSpeed's flat buffers; unless ``keep_engine``, the engine is destroyed and
    collected before returning (the model stays usable as a plain module).

    Args:
        model: the model, on the CPU, params in ``dtype``; a fresh one per call.
        stage: ZeRO stage, 1 or 2.
        dtype: ``"bf16"`` or ``"fp32"``.
        bucket_numel: reduce/allgather bucket sizes in elements (positive, even).
        lr: AdamW learning rate.
        keep_partitions: keep DeepSpeed's fp32 partitions in the result (4 bytes/element).
        keep_engine: keep the engine in the result; the caller must ``release_engine`` it.

    Returns:
        Wall and CPU seconds of the call, RSS in bytes, layout sizes and a consistency check.

    Raises:
        RuntimeError: DeepSpeed not importable or no process group (see
            ``prepare_deepspeed``).
        ValueError: bad ``stage``/``dtype``/``bucket_numel``, or params not in ``dtype``.
    """
    config = deepspeed_config(stage=stage, dtype=dtype, bucket_numel=bucket_numel)
    want = BENCH_DTYPES[dtype]
    wrong = {str(p.dtype) for p in model.parameters() if p.dtype != want}
    if wrong:
        raise ValueError(
            f"model has params in {sorted(wrong)} but dtype={dtype!r}: convert the model "
            f"first (model.to({want})) so the timed initialize does not include a cast"
        )
    prepare_deepspeed()
    import deepspeed

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    trim_host_memory()
    dist.barrier()
    reset = reset_peak_rss()
    rss_before = rss_bytes()
    c0 = time.process_time()
    t0 = time.perf_counter()
    engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config
    )
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    peak = peak_rss_bytes()
    rss_after = rss_bytes()
    del optimizer

    matches = _check_partitions(ds_optimizer, model)
    flat_numel = tuple(f.numel() for f in ds_optimizer.bit16_groups_flat)
    parts = tuple(ds_optimizer.single_partition_of_fp32_groups)
    result = DeepSpeedInitResult(
        wall_s=wall,
        cpu_s=cpu,
        rss_before_bytes=rss_before,
        peak_rss_bytes=peak,
        rss_after_bytes=rss_after,
        peak_rss_reset=reset,
        stage=stage,
        dtype=dtype,
        bucket_numel=bucket_numel,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        flat_numel=flat_numel,
        partition_numel=tuple(p.numel() for p in parts),
        partition_matches_flat=matches,
        fp32_partitions=tuple(p.detach() for p in parts) if keep_partitions else None,
        engine=engine if keep_engine else None,
    )
    del parts, ds_optimizer
    if not keep_engine:
        release_engine(engine)
    del engine
    trim_host_memory()
    logger.debug(
        "deepspeed.initialize stage %d %s: %.3f s wall, %.3f s cpu", stage, dtype, wall, cpu
    )
    return result
