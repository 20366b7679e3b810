"""GPU tests: they run only where a CUDA device is visible, and skip otherwise.

``tests/conftest.py`` hides every GPU from the test process unless ``FLATZERO_TEST_GPU=1``
is set, so a plain ``python3 -m pytest`` skips these on any machine, and
``FLATZERO_TEST_GPU=1 python3 -m pytest -q tests/gpu tests/test_checkpoint_gpu.py`` runs
them on a GPU machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    if os.environ.get("FLATZERO_TEST_GPU") == "1":
        reason = "needs a CUDA device"
    else:
        reason = "GPU tests run with FLATZERO_TEST_GPU=1 (the CPU suite hides every GPU)"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)
