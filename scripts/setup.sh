#!/usr/bin/env bash
# Set up flatzero in the current Python: torch (CPU build, pinned, only if no torch is
# installed; an existing torch is never replaced), then the package with its dev and
# bench and hf extras (pytest, ruff, hypothesis; DeepSpeed 0.19.8 and matplotlib for the
# side-by-side benchmarks; transformers). torch==2.13.0 comes from the local wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev,bench,hf]"
