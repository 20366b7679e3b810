"""Predicted init time of one rank, per flatzero tier and per DeepSpeed path.

Each method's time is its bytes per link (``traffic``) divided by the rank's rate on that
link (``rates.Rates``), plus a per-tensor cost, combined as the code runs them ([Note: how
each method's time combines]; [Note: copies and casts counted]).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .rates import Rates

__all__ = [
    "InitTime",
    "StepComm",
    "Work",
    "deepspeed_time",
    "flatzero_time",
    "placement_time",
    "step_comm",
]


@dataclass(frozen=True)
class Work:
    """What one rank's init handles, in bytes (and tensors).

    Attributes:
        tensors: trainable params (tensors) of the model.
        param_bytes: bytes of the params themselves.
        bucket_bytes: bytes of every bucket, padding included.
        slice_bytes: bytes of this rank's slices of every bucket, in the params' dtype.
        master_bytes: bytes of this rank's fp32 master shards.
        master_cast_bytes: the part of ``master_bytes`` cast from another dtype (the
            rest is a plain copy of fp32 params).
    """

    tensors: int
    param_bytes: int
    bucket_bytes: int
    slice_bytes: int
    master_bytes: int
    master_cast_bytes: int = 0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"Work.{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class InitTime:
    """Predicted seconds of one rank's init by one method.

    Attributes:
        method: a flatzero tier or a DeepSpeed path.
        seconds: the prediction.
        phases: seconds of each component before overlap (``fill``, ``upload``, ...).
        combine: how the phases add up, in words.
    """

    method: str
    seconds: float
    phases: dict[str, float] = field(default_factory=dict)
    combine: str = ""

    def __post_init__(self) -> None:
        if self.seconds < 0:
            raise ValueError(f"InitTime.seconds must be >= 0, got {self.seconds}")


# [Note: how each method's time combines]
# - ``device``: the bucket copies run asynchronously on the GPU while the host does the
#   per-tensor work: ``max(copies, tensors)``, then the master (a cast of this rank's slices).
# - ``host`` / ``sharded``: host fill, upload and all-gather of consecutive buckets overlap
#   (a ring of staging slots, a side stream): ``max(fill, upload, all-gather, tensors)``,
#   then the master. A checkpoint source is read at the rank's share of the disk.
# - ``host_park``: a bucket's params go to a host image before its upload starts:
#   ``d2h + max(fill, upload, tensors)``, then the master.
# - ``cpu``: every bucket and the master are new host memory from flatzero's allocator: the
#   buckets at the rate of copying into it, the master at the rate of casting into it (a
#   bf16 -> fp32 cast on a CPU without bf16 instructions is compute-bound), plus the
#   per-tensor work (one thread of control, nothing overlaps).
# - DeepSpeed ``deepspeed_device``: one ``torch.cat`` of each group on the GPU, the master
#   partition (a clone, then an fp32 copy) and DeepSpeed's per-tensor work.
# - DeepSpeed ``deepspeed_legacy``: every param to pageable host memory, ``torch.cat`` into
#   new host memory with every core of the node shared by all its ranks, the flat buffer back
#   to the GPU, then the master. Threads fighting over cores are not modeled: that is where
#   the 2,244 CPU-minutes of DeepSpeed #7677 went (docs/plan.md).
# - ``placement``: DeepSpeed's engine first moves params that are in host memory to the GPU
#   (``module.to``, pageable), every rank the whole model.
#
# [Note: copies and casts counted]
# Copies on a GPU are counted in bytes copied (a device copy rate already counts each byte
# once though it is read and written); a cast is counted in fp32 bytes written at the cast
# rate. On a machine without a GPU every DeepSpeed "device" buffer is new host memory from
# torch's allocator, so device rates are that allocator's (``rates.node_rates``).


def _master_seconds(work: Work, rates: Rates, *, on_host: bool) -> float:
    """The fp32 master: a cast of this rank's slices (bf16/fp16 params) or a plain copy
    (fp32 params) into flatzero's new host memory (``on_host``) or the device's."""
    copied = work.master_bytes - work.master_cast_bytes
    copy = rates.seconds(copied, "first_touch" if on_host else "device_copy")
    return copy + rates.seconds(work.master_cast_bytes, "host_cast" if on_host else "cast")


def flatzero_time(
    tier: str, fill: dict[str, int], work: Work, rates: Rates, *, params_on: str
) -> InitTime:
    """Seconds of ``flatten_parameters`` in ``tier`` for one rank.

    ``fill`` is the tier's bytes without the master copy (``traffic.flatzero_bytes(...,
    build_master=False)``).
    """
    tensors = work.tensors * rates.tensor_seconds["flatzero"]
    master = _master_seconds(work, rates, on_host=tier == "cpu")
    read_rate = "disk" if params_on == "checkpoint" else "host_copy"
    if tier == "cpu":
        phases = {"fill": rates.seconds(work.bucket_bytes, "first_touch"), "tensors": tensors}
        return InitTime(
            tier,
            sum(phases.values()) + master,
            phases | {"master": master},
            "fill + tensors + master",
        )
    if tier == "device":
        phases = {"fill": rates.seconds(fill["device_copy"], "device_copy"), "tensors": tensors}
        return InitTime(
            tier,
            max(phases.values()) + master,
            phases | {"master": master},
            "max(fill, tensors) + master",
        )
    phases = {
        "fill": rates.seconds(fill["host_copy"], read_rate),
        "upload": rates.seconds(fill["h2d"], "h2d_pinned"),
        "all_gather": rates.seconds(fill["all_gather"], "collective"),
        "tensors": tensors,
    }
    if tier == "host_park":
        out = rates.seconds(fill["d2h"], "h2d_pageable")
        return InitTime(
            tier,
            out + max(phases.values()) + master,
            {"d2h": out, **phases, "master": master},
            "d2h + max(fill, upload, tensors) + master",
        )
    return InitTime(
        tier,
        max(phases.values()) + master,
        phases | {"master": master},
        "max(fill, upload, all_gather, tensors) + master",
    )


def deepspeed_time(
    path: str,
    moved: dict[str, int],
    work: Work,
    rates: Rates,
    *,
    master_clone: int,
    master_cast: int,
) -> InitTime:
    """Seconds of DeepSpeed's flatten in ``path`` for one rank; ``moved`` is
    ``traffic.deepspeed_bytes``, of which the master partition is ``master_clone`` bytes
    (a clone in the params' dtype) plus ``master_cast`` (its fp32 copy; 0 for fp32)."""
    master = rates.seconds(master_clone, "device_copy") + rates.seconds(master_cast, "cast")
    if path == "deepspeed_device":
        phases = {
            "cat": rates.seconds(moved["device_copy"] - master_clone - master_cast, "device_copy"),
            "tensors": work.tensors * rates.tensor_seconds["torch_cat"],
            "master": master,
        }
        return InitTime(path, sum(phases.values()), phases, "cat + tensors + master")
    phases = {
        "d2h": rates.seconds(moved["d2h"], "h2d_pageable"),
        "cat": rates.seconds(moved["host_copy"], "all_cores_first_touch"),
        "h2d": rates.seconds(moved["h2d"], "h2d_pageable"),
        "tensors": work.tensors * rates.tensor_seconds["legacy_cpu"],
        "master": master,
    }
    return InitTime(path, sum(phases.values()), phases, "d2h + cat + h2d + tensors + master")


def placement_time(param_bytes: int, rates: Rates) -> float:
    """Seconds of DeepSpeed's ``module.to(device)`` of params in pageable host memory."""
    return rates.seconds(param_bytes, "h2d_pageable")


@dataclass(frozen=True)
class StepComm:
    """Communication of one optimizer step, per rank.

    Attributes:
        reduce_scatter_bytes: gradient bytes received by the reduce-scatters of a step
            (stage 2: one per micro-batch; stage 1: one per step), in the reduce dtype.
        all_gather_bytes: param bytes received by the all-gathers after the step.
        network_bytes: of both, what crosses one NIC (0 on one node).
        seconds: their time at the collective bus bandwidth.
    """

    reduce_scatter_bytes: int
    all_gather_bytes: int
    network_bytes: int
    seconds: float


def step_comm(
    gathered: int,
    reduced: int,
    *,
    stage: int,
    grad_accum: int,
    nodes: int,
    gpus_per_node: int,
    rates: Rates,
) -> StepComm:
    """Per-step communication: ``gathered`` bytes received by one all-gather of every
    bucket, ``reduced`` by one reduce-scatter of every bucket (both from the layout)."""
    if grad_accum < 1:
        raise ValueError(f"grad_accum must be >= 1, got {grad_accum}")
    rs = reduced * (grad_accum if stage == 2 else 1)
    network = (rs + gathered) // gpus_per_node if nodes > 1 else 0
    seconds = rates.seconds(rs + gathered, "collective")
    return StepComm(rs, gathered, network, seconds)
