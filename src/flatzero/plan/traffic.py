"""Bytes one rank moves during init, by kind and by link.

``flatzero_bytes`` counts exactly what ``InitReport.bytes_moved`` counts (the keys of
``report.ReportBuilder.bytes_moved``), computed from the layout instead of by running
([Note: flatzero's bytes by kind]). ``deepspeed_bytes`` counts what ``measure.baselines``
counts for DeepSpeed's two paths (``BaselineResult.flatten_bytes`` and ``master_bytes``:
bytes written by copies). ``links`` turns kinds into links (HBM, PCIe, host memory, NVLink,
network).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..deepspeed.layout import padded_numel, partition_range
from ..flatten.registry import spec
from ..layout import GroupLayout, Layout
from .memory_model import itemsize

__all__ = [
    "KINDS",
    "all_gather_link_bytes",
    "deepspeed_bytes",
    "deepspeed_master_bytes",
    "flatzero_bytes",
    "links",
]

KINDS = ("device_copy", "host_copy", "h2d", "d2h", "all_gather")
"""The keys of ``InitReport.bytes_moved``."""

_SOURCE_DEVICE = {"device": "cuda", "host": "cpu", "checkpoint": "cpu"}


def _copy_kind(src: str, dst: str) -> str:
    """``flatten.tiers.copy_kind`` on device types (``"cpu"`` or ``"cuda"``)."""
    if src == "cpu":
        return "host_copy" if dst == "cpu" else "h2d"
    return "d2h" if dst == "cpu" else "device_copy"


def _param_elements(group: GroupLayout, bucket: int, lo: int, hi: int) -> int:
    """Elements of params (not padding) inside ``[lo, hi)`` of ``bucket``."""
    return hi - lo - sum(end - start for start, end in group.gaps(bucket, lo, hi))


# [Note: flatzero's bytes by kind]
# - a direct fill (``device``, ``cpu``) copies every param of every bucket into it
#   (``flatten.tiers.DirectTier``), kind by source and destination (``tiers.copy_kind``);
# - an upload fill (``host``, ``sharded``) copies the params of its range (a whole bucket,
#   or this rank's slice in ``sharded``) into staging (``host_copy``; on a CPU the bucket is
#   the staging), uploads the whole range padding included (``h2d``, GPU only) and, in
#   ``sharded``, all-gathers the rest of the bucket (``all_gather``: bytes received);
# - ``host_park`` first copies a bucket's params to a host image (``d2h`` on a GPU), then
#   uploads as ``host`` does;
# - the master copy reads this rank's slice of every bucket (``host_copy`` when the master is
#   in host memory, else ``device_copy``; bytes of the slices in the params' dtype).


def _fill(
    moved: dict[str, int], group: GroupLayout, tier: str, rank: int, src: str, buffers: str
) -> None:
    """Add the bytes of filling every bucket of ``group`` in ``tier``."""
    size = itemsize(group.dtype)
    bucket_device = "cpu" if spec(tier).buffers_on_host else buffers
    own_slice = tier == "sharded" and group.world_size > 1
    for index, bucket in enumerate(group.buckets):
        params = _param_elements(group, index, 0, bucket.numel) * size
        if tier in ("device", "cpu"):
            moved[_copy_kind(src, bucket_device)] += params
            continue
        if tier == "host_park":
            moved[_copy_kind(src, "cpu")] += params  # to the host image
        lo, hi = bucket.rank_range(rank) if own_slice else (0, bucket.numel)
        moved["host_copy"] += _param_elements(group, index, lo, hi) * size
        if bucket_device != "cpu":
            moved["h2d"] += (hi - lo) * size
        if own_slice:
            moved["all_gather"] += (bucket.numel - (hi - lo)) * size


def flatzero_bytes(
    layout: Layout,
    tier: str,
    rank: int,
    *,
    params_on: str,
    buffers_on: str,
    build_master: bool = True,
) -> dict[str, int]:
    """``InitReport.bytes_moved`` of rank ``rank`` when every bucket is built in ``tier``.

    Args:
        layout: the model's layout.
        tier: a registered tier (not ``auto``).
        rank: the rank (the ``sharded`` tier's bytes depend on which slices it owns).
        params_on: ``"device"``, ``"host"`` or ``"checkpoint"`` (read from safetensors).
        buffers_on: device type of ``FlattenConfig.device``: ``"cuda"`` or ``"cpu"``.
        build_master: the fp32 master shards are built (and copied) too.
    """
    if params_on not in _SOURCE_DEVICE:
        raise ValueError(f"params_on {params_on!r} must be one of {', '.join(_SOURCE_DEVICE)}")
    if buffers_on not in ("cuda", "cpu"):
        raise ValueError(f"buffers_on {buffers_on!r} must be 'cuda' or 'cpu'")
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} is outside world size {layout.world_size}")
    moved = dict.fromkeys(KINDS, 0)
    src = _SOURCE_DEVICE[params_on]
    master_on = "cpu" if spec(tier).buffers_on_host else buffers_on
    for group in layout.groups:
        _fill(moved, group, tier, rank, src, buffers_on)
        if build_master:
            slices = sum(b.slice_numel for b in group.buckets) * itemsize(group.dtype)
            moved["host_copy" if master_on == "cpu" else "device_copy"] += slices
    return moved


def deepspeed_bytes(
    group_numels: Sequence[int], elt: int, rank: int, world_size: int, *, path: str
) -> dict[str, int]:
    """Bytes written by copies in DeepSpeed ZeRO-1/2's flatten on a GPU, by kind.

    ``path``: ``deepspeed_device`` (one ``torch.cat`` per group on the device) or
    ``deepspeed_legacy`` (every param to the host, ``torch.cat`` there, the flat buffer
    back). The fp32 master partition is a clone of the rank's partition, then a cast.
    Before either, DeepSpeed's engine moves params in host memory to the device; that is
    not counted here (see ``placement``).
    """
    moved = dict.fromkeys(KINDS, 0)
    for numel in group_numels:
        padded = padded_numel(numel, world_size)
        if path == "deepspeed_device":
            moved["device_copy"] += padded * elt
        elif path == "deepspeed_legacy":
            moved["d2h"] += numel * elt
            moved["host_copy"] += padded * elt
            moved["h2d"] += padded * elt
        else:
            raise ValueError(f"path {path!r} must be 'deepspeed_device' or 'deepspeed_legacy'")
        moved["device_copy"] += deepspeed_master_bytes(numel, elt, rank, world_size)
    return moved


def deepspeed_master_bytes(numel: int, elt: int, rank: int, world_size: int) -> int:
    """Bytes written building DeepSpeed's fp32 master partition of a group of ``numel``
    elements: a clone of the rank's partition, then its fp32 copy (none for fp32 params)."""
    padded = padded_numel(numel, world_size)
    _start, part = partition_range(padded, rank, world_size)
    return part * elt + (part * 4 if elt != 4 else 0)


def all_gather_link_bytes(received: int, *, nodes: int, gpus_per_node: int) -> tuple[int, int]:
    """(intra-node bytes, network bytes) one GPU receives in an all-gather in which it
    receives ``received`` bytes in all, as NCCL's ring does it with one ring per rail:
    every byte arrives over the GPU's intra-node links; a ring crosses each node boundary
    through one NIC, and the ``gpus_per_node`` rings share the data, so one NIC carries
    ``received / gpus_per_node`` (nothing with one node)."""
    network = received // gpus_per_node if nodes > 1 else 0
    return received, network


def links(moved: dict[str, int], *, nodes: int, gpus_per_node: int) -> dict[str, int]:
    """Bytes per link of one rank: ``hbm`` (device copies), ``host_memory`` (host copies),
    ``pcie_h2d``, ``pcie_d2h``, ``intra_node`` and ``network`` (the all-gather)."""
    intra, network = all_gather_link_bytes(
        moved["all_gather"], nodes=nodes, gpus_per_node=gpus_per_node
    )
    return {
        "hbm": moved["device_copy"],
        "host_memory": moved["host_copy"],
        "pcie_h2d": moved["h2d"],
        "pcie_d2h": moved["d2h"],
        "intra_node": intra,
        "network": network,
    }
