"""``storage.image``: a snapshot laid out as a safetensors file's data and written with
``O_DIRECT`` (or through the page cache where that is refused) reads back exactly, with the
checksums a streamed write records."""

from __future__ import annotations

import mmap
import os

import pytest
import torch
from safetensors import safe_open

from flatzero.storage import image
from flatzero.storage.checksum import Checksummer


def tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(3000, generator=g)),  # fp32, 12000 bytes: not a whole page
        ("b", torch.randn(17, 5, generator=g).to(torch.bfloat16)),  # starts at an odd offset
        ("empty", torch.empty(0)),
        ("scalar", torch.tensor(7, dtype=torch.int64)),
        ("bytes", torch.arange(4099, dtype=torch.int32).to(torch.uint8)),
    ]


@pytest.mark.parametrize("direct", [True, False])
def test_an_image_reads_back_as_written(tmp_path, monkeypatch, direct):
    if not direct:  # a system without O_DIRECT: the same bytes through the page cache
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    ts = tensors()
    nbytes = sum(t.numel() * t.element_size() for _, t in ts)
    buffer = torch.frombuffer(mmap.mmap(-1, image.padded(nbytes)), dtype=torch.uint8)
    img, copies = image.lay_out("f.safetensors", ts, {"tag": "x"}, buffer)
    assert len(copies) == sum(1 for _, t in ts if t.numel())  # nothing copied yet
    for dst, src in copies:
        dst.copy_(src)
    assert img.nbytes == nbytes and img.data.numel() == image.padded(nbytes)
    assert len(img.prefix) % image.PAGE == 0
    calls = []
    size = image.write_image(tmp_path, img, tensor_written=lambda: calls.append(1))
    sums = image.checksums(img)
    path = tmp_path / "f.safetensors"
    assert size == path.stat().st_size == len(img.prefix) + nbytes and len(calls) == len(ts)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"tag": "x"}
        for name, t in ts:
            assert torch.equal(f.get_tensor(name), t)
            summer = Checksummer()
            summer.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B"))
            assert sums[name] == summer.result()
