"""README.md's Performance figures are the committed results files' (issue 38 item 9).

Each figure is recomputed from the file the README names, rounded as the README rounds it,
and must appear in the Performance section as written: a rerun committed over a file, or
an edit of a figure, fails here until the other follows. Reads JSON only: no torch.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODES = {"back to back": "back-to-back", "settled": "settled 6s"}
DOORS = {
    "6,291 tensors": "doors_cpu_qwen3-moe-narrow-unfused.json",
    "llama-0.4b": "doors_cpu_llama-0.4b.json",
}


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def performance() -> str:
    """README's Performance section, whitespace collapsed (figures may wrap)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Performance\n", 1)[1].split("\n## ", 1)[0]
    return re.sub(r"\s+", " ", section)


def span(values: list[float], fmt: str) -> str:
    """``min-max`` of ``values`` formatted, or one value where both read the same."""
    low, high = format(min(values), fmt), format(max(values), fmt)
    return low if low == high else f"{low}-{high}"


def group(doors: dict, world_size: int, mode: str) -> dict:
    (found,) = (g for g in doors["groups"] if g["world_size"] == world_size and g["mode"] == mode)
    return found


def triple(spread: dict) -> str:
    return " / ".join(f"{spread[k]:.2f}" for k in ("min", "median", "max"))


def test_the_door_table_is_the_doors_files():
    rows, model = [], None
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[2] not in MODES:
            continue
        model = (
            next((f for key, f in DOORS.items() if key in cells[0]), model) if cells[0] else model
        )
        rows.append((model, int(cells[1]), MODES[cells[2]], cells[3], cells[4]))
    assert len(rows) == 8, rows
    for name, world_size, mode, init, ttfs in rows:
        ratio = group(load(name), world_size, mode)["spread"]["ratio"]
        assert (init, ttfs) == (triple(ratio["init_s"]), triple(ratio["ttfs_s"])), (
            name,
            world_size,
            mode,
        )


def test_the_door_bullets_are_the_doors_files():
    text = performance()
    many = load(DOORS["6,291 tensors"])["groups"]
    medians = {
        door: [g["spread"]["doors"][door]["init_s"]["median"] for g in many]
        for door in ("flatzero", "deepspeed")
    }
    assert f"takes {span(medians['deepspeed'], '.0f')} s" in text
    flatzero = f"{min(medians['flatzero']):.2f}-{max(medians['flatzero']):.1f} s"
    assert f"takes {flatzero}" in text
    llama = [g for g in load(DOORS["llama-0.4b"])["groups"] if g["world_size"] == 1]
    limit = {
        door: [statistics.median(r["doors"][door]["x_limit"] for r in g["runs"]) for g in llama]
        for door in ("flatzero", "deepspeed")
    }
    assert f"init is {span(limit['flatzero'], '.2f')}x the first touch" in text
    assert f"DeepSpeed's is {span(limit['deepspeed'], '.1f')}x" in text
    sync = statistics.median(
        max(r["phase_seconds"]["sync"] for r in launch["ranks"])
        for launch in load(DOORS["llama-0.4b"])["launches"]
        if launch["door"] == "flatzero" and launch["world_size"] == 2
    )
    assert f"a second pass over every byte ({sync:.1f} s)" in text
    for name in (
        "doors_cpu_llama-0.4b_ws2_sharded.json",
        "doors_cpu_llama-0.4b_ws2_broadcast_all_gather.json",
    ):
        doors = load(name)
        b2b, settled = (group(doors, 2, mode)["spread"]["ratio"] for mode in MODES.values())
        init, ttfs = (f"{b2b[k]['median']:.2f}" for k in ("init_s", "ttfs_s"))
        init += f" back to back and {settled['init_s']['median']:.2f} settled"
        ttfs += f" / {settled['ttfs_s']['median']:.2f}"
        assert (
            f"{init}, and init + first step {ttfs}" in text
            or f"{init}, init + first step {ttfs}" in text
        ), name


def test_the_flatten_step_and_memory_figures_are_their_files():
    text = performance()
    cat = {
        r["world_size"]: r["x_flatzero"]
        for r in load("init_cpu_llama-0.4b.json")["rows"]
        if r["method"] == "torch_cat"
    }
    assert f"{cat[1]:.1f}x faster at 1 rank and {cat[2]:.1f}x at 2 ranks" in text
    wall = {}
    for kind in ("fused", "unfused"):
        data = load(f"init_cpu_qwen3-moe-narrow-{kind}.json")
        tensors = data["model"]["tensors"]
        for r in data["rows"]:
            if r["world_size"] == 1:
                wall[kind, r["method"]] = (tensors, r["wall_s"])
    per_tensor = {
        m: (wall["unfused", m][1] - wall["fused", m][1])
        / (wall["unfused", m][0] - wall["fused", m][0])
        * 1e6
        for m in ("flatzero", "torch_cat")
    }
    assert "flatzero costs about 30 µs, a bare `torch.cat` about 17 µs" in text
    assert abs(per_tensor["flatzero"] - 30) < 1.5 and abs(per_tensor["torch_cat"] - 17) < 0.5, (
        per_tensor
    )
    step = load("step_cpu_llama-22m_fp32.json")["rows"]

    def ratios(world_size: int, fused: bool) -> list[float]:
        return [
            value["bwd_plus_step"]
            for r in step
            if r["world_size"] == world_size and r["method"].startswith("flatzero")
            for base, value in r["ratios"].items()
            if base.endswith("-fused") == fused
        ]

    plain, fused = span(ratios(1, False), ".2f"), span(ratios(1, True), ".2f")
    assert f"at 1 rank {plain}x plain `torch.optim.AdamW` and {fused}x the fused one" in text
    plain, fused = span(ratios(2, False), ".2f"), span(ratios(2, True), ".2f")
    assert f"at 2 ranks {plain}x DeepSpeed ZeRO-1/2 with the same client AdamW" in text
    assert f"and {fused}x with the fused one" in text
    memory = {
        r["method"]: r
        for r in load("device_memory_emu_llama-0.4b.json")["rows"]
        if r["world_size"] == 1 and r["params_on"] == "device"
    }
    mib = 2**20
    ours, theirs = memory["flatzero"], memory["torch_cat"]
    assert f"passes {ours['transient_bytes'] / mib:.0f} MiB above what it keeps" in text
    assert f"`torch.cat` {theirs['transient_bytes'] / mib:.0f} MiB" in text
    peaks = (f"{r['peak_extra_bytes'] / mib:,.0f} MiB" for r in (ours, theirs))
    assert "peak {} against {}".format(*peaks) in text
