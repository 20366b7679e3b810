"""Smoke test of ``flatzero bench offload`` at tiny sizes (no DeepSpeed: seconds)."""

from __future__ import annotations

import json

from flatzero.cli import _function, _parser


def test_offload_kernel_launch_in_process_and_its_table(capsys, monkeypatch):
    """One kernel launch's body (``offload_kernel.main``, here in this process: the
    command runs it as a child with OMP_NUM_THREADS set) and the command's summary."""
    from flatzero_bench.offload import offload_bench, offload_kernel

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what main sets, undone after the test
    argv = ["--threads", "1", "--numel", "4096", "--steps", "2", "--warmup", "1"]
    assert offload_kernel.main([*argv, "--methods", "flatzero,torch_foreach,torch_single"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    rec = json.loads(line.removeprefix(offload_kernel.MARKER))
    rows = {r["method"]: r for r in offload_bench._kernel_rows([rec])}
    assert set(rows) == {"flatzero", "torch_foreach", "torch_single"}
    for row in rows.values():
        assert row["steps"] == 2 and row["step_s_median"] > 0 and row["x_deepspeed"] is None
        # The same AdamW over the same tensor and gradients: the same result, to rounding.
        assert row["param_max_abs_diff"] < 1e-6
    assert rows["flatzero"]["fused"] is True  # the host step runs torch's fused CPU kernel
    assert "torch_single" in offload_bench._kernel_table(list(rows.values()), 4096)
    args = _parser().parse_args(["bench", "offload", "--what", "kernel,step", "--no-deepspeed"])
    assert _function(args.run) is offload_bench.run  # "module:run", imported when it runs


def test_offload_step_methods_train_alike_in_process():
    """The step part's rank function at world size 1 (no process group, no DeepSpeed)."""
    from flatzero_bench.offload import offload_step

    spec = offload_step.OffloadStepSpec(
        model="tiny", dtype="bf16", methods=("flatzero-offload", "flatzero"), stage=2,
        batch=1, seq=8, warmup=0, steps=2, bucket_numel=2**20,
    )  # fmt: skip
    rows = offload_step.summarize(1, [offload_step.rank_main(0, 1, spec)], spec)
    assert [r["method"] for r in rows] == ["flatzero-offload", "flatzero"]
    for row in rows:
        assert row["timed_steps"] == 2 and row["step_s"] > 0 and row["x_baseline"] is None
        # Offload or not, on the host the same computation: the same losses.
        assert row["loss_max_abs_diff"] == 0.0
    assert "flatzero-offload" in offload_step.table(rows)


def test_offload_init_and_memory_figures_from_launch_records():
    """The init and memory parts' summaries of (synthetic) launch records: the plan's
    formula for the tiny model beside the bytes recorded."""
    import argparse

    from flatzero.plan.model_source import resolve_model
    from flatzero_bench.offload import offload_bench

    def launch(door, run, init_s, gain, phases=True):
        rank = {
            "init_s": init_s, "init_cpu_s": init_s, "step_s": [0.5, 0.4], "loss": [1.0, 0.9],
            "rss_before_bytes": 10**9, "rss_step_bytes": [0, 10**9 + gain],
            "peak_rss_bytes": 10**9 + 2 * gain, "optimizer": door, "inner_optimizer": "x",
            "model_bytes": 2 * 10**6,
            "offload_host_bytes": {"master": 1, "grads": 1, "state": 2, "pinned": 0},
            "held_gradient_peak_bytes": 2**19,
        }  # fmt: skip
        if phases:  # each phase's high-water mark, per step
            rank["peak_rss_phase_bytes"] = {
                "forward": [10**9 + gain, 10**9 + gain],
                "backward": [10**9 + 3 * gain, 10**9 + 2 * gain],
                "step": [10**9 + gain, 10**9 + 2 * gain],
            }
        rec = {"door": door, "world_size": 1, "ranks": [rank], "run": run, "trial": 0}
        return rec | {"slowest": offload_bench._slowest(rec)}

    launches = [launch(d, run, s, 2**20) for run in range(2)
                for d, s in (("flatzero", 1.0), ("deepspeed", 4.0))]  # fmt: skip
    rows = offload_bench._init_rows(launches, ("flatzero", "deepspeed"))
    assert rows[0]["x_deepspeed_init"]["median"] == 0.25 and rows[1]["init_s"] == 4.0
    args = argparse.Namespace(world_sizes=[1], init_model="tiny", stage=2, bucket_numel=2**26)
    memory = offload_bench._memory(args, {"launches": launches}, None)
    (row,) = memory["rows"]
    assert row["rss_gain_bytes"] == 2**20 and row["launches"] == 2
    assert row["formula"]["total"] == row["formula"]["master"] * 4  # AdamW: 4 + 8 + 4 bytes
    assert "/ exp + lg" in offload_bench._memory_table(memory)
    formula = row["formula"]["total"]
    expected = formula + row["other_bytes"]
    assert row["phase_peak_gain_bytes"] == {"forward": 2**20, "backward": 3 * 2**20, "step": 2**21}
    assert row["step_peak_over_formula"] == 2**21 / formula
    assert row["backward_peak_over_formula"] == 3 * 2**20 / formula
    assert row["backward_peak_over_formula_plus_other"] == 3 * 2**20 / expected
    assert row["held_gradient_peak_bytes"] == 2**19
    tiny = resolve_model("tiny").config  # its largest: the embedding and lm_head, bf16
    assert row["largest_gradient_bytes"] == tiny.vocab_size * tiny.hidden_size * 2
    assert row["backward_peak_over_plan"] == 3 * 2**20 / (expected + row["largest_gradient_bytes"])
    # launch records from before the phases were recorded: the whole-span peak alone
    old = [launch(d, 0, s, 2**20, phases=False) for d, s in (("flatzero", 1.0),)]
    (row,) = offload_bench._memory(args, {"launches": old}, None)["rows"]
    assert row["phase_peak_gain_bytes"] is None and row["step_peak_over_formula"] is None
    assert row["peak_over_formula"] == 2**21 / formula
    assert "peak" in offload_bench._memory_table({"rows": [row]})
