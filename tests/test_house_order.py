"""Issue 27: the house order of ``src/flatzero`` (``scripts/house.py`` is the plan).

Every module's imports, read with ``ast`` (at the top, inside functions, under
``TYPE_CHECKING``): no circle between modules or between rooms (a top-level module or a
subpackage), no arrow up a floor but those ``house.ALLOWED_UP`` lists with a reason, none up
an inner floor of a subpackage (``house.INNER_FLOORS``), nothing on the product's path
imports ``harness`` or ``testing``, and no product test imports the benchmark harness
(``flatzero_bench``). The checker is itself checked: violations planted in a copy of the
package's text are all found.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import house


@pytest.fixture(scope="module")
def sources() -> dict[str, str]:
    return house.texts()


def _names(sources: dict[str, str]) -> list[str]:
    return [key.removesuffix(".__init__") for key in sources]


def test_every_room_has_one_floor_and_one_line(sources):
    on_floors = [room for _name, rooms in house.FLOORS for room in rooms]
    assert len(on_floors) == len(set(on_floors)), "a room on two floors"
    assert set(on_floors) == set(house.ROOMS), "FLOORS and ROOMS name different rooms"
    assert set(on_floors) == {house.room_of(n) for n in _names(sources)}
    assert set(house.PRODUCT) | set(house.TOOLS) <= set(on_floors)
    for importer, imported in house.ALLOWED_UP:
        assert house.ALLOWED_UP[importer, imported].strip(), "an allowed arrow needs its reason"


def test_every_module_of_a_room_with_inner_floors_has_one(sources):
    names = _names(sources)
    for room, floors in house.INNER_FLOORS.items():
        assert room in house.ROOMS, room
        listed = [m for _floor, on_floor in floors for m in on_floor]
        assert len(listed) == len(set(listed)), f"a module on two inner floors of {room}"
        here = {house.inner_name(n) for n in names if house.room_of(n) == room}
        assert set(listed) == here, room


def test_the_house_is_in_order(sources):
    found = house.arrows(sources)
    assert house.problems(found, _names(sources)) == []


def test_the_product_path_imports_no_tool(sources):
    found = house.arrows(sources)
    bad = [
        f"{a.source} -> {a.target}"
        for a in found
        if house.room_of(a.source) in house.PRODUCT and house.room_of(a.target) in house.TOOLS
    ]
    assert bad == []


def test_no_product_test_imports_the_harness():
    assert house.tests_importing_harness() == []


def test_a_product_test_importing_the_harness_is_found(tmp_path):
    (tmp_path / "tests" / "gpu").mkdir(parents=True)
    (tmp_path / "tests" / "gpu" / "test_x.py").write_text("import flatzero_bench.common\n")
    (tmp_path / "tests" / "test_y.py").write_text("def f():\n    from flatzero_bench import a\n")
    (tmp_path / "tests" / "test_bench_z.py").write_text("import flatzero_bench\n")
    found = house.tests_importing_harness(tmp_path / "tests")
    assert found == ["tests/gpu/test_x.py:1", "tests/test_y.py:2"]


def test_the_reader_sees_every_kind_of_import():
    planted = {
        "flatzero.__init__": "from .a import f\n",
        "flatzero.a": (
            "from typing import TYPE_CHECKING\n"
            "import flatzero.b\n"
            "from . import c\n"
            "if TYPE_CHECKING:\n"
            "    from .sub.d import D\n"
            "def f():\n"
            "    from .sub import e\n"
            "    return e\n"
        ),
        "flatzero.b": "",
        "flatzero.c": "",
        "flatzero.sub.__init__": "from .e import g\n",
        "flatzero.sub.d": "from ..b import x\n",
        "flatzero.sub.e": "from . import d\ndef g():\n    import os\n",
    }
    found = {(a.source, a.target, a.kind) for a in house.arrows(planted)}
    assert found == {
        ("flatzero", "flatzero.a", "top"),
        ("flatzero.a", "flatzero.b", "top"),
        ("flatzero.a", "flatzero.c", "top"),
        ("flatzero.a", "flatzero.sub.d", "typing"),
        ("flatzero.a", "flatzero.sub.e", "lazy"),
        ("flatzero.sub", "flatzero.sub.e", "top"),
        ("flatzero.sub.d", "flatzero.b", "top"),
        ("flatzero.sub.e", "flatzero.sub.d", "top"),
    }


def _plant(sources: dict[str, str], module: str, text: str) -> list[str]:
    planted = dict(sources)
    planted[module] = planted.get(module, "") + text
    return house.problems(house.arrows(planted), _names(planted))


def test_planted_violations_are_caught(sources):
    # an arrow up, lazy: the layout (data) asks the engine
    planted = "def f():\n    from .deepspeed.engine import Engine\n"
    found = _plant(sources, "flatzero.layout", planted)
    climbs = "flatzero.layout (floor 'data') imports flatzero.deepspeed.engine"
    assert any(climbs in p for p in found)
    assert any("(lazy): an arrow up" in p for p in found)
    # an arrow up under TYPE_CHECKING
    found = _plant(
        sources,
        "flatzero.config",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .flatten.api import x\n",
    )
    assert any("flatzero.config" in p and "(typing): an arrow up" in p for p in found)
    # a circle between modules of one floor (params imports dtypes)
    found = _plant(sources, "flatzero.dtypes", "from .params import collect_param_groups\n")
    assert any(p.startswith("modules import each other in a circle") for p in found)
    assert any(p.startswith("rooms import each other in a circle") for p in found)
    # a circle between rooms only: no module's imports come back to it
    found = _plant(sources, "flatzero.memory", "from .flatten.buffers import shaped_view\n")
    assert not any(p.startswith("modules import each other") for p in found)
    assert any(p.startswith("rooms import each other") and "memory" in p for p in found)
    # a circle inside one room
    found = _plant(sources, "flatzero.flatten.faults", "from .api import flatten_parameters\n")
    assert any("circle" in p and "flatzero.flatten.faults" in p for p in found)
    # the product imports the benchmark harness
    found = _plant(sources, "flatzero.optim.zero", "def f():\n    from ..harness import HARNESS\n")
    assert any("(product) imports flatzero.harness" in p for p in found)
    # a new room nobody gave a floor
    found = _plant(sources, "flatzero.newroom", "from . import layout\n")
    assert found == ["room 'newroom' has no floor: add it to FLOORS and ROOMS in scripts/house.py"]


def test_an_allowed_arrow_that_no_longer_climbs_is_reported(sources):
    found = house.arrows(sources)
    stale = {("flatzero.layout", "flatzero.deepspeed.engine"): "planted"}
    problems = house.problems(found, _names(sources), {**house.ALLOWED_UP, **stale})
    assert problems == [
        "ALLOWED_UP lists flatzero.layout -> flatzero.deepspeed.engine, which no longer climbs: "
        "drop it"
    ]


def test_planted_inner_violations_are_caught(sources):
    # an arrow up inside a room, lazy: a piece of the flatten asks the tier choice
    found = _plant(sources, "flatzero.flatten.faults", "def f():\n    from .choice import x\n")
    assert any(
        p.startswith("flatzero.flatten.faults (inner floor 'pieces') imports ")
        and "flatzero.flatten.choice (inner floor 'choice and driver')" in p
        and p.endswith("(lazy): an arrow up inside 'flatten'")
        for p in found
    ), found
    # an arrow up inside a nested package, under TYPE_CHECKING
    found = _plant(
        sources,
        "flatzero.testing.emulated.storage",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .kernels import IMPLS\n",
    )
    assert any(
        "flatzero.testing.emulated.storage (inner floor" in p
        and "(typing): an arrow up inside 'testing'" in p
        for p in found
    ), found
    # a new module of a room with inner floors, on none of them
    found = _plant(sources, "flatzero.plan.newmodule", "from . import hardware\n")
    assert found == [
        "module 'newmodule' of room 'plan' has no inner floor: "
        "add it to INNER_FLOORS['plan'] in scripts/house.py"
    ]
    # an arrow up inside a room accepted by ALLOWED_UP, and reported once it no longer climbs
    planted = dict(sources)
    planted["flatzero.flatten.faults"] += "def f():\n    from .choice import x\n"
    allowed = {("flatzero.flatten.faults", "flatzero.flatten.choice"): "planted"}
    assert house.problems(house.arrows(planted), _names(planted), allowed) == []
    stale = house.problems(house.arrows(sources), _names(sources), allowed)
    assert stale == [
        "ALLOWED_UP lists flatzero.flatten.faults -> flatzero.flatten.choice, which no "
        "longer climbs: drop it"
    ]


def test_a_room_gets_inner_floors_with_one_entry():
    planted = {
        "flatzero.__init__": "",
        "flatzero.optim.__init__": "from .zero import Z\n",
        "flatzero.optim.zero": "from .config import C\n",
        "flatzero.optim.config": "",
    }
    found, names = house.arrows(planted), _names(planted)
    assert house.inner_problems(found, names, inner={}) == []  # no entry: circles only
    ordered = {"optim": (("data", ("config",)), ("optimizer", ("zero", "__init__")))}
    assert house.inner_problems(found, names, inner=ordered) == []
    upside_down = {"optim": (("data", ("zero",)), ("top", ("config", "__init__")))}
    assert house.inner_problems(found, names, inner=upside_down) == [
        "flatzero.optim.zero (inner floor 'data') imports flatzero.optim.config (inner floor "
        "'top') at line 1 (top): an arrow up inside 'optim'"
    ]
    wrong = {
        "optim": (("data", ("config", "gone")), ("top", ("__init__",))),
        "nowhere": (),
    }
    assert house.inner_problems(found, names, inner=wrong) == [
        "INNER_FLOORS names 'nowhere', which is no room",
        "module 'zero' of room 'optim' has no inner floor: "
        "add it to INNER_FLOORS['optim'] in scripts/house.py",
        "INNER_FLOORS['optim'] lists 'gone', which is no module of 'optim'",
    ]


def test_no_module_or_function_is_too_long(sources):
    assert house.oversized(sources) == []


def test_the_size_check_finds_long_modules_and_functions():
    lines = [f"    x{i} = {i}\n" for i in range(house.MAX_FUNCTION_LINES + 1)]
    body = "".join(lines)
    planted = {
        "flatzero.long": "def f():\n" + body,
        # the docstring does not count: 75 lines of code under 4 of docstring pass
        "flatzero.documented": 'def g():\n    """Doc.\n\n    more\n    """\n' + "".join(lines[1:]),
        "flatzero.big": "x = 1\n" * (house.MAX_MODULE_LINES + 1),
        "flatzero.models.big": "x = 1\n" * (house.MAX_MODULE_LINES + 1),
    }
    assert house.oversized(planted) == [
        f"flatzero.long: f ({house.MAX_FUNCTION_LINES + 1} lines)",
        f"flatzero.big: the module ({house.MAX_MODULE_LINES + 1} lines)",
    ]
