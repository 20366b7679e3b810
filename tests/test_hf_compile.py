"""Hugging Face Trainer with ``torch_compile=True`` under a DeepSpeed config routed to
flatzero (issue 39 item 3): Accelerate calls ``engine.compile()``, the engine compiles its
module in place, and the run trains with DeepSpeed 0.19.8's losses and no graph break (one
rank, CPU, the unchanged script ``hf_scripts/train_trainer.py`` run in one process: flatzero
first, so its run compiles from nothing, then DeepSpeed).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

for _package in ("transformers", "accelerate", "deepspeed"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "hf_scripts"
CONFIG = {
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto",
                   "torch_adam": True},
    },
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "zero_force_ds_cpu_optimizer": False,
    "steps_per_print": 2000,
}  # fmt: skip
ARGS = [
    "--per_device_train_batch_size=2",
    "--gradient_accumulation_steps=2",
    "--max_steps=3",
    "--learning_rate=1e-2",
    "--max_grad_norm=1.0",
    "--logging_steps=1",
    "--save_strategy=no",
    "--report_to=none",
    "--seed=0",
    "--disable_tqdm=true",
    "--torch_compile=true",
    "--torch_compile_backend=aot_eager",
]


def test_trainer_with_torch_compile_trains_as_deepspeed(tmp_path):
    (tmp_path / "z2.json").write_text(json.dumps(CONFIG))
    script = str(SCRIPTS / "train_trainer.py")
    argv = [f"--deepspeed={tmp_path / 'z2.json'}", *ARGS]
    plan = [
        {"name": n, "flatzero": n == "fz", "script": script,
         "argv": [f"--output_dir={tmp_path / n}", *argv]}
        for n in ("fz", "ds")
    ]  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = dict(os.environ)
    path = [str(SCRIPTS / "cpu_site"), str(ROOT / "src"), env.get("PYTHONPATH", "")]
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in path if p),
        DS_ACCELERATOR="cpu",
        FLATZERO_HF_TEST_CPU="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HOME=str(tmp_path / "hf_home"),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
           str(SCRIPTS / "run_in_process.py"), str(tmp_path / "plan.json")]  # fmt: skip
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=400, check=False)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    runs = {n: json.loads((tmp_path / n / "log_history.json").read_text()) for n in ("fz", "ds")}
    fz, ds = runs["fz"], runs["ds"]
    assert fz["engine"] == "DeepSpeedCompatibleEngine" and ds["engine"] == "DeepSpeedEngine"
    assert fz["compiled"] and ds["compiled"]
    assert fz["graphs"] >= 1 and fz["graph_breaks"] == 0  # flatzero's run came first
    fz_losses, ds_losses = ([r["loss"] for r in d["log_history"] if "loss" in r] for d in (fz, ds))
    assert len(fz_losses) == 3
    assert fz_losses == pytest.approx(ds_losses, rel=1e-6)  # measured: bit for bit
