"""The device suite: flatzero's accelerator lines, run on every accelerator kind we have.

Each test takes ``kind``: ``"emu"``, the emulated accelerator of
``flatzero.testing.emulated`` (always runs, in spawned rank processes: registering it is
process-global), and ``"cuda"`` (runs where a CUDA device is visible, i.e. with
``FLATZERO_TEST_GPU=1`` on a GPU machine; skipped otherwise). The same worker functions
run on both, through the device seam (``flatzero.accel``).
"""

from __future__ import annotations

import pytest
import torch

KINDS = [
    pytest.param("emu", id="emu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(),
            reason="needs CUDA (run with FLATZERO_TEST_GPU=1 on a GPU machine)",
        ),
    ),
]


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    """The accelerator kind a test runs on."""
    return request.param
