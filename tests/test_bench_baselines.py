"""Tests of the benchmark baselines (DeepSpeed-faithful flattening), limits and runner."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from flatzero.deepspeed.layout import padded_numel as deepspeed_padded_numel
from flatzero.deepspeed.layout import partition_range as deepspeed_partition_range
from flatzero.launch import run_ranks
from flatzero.measure.baselines import BaselineResult, flatten_legacy_cpu, flatten_torch_cat
from flatzero.measure.limits import (
    device_copy_seconds,
    first_touch_seconds,
    memcpy_seconds,
    pinned_h2d_seconds,
)
from flatzero.testing.deepspeed import deepspeed_available, deepspeed_config

FLATTENERS = [flatten_torch_cat, flatten_legacy_cpu]


def _model(dtype: torch.dtype, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3, bias=False), nn.Linear(3, 11))
    m[1].weight.requires_grad_(False)  # frozen: DeepSpeed leaves it out of the flat buffer
    return m.to(dtype)


def _expected_flat(params: list[torch.Tensor], world_size: int) -> torch.Tensor:
    flat = torch.cat([p.reshape(-1) for p in params])
    padded = deepspeed_padded_numel(flat.numel(), world_size)
    return torch.cat([flat, flat.new_zeros(padded - flat.numel())])


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits, so that equality is bitwise (NaN and -0.0 included)."""
    return t.detach().reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("flatten", FLATTENERS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_flatten_preserves_values_and_rebinds(flatten, world_size, dtype) -> None:
    for rank in range(world_size):
        model = _model(dtype)
        trainable = [p for p in model.parameters() if p.requires_grad]
        originals = [p.detach().clone() for p in trainable]
        frozen = model[1].weight
        frozen_ptr = frozen.data_ptr()
        # Group 0: the first two trainable params; group 1: the rest and the frozen one.
        groups = [trainable[:2], [*trainable[2:], frozen]]
        result = flatten(groups, rank=rank, world_size=world_size, device="cpu")

        assert isinstance(result, BaselineResult)
        assert result.world_size == world_size and result.rank == rank
        assert len(result.flat_buffers) == 2 and len(result.master_partitions) == 2
        assert result.flatten_s >= 0 and result.master_s >= 0 and result.bytes_moved > 0
        assert frozen.data_ptr() == frozen_ptr and not frozen.requires_grad

        it = iter(originals)
        for g, (params, flat, master) in enumerate(
            zip(groups, result.flat_buffers, result.master_partitions, strict=True)
        ):
            params = [p for p in params if p.requires_grad]
            n = sum(p.numel() for p in params)
            assert result.group_numel[g] == n
            assert flat.numel() == result.padded_numel[g] == deepspeed_padded_numel(n, world_size)
            assert flat.numel() % (2 * world_size) == 0
            assert flat.dtype == dtype and flat.is_contiguous()
            assert torch.count_nonzero(flat[n:]) == 0  # padding is zero
            # Each param: bitwise its original, and a view at its offset in the flat buffer.
            offset = 0
            for p in params:
                orig = next(it)
                assert p.dtype == dtype and p.shape == orig.shape
                assert torch.equal(_bits(p), _bits(orig))
                assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
                assert p.data_ptr() == flat.data_ptr() + offset * flat.element_size()
                offset += p.numel()
            # The master is this rank's slice of the flattened originals, fp32, own storage.
            expected = _expected_flat(originals[:2] if g == 0 else originals[2:], world_size)
            start, size = deepspeed_partition_range(flat.numel(), rank, world_size)
            assert size * world_size == flat.numel()
            assert master.dtype == torch.float32 and master.numel() == size
            assert torch.equal(master, expected[start : start + size].float())
            assert master.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()


def test_paths_and_bytes() -> None:
    model = _model(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    nbytes = deepspeed_padded_numel(sum(p.numel() for p in params), 2) * 2
    cat = flatten_torch_cat([params], rank=1, world_size=2)
    assert cat.paths == ("device",) and cat.algorithm == "torch_cat"
    assert cat.flatten_bytes == nbytes
    # Master: bf16 clone of half the buffer, then the fp32 cast.
    assert cat.master_bytes == nbytes // 2 + nbytes

    model = _model(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    unpadded = sum(p.numel() for p in params) * 2
    legacy = flatten_legacy_cpu([params], rank=0, world_size=2)
    assert legacy.paths == ("host",) and legacy.algorithm == "legacy_cpu"
    assert legacy.flatten_bytes == unpadded + 2 * nbytes  # to host, cat, back

    model = _model(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    plain = flatten_legacy_cpu([params], rank=0, world_size=2, emulate_transfers=False)
    assert plain.flatten_bytes == nbytes  # DeepSpeed on its CPU accelerator: the cat only


def test_argument_errors() -> None:
    model = _model(torch.float32)
    params = list(model.parameters())
    with pytest.raises(TypeError, match="list of lists"):
        flatten_torch_cat(params, rank=0, world_size=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        flatten_torch_cat([params], rank=2, world_size=2)
    with pytest.raises(ValueError, match="twice"):
        flatten_torch_cat([[params[0], params[0]]], rank=0, world_size=1)
    with pytest.raises(ValueError, match="more than one param group"):
        flatten_torch_cat([[params[0]], [params[0]]], rank=0, world_size=1)
    mixed = [params[0], nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="mixes dtypes"):
        flatten_legacy_cpu([mixed], rank=0, world_size=1)


def test_partition_range_matches_deepspeed_rule() -> None:
    # DeepSpeed's get_data_parallel_partitions: remainder spread over the first ranks.
    sizes = [deepspeed_partition_range(10, r, 3) for r in range(3)]
    assert sizes == [(0, 4), (4, 3), (7, 3)]
    assert deepspeed_padded_numel(10, 3) == 12
    assert deepspeed_padded_numel(12, 3) == 12


def test_limits_positive() -> None:
    m = memcpy_seconds(8 << 20, threads=1, repeats=2)
    assert m.seconds > 0 and m.gbps > 0 and m.threads == 1 and m.nbytes == 8 << 20
    assert torch.get_num_threads() >= 1
    # Chunked: 5 MiB + a remainder through 2 MiB buffers.
    c = memcpy_seconds((5 << 20) + 123, repeats=1, chunk_bytes=2 << 20)
    assert c.chunk_bytes == 2 << 20 and c.gbps > 0
    f = first_touch_seconds(6 << 20, threads=1, repeats=2, settle_s=0.0)
    assert f.kind == "first_touch" and f.nbytes == 6 << 20 and f.repeats == 2 and f.gbps > 0
    d = device_copy_seconds(4 << 20, "cpu", repeats=1)
    assert d.kind == "memcpy" and d.gbps > 0
    if torch.cuda.is_available():
        h = pinned_h2d_seconds(4 << 20, "cuda", repeats=1)
        assert h is not None and h.gbps > 0
    else:
        assert pinned_h2d_seconds(4 << 20, "cuda") is None
    assert pinned_h2d_seconds(4 << 20, "cpu") is None
    with pytest.raises(ValueError, match="nbytes"):
        memcpy_seconds(0)


def test_deepspeed_config_validation() -> None:
    cfg = deepspeed_config(stage=2, dtype="bf16", bucket_numel=1000)
    assert cfg["zero_optimization"]["stage"] == 2 and cfg["bf16"]["enabled"] is True
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 1000
    with pytest.raises(ValueError, match="stage"):
        deepspeed_config(stage=3, dtype="bf16", bucket_numel=1000)
    with pytest.raises(ValueError, match="even"):
        deepspeed_config(stage=1, dtype="fp32", bucket_numel=999)


def _ds_worker(rank: int, world_size: int) -> bytes:
    """A real ``deepspeed.initialize`` timed on this rank (a fork of the suite's rank
    server: no interpreter start or torch import per rank)."""
    from flatzero_bench.common.deepspeed_init import time_deepspeed_initialize

    torch.manual_seed(1234)  # same model on every rank
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8), nn.Linear(8, 3)).to(torch.bfloat16)
    originals = [p.detach().clone() for p in model.parameters()]
    result = time_deepspeed_initialize(
        model, stage=2, dtype="bf16", bucket_numel=1000, keep_partitions=True
    )
    # A second trial on a fresh model in the same process must work too.
    small = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    again = time_deepspeed_initialize(small, stage=1, dtype="bf16", bucket_numel=1000)
    buffer = io.BytesIO()  # tensors through the result queue: serialized
    torch.save(
        {
            "result": {
                "wall_s": result.wall_s,
                "cpu_s": result.cpu_s,
                "peak_rss_bytes": result.peak_rss_bytes,
                "flat_numel": result.flat_numel,
                "partition_matches_flat": result.partition_matches_flat,
                "world_size": result.world_size,
                "rank": result.rank,
            },
            "again_ok": again.partition_matches_flat,
            "fp32": result.fp32_partitions[0].clone(),
            "originals": originals,
            "params_after": [p.detach().clone() for p in model.parameters()],
        },
        buffer,
    )
    return buffer.getvalue()


def test_deepspeed_initialize_two_ranks() -> None:
    ok, why = deepspeed_available()
    if not ok:
        pytest.skip(why)
    world_size = 2
    blobs = run_ranks(_ds_worker, world_size, env={"DS_ACCELERATOR": "cpu"})
    outs = [torch.load(io.BytesIO(blob), weights_only=False) for blob in blobs]
    expected = _expected_flat(outs[0]["originals"], world_size).float()
    part = expected.numel() // world_size
    for rank, out in enumerate(outs):
        res = out["result"]
        assert res["rank"] == rank and res["world_size"] == world_size
        assert res["wall_s"] > 0 and res["cpu_s"] > 0 and res["peak_rss_bytes"] > 0
        assert res["partition_matches_flat"] and out["again_ok"]
        assert res["flat_numel"] == (expected.numel(),)
        # DeepSpeed's single_partition_of_fp32_groups[0] is rank r's slice of the
        # flattened original params: we timed a real initialize on this model.
        assert torch.equal(out["fp32"], expected[rank * part : (rank + 1) * part])
        for before, after in zip(out["originals"], out["params_after"], strict=True):
            assert torch.equal(before, after)
