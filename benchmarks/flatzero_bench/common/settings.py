"""A benchmark's settings: the dtypes it runs, what every run of trials sets, and how they
are read from its command line (lists, method names, spec objects)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, TypeVar

import torch

from flatzero.dtypes import SHORT_DTYPES
from flatzero_bench.common.options import BENCH_DTYPE_NAMES

__all__ = [
    "BENCH_DTYPES",
    "TrialsSpec",
    "parse_list",
    "parse_methods",
    "spec_from_args",
]

BENCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {name: SHORT_DTYPES[name] for name in BENCH_DTYPE_NAMES}
)
"""The params' dtypes the benchmarks run (``options.BENCH_DTYPE_NAMES``: ``"bf16"``,
``"fp32"``), a view of ``flatzero.dtypes.SHORT_DTYPES``."""


@dataclass(frozen=True)
class TrialsSpec:
    """What every run of alternating trials of methods sets (identical on every rank).

    Attributes:
        model: a key of the benchmark's ``MODELS``.
        dtype: a key of ``BENCH_DTYPES``: the params' dtype.
        trials: timed trials per method.
        warmup: untimed rounds of every method first.
        methods: the methods, in first-round order (rotated every round).
        bucket_numel: flatten bucket size in elements.
    """

    model: str
    dtype: str
    trials: int
    warmup: int
    methods: tuple[str, ...]
    bucket_numel: int


_Spec = TypeVar("_Spec")
_Item = TypeVar("_Item")


def parse_list(text: str, kind: Callable[[str], _Item], what: str) -> list[_Item]:
    """``"1,2"`` -> ``[kind("1"), kind("2")]`` (blank items skipped).

    Raises:
        SystemExit: an item ``kind`` rejects, or no item; the message names ``what``.
    """
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{what} {text!r}: expected comma-separated numbers") from None
    if not values:
        raise SystemExit(f"{what} {text!r} is empty")
    return values


def parse_methods(text: str, known: Sequence[str]) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")``, every one of them in ``known``.

    Raises:
        SystemExit: a name not in ``known``.
    """
    methods = tuple(m for m in text.split(",") if m)
    unknown = set(methods) - set(known)
    if unknown:
        raise SystemExit(f"unknown method(s) {sorted(unknown)}; choose from {', '.join(known)}")
    return methods


def spec_from_args(cls: type[_Spec], args: argparse.Namespace, **values: Any) -> _Spec:
    """The dataclass ``cls`` with each field from ``values`` when given there, else from the
    option of the same name in ``args``, else its default."""
    given = {
        f.name: values[f.name] if f.name in values else getattr(args, f.name)
        for f in fields(cls)
        if f.name in values or hasattr(args, f.name)
    }
    return cls(**given)
