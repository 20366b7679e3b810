"""The command lines ``flatzero import-deepspeed`` and ``flatzero export-deepspeed``: a run
that prints one line of what it wrote (their options: ``flatzero.checkpoint_options``)."""

from __future__ import annotations

import argparse

from ..engine.config import load_config_dict
from .incoming import from_deepspeed
from .outgoing import to_deepspeed

__all__ = ["export_main", "import_main"]


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
