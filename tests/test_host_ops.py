"""Issue 42 part 3: flatzero stays lean on the host.

Operator calls dispatched on the host (``flatzero.testing.host_ops``, a counting
``TorchDispatchMode`` around backward and around the step) on a stack of small
``nn.Linear`` layers: backward costs at most 3 ops per param more than plain torch's own
backward, and the step's count does not grow with the params (one bucket holds them all,
for 50 layers as for 200).
"""

from __future__ import annotations

import pytest

from flatzero.launch import run_ranks
from flatzero.testing.host_ops import HostOpsSpec, count_all, count_host_ops

EXTRA_PER_PARAM = 3.0
"""Most backward ops per param above plain torch's (issue 42's bound)."""

SPECS = tuple(
    HostOpsSpec(method=f"flatzero-z{stage}", layers=layers)
    for stage in (1, 2)
    for layers in (50, 200)
)


@pytest.fixture(scope="module")
def plain() -> dict:
    """Plain torch's (AdamW foreach, one process) counts."""
    return count_host_ops(0, 1, HostOpsSpec(method="torch-adamw", layers=50))


@pytest.fixture(scope="module")
def plain_per_param(plain: dict) -> float:
    """Plain torch's backward ops per param."""
    return plain["backward"] / plain["params"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_backward_and_step_host_ops(world_size: int, plain_per_param: float) -> None:
    # One rank: in this process, without a process group (as a single-process user runs).
    ranks = run_ranks(count_all, world_size, SPECS) if world_size > 1 else [count_all(0, 1, SPECS)]
    for rank, counted in enumerate(ranks):
        by_spec = dict(zip(SPECS, counted, strict=True))
        for spec, ops in by_spec.items():
            per_param = ops["backward"] / ops["params"]
            assert per_param <= plain_per_param + EXTRA_PER_PARAM, (spec, rank, per_param)
            if world_size > 1:  # the reductions' own ops are seen (inside the hooks, for z2)
                assert any(name.startswith("c10d.") for name in ops["backward_ops"])
        for stage in (1, 2):
            few, many = (by_spec[s] for s in SPECS if s.method == f"flatzero-z{stage}")
            assert many["params"] == 4 * few["params"] and many["buckets"] == few["buckets"] == 1
            assert many["step"] == few["step"], (stage, rank, few["step_ops"], many["step_ops"])


def test_counter_sees_plain_backward(plain: dict) -> None:
    """The counter sees autograd's own ops in plain torch's backward (the reference): the
    matmuls (2 per layer but the first, which needs no input gradient) and AccumulateGrad's
    detach of each param's new gradient."""
    steps = HostOpsSpec(method="torch-adamw", layers=50).steps
    assert plain["backward_ops"]["aten.mm"] == (2 * 50 - 1) * steps
    assert plain["backward_ops"]["aten.detach"] == plain["params"] * steps
