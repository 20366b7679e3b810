"""Saving and loading a model's parameters as one safetensors file, keyed by name."""

from __future__ import annotations

import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ._params import ParameterSlots

__all__ = ["load_model_safetensors", "save_model_safetensors"]


def _unique_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Parameters by their first name; a tied parameter appears once."""
    return dict(model.named_parameters())


def save_model_safetensors(model: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write every unique parameter of ``model`` to ``path`` (a ``.safetensors`` file).

    A tied parameter is saved once, under its first name (``model.embed_tokens.weight``
    for a tied ``lm_head``), as HF transformers does. Dtypes are kept; tensors are copied
    to host memory. Buffers are not saved (the zoo's models have none).
    """
    tensors = {}
    for name, param in _unique_parameters(model).items():
        if param.is_meta:
            raise ValueError(
                f"{name} is on the meta device and has no values; materialize the model first"
            )
        tensors[name] = param.detach().cpu().contiguous()
    save_file(tensors, os.fspath(path), metadata={"format": "pt"})


def load_model_safetensors(
    model: nn.Module, path: str | os.PathLike[str], *, device: torch.device | str = "cpu"
) -> nn.Module:
    """Load parameters written by :func:`save_model_safetensors` (or HF) into ``model``.

    The file must hold exactly the unique parameter names of ``model`` with the same
    shapes. Values are cast to each parameter's dtype. A materialized parameter is
    updated in place (same ``Parameter`` object, same device); a meta parameter is
    replaced by a new ``Parameter`` on ``device`` (tied parameters stay tied).

    Returns:
        ``model``.
    """
    params = _unique_parameters(model)
    slots = ParameterSlots(model)
    with safe_open(os.fspath(path), framework="pt") as f, torch.no_grad():
        keys = set(f.keys())
        missing = sorted(params.keys() - keys)
        unexpected = sorted(keys - params.keys())
        if missing or unexpected:
            raise ValueError(
                f"{os.fspath(path)} does not match the model: missing {missing[:5]} "
                f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in "
                "all); save it from a model built with the same config and layout"
            )
        for name, param in params.items():
            tensor = f.get_tensor(name)
            if tensor.shape != param.shape:
                raise ValueError(
                    f"{name} has shape {tuple(tensor.shape)} in {os.fspath(path)} but "
                    f"{tuple(param.shape)} in the model; build the model with the same config"
                )
            if param.is_meta:
                slots.replace(param, tensor.to(device=device, dtype=param.dtype))
            else:
                param.copy_(tensor)
    return model
