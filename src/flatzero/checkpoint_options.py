"""The options of ``flatzero export``, ``import-deepspeed`` and ``export-deepspeed``:
argument definitions only, with no torch behind them, so that ``--help`` and an argument
error answer at once (each command imports its module when it runs)."""

from __future__ import annotations

import argparse

from .cli_types import MAX_WORLD_SIZE, count, parse_size
from .layout import DEFAULT_BUCKET_NUMEL
from .progress import add_progress_argument

__all__ = [
    "EXPORT_DTYPES",
    "add_export_arguments",
    "add_export_deepspeed_arguments",
    "add_import_deepspeed_arguments",
]

EXPORT_DTYPES = ("fp32", "fp16", "bf16", "saved")
"""``flatzero export --dtype``: ``checkpoint.config.EXPORT_DTYPES`` (the short dtype names,
then ``saved``), spelled here without torch; a test keeps the two equal."""


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``flatzero export CHECKPOINT OUT_DIR``."""
    parser.add_argument("checkpoint", help="checkpoint directory (its latest) or a checkpoint")
    parser.add_argument("out_dir", help="output directory for model*.safetensors")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument(
        "--dtype",
        choices=EXPORT_DTYPES,
        default="bf16",
        help="dtype of the weights (from the fp32 masters); 'saved': the training dtype",
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=5 * 10**9,
        help="bytes per file at most, e.g. 5GB (default), 500MiB",
    )
    parser.add_argument(
        "--include-tied", action="store_true", help="also write tied params under second names"
    )
    parser.add_argument(
        "--no-rest", action="store_true", help="leave out frozen params and buffers"
    )
    parser.add_argument("--verify", action="store_true", help="check rank file checksums first")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    add_progress_argument(parser)


def add_import_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``flatzero import-deepspeed DS_DIR OUT_DIR``."""
    parser.add_argument("ds_dir", help="DeepSpeed checkpoint directory (with latest) or a tag")
    parser.add_argument("out_dir", help="flatzero checkpoint directory to write")
    parser.add_argument("--tag", default=None, help="DeepSpeed tag (default: its latest)")
    parser.add_argument("--out-tag", default=None, help="flatzero tag (default: DeepSpeed's)")
    parser.add_argument(
        "--world-size",
        type=count(1, MAX_WORLD_SIZE),
        default=None,
        help="ranks of the written layout (default: DeepSpeed's; loads at any world size)",
    )
    parser.add_argument(
        "--bucket-numel",
        type=count(1, 2**40),
        default=DEFAULT_BUCKET_NUMEL,
        help="bucket size of the written layout, in elements",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing tag")
    add_progress_argument(parser)


def add_export_deepspeed_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``flatzero export-deepspeed CKPT OUT --world-size N``."""
    parser.add_argument("checkpoint", help="flatzero (or Trainer/Accelerate) checkpoint dir")
    parser.add_argument("out_dir", help="DeepSpeed checkpoint directory to write")
    parser.add_argument(
        "--world-size",
        type=count(1, MAX_WORLD_SIZE),
        required=True,
        help="data-parallel ranks of the DeepSpeed run",
    )
    parser.add_argument("--tag", default=None, help="flatzero tag (default: its latest)")
    parser.add_argument("--out-tag", default=None, help="DeepSpeed tag (default: the same)")
    parser.add_argument(
        "--ds-config",
        default=None,
        help="the DeepSpeed run's config (JSON): checked, and its clipping, fp16 loss-scaler "
        "keys and ZeRO layout options written as DeepSpeed would; the optimizer state is "
        "written for the optimizer it makes DeepSpeed build (Adam/AdamW: FusedAdam, "
        "DeepSpeedCPUAdam with offload_optimizer, torch's with torch_adam; no optimizer "
        "section: the checkpoint's torch.optim class, a client optimizer). Without it: "
        "DeepSpeed's default for the checkpoint's optimizer (FusedAdam for Adam/AdamW, "
        "the torch.optim class for others)",
    )
    parser.add_argument(
        "--any-optimizer",
        action="store_true",
        help="export an optimizer other than torch.optim's elementwise ones",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace what exists in OUT")
    add_progress_argument(parser)
