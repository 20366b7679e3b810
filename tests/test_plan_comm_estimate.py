"""Issue 42 part 1: ``flatzero plan`` reports the exposed data-parallel communication of a
step, without overlap (every bucket's all-gather and reduction) and with it (one bucket's
all-gather + one bucket's reduction), from the link bandwidth it knows."""

from __future__ import annotations

import json

import pytest

from flatzero.cli import main
from flatzero.plan.comm_estimate import exposed_comm


def _ms(n: int) -> float:
    return n / 1000  # 1 kB/s: bytes -> seconds


def test_exposed_comm_with_known_numbers():
    buckets = [(100, 200), (300, 400)]  # (gathered, reduced) bytes per bucket
    one = exposed_comm(buckets, stage=1, grad_accum=2, seconds=_ms)
    assert (one.buckets, one.without_overlap_s, one.with_overlap_s) == (2, 1.0, 0.7)
    two = exposed_comm(buckets, stage=2, grad_accum=2, seconds=_ms)  # reduces per micro-batch
    assert (two.without_overlap_s, two.with_overlap_s) == (1.6, 1.1)
    assert exposed_comm([], stage=2, grad_accum=1, seconds=_ms).with_overlap_s == 0.0
    with pytest.raises(ValueError, match="grad_accum"):
        exposed_comm(buckets, stage=2, grad_accum=0, seconds=_ms)


def test_plan_shows_the_exposed_communication(capsys):
    argv = ["plan", "--model", "llama-0.4b", "--gpus-per-node", "8", "--gpu", "h100"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    ex, step = plan["exposed_comm"], plan["step"]
    assert ex["without_overlap_s"] == pytest.approx(step["seconds"])  # nothing hidden
    buckets = sum(g["buckets"] for g in plan["layout"]["groups"])
    assert ex["buckets"] == buckets > 1
    # equal buckets but the last: one bucket's worth is about 1/buckets of the whole
    assert ex["without_overlap_s"] / buckets <= ex["with_overlap_s"] < ex["without_overlap_s"]
    assert main(argv) == 0
    shown = capsys.readouterr().out
    assert (
        f"exposed communication per step: {1e3 * ex['without_overlap_s']:.1f} ms without "
        f"overlap (all {buckets} buckets' all-gathers and reductions), "
        f"{1e3 * ex['with_overlap_s']:.1f} ms with overlap"
    ) in shown
