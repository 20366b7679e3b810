"""Time the real ``deepspeed.initialize`` (ZeRO-1/2, DeepSpeed 0.19.8) on the CPU.

The caller has already initialized a gloo process group (``torch.distributed``, env://
with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``LOCAL_WORLD_SIZE`` set, e.g. by ``torch.multiprocessing.spawn``). DeepSpeed is never a
hard import: it is imported inside the functions here, and ``deepspeed_available`` says
why it cannot be used when it cannot.

What it takes to run DeepSpeed 0.19.8 cleanly on a CPU-only machine (found by running it):

- ``DS_ACCELERATOR=cpu`` must be in the environment before ``deepspeed`` is first
  imported (accelerator detection happens at import and is cached); without it DeepSpeed
  guesses and logs a warning. ``_prepare_env`` sets it (if unset) and ``LOCAL_SIZE`` (the
  CPU accelerator's device count; unset, it shells out to ``numactl`` to count NUMA nodes).
- The process group is not re-initialized: ``deepspeed.comm.init_distributed`` sees
  ``torch.distributed.is_initialized()`` and wraps the existing group in its
  ``TorchBackend``; no new process groups are created per ``initialize`` call.
- Creating that ``TorchBackend`` (once per process, on the first ``initialize``) JIT-builds
  the ``deepspeed_shm_comm`` C++ op with ninja/g++ (about 40 s on 2 cores, cached in
  ``~/.cache/torch_extensions`` or ``$TORCH_EXTENSIONS_DIR``; later processes only load
  the ``.so``) and prints ``... built successfully`` to stdout. The op serves only
  inference all-reduce, never ZeRO. ``prepare_deepspeed`` creates the backend once,
  outside the timed region, with stdout captured, and by default marks the op
  incompatible (``deepspeed.ops.__compatible_ops__``) so it is neither built nor loaded:
  no compiler needed. No other op is compiled: the client ``torch.optim.AdamW`` with
  ``zero_force_ds_cpu_optimizer: false`` avoids DeepSpeed's CPU Adam.
- DeepSpeed's logger (``"DeepSpeed"``, its own stdout handler, not propagating) is set to
  WARNING.
- ``allgather_bucket_size`` must be even (``nccl_start_alignment_factor`` is 2).
- With ``bf16`` enabled the engine casts every param that is not bf16 (inside
  ``initialize``); models are required here to arrive in the requested dtype, so that the
  timed region does the same work as flatzero's.
- Between trials the engine must be destroyed. The ZeRO optimizer's gradient hooks live
  in the autograd graph (C++, invisible to Python's cycle collector) and close over the
  optimizer, so a dropped engine is never freed: measured +200 MB RSS and +292 live
  tensors per trial for a 50M-param bf16 model at world size 2.
  ``engine.destroy()`` (which calls the optimizer's ``destroy()``) removes the hooks;
  ``release_engine`` does that, then ``gc.collect()`` and ``malloc_trim``. With it, over
  10 alternating stage-1/2 trials RSS after each stays at the same level (±1 MB) and no
  tensor stays alive. Without ``malloc_trim`` RSS creeps up by glibc heap
  retention (not a leak), which is why ``trim_host_memory`` exists.

The timed region is the ``deepspeed.initialize`` call alone (after a barrier): engine
setup, the broadcast of every param from rank 0, the ZeRO flatten, partitioning and the
fp32 master partition. Peak RSS is per process (the Linux high-water mark, reset before
the call through ``/proc/self/clear_refs``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .baselines import deepspeed_partition_range
from .procmem import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_host_memory
from .settings import BENCH_DTYPES

__all__ = [
    "DeepSpeedInitResult",
    "deepspeed_available",
    "deepspeed_config",
    "import_deepspeed",
    "prepare_deepspeed",
    "release_engine",
    "time_deepspeed_initialize",
    "without_unavailable_deepspeed",
]

logger = logging.getLogger(__name__)

EXPECTED_VERSION = "0.19.8"
"""The DeepSpeed release the baselines were read from and the runner was tested with."""

_prepare_seconds: float | None = None


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


def _prepare_env() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        os.environ.setdefault("LOCAL_SIZE", local)


def _silence_deepspeed() -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def deepspeed_available() -> tuple[bool, str]:
    """Whether DeepSpeed can be imported here, and why not when it cannot.

    Sets ``DS_ACCELERATOR=cpu`` (if unset) before importing. Returns ``(True, "deepspeed
    X.Y.Z")`` when importable (logging a warning when the version is not
    ``EXPECTED_VERSION``), else ``(False, reason)``.
    """
    _prepare_env()
    try:
        import deepspeed
    except Exception as e:  # ImportError, or a broken install raising anything
        return False, f"deepspeed is not importable: {type(e).__name__}: {e}"
    _silence_deepspeed()
    version = getattr(deepspeed, "__version__", "unknown")
    if version != EXPECTED_VERSION:
        logger.warning("deepspeed %s found; the baselines follow %s", version, EXPECTED_VERSION)
    return True, f"deepspeed {version}"


def without_unavailable_deepspeed(
    names: tuple[str, ...],
) -> tuple[tuple[str, ...], dict[str, str]]:
    """``names`` less ``"deepspeed"`` where DeepSpeed cannot be imported, and the skipped:
    ``{"deepspeed": why}`` then, else ``{}``. Imports DeepSpeed only when ``names`` holds it."""
    if "deepspeed" not in names:
        return names, {}
    ok, why = deepspeed_available()
    if ok:
        return names, {}
    return tuple(n for n in names if n != "deepspeed"), {"deepspeed": why}


def _disable_shm_comm_op() -> None:
    import deepspeed.ops as ds_ops

    compatible = ds_ops.__compatible_ops__
    for name in list(compatible):
        if "shm_comm" in name:
            compatible[name] = False


def import_deepspeed(*, shm_comm_op: bool = False) -> ModuleType:
    """``deepspeed``, imported as a script on this CPU machine does: ``DS_ACCELERATOR=cpu``
    first, its logger at WARNING, and unless ``shm_comm_op`` its inference-only
    ``deepspeed_shm_comm`` op marked incompatible (neither built nor loaded).

    Raises:
        RuntimeError: DeepSpeed is not importable (the reason).
    """
    ok, why = deepspeed_available()
    if not ok:
        raise RuntimeError(why)
    import deepspeed

    if not shm_comm_op:
        _disable_shm_comm_op()
    return deepspeed


def prepare_deepspeed(*, shm_comm_op: bool = False, warmup: bool = True) -> float:
    """One-time per-process setup before timing; returns its seconds (0 after the first).

    Imports DeepSpeed, silences its logger, builds its communication backend over the
    already initialized process group and (``warmup``) runs one ``deepspeed.initialize`` on
    a one-layer model, so that none of these one-off costs lands in a timed ``initialize``
    (the first call in a process is otherwise about 2x slower: lazy imports and setup).
    Collective: call it on every rank (``time_deepspeed_initialize`` does).

    Args:
        shm_comm_op: build (first time ever: JIT-compile, about 40 s on 2 cores) or load
            DeepSpeed's ``deepspeed_shm_comm`` op, as a plain ``deepspeed.initialize``
            does. It serves only inference all-reduce, never ZeRO, so by default it is
            marked incompatible and skipped: no compiler needed, no one-off delay. If the
            build fails, it is skipped as well.

    Raises:
        RuntimeError: DeepSpeed is not importable, or no process group is initialized.
    """
    global _prepare_seconds
    if _prepare_seconds is not None:
        return 0.0
    deepspeed = import_deepspeed(shm_comm_op=shm_comm_op)
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "no torch.distributed process group is initialized: call "
            "torch.distributed.init_process_group('gloo') (env://) before timing deepspeed"
        )
    t0 = time.perf_counter()
    import deepspeed.comm as ds_comm

    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            ds_comm.init_distributed(dist_backend=dist.get_backend())
    except Exception as e:
        if not shm_comm_op:
            raise
        logger.warning("deepspeed shm comm op build failed (%s); continuing without it", e)
        _disable_shm_comm_op()
        with contextlib.redirect_stdout(captured):
            ds_comm.init_distributed(dist_backend=dist.get_backend())
    if warmup:
        tiny = nn.Linear(8, 8).to(torch.bfloat16)
        config = deepspeed_config(stage=2, dtype="bf16", bucket_numel=1024)
        with contextlib.redirect_stdout(captured):
            engine, *_ = deepspeed.initialize(
                model=tiny, optimizer=torch.optim.AdamW(tiny.parameters()), config=config
            )
        release_engine(engine)
        del engine, tiny
    for line in captured.getvalue().splitlines():
        logger.debug("deepspeed: %s", line)
    _silence_deepspeed()
    _prepare_seconds = time.perf_counter() - t0
    logger.debug("deepspeed %s prepared in %.2f s", deepspeed.__version__, _prepare_seconds)
    return _prepare_seconds


def deepspeed_config(
    *, stage: int, dtype: Literal["bf16", "fp32"], bucket_numel: int
) -> dict[str, Any]:
    """The DeepSpeed config used for the timed ``initialize``.

    Args:
        stage: ZeRO stage, 1 or 2.
        dtype: ``"bf16"`` (bf16 params, fp32 master) or ``"fp32"``.
        bucket_numel: ``reduce_bucket_size`` and ``allgather_bucket_size``, in elements;
            positive and even.
    """
    if stage not in (1, 2):
        raise ValueError(f"stage={stage!r} is not supported: use 1 or 2")
    if dtype not in BENCH_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported: use 'bf16' or 'fp32'")
    if bucket_numel <= 0 or bucket_numel % 2:
        raise ValueError(
            f"bucket_numel={bucket_numel} must be positive and even (DeepSpeed requires "
            "allgather_bucket_size to be a multiple of 2)"
        )
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": bucket_numel,
            "allgather_bucket_size": bucket_numel,
        },
        "bf16": {"enabled": dtype == "bf16"},
    }


def release_engine(engine: Any) -> None:
    """Free a DeepSpeed engine: ``destroy()`` (hooks, global registries), then collect."""
    if engine is None:
        return
    try:
        engine.destroy()
    except Exception as e:
        logger.warning("deepspeed engine.destroy() failed: %s", e)
    del engine
    trim_host_memory()


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
