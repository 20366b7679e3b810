"""The rates one rank sees on a node: what the time model divides bytes by.

``node_rates`` derives them from a GPU and a host spec and the node's shape: the host's
memory system and cores are shared by the ranks of a node, each rank has its own PCIe link
and NIC. A measured ``Calibration`` (``flatzero info --measure``) replaces the host's
figures and, when it was taken on a GPU, the GPU's copy bandwidths.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .calibration import Calibration
from .hardware import GpuSpec, HostSpec

__all__ = ["DEFAULT_TENSOR_SECONDS", "Rates", "node_rates"]

DEFAULT_TENSOR_SECONDS = {"flatzero": 30e-6, "torch_cat": 17e-6, "legacy_cpu": 30e-6}
"""Per-tensor Python and dispatch cost of each flatten method (seconds), measured on the
2-core development VM (docs/benchmarks.md, "Many tensors"); a calibration replaces them."""


@dataclass(frozen=True)
class Rates:
    """What one rank can move per second during init (GB/s = 1e9 bytes per second).

    Attributes:
        device_copy_gbps: bytes copied per second device to device.
        h2d_pinned_gbps: pinned host memory to the device.
        h2d_pageable_gbps: pageable host memory to the device (and back).
        host_copy_gbps: bytes copied per second between host buffers already in memory,
            with the rank's share of the cores and of the memory system.
        first_touch_gbps: bytes written per second into new host memory from flatzero's
            host allocator (``hostmem.empty_host``), same share.
        host_cast_gbps: fp32 bytes written per second by a cast from the params' dtype
            into such memory (the ``cpu`` tier's master shard), same share.
        cast_gbps: fp32 bytes written per second by a cast from the params' dtype on the
            device: the device's copy bandwidth counted in fp32 bytes written (a cast from
            2-byte params reads 2 and writes 4 bytes per element); on a CPU-only job, into
            new memory from torch's allocator, every core of the node shared by its ranks.
        all_cores_first_touch_gbps: bytes written per second into new memory from torch's
            allocator when every rank of the node uses every core (DeepSpeed's host
            ``torch.cat``): the node's rate shared by its ranks.
        collective_gbps: bus bandwidth of an all-gather or reduce-scatter over all ranks.
        disk_gbps: the rank's share of the checkpoint storage's read bandwidth.
        tensor_seconds: per-tensor cost of each flatten method (``flatzero``,
            ``torch_cat``, ``legacy_cpu``), seconds.
        origin: where each rate came from (``datasheet``, ``assumed``, ``measured``).
    """

    device_copy_gbps: float
    h2d_pinned_gbps: float
    h2d_pageable_gbps: float
    host_copy_gbps: float
    first_touch_gbps: float
    host_cast_gbps: float
    cast_gbps: float
    all_cores_first_touch_gbps: float
    collective_gbps: float
    disk_gbps: float
    tensor_seconds: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_TENSOR_SECONDS))
    origin: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name.endswith("_gbps"):
                value = getattr(self, f.name)
                if not value > 0:
                    raise ValueError(f"Rates.{f.name} must be > 0 GB/s, got {value!r}")
        missing = set(DEFAULT_TENSOR_SECONDS) - set(self.tensor_seconds)
        if missing or min(self.tensor_seconds.values()) < 0:
            raise ValueError(
                f"Rates.tensor_seconds needs >= 0 for {sorted(DEFAULT_TENSOR_SECONDS)}"
            )

    def seconds(self, nbytes: float, rate: str) -> float:
        """``nbytes`` at the rate called ``rate`` (a field name without ``_gbps``)."""
        return nbytes / (getattr(self, f"{rate}_gbps") * 1e9)


def _share(per_thread: float, threads: int, node: float, ranks: int) -> float:
    """A rank's rate: its threads at ``per_thread`` each, at most its share of ``node``."""
    return min(per_thread * threads, node / ranks)


def _device_rates(
    gpu: GpuSpec, host: HostSpec, nodes: int, ranks: int, calibration: Calibration | None
) -> tuple[dict[str, float], dict[str, str]]:
    """The GPU-side rates of one rank (GB/s) and where each comes from."""
    rates = {
        "device_copy": gpu.hbm_gbps / 2,  # a copy reads and writes every byte
        "h2d_pinned": min(gpu.pcie_gbps, 2 * host.memcpy_gbps / ranks),
        "h2d_pageable": min(host.pageable_h2d_gbps, host.memcpy_gbps / ranks),
        "collective": gpu.intra_node_gbps
        if nodes == 1
        else min(gpu.intra_node_gbps, ranks * gpu.network_gbps),
    }
    host_origin = "assumed" if calibration is None else "measured"
    origin = {
        "device_copy": "datasheet",
        "h2d_pinned": "datasheet" if gpu.pcie_gbps <= rates["h2d_pinned"] else host_origin,
        "h2d_pageable": "assumed",
        "collective": "datasheet",
    }
    if calibration is not None and calibration.device_copy_gbps is not None:
        rates["device_copy"], origin["device_copy"] = calibration.device_copy_gbps, "measured"
    if calibration is not None and calibration.h2d_gbps is not None:
        rates["h2d_pinned"] = min(calibration.h2d_gbps, 2 * host.memcpy_gbps / ranks)
        origin["h2d_pinned"] = "measured"  # the GPU's link or the host's memory, both measured
    rates["cast"] = rates["device_copy"] * 2 * 4 / 6  # bf16 -> fp32: 6 bytes moved per 4 written
    origin["cast"] = origin["device_copy"]
    return rates, origin


def node_rates(
    gpu: GpuSpec | None,
    host: HostSpec,
    *,
    nodes: int,
    ranks_per_node: int,
    calibration: Calibration | None = None,
    huge_pages: bool = True,
) -> Rates:
    """The rates of one rank of a ``nodes`` x ``ranks_per_node`` job.

    Without a GPU (``gpu=None``) flatzero's only tier is ``cpu``, and what DeepSpeed puts
    in device memory is new host memory from torch's allocator, written with every core:
    the device rates are that allocator's rates, the node's shared by its ranks.
    With ``huge_pages=False`` flatzero's host buffers come from torch's allocator and take
    its rates: the node's over its ranks (a calibration measures torch's allocator with
    every core only, at the master shard's size). Otherwise a calibration measured with as
    many ranks as the node has (``Calibration.ranks``) gives each rank its share of the
    node's measured new-memory rates, and any other gives a rank its threads at the
    one-thread rate, at most its share of the node's.
    A pinned upload reads host memory at up to twice the node's copy rate (a copy reads and
    writes each byte), shared by the node's GPUs; a pageable one is a host copy into the
    driver's pinned buffer, so it is also capped by the rank's share of the copy rate.
    """
    if calibration is not None:
        host = calibration.host_spec(host)
    ranks = ranks_per_node
    threads = max(1, host.cores // ranks)
    if not huge_pages:
        # flatzero's host buffers come from torch's allocator (host_huge_pages=False).
        first_touch = host.plain_first_touch_gbps / ranks
        host_cast = host.plain_cast_gbps / ranks
    elif calibration is not None and calibration.ranks == ranks:
        # Measured in this node's shape: every rank writing new memory at once.
        first_touch, host_cast = host.first_touch_gbps / ranks, host.cast_gbps / ranks
    else:
        first_touch = _share(host.thread_first_touch_gbps, threads, host.first_touch_gbps, ranks)
        host_cast = _share(host.thread_cast_gbps, threads, host.cast_gbps, ranks)
    rates = {
        "host_copy": _share(host.thread_memcpy_gbps, threads, host.memcpy_gbps, ranks),
        "first_touch": first_touch,
        "host_cast": host_cast,
        "all_cores_first_touch": host.plain_first_touch_gbps / ranks,
        "disk": host.disk_gbps / ranks,
    }
    host_origin = "measured" if calibration is not None else "assumed"
    origin = dict.fromkeys(rates, host_origin)
    if gpu is None:
        # No accelerator: every "device" buffer and copy is new host memory from torch's
        # allocator; gloo collectives on one node go through host memory.
        plain = rates["all_cores_first_touch"]
        device = dict.fromkeys(("device_copy", "h2d_pinned", "h2d_pageable"), plain)
        device["cast"] = host.plain_cast_gbps / ranks
        device["collective"] = rates["host_copy"]
        origin |= dict.fromkeys(device, host_origin)
    else:
        device, device_origin = _device_rates(gpu, host, nodes, ranks, calibration)
        origin |= device_origin
    tensor_seconds = dict(DEFAULT_TENSOR_SECONDS)
    if calibration is not None and calibration.tensor_seconds:
        tensor_seconds |= calibration.tensor_seconds
    origin["tensor_seconds"] = "measured" if calibration is not None else "measured (dev VM)"
    return Rates(
        **{f"{name}_gbps": value for name, value in (rates | device).items()},
        tensor_seconds=tensor_seconds,
        origin=origin,
    )
