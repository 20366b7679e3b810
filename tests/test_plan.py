"""``flatzero plan``: its memory and bytes models against what the code really does.

- memory: the prediction equals what ``flatten_parameters`` and ``ZeroOptimizer`` allocate
  (buckets, fp32 master and gradient shards, stage 1 flat gradients, staging, optimizer
  state after one step), read back from the objects, at world sizes 1, 2 and 3 (gloo);
- bytes: the prediction equals ``InitReport.bytes_moved`` on every rank for every tier
  that runs on the CPU, and ``bench.baselines``' counts for DeepSpeed's two paths;
- the tier ``auto`` takes for given free memory equals ``flatten.choice.choose_tier``'s;
- inputs: an HF ``config.json`` (and a model directory) gives the params transformers
  builds; the DeepSpeed #7677 shape plans at 8 and 1 GPUs with consistent figures;
- calibration plumbing: measured rates reach the time model, which scales with them.

Sizes are chosen so that nothing divides evenly: params are not multiples of the 64-element
alignment, buckets not multiples of the world size, an embedding is bigger than a bucket.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from pathlib import Path

import pytest
import torch

from flatzero import FlattenConfig, flatten_parameters
from flatzero.cores import usable_cores
from flatzero.launch import run_ranks
from flatzero.layout import plan_layout
from flatzero.measure.baselines import flatten_legacy_cpu, flatten_torch_cat
from flatzero.models import LlamaConfig, Qwen3MoeConfig, build_model, save_model_safetensors
from flatzero.optim import ZeroConfig, ZeroOptimizer
from flatzero.plan import (
    Calibration,
    PlanSpec,
    format_plan,
    get_gpu,
    make_plan,
    model_states,
    resolve_model,
)
from flatzero.plan.calibration import measure_fresh_write
from flatzero.plan.cli import spec_from_args
from flatzero.plan.model_source import ModelSource, group_dicts, param_groups
from flatzero.plan.options import add_arguments
from flatzero.plan.planner import huge_pages_advice, new_memory_sizes
from flatzero.plan.traffic import deepspeed_bytes, deepspeed_master_bytes, flatzero_bytes
from flatzero.storage.index import SafetensorsCheckpoint
from plan_fixtures import calibration as _calibration

LLAMA = LlamaConfig(
    vocab_size=97,
    hidden_size=40,
    intermediate_size=72,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=10,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
MOE = Qwen3MoeConfig(
    vocab_size=53,
    hidden_size=24,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=6,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    moe_intermediate_size=10,
    num_experts=5,
    num_experts_per_tok=2,
    expert_layout="unfused",
)
BUCKET = 3001  # the 97 x 40 embedding gets a bucket of its own
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-3}),
    "sgd": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
}
# (model, dtype, grouping, stage, optimizer)
STATE_CASES = [
    ("llama", "fp32", "decay", 2, "adamw"),
    ("llama", "bf16", "one", 2, "sgd"),
    ("llama", "fp32", "one", 1, "adagrad"),
    ("llama", "bf16", "decay", 1, "adamw"),
    ("moe", "bf16", "decay", 2, "adamw"),
]
TIERS = ("device", "host", "sharded", "host_park", "cpu")


def _source(name: str) -> ModelSource:
    return ModelSource(name, LLAMA if name == "llama" else MOE, tie_embeddings=name == "llama")


def _layout(name: str, dtype: str, grouping: str, world_size: int):
    groups = param_groups(_source(name), str(DTYPES[dtype]).removeprefix("torch."), grouping)
    return plan_layout(groups, world_size=world_size, bucket_numel=BUCKET)


def _model(name: str, dtype: str):
    source = _source(name)
    return build_model(
        source.config,
        device="cpu",
        dtype=DTYPES[dtype],
        seed=1,
        tie_embeddings=source.tie_embeddings,
    )


def _measured_states(opt: ZeroOptimizer) -> dict[str, int]:
    """What the optimizer really holds, read back from its objects."""
    buckets = {b.data_ptr(): b.nbytes for g in opt.flat.groups for b in g.buckets}
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {
        "params": sum(buckets.values()),
        "master": sum(m.nbytes for m in opt.master_shards),
        "grad_shards": sum(g.nbytes for g in opt.grad_shards),
        "gradients": opt.gradient_bytes(),
        "optimizer": sum(t.nbytes for t in state),
    }


def _check_states(rank: int, world_size: int) -> list[str]:
    """Build and step every ``STATE_CASES`` entry; return the mismatches."""
    errors = []
    for name, dtype, grouping, stage, optimizer in STATE_CASES:
        model = _model(name, dtype)
        cls, kwargs = OPTIMIZERS[optimizer]
        opt = ZeroOptimizer(
            group_dicts(model, grouping),
            cls,
            stage=stage,
            config=ZeroConfig(),
            flatten_config=FlattenConfig(device="cpu", bucket_numel=BUCKET, progress=False),
            **kwargs,
        )
        ids = torch.randint(
            0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(rank)
        )
        model(ids, labels=ids).loss.backward()
        opt.step()
        predicted = model_states(
            _layout(name, dtype, grouping, world_size),
            stage=stage,
            optimizer=optimizer,
            host_gloo=True,  # CPU ranks on gloo: stage 1 stages its fp32 buckets too
        )
        expected = {
            k: getattr(predicted, k)
            for k in ("params", "master", "grad_shards", "gradients", "optimizer")
        }
        got = _measured_states(opt)
        if got != expected:
            errors.append(
                f"rank {rank} {name}/{dtype}/{grouping}/{stage}/{optimizer}: {got} != {expected}"
            )
        opt.close()
    return errors


def _check_bytes(rank: int, world_size: int, checkpoint: str | None) -> list[str]:
    """Flatten in every tier (and from a checkpoint); compare ``bytes_moved``."""
    errors = []
    for tier in TIERS:
        for dtype, grouping in (("bf16", "decay"), ("fp32", "one")):
            model = _model("llama", dtype)
            config = FlattenConfig(tier=tier, device="cpu", bucket_numel=BUCKET, progress=False)
            flat = flatten_parameters(group_dicts(model, grouping), config=config)
            layout = _layout("llama", dtype, grouping, world_size)
            want = flatzero_bytes(layout, tier, rank, params_on="host", buffers_on="cpu")
            if flat.report.bytes_moved != want:
                errors.append(f"rank {rank} {tier}/{dtype}: {flat.report.bytes_moved} != {want}")
    if checkpoint is not None:
        for tier in ("sharded", "host", "cpu"):
            meta = build_model(MOE, device="meta", dtype=torch.bfloat16)
            config = FlattenConfig(tier=tier, device="cpu", bucket_numel=BUCKET, progress=False)
            flat = flatten_parameters(
                meta, config=config, checkpoint=SafetensorsCheckpoint(checkpoint)
            )
            layout = plan_layout(
                param_groups(_source("moe"), "bfloat16"), world_size=world_size, bucket_numel=BUCKET
            )
            want = flatzero_bytes(layout, tier, rank, params_on="checkpoint", buffers_on="cpu")
            if flat.report.bytes_moved != want:
                errors.append(f"rank {rank} checkpoint/{tier}: {flat.report.bytes_moved} != {want}")
    return errors


def _rank_main(rank: int, world_size: int, checkpoint: str) -> list[str]:
    return _check_states(rank, world_size) + _check_bytes(rank, world_size, checkpoint)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("plan") / "moe.safetensors"
    save_model_safetensors(build_model(MOE, device="cpu", dtype=torch.bfloat16, seed=2), path)
    return str(path)


def test_predictions_match_one_rank(moe_checkpoint):
    """World size 1, no process group: memory and bytes equal the prediction."""
    assert _rank_main(0, 1, moe_checkpoint) == []


@pytest.mark.parametrize("world_size", [2, 3])
def test_predictions_match_every_rank(world_size, moe_checkpoint):
    """Every rank's memory and bytes equal the prediction for that rank (gloo)."""
    errors = run_ranks(_rank_main, world_size, moe_checkpoint, timeout_s=120)
    assert [e for rank_errors in errors for e in rank_errors] == []


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_deepspeed_bytes_match_baselines(world_size, dtype):
    """DeepSpeed's two paths: predicted bytes equal what ``bench.baselines`` counts."""
    elt = DTYPES[dtype].itemsize
    for rank in range(world_size):
        for algorithm, path in (
            (flatten_torch_cat, "deepspeed_device"),
            (flatten_legacy_cpu, "deepspeed_legacy"),
        ):
            groups = [
                [p for _, p in g["params"]] for g in group_dicts(_model("moe", dtype), "decay")
            ]
            result = algorithm(groups, rank=rank, world_size=world_size, device="cpu")
            numels = [g.param_numel for g in _layout("moe", dtype, "decay", world_size).groups]
            assert tuple(numels) == result.group_numel
            moved = deepspeed_bytes(numels, elt, rank, world_size, path=path)
            master = sum(deepspeed_master_bytes(n, elt, rank, world_size) for n in numels)
            assert result.paths == (("device",) if path == "deepspeed_device" else ("host",)) * 2
            assert sum(moved.values()) == result.bytes_moved
            assert master == result.master_bytes


@pytest.mark.parametrize("params_on", ["device", "host"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_auto_tier_agrees_with_choose_tier(params_on, world_size, monkeypatch):
    """For every free-memory value around the thresholds, the planner's decision is the
    library's ``choose_tier`` (run with its free-memory measurement stubbed)."""
    import flatzero.memory as memory
    from flatzero.flatten import choice

    sizes = {"largest_bucket_bytes": 300, "total_bytes": 1000, "shard_bytes": 120}
    thresholds = {0, 120, 420, 1120}
    for free in sorted({t + d for t in thresholds for d in (-1, 0, 1)} - {-1}):
        monkeypatch.setattr(memory, "free_bytes", lambda device, free=free: free)
        for device_type in ("cuda", "cpu"):
            mine = choice.decide_tier(
                "auto",
                params_on=params_on,
                device_type=device_type,
                world_size=world_size,
                min_free=free,
                **sizes,
            )
            try:
                theirs = choice.choose_tier(
                    "auto",
                    params_on=params_on,
                    device=torch.device(device_type),
                    world_size=world_size,
                    group=None,
                    **sizes,
                ).tier
            except MemoryError:
                theirs = None
            assert mine.tier == theirs, (free, device_type)


def _hf_config(kind: str) -> dict:
    common = {
        "vocab_size": 61,
        "hidden_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
    }
    if kind == "llama":
        return {
            "model_type": "llama",
            "intermediate_size": 40,
            "tie_word_embeddings": True,
            **common,
        }
    return {
        "model_type": "qwen3_moe",
        "head_dim": 8,
        "moe_intermediate_size": 12,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 40,
        **common,
    }


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_hf_config_gives_the_params_transformers_builds(kind, tmp_path):
    """A config.json (file or directory) plans the params transformers would build."""
    data = _hf_config(kind)
    (tmp_path / "config.json").write_text(json.dumps(data))
    for text in (str(tmp_path / "config.json"), str(tmp_path)):
        source = resolve_model(text)
        specs = {(s.name, s.shape) for g in param_groups(source, "bfloat16") for s in g}
        assert source.tie_embeddings == (kind == "llama")
        transformers = pytest.importorskip("transformers")
        config = transformers.AutoConfig.for_model(**data)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(config)
        assert specs == {(n, tuple(p.shape)) for n, p in hf.named_parameters()}
    plan = make_plan(PlanSpec(model=source, gpus_per_node=2, gpu=get_gpu("a100-80g")))
    assert plan.layout.param_numel == sum(p.numel() for p in hf.parameters())


def test_hf_config_refuses_what_it_cannot_model(tmp_path, monkeypatch):
    """Without transformers, a family the zoo does not map is refused by its model type
    (with transformers it plans: tests/test_plan_models.py)."""
    import flatzero.plan.model_source as model_source

    monkeypatch.setattr(model_source, "transformers_available", lambda: False)
    data = {**_hf_config("llama"), "model_type": "gpt2"}
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported .* without trans"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="neither"):
        resolve_model(str(tmp_path / "missing.json"))


@functools.cache
def _issue_7677(gpus: int, gpu: str = "h100"):
    """DeepSpeed #7677: Qwen3-30B-A3B cut to 16 layers, transformers 4.x (unfused experts),
    ``AutoModel`` (no lm_head), bf16, ZeRO-2, AdamW, params loaded in host memory."""
    source = resolve_model("qwen3-30b-a3b", layers=16, expert_layout="unfused", with_lm_head=False)
    return make_plan(PlanSpec(model=source, gpus_per_node=gpus, gpu=get_gpu(gpu)))


def test_issue_7677_shape_at_eight_gpus():
    plan = _issue_7677(8)
    meta = build_model(plan.spec.model.config, with_lm_head=False)
    assert plan.layout.num_params == len(list(meta.parameters()))
    assert plan.layout.param_numel == sum(p.numel() for p in meta.parameters())
    buckets = sum(g.numel for g in plan.layout.groups) * 2
    assert plan.states.params == buckets and plan.states.master * 8 == buckets * 2
    assert plan.decision.tier == "sharded"
    sharded = plan.methods["sharded"].bytes_moved
    assert sharded["h2d"] * 8 == buckets  # each rank uploads its slice of every bucket
    assert sharded["all_gather"] == buckets - sharded["h2d"]
    assert plan.methods["host"].bytes_moved["h2d"] == buckets
    assert plan.deepspeed_019[0] == "deepspeed_device"
    device_path = plan.methods["deepspeed_device"]
    assert device_path.memory.device_peak >= 2 * plan.layout.param_numel * 2  # the 2x peak
    times = {name: m.time.seconds for name, m in plan.methods.items()}
    assert times["sharded"] < times["deepspeed_device"] < times["deepspeed_legacy"]
    assert plan.states.total < plan.free_bytes


def test_issue_7677_shape_at_one_gpu():
    """At one GPU the init needs master and gradient shards of the whole model: more than
    an 80 GB GPU has, so #7677's one-GPU run needed a bigger one (an H200 fits)."""
    small, big = _issue_7677(1), _issue_7677(1, "h200")
    assert small.decision.tier is None and big.decision.tier == "host"
    assert small.methods["deepspeed_device"].memory.device_peak > small.free_bytes
    assert big.methods["deepspeed_device"].memory.device_peak <= big.free_bytes
    assert big.methods["host"].bytes_moved["all_gather"] == 0


def test_calibration_reaches_the_time_model():
    """A CPU job's predicted init is its new bytes at the calibrated rates, each rank with
    its share of the cores (4 cores, 2 ranks: 2 threads each, half the node's rate)."""
    source = _source("llama")
    plans = [
        make_plan(
            PlanSpec(
                model=source,
                gpus_per_node=2,
                gpu=None,
                bucket_numel=BUCKET,
                calibration=_calibration(scale),
            )
        )
        for scale in (1.0, 2.0)
    ]
    rates = plans[0].rates
    assert (rates.first_touch_gbps, rates.host_cast_gbps) == (1.0, 0.75)
    assert rates.origin["first_touch"] == "measured"
    layout = plans[0].layout
    buckets = sum(g.numel for g in layout.groups) * 2
    master = sum(g.shard_numel for g in layout.groups) * 4
    want = buckets / 1.0e9 + master / 0.75e9
    assert plans[0].methods["cpu"].time.seconds == pytest.approx(want, rel=1e-12)
    # DeepSpeed's buffers come from torch's allocator, every core of the node shared by
    # its ranks: 4 and 3 GB/s over 2 ranks; a copy of the flat buffer, a clone of this
    # rank's partition, then its fp32 cast.
    assert (rates.device_copy_gbps, rates.cast_gbps) == (2.0, 1.5)
    assert rates.all_cores_first_touch_gbps == 2.0
    params = [g.param_numel for g in layout.groups]
    partition = sum(deepspeed_master_bytes(n, 2, 0, 2) for n in params) // 6  # 2 + 4 bytes
    device = plans[0].methods["deepspeed_device"].time.phases
    assert device["cat"] == pytest.approx(sum(params) * 2 / 2.0e9, rel=1e-12)
    assert device["master"] == pytest.approx(partition * 2 / 2.0e9 + partition * 4 / 1.5e9)
    for name in ("cpu", "deepspeed_device", "deepspeed_legacy"):
        assert plans[1].methods[name].time.seconds == pytest.approx(
            plans[0].methods[name].time.seconds / 2, rel=1e-12
        )


def test_a_calibration_without_the_plain_rates_uses_flatzeros_for_them():
    """A calibration written before torch's allocator was measured (the committed result
    of an earlier benchmark) still loads; the plan then takes flatzero's new-memory rates
    for both allocators. A bench result with one calibration per world size is refused by
    name."""
    results = Path(__file__).parents[1] / "benchmarks" / "results"
    old = Calibration.from_dict(json.loads((results / "plan_cpu_llama-0.4b_cold.json").read_text()))
    assert old.plain_first_touch_gbps is None and old.ranks == 1
    rates = make_plan(
        PlanSpec(
            model=_source("llama"), gpus_per_node=2, gpu=None, bucket_numel=BUCKET,
            calibration=old,
        )
    ).rates  # fmt: skip
    assert (rates.device_copy_gbps, rates.cast_gbps) == (
        old.first_touch_gbps / 2,
        old.cast_gbps / 2,
    )
    new = json.loads((results / "plan_cpu_llama-0.4b_settled10.json").read_text())
    with pytest.raises(ValueError, match="one calibration per world size"):
        Calibration.from_dict(new)
    assert Calibration.from_dict(new["calibrations"]["2"]).ranks == 2


def test_a_calibration_in_the_jobs_shape_is_used_as_measured():
    """New-memory rates measured with as many processes as the node has ranks give each
    rank the node's rate over its ranks; measured in another shape, a rank gets its threads
    at the one-thread rate, capped by its share of the node's."""
    source = _source("llama")
    slow_thread = dataclasses.replace(
        _calibration(), thread_first_touch_gbps=0.1, thread_cast_gbps=0.05
    )

    def rates(ranks: int, measured_with: int):
        calibration = dataclasses.replace(slow_thread, ranks=measured_with)
        spec = PlanSpec(
            model=source,
            gpus_per_node=ranks,
            gpu=None,
            bucket_numel=BUCKET,
            calibration=calibration,
        )
        r = make_plan(spec).rates
        return r.first_touch_gbps, r.host_cast_gbps

    # 4 cores; the node writes 2 GB/s (copy) and casts 1.5 GB/s; one thread 0.1 and 0.05.
    assert rates(4, measured_with=4) == (2 / 4, 1.5 / 4)
    assert rates(2, measured_with=2) == (2 / 2, 1.5 / 2)
    assert rates(2, measured_with=1) == pytest.approx((0.1 * 2, 0.05 * 2))
    assert rates(4, measured_with=2) == pytest.approx((0.1, 0.05))
    with pytest.raises(ValueError, match="ranks"):
        dataclasses.replace(_calibration(), ranks=5)


def test_concurrent_calibration_fails_fast_when_a_process_fails():
    """A process of a concurrent measurement that runs out of memory fails the measurement
    at once on the caller, naming the error, and leaves no process waiting behind it."""
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"calibration process failed.*allocate"):
        measure_fresh_write(1 << 50, 1, processes=2, passes=1)
    assert time.monotonic() - t0 < 120
    assert measure_fresh_write(2**20, 1, processes=2, passes=1) > 0


def test_calibrate_measures_at_the_jobs_sizes_in_its_shape(monkeypatch):
    """``flatzero plan --calibrate`` measures new memory at the job's largest bucket and
    master shard, with one process per rank (at most the cores), after ``--settle-s``."""
    import flatzero.plan.cli as plan_cli

    seen = {}

    def fake_measure(**kwargs):
        seen.update(kwargs)
        return _calibration()

    monkeypatch.setattr(plan_cli, "measure", fake_measure)
    args = _plan_args(
        "--model", "tiny", "--gpu", "none", "--gpus-per-node", "2", "--calibrate",
        "--settle-s", "7",
    )  # fmt: skip
    spec = spec_from_args(args)
    assert spec.calibration == _calibration()
    want = new_memory_sizes(make_plan(dataclasses.replace(spec, calibration=None)))
    assert seen == {"ranks": min(2, usable_cores()), "settle_s": 7.0, **want}


def test_host_huge_pages_off_plans_with_torchs_allocator_and_advice_follows_the_rates():
    """``host_huge_pages=False`` gives the ``cpu`` tier torch's new-memory rates; the plan
    advises the other allocator when its predicted init is a quarter faster or more, and
    nothing when they are close."""
    source = _source("llama")

    def plan(calibration: Calibration, huge_pages: bool):
        spec = PlanSpec(
            model=source, gpus_per_node=2, gpu=None, bucket_numel=BUCKET,
            calibration=calibration, host_huge_pages=huge_pages,
        )  # fmt: skip
        return make_plan(spec)

    cal = _calibration()  # 2 MiB pages: 2 / 1.5 GB/s; torch's allocator: 4 / 3 GB/s
    off = plan(cal, False)
    assert (off.rates.first_touch_gbps, off.rates.host_cast_gbps) == (4 / 2, 3 / 2)
    on = plan(cal, True)
    assert on.methods["cpu"].time.seconds > off.methods["cpu"].time.seconds
    assert "host_huge_pages=False" in huge_pages_advice(on)
    assert "host_huge_pages=False" in format_plan(on)
    assert huge_pages_advice(off) == ""
    # The advice weighs the whole predicted init (buckets and master), not one rate.
    faster_huge = dataclasses.replace(cal, plain_first_touch_gbps=0.5, plain_cast_gbps=0.5)
    assert "host_huge_pages=True" in huge_pages_advice(plan(faster_huge, False))
    assert huge_pages_advice(plan(faster_huge, True)) == ""
    close = dataclasses.replace(cal, plain_first_touch_gbps=2.2, plain_cast_gbps=1.6)
    assert huge_pages_advice(plan(close, True)) == huge_pages_advice(plan(close, False)) == ""
    args = _plan_args("--model", "tiny", "--gpu", "none", "--no-host-huge-pages")
    assert spec_from_args(args).host_huge_pages is False
    assert spec_from_args(_plan_args("--model", "tiny")).host_huge_pages is True


def test_calibration_sizes_are_the_jobs_bucket_and_master_shard():
    """``--calibrate`` writes new memory at the sizes the job does: its largest bucket and
    its fp32 master shard."""
    plan = make_plan(
        PlanSpec(model=_source("llama"), gpus_per_node=3, gpu=None, bucket_numel=BUCKET)
    )
    sizes = new_memory_sizes(plan)
    buckets = [b.numel * 2 for g in plan.layout.groups for b in g.buckets]
    assert sizes == {
        "fill_bytes": max(buckets),
        "cast_bytes": 4 * sum(g.shard_numel for g in plan.layout.groups),
    }


def test_without_an_accelerator_deepspeed_concatenates_in_host_memory():
    """On CPUs only DeepSpeed's device path is its CPU accelerator's: the reason says so
    (no free device memory figure to compare)."""
    plan = make_plan(
        PlanSpec(model=_source("llama"), gpus_per_node=2, gpu=None, bucket_numel=BUCKET)
    )
    path, why = plan.deepspeed_019
    assert path == "deepspeed_device"
    assert why.startswith("no accelerator") and "GiB free" not in why


def _plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_calibration_file_and_host_bandwidth_reach_the_plan(tmp_path, capsys):
    from flatzero.cli import main

    path = tmp_path / "cal.json"
    path.write_text(json.dumps(_calibration().to_dict()))
    assert Calibration.from_dict(json.loads(path.read_text())) == _calibration()
    assert (
        main(
            [
                "plan",
                "--model",
                "tiny",
                "--gpu",
                "none",
                "--gpus-per-node",
                "2",
                "--calibration",
                str(path),
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["rates"]["first_touch_gbps"] == 1.0 and data["calibration"]["cast_gbps"] == 1.5
    spec = spec_from_args(
        _plan_args("--model", "tiny", "--host-bandwidth", "64", "--gpus-per-node", "4")
    )
    assert make_plan(spec).rates.host_copy_gbps == 64 / 4


def test_info_measure_writes_a_calibration(tmp_path, capsys):
    from flatzero.cli import main

    path = tmp_path / "cal.json"
    ranks = min(2, usable_cores())
    argv = ["info", "--measure", "--measure-mib", "4", "--fill-mib", "8", "--ranks", str(ranks)]
    assert main([*argv, "--json", str(path)]) == 0
    cal = Calibration.from_dict(json.loads(path.read_text()))
    assert (
        cal.memcpy_gbps > 0
        and cal.cast_gbps > 0
        and cal.plain_first_touch_gbps > 0
        and (cal.fill_bytes, cal.cast_bytes, cal.ranks) == (8 * 2**20, 4 * 2**20, ranks)
        and set(cal.tensor_seconds) == {"flatzero", "torch_cat", "legacy_cpu"}
    )
    assert "cast" in capsys.readouterr().out


def test_plan_cli_table_and_json(tmp_path, capsys):
    from flatzero.cli import main

    out = tmp_path / "plan.json"
    argv = [
        "plan",
        "--model",
        "qwen3-moe-narrow-unfused",
        "--nodes",
        "2",
        "--gpus-per-node",
        "4",
        "--gpu",
        "h200",
        "--stage",
        "1",
        "--grad-accum",
        "4",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["auto"]["tier"] == "sharded" and "flatzero auto -> sharded" in text
    assert data["spec"]["world_size"] == 8
    step = data["step"]
    # stage 1 reduces once per step whatever the accumulation; 2 nodes: a NIC carries 1/4
    assert step["reduce_scatter_bytes"] == step["all_gather_bytes"] * 2  # fp32 vs bf16
    assert step["network_bytes"] == (step["reduce_scatter_bytes"] + step["all_gather_bytes"]) // 4
    assert main([*argv[:-2], "--reduce-dtype", "bf16", "--json", str(out)]) == 0
    capsys.readouterr()
    summed_in_bf16 = json.loads(out.read_text())["step"]
    assert summed_in_bf16["reduce_scatter_bytes"] == step["all_gather_bytes"]  # bf16 both ways
    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "neither" in capsys.readouterr().err
