"""`flatzero bench init` end to end on a tiny model: table, JSON line, correct values."""

from __future__ import annotations

import json

from flatzero.cli import main


def test_bench_init_runs_every_method_and_ends_with_json(capsys, tmp_path):
    out = tmp_path / "init.json"
    argv = [
        "bench", "init", "--model", "tiny", "--world-sizes", "1,3", "--trials", "1",
        "--methods", "flatzero,torch_cat,legacy_cpu", "--bucket-numel", "100000",
        "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result == json.loads(out.read_text())
    assert result["command"] == "flatzero " + " ".join(argv)
    rows = {(r["world_size"], r["method"]): r for r in result["rows"]}
    assert set(rows) == {(ws, m) for ws in (1, 3) for m in ("flatzero", "torch_cat", "legacy_cpu")}
    assert rows[(1, "flatzero")]["tier"] == "cpu"
    for r in rows.values():
        assert r["wall_s"] > 0 and r["x_limit"] > 0 and r["x_first_touch"] > 0
    for ws in ("1", "3"):
        assert {lim["kind"] for lim in result["limits"][ws].values()} == {"memcpy", "first_touch"}
    assert rows[(3, "flatzero")]["x_flatzero"] == 1.0
    assert any("x copy" in line and "x 1st touch" in line for line in lines)
