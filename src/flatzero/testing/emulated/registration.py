"""``install``: the emulated device registered with torch and ``torch.distributed``."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

from .collectives import GlooOverAliases
from .device_module import DeviceModule, Guard, Hooks
from .fallback import fallback
from .kernels import IMPLS
from .pinning import HostRegistry
from .state import Counters, EmulatedDevice, EmulationUnavailable, installed, set_installed

__all__ = ["DEFERRED_ENV", "install"]

DEFERRED_ENV = "FLATZERO_EMU_STREAMS"
"""``FLATZERO_EMU_STREAMS=deferred``: ``install`` turns on [Note: deferred streams] (a
test sets it before launching its rank processes)."""

_LIBRARIES: list[torch.library.Library] = []

# [Note: registration rests on experimental torch]
# The registration rests on torch's experimental
# ``torch.utils.backend_registration._setup_privateuseone_for_python_backend`` and was
# written against torch 2.13: ``install`` raises ``EmulationUnavailable`` with the reason
# where that machinery is missing, and tests skip on it. Registration is process-global and
# cannot be undone: use it in a process of its own (a spawned test worker).


def install(
    name: str = "emu",
    *,
    capacity_bytes: int = 1 << 30,
    host_collectives: bool = True,
    deferred_streams: bool | None = None,
    host_registration: bool | None = None,
) -> EmulatedDevice:
    """Register the emulated accelerator ``name`` in this process (once per process).

    Args:
        name: the device type torch will know it by (``torch.device(name, i)``).
        capacity_bytes: memory per device, in bytes; allocations beyond it raise
            ``torch.OutOfMemoryError``. Change it later with ``set_capacity``.
        host_collectives: whether the ``<name>-gloo`` backend also takes host tensors (as
            gloo does); False makes it refuse them as NCCL does, for a group created with
            the device backend alone (``init_process_group("<name>-gloo")``).
        deferred_streams: [Note: deferred streams] (``streams``); None: on when the
            environment has ``FLATZERO_EMU_STREAMS=deferred`` (``DEFERRED_ENV``).
        host_registration: the device module offers ``cudart()`` to page-lock host memory
            ([Note: emulated registration]); None: as ``deferred_streams`` (so that the
            copies flatzero makes asynchronous only from page-locked memory are).

    Returns:
        The installed device (its counters and capacity).

    Raises:
        EmulationUnavailable: this torch lacks the Python PrivateUse1 machinery, or the
            PrivateUse1 slot is taken by another backend (see
            [Note: registration rests on experimental torch]).
    """
    current = installed()
    if current is not None:
        if current.name != name:
            raise EmulationUnavailable(
                f"emulated device {current.name!r} is already installed in this process; "
                f"one PrivateUse1 backend per process (asked for {name!r})"
            )
        return current
    setup = _python_backend_setup()
    if torch._C._get_privateuse1_backend_name() != "privateuseone":
        raise EmulationUnavailable(
            f"PrivateUse1 is already taken by {torch._C._get_privateuse1_backend_name()!r}"
        )
    if deferred_streams is None:
        deferred_streams = os.environ.get(DEFERRED_ENV, "") == "deferred"
    if host_registration is None:
        host_registration = deferred_streams
    state = EmulatedDevice(
        name=name,
        device_count=1,
        backend_name=f"{name}-gloo",
        counters=[Counters(capacity=capacity_bytes)],
        host_collectives=host_collectives,
        deferred_streams=deferred_streams,
        host_registry=HostRegistry() if host_registration else None,
    )
    set_installed(state)
    try:
        _register(state, setup)
    except Exception as e:  # pragma: no cover - depends on the torch build
        set_installed(None)
        raise EmulationUnavailable(
            f"could not register the emulated accelerator on torch {torch.__version__}: {e}"
        ) from e
    return state


def _python_backend_setup() -> Callable[..., None]:
    """torch's ``_setup_privateuseone_for_python_backend``; EmulationUnavailable without."""
    try:
        from torch.utils.backend_registration import (
            _setup_privateuseone_for_python_backend,
        )
    except ImportError as e:  # pragma: no cover - depends on the torch build
        raise EmulationUnavailable(f"torch {torch.__version__} has no Python backends: {e}") from e
    return _setup_privateuseone_for_python_backend


def _register(state: EmulatedDevice, setup: Callable[..., None]) -> None:
    """Register ``state``'s device module (through ``setup``), kernels, fallback and
    collective backend."""
    setup(state.name, backend_module=DeviceModule(), hook=Hooks(), device_guard=Guard())
    impl = torch.library.Library("aten", "IMPL")
    for op, fn in IMPLS:
        impl.impl(op, fn, "PrivateUse1")
    library = torch.library.Library("_", "IMPL")
    library.fallback(fallback, dispatch_key="PrivateUse1", with_keyset=True)
    _LIBRARIES.extend([impl, library])
    dist.Backend.register_backend(state.backend_name, GlooOverAliases, devices=[state.name])
    # torch counts no PrivateUse1 tensor shallow-copy compatible with a host one, so
    # ``module.to(name)`` would give each module a new Parameter and untie tied weights;
    # swapping (torch's announced future default) keeps every Parameter object.
    torch.__future__.set_swap_module_params_on_conversion(True)
