"""The ``flatzero`` section of a DeepSpeed config, derived from the dataclasses it sets.

The section holds what DeepSpeed's config has no words for. Its keys are the fields of
``FlattenConfig``, ``ZeroConfig`` and ``FlatzeroSection`` (the engine's own), under their
own names (``ZeroConfig.staging_buffers`` is ``reduce_staging_buffers``, beside
``FlattenConfig.staging_buffers``), except the fields another DeepSpeed key sets
(``SET_ELSEWHERE``). A key's default is its field's default, its doc the field's line in
the class docstring, and how it is read follows the field's type (``bool``, ``int``,
``str``, optional or not) and its metadata (``choices``, ``unit``). A field added to one of
those dataclasses is a key of the section without a change here, or an error at import
when its type cannot be read from JSON.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ....config import FlattenConfig
from ....flatten.registry import TIER_ALIASES, TIERS
from ....optim import ZeroConfig
from .reader import MISSING, Section
from .schema import FlatzeroSection

__all__ = ["FLATZERO_KEYS", "SET_ELSEWHERE", "FlatzeroKey", "read_flatzero"]

OWNERS = (FlattenConfig, ZeroConfig, FlatzeroSection)
"""The dataclasses whose fields are the section's keys, in the order they are read."""

SET_ELSEWHERE: Mapping[tuple[type, str], str] = {
    (FlattenConfig, "alignment"): "fixed: 64 elements",
    (FlattenConfig, "build_master"): "the engine always builds the fp32 master shards",
    (FlattenConfig, "dtype"): "bf16.enabled / fp16.enabled",
    (FlattenConfig, "master_on_host"): "zero_optimization.offload_optimizer",
    (FlattenConfig, "tier_reason"): "initialize, when it sets the tier",
    (FlattenConfig, "whole_params"): "the optimizer: whole params where it steps them whole",
    (ZeroConfig, "stage"): "zero_optimization.stage",
    (ZeroConfig, "max_grad_norm"): "gradient_clipping",
    (ZeroConfig, "reduce_dtype"): "communication_data_type",
    (ZeroConfig, "grad_accum_dtype"): "data_types.grad_accum_dtype",
    (ZeroConfig, "loss_scale"): "fp16 / bf16",
    (ZeroConfig, "offload_optimizer"): "zero_optimization.offload_optimizer",
    (ZeroConfig, "overlap_param_gather"): "zero_optimization.overlap_comm",
}
"""Fields that are not keys of the section, and the DeepSpeed key that sets each."""

_RENAMED: Mapping[tuple[type, str], str] = {
    (ZeroConfig, "staging_buffers"): "reduce_staging_buffers"
}
"""Fields whose key is not their name (two dataclasses have a ``staging_buffers``)."""

_METADATA: Mapping[tuple[type, str], Mapping[str, Any]] = {
    (FlattenConfig, "tier"): {"choices": (*TIERS, *TIER_ALIASES)},
    (FlattenConfig, "bucket_numel"): {"unit": " (elements)"},
}
"""Metadata of fields declared without it (a field's own metadata wins)."""

_ENTRY = re.compile(r"^    (\w+): (.*)$")
_MORE = re.compile(r"^        (.*)$")


def _field_docs(cls: type) -> dict[str, str]:
    """``field -> description`` from the ``Attributes:`` block of ``cls``'s docstring."""
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    docs: dict[str, str] = {}
    if "Attributes:" not in lines:
        return docs
    name = None
    for line in lines[lines.index("Attributes:") + 1 :]:
        entry, more = _ENTRY.match(line), _MORE.match(line)
        if entry:
            name = entry.group(1)
            docs[name] = entry.group(2)
        elif more and name is not None:
            docs[name] += " " + more.group(1)
        else:
            break
    return docs


@dataclass(frozen=True)
class FlatzeroKey:
    """One key of the ``flatzero`` section.

    Attributes:
        key: its name in the section.
        owner: the dataclass it sets.
        field: the field of ``owner`` it sets.
        kind: how it is read: ``"bool"``, ``"int"``, ``"str"`` or ``"choice"``.
        default: the field's default.
        doc: the field's description in ``owner``'s docstring.
        choices: the values a ``"choice"`` takes.
        unit: what the number counts, in errors (``" (elements)"``).
    """

    key: str
    owner: type
    field: str
    kind: str
    default: Any
    doc: str
    choices: tuple[str, ...] = ()
    unit: str = ""

    def read(self, section: Section) -> Any:
        """The value given in ``section`` (which has the key)."""
        if self.kind == "bool":
            return section.bool(self.key, MISSING)
        if self.kind == "int":
            return section.int(self.key, MISSING, unit=self.unit)
        if self.kind == "choice":
            return section.choice(self.key, MISSING, self.choices)
        return section.string(self.key, MISSING)


def _key(owner: type, f: dataclasses.Field, doc: str) -> FlatzeroKey:
    meta = {**_METADATA.get((owner, f.name), {}), **f.metadata}
    base, _, rest = str(f.type).partition(" | ")  # "int | None": null is a value too
    kind = "choice" if base == "str" and "choices" in meta else base
    if kind not in ("bool", "int", "str", "choice") or rest not in ("", "None"):
        raise TypeError(
            f"{owner.__name__}.{f.name} has type {f.type}, which the DeepSpeed config's "
            f"'flatzero' section cannot read; add it to SET_ELSEWHERE or teach FlatzeroKey"
        )
    return FlatzeroKey(
        key=_RENAMED.get((owner, f.name), f.name),
        owner=owner,
        field=f.name,
        kind=kind,
        default=f.default,
        doc=doc,
        choices=tuple(meta.get("choices", ())),
        unit=meta.get("unit", ""),
    )


def _derive() -> tuple[FlatzeroKey, ...]:
    keys = []
    for owner in OWNERS:
        docs = _field_docs(owner)
        for f in dataclasses.fields(owner):
            if (owner, f.name) not in SET_ELSEWHERE:
                keys.append(_key(owner, f, docs.get(f.name, "")))
    return tuple(keys)


FLATZERO_KEYS: tuple[FlatzeroKey, ...] = _derive()
"""Every key of the ``flatzero`` section."""


def read_flatzero(top: Section) -> dict[type, dict[str, Any]]:
    """The keys given in ``top``'s ``flatzero`` section, as keyword arguments of the
    dataclass each sets: ``{FlattenConfig: {"tier": "sharded"}, ZeroConfig: {...},
    FlatzeroSection: {...}}``. A key left out takes its field's default.

    Raises:
        ValueError / TypeError: a bad value or an unknown key (naming the known ones).
    """
    section = top.section("flatzero")
    given: dict[type, dict[str, Any]] = {owner: {} for owner in OWNERS}
    for key in FLATZERO_KEYS:
        if key.key in section:
            given[key.owner][key.field] = key.read(section)
    section.finish(unknown="error")
    return given
