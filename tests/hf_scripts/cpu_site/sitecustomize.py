"""Test harness only (on ``PYTHONPATH`` of the HF integration tests): what DeepSpeed and
Accelerate need to run on a CPU-only machine, set up in every rank before the script runs.

- Accelerate picks no process-group backend when there is no accelerator (so its world size
  is 1 with DeepSpeed); give it gloo.
- DeepSpeed's CPU communication backend JIT-compiles its ``deepspeed_shm_comm`` op (about
  40 s with g++; used only for inference all-reduce, never by ZeRO): mark it incompatible,
  as ``flatzero.testing.deepspeed`` does.

Only in processes a launcher started as a rank (``LOCAL_RANK`` set), not in the launcher.
"""

import os

if "LOCAL_RANK" in os.environ and os.environ.get("FLATZERO_HF_TEST_CPU") == "1":
    import deepspeed.ops as _ds_ops
    from accelerate.state import PartialState as _PartialState

    for _name in list(_ds_ops.__compatible_ops__):
        if "shm_comm" in _name:
            _ds_ops.__compatible_ops__[_name] = False

    _prepare_backend = _PartialState._prepare_backend

    def _gloo_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        backend, distributed_type = _prepare_backend(self, cpu, sagemaker_dp, backend)
        return backend or "gloo", distributed_type

    _PartialState._prepare_backend = _gloo_backend
