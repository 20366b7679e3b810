"""gloo's connect-time abort, and launching again after it.

On this 2-core machine under load, a rank of a fresh multi-process launch sometimes dies
when gloo's transport thread meets an exception while connecting (pytorch/gloo#162):
``terminate called without an active exception``, exit -6 (seen in CI and in local suite
runs, never in quiet repeated launches). It is gloo's, not flatzero's; tests that
start launches of their own launch again after it, a bounded number of times, and fail with
the logs otherwise.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

GLOO_ABORT = "terminate called without an active exception"
"""What a rank prints when gloo aborts it."""

GLOO_ABORT_RETRIES = 3
"""Launches again after ``GLOO_ABORT``: a suite run on 2026-11-28 saw it in three launches in
a row of the two-host test under load."""


def run_again_after_gloo_abort(
    launch: Callable[[], subprocess.CompletedProcess[str]],
    before_again: Callable[[], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``launch()``; again (after ``before_again()``) while it failed of ``GLOO_ABORT``, up to
    ``GLOO_ABORT_RETRIES`` more times. Returns the last launch."""
    done = launch()
    for _ in range(GLOO_ABORT_RETRIES):
        if done.returncode == 0 or GLOO_ABORT not in f"{done.stdout}{done.stderr}":
            break
        if before_again is not None:
            before_again()
        done = launch()
    return done
