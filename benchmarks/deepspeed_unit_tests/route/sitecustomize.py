"""Every Python process started with this directory on ``PYTHONPATH`` (the pytest process and
the workers DeepSpeed's ``DistributedTest`` starts with forkserver or spawn) routes
``deepspeed.initialize`` through flatzero (``flatzero.patch_deepspeed()``) before any test
module is imported. Used by ``benchmarks/deepspeed_unit_tests.py --route flatzero``."""

import os

if os.environ.get("FLATZERO_ROUTE") == "1":
    import flatzero

    flatzero.patch_deepspeed()
