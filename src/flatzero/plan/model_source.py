"""What a plan is for: a model's parameter shapes, built on the meta device.

A model is named by a zoo preset (``llama-3-8b``, ``llama-3-70b``, ``qwen3-30b-a3b``), a
benchmark model (``qwen3-moe-narrow-unfused``, ``qwen3-30b-a3b-16l-unfused``, ...), a Hugging
Face ``config.json`` or a model directory holding one (no weights are read). A preset or
benchmark model is built by the zoo on the meta device; a ``config.json`` by transformers
where it is installed (``hf_model``: any causal LM it can build), else by the zoo for the
families it maps (llama, mistral, qwen3_moe). Either way the params are grouped as flatzero
groups them (``collect_param_groups``: trainable, tied ones once), so every byte count of
the plan comes from the real layout, not from a parameter-count formula.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..deepspeed.engine.config.reader import load_config_dict
from ..layout import ParamSpec
from ..models import LlamaConfig, ModelConfig, Qwen3MoeConfig, build_model
from ..models.zoo import PRESETS
from ..params import collect_param_groups
from .hf_model import build_hf_model, check_sizes, hf_layers, hf_ties, transformers_available
from .names import GROUPINGS

__all__ = [
    "GROUPINGS",
    "ModelSource",
    "config_from_hf",
    "group_dicts",
    "meta_model",
    "param_groups",
    "resolve_model",
]


_ZOO_LEAVES_OUT = ("attention_bias", "mlp_bias", "mlp_only_layers", "decoder_sparse_step")
"""Fields of a config.json the zoo does not build and transformers does: left out of the
zoo's checks of a config that transformers builds."""

_LLAMA_TYPES = ("llama", "mistral")
"""HF ``model_type`` values whose params have exactly the zoo Llama's names and shapes."""


@dataclass(frozen=True)
class ModelSource:
    """A model to plan for.

    Attributes:
        name: how the user named it (preset, benchmark model or path).
        config: the zoo config the meta-device model is built from; None when transformers
            builds it from ``hf_config``.
        with_lm_head: the model has ``lm_head`` (``AutoModelForCausalLM``); without it, the
            base model (``AutoModel``).
        tie_embeddings: ``lm_head.weight`` is ``embed_tokens.weight`` (counted once).
        hf_config: a ``config.json`` (as a dict) that transformers builds on the meta device,
            instead of ``config``.
        layers: with ``hf_config``, its layer count replaced by this (None: its own).
    """

    name: str
    config: ModelConfig | None
    with_lm_head: bool = True
    tie_embeddings: bool = False
    hf_config: dict[str, Any] | None = None
    layers: int | None = None

    def __post_init__(self) -> None:
        if (self.config is None) == (self.hf_config is None):
            raise ValueError("ModelSource needs exactly one of config and hf_config")
        if self.config is not None and not isinstance(self.config, (LlamaConfig, Qwen3MoeConfig)):
            raise TypeError(
                f"ModelSource.config must be a LlamaConfig or Qwen3MoeConfig, got "
                f"{type(self.config).__name__}"
            )
        if self.tie_embeddings and not self.with_lm_head:
            raise ValueError("ModelSource.tie_embeddings needs with_lm_head=True")

    @property
    def kind(self) -> str:
        """The family as the report names it (``Llama``, ``Qwen3Moe, 128 experts fused``,
        ``gpt2 (transformers)``)."""
        if self.config is None:
            return f"{self.hf_config['model_type']} (transformers)"
        kind = type(self.config).__name__.removesuffix("Config")
        if isinstance(self.config, Qwen3MoeConfig):
            kind += f", {self.config.num_experts} experts {self.config.expert_layout}"
        return kind

    @property
    def num_hidden_layers(self) -> int | None:
        """Decoder layers (None when a ``config.json`` names no layer count)."""
        if self.config is None:
            return hf_layers(self.hf_config, self.layers)
        return self.config.num_hidden_layers

    def describe(self) -> dict[str, Any]:
        """The model as JSON-serializable data: the zoo config's fields, or the
        ``config.json`` transformers built."""
        if self.config is None:
            fields: dict[str, Any] = {"hf_config": self.hf_config, "layers": self.layers}
        else:
            fields = dataclasses.asdict(self.config)
        return {
            **fields,
            "name": self.name,
            "with_lm_head": self.with_lm_head,
            "tie_embeddings": self.tie_embeddings,
        }


def _get(data: dict[str, Any], key: str, default: Any = None) -> Any:
    value = data.get(key, default)
    if value is None:
        raise ValueError(f"the config has no {key!r}; a config.json of this model type needs it")
    return value


def _int(data: dict[str, Any], key: str, default: Any = None) -> int:
    """``data[key]`` as a whole number, or a ``ValueError`` naming the key."""
    value = _get(data, key, default)
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole:
        raise ValueError(f"the config's {key!r} is {value!r}; it must be a whole number")
    return int(value)


def _float(data: dict[str, Any], key: str, default: float) -> float:
    """``data[key]`` (``default`` when absent or null) as a number, or a ``ValueError``
    naming the key."""
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"the config's {key!r} is {value!r}; it must be a number")
    return float(value)


def _bool(data: dict[str, Any], key: str, default: bool) -> bool:
    """``data[key]`` (``default`` when absent) as a JSON true/false, or a ``ValueError``."""
    value = data.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"the config's {key!r} is {value!r}; it must be true or false")
    return value


def _or_default(data: dict[str, Any], key: str, default: int) -> dict[str, Any]:
    """``{key: data[key]}``, or ``default`` when it is absent or null."""
    value = data.get(key)
    return {key: default if value is None else value}


def _common_fields(data: dict[str, Any]) -> dict[str, Any]:
    heads = _int(data, "num_attention_heads")
    hidden = _int(data, "hidden_size")
    # Absent or null: derived (as transformers does); 0 or a negative number is refused.
    head_dim = hidden // heads if heads > 0 else 0
    return {
        "vocab_size": _int(data, "vocab_size"),
        "hidden_size": hidden,
        "num_hidden_layers": _int(data, "num_hidden_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(
            _or_default(data, "num_key_value_heads", heads), "num_key_value_heads"
        ),
        "head_dim": _int(_or_default(data, "head_dim", head_dim), "head_dim"),
        "rms_norm_eps": _float(data, "rms_norm_eps", 1e-6),
        "rope_theta": _float(data, "rope_theta", 10000.0),
    }


def config_from_hf(
    data: dict[str, Any], *, expert_layout: str = "fused"
) -> tuple[ModelConfig, bool]:
    """The zoo config of a Hugging Face ``config.json`` (as a dict), and its
    ``tie_word_embeddings``.

    Supported ``model_type``: ``llama`` and ``mistral`` (a dense Llama), ``qwen3_moe`` (every
    layer sparse, no shared expert). ``expert_layout`` is the layout of MoE expert weights:
    ``fused`` as transformers 5.x stores them, ``unfused`` as 4.x does.

    Raises:
        ValueError: an unsupported model type or field (named), or a missing field.
    """
    model_type = data.get("model_type")
    if model_type not in (*_LLAMA_TYPES, "qwen3_moe"):
        raise ValueError(
            f"model_type {model_type!r} is not supported by the planner without transformers; "
            f"supported: {', '.join((*_LLAMA_TYPES, 'qwen3_moe'))}; with transformers "
            "installed (pip install -e '.[hf]'), any causal LM it can build plans"
        )
    tie = _bool(data, "tie_word_embeddings", False)
    fields = _common_fields(data)
    if model_type in _LLAMA_TYPES:
        for flag in ("attention_bias", "mlp_bias"):
            if data.get(flag):
                raise ValueError(f"{flag}=true is not modeled (the zoo's Llama has no biases)")
        return LlamaConfig(intermediate_size=_int(data, "intermediate_size"), **fields), tie
    if model_type == "qwen3_moe":
        if data.get("mlp_only_layers") or int(data.get("decoder_sparse_step", 1)) != 1:
            raise ValueError(
                "mlp_only_layers / decoder_sparse_step != 1 (dense layers among sparse ones) "
                "are not modeled; the zoo's Qwen3-MoE is sparse in every layer"
            )
        moe = Qwen3MoeConfig(
            moe_intermediate_size=_int(data, "moe_intermediate_size"),
            num_experts=_int(data, "num_experts"),
            num_experts_per_tok=_int(data, "num_experts_per_tok"),
            norm_topk_prob=_bool(data, "norm_topk_prob", True),
            expert_layout=expert_layout,
            **fields,
        )
        return moe, tie
    raise AssertionError(model_type)  # every supported type returned above


def _named_config(name: str) -> ModelConfig | None:
    """A zoo preset or benchmark model called ``name``, else None."""
    if name in PRESETS:
        return PRESETS[name]
    from ..models.bench_models import MODELS

    return MODELS[name]() if name in MODELS else None


def resolve_model(
    text: str,
    *,
    layers: int | None = None,
    expert_layout: str | None = None,
    with_lm_head: bool | None = None,
) -> ModelSource:
    """The model named by ``text``: a preset, a benchmark model, a ``config.json`` or a
    directory holding one.

    Args:
        text: the name or path.
        layers: replace ``num_hidden_layers`` (DeepSpeed #7677 cut Qwen3-30B-A3B to 16).
        expert_layout: ``fused`` or ``unfused`` MoE expert weights (default: the preset's,
            or ``fused`` for a config.json, as transformers 5.x builds it).
        with_lm_head: build ``lm_head`` (default: True, or a config's own choice).
    """
    config = _named_config(text)
    tie = False
    if config is None:
        path = Path(text)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"{text!r} is neither a model preset, a benchmark model, a config.json nor a "
                f"directory with one; presets: {', '.join(PRESETS)}"
            )
        data = load_config_dict(str(path))  # errors name the file
        head = True if with_lm_head is None else with_lm_head
        zoo_layout = expert_layout is not None and data.get("model_type") == "qwen3_moe"
        if transformers_available() and not zoo_layout:
            if data.get("model_type") in (*_LLAMA_TYPES, "qwen3_moe"):  # the zoo's checks
                config_from_hf({k: v for k, v in data.items() if k not in _ZOO_LEAVES_OUT})
            check_sizes({**data, "num_hidden_layers": layers or data.get("num_hidden_layers")})
            tie = head and hf_ties(data)
            return ModelSource(
                text, None, with_lm_head=head, tie_embeddings=tie, hf_config=data, layers=layers
            )
        config, tie = config_from_hf(data, expert_layout=expert_layout or "fused")
    changes: dict[str, Any] = {}
    if layers is not None:
        changes["num_hidden_layers"] = layers
    if expert_layout is not None and isinstance(config, Qwen3MoeConfig):
        changes["expert_layout"] = expert_layout
    config = dataclasses.replace(config, **changes)
    head = True if with_lm_head is None else with_lm_head
    return ModelSource(text, config, with_lm_head=head, tie_embeddings=tie and head)


def param_groups(source: ModelSource, dtype: str, grouping: str = "one") -> list[list[ParamSpec]]:
    """The model's trainable params as flatzero's layout sees them: built on the meta
    device in ``dtype``, grouped by ``grouping`` (see ``GROUPINGS``), tied params once."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping {grouping!r} must be one of {', '.join(GROUPINGS)}")
    model = meta_model(source, dtype)
    return [g.specs() for g in collect_param_groups(group_dicts(model, grouping))]


def meta_model(source: ModelSource, dtype: str) -> torch.nn.Module:
    """``source``'s model on the meta device, its params in ``dtype``."""
    if source.hf_config is not None:
        return build_hf_model(
            source.hf_config,
            dtype=getattr(torch, dtype),
            with_lm_head=source.with_lm_head,
            layers=source.layers,
        )
    return build_model(
        source.config,
        device="meta",
        dtype=getattr(torch, dtype),
        with_lm_head=source.with_lm_head,
        tie_embeddings=source.tie_embeddings,
    )


def group_dicts(model: torch.nn.Module, grouping: str = "one") -> list[dict[str, Any]]:
    """``model``'s named params as ``torch.optim`` param groups, grouped by ``grouping``
    (what the planner assumes a training script passes)."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping {grouping!r} must be one of {', '.join(GROUPINGS)}")
    named = list(model.named_parameters())
    if grouping == "one":
        return [{"params": named}]
    return [
        {"params": [(n, p) for n, p in named if p.dim() >= 2]},
        {"params": [(n, p) for n, p in named if p.dim() < 2]},
    ]
