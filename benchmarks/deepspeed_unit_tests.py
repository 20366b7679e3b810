"""DeepSpeed's own ZeRO-1/2 unit tests, unedited, run twice on the CPU: on DeepSpeed, and with
``deepspeed.initialize`` routed to flatzero (``flatzero.patch_deepspeed()``).

The tests are vendored under ``benchmarks/deepspeed_unit_tests/tests`` (Apache-2.0, see the
README there); nothing is fetched at run time. Each route is one pytest run over the selected
files, with ``DS_ACCELERATOR=cpu`` (gloo) and ``-p stages12`` (ZeRO stage 3 deselected: the
router hands it to DeepSpeed); the flatzero route adds ``route/`` to ``PYTHONPATH``, whose
``sitecustomize.py`` applies the patch in every process, DeepSpeed's test workers included.
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
    "unit/runtime/zero/test_ignore_unused_parameters.py",
    "unit/runtime/zero/test_zero_grad_clip.py",
    "unit/runtime/zero/test_unwrap_model.py",
    "unit/runtime/zero/test_zero_tensor_fragment.py",
)
"""The files run by default: checkpoints (latest, tags, LR scheduler, other optimizers),
unused parameters, gradient clipping, unwrapping, and the tensor-fragment API (a subset of
DeepSpeed's ZeRO-1/2 tests that fits a 2-core machine in minutes; any other file is one
``--files`` away)."""

KEYWORD = "not local and not nvme and not cpu"
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


def run_route(
    route: str, files: list[str], keyword: str | None, junit: Path
) -> tuple[dict, float, list[str]]:
    """One pytest run of ``files`` on ``route``; its outcomes, seconds and command."""
    command = [sys.executable, "-m", "pytest", "-p", "stages12", "-p", "no:cacheprovider",
               f"--junitxml={junit}", "-q", *files]  # fmt: skip
    if keyword:
        command += ["-k", keyword]
    start = time.perf_counter()
    subprocess.run(command, cwd=TESTS, env=_environment(route), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)  # fmt: skip
    return _outcomes(junit), time.perf_counter() - start, command


def _versions() -> dict[str, str]:
    code = "import torch, deepspeed; print(torch.__version__, deepspeed.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=_environment("deepspeed"), check=False).stdout.split()  # fmt: skip
    return {"torch": out[0], "deepspeed": out[1]} if len(out) == 2 else {}


def write_results(routes: dict, seconds: dict, commands: dict, out: Path, argv: list[str]) -> None:
    """The JSON file: per test, each route's outcome, and why flatzero fails where DeepSpeed
    passes (``reasons.json``)."""
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
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(FILES), help="test files (under tests/)")
    parser.add_argument("-k", dest="keyword", default=KEYWORD, help="pytest -k expression")
    parser.add_argument("--routes", nargs="+", default=["deepspeed", "flatzero"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--merge", nargs="+", type=Path, default=None,
        help="combine result files written earlier (a route each: run at once) into --out",
    )  # fmt: skip
    args = parser.parse_args(argv)
    routes: dict = {}
    seconds: dict = {}
    commands: dict = {}
    if args.merge:
        for path in args.merge:
            data = json.loads(path.read_text())
            for route in data["seconds"]:
                routes[route] = {t: row[route] for t, row in data["tests"].items() if route in row}
                seconds[route] = data["seconds"][route]
                commands[route] = data["pytest_commands"][route]
    for route in [] if args.merge else args.routes:
        junit = args.out.with_suffix(f".{route}.xml")
        routes[route], seconds[route], command = run_route(route, args.files, args.keyword, junit)
        commands[route] = " ".join(command[1:])
        junit.unlink(missing_ok=True)
    write_results(routes, seconds, commands, args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
