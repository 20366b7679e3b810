"""Initialize a model built on the meta device straight from a safetensors checkpoint.

Trainable params go through ``flatten_parameters(checkpoint=...)``: in the ``sharded``
tier each rank reads only the bytes of its slices and the all-gather fills the rest,
so no rank ever holds the full model in host memory. Frozen params and buffers are
small; each rank reads them whole onto the target device.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .config import FlattenConfig
from .devices import resolve_device
from .flatten import FlatParams, flatten_parameters
from .params import rebind_param
from .process_group import join_launched_job
from .storage.index import SafetensorsCheckpoint

__all__ = ["allocate_rest", "load_flat", "materialize_rest"]


def materialize_rest(
    model: nn.Module,
    checkpoint: SafetensorsCheckpoint,
    key_map: Callable[[str], str],
    device: torch.device,
    init_buffers: Callable[[nn.Module], None] | None,
) -> None:
    """Load frozen params and buffers on the meta device; leave trainable params alone."""
    missing = []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, p in module.named_parameters(recurse=False):
            if p.requires_grad or p.device.type != "meta":
                continue
            key = key_map(prefix + name)
            if key not in checkpoint:
                raise ValueError(
                    f"frozen param {prefix + name!r} has no tensor {key!r} in checkpoint "
                    f"{checkpoint.path}; pass key_map= to map model names to checkpoint keys"
                )
            rebind_param(p, checkpoint.read(key).to(device=device, dtype=p.dtype).view(p.shape))
        for name, b in module.named_buffers(recurse=False):
            if b.device.type != "meta":
                continue
            key = key_map(prefix + name)
            if key in checkpoint:
                value = checkpoint.read(key).to(device=device, dtype=b.dtype).view(b.shape)
            else:
                value = torch.zeros(b.shape, dtype=b.dtype, device=device)
                missing.append(prefix + name)
            module._buffers[name] = value
    if missing and init_buffers is None:
        raise ValueError(
            f"buffers {', '.join(missing)} are on the meta device and not in checkpoint "
            f"{checkpoint.path}; pass init_buffers=fn, a function that computes them in place"
        )
    if init_buffers is not None:
        init_buffers(model)


def allocate_rest(model: nn.Module, device: torch.device) -> None:
    """Give frozen params and buffers still on the meta device uninitialized storage on
    ``device``, for a load to fill; trainable params are left alone."""
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if not p.requires_grad and p.device.type == "meta":
                rebind_param(p, torch.empty(p.shape, dtype=p.dtype, device=device))
        for name, b in module.named_buffers(recurse=False):
            if b.device.type == "meta":
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def load_flat(
    model: nn.Module,
    checkpoint: str | os.PathLike | SafetensorsCheckpoint,
    *,
    key_map: Callable[[str], str] | None = None,
    init_buffers: Callable[[nn.Module], None] | None = None,
    process_group: dist.ProcessGroup | None = None,
    config: FlattenConfig | None = None,
    params: Any = None,
    agreement_group: dist.ProcessGroup | None = None,
) -> FlatParams:
    """Build ``model``'s flat buffers straight from a safetensors checkpoint.

    Args:
        model: the model, typically built on the meta device (``with torch.device("meta")``).
        checkpoint: a ``.safetensors`` file, an HF-style directory (sharded with an index,
            or not), a ``flatzero export`` directory, or an opened ``SafetensorsCheckpoint``.
        key_map: maps a model name (param or buffer) to its checkpoint key.
        init_buffers: called with the model after loading, to compute buffers that are
            not in the checkpoint (non-persistent ones, e.g. rotary tables); required if
            any such buffer is on the meta device.
        process_group: ranks the buffers are sharded over (default group if initialized).
        config: tier, device, bucket size; tier ``auto`` picks ``sharded`` on GPUs.
        params: the trainable params and their groups, as ``flatten_parameters`` takes
            them (e.g. ``collect_param_groups``'s); default: the model's.
        agreement_group: the ranks that take every flatten decision together
            (``flatten_parameters``); default ``process_group``.

    Returns:
        ``FlatParams``, as ``flatten_parameters`` returns.
    """
    config = config or FlattenConfig()
    if process_group is None:
        join_launched_job()  # before the device is chosen by LOCAL_RANK
    ckpt = (
        checkpoint
        if isinstance(checkpoint, SafetensorsCheckpoint)
        else SafetensorsCheckpoint(checkpoint)
    )
    mapping = key_map or (lambda name: name)
    materialize_rest(
        model, ckpt, mapping, resolve_device(config.device, process_group), init_buffers
    )
    return flatten_parameters(
        model if params is None else params,
        process_group=process_group,
        config=config,
        checkpoint=ckpt,
        key_map=key_map,
        agreement_group=agreement_group,
    )
