"""``flatzero.initialize`` (the DeepSpeed door) on an accelerator, and the seam's promises:
any backend with a device module, a device-only collective backend, no device call
outside ``flatzero.accel``."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import torch

import flatzero
from flatzero import accel
from flatzero.launch import run_ranks
from flatzero.testing.emulated import install
from test_engine import ds_config, make_model  # tests/ is on sys.path

from .harness import launch, packed, this_device, unpacked

STEPS = 4
SEQ = 12


def _batch(step: int, rank: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (2, SEQ), generator=g)


def _initialize_worker(rank: int, world_size: int, kind: str) -> dict:
    """Train a tiny Llama through ``flatzero.initialize`` with ZeRO-2, buckets on ``kind``."""
    device = torch.device("cpu") if kind == "cpu" else this_device(kind)
    model = make_model().to(device)
    config = ds_config(2, world_size, gradient_accumulation_steps=1)
    config["train_batch_size"] = 2 * world_size
    config["train_micro_batch_size_per_gpu"] = 2
    engine, _, _, _ = flatzero.initialize(model=model, config=config)
    accel.reset_peak_memory_stats(device)
    losses = []
    for _ in range(STEPS):
        ids = _batch(0, rank, model.config.vocab_size).to(device)  # one batch, learned
        loss = engine(ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {
        "losses": losses,
        "buckets_on": sorted(
            {str(b.device) for g in engine.optimizer.flat.groups for b in g.buckets}
        ),
        "params": packed({n: p.detach().cpu() for n, p in model.named_parameters()}),
    }


def test_initialize_trains_on_the_emulated_device_as_on_the_host():
    host = run_ranks(_initialize_worker, 2, "cpu", timeout_s=300)
    emu = launch("emu", _initialize_worker, 2, timeout_s=300)
    for h, e in zip(host, emu, strict=True):
        assert e["buckets_on"] == ["emu:0"] and h["buckets_on"] == ["cpu"]
        assert e["losses"][-1] < e["losses"][0]
        on_emu = unpacked(e["params"])
        for name, value in unpacked(h["params"]).items():
            torch.testing.assert_close(on_emu[name], value, rtol=1e-4, atol=1e-5)


# ------------------------------------------------ any backend, a device-only backend
def _any_name_worker(rank: int, world_size: int, name: str) -> dict:
    model = make_model().to(name)
    flat = flatzero.flatten_parameters(
        model, config=flatzero.FlattenConfig(bucket_numel=2000, progress=False)
    )
    opt = flatzero.ZeroOptimizer(flat, torch.optim.AdamW, stage=2, lr=1e-3)
    ids = _batch(0, rank, model.config.vocab_size).to(name)
    model(ids, labels=ids).loss.backward()
    opt.step()
    return {
        "devices": sorted({str(b.device) for g in flat.groups for b in g.buckets}),
        "masters": sorted({str(m.device) for m in opt.master_shards}),
        "tiers": flat.report.tiers,
    }


def test_a_backend_of_any_name_is_served_by_the_same_lines():
    """Nothing in flatzero knows the emulator's name: call it something else."""
    prepare = functools.partial(install, "npx", capacity_bytes=1 << 30)
    results = run_ranks(
        _any_name_worker, 2, "npx", backend="cpu:gloo,npx:npx-gloo", prepare=prepare
    )
    for r in results:
        assert r["devices"] == ["npx:0"] and r["masters"] == ["npx:0"]
        assert set(r["tiers"]) == {"device"}


def test_a_device_only_backend_gets_its_control_tensors_on_the_device():
    """As with a pure NCCL group: the collective backend refuses host tensors, so every
    norm, flag and agreement tensor of a step must be on the device."""
    results = launch("emu", _any_name_worker_emu, 2, backend="emu-gloo", host_collectives=False)
    for r in results:
        assert r["devices"] == ["emu:0"]


def _any_name_worker_emu(rank: int, world_size: int, kind: str) -> dict:
    return _any_name_worker(rank, world_size, kind)


# ------------------------------------------------------------ one room talks to devices
SRC = Path(flatzero.__file__).resolve().parent
ALLOWED = {SRC / "accel.py"}
"""The seam itself. ``bench/`` measures CUDA-specific limits (device copy bandwidth,
pinned H2D) and is allowed to name CUDA; ``testing/`` is a device of its own."""


def _device_runtime_uses(path: Path) -> list[str]:
    """``torch.cuda`` / ``torch.xpu`` / ... attribute uses and ``== "cuda"`` tests."""
    found = []
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and node.attr in ("cuda", "xpu", "npu", "hpu", "mps", "mtia")
        ):
            found.append(f"{path.name}:{node.lineno} torch.{node.attr}")
        if isinstance(node, ast.Compare) and any(
            isinstance(c, ast.Constant) and c.value == "cuda" for c in node.comparators
        ):
            found.append(f"{path.name}:{node.lineno} compares with 'cuda'")
    return found


def test_nothing_outside_the_seam_calls_a_device_runtime():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path in ALLOWED or "testing" in path.relative_to(SRC).parts:
            continue
        offenders += _device_runtime_uses(path)
    assert offenders == [], "device calls belong in flatzero/accel.py:\n" + "\n".join(offenders)


def test_the_seam_check_finds_a_device_call(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('import torch\nif torch.cuda.is_available() and d.type == "cuda":\n    pass\n')
    assert len(_device_runtime_uses(bad)) == 2
