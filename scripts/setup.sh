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
# tests/test_two_hosts.py (only it) makes two hosts out of network namespaces with `ip`
# (iproute2): when it is missing and this runs as root with apt-get, say so, then install
# the system package (FLATZERO_NO_SYSTEM_PACKAGES=1 skips it); never fail here (the test
# skips without it).
if ! command -v ip >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if [ "${FLATZERO_NO_SYSTEM_PACKAGES:-0}" = 1 ]; then
        echo "setup.sh: not installing iproute2 (FLATZERO_NO_SYSTEM_PACKAGES=1); tests/test_two_hosts.py will skip" >&2
    else
        echo "setup.sh: installing the system package iproute2 with apt-get (running as root; only tests/test_two_hosts.py needs it; FLATZERO_NO_SYSTEM_PACKAGES=1 skips this)" >&2
        apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2; }
        { apt_install || { apt-get update -qq && apt_install; }; } >/dev/null 2>&1 \
            || echo "setup.sh: could not install iproute2; tests/test_two_hosts.py will skip" >&2
    fi
fi
