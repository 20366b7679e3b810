"""Which device a rank computes on, and where a process group can run collectives.

One place for every device decision of both doors, for any accelerator torch knows
(CUDA, XPU, Ascend NPU, HPU, a PrivateUse1 backend):

- the accelerator device of a rank is the process group's bound device when it has one,
  else the current device when the user set it explicitly (``set_device``), else
  ``LOCAL_RANK`` (as torchrun sets it and DeepSpeed's engine uses it);
- flat buffers go on the accelerator only when the process group's backend runs
  collectives on that device type (NCCL for CUDA, XCCL for XPU, HCCL for NPU, a
  registered backend's declared devices); a gloo group on a machine with GPUs keeps them
  on the host;
- small control tensors (agreement, norms) go where the group's backend takes them: the
  host when it has a host backend (gloo, or the gloo half of ``cpu:gloo,cuda:nccl``),
  else this rank's accelerator.

The device queries themselves go through the device seam (``accel.py``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import accel

__all__ = [
    "activate",
    "backend_of",
    "buckets_may_use_accelerator",
    "collective_device",
    "collectives_run_on",
    "collectives_run_on_cpu",
    "default_backend",
    "device_backends",
    "local_device_index",
    "resolve_device",
]

_HOST_ONLY = {"gloo": ("cpu",), "mpi": ("cpu",), "ucc": ("cpu",)}
"""Backends flatzero uses for host tensors only, whatever else torch lists for them:
gloo's CUDA support lacks reduce-scatter and is slow where it exists."""


def _distributed(group: dist.ProcessGroup | None) -> bool:
    return group is not None or (dist.is_available() and dist.is_initialized())


def backend_of(group: dist.ProcessGroup | None) -> str:
    """The backend of ``group`` in lower case (``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``, ...); ``""`` without a process group."""
    if not _distributed(group):
        return ""
    return str(dist.get_backend(group)).lower()


def device_backends(backend: str) -> dict[str, str]:
    """Device type -> backend name that runs its collectives, for a backend string.

    ``"cpu:gloo,cuda:nccl"`` names its devices; a single name takes the devices torch's
    registry declares for it (``dist.Backend.backend_capability``: nccl -> cuda, xccl ->
    xpu, a registered backend's ``devices``), gloo/mpi/ucc the host only.
    """
    if not backend:
        return {}
    if ":" in backend:
        pairs = (part.split(":", 1) for part in backend.split(",") if ":" in part)
        return {device.strip(): name.strip() for device, name in pairs}
    capability = getattr(dist.Backend, "backend_capability", {})
    devices = _HOST_ONLY.get(backend) or capability.get(backend) or ()
    return dict.fromkeys(devices, backend)


def default_backend(device_type: str) -> str:
    """The collective backend torch pairs with ``device_type`` (``"nccl"`` for CUDA,
    ``"xccl"`` for XPU, a registered backend for its device); gloo for the host."""
    default_for = getattr(dist, "get_default_backend_for_device", None)
    if default_for is not None:
        return str(default_for(device_type))
    return {"cuda": "nccl", "xpu": "xccl"}.get(device_type, "gloo")  # torch < 2.6


def collectives_run_on(group: dist.ProcessGroup | None, device_type: str) -> bool:
    """Whether ``group``'s backend runs collectives on ``device_type`` tensors (always true
    without a process group: one rank runs no collectives)."""
    backend = backend_of(group)
    return backend == "" or device_type in device_backends(backend)


def collectives_run_on_cpu(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s backend runs collectives on host tensors."""
    return collectives_run_on(group, "cpu")


def buckets_may_use_accelerator(group: dist.ProcessGroup | None) -> bool:
    """Whether this process has an accelerator and ``group`` can reduce-scatter and
    all-gather its tensors."""
    device_type = accel.accelerator_type()
    return device_type is not None and collectives_run_on(group, device_type)


def local_device_index(device_type: str, group: dist.ProcessGroup | None = None) -> int:
    """The index of this rank's ``device_type`` device.

    In order: the device ``group`` was bound to (``init_process_group(device_id=...)``);
    the current device when it is not 0 (the user called ``set_device``); ``LOCAL_RANK``
    (one device per local rank, or device 0 when the launcher shows each rank one
    device); the current device.

    Raises:
        ValueError: ``LOCAL_RANK`` names a device this process cannot see.
    """
    bound = _bound_device(group)
    if bound is not None and bound.type == device_type and bound.index is not None:
        return bound.index
    current = accel.current_index(device_type)
    local = os.environ.get("LOCAL_RANK")
    if current != 0 or local is None:
        return current
    count = accel.device_count(device_type)
    index = int(local)
    if count == 1:
        return 0
    if not 0 <= index < count:
        raise ValueError(
            f"LOCAL_RANK={index} but this process sees {count} {device_type} devices; launch "
            f"at most {count} ranks per node, or call torch.get_device_module("
            f"{device_type!r}).set_device(...) before flatzero"
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
        requested: ``FlattenConfig.device``: ``None`` (this rank's accelerator when there
            is one and the backend runs collectives there, else the host), ``"cpu"``, a
            device type (``"cuda"``: this rank's device of that type) or ``"cuda:N"``.
        group: the process group the buffers are sharded over.

    Raises:
        ValueError: an accelerator was requested but the group's backend cannot run
            collectives on its tensors.
    """
    if requested is None:
        device_type = accel.accelerator_type()
        if device_type is not None and collectives_run_on(group, device_type):
            return torch.device(device_type, local_device_index(device_type, group))
        return torch.device("cpu")
    device = torch.device(requested)
    if not accel.is_accelerator(device):
        return device
    if not collectives_run_on(group, device.type):
        raise ValueError(
            f"FlattenConfig.device={requested!r} but the process group's backend "
            f"{backend_of(group)!r} cannot reduce-scatter {device.type} tensors; initialize "
            f"the process group with a backend for {device.type} (for CUDA 'nccl' or "
            "'cpu:gloo,cuda:nccl'), or use device='cpu'"
        )
    if device.index is None:
        return torch.device(device.type, local_device_index(device.type, group))
    return device


def collective_device(
    group: dist.ProcessGroup | None, data_device: torch.device | None = None
) -> torch.device:
    """Where small tensors for ``group``'s collectives live: the host when the backend
    runs collectives there, else the accelerator of the data they go with
    (``data_device``, so a script that placed its model on ``cuda:N`` without
    ``set_device`` stays on it), else this rank's accelerator."""
    backend = backend_of(group)
    if not backend or collectives_run_on(group, "cpu"):
        return torch.device("cpu")
    if (
        data_device is not None
        and accel.is_accelerator(data_device)
        and collectives_run_on(group, data_device.type)
    ):
        return data_device
    for device_type in device_backends(backend):
        if device_type == accel.accelerator_type():
            return torch.device(device_type, local_device_index(device_type, group))
    raise ValueError(
        f"the process group's backend {backend!r} runs collectives on neither host tensors "
        f"nor this process's accelerator ({accel.accelerator_type()}); use a backend for "
        "one of them"
    )


def activate(device: torch.device) -> None:
    """Make ``device`` the current device of its type (as DeepSpeed's engine does with
    ``LOCAL_RANK``), so streams, events and kernels of this rank default to it."""
    accel.set_current(device)
