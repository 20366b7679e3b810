#!/usr/bin/env bash
# Set up flatzero in the current Python: torch (CPU build, pinned, only if missing), then
# the package with its dev extras. Never replaces an existing torch. Works offline here:
# torch==2.13.0 comes from this machine's local wheel, the rest from the package registry.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev]"
