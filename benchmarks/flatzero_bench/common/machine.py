"""The machine a benchmark runs on, as its results describe it: cores, CPU, versions."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from flatzero.cores import usable_cores

__all__ = ["cpu_name", "describe_host", "device_name", "usable_cores", "versions"]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows, else "cpu"."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def device_name(device: str) -> str:
    """What computes on ``device`` (``"cuda"`` or ``"cpu"``): the GPU's or the CPU's name."""
    return torch.cuda.get_device_name() if device == "cuda" else cpu_name()


def versions() -> dict[str, str]:
    """``{"torch": ..., "deepspeed": ...}``; ``"deepspeed"`` only where it is installed."""
    out = {"torch": torch.__version__}
    try:
        from importlib.metadata import version

        out["deepspeed"] = version("deepspeed")
    except Exception:  # not installed
        pass
    return out


def describe_host(load_before: tuple[float, ...]) -> dict[str, Any]:
    """The host in full: name, cores (all and usable), CPU, memory in bytes, the 1-, 5- and
    15-minute load averages before the run (``load_before``) and now, and versions."""
    import flatzero

    return {
        "node": platform.node(),
        "cpus": os.cpu_count(),
        "cores_usable": usable_cores(),
        "cpu": cpu_name(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "python": platform.python_version(),
        "flatzero": flatzero.__version__,
        **versions(),
    }
