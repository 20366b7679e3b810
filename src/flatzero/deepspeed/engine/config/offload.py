"""``zero_optimization.offload_optimizer`` (and DeepSpeed's older ``cpu_offload``) ->
``OffloadConfig``: optimizer offload to host memory, as DeepSpeed's ZeRO-Offload at
stages 1 and 2.

``device: "cpu"`` is flatzero's own (``ZeroConfig.offload_optimizer``); ``device: "nvme"``
and the variants DeepSpeed has beyond it (partial offload ``ratio < 1``, SuperOffload) are
``UnsupportedFeatureError``s, which ``flatzero.patch_deepspeed()`` hands to DeepSpeed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

from ....optim import OffloadConfig
from .reader import Section, fmt

__all__ = ["OFFLOAD_DEVICES", "parse_offload_optimizer"]

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
"""``offload_optimizer.device`` values (DeepSpeed's ``OffloadDeviceEnum``)."""

_NO_EFFECT = {
    "nvme_path": "NVMe offload only",
    "buffer_count": "NVMe offload only",
    "pipeline_read": "NVMe offload only",
    "pipeline_write": "NVMe offload only",
    "fast_init": "NVMe offload only",
    "cpuadam_cores_perc": "the host step uses the rank's share of the cores",
}
"""``offload_optimizer`` keys accepted without effect at ``device: cpu``, and why."""


def _deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _nvme_fix() -> str:
    if _deepspeed_installed():
        return (
            "use device 'cpu' (flatzero's own optimizer offload), or run DeepSpeed itself: "
            "flatzero.patch_deepspeed() hands this config to deepspeed.initialize"
        )
    return (
        "use device 'cpu' (flatzero's own optimizer offload); NVMe offload needs DeepSpeed, "
        "which is not installed here: pip install deepspeed and call deepspeed.initialize (or "
        "flatzero.patch_deepspeed(), which routes this config to it)"
    )


def _read_section(offload: Section, stage: int) -> OffloadConfig | None:
    device = offload.choice("device", "none", OFFLOAD_DEVICES)
    if device == "none":
        offload.ignored.append((offload.path, "device 'none': no optimizer offload"))
        for name in offload.data:
            offload.used.add(name)
        return None
    if device == "nvme":
        raise offload.unsupported(
            "device",
            device,
            "flatzero offloads the optimizer to host memory ('cpu'), not to NVMe",
            _nvme_fix(),
            "NVMe optimizer offload",
        )
    if stage == 0:
        raise offload.unsupported(
            "device",
            device,
            "optimizer offload needs ZeRO stage 1 or 2 (zero_optimization.stage is 0)",
            "set zero_optimization.stage to 1 or 2, or turn optimizer offload off",
            "optimizer offload at ZeRO stage 0",
        )
    pin = offload.bool("pin_memory", False)
    ratio = offload.number("ratio", 1.0, minimum=0.0)
    if ratio != 1.0:
        raise offload.unsupported(
            "ratio",
            ratio,
            "flatzero offloads the whole optimizer (ratio 1.0), not part of it",
            "remove ratio (or set it to 1.0), or run DeepSpeed itself",
            "partial optimizer offload",
        )
    if offload.bool("super_offload", False):
        raise offload.unsupported(
            "super_offload",
            True,
            "flatzero offloads with ZeRO-Offload's scheme, not SuperOffload's",
            "remove super_offload (or set it to false), or run DeepSpeed itself",
            "SuperOffload",
        )
    for name, reason in _NO_EFFECT.items():
        offload.no_effect(name, reason)
    offload.finish(unknown="error")
    return OffloadConfig(pin_memory=pin)


def parse_offload_optimizer(zero: Section, stage: int) -> OffloadConfig | None:
    """The optimizer offload ``zero`` (the ``zero_optimization`` section) asks for: its
    ``offload_optimizer`` section, or the older ``cpu_offload: true`` with
    ``cpu_offload_use_pin_memory``; None for none (absent, null, ``device: "none"``,
    ``cpu_offload: false``).

    Raises:
        UnsupportedFeatureError: ``device: "nvme"`` (saying whether DeepSpeed, which has it,
            is installed), ``ratio`` below 1, ``super_offload``, or offload at stage 0.
        ValueError / TypeError: a bad value or an unknown key, or both forms at once.
    """
    legacy = zero.bool("cpu_offload", False) if zero.raw("cpu_offload", None) is not None else None
    legacy_pin = zero.raw("cpu_offload_use_pin_memory", None)
    if legacy_pin is not None:
        legacy_pin = zero.bool("cpu_offload_use_pin_memory", False)
    raw = zero.raw("offload_optimizer", None)
    if raw is not None and legacy:
        raise zero.fail(
            "cpu_offload",
            True,
            "it is DeepSpeed's older name of offload_optimizer, which is given too",
            "remove cpu_offload (and cpu_offload_use_pin_memory)",
        )
    if raw is not None:
        if not isinstance(raw, Mapping):
            raise TypeError(
                f"config key {zero.key('offload_optimizer')!r} must be a JSON object such as "
                f'{{"device": "cpu", "pin_memory": true}}, got {type(raw).__name__} {fmt(raw)}'
            )
        return _read_section(zero.section("offload_optimizer"), stage)
    if not legacy:
        for name, value in (("cpu_offload", legacy), ("cpu_offload_use_pin_memory", legacy_pin)):
            if value is not None:
                zero.ignored.append((zero.key(name), "no optimizer offload; no effect"))
        return None
    return _read_section(
        Section({"device": "cpu", "pin_memory": bool(legacy_pin)}, zero.key("cpu_offload"), []),
        stage,
    )
