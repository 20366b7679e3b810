"""The one dtype table (``flatzero.dtypes``): its views agree with each other and with
safetensors, and a dtype any writer writes, every reader reads (F8 included)."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
from torch import nn

from flatzero import FlattenConfig, SafetensorsCheckpoint
from flatzero.checkpoint import ExportConfig, export_checkpoint, save_checkpoint
from flatzero.dtypes import (
    DTYPES,
    SAFETENSORS_DTYPES,
    SAFETENSORS_NAMES,
    SHORT_DTYPES,
    dtype_name,
    int_of_width,
)
from flatzero.optim import ZeroOptimizer
from flatzero.storage.header import TensorEntry
from flatzero.storage.writer import SafetensorsWriter

F8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def test_table_matches_safetensors_and_is_one_to_one():
    assert dict(SAFETENSORS_DTYPES) == safetensors.torch._TYPES  # the format's full list
    assert {v: k for k, v in SAFETENSORS_DTYPES.items()} == dict(SAFETENSORS_NAMES)
    assert len({d.dtype for d in DTYPES}) == len(DTYPES)
    assert dict(SHORT_DTYPES) == {
        "fp32": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
    }
    for info in DTYPES:
        assert info.name == dtype_name(info.dtype) and getattr(torch, info.name) is info.dtype
        assert info.itemsize == torch.empty(0, dtype=info.dtype).element_size()
    assert [int_of_width(n) for n in (1, 2, 4, 8)] == [
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
    ]


def _f8_values(dtype: torch.dtype) -> torch.Tensor:
    return torch.linspace(-4, 4, 24).to(dtype).reshape(4, 6)


@pytest.mark.parametrize("dtype", F8, ids=str)
def test_f8_written_by_storage_writer_reads_back_through_storage_index(tmp_path, dtype):
    value = _f8_values(dtype)
    path = tmp_path / "f8.safetensors"
    with SafetensorsWriter(path, [TensorEntry("w", dtype, tuple(value.shape))]) as writer:
        writer.write("w", value)
    ckpt = SafetensorsCheckpoint(path)
    read = ckpt.read("w")
    assert read.dtype == dtype and torch.equal(read.view(torch.uint8), value.view(torch.uint8))


class _F8Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("scale_e4m3", _f8_values(torch.float8_e4m3fn))
        self.register_buffer("scale_e5m2", _f8_values(torch.float8_e5m2))


def test_f8_buffer_survives_checkpoint_and_export(tmp_path):
    model = _F8Buffers()
    opt = ZeroOptimizer(
        model.named_parameters(),
        torch.optim.SGD,
        lr=0.1,
        flatten_config=FlattenConfig(progress=False),
    )
    save_checkpoint(tmp_path / "ckpt", opt, model=model)
    result = export_checkpoint(
        tmp_path / "ckpt", tmp_path / "out", config=ExportConfig(dtype="saved")
    )
    exported = SafetensorsCheckpoint(tmp_path / "out" / result.files[0])
    for name in ("scale_e4m3", "scale_e5m2"):
        read, expected = exported.read(name), getattr(model, name)
        assert read.dtype == expected.dtype
        assert torch.equal(read.view(torch.uint8), expected.view(torch.uint8)), name
    opt.close()
