"""Resharding plans (pure): any saved layout -> any new layout, element for element."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatzero.checkpoint.reshard import (
    ParamRecord,
    Segment,
    execute,
    index_layout,
    plan_reads,
)
from flatzero.layout import Layout, ParamSpec, plan_layout


def shards_of(layout: Layout, full: dict[str, torch.Tensor]) -> dict[tuple[int, int], torch.Tensor]:
    """Every (rank, group) shard of ``layout`` filled from full param values, padding zero."""
    out = {}
    for gi, gl in enumerate(layout.groups):
        for rank in range(layout.world_size):
            shard = torch.zeros(gl.shard_numel)
            for p in gl.shard_pieces(rank):
                name = gl.slots[p.slot].spec.name
                shard[p.shard_start : p.shard_start + p.numel] = full[name].reshape(-1)[
                    p.param_start : p.param_end
                ]
            out[rank, gi] = shard
    return out


def make_params(shapes: list[tuple[int, ...]], groups: int) -> list[list[ParamSpec]]:
    specs: list[list[ParamSpec]] = [[] for _ in range(groups)]
    for i, shape in enumerate(shapes):
        specs[i % groups].append(ParamSpec(f"p{i}", shape, "bfloat16" if i % 3 else "float32"))
    return specs


def full_values(specs: list[list[ParamSpec]]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=g) for group in specs for s in group}


shape_st = st.lists(
    st.one_of(
        st.tuples(st.integers(0, 300)),
        st.tuples(st.integers(1, 40), st.integers(1, 40)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(
    shapes=shape_st,
    groups=st.integers(1, 2),
    old_ws=st.integers(1, 5),
    new_ws=st.integers(1, 5),
    old_bucket=st.integers(1, 2000),
    new_bucket=st.integers(1, 2000),
    old_align=st.sampled_from([1, 8, 64]),
    new_align=st.sampled_from([1, 64]),
    old_whole=st.booleans(),
    new_whole=st.booleans(),
)
def test_reshard_any_layout_to_any_layout(
    shapes,
    groups,
    old_ws,
    new_ws,
    old_bucket,
    new_bucket,
    old_align,
    new_align,
    old_whole,
    new_whole,
):
    """Any layout, whole-params (Muon's) or not, to any other."""
    specs = make_params(shapes, groups)
    full = full_values(specs)
    old = plan_layout(
        specs,
        world_size=old_ws,
        bucket_numel=old_bucket,
        alignment=old_align,
        whole_params=old_whole,
    )
    # the new model registers its groups the other way round: matching is by name
    new = plan_layout(
        list(reversed(specs)),
        world_size=new_ws,
        bucket_numel=new_bucket,
        alignment=new_align,
        whole_params=new_whole,
    )
    saved = shards_of(old, full)
    expected = shards_of(new, full)
    index = index_layout(old)

    def fetch(source, start, numel):
        return saved[source][start : start + numel]

    for rank in range(new_ws):
        plans = plan_reads(index, new, rank)
        for plan in plans:
            out = torch.full((plan.shard_numel,), float("nan"))
            out.zero_()
            execute(plan, out, fetch)
            assert torch.equal(out, expected[rank, plan.group])
            # merged copies never overlap and stay inside the shard
            ends = [(c.dst_start, c.dst_start + c.numel) for c in plan.copies]
            assert all(a < b for a, b in ends)
            assert all(ends[i][1] <= ends[i + 1][0] for i in range(len(ends) - 1))


@settings(max_examples=30, deadline=None)
@given(shapes=shape_st, ws=st.integers(1, 6), bucket=st.integers(1, 3000))
def test_index_layout_agrees_with_param_pieces(shapes, ws, bucket):
    layout = plan_layout(make_params(shapes, 1), world_size=ws, bucket_numel=bucket)
    index = index_layout(layout)
    gl = layout.groups[0]
    for i, slot in enumerate(gl.slots):
        record = index[slot.spec.name]
        pieces = gl.param_pieces(i)
        assert [(s.source[0], s.param_start, s.param_end, s.offset) for s in record.segments] == [
            (r, p.param_start, p.param_end, p.shard_start) for r, p in pieces
        ]


def test_same_layout_reads_one_run_per_bucket_slice():
    """The same model at the same world size reads long runs, not one per param."""
    specs = [[ParamSpec(f"w{i}", (64, 64), "float32") for i in range(20)]]
    old = plan_layout(specs, world_size=4, bucket_numel=64 * 64 * 5)
    new = plan_layout(specs, world_size=2, bucket_numel=64 * 64 * 7)
    plans = plan_reads(index_layout(old), new, 0)
    pieces = len(new.groups[0].shard_pieces(0))
    assert len(plans[0].copies) < pieces


def test_missing_extra_and_misshaped_params_are_named():
    old = plan_layout([[ParamSpec("a", (4, 4), "float32")]], world_size=2, bucket_numel=100)
    index = index_layout(old)
    new = plan_layout([[ParamSpec("b", (4, 4), "float32")]], world_size=1, bucket_numel=100)
    try:
        plan_reads(index, new, 0, where="CKPT")
    except ValueError as e:
        assert "'b'" in str(e) and "CKPT" in str(e)
    else:
        raise AssertionError("missing param not reported")
    plans = plan_reads(index, new, 0, rename={"b": "a"})
    assert sum(c.numel for c in plans[0].copies) == 16
    loose = plan_reads(index, new, 0, strict=False)
    assert loose[0].copies == () and loose[0].missing == (("b", 0, 16),)
    bad = plan_layout([[ParamSpec("a", (2, 8), "float32")]], world_size=1, bucket_numel=100)
    try:
        plan_reads(index, bad, 0)
    except ValueError as e:
        assert "(2, 8)" in str(e) and "(4, 4)" in str(e)
    else:
        raise AssertionError("shape mismatch not reported")
    two = plan_layout(
        [[ParamSpec("a", (4, 4), "float32"), ParamSpec("z", (3,), "float32")]],
        world_size=3,
        bucket_numel=100,
    )
    only_a = plan_layout([[ParamSpec("a", (4, 4), "float32")]], world_size=1, bucket_numel=100)
    try:
        plan_reads(index_layout(two), only_a, 0)
    except ValueError as e:
        assert "1 params the model does not have" in str(e) and "'z'" in str(e)
    else:
        raise AssertionError("saved param missing from the model not reported")
    assert plan_reads(index_layout(two), only_a, 0, strict=False)[0].missing == ()


def test_param_record_runs_bisects_segments():
    segs = tuple(Segment(i * 10, i * 10 + 10, (i, 0), 5) for i in range(10))
    record = ParamRecord("x", (100,), "float32", 0, segs)
    runs = list(record.runs(35, 52))
    assert [(s.source[0], lo, hi) for s, lo, hi in runs] == [(3, 35, 40), (4, 40, 50), (5, 50, 52)]
