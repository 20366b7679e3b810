"""The CPU suite sees no GPU, on any machine (``tests/conftest.py``), unless
``FLATZERO_TEST_GPU=1`` asks for the GPU run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    os.environ.get("FLATZERO_TEST_GPU") == "1",
    reason="FLATZERO_TEST_GPU=1: this run is meant to see the GPUs",
)


def test_the_test_process_sees_no_cuda_device():
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert not torch.cuda.is_available()
    assert torch.cuda.device_count() == 0


def test_processes_the_tests_start_see_no_cuda_device():
    """Ranks started by ``run_ranks`` (spawn) or a subprocess inherit the hidden GPUs."""
    code = (
        "import os, torch; "
        "print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), torch.cuda.device_count())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split() == ["''", "0"]
