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
def plain_per_param() -> float:
    """Plain torch's (AdamW foreach, one process) backward ops per param."""
    counts = count_host_ops(0, 1, HostOpsSpec(method="torch-adamw", layers=50))
    return counts["backward"] / counts["params"]


@pytest.mark.parametrize("world_size", [1, 2])
def test_backward_and_step_host_ops(world_size: int, plain_per_param: float) -> None:
    ranks = run_ranks(count_all, world_size, SPECS)
    for rank, counted in enumerate(ranks):
        by_spec = dict(zip(SPECS, counted, strict=True))
        for spec, ops in by_spec.items():
            per_param = ops["backward"] / ops["params"]
            assert per_param <= plain_per_param + EXTRA_PER_PARAM, (spec, rank, per_param)
            if world_size > 1:  # the reductions' own ops are seen (inside the hooks, for z2)
                assert any(name.startswith("c10d.") for name in ops["backward_ops"])
        for stage in (1, 2):
            few, many = (by_spec[s] for s in SPECS if s.method == f"flatzero-z{stage}")
            assert many["params"] == 4 * few["params"]
            assert many["step"] == few["step"], (stage, rank, few["step_ops"], many["step_ops"])


def test_counter_sees_plain_backward() -> None:
    """The counter sees autograd's own ops: two matmuls per Linear weight at least."""
    counts = count_host_ops(0, 1, HostOpsSpec(method="torch-adamw", layers=50))
    assert counts["backward_ops"]["aten.mm"] >= 2 * 49 * 2  # 2 counted steps
    assert 4 <= counts["backward"] / counts["params"] <= 7
