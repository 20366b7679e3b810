"""``flatzero bench device-memory`` on the emulated accelerator: its columns are the
device's counters, and they show what the design promises."""

from __future__ import annotations

import json

from flatzero.cli import main
from flatzero.models import build_model
from flatzero_bench.init.init_bench import MODELS


def test_device_memory_bench_fills_the_memory_columns(capsys):
    bucket = 65536
    assert main(["bench", "device-memory", "--device", "emu", "--model", "tiny",
                 "--world-sizes", "1", "--bucket-numel", str(bucket)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    rows = {(r["params_on"], r["method"]): r for r in result["rows"]}
    model_bytes = result["model"]["model_bytes"]
    # flatzero: at most one bucket in flight (a param larger than a bucket is a bucket of
    # its own; bf16: 2 bytes an element) on top of what it keeps; DeepSpeed's torch.cat:
    # the whole model beside the originals.
    largest = max(p.numel() for p in build_model(MODELS["tiny"](), device="meta").parameters())
    largest_bucket = (max(bucket, largest) + 63) // 64 * 64 * 2
    assert rows["device", "flatzero"]["transient_bytes"] <= largest_bucket
    assert rows["device", "torch_cat"]["transient_bytes"] >= model_bytes
    assert rows["host", "flatzero"]["tier"] == "host"
    assert rows["host", "flatzero"]["moved"]["h2d"] == model_bytes
    assert "transient MiB" in out
