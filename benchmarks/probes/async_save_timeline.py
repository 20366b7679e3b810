"""Where an asynchronous save's time goes while one rank trains: a timeline.

One process (gloo, world size 1), the checkpoint benchmark's model and optimizer
(``bench.checkpoint_bench.build``), one step, a first asynchronous save (its buffer's first
touch) and its steps, then ``SAVES`` timed saves. Each is followed by ``STEPS`` steps and
``wait_for_save``; the background thread's stages are stamped by wrapping the functions
that run them (nothing in flatzero changes): the snapshot landed, the rank file written,
the checksums ready, ``meta.json`` written and published. Printed per save: seconds
from the call to each stamp, each step's seconds and the wait at the end.

    PYTHONPATH=benchmarks python benchmarks/probes/async_save_timeline.py \\
        DIR [MODEL] [STEPS] [SAVES]
"""

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from flatzero.checkpoint import (
    SaveConfig,
    async_save,
    atomic,
    collect,
    save,
    save_checkpoint,
    writer,
)
from flatzero.checkpoint.checkpointer import wait_for_save
from flatzero_bench.checkpoint.checkpoint_bench import CheckpointSpec, build, train_step

STAMPS: dict[str, float] = {}


def stamped(module, name: str, label: str) -> None:
    """Wrap ``module.name`` so that its end is stamped as ``label``."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        out = original(*args, **kwargs)
        STAMPS.setdefault(label, time.perf_counter())
        return out

    setattr(module, name, wrapper)


def main() -> None:
    directory = Path(sys.argv[1])
    model_name = sys.argv[2] if len(sys.argv) > 2 else "llama-0.4b"
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    saves = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    dist.init_process_group("gloo", rank=0, world_size=1)
    spec = CheckpointSpec(
        model=model_name, dtype="bf16", trials=1, warmup=0, methods=("async",),
        bucket_numel=2**24, seq=16, steps=steps, workdir=str(directory),
    )  # fmt: skip
    model, opt = build(spec)
    train_step(model, opt, spec, 0)
    landed = async_save.Staging.fence

    def fence(self):
        landed(self)
        STAMPS.setdefault("fence done", time.perf_counter())

    async_save.Staging.fence = fence
    stamped(writer, "write_image", "rank file written")
    stamped(async_save.Hasher, "sums", "checksums taken")
    stamped(save.Save, "_write_images", "files written")
    stamped(save, "mark", "marked")
    stamped(save, "collect_marks", "marks collected")
    stamped(collect.Collected, "meta", "meta made")
    stamped(atomic.StagedDirectory, "publish", "renamed")
    stamped(save, "write_latest", "latest written")
    stamped(save, "_prune", "pruned")
    stamped(save.Save, "_publish_here", "published")
    config = SaveConfig(overwrite=True, keep_last=1)
    for index in range(saves + 1):
        STAMPS.clear()
        t0 = time.perf_counter()
        save_checkpoint(directory / "ckpt", opt, f"probe{index}", config=config, asynchronous=True)
        seconds = []
        for i in range(steps):
            s0 = time.perf_counter()
            train_step(model, opt, spec, i)
            seconds.append(time.perf_counter() - s0)
        w0 = time.perf_counter()
        wait_for_save(opt)
        end = time.perf_counter()
        marks = ", ".join(
            f"{k} {v - t0:.2f}" for k, v in sorted(STAMPS.items(), key=lambda x: x[1])
        )
        print(f"save {index}{' (first)' if index == 0 else ''}: {marks}; steps end {w0 - t0:.2f}")
        print(f"  steps {[round(s, 2) for s in seconds]}; wait at the end {end - w0:.2f} s")
        os.sync()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
