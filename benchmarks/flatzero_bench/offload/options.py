"""The ``flatzero bench offload`` options (no torch: see ``common.options``)."""

from __future__ import annotations

import argparse

from flatzero_bench.offload.offload_kernel import DEFAULT_KERNEL_METHODS, KERNEL_METHODS

__all__ = ["HELP", "PARTS", "STEP_METHODS", "add_arguments"]

HELP = "Offload benchmark: ZeRO-Offload (offload_optimizer: {device: cpu}), flatzero vs DeepSpeed."
"""The benchmark's line in ``flatzero bench --help``."""

PARTS = ("kernel", "step", "init", "memory")
"""What ``--what`` chooses from: the benchmark's parts."""

STEP_METHODS = ("flatzero-offload", "deepspeed-offload", "deepspeed-offload-torch", "flatzero")
"""The step part's methods (``offload_step``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flatzero bench offload`` options."""
    parser.add_argument(
        "--what", default=",".join(PARTS), help=f"comma-separated of {', '.join(PARTS)}"
    )
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1,2")
    parser.add_argument("--runs", type=int, default=2, help="repeats of every part's launches")
    parser.add_argument("--numel", type=int, default=50_000_000, help="kernel: fp32 elements")
    parser.add_argument(
        "--kernel-threads",
        help="kernel: comma-separated thread counts (default: a rank's share of the cores at "
        "each world size)",
    )
    parser.add_argument("--kernel-steps", type=int, default=20, help="kernel: timed steps")
    parser.add_argument("--kernel-warmup", type=int, default=3, help="kernel: untimed steps")
    parser.add_argument(
        "--kernel-methods",
        default=",".join(DEFAULT_KERNEL_METHODS),
        help=f"kernel: comma-separated of {', '.join(KERNEL_METHODS)} (default: "
        f"{','.join(DEFAULT_KERNEL_METHODS)}; torch's foreach and single-tensor AdamW allocate "
        "param-sized temporaries every step, which slowed the others in the same process "
        "by up to 40 %% at 1 thread: run them in a launch of their own)",
    )
    parser.add_argument(
        "--no-build",
        action="store_true",
        help="kernel: skip timing DeepSpeed's cpu_adam JIT build (use the default "
        "TORCH_EXTENSIONS_DIR)",
    )
    parser.add_argument(
        "--extensions-dir",
        help="a TORCH_EXTENSIONS_DIR where DeepSpeed's cpu_adam is built already (no build "
        "timed); default: the kernel part's fresh one, else the default directory",
    )
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2], help="ZeRO stage")
    parser.add_argument(
        "--bucket-numel", type=int, default=2**26, help="reduce/all-gather bucket elements"
    )
    parser.add_argument("--step-model", default="llama-22m", help="step: a bench step model")
    parser.add_argument(
        "--step-dtype", default="bf16", choices=["bf16", "fp32"], help="dtype of the step's params"
    )
    parser.add_argument("--step-batch", type=int, default=1, help="step: sequences per rank")
    parser.add_argument("--step-seq", type=int, default=16, help="step: tokens per sequence")
    parser.add_argument("--step-warmup", type=int, default=2, help="step: untimed steps")
    parser.add_argument(
        "--communication-data-type",
        choices=["bf16", "fp32"],
        help="step: the config's communication_data_type, both doors (default: unset; "
        "each door then reduces bf16 gradients in bf16, as DeepSpeed does)",
    )
    parser.add_argument("--step-steps", type=int, default=10, help="step: timed steps")
    parser.add_argument(
        "--step-methods",
        default=",".join(STEP_METHODS),
        help=f"step: comma-separated of {', '.join(STEP_METHODS)}",
    )
    parser.add_argument("--init-model", default="llama-0.4b", help="init, memory: the model")
    parser.add_argument("--init-trials", type=int, default=1, help="init: launches per door")
    parser.add_argument("--init-warmup", type=int, default=1, help="init: untimed launches")
    parser.add_argument("--init-seq", type=int, default=2, help="init: tokens per step")
    parser.add_argument("--init-steps", type=int, default=2, help="init: steps after init")
    parser.add_argument(
        "--settle-s",
        type=float,
        default=6.0,
        help="init, memory: seconds to pause before every launch (the machine takes freed "
        "memory back: every init writes cold memory); 0: back to back",
    )
    parser.add_argument("--no-deepspeed", action="store_true", help="skip DeepSpeed")
    parser.add_argument("--workdir", help="where temporary directories go (default: the system's)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per child process")
    parser.add_argument("--json", help="also write the result JSON to this path")
