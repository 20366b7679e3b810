"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions on a checkpoint that
``engine.save_checkpoint`` wrote through ``patch_deepspeed()`` (flatzero's format): each returns
flatzero's fp32 masters bit for bit under the model's names, with the same names and dtypes as
DeepSpeed 0.19.8's own consolidation of the same training; a checkpoint DeepSpeed wrote still
goes to DeepSpeed's reader; the ``zero_to_fp32.py`` the door writes beside its checkpoints
consolidates them as DeepSpeed's does its own (CPU, gloo, 2 ranks; skipped without DeepSpeed)."""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from flatzero.launch import run_ranks


class _Tied(torch.nn.Module):
    """Tied embedding and head, a frozen layer, a buffer (13 + 80 + 72 + 72 elements)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(10, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.frozen(torch.tanh(self.mid(self.emb(x)))) * self.scale[0]
        return self.head(h).float().pow(2).mean()


CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
    "bf16": {"enabled": True},
}


def _train_and_save(initialize: Any, rank: int, where: Path) -> tuple[Any, dict[str, Any]]:
    import deepspeed

    engine, *_ = initialize(model=_Tied(), config=CONFIG)
    for step in range(3):
        x = torch.randint(0, 10, (2, 5), generator=torch.Generator().manual_seed(10 * step + rank))
        engine.backward(engine(x))
        engine.step()
    engine.save_checkpoint(str(where))
    masters = {
        n: deepspeed.utils.safe_get_full_fp32_param(p).clone()
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }
    return engine, masters


def _consolidations(where: Path, tag: str) -> dict[str, Any]:
    from deepspeed.utils import zero_to_fp32 as z

    out = where.parent / f"{where.name}_out"
    z.convert_zero_checkpoint_to_fp32_state_dict(str(where), str(out), max_shard_size=None)
    lazy = z.get_fp32_state_dict_from_zero_checkpoint(str(where), lazy_mode=True)
    model = z.load_state_dict_from_zero_checkpoint(_Tied(), str(where))
    return {
        "latest": z.get_fp32_state_dict_from_zero_checkpoint(str(where)),
        "tag": z.get_fp32_state_dict_from_zero_checkpoint(str(where), tag=tag),
        "lazy": {n: t.contiguous() for n, t in lazy.items()},
        "file": torch.load(out / "pytorch_model.bin", weights_only=True),
        "loaded": dict(model.state_dict()),
        "no frozen": z.get_fp32_state_dict_from_zero_checkpoint(
            str(where), exclude_frozen_parameters=True
        ),
    }


def _run_script(where: Path) -> dict[str, torch.Tensor]:
    """``python zero_to_fp32.py . out`` in ``where`` (in this process: the script's file run as
    ``__main__``); what it wrote."""
    argv = sys.argv
    sys.argv = ["zero_to_fp32.py", str(where), str(where / "out"), "--max_shard_size", "1GB"]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(where / "zero_to_fp32.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert done.value.code == 0
    return torch.load(where / "out" / "pytorch_model.bin", weights_only=True)


def _leave(where: Path) -> None:
    """``flatzero export-deepspeed`` leaves the door's script behind (DeepSpeed writes its own)."""
    from flatzero.deepspeed.convert.outgoing import to_deepspeed

    (where / "trainer_state.json").write_text("{}")
    result = to_deepspeed(where, where.parent / "left", world_size=1)
    assert result.copied == ("out", "trainer_state.json"), result.copied


def _rank(rank: int, world_size: int, root: str) -> None:
    import deepspeed

    import flatzero
    from flatzero.testing.deepspeed import prepare_deepspeed, release_engine

    prepare_deepspeed()
    original = deepspeed.initialize
    out: dict[str, Any] = {}
    with flatzero.patch_deepspeed():
        for name, initialize in (("flatzero", deepspeed.initialize), ("deepspeed", original)):
            where = Path(root) / name
            engine, out[f"{name} masters"] = _train_and_save(initialize, rank, where)
            torch.distributed.barrier()
            if rank == 0:
                tag = (where / "latest").read_text().strip()
                out[name] = _consolidations(where, tag)
            if rank == 0 and name == "flatzero":  # the door's zero_to_fp32.py, as HF runs it
                out[name]["script"] = _run_script(where)
                _leave(where)
            torch.distributed.barrier()
            engine.destroy() if name == "flatzero" else release_engine(engine)
    if rank == 0:  # the tensors stay in this process (tied ones are one tensor)
        _check(out, Path(root))


def _check(out: dict[str, Any], root: Path) -> None:
    assert (root / "flatzero" / "global_step3" / "meta.json").is_file()
    assert list((root / "deepspeed" / "global_step3").glob("*_model_states.pt"))
    for route in ("flatzero", "deepspeed"):
        masters = out[f"{route} masters"]
        for kind, state in out[route].items():
            for name, value in masters.items():  # the trained params: the fp32 masters
                assert state[name].dtype == torch.float32, (route, kind, name)
                assert torch.equal(state[name].float(), value), (route, kind, name)
    fz, ds = out["flatzero"], out["deepspeed"]
    ds["script"] = ds["file"]  # what DeepSpeed's own script writes
    for kind in ("latest", "tag", "lazy", "file", "script"):  # as DeepSpeed returns them
        assert {n: t.dtype for n, t in fz[kind].items()} == {
            n: t.dtype for n, t in ds[kind].items()
        }, kind
    for name in ("frozen.weight", "frozen.bias", "scale"):  # saved as trained
        assert torch.equal(fz["latest"][name], ds["latest"][name])
    assert fz["latest"]["head.weight"] is fz["latest"]["emb.weight"]  # tied: one tensor
    # Excluding frozen params drops the buffers too (one file holds both): DeepSpeed keeps them.
    assert set(ds["no frozen"]) - set(fz["no frozen"]) == {"scale"}
    assert "frozen.weight" not in fz["no frozen"]


def test_zero_to_fp32_reads_flatzero_checkpoints_and_still_deepspeeds(tmp_path):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    run_ranks(_rank, 2, str(tmp_path), env={"DS_ACCELERATOR": "cpu"})
