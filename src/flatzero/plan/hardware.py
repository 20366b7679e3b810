"""The hardware a plan is for: one table of GPUs and one of hosts.

Every figure says where it comes from (the ``source`` field of each entry, and the
comments): a vendor datasheet, an assumption stated here, or a measurement. Datasheet
bandwidths are peaks; real copies reach roughly 80-95% of them, so a time predicted from
them is a lower bound. ``flatzero info --measure`` measures a machine's own figures and
``flatzero plan --calibration`` uses them instead.

Units: bytes for memory, GB/s (1e9 bytes per second) for bandwidths, always per direction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["GPUS", "HOSTS", "GpuSpec", "HostSpec", "get_gpu", "get_host"]

_MIB = 2**20


def _check_positive(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner}.{name} must be a positive number, got {value!r}")


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator and the links around it.

    Attributes:
        name: the key in ``GPUS`` (or a user's name for an explicit spec).
        memory_bytes: device memory, bytes (as ``nvidia-smi`` reports it where known).
        hbm_gbps: device memory bandwidth, GB/s (datasheet; a device-to-device copy moves
            half of it, since it reads and writes every byte).
        pcie_gbps: host-to-device bandwidth from pinned host memory, GB/s per direction.
        intra_node_gbps: GPU-to-GPU bandwidth inside a node (NVLink, else PCIe), GB/s per
            direction per GPU: the bus bandwidth of an all-gather among the node's GPUs.
        network_gbps: network bandwidth per GPU between nodes, GB/s per direction (the
            GPU's NIC on a rail-optimized cluster).
        source: where the figures come from, in words.
    """

    name: str
    memory_bytes: int
    hbm_gbps: float
    pcie_gbps: float
    intra_node_gbps: float
    network_gbps: float
    source: str = "explicit"

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "hbm_gbps", "pcie_gbps", "intra_node_gbps", "network_gbps"):
            _check_positive("GpuSpec", name, getattr(self, name))
        object.__setattr__(self, "memory_bytes", int(self.memory_bytes))


@dataclass(frozen=True)
class HostSpec:
    """The host of one node: cores, memory and what copies through it cost.

    Attributes:
        name: the key in ``HOSTS`` (or ``"measured"``).
        cores: usable CPU cores per node.
        memory_bytes: host RAM per node, bytes.
        memcpy_gbps: bytes copied per second between host buffers already in memory, all
            cores of the node together (a copy reads and writes each byte: about half the
            memory system's bandwidth), GB/s.
        thread_memcpy_gbps: the same, one thread, GB/s.
        first_touch_gbps: bytes written per second into new host memory allocated as
            flatzero allocates its host buffers (``hostmem.empty_host``: 2 MiB pages where
            the OS allows; page faults and the kernel zeroing pages included), all cores,
            GB/s.
        thread_first_touch_gbps: the same, one thread, GB/s.
        cast_gbps: fp32 bytes written per second casting bf16/fp16 into such new host
            memory, all cores (the master shard of the ``cpu`` tier), GB/s.
        thread_cast_gbps: the same, one thread, GB/s.
        plain_first_touch_gbps: bytes written per second into new host memory from
            torch's own allocator (4 KiB pages: what ``torch.cat``, ``clone`` and ``.to``
            allocate, so DeepSpeed's host buffers), all cores, GB/s.
        plain_cast_gbps: fp32 bytes written per second casting bf16/fp16 into such memory,
            all cores, GB/s.
        pageable_h2d_gbps: host-to-device bandwidth from pageable (not pinned) memory per
            GPU, GB/s: the driver stages it through its own pinned buffer. Also used for
            device-to-pageable-host copies.
        disk_gbps: read bandwidth of the checkpoint's storage, whole node, GB/s.
        source: where the figures come from, in words.
    """

    name: str
    cores: int
    memory_bytes: int
    memcpy_gbps: float
    thread_memcpy_gbps: float
    first_touch_gbps: float
    thread_first_touch_gbps: float
    cast_gbps: float
    thread_cast_gbps: float
    plain_first_touch_gbps: float
    plain_cast_gbps: float
    pageable_h2d_gbps: float
    disk_gbps: float
    source: str = "explicit"

    def __post_init__(self) -> None:
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1:
            raise ValueError(f"HostSpec.cores must be a positive int, got {self.cores!r}")
        for field in dataclasses.fields(self):
            if field.name not in ("name", "cores", "source"):
                _check_positive("HostSpec", field.name, getattr(self, field.name))
        object.__setattr__(self, "memory_bytes", int(self.memory_bytes))


# Datasheets:
#   H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: 80 GB HBM3 at 3.35 TB/s, NVLink
#     900 GB/s (both directions, so 450 GB/s each way), PCIe Gen5 128 GB/s (64 each way).
#     Memory as nvidia-smi reports it on an H100 80GB HBM3: 81559 MiB.
#   H200 SXM: NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5
#     128 GB/s. nvidia-smi: 143771 MiB.
#   A100 SXM4 80GB: NVIDIA A100 datasheet: 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s
#     (300 each way), PCIe Gen4 64 GB/s (32 each way). nvidia-smi: 81920 MiB.
#   A100 SXM4 40GB: same datasheet: 40 GB HBM2 at 1,555 GB/s. nvidia-smi: 40960 MiB.
#   L40S: NVIDIA L40S datasheet: 48 GB GDDR6 at 864 GB/s, no NVLink (GPU-to-GPU over
#     PCIe Gen4 x16: 32 GB/s each way at best), PCIe Gen4 64 GB/s. nvidia-smi: 46068 MiB.
#   B200 (HGX B200): NVIDIA HGX B200 datasheet: 1,440 GB and 62 TB/s for 8 GPUs (180 GB,
#     7.7 TB/s each), NVLink 5 1.8 TB/s (900 each way); PCIe Gen5 assumed (64 each way).
#   Network: DGX H100/H200/B200 have one 400 Gb/s ConnectX-7 per GPU (50 GB/s); DGX A100
#     one 200 Gb/s ConnectX-6 per GPU (25 GB/s). For L40S servers 25 GB/s is assumed.
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 81559 * _MIB, 3350, 64, 450, 50, "datasheet (H100 SXM5 80GB)"),
    "h200": GpuSpec("h200", 143771 * _MIB, 4800, 64, 450, 50, "datasheet (H200 SXM 141GB)"),
    "a100-80g": GpuSpec("a100-80g", 81920 * _MIB, 2039, 32, 300, 25, "datasheet (A100 SXM4)"),
    "a100-40g": GpuSpec("a100-40g", 40960 * _MIB, 1555, 32, 300, 25, "datasheet (A100 SXM4)"),
    "l40s": GpuSpec("l40s", 46068 * _MIB, 864, 32, 32, 25, "datasheet (L40S); network assumed"),
    "b200": GpuSpec("b200", 180 * 10**9, 7700, 64, 900, 50, "datasheet (HGX B200); PCIe assumed"),
}
"""Known GPUs by name (datasheet figures, per GPU, per direction)."""


# Host figures are assumptions for a typical 8-GPU server, stated so that they can be
# argued with; measure the real node with ``flatzero info --measure``.
#   dgx-h100: 2x Intel Xeon Platinum 8480C (the DGX H100's CPUs; PR #7828 used 8480+), 112
#     cores, 2 TiB DDR5-4800. Peak memory bandwidth 2 sockets x 8 channels x 38.4 GB/s =
#     614 GB/s; a copy reads and writes, and STREAM-like copies reach ~60% of the peak:
#     ~180 GB/s of bytes copied per node (assumed). One core copies ~10 GB/s (assumed).
#     First touch on bare metal is bound by the kernel's page zeroing and faults, ~4 GB/s
#     per thread with 4 KiB pages (assumed), scaling to ~100 GB/s for the node (assumed);
#     a bf16 -> fp32 cast into new memory the same (assumed: bound by the faults). The
#     same figures for flatzero's 2 MiB pages (assumed: no better, though fewer faults).
#     Pageable host-to-device copies: ~20 GB/s per GPU (assumed; the driver copies through
#     its own pinned buffer). Local NVMe RAID: ~25 GB/s per node (assumed).
#   dgx-a100: 2x AMD EPYC 7742, 128 cores, 1 TiB DDR4-3200: 2 x 8 x 25.6 = 410 GB/s peak,
#     ~120 GB/s copied (assumed); the per-thread figures as above; pageable H2D 12 GB/s.
HOSTS: dict[str, HostSpec] = {
    "dgx-h100": HostSpec(
        name="dgx-h100",
        cores=112,
        memory_bytes=2 * 2**40,
        memcpy_gbps=180,
        thread_memcpy_gbps=10,
        first_touch_gbps=100,
        thread_first_touch_gbps=4,
        cast_gbps=100,
        thread_cast_gbps=4,
        plain_first_touch_gbps=100,
        plain_cast_gbps=100,
        pageable_h2d_gbps=20,
        disk_gbps=25,
        source="assumed (see flatzero/plan/hardware.py)",
    ),
    "dgx-a100": HostSpec(
        name="dgx-a100",
        cores=128,
        memory_bytes=2**40,
        memcpy_gbps=120,
        thread_memcpy_gbps=10,
        first_touch_gbps=80,
        thread_first_touch_gbps=4,
        cast_gbps=80,
        thread_cast_gbps=4,
        plain_first_touch_gbps=80,
        plain_cast_gbps=80,
        pageable_h2d_gbps=12,
        disk_gbps=20,
        source="assumed (see flatzero/plan/hardware.py)",
    ),
}
"""Known hosts by name (assumptions, per node)."""


def get_gpu(name: str) -> GpuSpec:
    """The GPU called ``name`` (a key of ``GPUS``)."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(
            f"unknown GPU {name!r}; choose one of {', '.join(GPUS)} or give its figures "
            "explicitly (--gpu-memory-gib, --hbm-gbps, --pcie-gbps, --nvlink-gbps, --network-gbps)"
        ) from None


def get_host(name: str) -> HostSpec:
    """The host called ``name`` (a key of ``HOSTS``)."""
    try:
        return HOSTS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown host {name!r}; choose one of {', '.join(HOSTS)}") from None
