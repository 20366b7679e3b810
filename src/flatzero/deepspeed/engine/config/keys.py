"""Which DeepSpeed keys flatzero accepts without effect, and which it refuses.

A refused key is an ``UnsupportedFeatureError`` when its value asks for the feature
(``Refusal.active``), and a key without effect otherwise. The tables are read in order,
which is the order the keys appear in ``EngineConfig.ignored``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = [
    "ADAM_KEYS",
    "DATA_TYPES_NO_EFFECT",
    "SGD_KEYS",
    "STAGE3_KEYS",
    "TOP_NO_EFFECT",
    "TOP_REFUSED",
    "ZERO_MAIN_KEYS",
    "ZERO_NO_EFFECT",
    "ZERO_REFUSED",
    "Refusal",
]


# [Note: the three kinds of keys, and user errors.
# Every key falls in one of three kinds:
#
# - implemented: parsed, validated and used (batch sizes, ``zero_optimization`` stage 0-2
#   and bucket sizes, ``bf16``, ``fp16``, ``optimizer``, ``scheduler``,
#   ``gradient_clipping``, ``steps_per_print``, ``communication_data_type``, the
#   ``flatzero`` section);
# - without effect here: accepted and listed in ``EngineConfig.ignored`` (monitors,
#   profilers, stage-3 tuning keys under stage 1/2, switches flatzero always has on, ...);
#   ``initialize`` logs them once in one warning;
# - asking for something DeepSpeed has and flatzero does not implement (stage 3, NVMe or param
#   offload, quantized or hierarchical ZeRO, torch autocast, pipeline or tensor parallelism,
#   optimizer types other than Adam/AdamW/SGD, ...): an ``UnsupportedFeatureError`` (a
#   ``ValueError``) naming the key, its value and the fix; ``flatzero.patch_deepspeed()`` hands
#   such configs to the real DeepSpeed.
#
# Everything else that is wrong is a user error (``ValueError``/``TypeError``): an unknown key
# inside a section flatzero parses (as DeepSpeed's own validation does), a bad type or value,
# inconsistent batch sizes, and any ``"auto"`` value where a value has an effect (``"auto"``
# is the Hugging Face Trainer's placeholder; the Trainer replaces it before it calls
# ``deepspeed.initialize``). ``steps_per_print`` may be ``inf`` (Accelerate's "never").]
class Refusal(NamedTuple):
    """A key naming a DeepSpeed feature flatzero does not implement.

    Attributes:
        key: the key in its section.
        active: whether a value asks for the feature.
        what: ``"it asks for X"``, as the error says it.
        fix: what to do instead.
    """

    key: str
    active: Callable[[Any], bool]
    what: str
    fix: str


def _enabled(value: Any) -> bool:
    """A feature section (``{"enabled": true, ...}``) or flag that is switched on."""
    if isinstance(value, Mapping):
        return bool(value.get("enabled", False))
    return bool(value)


def _compile_on(value: Any) -> bool:
    if isinstance(value, Mapping):
        return bool(value.get("deepcompile", False)) or bool(value.get("enabled", False))
    return bool(value)


def _offload_active(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, Mapping):
        return str(value.get("device", "none")).lower() not in ("none", "")
    return bool(value)


_OFF = "remove it (or set enabled: false)"
_OFFLOAD_FIX = "remove it (or set its device to 'none'); flatzero keeps everything on device"
"""The fix of ``offload_param`` (ZeRO-3 in DeepSpeed); the optimizer's offload is parsed by
``offload.parse_offload_optimizer``."""

TOP_REFUSED: tuple[Refusal, ...] = (
    Refusal("amp", _enabled, "it asks for apex AMP", _OFF),
    Refusal("torch_autocast", _enabled, "it asks for torch autocast", _OFF),
    Refusal("elasticity", _enabled, "it asks for elastic training", _OFF),
    Refusal("autotuning", _enabled, "it asks for autotuning", _OFF),
    Refusal("hybrid_engine", _enabled, "it asks for the hybrid engine", _OFF),
    Refusal("data_efficiency", _enabled, "it asks for data efficiency", _OFF),
    Refusal("curriculum_learning", _enabled, "it asks for curriculum learning", _OFF),
    Refusal("eigenvalue", _enabled, "it asks for eigenvalue computation", _OFF),
    Refusal("progressive_layer_drop", _enabled, "it asks for progressive layer drop", _OFF),
    Refusal("nebula", _enabled, "it asks for Nebula checkpointing", _OFF),
    Refusal("quantize_training", _enabled, "it asks for quantized training", _OFF),
    Refusal(
        "compile", _compile_on, "it asks for DeepCompile", "remove it (or set deepcompile: false)"
    ),
    Refusal(
        "sequence_parallel_size",
        lambda v: v not in (None, 1),
        "it asks for sequence parallelism",
        "remove it",
    ),
    Refusal(
        "tensor_parallel",
        lambda v: isinstance(v, Mapping) and v.get("autotp_size", 0) not in (0, 1),
        "it asks for tensor parallelism",
        "remove it",
    ),
    Refusal(
        "gradient_allreduce_op",
        lambda v: v != "mean",
        "it asks to sum gradients over ranks instead of averaging them",
        "remove it",
    ),
    Refusal(
        "managed_gradient_accumulation",
        lambda v: v is not True,
        "it asks the caller to own the accumulation boundary",
        "remove it; engine.step() steps at every gradient_accumulation_steps-th call",
    ),
    Refusal("compression_training", bool, "it asks for compression training", "remove it"),
    Refusal("sparse_attention", bool, "it asks for sparse attention", "remove it"),
    Refusal("weight_quantization", bool, "it asks for weight quantization", "remove it"),
)
"""Top-level keys refused when they ask for their feature."""

TOP_NO_EFFECT: Mapping[str, str] = {
    "wall_clock_breakdown": "no timers",
    "memory_breakdown": "no memory logging",
    "dump_state": "no effect",
    "zero_allow_untested_optimizer": "any elementwise torch.optim optimizer is allowed",
    "zero_force_ds_cpu_optimizer": "no DeepSpeed CPU optimizer",
    "tensorboard": "no monitors",
    "wandb": "no monitors",
    "csv_monitor": "no monitors",
    "comet": "no monitors",
    "aim": "no monitors",
    "comms_logger": "no comms logging",
    "flops_profiler": "no profiler",
    "timers": "no timers",
    "checkpoint": "flatzero's checkpoint format is fixed",
    "activation_checkpointing": "applies to deepspeed.checkpointing only",
    "aio": "no NVMe offload",
    "prescale_gradients": "gradients are summed, then divided once",
    "gradient_predivide_factor": "gradients are summed, then divided once",
    "sparse_gradients": "no effect",
    "disable_allgather": "no effect",
    "seq_parallel_communication_data_type": "no sequence parallelism",
    "use_data_before_expert_parallelism": "no expert parallelism",
    "use_node_local_storage": "no effect",
    "disable_python_gc": "no effect",
    "graph_harvesting": "no effect",
    "zero_optimization_stage": "no effect",
    "train_micro_batch_size_per_device": "no effect",
    "log_level": "no effect",
    "pipeline": "no pipeline parallelism",
}
"""Top-level keys accepted without effect, and why."""

DATA_TYPES_NO_EFFECT: Mapping[str, str] = {
    "param_dtype": "params take the bf16/fp16 training dtype",
}
"""``data_types`` keys accepted without effect (``grad_accum_dtype``, ``buffer_dtype`` and
``keep_in_fp32_modules`` are parsed), and why."""

ZERO_REFUSED: tuple[Refusal, ...] = (
    Refusal("offload_param", _offload_active, "it asks to offload the params", _OFFLOAD_FIX),
    Refusal("cpu_offload_param", bool, "it asks to offload the params", _OFFLOAD_FIX),
    Refusal(
        "zero_hpz_partition_size",
        lambda v: v not in (0, 1),
        "it asks for hierarchical partitioning (ZeRO++)",
        "remove it",
    ),
    Refusal("mics_shard_size", lambda v: v not in (-1, 0, None), "it asks for MiCS", "remove it"),
    Refusal(
        "mics_hierarchical_params_gather",
        bool,
        "it asks for MiCS hierarchical gather",
        "remove it",
    ),
    Refusal("zero_quantized_weights", bool, "it asks for quantized weights (ZeRO++)", "remove it"),
    Refusal(
        "zero_quantized_gradients", bool, "it asks for quantized gradients (ZeRO++)", "remove it"
    ),
    Refusal("zenflow", lambda v: v is not None, "it asks for ZenFlow", "remove it"),
    Refusal("legacy_stage1", bool, "it asks for DeepSpeed's legacy stage 1", "remove it"),
)
"""``zero_optimization`` keys refused when they ask for their feature."""

ZERO_NO_EFFECT: Mapping[str, str] = {
    "reduce_scatter": "flatzero always reduce-scatters",
    "allgather_partitions": "flatzero always all-gathers updated buckets",
    "use_multi_rank_bucket_allreduce": "no effect",
    "round_robin_gradients": "no effect",
    "load_from_fp32_weights": "checkpoints always hold fp32 master weights",
    "elastic_checkpoint": "checkpoints always load at any world size",
    "compute_grad_norm": "the norm is computed when clipping or loss scaling needs it",
    "parameter_alignment": "params are always aligned to 64 elements",
    "save_muon_momentum_buffer_in_memory": "no Muon",
    "ratio": "no offload",
}
"""``zero_optimization`` keys accepted without effect, and why."""

STAGE3_KEYS = (
    "stage3_prefetch_bucket_size",
    "prefetch_bucket_size",
    "stage3_param_persistence_threshold",
    "param_persistence_threshold",
    "stage3_model_persistence_threshold",
    "model_persistence_threshold",
    "stage3_max_live_parameters",
    "max_live_parameters",
    "stage3_max_reuse_distance",
    "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save",
    "gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "stage3_module_granularity_threshold",
    "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params",
    "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential",
    "allgather_sequential",
    "sub_group_size",
    "memory_efficient_linear",
    "override_module_apply",
    "leaf_module",
    "log_trace_cache_warnings",
    "enable_sanity_checks",
    "pipeline_loading_checkpoint",
    "zero_quantized_nontrainable_weights",
)
"""``zero_optimization`` keys of stage 3 only: without effect at stages 0-2."""

ZERO_MAIN_KEYS = (
    "stage",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "contiguous_gradients",
    "offload_optimizer",
    "offload_param",
    "stage3_*",
)
"""The ``zero_optimization`` keys an unknown-key error lists."""

ADAM_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")
"""``optimizer.params`` of Adam/AdamW passed on to ``torch.optim``."""

SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
"""``optimizer.params`` of SGD passed on to ``torch.optim``."""
