"""Chunked checksums fused into the read (issue 24 item 2): any range of a tensor reads back
exactly and verified, and a corrupt byte anywhere in what is read is refused."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatzero.storage.checksum import ALGORITHMS, Checksummer, ChunkSums
from flatzero.storage.header import TensorEntry
from flatzero.storage.tensorfile import TensorFile, _bytes_of
from flatzero.storage.writer import SafetensorsWriter

CHUNK = 24  # bytes: 6 fp32 elements, 3 fp64 ones; small enough for partial chunks everywhere


def sums_of(tensor: torch.Tensor, algorithm: str, chunk: int = CHUNK) -> ChunkSums:
    summer = Checksummer(algorithm, chunk)
    summer.update(_bytes_of(tensor.reshape(-1).contiguous()))
    return summer.result()


@pytest.fixture(scope="module")
def file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tf") / "t.safetensors"
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(101, generator=g),
        "b": torch.randn(17, generator=g, dtype=torch.float64),
        "e": torch.empty(0),
    }
    entries = [TensorEntry(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    with SafetensorsWriter(path, entries, {"k": "v"}) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    return path, tensors, writer.checksum


@given(pieces=st.lists(st.integers(0, 50), max_size=12))
def test_checksums_do_not_depend_on_how_the_bytes_are_fed(pieces):
    data = bytes(range(256)) * 2
    whole = Checksummer("crc32", CHUNK)
    whole.update(memoryview(data))
    fed = Checksummer("crc32", CHUNK)
    at = 0
    for n in [*pieces, len(data)]:
        fed.update(memoryview(data)[at : at + n])
        at = min(len(data), at + n)
    assert fed.result() == whole.result()
    assert len(whole.result().sums) == -(-len(data) // CHUNK)


def test_the_writer_records_the_default_chunked_sums(file):
    _, tensors, recorded = file
    for name, tensor in tensors.items():
        expected = sums_of(tensor, recorded[name].algorithm, recorded[name].chunk_bytes)
        assert recorded[name] == expected
    assert recorded["e"].sums == ()


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["a", "b"]),
    algorithm=st.sampled_from(sorted(ALGORITHMS)),
    data=st.data(),
)
def test_any_range_reads_back_exactly_and_verified(file, name, algorithm, data):
    path, tensors, _ = file
    tensor = tensors[name]
    start = data.draw(st.integers(0, tensor.numel()))
    numel = data.draw(st.integers(0, tensor.numel() - start))
    out = torch.full((numel,), -1.0, dtype=tensor.dtype)
    with TensorFile(path) as f:
        f.read_into(name, start, out, sums_of(tensor, algorithm))
    assert torch.equal(out, tensor[start : start + numel])


@pytest.mark.parametrize("at", [0, 23, 24, 200, 403])  # first byte, chunk edges, last byte
def test_a_flipped_byte_is_refused_by_every_read_that_touches_its_chunk(file, tmp_path, at):
    path, tensors, _ = file
    damaged = tmp_path / "d.safetensors"
    data = bytearray(path.read_bytes())
    with TensorFile(path) as f:
        begin = f.info("a").offset
    data[begin + at] ^= 0x40
    damaged.write_bytes(bytes(data))
    sums = sums_of(tensors["a"], "crc32")
    element = at // 4
    with TensorFile(damaged) as f:
        with pytest.raises(ValueError, match=r"tensor 'a' fails its checksum in bytes \d+-\d+"):
            f.read_into("a", element, torch.empty(1), sums)  # the element itself
        chunk_start = at // CHUNK * CHUNK // 4
        if element > chunk_start:  # a neighbour in the same chunk: the whole chunk is checked
            with pytest.raises(ValueError, match="fails its checksum"):
                f.read_into("a", chunk_start, torch.empty(1), sums)
        with pytest.raises(ValueError, match="fails its checksum"):
            f.verify("a", sums)
        out = torch.empty(101)
        f.read_into("a", 0, out, None)  # unverified: the damage comes through
        assert not torch.equal(out, tensors["a"])


def test_damaged_headers_and_ranges_are_named(file, tmp_path):
    path, _, _ = file
    with TensorFile(path) as f:
        with pytest.raises(ValueError, match="lie outside tensor 'a'"):
            f.read_into("a", 100, torch.empty(2), None)
        with pytest.raises(ValueError, match="has no tensor 'z'"):
            f.info("z")
        with pytest.raises(ValueError, match="3 checksums recorded"):
            f.read_into("a", 0, torch.empty(1), ChunkSums("crc32", CHUNK, (1, 2, 3)))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        TensorFile(bad)
    with pytest.raises(ValueError, match="is missing"):
        TensorFile(tmp_path / "nope.safetensors")


def test_records_of_older_checkpoints_are_one_crc32_chunk():
    legacy = ChunkSums.of_record({"dtype": "float32", "shape": [3], "crc32": 7}, 12)
    assert legacy == ChunkSums("crc32", 12, (7,))
    assert ChunkSums.of_record({"dtype": "float32", "shape": [3], "crc32": None}, 12) is None
