"""Issue 38 item 9: docs/plan.md's tables under "Against the published numbers" are the
planner's output, recomputed here row by row (the plans use datasheet and assumed rates, the
same on every machine), so a change to the model that moves a figure fails until the table
is updated. Quoted (reported) figures are left alone; predicted ratios are recomputed from
the cells they divide."""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path
from typing import Any

from flatzero.plan import make_plan, plan_to_dict
from flatzero.plan.cli import spec_from_args
from flatzero.plan.options import add_arguments

ROOT = Path(__file__).resolve().parent.parent
QWEN = "--model qwen3-30b-a3b --no-lm-head --expert-layout "
PLANS = {
    "16/8xh100": QWEN + "unfused --layers 16 --gpus-per-node 8",
    "16/1xh200": QWEN + "unfused --layers 16 --gpus-per-node 1 --gpu h200",
    "16/8xh100/meta": QWEN + "unfused --layers 16 --gpus-per-node 8 --params-on meta",
    "32/8xh100": QWEN + "unfused --layers 32 --gpus-per-node 8",
    "32/8xh100/fused": QWEN + "fused --layers 32 --gpus-per-node 8",
}
"""Each setup of the tables, as ``flatzero plan`` options."""

METHODS = {
    "flatzero `host`": "host",
    "flatzero `host` (auto)": "host",
    "flatzero `sharded` (auto)": "sharded",
    "DeepSpeed legacy": "deepspeed_legacy",
    "DeepSpeed 0.19 device (taken)": "deepspeed_device",
}
PHASES = {"per-tensor": "tensors", "all-gather": "all_gather"}
NUMBER = re.compile(r"(?<![\w#.])\d[\d,]*(?:\.\d+)?")


@functools.cache
def _plan(name: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return plan_to_dict(make_plan(spec_from_args(parser.parse_args(PLANS[name].split()))))


def _tables() -> list[list[list[str]]]:
    """The tables of the section, each a list of rows of cells (header and rule dropped)."""
    text = (ROOT / "docs/plan.md").read_text()
    section = text[text.index("## Against the published numbers") :]
    section = section[: section.index("\n## ", 10)] if "\n## " in section[10:] else section
    tables, rows = [], []
    for line in [*section.splitlines(), ""]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            tables.append(rows[2:])
            rows = []
    return tables


def _close(shown: str, value: float) -> bool:
    """Whether ``shown`` (a figure as the table prints it) is ``value`` at its decimals."""
    decimals = len(shown.partition(".")[2])
    return f"{value:.{decimals}f}" == shown.replace(",", "")


def test_flatzeros_tiers_table_is_the_planners():
    """Every figure of "flatzero's tiers for the same setups" is the planner's: device peak,
    host RAM per node, bytes per link, time and its components."""
    setups = {
        "#7677, 8xH100, params in host memory": "16/8xh100",
        "#7677, 8xH100, meta + safetensors": "16/8xh100/meta",
        "#7677, 1xH200": "16/1xh200",
        "#7828, 8xH100, unfused": "32/8xh100",
        "#7828, 8xH100, fused": "32/8xh100/fused",
    }
    links = ("hbm", "host_memory", "pcie_h2d", "pcie_d2h", "intra_node")
    checked, setup = 0, None
    for row in _tables()[1]:
        setup = setups[row[0]] if row[0] else setup
        plan = _plan(setup)
        method = plan["methods"][METHODS[row[1]]]
        gib = [method["memory"]["device_peak"], method["host_ram_per_node"]]
        gib += [method["links"][link] for link in links]
        for shown, value in zip(row[2:9], gib, strict=True):
            assert _close(shown, value / 2**30), (row[0], row[1], shown, value / 2**30)
        assert _close(row[9], method["time"]["seconds"]), (row, method["time"])
        for name, shown in re.findall(r"([a-z][a-z-]*) (\d+\.\d+)", row[10]):
            phase = method["time"]["phases"][PHASES.get(name, name)]
            assert _close(shown, phase), (row[0], row[1], name, shown, phase)
        for shown in re.findall(r"\(([\d,]+) tensors\)", row[10]):
            assert int(shown.replace(",", "")) == plan["layout"]["tensors"]
        checked += 1
    assert checked == 9


def _numbers(plan: dict[str, Any]) -> set[str]:
    """Every figure the plan can be quoted as: seconds and GiB at 1-2 decimals, billions."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            for x in (value, value / 2**30, value / 1e9):
                found.update({f"{x:.1f}", f"{x:.2f}"})

    walk(plan)
    return found


def test_against_the_published_numbers_table_is_the_planners():
    """Every predicted figure with decimals in the comparison table is one the plans of its
    row give, and each predicted ratio is the quotient of the cells above it."""
    table = _tables()[0]
    plans = [("16/8xh100",), ("16/1xh200",), (), ("32/8xh100", "32/8xh100/fused")]
    plans += [("32/8xh100", "32/8xh100/fused"), ()]
    assert len(table) == len(plans)
    for row, names in zip(table, plans, strict=True):
        if not names:
            continue
        known = set().union(*(_numbers(_plan(name)) for name in names))
        for cell in (row[0], *row[2:]):
            for shown in NUMBER.findall(cell):
                if "." in shown:
                    assert shown in known, (row[0], cell, shown)

    def first(cell: str, index: int = 0) -> float:
        return float(re.findall(r"\d+\.\d+", cell)[index])

    for column in (2, 3, 4):
        ratio = first(table[0][column]) / first(table[1][column])
        assert table[2][column] == f"{ratio:.1f}x", (table[2], ratio)
    legacy, device = table[3][2], table[4][3]
    ratios = [first(legacy, i) / first(device, i) for i in (0, 1)]
    assert table[5][2].startswith(f"{ratios[0]:.1f}x / {ratios[1]:.1f}x"), (table[5], ratios)
