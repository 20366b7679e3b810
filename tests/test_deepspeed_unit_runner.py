"""benchmarks/deepspeed_unit_tests.py reads pytest's verbose log: which tests ended how, and
which one started and never ended (the one that hung), so a hang costs one test, not the run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "deepspeed_unit_tests.py"
spec = importlib.util.spec_from_file_location("flatzero_ds_unit_runner", SCRIPT)
runner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(runner)

A = "unit/runtime/zero/test_a.py::TestA::test[False]"
B = "unit/runtime/zero/test_a.py::TestA::test[True]"
HEADER = (
    "\x1b[1m============================= test session starts ====\x1b[0m\ncollected 2 items\n\n"
)


def test_a_test_started_without_an_outcome_is_the_hung_one():
    log = f"--- flatzero: -m pytest ...\n{HEADER}{A} \x1b[32mPASSED\x1b[0m [ 50%]\n{B} "
    done, hung = runner._from_log(log)
    assert done == {A: {"outcome": "passed", "message": ""}}
    assert hung == B


def test_the_summaries_after_the_tests_name_no_hung_test():
    log = (
        f"{HEADER}{A} FAILED [ 50%]\n{B} SKIPPED [100%]\n"
        f"=== warnings summary ===\n{A}\n  UserWarning: ...\n"
        f"=== short test summary info ===\nFAILED {A} - AssertionError\n"
    )
    done, hung = runner._from_log(log)
    assert {t: o["outcome"] for t, o in done.items()} == {A: "failed", B: "skipped"}
    assert hung is None


def test_junit_ids_match_the_junit_files_form():
    assert runner._junit_id(B) == "unit.runtime.zero.test_a.TestA::test[True]"


def _result(route: str, seconds: float, tests: dict[str, str]) -> dict:
    return {
        "command": f"run {route} {sorted(tests)}",
        "date": "today",
        "seconds": {route: seconds},
        "pytest_commands": {route: "pytest"},
        "tests": {t: {route: {"outcome": o, "message": ""}} for t, o in tests.items()},
    }


def test_a_merged_rerun_replaces_outcomes_and_is_listed_apart():
    routes, seconds, commands, reruns = {}, {}, {}, []
    runner._merge(_result("flatzero", 10.0, {A: "failed"}), routes, seconds, commands, reruns)
    runner._merge(_result("flatzero", 5.0, {B: "passed"}), routes, seconds, commands, reruns)
    runner._merge(_result("flatzero", 3.0, {A: "passed"}), routes, seconds, commands, reruns)
    assert {t: o["outcome"] for t, o in routes["flatzero"].items()} == {A: "passed", B: "passed"}
    assert seconds == {"flatzero": 15.0}  # a part adds its time, a rerun does not
    assert [r["replaces"] for r in reruns] == [[A]] and reruns[0]["seconds"] == 3.0
