"""Which device a rank computes on, and where a process group can run collectives.

One place for every device decision of both doors:

- the CUDA device of a rank is the process group's bound device when it has one, else
  the current device when the user set it explicitly (``torch.cuda.set_device``), else
  ``LOCAL_RANK`` (as torchrun sets it and DeepSpeed's engine uses it);
- flat buffers go on CUDA only when the process group's backend runs collectives on CUDA
  tensors (NCCL); a gloo group on a machine with GPUs keeps them on the host;
- small control tensors (agreement, norms) go where the group's backend takes them: the
  host for gloo (or a ``cpu:gloo,cuda:nccl`` group), this rank's GPU for a pure NCCL group.

Every function here is plain logic over ``torch.cuda``'s queries (``is_available``,
``device_count``, ``current_device``), so CPU tests exercise it with those stubbed.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = [
    "activate",
    "backend_of",
    "buckets_may_use_cuda",
    "collective_device",
    "collectives_run_on_cpu",
    "local_cuda_index",
    "resolve_device",
]


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return group is not None or (dist.is_available() and dist.is_initialized())


def backend_of(group: dist.ProcessGroup | None) -> str:
    """The backend of ``group`` in lower case (``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``, ...); ``""`` without a process group."""
    if not _distributed(group):
        return ""
    return str(dist.get_backend(group)).lower()


def _cuda_backend(backend: str) -> bool:
    if ":" in backend:  # "cpu:gloo,cuda:nccl": a backend per device type
        return any(part.strip().startswith("cuda:") for part in backend.split(","))
    return backend in ("nccl", "xccl") or "nccl" in backend


def _cpu_backend(backend: str) -> bool:
    if ":" in backend:
        return any(part.strip().startswith("cpu:") for part in backend.split(","))
    return backend in ("gloo", "mpi") or "gloo" in backend


def buckets_may_use_cuda(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s backend can reduce-scatter and all-gather CUDA tensors (always
    true without a process group: one rank runs no collectives)."""
    backend = backend_of(group)
    return backend == "" or _cuda_backend(backend)


def collectives_run_on_cpu(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s backend runs collectives on host tensors (gloo, or a gloo part
    of a per-device backend); true without a process group."""
    backend = backend_of(group)
    return backend == "" or _cpu_backend(backend)


def local_cuda_index(group: dist.ProcessGroup | None = None) -> int:
    """The CUDA device index of this rank.

    In order: the device ``group`` was bound to (``init_process_group(device_id=...)``);
    the current device when it is not 0 (the user called ``torch.cuda.set_device``);
    ``LOCAL_RANK`` (one GPU per local rank, or device 0 when the launcher shows each rank
    one GPU); the current device.

    Raises:
        ValueError: ``LOCAL_RANK`` names a device this process cannot see.
    """
    bound = _bound_device(group)
    if bound is not None and bound.type == "cuda" and bound.index is not None:
        return bound.index
    current = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if current != 0 or local is None:
        return current
    count = torch.cuda.device_count()
    index = int(local)
    if count == 1:
        return 0
    if not 0 <= index < count:
        raise ValueError(
            f"LOCAL_RANK={index} but this process sees {count} CUDA devices; launch at most "
            f"{count} ranks per node, or call torch.cuda.set_device(...) before flatzero"
        )
    return index


def _bound_device(group: dist.ProcessGroup | None) -> torch.device | None:
    if not _distributed(group):
        return None
    pg = group if group is not None else dist.group.WORLD
    return getattr(pg, "bound_device_id", None)


def resolve_device(requested: str | None, group: dist.ProcessGroup | None) -> torch.device:
    """Where the flat buffers of ``group``'s ranks go.

    Args:
        requested: ``FlattenConfig.device``: ``None`` (this rank's GPU when CUDA is
            available and the backend runs collectives there, else the host), ``"cpu"``,
            ``"cuda"`` (this rank's GPU) or ``"cuda:N"``.
        group: the process group the buffers are sharded over.

    Raises:
        ValueError: CUDA was requested but the group's backend cannot run collectives
            on CUDA tensors.
    """
    if requested is None:
        if torch.cuda.is_available() and buckets_may_use_cuda(group):
            return torch.device("cuda", local_cuda_index(group))
        return torch.device("cpu")
    device = torch.device(requested)
    if device.type != "cuda":
        return device
    if not buckets_may_use_cuda(group):
        raise ValueError(
            f"FlattenConfig.device={requested!r} but the process group's backend "
            f"{backend_of(group)!r} cannot reduce-scatter CUDA tensors; initialize the process "
            "group with backend='nccl' (or 'cpu:gloo,cuda:nccl'), or use device='cpu'"
        )
    if device.index is None:
        return torch.device("cuda", local_cuda_index(group))
    return device


def collective_device(
    group: dist.ProcessGroup | None, data_device: torch.device | None = None
) -> torch.device:
    """Where small tensors for ``group``'s collectives live: the host unless the backend
    runs on CUDA only (NCCL), then the GPU of the data they go with (``data_device``, so
    a script that placed its model on ``cuda:N`` without ``set_device`` stays on it), else
    this rank's GPU."""
    backend = backend_of(group)
    if backend and _cuda_backend(backend) and not _cpu_backend(backend):
        if data_device is not None and data_device.type == "cuda":
            return data_device
        return torch.device("cuda", local_cuda_index(group))
    return torch.device("cpu")


def activate(device: torch.device) -> None:
    """Make ``device`` the current CUDA device (as DeepSpeed's engine does with
    ``LOCAL_RANK``), so streams, events and kernels of this rank default to it."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)
