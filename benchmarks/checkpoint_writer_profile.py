"""Where an asynchronous save's time goes, one rank, no training steps (issue 24).

Builds the benchmark model (``flatzero bench checkpoint``'s ``build``: ZeRO-2 AdamW, one
step taken), then for each mode given (``async``, ``sync``) saves twice in a row and prints,
per save, the call's wall and CPU seconds and the background write's wall and CPU seconds
(the main thread only waits in ``wait_for_save``, so the process's CPU seconds then are the
writer thread's). Run it with ``PYTHONPATH`` pointing at two checkouts to compare versions:

    PYTHONPATH=<checkout>/src python benchmarks/checkpoint_writer_profile.py llama-0.4b async sync

``flatzero bench checkpoint --what writer`` measures the same for the current code.
"""

import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

import torch.distributed as dist

from flatzero.checkpoint import SaveConfig, save_checkpoint
from flatzero.checkpoint.checkpointer import wait_for_save
from flatzero_bench.checkpoint import checkpoint_bench as cb

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29731")
dist.init_process_group("gloo", rank=0, world_size=1)
fields = {f.name for f in dataclasses.fields(cb.CheckpointSpec)}
values = dict(model=sys.argv[1], dtype="bf16", world_size=1, trials=1, warmup=0,
              methods=("async",), bucket_numel=2**24, seq=16, steps=1,
              workdir="/tmp/ck")  # fmt: skip
spec = cb.CheckpointSpec(**{k: v for k, v in values.items() if k in fields})
model, opt = cb.build(spec)
t = time.perf_counter()
cb.train_step(model, opt, spec, 0)
print("step", round(time.perf_counter() - t, 2))
root = Path(spec.workdir) / "profile"
shutil.rmtree(root, ignore_errors=True)
for mode in sys.argv[2:]:
    for i in range(2):
        t0, c0 = time.perf_counter(), time.process_time()
        config = SaveConfig(overwrite=True, keep_last=1)
        save_checkpoint(root, opt, f"t{i}", config=config, asynchronous=mode == "async")
        t1, c1 = time.perf_counter(), time.process_time()
        wait_for_save(opt)
        t2, c2 = time.perf_counter(), time.process_time()
        print(
            mode, i, f"call wall {t1 - t0:.2f} cpu {c1 - c0:.2f}; "
            f"background wall {t2 - t1:.2f} cpu {c2 - c1:.2f}", flush=True,
        )  # fmt: skip
dist.destroy_process_group()
shutil.rmtree(root, ignore_errors=True)
