"""Host memory a ``save_16bit_model`` adds (docs/checkpoints.md, "save_16bit_model").

``PYTHONPATH=src python benchmarks/probes/save_16bit_memory.py`` writes
``benchmarks/results/save_16bit_memory_cpu_llama-116m.json``: one rank, a Llama of 4 layers,
hidden 1024, vocabulary 32000 in bf16 (cpu tier, 8 Mi-element buckets, so the largest
bucket is the embedding's own, 62.5 MiB), one training step, then the peak resident set a
save adds (``VmHWM`` reset before it, so the figure is the save's own) for
``pytorch_model.bin`` and ``model.safetensors``: written from the buffers as on the CPU,
with every block copied to the host as from a device, and, for scale, what the save did
before (a clone of the whole state dict, then ``torch.save``). Median of 3 saves each.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

OUT = Path(__file__).parents[1] / "results" / "save_16bit_memory_cpu_llama-116m.json"
NAMES = ("pytorch_model.bin", "model.safetensors")
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 8 * 2**20},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "flatzero": {"progress": False},
}


def added(save) -> int:
    """Peak RSS the call ``save()`` adds over the RSS before it, in bytes."""
    from flatzero.procmem import peak_rss_bytes, reset_peak_rss, rss_bytes, trim_host_memory

    trim_host_memory()
    assert reset_peak_rss(), "this kernel cannot reset VmHWM"
    before = rss_bytes()
    save()
    return peak_rss_bytes() - before


def rank_main(rank: int, world_size: int) -> dict:
    import flatzero
    from flatzero.deepspeed.engine import weights16
    from flatzero.models import build_model, count_params, scaled

    config = scaled(
        "llama-3-8b", layers=4, hidden=1024, heads=8, kv_heads=8, intermediate=2816, vocab=32000
    )
    model = build_model(config, device="cpu", dtype=torch.bfloat16)
    engine, *_ = flatzero.initialize(model=model, config=CONFIG)
    ids = torch.randint(0, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    state_bytes = sum(t.nbytes for t in model.state_dict().values())
    rows = []
    with tempfile.TemporaryDirectory() as out:
        host = weights16._in_host_memory
        for copied in (False, True):
            weights16._in_host_memory = (lambda tensor: False) if copied else host
            for name in NAMES:
                gains = [added(lambda n=name: engine.save_16bit_model(out, n)) for _ in range(3)]
                rows.append(
                    {
                        "method": "copied" if copied else "buffers",
                        "file": name,
                        "added_bytes": gains,
                    }
                )
        weights16._in_host_memory = host

        def before() -> None:
            clone = {k: v.detach().clone() for k, v in model.state_dict().items()}
            torch.save(clone, os.path.join(out, "before.bin"))

        rows.append(
            {
                "method": "clone_then_torch_save",
                "file": "pytorch_model.bin",
                "added_bytes": [added(before) for _ in range(3)],
            }
        )
    for row in rows:
        row["added_mib_median"] = statistics.median(row["added_bytes"]) / 2**20
    largest = max(b.nbytes for g in engine.optimizer.flat.groups for b in g.buckets)
    engine.destroy()
    return {
        "params": count_params(model),
        "state_dict_bytes": state_bytes,
        "largest_bucket_bytes": largest,
        "rows": rows,
    }


def main() -> None:
    from flatzero.launch import run_ranks

    load = os.getloadavg()
    result = run_ranks(rank_main, 1, timeout_s=600)[0]
    result.update(
        probe="save_16bit_memory",
        command="PYTHONPATH=src python benchmarks/probes/save_16bit_memory.py",
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        machine={
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "load_average_before": load,
            "load_average_after": os.getloadavg(),
        },
    )
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["rows"]:
        print(f"{row['method']:<22} {row['file']:<18} {row['added_mib_median']:7.1f} MiB")


if __name__ == "__main__":
    main()
