"""A rank's random number generator states: capture into a rank file, restore from it.

Tensor states (torch's CPU generator, each CUDA device's) go into the rank file as uint8
tensors ``rng.torch`` and ``rng.cuda.<i>``; Python's ``random`` and NumPy's global state go
into its safetensors metadata as JSON.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]

logger = logging.getLogger(__name__)


def capture_rng() -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """``(tensors, metadata)`` describing this process's RNG states."""
    tensors = [("rng.torch", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors.append((f"rng.cuda.{i}", state))
    version, internal, gauss = random.getstate()
    metadata = {"rng.python": json.dumps([version, list(internal), gauss])}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        metadata["rng.numpy"] = json.dumps([name, keys.tolist(), pos, has_gauss, cached])
    return tensors, metadata


def restore_rng(handle: Any, metadata: dict[str, str]) -> None:
    """Restore the states captured by ``capture_rng`` from an open rank file."""
    keys = set(handle.keys())
    if "rng.torch" in keys:
        torch.set_rng_state(handle.get_tensor("rng.torch"))
    cuda = sorted(k for k in keys if k.startswith("rng.cuda."))
    if cuda and torch.cuda.is_available():
        states = [handle.get_tensor(k) for k in cuda]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            logger.warning(
                "checkpoint has RNG states of %d CUDA devices, this process sees %d; "
                "CUDA RNG states not restored",
                len(states),
                torch.cuda.device_count(),
            )
    if "rng.python" in metadata:
        version, internal, gauss = json.loads(metadata["rng.python"])
        random.setstate((version, tuple(internal), gauss))
    np = sys.modules.get("numpy")
    if np is not None and "rng.numpy" in metadata:
        name, keys_list, pos, has_gauss, cached = json.loads(metadata["rng.numpy"])
        np.random.set_state((name, np.asarray(keys_list, dtype=np.uint32), pos, has_gauss, cached))
