"""The init report: printed once per job, one fact per line, every line under 100 characters."""

from __future__ import annotations

import logging

import torch
from torch import nn

from flatzero.launch import run_ranks
from flatzero.report import LINE_WIDTH, fit


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _door_logs(rank: int, world_size: int) -> list[str]:
    """What flatzero logs at INFO on this rank through one ``flatzero.initialize``."""
    import flatzero

    handler = _Lines()
    root = logging.getLogger("flatzero")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "flatzero": {"progress": False},
    }
    flatzero.initialize(model=model, config=config)
    root.removeHandler(handler)
    return handler.messages


def test_the_door_logs_its_report_once_one_fact_per_line():
    """``flatzero.initialize`` logs one report holding the flatten report's facts: the
    flatten report and ``ZeroOptimizer``'s line are not logged again beside it (under
    ``python -m flatzero.run``, which shows INFO, the flatten report came out twice)."""
    messages = run_ranks(_door_logs, 2)[0]
    reports = [m for m in messages if "tier:" in m]
    assert len(reports) == 1, messages
    assert not [m for m in messages if m.startswith(("flatzero init", "ZeroOptimizer"))]
    lines = reports[0].splitlines()
    assert lines[0].startswith("flatzero.initialize ") and "2 ranks" in lines[0]
    assert all(len(line) <= LINE_WIDTH for line in lines), lines
    labels = [line.strip().split(":")[0] for line in lines[1:] if not line.startswith(" " * 5)]
    for fact in ("weights from", "phases", "tier", "moved", "memory", "optimizer", "scheduler"):
        assert fact in labels, lines
    assert not [line for line in lines if "optimizer:" in line and "scheduler:" in line]
    assert not [m for m in messages if "1 ranks" in m or "1 buckets" in m]


def test_a_long_fact_wraps_under_the_width():
    long = "  event: " + "out of memory in bucket 3, continuing with the next tier " * 4
    text = fit(["head", long])
    assert text.startswith("head\n  event: out of memory")
    assert all(len(line) <= LINE_WIDTH for line in text.splitlines())
    assert all(line.startswith("      ") for line in text.splitlines()[2:])
