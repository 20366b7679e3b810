"""Test harness: run unchanged training scripts one after another in this rank's process,
each as ``__main__`` with its own ``sys.argv``, some with ``flatzero.patch_deepspeed()``
active (undone after), as if each had its own ``torchrun``; saves the start-up of a process
tree per run (transformers, DeepSpeed and Accelerate take ~10 s to import here).

Usage: ``torchrun --nproc-per-node 2 run_in_process.py PLAN.json``. ``PLAN.json``: a list of
``{"name", "script", "argv", "flatzero": bool}``; then ``{"check_pretrained": [dirs]}``
entries make rank 0 load each dir with ``from_pretrained`` and write what it found to
``DIR/pretrained_check.json``. Between runs Accelerate's shared state and the environment are
reset (a fresh process would start without them).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time


def _reset() -> None:
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()


def _check_pretrained(directory: str) -> None:
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(directory, output_loading_info=True)
    saved = load_file(os.path.join(directory, "model.safetensors"))
    state = model.state_dict()
    worst = max(float((state[k] - v).abs().max()) for k, v in saved.items())
    with open(os.path.join(directory, "pretrained_check.json"), "w") as f:
        json.dump(
            {
                "missing": sorted(info["missing_keys"]),
                "unexpected": sorted(info["unexpected_keys"]),
                "mismatched": [list(map(str, m)) for m in info["mismatched_keys"]],
                "max_diff_to_file": worst,
            },
            f,
        )


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    environ = dict(os.environ)
    for entry in plan:
        if "check_pretrained" in entry:
            if os.environ.get("RANK", "0") == "0":
                for directory in entry["check_pretrained"]:
                    _check_pretrained(directory)
            continue
        handle = None
        if entry["flatzero"]:
            import flatzero

            handle = flatzero.patch_deepspeed()
        sys.argv = [entry["script"], *entry["argv"]]
        t0 = time.perf_counter()
        try:
            runpy.run_path(entry["script"], run_name="__main__")
        finally:
            if handle is not None:
                handle.undo()
            _reset()
            os.environ.clear()
            os.environ.update(environ)
        print(f"[run_in_process] {entry['name']}: {time.perf_counter() - t0:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
