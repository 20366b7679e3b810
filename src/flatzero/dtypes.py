"""Every name a dtype has in flatzero, in one table.

A dtype is written four ways: as a ``torch.dtype``, by its torch name (``"bfloat16"``: the
layout, checkpoint metadata and ``FlattenConfig.dtype`` use it), by its safetensors name
(``"BF16"``, ``"F8_E4M3"``: the header of a safetensors file), and, for the three training
dtypes, by DeepSpeed's short name (``"bf16"``: configs, command lines, ``flatzero
export --dtype``). ``DTYPES`` holds one ``DtypeInfo`` per dtype; every other table in the
package is a view of it, so a dtype one reader knows is a dtype every writer knows.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

__all__ = [
    "DTYPES",
    "SAFETENSORS_DTYPES",
    "SAFETENSORS_NAMES",
    "SHORT_DTYPES",
    "DtypeInfo",
    "dtype_name",
    "int_of_width",
]


@functools.cache
def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class DtypeInfo:
    """One dtype under each of its names.

    Attributes:
        dtype: the ``torch.dtype``.
        safetensors: its name in a safetensors header (``"BF16"``).
        short: DeepSpeed's short name (``"bf16"``) for a training dtype, else None.
    """

    dtype: torch.dtype
    safetensors: str
    short: str | None = None

    @property
    def name(self) -> str:
        """The torch name (``"bfloat16"``)."""
        return dtype_name(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize


DTYPES: tuple[DtypeInfo, ...] = (
    # The training dtypes first, in DeepSpeed's order of communication_data_type choices.
    DtypeInfo(torch.float32, "F32", "fp32"),
    DtypeInfo(torch.float16, "F16", "fp16"),
    DtypeInfo(torch.bfloat16, "BF16", "bf16"),
    DtypeInfo(torch.float64, "F64"),
    DtypeInfo(torch.float8_e4m3fn, "F8_E4M3"),
    DtypeInfo(torch.float8_e5m2, "F8_E5M2"),
    DtypeInfo(torch.float8_e4m3fnuz, "F8_E4M3FNUZ"),
    DtypeInfo(torch.float8_e5m2fnuz, "F8_E5M2FNUZ"),
    DtypeInfo(torch.complex64, "C64"),
    DtypeInfo(torch.int64, "I64"),
    DtypeInfo(torch.int32, "I32"),
    DtypeInfo(torch.int16, "I16"),
    DtypeInfo(torch.int8, "I8"),
    DtypeInfo(torch.uint64, "U64"),
    DtypeInfo(torch.uint32, "U32"),
    DtypeInfo(torch.uint16, "U16"),
    DtypeInfo(torch.uint8, "U8"),
    DtypeInfo(torch.bool, "BOOL"),
)
"""Every dtype flatzero reads or writes (the safetensors format's, as ``safetensors.torch``
maps them)."""

SHORT_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {d.short: d.dtype for d in DTYPES if d.short is not None}
)
"""``"fp32"``/``"fp16"``/``"bf16"`` -> torch dtype, in that order."""

SAFETENSORS_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {d.safetensors: d.dtype for d in DTYPES}
)
"""Safetensors header name -> torch dtype."""

SAFETENSORS_NAMES: Mapping[torch.dtype, str] = MappingProxyType(
    {d.dtype: d.safetensors for d in DTYPES}
)
"""torch dtype -> safetensors header name."""

_INTS_BY_WIDTH: Mapping[int, torch.dtype] = MappingProxyType(
    {d.itemsize: d.dtype for d in DTYPES if d.name.startswith("int")}
)


def int_of_width(itemsize: int) -> torch.dtype:
    """The signed integer dtype of ``itemsize`` bytes (1, 2, 4 or 8): a view of a tensor's
    bits as integers."""
    return _INTS_BY_WIDTH[itemsize]
