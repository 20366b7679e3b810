"""A small model zoo built from real configs without downloads: dense Llama and Qwen3-MoE
(fused or unfused experts), with HF parameter names, a deterministic init, a real forward,
and safetensors save/load.
"""

from .config import EXPERT_LAYOUTS, LlamaConfig, ModelConfig, Qwen3MoeConfig
from .llama import LlamaForCausalLM
from .materialize import INIT_STD, materialize
from .qwen3_moe import Qwen3MoeForCausalLM
from .safetensors_io import load_model_safetensors, save_model_safetensors
from .stats import count_bytes, count_params, count_tensors
from .transformer import IGNORE_INDEX, CausalLM, CausalLMOutput
from .zoo import PRESETS, build_model, get_preset, scaled

__all__ = [
    "EXPERT_LAYOUTS",
    "IGNORE_INDEX",
    "INIT_STD",
    "PRESETS",
    "CausalLM",
    "CausalLMOutput",
    "LlamaConfig",
    "LlamaForCausalLM",
    "ModelConfig",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    "build_model",
    "count_bytes",
    "count_params",
    "count_tensors",
    "get_preset",
    "load_model_safetensors",
    "materialize",
    "save_model_safetensors",
    "scaled",
]
