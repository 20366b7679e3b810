"""The default process group, created the way ``deepspeed.initialize`` creates it: by
``flatzero.initialize`` always, by the PyTorch door when a launcher started several
processes and none created it (``join_launched_job``)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from . import accel
from .devices import default_backend, local_device_index
from .ports import free_port

__all__ = [
    "DEFAULT_TIMEOUT",
    "FLATZERO_TIMEOUT_VARIABLE",
    "TIMEOUT_VARIABLE",
    "ensure_process_group",
    "job_timeout",
    "join_launched_job",
]

logger = logging.getLogger(__name__)

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

DEFAULT_TIMEOUT = timedelta(minutes=30)
"""The job's timeout when neither ``FLATZERO_TIMEOUT`` nor ``DEEPSPEED_TIMEOUT`` is set."""

TIMEOUT_VARIABLE = "DEEPSPEED_TIMEOUT"
"""The environment variable giving that timeout in minutes, as DeepSpeed reads it."""

FLATZERO_TIMEOUT_VARIABLE = "FLATZERO_TIMEOUT"
"""flatzero's own setting of the job's timeout, in seconds (both doors, the HF route);
it takes precedence over ``DEEPSPEED_TIMEOUT``."""


def _positive(name: str, value: str, unit: str, example: str, *, whole: bool) -> float:
    """``value`` of the variable ``name`` as a positive number of ``unit``.

    Raises:
        ValueError: naming the variable, the value, the unit and an ``example``.
    """
    text = value.strip()
    try:
        number = int(text) if whole else float(text)
    except ValueError:
        number = 0
    if not number > 0 or number == float("inf"):
        kind = "whole number" if whole else "number"
        raise ValueError(
            f"{name}={value!r}: it must be a positive {kind} of {unit} (the timeout of "
            f"flatzero's collectives and waits); e.g. {name}={example}"
        )
    return float(number)


def job_timeout() -> timedelta:
    """The job's timeout: of every collective on a group flatzero makes (the default group
    of either door, its gloo control groups) and of flatzero's own waits for other ranks
    (the least a checkpoint's write wait allows, ``control.host_work_timeout``).

    ``FLATZERO_TIMEOUT`` seconds when set, else ``DEEPSPEED_TIMEOUT`` minutes (as DeepSpeed
    reads it), else ``DEFAULT_TIMEOUT``.

    Raises:
        ValueError: a variable is set to something other than a positive number
            (``DEEPSPEED_TIMEOUT``: whole number), naming it.
    """
    seconds = os.environ.get(FLATZERO_TIMEOUT_VARIABLE, "")
    if seconds.strip():
        value = _positive(FLATZERO_TIMEOUT_VARIABLE, seconds, "seconds", "600", whole=False)
        return timedelta(seconds=value)
    minutes = os.environ.get(TIMEOUT_VARIABLE, "")
    if minutes.strip():
        value = _positive(TIMEOUT_VARIABLE, minutes, "minutes", "30", whole=True)
        return timedelta(minutes=value)
    return DEFAULT_TIMEOUT


_LAUNCHER_SIZES = ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
"""Variables in which a launcher that is not torchrun (``srun``, ``mpirun``) gives the
number of processes it started."""


def _check_not_one_of_many() -> None:
    """Refuse to make a world of one process when a launcher started several: each task
    would train alone, silently.

    Raises:
        ValueError: naming the launcher's variable and the torchrun variables missing.
    """
    for name in _LAUNCHER_SIZES:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 1:
            missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
            raise ValueError(
                f"{name}={value} says this is one of {value} processes, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set, so "
                "every process would train alone; launch with torchrun (srun torchrun ...), "
                "or export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the "
                "launcher's variables (docs/multinode.md)"
            )


def _single_process_env() -> bool:
    """torchrun's environment for a world of one process (not launched by torchrun,
    deepspeed or mpirun); whether the rendezvous port is one this function chose."""
    chosen = "MASTER_PORT" not in os.environ
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    return chosen


_PORT_TRIES = 3
"""Rendezvous ports tried for a one-process group whose port flatzero chose: another
process may take a probed port before the store listens on it (EADDRINUSE)."""


def _init_default_group(backend: str, port_chosen: bool) -> None:
    """``init_process_group`` from the environment; on a port flatzero chose that was
    taken meanwhile, again on a fresh one."""
    for attempt in range(_PORT_TRIES):
        try:
            dist.init_process_group(backend, timeout=job_timeout())
            return
        except dist.DistNetworkError as error:
            if not port_chosen or "EADDRINUSE" not in str(error) or attempt == _PORT_TRIES - 1:
                raise
            os.environ["MASTER_PORT"] = str(free_port())


def ensure_process_group(dist_init_required: bool | None) -> None:
    """The default process group: the one initialized, else one from torchrun's
    environment (NCCL with CUDA, gloo without), else a one-process gloo group.

    Raises:
        ValueError: ``dist_init_required`` is False and no group is initialized; or a
            launcher started several processes without torchrun's environment.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ValueError(
            "dist_init_required=False but torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() first or drop dist_init_required"
        )
    device_type = accel.accelerator_type()
    port_chosen = False
    if not all(k in os.environ for k in _TORCHRUN_ENV):
        _check_not_one_of_many()
        port_chosen = _single_process_env()
    backend = "gloo"
    if device_type is not None:
        accel.set_current(torch.device(device_type, local_device_index(device_type)))
        backend = default_backend(device_type)
    _init_default_group(backend, port_chosen)
    # The group is flatzero's to tear down: a script that never calls
    # destroy_process_group() otherwise leaves it to interpreter finalization, where a
    # rank was seen to abort ("terminate called without an active exception", exit -6).
    atexit.register(_destroy_at_exit)
    logger.info(
        "initialized torch.distributed (%s): rank %d of %d",
        dist.get_backend(),
        dist.get_rank(),
        dist.get_world_size(),
    )


def _destroy_at_exit() -> None:
    """Destroy the default group at interpreter exit if the script did not."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):  # exiting anyway: never a second error
            dist.destroy_process_group()


def _launched_world_size() -> int:
    """The number of processes torchrun (or the DeepSpeed launcher) says this job has; 1
    when none says."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() else 1


def join_launched_job() -> None:
    """For the PyTorch door (``ZeroOptimizer``, ``flatten_parameters``, ``load_flat``) with
    ``process_group=None``: when a launcher started this process as one of several and no
    default process group exists, create it as ``flatzero.initialize`` does
    (``ensure_process_group``) and say so, so that N processes train one model together,
    never N separate copies. Without a launcher (one plain process) nothing is created.

    Raises:
        ValueError: a launcher other than torchrun started several processes without
            torchrun's environment (``_check_not_one_of_many``).
    """
    if dist.is_initialized():
        return
    if _launched_world_size() == 1:
        _check_not_one_of_many()
        return
    ensure_process_group(None)
    if dist.get_rank() == 0:
        logger.warning(
            "flatzero: WORLD_SIZE=%d but torch.distributed was not initialized; initialized "
            "it (%s) as flatzero.initialize does, so the %d ranks train together. Call "
            "torch.distributed.init_process_group() before building the optimizer to choose "
            "the backend and timeout yourself",
            dist.get_world_size(),
            dist.get_backend(),
            dist.get_world_size(),
        )
