"""Property tests of the pure layout: coverage, alignment, equal shards, inverse mapping."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flatzero.layout import Layout, ParamSpec, plan_layout

DTYPES = ("bfloat16", "float32", "float16")

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple)
specs = st.lists(st.tuples(shapes, st.sampled_from(DTYPES)), min_size=1, max_size=25)


def _groups(draw_groups):
    out, k = [], 0
    for group in draw_groups:
        specs_ = []
        for shape, dtype in group:
            specs_.append(ParamSpec(f"p{k}", shape, dtype))
            k += 1
        out.append(specs_)
    return out


@settings(max_examples=200, deadline=None)
@given(
    groups=st.lists(specs, min_size=1, max_size=3).map(_groups),
    world_size=st.integers(1, 8),
    bucket_numel=st.integers(1, 5000),
    alignment=st.sampled_from([1, 8, 64]),
)
def test_layout_invariants(groups, world_size, bucket_numel, alignment):
    layout = plan_layout(
        groups, world_size=world_size, bucket_numel=bucket_numel, alignment=alignment
    )
    # One layout per (group, dtype), params in reverse registration order.
    expected_pairs = []
    for gi, g in enumerate(groups):
        for dtype in dict.fromkeys(s.dtype for s in g):
            expected_pairs.append((gi, dtype))
    assert [(g.group_index, g.dtype) for g in layout.groups] == expected_pairs
    for gl in layout.groups:
        members = [s for s in groups[gl.group_index] if s.dtype == gl.dtype]
        assert [s.spec for s in gl.slots] == list(reversed(members))
        regs = [s.registration_index for s in gl.slots]
        assert regs == sorted(regs, reverse=True)

        shard_sizes = set()
        for b in gl.buckets:
            assert b.numel % (world_size * alignment) == 0
            assert b.numel >= b.used
            shard_sizes.add(b.slice_numel)
            slots = gl.bucket_slots(b.index)
            # Params in a bucket do not overlap and fit in it; big params are alone.
            for a, c in itertools.pairwise(slots):
                assert a.end <= c.offset
            for s in slots:
                assert s.offset % alignment == 0
                assert s.end <= b.used
                if s.numel > bucket_numel:
                    assert slots == (s,)  # a param bigger than a bucket is alone
            if len(slots) > 1:
                assert b.used <= bucket_numel
        # Shard offsets are the running sum of slice sizes.
        running = 0
        for b in gl.buckets:
            assert b.shard_offset == running
            running += b.slice_numel
        assert running == gl.shard_numel

        # Every element of every param is covered exactly once over all ranks' shards,
        # and the shard offsets of different ranks' pieces agree with the bucket slices.
        covered = {i: [0] * s.numel for i, s in enumerate(gl.slots)}
        for rank in range(world_size):
            for piece in gl.shard_pieces(rank):
                slot = gl.slots[piece.slot]
                b = gl.buckets[piece.bucket]
                lo, hi = b.rank_range(rank)
                assert lo <= piece.bucket_start < hi
                assert piece.bucket_start == slot.offset + piece.param_start
                assert piece.shard_start == b.shard_offset + piece.bucket_start - lo
                assert 0 <= piece.shard_start < gl.shard_numel
                for e in range(piece.param_start, piece.param_end):
                    covered[piece.slot][e] += 1
        assert all(c == 1 for cs in covered.values() for c in cs)

        # The per-param mapping is the inverse of the per-rank one.
        for i in range(len(gl.slots)):
            pieces = gl.param_pieces(i)
            ends = [p.param_start for _, p in pieces] + [gl.slots[i].numel]
            assert [p.param_end for _, p in pieces] == ends[1:]
            for rank, piece in pieces:
                assert piece in gl.shard_pieces(rank)

        # Padding is exactly what gaps() reports.
        for b in gl.buckets:
            gap_total = sum(e - s for s, e in gl.gaps(b.index))
            params_total = sum(s.numel for s in gl.bucket_slots(b.index))
            assert gap_total + params_total == b.numel

    assert len({gl.shard_numel for gl in layout.groups}) >= 1


def test_layout_round_trips_through_json_and_hash_is_stable():
    groups = [[ParamSpec("a", (3, 5), "bfloat16"), ParamSpec("b", (100,), "float32")]]
    layout = plan_layout(groups, world_size=3, bucket_numel=64)
    again = Layout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout
    assert again.digest() == layout.digest()
    other = plan_layout(groups, world_size=2, bucket_numel=64)
    assert other.digest() != layout.digest()


def test_big_param_gets_its_own_bucket_and_order_is_reversed():
    groups = [
        [
            ParamSpec("first", (10,), "float32"),
            ParamSpec("huge", (1000,), "float32"),
            ParamSpec("last", (10,), "float32"),
        ]
    ]
    gl = plan_layout(groups, world_size=2, bucket_numel=200).groups[0]
    assert [s.spec.name for s in gl.slots] == ["last", "huge", "first"]
    assert [len(b.slots) for b in gl.buckets] == [1, 1, 1]
    assert gl.slots[1].bucket == 1 and gl.slots[1].offset == 0
    assert gl.buckets[1].numel == 1024  # 1000 rounded up to 2 * 64 * k


def test_small_params_share_a_bucket_on_aligned_offsets():
    groups = [[ParamSpec(f"p{i}", (3,), "bfloat16") for i in range(4)]]
    gl = plan_layout(groups, world_size=4, bucket_numel=1000).groups[0]
    assert len(gl.buckets) == 1
    assert [s.offset for s in gl.slots] == [0, 64, 128, 192]
    assert gl.buckets[0].numel == 256
    assert gl.padding_numel == 256 - 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0, "bucket_numel": 10}, "world_size must be a positive int"),
        ({"world_size": 2, "bucket_numel": 0}, "bucket_numel must be a positive int"),
        ({"world_size": 2, "bucket_numel": 10, "alignment": -1}, "alignment"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_layout([[ParamSpec("a", (2,), "float32")]], **kwargs)


def test_param_in_two_groups_is_an_error():
    a = ParamSpec("a", (2,), "float32")
    with pytest.raises(ValueError, match="appears in param groups 0 and 1"):
        plan_layout([[a], [a]], world_size=1, bucket_numel=10)


def test_rank_outside_world_is_an_error():
    gl = plan_layout([[ParamSpec("a", (2,), "float32")]], world_size=2, bucket_numel=10).groups[0]
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        gl.shard_pieces(2)


@settings(max_examples=150, deadline=None)
@given(
    groups=st.lists(specs, min_size=1, max_size=3).map(_groups),
    world_size=st.integers(1, 8),
    bucket_numel=st.integers(1, 5000),
    alignment=st.sampled_from([1, 8, 64]),
)
def test_whole_params_layout_puts_every_param_whole_on_one_rank(
    groups, world_size, bucket_numel, alignment
):
    """``whole_params=True`` (Muon): each param inside one rank's slice, params never
    overlap, every element covered once, padding exactly the gaps, slices as long as the
    fullest rank's part of the bucket."""
    layout = plan_layout(
        groups,
        world_size=world_size,
        bucket_numel=bucket_numel,
        alignment=alignment,
        whole_params=True,
    )
    for gl in layout.groups:
        members = [s for s in groups[gl.group_index] if s.dtype == gl.dtype]
        assert sorted(s.spec.name for s in gl.slots) == sorted(s.name for s in members)
        for i, slot in enumerate(gl.slots):
            b = gl.buckets[slot.bucket]
            assert slot.offset % alignment == 0
            if slot.numel:
                assert slot.offset // b.slice_numel == (slot.end - 1) // b.slice_numel
                assert len(gl.param_pieces(i)) == 1
        for b in gl.buckets:
            assert b.numel == b.slice_numel * world_size
            assert b.slice_numel % alignment == 0
            slots = gl.bucket_slots(b.index)
            for a, c in itertools.pairwise(slots):
                assert a.end <= c.offset
            fills = [0] * world_size
            for s in slots:
                if s.numel:
                    rank = s.offset // b.slice_numel
                    fills[rank] = s.end - rank * b.slice_numel
            assert max(alignment, -(-max(fills) // alignment) * alignment) == b.slice_numel
            gap_total = sum(e - s for s, e in gl.gaps(b.index))
            assert gap_total + sum(s.numel for s in slots) == b.numel
        covered = {i: 0 for i in range(len(gl.slots))}
        for rank in range(world_size):
            for piece in gl.shard_pieces(rank):
                assert piece.param_start == 0 and piece.param_end == gl.slots[piece.slot].numel
                covered[piece.slot] += 1
        assert all(covered[i] == 1 for i, s in enumerate(gl.slots) if s.numel)
