"""docs/huggingface.md's table of the versions tested is the installed packages' (issue 38
item 6): a package the table lists is either not installed here (skipped) or installed at
the listed version; one the table calls "not installed, not tested" must not be installed
(else the suite ran with it and the table is stale)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "huggingface.md"
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "peft", "trl")
NOT_TESTED = "not installed, not tested"
_ROW = re.compile(r"^\| (\S+) \| ([^|]+?) \|$")


def table_versions(text: str) -> dict[str, str]:
    """The table under ``## Install``: package -> version (or ``NOT_TESTED``)."""
    section = re.split(r"^## ", text.split("## Install\n", 1)[1], maxsplit=1, flags=re.M)[0]
    rows = (_ROW.match(line) for line in section.splitlines())
    return {m[1]: m[2] for m in rows if m and m[1] not in ("package", "---")}


def installed(package: str) -> str | None:
    """The installed version without its local part (``2.13.0+cpu`` -> ``2.13.0``)."""
    try:
        return importlib.metadata.version(package).split("+", 1)[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def test_the_table_lists_every_package():
    assert sorted(table_versions(DOC.read_text())) == sorted(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_the_table_is_the_installed_version(package):
    listed = table_versions(DOC.read_text())[package]
    version = installed(package)
    if version is None:
        pytest.skip(f"{package} is not installed")
    assert listed != NOT_TESTED, (
        f"{package} {version} is installed, and docs/huggingface.md's table says "
        f"'{NOT_TESTED}': run the suite with it and write {version} there"
    )
    assert listed == version, (
        f"docs/huggingface.md's table says {package} {listed}, installed is {version}: "
        "run the suite with it and update the table"
    )


def test_a_stale_table_is_found():
    text = "## Install\n\n| package | version tested |\n|---|---|\n| torch | 1.0.0 |\n\n## Next\n"
    assert table_versions(text) == {"torch": "1.0.0"}
    assert installed("torch") != "1.0.0"
