"""DeepSpeed's own ZeRO-1/2 unit tests, unedited, run twice on the CPU: on DeepSpeed, and with
``deepspeed.initialize`` routed to flatzero (``flatzero.patch_deepspeed()``).

The tests are vendored under ``benchmarks/deepspeed_unit_tests/tests`` (Apache-2.0, see the
README there); nothing is fetched at run time. Each route runs each selected file in its own
pytest process, with ``DS_ACCELERATOR=cpu`` (gloo) and ``-p stages12`` (ZeRO stage 3
deselected: the router hands it to DeepSpeed); the flatzero route adds ``route/`` to
``PYTHONPATH``, whose ``sitecustomize.py`` applies the patch in every process, DeepSpeed's test
workers included. pytest's output is kept in ``<out>.<route>.log``. A test that prints nothing
for ``--timeout`` seconds is stopped with its process group and recorded as ``timeout``, and
its file runs on without it (DeepSpeed's harness hangs when a test fails through
``pytest.fail``, e.g. ``pytest.raises`` that did not raise: the ``Failed`` it re-raises is a
``BaseException``, which kills its ``multiprocessing.Pool`` worker, and the result never comes).
Per-test outcomes of both routes, the command, the machine and the date go to one JSON file.

    python benchmarks/deepspeed_unit_tests.py                      # both routes, the default files
    python benchmarks/deepspeed_unit_tests.py --files unit/checkpoint/test_latest_checkpoint.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent / "deepspeed_unit_tests"
TESTS = HERE / "tests"
ROUTE = HERE / "route"
SRC = HERE.parent.parent / "src"
RESULTS = HERE.parent / "results" / "deepspeed_unit_tests_cpu.json"
REASONS = HERE / "reasons.json"

FILES = (
    "unit/checkpoint/test_latest_checkpoint.py",
    "unit/checkpoint/test_tag_validation.py",
    "unit/checkpoint/test_lr_scheduler.py",
    "unit/checkpoint/test_other_optimizer.py",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROCheckpoint",
    "unit/checkpoint/test_zero_optimizer.py::TestZeROSaveLoadEdgeCase",
    "unit/runtime/zero/test_ignore_unused_parameters.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_unwrap_model.py",
    "unit/runtime/zero/test_zero_tensor_fragment.py",
    "unit/runtime/half_precision/test_dynamic_loss_scale.py",
    "unit/v1/half_precision/test_bf16.py::TestAdamBF16ZeroOneCycleCompatibility",
    "unit/v1/half_precision/test_bf16.py::TestZeroAllowUntestedOptimizer",
    "unit/v1/half_precision/test_bf16.py::TestZeroEmptyPartition",
    "unit/v1/half_precision/test_bf16.py::TestZeroSupportedClientOptimizer",
    "unit/v1/half_precision/test_bf16.py::TestZero2ReduceScatterOff",
    "unit/v1/half_precision/test_bf16.py::TestZeroEmptyGrad",
    "unit/v1/zero/test_zero.py::TestZeroUnbalancedGradients",
    "unit/v1/zero/test_zero.py::TestZeroToFP32",
    "unit/v1/zero/test_zero.py::TestIncorectAllgatherBucketSize",
    "unit/v1/zero/test_zero.py::TestPartitionNcclAlignment",
    "unit/v1/zero/test_zero.py::TestZeroOffloadStage1",
    "unit/v1/zero/test_zero.py::TestZeroAdamOptimizerStepCount",
    "unit/v1/zero/test_zero.py::TestZeroFrozenWeights",
    "unit/v1/zero/test_zero.py::TestZeroOffloadOptim",
    "unit/v1/zero/test_zero.py::TestBF16OptimizerGradReduction",
    "unit/v1/zero/test_zero_cpu_offload_grad_accum.py",
    "unit/v1/zero/test_zero_user_backward.py::TestZeroUserBackwardBasic",
    "unit/v1/zero/test_zero_user_backward.py::TestZeroUserBackwardGradAccumulation",
)
"""The tests run by default (files, or ``file::Class``; one pytest process per file):
checkpoints (latest, tags, LR scheduler, other optimizers, ZeRO optimizer state and its
edge cases), unused parameters, gradient clipping, unwrapping, the tensor-fragment API, fp16
dynamic loss scaling, bf16, the stage-1/2 classes of ``test_zero.py``, offloaded gradient
accumulation and a plain ``loss.backward()``: the ZeRO-0/1/2 part of DeepSpeed's tests that
fits a 2-core machine in about half an hour a route. Classes that only run stage 3
(``TestZero3*``, ``TestEmptyParameterGroup``, ``TestZeroPartitionCache``, ZeRO++), the
world-size-4 elastic checkpoints and the rest of ``test_zero_user_backward.py`` are left out;
any other test is one ``--files`` away."""

KEYWORD = "not (tensor_fragment and (local or nvme or cpu))"
"""The default ``-k``: the tensor-fragment tests' ZeRO-3-only local API and offload cases out."""


def _environment(route: str) -> dict[str, str]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2", DS_UNITTEST_TIMEOUT="300")
    paths = [str(ROUTE), str(SRC), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["FLATZERO_ROUTE"] = "1" if route == "flatzero" else "0"
    return env


def _outcomes(junit: Path) -> dict[str, dict[str, str]]:
    """``{test id: {"outcome": passed|failed|skipped|error, "message": ...}}`` of a junit file."""
    out: dict[str, dict[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (
                    (node.get("message") or "").splitlines()[0][:300] if node.get("message") else ""
                )
                break
        out[test] = {"outcome": outcome, "message": message}
    return out


def _junit_id(nodeid: str) -> str:
    """``unit/a/test_b.py::C::t[x]`` -> ``unit.a.test_b.C::t[x]`` (the junit file's form)."""
    path, *rest = nodeid.split("::")
    return ".".join([path.removesuffix(".py").replace("/", "."), *rest[:-1]]) + "::" + rest[-1]


def _from_log(text: str) -> tuple[dict[str, dict[str, str]], str | None]:
    """Outcomes that ``pytest -v`` printed in ``text``, and the test it started last without
    an outcome (the one that hung), if any."""
    done: dict[str, dict[str, str]] = {}
    started = None
    for line in text.splitlines():
        plain = re.sub(r"\x1b\[[0-9;]*m", "", line)
        if re.match(r"=+ (?!test session starts)", plain):
            break  # the summaries after the tests name tests without outcomes
        words = plain.split()
        if not words or "::" not in words[0] or not words[0].startswith("unit/"):
            continue
        started = words[0]
        if len(words) > 1 and words[1] in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            done[words[0]] = {"outcome": words[1].lower(), "message": ""}
            started = None
    return done, started


def _pytest(command: list[str], env: dict, log: Path, idle_s: float) -> bool:
    """Run ``command`` with its output appended to ``log``; stop it (its whole process group:
    DeepSpeed's test workers too) once ``log`` has not grown for ``idle_s`` seconds. True if
    it finished on its own."""
    with log.open("ab") as sink:
        proc = subprocess.Popen(command, cwd=TESTS, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        size, quiet_since = -1, time.monotonic()
        while proc.poll() is None:
            time.sleep(2.0)
            if log.stat().st_size != size:
                size, quiet_since = log.stat().st_size, time.monotonic()
            elif time.monotonic() - quiet_since > idle_s:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return False
    return True


def run_file(
    route: str, targets: list[str], keyword: str | None, junit: Path, log: Path, idle_s: float
) -> dict[str, dict[str, str]]:
    """Outcomes of one test file's ``targets`` (the file, or classes in it) on ``route``. A
    test that prints nothing for ``idle_s`` seconds, or that ends the session unfinished
    (DeepSpeed's harness calls ``pytest.exit`` when a test outlives ``DS_UNITTEST_TIMEOUT``),
    is recorded as ``timeout`` and the file is run again without it and the tests already
    done, so one hang costs minutes, not the run."""
    outcomes: dict[str, dict[str, str]] = {}
    skip: list[str] = []
    while True:
        command = [sys.executable, "-m", "pytest", "-p", "stages12", "-p", "no:cacheprovider",
                   "--color=no", f"--junitxml={junit}", "-v", "-rA", *targets]  # fmt: skip
        command += ["-k", keyword] if keyword else []
        command += [f"--deselect={t}" for t in skip]
        before = log.stat().st_size if log.exists() else 0
        with log.open("a") as sink:
            sink.write(f"\n--- {route}: {' '.join(command[1:])}\n")
        junit.unlink(missing_ok=True)
        finished = _pytest(command, _environment(route), log, idle_s)
        with log.open("rb") as f:
            done, hung = _from_log(f.read()[before:].decode(errors="replace"))
        outcomes.update({_junit_id(t): o for t, o in done.items()})
        outcomes.update(_outcomes(junit) if junit.exists() else {})
        junit.unlink(missing_ok=True)
        if hung is None:
            return outcomes
        why = "ended the session unfinished" if finished else f"no output for {idle_s:.0f} s"
        with log.open("a") as sink:
            sink.write(f"\n--- {route}: TIMEOUT {hung} ({why})\n")
        outcomes[_junit_id(hung)] = {"outcome": "timeout", "message": why}
        skip += [*done, hung]


def run_route(
    route: str, files: list[str], keyword: str | None, out: Path, idle_s: float
) -> tuple[dict, float, list[str]]:
    """Each of ``files`` in its own pytest run on ``route`` (output kept in
    ``<out>.<route>.log``); the outcomes, the seconds and the command (of one file)."""
    out = out.resolve()  # pytest runs in TESTS
    junit, log = out.with_suffix(f".{route}.xml"), out.with_suffix(f".{route}.log")
    log.unlink(missing_ok=True)
    outcomes: dict[str, dict[str, str]] = {}
    start = time.perf_counter()
    by_file: dict[str, list[str]] = {}  # one pytest process per file, its classes together
    for target in files:
        by_file.setdefault(target.split("::")[0], []).append(target)
    for targets in by_file.values():
        outcomes.update(run_file(route, targets, keyword, junit, log, idle_s))
    command = ["python", "-m", "pytest", "-p", "stages12", "-p", "no:cacheprovider", "--color=no",
               "-v", "-rA", "<file>"] + (["-k", keyword] if keyword else [])  # fmt: skip
    return outcomes, time.perf_counter() - start, command


def _versions() -> dict[str, str]:
    code = "import torch, deepspeed; print(torch.__version__, deepspeed.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_environment("deepspeed"), check=False).stdout.split()  # fmt: skip
    return {"torch": out[0], "deepspeed": out[1]} if len(out) == 2 else {}


def write_results(
    routes: dict, seconds: dict, commands: dict, out: Path, argv: list[str], reruns: list[dict]
) -> None:
    """The JSON file: per test, each route's outcome, why flatzero fails where DeepSpeed
    passes (``reasons.json``), and the files that ran tests again (``reruns``)."""
    reasons = json.loads(REASONS.read_text()) if REASONS.exists() else {}
    tests = sorted(set().union(*routes.values()))
    table = {
        t: {r: routes[r].get(t, {"outcome": "not run", "message": ""}) for r in routes}
        for t in tests
    }
    for test, row in table.items():
        if (
            len(routes) == 2
            and row["deepspeed"]["outcome"] == "passed"
            and row["flatzero"]["outcome"] != "passed"
        ):
            row["reason"] = reasons.get(test, "no reason recorded")
    summary: dict[str, dict[str, int]] = {r: {} for r in routes}
    for row in table.values():
        for r in routes:
            outcome = row[r]["outcome"]
            summary[r][outcome] = summary[r].get(outcome, 0) + 1
    result = {
        "command": " ".join(["python", "benchmarks/deepspeed_unit_tests.py", *argv]),
        "pytest_commands": commands,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), **_versions()},
        "tests_source": "benchmarks/deepspeed_unit_tests/README.md",
        "seconds": {r: round(s, 1) for r, s in seconds.items()},
        "summary": summary,
        "tests": table,
    }
    if reruns:
        result["reruns"] = reruns
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--files", nargs="+", default=list(FILES), help="test files or file::Class (under tests/)"
    )
    parser.add_argument("-k", dest="keyword", default=KEYWORD, help="pytest -k expression")
    parser.add_argument("--routes", nargs="+", default=["deepspeed", "flatzero"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--timeout", type=float, default=600.0,
        help="seconds a test may run without output before it is stopped (outcome: timeout)",
    )  # fmt: skip
    parser.add_argument(
        "--merge", nargs="+", type=Path, default=None,
        help="combine result files into --out (a route in several: its tests together)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    routes: dict = {}
    seconds: dict = {}
    commands: dict = {}
    reruns: list[dict] = []
    for path in args.merge or []:
        _merge(json.loads(path.read_text()), routes, seconds, commands, reruns)
    for route in [] if args.merge else args.routes:
        outcome = run_route(route, args.files, args.keyword, args.out, args.timeout)
        routes[route], seconds[route], command = outcome
        commands[route] = " ".join(command[1:])
    write_results(routes, seconds, commands, args.out, argv, reruns)
    return 0


def _merge(data: dict, routes: dict, seconds: dict, commands: dict, reruns: list[dict]) -> None:
    """Add one result file's routes: a route's tests from several files together; a file
    that only runs again tests an earlier file ran (after a fix) replaces their outcomes and
    is listed in ``reruns`` (its command, date, seconds and tests), not added to the time."""
    for route in data["seconds"]:
        rows = {t: row[route] for t, row in data["tests"].items() if route in row}
        if rows and set(rows) <= set(routes.get(route, {})):
            rerun = {"route": route, "command": data["command"], "date": data["date"]}
            reruns.append({**rerun, "seconds": data["seconds"][route], "replaces": sorted(rows)})
            routes[route].update(rows)
            continue
        routes.setdefault(route, {}).update(rows)
        seconds[route] = seconds.get(route, 0.0) + data["seconds"][route]
        command = data["pytest_commands"][route]
        commands[route] = f"{commands[route]}; {command}" if route in commands else command


if __name__ == "__main__":
    sys.exit(main())
