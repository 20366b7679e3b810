"""A Hugging Face ``config.json`` built by transformers on the meta device, for the plan.

[Note: counting from transformers] Where transformers is installed, the plan of a
``config.json`` counts the params of the causal LM transformers itself builds from it
(``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``: shapes only, no memory,
no weights read), so any family it can build plans (qwen2, mistral, mixtral, gpt2, gpt_neox,
DeepSeek's MoE, ...) with its real names, shapes and tied weights. Without transformers,
``model_source.config_from_hf`` maps the families the zoo builds (llama, mistral, qwen3_moe)
field by field.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

import torch

from ..models.config import MAX_EXPERT_MODULES, MAX_LAYERS, MAX_WIDTH

__all__ = [
    "build_hf_model",
    "check_sizes",
    "hf_layers",
    "hf_ties",
    "transformers_available",
]

LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
"""Where ``config.json`` files keep the layer count (GPT-2: ``n_layer``)."""


SIZE_KEYS = (
    "vocab_size",
    "hidden_size",
    "n_embd",
    "intermediate_size",
    "n_inner",
    "moe_intermediate_size",
    "num_attention_heads",
    "n_head",
    "num_key_value_heads",
    "head_dim",
)
"""Widths a ``config.json`` may give under these names: each at most ``MAX_WIDTH``."""

EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
"""Where MoE configs keep their experts per layer."""


def check_sizes(data: Mapping[str, Any]) -> None:
    """Refuse, before transformers builds anything, sizes no real model has: a width above
    ``MAX_WIDTH``, more than ``MAX_LAYERS`` layers, more than ``MAX_EXPERT_MODULES`` experts
    over all layers, or a size that is not a positive whole number (named).

    Raises:
        ValueError: naming the field, its value and the bound.
    """
    for key, high in (
        *((k, MAX_WIDTH) for k in (*SIZE_KEYS, *EXPERT_KEYS)),
        *((k, MAX_LAYERS) for k in LAYER_KEYS),
    ):
        value = data.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"the config's {key!r} is {value!r}; it must be a positive whole number"
            )
        if value > high:
            raise ValueError(
                f"{key}={value} is more than {high:,}, far beyond any real model; use the value "
                "of the model's config.json"
            )
    layers = hf_layers(data) or 1
    experts = max((data.get(k) or 0 for k in EXPERT_KEYS), default=0)
    if layers * experts > MAX_EXPERT_MODULES:
        raise ValueError(
            f"{layers} layers of {experts} experts are {layers * experts:,} experts, more than "
            f"{MAX_EXPERT_MODULES:,}, far beyond any real model; use the values of the model's "
            "config.json"
        )


def transformers_available() -> bool:
    """Whether transformers can be imported (looked up, not imported)."""
    return importlib.util.find_spec("transformers") is not None


def _hf_config(data: Mapping[str, Any], layers: int | None) -> Any:
    """transformers' config object of ``data`` (its ``model_type`` class), ``layers`` set."""
    from transformers import AutoConfig

    model_type = data.get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(
            f"the config's 'model_type' is {model_type!r}; a config.json names its model type "
            '(e.g. "llama", "qwen2", "gpt2")'
        )
    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **fields)
    except ValueError as error:
        first = str(error).strip().splitlines()[0]
        raise ValueError(f"transformers cannot build model_type {model_type!r}: {first}") from None
    if layers is not None:
        config.num_hidden_layers = layers  # attribute_map: n_layer for GPT-2, ...
    return config


def hf_layers(data: Mapping[str, Any], layers: int | None = None) -> int | None:
    """The layer count of ``data`` (``layers`` when given), or None when it names none."""
    if layers is not None:
        return layers
    return next((int(data[k]) for k in LAYER_KEYS if isinstance(data.get(k), int)), None)


def hf_ties(data: Mapping[str, Any]) -> bool:
    """Whether transformers ties ``lm_head`` to the input embedding for ``data`` (its
    family's default when the file does not say: GPT-2 ties, Llama does not)."""
    return bool(getattr(_hf_config(data, None), "tie_word_embeddings", False))


def build_hf_model(
    data: Mapping[str, Any],
    *,
    dtype: torch.dtype,
    with_lm_head: bool = True,
    layers: int | None = None,
) -> torch.nn.Module:
    """The model of ``data`` (a ``config.json`` as a dict) built by transformers on the meta
    device in ``dtype``: ``AutoModelForCausalLM`` (``AutoModel`` without ``with_lm_head``).

    Raises:
        ValueError: no or an unknown ``model_type``, or a config transformers refuses (its
            message).
    """
    from transformers import AutoModel, AutoModelForCausalLM

    config = _hf_config(data, layers)
    auto = AutoModelForCausalLM if with_lm_head else AutoModel
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
    except (ValueError, TypeError, AttributeError, KeyError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise ValueError(
            f"transformers cannot build {type(config).__name__} from this config.json: "
            f"{type(error).__name__}: {first}"
        ) from None
    return model.to(dtype)
