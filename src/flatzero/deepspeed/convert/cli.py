"""The command lines ``flatzero import-deepspeed`` and ``flatzero export-deepspeed``: their
arguments, and a run that prints one line of what it wrote."""

from __future__ import annotations

import argparse

from ...cli_types import MAX_WORLD_SIZE, count
from ...config import DEFAULT_BUCKET_NUMEL
from ...progress import add_progress_argument
from ..engine.config import load_config_dict
from .incoming import from_deepspeed
from .outgoing import to_deepspeed

__all__ = ["add_export_arguments", "add_import_arguments", "export_main", "import_main"]


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
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


def import_main(args: argparse.Namespace) -> int:
    """Run ``flatzero import-deepspeed``; returns the exit status (``flatzero.cli.main``
    turns an error in the input into one line and exit status 2)."""
    path = from_deepspeed(
        args.ds_dir,
        args.out_dir,
        tag=args.tag,
        out_tag=args.out_tag,
        world_size=args.world_size,
        bucket_numel=args.bucket_numel,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(f"wrote flatzero checkpoint {path}")
    return 0


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
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


def export_main(args: argparse.Namespace) -> int:
    """Run ``flatzero export-deepspeed``; returns the exit status (``flatzero.cli.main``
    turns an error in the input into one line and exit status 2). ``--ds-config`` is read
    with the DeepSpeed door's reader (JSON or hjson, base64; duplicate keys refused)."""
    ds_config = None if args.ds_config is None else load_config_dict(args.ds_config)
    result = to_deepspeed(
        args.checkpoint,
        args.out_dir,
        world_size=args.world_size,
        tag=args.tag,
        out_tag=args.out_tag,
        ds_config=ds_config,
        any_optimizer=args.any_optimizer,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    print(
        f"wrote DeepSpeed ZeRO-{result.stage} checkpoint {result.path} for "
        f"{result.world_size} ranks ({len(result.files)} files"
        + (f"; copied {', '.join(result.copied)}" if result.copied else "")
        + f") in {result.seconds:.1f} s"
    )
    return 0
