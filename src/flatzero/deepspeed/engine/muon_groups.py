"""DeepSpeed 0.19.8's ``Muon`` config: which params Muon steps, and the param groups.

DeepSpeed tags every param of the model: Muon for a param of two or more dimensions whose
name contains neither ``embed`` nor ``lm_head``, Adam for the rest. Each incoming param
group (``model_parameters``' dicts; loose params form one more) splits into a Muon half
then an Adam half (an empty half is left out), named ``muon-params`` / ``adam-params``
(``group<i>-...`` or ``<name>-...`` with several groups). A half's settings: the config's
shared values, then ``muon_lr`` / ``adam_lr``, then what the group itself sets, among the
keys that half takes; ``DeepSpeedMuon``'s defaults for the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

__all__ = ["ADAM_KEYS", "MUON_KEYS", "muon_param_groups", "uses_muon"]

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
"""The settings a Muon half takes."""

ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
"""The settings an Adam half takes."""

_DEFAULTS = {
    True: {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"},
    False: {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0},
}
"""DeepSpeed's ``MuonWithAuxAdam`` defaults per half (``use_muon``)."""


def uses_muon(name: str, param: nn.Parameter) -> bool:
    """DeepSpeed's rule: Muon steps ``param`` (named ``name`` in the model)."""
    lower = name.lower()
    return param.dim() >= 2 and "embed" not in lower and "lm_head" not in lower


def _half_settings(config: Mapping[str, Any], use_muon: bool) -> dict[str, Any]:
    keys = MUON_KEYS if use_muon else ADAM_KEYS
    settings = dict(_DEFAULTS[use_muon])
    settings.update({k: config[k] for k in keys if k in config})
    override = "muon_lr" if use_muon else "adam_lr"
    if override in config:
        settings["lr"] = config[override]
    return settings


def _incoming_groups(params: Any) -> list[dict[str, Any]]:
    """``params`` as DeepSpeed reads ``model_parameters``: its dicts, then its loose
    params as one group (also when there is nothing else)."""
    groups: list[dict[str, Any]] = []
    loose: list[Any] = []
    for item in params:
        (groups if isinstance(item, dict) else loose).append(item)
    if loose or not groups:
        groups.append({"params": loose})
    return groups


def _group_params(group: Mapping[str, Any]) -> list[nn.Parameter]:
    items = group["params"]
    items = [items] if isinstance(items, nn.Parameter) else list(items)
    return [p[1] if isinstance(p, tuple) else p for p in items]


def muon_param_groups(
    model: nn.Module, model_parameters: Iterable[Any] | None, config: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """DeepSpeed's Muon and Adam halves of ``model_parameters`` (default: the model's).

    Args:
        model: the model (its param names decide which half a param is in).
        model_parameters: params or param groups, as ``deepspeed.initialize`` takes them.
        config: the config's ``optimizer.params`` (``config.optimizer._muon_params``).

    Returns:
        The param groups (each with ``use_muon``, ``DeepSpeedMuon.whole_group_option``, and
        ``name``) and ``DeepSpeedMuon``'s keyword arguments.

    Raises:
        ValueError: a param that is not the model's and has no ``use_muon`` of its own.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    params = model.parameters() if model_parameters is None else model_parameters
    incoming = _incoming_groups(params)
    halves = [(True, "muon"), (False, "adam")]
    out = []
    for index, group in enumerate(incoming):
        overrides = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in _group_params(group) if p.requires_grad]
        for use_muon, label in halves:
            half = [p for p in trainable if _tag(p, names) is use_muon]
            if not half:
                continue
            settings = _half_settings(config, use_muon)
            keys = MUON_KEYS if use_muon else ADAM_KEYS
            settings.update({k: v for k, v in overrides.items() if k in keys})
            prefix = overrides.get("name") or (f"group{index}" if len(incoming) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append({"params": half, "use_muon": use_muon, "name": name, **settings})
    return out, {"adam_w_mode": bool(config.get("adam_w_mode", True))}


def _tag(param: nn.Parameter, names: Mapping[int, str]) -> bool:
    name = names.get(id(param))
    if name is not None:
        return uses_muon(name, param)
    own = getattr(param, "use_muon", None)
    if own is None:
        raise ValueError(
            "the Muon optimizer decides per param, by its name in the model, whether Muon "
            "or Adam steps it; model_parameters holds a param of shape "
            f"{tuple(param.shape)} that is not the model's: pass it as part of the model, "
            "or set param.use_muon = True / False on it"
        )
    return bool(own)
