"""The real DeepSpeed (ZeRO-1/2, 0.19.8) in this process, for tests and benchmarks alike.

The caller has already initialized a gloo process group (``torch.distributed``, env://
with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``LOCAL_WORLD_SIZE`` set, e.g. by ``torch.multiprocessing.spawn``). DeepSpeed is never a
hard import: it is imported inside the functions here, and ``deepspeed_available`` says
why it cannot be used when it cannot.
See [Note: DeepSpeed 0.19.8 on a CPU-only machine] beside ``_prepare_env``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
from types import ModuleType
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from ..procmem import trim_host_memory

__all__ = [
    "deepspeed_available",
    "deepspeed_config",
    "import_deepspeed",
    "prepare_deepspeed",
    "release_engine",
    "without_unavailable_deepspeed",
]

logger = logging.getLogger(__name__)

EXPECTED_VERSION = "0.19.8"
"""The DeepSpeed release the baselines were read from and the runner was tested with."""

_prepare_seconds: float | None = None


# [Note: DeepSpeed 0.19.8 on a CPU-only machine] What it takes to run it cleanly (found by
# running it):
#
# - ``DS_ACCELERATOR=cpu`` must be in the environment before ``deepspeed`` is first
#   imported (accelerator detection happens at import and is cached); without it DeepSpeed
#   guesses and logs a warning. ``_prepare_env`` sets it (if unset) and ``LOCAL_SIZE`` (the
#   CPU accelerator's device count; unset, it shells out to ``numactl`` to count NUMA nodes).
# - The process group is not re-initialized: ``deepspeed.comm.init_distributed`` sees
#   ``torch.distributed.is_initialized()`` and wraps the existing group in its
#   ``TorchBackend``; no new process groups are created per ``initialize`` call.
# - Creating that ``TorchBackend`` (once per process, on the first ``initialize``) JIT-builds
#   the ``deepspeed_shm_comm`` C++ op with ninja/g++ (about 40 s on 2 cores, cached in
#   ``~/.cache/torch_extensions`` or ``$TORCH_EXTENSIONS_DIR``; later processes only load
#   the ``.so``) and prints ``... built successfully`` to stdout. The op serves only
#   inference all-reduce, never ZeRO. ``prepare_deepspeed`` creates the backend once,
#   outside the timed region, with stdout captured, and by default marks the op
#   incompatible (``deepspeed.ops.__compatible_ops__``) so it is neither built nor loaded:
#   no compiler needed. No other op is compiled where a client ``torch.optim.AdamW`` with
#   ``zero_force_ds_cpu_optimizer: false`` avoids DeepSpeed's Adam ops; a config
#   ``optimizer`` of type Adam/AdamW without ``torch_adam`` builds FusedAdam (with optimizer
#   offload DeepSpeedCPUAdam), whose CPU op is JIT-compiled the same way (minutes the first
#   time, then cached): ``tests/test_deepspeed_export.py`` builds both before its spawns.
# - DeepSpeed's logger (``"DeepSpeed"``, its own stdout handler, not propagating) is set to
#   WARNING.
# - ``allgather_bucket_size`` must be even (``nccl_start_alignment_factor`` is 2).
# - With ``bf16`` enabled the engine casts every param that is not bf16 (inside
#   ``initialize``); models are required here to arrive in the requested dtype, so that the
#   timed region does the same work as flatzero's.
# - Between trials the engine must be destroyed. The ZeRO optimizer's gradient hooks live
#   in the autograd graph (C++, invisible to Python's cycle collector) and close over the
#   optimizer, so a dropped engine is never freed: measured +200 MB RSS and +292 live
#   tensors per trial for a 50M-param bf16 model at world size 2.
#   ``engine.destroy()`` (which calls the optimizer's ``destroy()``) removes the hooks;
#   ``release_engine`` does that, then ``gc.collect()`` and ``malloc_trim``. With it, over
#   10 alternating stage-1/2 trials RSS after each stays at the same level (±1 MB) and no
#   tensor stays alive. Without ``malloc_trim`` RSS creeps up by glibc heap
#   retention (not a leak), which is why ``trim_host_memory`` exists.
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
    Collective: call it on every rank.

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
    if dtype not in ("bf16", "fp32"):
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
