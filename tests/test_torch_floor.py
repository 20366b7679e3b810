"""The torch floor pyproject declares covers the newest torch API the package uses (issue 41
item 6: ``group_dst``/``group_src`` arrived in torch 2.6 while the floor said 2.4, so 2.4/2.5
crashed at the first stage 2 reduction).

``GATED`` lists the version-gated torch APIs flatzero calls, each with the release that
brought it; the test greps ``src/`` for each and asserts the declared floor is at least the
newest one found. A new call to a newer API belongs in ``GATED`` (and raises the floor).
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]

GATED: dict[str, tuple[tuple[int, int], str]] = {
    # pattern in the source -> (first torch release with it, what it is)
    r"\bgroup_(?:dst|src)\s*=": ((2, 6), "group-relative ranks in c10d collectives"),
    r"\btorch\.accelerator\b|getattr\(torch, \"accelerator\"": ((2, 6), "torch.accelerator"),
    r"\bget_device_module\(": ((2, 3), "torch.get_device_module"),
    r"\bregister_post_accumulate_grad_hook\(": ((2, 1), "post-accumulate-grad hooks"),
}


def declared_floor() -> tuple[int, int]:
    """``(major, minor)`` of the ``torch>=`` requirement in pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'"torch>=(\d+)\.(\d+)[^"]*"', text)
    assert match, "pyproject.toml declares no torch>= floor"
    return int(match.group(1)), int(match.group(2))


def needed_floor(sources: dict[str, str]) -> tuple[tuple[int, int], list[str]]:
    """The newest release any ``GATED`` API found in ``sources`` (path -> text) needs, and
    where each API of that release is used."""
    newest, where = (0, 0), []
    for pattern, (version, _) in GATED.items():
        hits = [path for path, text in sources.items() if re.search(pattern, text)]
        if hits and version > newest:
            newest, where = version, []
        if hits and version == newest:
            where += [f"{path} ({pattern})" for path in hits]
    return newest, where


def _sources() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for path in sorted((ROOT / "src" / "flatzero").rglob("*.py"))
    }


def test_declared_floor_covers_the_newest_api_used():
    floor = declared_floor()
    needed, where = needed_floor(_sources())
    assert needed >= (2, 6), "the table no longer finds group_dst/group_src: update GATED"
    assert floor >= needed, f"torch>={floor} but {needed} is needed by: {where}"


def test_the_check_refuses_a_floor_below_an_api_in_use():
    """The check is not vacuous: a source calling ``dist.reduce(..., group_dst=...)`` needs
    2.6, a floor of 2.4 is below it."""
    needed, where = needed_floor({"x.py": "dist.reduce(t, group_dst=1, group=pg)"})
    assert needed == (2, 6) and where
    assert needed > (2, 4)
    assert needed_floor({"x.py": "param.register_post_accumulate_grad_hook(h)"})[0] == (2, 1)


def test_the_gated_apis_exist_in_this_torch():
    """Every API in the table is real (the patterns name what torch calls them)."""
    assert "group_dst" in inspect.signature(dist.reduce).parameters
    assert "group_src" in inspect.signature(dist.broadcast).parameters
    assert hasattr(torch, "accelerator") and hasattr(torch, "get_device_module")
    assert hasattr(torch.nn.Parameter, "register_post_accumulate_grad_hook")
