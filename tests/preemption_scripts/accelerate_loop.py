"""An ordinary Accelerate loop with DeepSpeed ZeRO-2 through ``flatzero.patch_deepspeed()``
(the Hugging Face route), save on a signal set in the DeepSpeed config's ``flatzero``
section. After its 3rd optimizer step the process sends itself SIGUSR1 (a real signal);
Accelerate's ``backward`` calls ``engine.step()``, which saves and raises ``Preempted``
(exit status 128 + 10). ``sys.argv[1]``: the checkpoint directory.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin

import flatzero


def main() -> None:
    flatzero.patch_deepspeed()
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "zero_force_ds_cpu_optimizer": False,
        "flatzero": {"progress": False, "preemption_dir": sys.argv[1]},
    }
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(torch.randn(40, 8), batch_size=2)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for step, x in enumerate(loader):
        accelerator.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        if step == 2:
            os.kill(os.getpid(), signal.SIGUSR1)


if __name__ == "__main__":
    main()
