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
# tests/test_two_hosts.py makes two hosts out of network namespaces with `ip` (iproute2):
# install it when it is missing, as root with apt-get only; quietly, and never fail here
# (the test skips without it).
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2; }
    { apt_install || { apt-get update -qq && apt_install; }; } >/dev/null 2>&1 \
        || echo "setup.sh: could not install iproute2; tests/test_two_hosts.py will skip" >&2
fi
