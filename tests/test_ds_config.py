"""The DeepSpeed config of ``flatzero.initialize``: parsing, DeepSpeed's rules, and the exact
error of every unsupported or inconsistent config (pure: no process group)."""

# ruff: noqa: E501  (the table pins whole error messages)

from __future__ import annotations

import json

import pytest
import torch

from flatzero.config import DEFAULT_BUCKET_NUMEL
from flatzero.deepspeed.engine.config import EngineConfig, parse_config
from flatzero.deepspeed.engine.errors import UnsupportedFeatureError
from flatzero.optim import LossScaleConfig, ZeroConfig

B = {"train_micro_batch_size_per_gpu": 2}

ERRORS = [  # (config, world size, exception, exact message)
    pytest.param(
        {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 3,
            "gradient_accumulation_steps": 1,
        },
        2,
        ValueError,
        "train_batch_size (8) must equal train_micro_batch_size_per_gpu (3) * gradient_accumulation_steps (1) * world size (2) = 6; fix one of them, or give only two and let the third be derived",
        id="inconsistent",
    ),
    pytest.param(
        {"train_batch_size": 2, "gradient_accumulation_steps": 4},
        2,
        ValueError,
        "config: train_micro_batch_size_per_gpu comes out as 0 at world size 2 (train_batch_size=2, train_micro_batch_size_per_gpu=0, gradient_accumulation_steps=4); train_batch_size must be at least train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size",
        id="derived_zero",
    ),
    pytest.param(
        {"gradient_accumulation_steps": 4},
        2,
        ValueError,
        "config needs train_batch_size or train_micro_batch_size_per_gpu (DeepSpeed's rule: train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size); add one of them",
        id="no_batch",
    ),
    pytest.param(
        {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2},
        2,
        ValueError,
        "config key 'train_batch_size' is 'auto': 'auto' is a placeholder that the Hugging Face Trainer fills in before it calls deepspeed.initialize; flatzero.initialize needs the value itself: write the number (or remove the key to take DeepSpeed's default)",
        id="auto",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        },
        1,
        ValueError,
        "config key 'optimizer.params.lr' is 'auto': 'auto' is a placeholder that the Hugging Face Trainer fills in before it calls deepspeed.initialize; flatzero.initialize needs the value itself: write the number (or remove the key to take DeepSpeed's default)",
        id="auto_nested",
    ),
    pytest.param(
        {"train_batch_size": "8"},
        1,
        TypeError,
        "config key 'train_batch_size' must be an integer, got str '8'",
        id="str_int",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": True},
        1,
        TypeError,
        "config key 'train_micro_batch_size_per_gpu' must be an integer, got bool True",
        id="bool_int",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2.5},
        1,
        ValueError,
        "config key 'train_micro_batch_size_per_gpu' is 2.5: it must be a whole number; write an integer",
        id="frac",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 0},
        1,
        ValueError,
        "config key 'gradient_accumulation_steps' is 0: it must be >= 1; use a value >= 1",
        id="zero_neg",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}},
        1,
        ValueError,
        "config key 'zero_optimization.stage' is 3: flatzero implements ZeRO stages 0, 1 and 2; stage 3 (partitioned parameters) is not implemented; use stage 1 or 2, or DeepSpeed itself for stage 3",
        id="stage3",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 5}},
        1,
        ValueError,
        "config key 'zero_optimization.stage' is 5: ZeRO stages are 0, 1, 2 (and 3); use 0, 1 or 2",
        id="stage5",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True, "ratio": 0.3},
            },
        },
        1,
        ValueError,
        "config key 'zero_optimization.offload_optimizer.ratio' is 0.3: flatzero offloads the whole optimizer (ratio 1.0), not part of it; remove ratio (or set it to 1.0), or run DeepSpeed itself",
        id="offload_opt",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}},
        },
        1,
        ValueError,
        "config key 'zero_optimization.offload_param' is {'device': 'nvme'}: it asks to offload the params, which flatzero does not implement; remove it (or set its device to 'none'); flatzero keeps everything on device",
        id="offload_param",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 0, "cpu_offload": True},
        },
        1,
        ValueError,
        "config key 'zero_optimization.cpu_offload.device' is 'cpu': optimizer offload needs ZeRO stage 1 or 2 (zero_optimization.stage is 0); set zero_optimization.stage to 1 or 2, or turn optimizer offload off",
        id="cpu_offload",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8},
        },
        1,
        ValueError,
        "config key 'zero_optimization.zero_hpz_partition_size' is 8: it asks for hierarchical partitioning (ZeRO++), which flatzero does not implement; remove it",
        id="hpz",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2, "zero_quantized_weights": True},
        },
        1,
        ValueError,
        "config key 'zero_optimization.zero_quantized_weights' is True: it asks for quantized weights (ZeRO++), which flatzero does not implement; remove it",
        id="qw",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2, "zero_quantized_gradients": True},
        },
        1,
        ValueError,
        "config key 'zero_optimization.zero_quantized_gradients' is True: it asks for quantized gradients (ZeRO++), which flatzero does not implement; remove it",
        id="qg",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2, "mics_shard_size": 8},
        },
        1,
        ValueError,
        "config key 'zero_optimization.mics_shard_size' is 8: it asks for MiCS, which flatzero does not implement; remove it",
        id="mics",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2, "reduce_bucket_sise": 5},
        },
        1,
        ValueError,
        "config key 'zero_optimization.reduce_bucket_sise' is not a key of 'zero_optimization' that DeepSpeed or flatzero knows (known: stage, reduce_bucket_size, allgather_bucket_size, overlap_comm, contiguous_gradients, offload_optimizer, offload_param, stage3_*, ...); fix its spelling or remove it",
        id="zero_unknown",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "zero_optimization": [2]},
        1,
        TypeError,
        "config key 'zero_optimization' must be a JSON object (dict), got list [2]",
        id="zero_not_dict",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 0},
        },
        1,
        ValueError,
        "config key 'zero_optimization.reduce_bucket_size' is 0: it must be >= 1 (elements); use a value >= 1",
        id="bucket_neg",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "fp16": {"enabled": True}},
        1,
        ValueError,
        "config keys 'fp16.enabled' and 'bf16.enabled' are both true: training runs in one of them; disable one",
        id="both_precisions",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
        },
        1,
        ValueError,
        "config key 'fp16.fp16_master_weights_and_grads' is True: it asks for fp16 master weights, which flatzero does not implement; remove it",
        id="fp16_master",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
        },
        1,
        ValueError,
        "config key 'bf16.bf16_master_weights_and_grads' is True: it asks for bf16 master weights, which flatzero does not implement; remove it",
        id="bf16_master",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True, "enable": True}},
        1,
        ValueError,
        "config key 'bf16.enable' is not a key of 'bf16' that DeepSpeed or flatzero knows (known: bf16_master_weights_and_grads, bf16_optimizer_states, check_grad_overflow, enabled, immediate_grad_update); fix its spelling or remove it",
        id="bf16_unknown",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "fp16": {"enabled": True, "initial_scale_power": 2, "min_loss_scale": 8},
        },
        1,
        ValueError,
        "config key 'fp16.min_loss_scale' is 8.0: it is above the initial scale 2**initial_scale_power = 4; lower min_loss_scale or raise initial_scale_power",
        id="min_scale",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": -1}},
        1,
        ValueError,
        "config key 'fp16.loss_scale' is -1: it must be >= 0; use a value >= 0",
        id="neg_scale",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Lamb"}},
        1,
        ValueError,
        "config key 'optimizer.type' is 'Lamb': flatzero's config optimizers are Adam, AdamW, SGD and Muon; use one of them, or build the optimizer yourself and pass it as flatzero.initialize(optimizer=torch.optim.X(...)) with an elementwise torch.optim class (Adagrad, RMSprop, ...)",
        id="lamb",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "optimizer": {"params": {}}},
        1,
        TypeError,
        "config key 'optimizer.type' must be a string such as 'AdamW', got None",
        id="opt_type",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}},
        },
        1,
        ValueError,
        "config key 'optimizer.params.max_grad_norm' is 1.0: gradient clipping is not an optimizer parameter; use the top-level key 'gradient_clipping'",
        id="max_grad_norm",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"bias_correction": False}},
        },
        1,
        ValueError,
        "config key 'optimizer.params.bias_correction' is False: Adam without bias correction is not available in torch.optim; remove it",
        id="bias_corr",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"momentum": 0.9}},
        },
        1,
        ValueError,
        "config key 'optimizer.params.momentum' is not a key of 'optimizer.params' that DeepSpeed or flatzero knows (known: adam_w_mode, amsgrad, betas, bias_correction, eps, foreach, fp32_optimizer_states, lr, max_grad_norm, torch_adam, weight_decay); fix its spelling or remove it",
        id="opt_unknown",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"betas": 0.9}},
        },
        1,
        ValueError,
        "config key 'optimizer.params.betas' is 0.9: it must be a list of two numbers; e.g. [0.9, 0.999]",
        id="betas",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}},
        },
        1,
        ValueError,
        "config key 'optimizer.params.betas' is not a key of 'optimizer.params' that DeepSpeed or flatzero knows (known: dampening, foreach, lr, max_grad_norm, maximize, momentum, nesterov, weight_decay); fix its spelling or remove it",
        id="sgd_unknown",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "scheduler": {"type": "OneCycle", "params": {}}},
        1,
        ValueError,
        "config key 'scheduler.type' is 'OneCycle': DeepSpeed's OneCycle schedule is not implemented in flatzero (its schedules are WarmupLR, WarmupDecayLR, WarmupCosineLR, plus any torch.optim.lr_scheduler class); use one of those, or pass lr_scheduler= to flatzero.initialize",
        id="onecycle",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "scheduler": {"type": "WarmupLinearLR"}},
        1,
        ValueError,
        "config key 'scheduler.type' is 'WarmupLinearLR': it is neither a DeepSpeed schedule flatzero implements (WarmupLR, WarmupDecayLR, WarmupCosineLR) nor a torch.optim.lr_scheduler class; fix its spelling",
        id="sched_unknown",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}},
        },
        1,
        ValueError,
        "config key 'scheduler.params.warmup_steps' is 10: WarmupLR has no such parameter (it takes warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch); fix its spelling or remove it",
        id="sched_param",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
        },
        1,
        ValueError,
        "config key 'scheduler.params' does not fit WarmupDecayLR: missing a required argument: 'total_num_steps'; it takes total_num_steps, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_epoch",
        id="sched_missing",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": -1.0},
        1,
        ValueError,
        "config key 'gradient_clipping' is -1.0: it must be >= 0; use a value >= 0",
        id="clip_neg",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "communication_data_type": "fp8"},
        1,
        ValueError,
        "config key 'communication_data_type' is 'fp8': it must be one of 'fp32', 'fp16', 'bf16', 'bfp16'; pick one of them",
        id="comm",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "amp": {"enabled": True}},
        1,
        ValueError,
        "config key 'amp' is {'enabled': True}: it asks for apex AMP, which flatzero does not implement; remove it (or set enabled: false)",
        id="amp",
    ),
    pytest.param(
        {
            "train_micro_batch_size_per_gpu": 2,
            "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        },
        1,
        ValueError,
        "config key 'torch_autocast' is {'enabled': True, 'dtype': 'bfloat16'}: it asks for torch autocast, which flatzero does not implement; remove it (or set enabled: false)",
        id="autocast",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "compile": {"deepcompile": True}},
        1,
        ValueError,
        "config key 'compile' is {'deepcompile': True}: it asks for DeepCompile, which flatzero does not implement; remove it (or set deepcompile: false)",
        id="compile",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 2},
        1,
        ValueError,
        "config key 'sequence_parallel_size' is 2: it asks for sequence parallelism, which flatzero does not implement; remove it",
        id="sp",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2}},
        1,
        ValueError,
        "config key 'tensor_parallel' is {'autotp_size': 2}: it asks for tensor parallelism, which flatzero does not implement; remove it",
        id="tp",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "gradient_allreduce_op": "sum"},
        1,
        ValueError,
        "config key 'gradient_allreduce_op' is 'sum': it asks to sum gradients over ranks instead of averaging them, which flatzero does not implement; remove it",
        id="sum",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "managed_gradient_accumulation": False},
        1,
        ValueError,
        "config key 'managed_gradient_accumulation' is False: it asks the caller to own the accumulation boundary, which flatzero does not implement; remove it; engine.step() steps at every gradient_accumulation_steps-th call",
        id="managed",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "flatzero": {"tier": "gpu"}},
        1,
        ValueError,
        "config key 'flatzero.tier' is 'gpu': it must be one of 'auto', 'device', 'host', 'sharded', 'host_park', 'cpu', 'offload'; pick one of them",
        id="fz_unknown",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "flatzero": {"bucket_size": 5}},
        1,
        ValueError,
        "config key 'flatzero.bucket_size' is not a key of 'flatzero' that DeepSpeed or flatzero knows (known: async_save, bucket_numel, check_gradients, device, elementwise_optimizer, host_huge_pages, host_threads, learn_bucket_order, load_fallback, overlap_guard, param_sync, preemption_check_every, preemption_dir, preemption_exit_code, preemption_grace_s, preemption_signals, progress, reduce_staging_buffers, reduce_staging_bytes, staging_buffers, tier); fix its spelling or remove it",
        id="fz_key",
    ),
    pytest.param(
        {"train_micro_batch_size_per_gpu": 2, "flatzero": {"param_sync": "broadcast"}},
        1,
        ValueError,
        "config key 'flatzero.param_sync' is 'broadcast': it must be one of 'gather', 'check', 'none'; pick one of them",
        id="fz_sync",
    ),
]


@pytest.mark.parametrize(("config", "world_size", "error", "message"), ERRORS)
def test_exact_errors(config, world_size, error, message):
    with pytest.raises(error) as info:
        parse_config(config, world_size=world_size)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("given", "world_size", "expected"),
    [
        (
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 4,
            },
            2,
            (16, 2, 4),
        ),
        ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, 2, (16, 2, 4)),
        ({"train_batch_size": 16, "gradient_accumulation_steps": 4}, 2, (16, 2, 4)),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, 2, (16, 2, 4)),
        ({"train_batch_size": 16}, 2, (16, 8, 1)),
        ({"train_micro_batch_size_per_gpu": 3}, 4, (12, 3, 1)),
        (
            {
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 1,
                "gradient_accumulation_steps": 1,
            },
            8,
            (8, 1, 1),
        ),
    ],
)
def test_batch_rule(given, world_size, expected):
    batch = parse_config(given, world_size=world_size).batch
    got = (batch.train_batch_size, batch.micro_batch_per_gpu, batch.gradient_accumulation_steps)
    assert got == expected


def test_issue_7677_config_at_its_world_sizes():
    dsc = {
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 8,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW"},
        "gradient_accumulation_steps": 1,
    }
    cfg = parse_config(dsc, world_size=8)
    assert cfg.zero.stage == 2 and cfg.precision.dtype == "bf16" and cfg.ignored == ()
    assert cfg.flatten_config().dtype == "bfloat16"
    assert cfg.optimizer.torch_class is torch.optim.AdamW
    assert cfg.optimizer.kwargs() == {"weight_decay": 0.0}  # FusedAdam's default, not torch's
    # bf16 checks gradients for inf/nan (DeepSpeed's check_grad_overflow) with a fixed scale 1.
    assert cfg.zero_config().loss_scale == LossScaleConfig(init_scale=1.0, dynamic=False)
    with pytest.raises(ValueError, match=r"\* world size \(2\) = 2"):
        parse_config(dsc, world_size=2)


def test_defaults_and_mapping():
    cfg = parse_config(B, world_size=1)
    assert cfg.zero.stage == 0 and cfg.precision.dtype == "fp32" and cfg.optimizer is None
    assert cfg.gradient_clipping == 1.0 and cfg.steps_per_print is None  # DeepSpeed's defaults
    assert cfg.bucket_numel == DEFAULT_BUCKET_NUMEL
    zc = cfg.zero_config()
    assert zc.stage == 1 and zc.max_grad_norm == 1.0 and zc.loss_scale is None  # stage 0 runs as 1
    assert cfg.flatten_config().dtype is None  # fp32: each param keeps its dtype

    cfg = parse_config(
        {
            **B,
            "zero_optimization": {
                "stage": 1,
                "reduce_bucket_size": 5e8,
                "allgather_bucket_size": 2e8,
            },
            "gradient_clipping": 1.0,
            "communication_data_type": "bf16",
            "flatzero": {"tier": "sharded", "reduce_staging_buffers": 3, "param_sync": "check"},
        },
        world_size=1,
    )
    assert cfg.bucket_numel == 500_000_000
    assert (
        "zero_optimization.allgather_bucket_size",
        "flatzero uses one bucket size (reduce_bucket_size) for both collectives",
    ) in cfg.ignored
    zc = cfg.zero_config()
    assert (zc.stage, zc.max_grad_norm, zc.reduce_dtype, zc.staging_buffers) == (
        1,
        1.0,
        torch.bfloat16,
        3,
    )
    assert cfg.flatten_config().tier == "sharded" and cfg.flatzero.param_sync == "check"
    assert (
        parse_config(
            {
                **B,
                "flatzero": {"bucket_numel": 1024},
                "zero_optimization": {"reduce_bucket_size": 5},
            },
            world_size=1,
        ).bucket_numel
        == 1024
    )
    assert (
        parse_config({**B, "zero_optimization": True}, world_size=1).zero.stage == 1
    )  # legacy form
    assert parse_config({**B, "gradient_clipping": 0.0}, world_size=1).gradient_clipping is None
    assert parse_config({**B, "steps_per_print": None}, world_size=1).steps_per_print is None


@pytest.mark.parametrize(
    ("precision", "comm", "expected"),
    [
        ({}, None, torch.float32),
        ({"bf16": {"enabled": True}}, None, torch.bfloat16),
        ({"fp16": {"enabled": True}}, None, torch.float32),
        ({"fp16": {"enabled": True}}, "fp16", torch.float16),
        ({"bf16": {"enabled": True}}, "fp32", torch.float32),
        ({"fp16": {"enabled": True}}, "bf16", torch.bfloat16),
        ({}, "bfp16", torch.bfloat16),
    ],
)
def test_bf16_gradients_are_summed_in_bf16_unless_communication_data_type_says(
    precision, comm, expected
):
    """As DeepSpeed's engine for bf16 (``communication_data_type()``: the given type, else
    bf16 when enabled): the same config sums the same bytes over the ranks. fp16 sums in
    fp32 unless asked (flatzero divides after the sum, DeepSpeed before it)."""
    config = {**B, "zero_optimization": {"stage": 2}, **precision}
    if comm is not None:
        config["communication_data_type"] = comm
    assert parse_config(config, world_size=2).zero_config().reduce_dtype == expected


def test_fp16_loss_scale_mapping():
    dyn = parse_config(
        {
            **B,
            "fp16": {
                "enabled": True,
                "initial_scale_power": 12,
                "loss_scale_window": 50,
                "hysteresis": 1,
                "min_loss_scale": 2,
            },
        },
        world_size=1,
    )
    assert dyn.precision.dtype == "fp16" and dyn.precision.torch_dtype == torch.float16
    scale = dyn.precision.loss_scale
    assert (
        scale.init_scale,
        scale.growth_interval,
        scale.hysteresis,
        scale.min_scale,
        scale.dynamic,
    ) == (4096.0, 50, 1, 2.0, True)
    assert dyn.ignored == ()
    static = parse_config(
        {**B, "fp16": {"enabled": True, "loss_scale": 128}}, world_size=1
    ).precision.loss_scale
    assert (static.init_scale, static.dynamic) == (128.0, False)
    # DeepSpeed's scaler rule, consecutive_hysteresis included (tests/test_deepspeed_parity.py)
    default = parse_config({**B, "fp16": {"enabled": True}}, world_size=1)
    assert default.ignored == ()
    scale = default.precision.loss_scale
    assert (scale.rule, scale.hysteresis, scale.consecutive_hysteresis) == ("deepspeed", 2, False)
    assert scale.init_scale == 2.0**16
    # Loss-scale keys are validated like DeepSpeed only when fp16 is on.
    assert (
        parse_config(
            {**B, "fp16": {"enabled": False, "min_loss_scale": 0}}, world_size=1
        ).precision.dtype
        == "fp32"
    )
    off = parse_config({**B, "bf16": {"enabled": True, "check_grad_overflow": False}}, world_size=1)
    assert off.precision.loss_scale is None
    legacy = parse_config({**B, "bfloat16": {"enabled": True}}, world_size=1)
    assert legacy.precision.dtype == "bf16"


def test_optimizer_sections():
    def opt(section):
        return parse_config({**B, "optimizer": section}, world_size=1).optimizer

    adam = opt({"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-6}})
    assert adam.torch_name == "AdamW"  # DeepSpeed's Adam is AdamW unless adam_w_mode is false
    assert adam.kwargs() == {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.0}
    assert opt({"type": "adam", "params": {"adam_w_mode": False}}).torch_name == "Adam"
    assert opt({"type": "AdamW", "params": {"adam_w_mode": False}}).torch_name == "AdamW"
    assert opt({"type": "AdamW", "params": {"torch_adam": True}}).kwargs() == {}  # torch's defaults
    sgd = opt({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True}})
    assert sgd.torch_class is torch.optim.SGD and sgd.kwargs() == {
        "lr": 0.1,
        "momentum": 0.9,
        "nesterov": True,
    }
    # Optimizer kwargs are frozen in the config.
    with pytest.raises(TypeError):
        sgd.params["lr"] = 1.0  # type: ignore[index]


def test_scheduler_sections():
    def sched(section):
        return parse_config({**B, "scheduler": section}, world_size=1).scheduler

    s = sched(
        {"type": "WarmupCosineLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}
    )
    assert s.scheduler_class.__name__ == "WarmupCosineLR" and s.kwargs() == {
        "total_num_steps": 100,
        "warmup_num_steps": 10,
    }
    step = sched(
        {"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}}
    )  # torch's, as DeepSpeed allows
    assert step.scheduler_class is torch.optim.lr_scheduler.StepLR


def test_keys_without_effect_are_listed():
    cfg = parse_config(
        {
            **B,
            "wall_clock_breakdown": False,
            "tensorboard": {"enabled": True},
            "amp": {"enabled": False},
            "zero_force_ds_cpu_optimizer": False,
            "zero_optimization": {
                "stage": 2,
                "overlap_comm": False,
                "stage3_max_live_parameters": 1e9,
                "offload_optimizer": {"device": "none"},
            },
            "some_new_deepspeed_key": 1,
        },
        world_size=1,
    )
    assert [k for k, _ in cfg.ignored] == [
        "zero_optimization.overlap_comm",
        "zero_optimization.offload_optimizer",
        "zero_optimization.stage3_max_live_parameters",
        "amp",
        "wall_clock_breakdown",
        "zero_force_ds_cpu_optimizer",
        "tensorboard",
        "some_new_deepspeed_key",
    ]
    assert "some_new_deepspeed_key (unknown key; no effect)" in cfg.ignored_summary()


def _accum(stage: int, value: str, precision: str | None = "bf16") -> dict:
    """A config at ``stage`` with ``data_types.grad_accum_dtype: value`` (and ``precision``
    enabled)."""
    config = {**B, "zero_optimization": {"stage": stage}, "data_types": {"grad_accum_dtype": value}}
    return {**config, precision: {"enabled": True}} if precision else config


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (_accum(1, "fp32"), torch.float32),
        (_accum(2, "fp32"), torch.float32),
        (_accum(0, "torch.float32"), torch.float32),
        (_accum(1, "float", "fp16"), torch.float32),
        (_accum(1, "bf16"), None),  # the training dtype: stage 1 accumulates in it anyway
        (_accum(1, "half", "fp16"), None),
        ({**B, "bf16": {"enabled": True}, "data_types": {}}, None),
    ],
)
def test_grad_accum_dtype_is_honoured(config, expected):
    cfg = parse_config(config, world_size=1)
    assert cfg.zero_optimizer.grad_accum_dtype == expected
    assert not [k for k, _ in cfg.ignored if k.startswith("data_types")]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            _accum(2, "bf16"),
            "config key 'data_types.grad_accum_dtype' is 'bf16': flatzero's ZeRO stage 2 accumulates gradients in the fp32 gradient shard (1/world_size of the model), never in bfloat16; set it to 'fp32' (or remove it)",
        ),
        (
            _accum(1, "fp16"),
            "config key 'data_types.grad_accum_dtype' is 'fp16': flatzero accumulates gradients in fp32 or in the training dtype (bfloat16, from bf16/fp16.enabled), not in float16; set it to 'fp32' (or remove it)",
        ),
        (
            _accum(1, "bf16", None),
            "config key 'data_types.grad_accum_dtype' is 'bf16': flatzero accumulates gradients in fp32 or in the training dtype (float32, from bf16/fp16.enabled), not in bfloat16; set it to 'fp32' (or remove it)",
        ),
    ],
)
def test_grad_accum_dtype_it_cannot_honour_is_refused(config, message):
    with pytest.raises(UnsupportedFeatureError) as info:
        parse_config(config, world_size=1)
    assert str(info.value) == message
    assert info.value.key == "data_types.grad_accum_dtype"


def test_other_data_types_keys_are_listed():
    cfg = parse_config(
        {
            **B,
            "bf16": {"enabled": True},
            "data_types": {"param_dtype": "bf16", "buffer_dtype": "fp32", "new_key": 1},
        },
        world_size=1,
    )
    assert [k for k, _ in cfg.ignored] == ["data_types.param_dtype", "data_types.new_key"]
    assert cfg.buffer_dtype == torch.float32  # buffer_dtype casts the buffers, as DeepSpeed
    assert parse_config({**B, "bf16": {"enabled": True}}, world_size=1).buffer_dtype is None
    keep = {"keep_in_fp32_modules": ["norm"]}
    listed = parse_config({**B, "bf16": {"enabled": True}, "data_types": keep}, world_size=1)
    assert "data_types.keep_in_fp32_modules" in [k for k, _ in listed.ignored]
    both = {**keep, "buffer_dtype": "bf16"}
    with pytest.raises(UnsupportedFeatureError, match="keep_in_fp32_modules"):
        parse_config({**B, "bf16": {"enabled": True}, "data_types": both}, world_size=1)
    with pytest.raises(ValueError, match="it must be one of 'fp32'"):
        parse_config(_accum(1, "int8"), world_size=1)
    with pytest.raises(ValueError, match=r"ZeroConfig\.grad_accum_dtype is torch\.bfloat16"):
        ZeroConfig(grad_accum_dtype=torch.bfloat16)


def test_config_from_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**B, "zero_optimization": {"stage": 2}}))
    assert parse_config(path, world_size=1).zero.stage == 2
    assert parse_config(str(path), world_size=1).zero.stage == 2
    with pytest.raises(ValueError, match=r"missing.json' does not exist .*; pass a dict"):
        parse_config(tmp_path / "missing.json", world_size=1)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        parse_config(tmp_path / "bad.json", world_size=1)
    with pytest.raises(TypeError, match=r"config must be a dict, the path .* got int"):
        parse_config(3, world_size=1)


def test_engine_config_is_frozen():
    cfg = parse_config(B, world_size=1)
    assert isinstance(cfg, EngineConfig)
    with pytest.raises(AttributeError):
        cfg.gradient_clipping = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.source["x"] = 1  # type: ignore[index]


def test_flatzero_section_is_derived_from_the_dataclasses():
    import dataclasses
    from pathlib import Path

    from flatzero import FlattenConfig, ZeroConfig
    from flatzero.deepspeed.engine.config import FLATZERO_KEYS, FlatzeroSection
    from flatzero.deepspeed.engine.config.flatzero_section import SET_ELSEWHERE

    # Every field of the three dataclasses is a key of the section or set by another key.
    for owner in (FlattenConfig, ZeroConfig, FlatzeroSection):
        keyed = {k.field for k in FLATZERO_KEYS if k.owner is owner}
        elsewhere = {name for cls, name in SET_ELSEWHERE if cls is owner}
        assert keyed | elsewhere == {f.name for f in dataclasses.fields(owner)}, owner
        assert not keyed & elsewhere
    # Defaults are the dataclasses' own, and every key is documented here and in the docs.
    cfg = parse_config(B, world_size=1)
    built = {FlattenConfig: cfg.flatten, ZeroConfig: cfg.zero_optimizer}
    built[FlatzeroSection] = cfg.flatzero
    door = (Path(__file__).parents[1] / "docs" / "deepspeed-door.md").read_text()
    for key in FLATZERO_KEYS:
        assert getattr(built[key.owner], key.field) == key.default, key.key
        assert key.doc, key.key
        assert f"`{key.key}`" in door, key.key
    # Each key lands in its dataclass.
    given = {
        "tier": "cpu",
        "bucket_numel": 4096,
        "device": "cpu",
        "host_threads": 1,
        "host_huge_pages": False,
        "staging_buffers": 3,
        "progress": False,
        "reduce_staging_buffers": 4,
        "reduce_staging_bytes": 2**20,
        "learn_bucket_order": False,
        "check_gradients": True,
        "overlap_guard": True,
        "param_sync": "none",
        "elementwise_optimizer": True,
        "load_fallback": "newest_valid",
        "async_save": True,
        "preemption_dir": "ckpt",
        "preemption_signals": "SIGUSR1",
        "preemption_grace_s": 100,
        "preemption_check_every": 5,
        "preemption_exit_code": 99,
    }
    assert {k.key for k in FLATZERO_KEYS} == set(given)
    cfg = parse_config({**B, "flatzero": given}, world_size=1)
    built = {FlattenConfig: cfg.flatten, ZeroConfig: cfg.zero_optimizer}
    built[FlatzeroSection] = cfg.flatzero
    for key in FLATZERO_KEYS:
        assert getattr(built[key.owner], key.field) == given[key.key], key.key
    with pytest.raises(TypeError, match=r"'flatzero\.host_threads' must be an integer, got str"):
        parse_config({**B, "flatzero": {"host_threads": "2"}}, world_size=1)
    with pytest.raises(TypeError, match=r"'flatzero\.device' must be a string, got 0"):
        parse_config({**B, "flatzero": {"device": 0}}, world_size=1)


def test_flatzero_tier_offload_is_the_old_name_of_host_park():
    """``"flatzero": {"tier": "offload"}`` (the ``host_park`` tier's old name) keeps
    working: the flatten config names ``host_park``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # once per process: maybe seen already
        cfg = parse_config(
            {"train_micro_batch_size_per_gpu": 2, "flatzero": {"tier": "offload"}}, world_size=1
        )
        assert cfg.flatten_config().tier == "host_park"
