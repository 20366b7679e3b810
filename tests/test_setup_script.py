"""``scripts/setup.sh``: what it installs beyond Python packages, it says (issue 38 item 6).

Run with stand-ins on ``PATH`` (a ``python3`` that installs nothing, an ``apt-get`` that
records its arguments, no ``ip``), so nothing is installed and no network is used."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the system-package step runs as root")


def _run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    calls = tmp_path / "apt-get.calls"
    (bin_dir / "apt-get").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    (bin_dir / "python3").write_text("#!/bin/sh\nexit 0\n")  # torch "imports", pip installs
    for stand_in in ("apt-get", "python3"):
        (bin_dir / stand_in).chmod(0o755)
    result = subprocess.run(
        [shutil.which("bash"), str(ROOT / "scripts" / "setup.sh")],
        env={"PATH": str(bin_dir), "PYTHON": str(bin_dir / "python3"), **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result, calls.read_text() if calls.exists() else ""


def test_setup_says_it_installs_iproute2_and_why(tmp_path):
    result, calls = _run(tmp_path)
    assert result.returncode == 0, result.stderr
    assert "installing the system package iproute2 with apt-get" in result.stderr
    assert "only tests/test_two_hosts.py needs it" in result.stderr
    assert "install -y -qq --no-install-recommends iproute2" in calls


def test_setup_can_be_told_not_to_install_system_packages(tmp_path):
    result, calls = _run(tmp_path, FLATZERO_NO_SYSTEM_PACKAGES="1")
    assert result.returncode == 0, result.stderr
    assert calls == ""
    assert "not installing iproute2 (FLATZERO_NO_SYSTEM_PACKAGES=1)" in result.stderr
