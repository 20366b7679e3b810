"""A rank's random number generator states: capture into a rank file, restore from it.

Tensor states (torch's CPU generator, each accelerator device's) go into the rank file as
uint8 tensors ``rng.torch`` and ``rng.<device type>.<i>`` (``rng.cuda.0``); Python's
``random`` and NumPy's global state go into its safetensors metadata as JSON.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from collections.abc import Mapping

import torch

from .. import accel

__all__ = ["RNG_PREFIX", "capture_rng", "restore_rng"]

RNG_PREFIX = "rng."
"""Prefix of the RNG tensors' names in a rank file."""

logger = logging.getLogger(__name__)


def capture_rng() -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """``(tensors, metadata)`` describing this process's RNG states."""
    tensors = [("rng.torch", torch.get_rng_state())]
    device_states = accel.rng_states()
    if device_states is not None:
        device_type, states = device_states
        tensors.extend((f"rng.{device_type}.{i}", state) for i, state in enumerate(states))
    version, internal, gauss = random.getstate()
    metadata = {"rng.python": json.dumps([version, list(internal), gauss])}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        metadata["rng.numpy"] = json.dumps([name, keys.tolist(), pos, has_gauss, cached])
    return tensors, metadata


def restore_rng(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Restore the states captured by ``capture_rng``: its tensors (read from a rank file)
    and that file's metadata."""
    keys = set(tensors)
    if "rng.torch" in keys:
        torch.set_rng_state(tensors["rng.torch"])
    device_type = accel.accelerator_type()
    prefix = f"rng.{device_type}."
    names = sorted((k for k in keys if k.startswith(prefix)), key=lambda k: int(k[len(prefix) :]))
    if device_type is not None and names:
        states = [tensors[k] for k in names]
        if not accel.set_rng_states(device_type, states):
            logger.warning(
                "checkpoint has RNG states of %d %s devices, this process sees %d; "
                "%s RNG states not restored",
                len(states),
                device_type,
                accel.device_count(device_type),
                device_type,
            )
    if "rng.python" in metadata:
        version, internal, gauss = json.loads(metadata["rng.python"])
        random.setstate((version, tuple(internal), gauss))
    np = sys.modules.get("numpy")
    if np is not None and "rng.numpy" in metadata:
        name, keys_list, pos, has_gauss, cached = json.loads(metadata["rng.numpy"])
        np.random.set_state((name, np.asarray(keys_list, dtype=np.uint32), pos, has_gauss, cached))
