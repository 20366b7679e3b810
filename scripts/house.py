"""The house order of ``src/flatzero``: its rooms, their floors, and the imports between them.

A *room* is a top-level module (``flatzero/comm.py`` is ``comm``) or a subpackage with
everything under it (``flatzero/flatten/`` is ``flatten``); the package's own
``__init__.py`` is the room ``flatzero``. Every room stands on one floor. An import may go
to a room on the same floor or on a floor below, never up, and no chain of imports may come
back to where it started, neither between modules nor between rooms. Inside a subpackage
the modules stand on floors of their own (``INNER_FLOORS``) under the same rule.

Every import counts, wherever it is written: at the top of a module, inside a function
(a lazy import is a dependency that is only paid later), under ``if TYPE_CHECKING:`` (a
type is knowledge of the room that defines it). ``from X import name`` is an arrow to the
module ``X.name`` when that is a module, else to ``X``. ``ALLOWED_UP`` lists the few
upward arrows accepted, each with its reason; an arrow listed there must exist (a stale
entry is an error) and may not close a circle.

``tests/test_house_order.py`` checks the package against this plan;
``scripts/plot_house.py`` draws it (``docs/house.png``) and writes the floors table of
``docs/architecture.md``. Standard library only: the test parses about 150 files in well
under a second.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "flatzero"
_HERE = "scripts/house.py"
SRC = Path(__file__).resolve().parent.parent / "src"

FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # (floor, rooms), from the ground up
    (
        "data",
        (
            "_version",
            "words",
            "dtypes",
            "owners",
            "layout",
            "config",
            "cli_types",
            "checkpoint_options",
            "ports",
            "gcpause",
            "progress",
            "models",
        ),
    ),
    ("device seam", ("accel",)),
    ("placement", ("devices", "hostmem", "params", "storage")),
    ("ranks", ("comm", "own_groups", "control", "process_group", "roll_call")),
    ("host and memory", ("cores", "memory", "procmem", "report")),
    ("flatten", ("flatten",)),
    ("optimizer", ("optim", "loading")),
    ("checkpoint", ("checkpoint",)),
    ("deepspeed", ("deepspeed",)),
    ("measuring", ("measure",)),
    ("doors", ("flatzero", "run", "launch", "plan")),
    ("tools", ("harness", "demo_spec", "demo", "testing")),
    ("command line", ("cli", "__main__")),
)
"""The floors from the ground up and the rooms on each.

``deepspeed`` is everything flatzero knows of DeepSpeed (the door's engine, the patch, the
checkpoint format); no room below it mentions DeepSpeed. ``measure`` stands above it
because its baselines reimplement DeepSpeed's flatten with DeepSpeed's padding and
partition rule, whose only home is ``deepspeed.layout`` (pure: it imports only ``layout``);
only ``plan``, the tools and the command line use ``measure``."""

ROOMS: dict[str, str] = {
    "_version": "the version, readable without importing the package",
    "words": "how counts read in messages (plural)",
    "dtypes": "every dtype name: short, torch, safetensors, element size",
    "owners": "whole-param placement: each whole param on one owner rank, balanced by cost",
    "layout": "plan_layout: order, alignment, buckets, each rank's slices; pure metadata",
    "config": "FlattenConfig, frozen data; checks that rooms above register run at construction",
    "cli_types": "argparse types of the command line (counts with bounds, sizes)",
    "checkpoint_options": "options of export, import-deepspeed, export-deepspeed (no torch)",
    "ports": "a free TCP port for a local rendezvous",
    "gcpause": "the garbage collector paused around init",
    "progress": "progress bars for long work: rank 0, a terminal, FLATZERO_PROGRESS",
    "models": "model shapes built without downloads (Llama, Qwen3-MoE), for plan, bench, demo",
    "accel": "the device seam: every call to an accelerator runtime",
    "devices": "which device a rank uses; where a process group runs collectives",
    "hostmem": "host buffers (huge pages), staging buffers (pinned through the seam)",
    "params": "collect_param_groups: trainable params once each, names, options",
    "storage": "safetensors bytes: one header parser, writer, verified reads, host images",
    "comm": "collectives that work without a process group; checks of sameness across ranks",
    "process_group": "the default process group, made as deepspeed.initialize makes it",
    "own_groups": "flatzero's own groups beside a user's: the gloo control group, the collectives'",
    "control": "what ranks agree on over the control group (any rank failed, host-work waits)",
    "roll_call": "a failed collective of the step: which ranks stopped answering, via the store",
    "cores": "this process's usable cores, a rank's share of them, init's thread count",
    "memory": "free device memory, out-of-memory errors",
    "procmem": "this process's RSS, peak RSS and CPU seconds; the host allocator trimmed",
    "report": "the init report: phases, bytes moved by kind, peaks",
    "measure": "hardware rates and DeepSpeed's flatten algorithms, for plan and the benchmarks",
    "flatten": "flatten_parameters: tiers, their registry, tier choice, bucket by bucket",
    "optim": "ZeroOptimizer: fp32 shards, gradient reduction, the inner optimizer's step",
    "loading": "load_flat: flatten straight from a safetensors checkpoint",
    "checkpoint": "save, load at any world size, export to safetensors",
    "deepspeed": "the DeepSpeed door (engine, config), patch_deepspeed, DeepSpeed's checkpoints",
    "flatzero": "the package's public names (flatzero.__all__)",
    "run": "python -m flatzero.run, the launcher: a script under deepspeed.patch, unchanged",
    "launch": "run a function on N local ranks as torchrun would (tests, benchmarks, demo)",
    "plan": "flatzero plan: predicted memory, tier, bytes per link and init time",
    "harness": "finds the benchmark harness (benchmarks/flatzero_bench) for bench and demo",
    "demo_spec": "flatzero demo's settings and options (no torch: --help answers at once)",
    "demo": "flatzero demo: the DeepSpeed door end to end, against DeepSpeed's",
    "testing": "for tests and benchmarks: an emulated accelerator, the real DeepSpeed set up",
    "cli": "the flatzero command: parses, dispatches, prints one line on a user error",
    "__main__": "python -m flatzero",
}
"""What each room owns, one line each."""

INNER_FLOORS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    # room: ((floor, modules), ...) from the ground up; a module is named inside its room
    # ("driver" is flatzero.flatten.driver, "emulated.state" is
    # flatzero.testing.emulated.state) and the room's own __init__.py is "__init__".
    "flatten": (
        ("pieces", ("alloc", "buffers", "faults", "source")),
        ("tiers", ("tiers", "registry")),
        ("choice and driver", ("choice", "driver")),
        ("api", ("api", "__init__")),
    ),
    "plan": (
        (
            "figures",
            ("names", "hardware", "memory_model", "hf_model", "model_source", "muon", "decision"),
        ),
        ("rates", ("calibration", "traffic", "rates", "time_model", "comm_estimate")),
        ("planner", ("planner", "advice")),
        ("output", ("report", "options", "cli", "__init__")),
    ),
    "measure": (
        ("measures", ("baselines", "limits", "settle")),
        ("package", ("__init__",)),
    ),
    "models": (
        ("shapes", ("config", "layers", "_params", "stats")),
        ("modules", ("transformer", "materialize", "safetensors_io")),
        ("architectures", ("llama", "qwen3_moe")),
        ("zoo", ("zoo", "bench_models", "__init__")),
    ),
    "storage": (
        ("format", ("checksum", "header")),
        ("files", ("image", "index", "tensorfile", "writer", "__init__")),
    ),
    "checkpoint": (
        (
            "records",
            (
                "config",
                "format",
                "rng",
                "run_id",
                "reshard",
                "exit",
                "checkpointer",
                "optimizer_state",
            ),
        ),
        ("files", ("atomic", "validate", "writer", "reader", "recovery", "reports", "async_save")),
        ("collected", ("collect", "begin")),
        ("protocol", ("save", "load", "export", "fallback", "preemption", "__init__")),
    ),
    "optim": (
        (
            "pieces",
            (
                "buckets",
                "gather",
                "deepspeed_muon",
                "whole",
                "inner",
                "norm",
                "config",
                "grad_check",
                "scaler",
                "agreement",
                "torch_clip",
            ),
        ),
        (
            "reduce and step",
            ("reducers", "stage1", "stage2", "state", "offload", "stepper", "overlap"),
        ),
        ("optimizer", ("prepare", "zero", "__init__")),
    ),
    "deepspeed": (
        (
            "format",
            (
                "layout",
                "pickle",
                "base_optimizer",
                "muon_state",
                "target",
                "state",
                "reader",
                "writer",
                "zero_to_fp32",
                "__init__",
            ),
        ),
        (
            "config",
            (
                "engine.errors",
                "engine.schedulers",
                "engine.config.keys",
                "engine.config.reader",
                "engine.config.schema",
                "engine.config.flatzero_section",
                "engine.config.offload",
                "engine.config.optimizer",
                "engine.config.sections",
                "engine.config.parse",
                "engine.config",
            ),
        ),
        ("convert", ("convert.incoming", "convert.outgoing", "convert.cli", "convert")),
        (
            "engine",
            (
                "engine.client",
                "engine.param_sync",
                "engine.report",
                "engine.weights",
                "engine.weights16",
                "engine.getters",
                "engine.door_optimizer",
                "engine.full_values",
                "engine.safe_full",
                "engine.lr_scheduler",
                "engine.muon_groups",
                "engine.optimizer_choice",
                "engine.rank_agreement",
                "engine.preemption",
                "engine.checkpointing",
                "engine.compiling",
                "engine.user_backward",
                "engine.unused_check",
                "engine.engine",
                "engine.deepspeed_compat",
                "engine.live",
                "engine.initialize",
                "engine",
            ),
        ),
        ("patch", ("patch",)),
    ),
    "testing": (
        ("state", ("emulated.pinning", "emulated.state")),
        ("memory and streams", ("emulated.storage", "emulated.streams")),
        (
            "ops, device module, collectives",
            (
                "emulated.kernels",
                "emulated.fallback",
                "emulated.device_module",
                "emulated.collectives",
            ),
        ),
        (
            "registration",
            ("emulated.registration", "emulated", "deepspeed", "host_ops", "slowlink", "__init__"),
        ),
    ),
}
"""The floors inside a subpackage, for the rooms that have them: an import between two
modules of the room may go to the same inner floor or below, never up. A room not listed
is checked for circles only; giving it floors is one entry here."""

TOOLS = ("harness", "testing")
"""Rooms that nothing on the product's path imports (``PRODUCT``), whatever the floors say."""

PRODUCT = (
    "deepspeed",
    "optim",
    "flatten",
    "checkpoint",
    "plan",
    "loading",
    "run",
    "launch",
    "flatzero",
)
"""The product's path: the rooms a user's training or ``flatzero plan`` runs."""

HARNESS = "flatzero_bench"
"""The benchmark harness's package (``benchmarks/flatzero_bench``), outside ``src``."""

HARNESS_TESTS = ("test_bench_*.py", "test_*_bench.py", "test_demo.py", "test_cli.py")
"""The test files of the harness (``flatzero bench``, ``flatzero demo``, the command line):
the only ones that may import it. Every other test is a product test."""

TESTS = SRC.parent / "tests"


def tests_importing_harness(tests: Path = TESTS) -> list[str]:
    """The product tests under ``tests`` that import the harness, ``path:line`` each."""
    out = []
    for path in sorted(tests.rglob("*.py")):
        if any(path.match(pattern) for pattern in HARNESS_TESTS):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if any(name.split(".")[0] == HARNESS for name in names):
                out.append(f"{path.relative_to(tests.parent)}:{node.lineno}")
    return out


ALLOWED_UP: dict[tuple[str, str], str] = {}
"""Upward arrows accepted, as ``(importer, imported)`` modules, each with its reason (between
rooms, or inside a room with ``INNER_FLOORS``)."""


@dataclass(frozen=True)
class Arrow:
    """One import: ``source`` (a module) imports ``target`` (a module) at ``line``."""

    source: str
    target: str
    line: int
    kind: str  # "top", "lazy" (inside a function) or "typing" (under TYPE_CHECKING)


def room_of(module: str) -> str:
    """The room of ``module`` (``flatzero.flatten.api`` -> ``flatten``)."""
    parts = module.split(".")
    return PACKAGE if len(parts) == 1 else parts[1]


def floor_of(room: str) -> int:
    """The floor number of ``room`` (0 is the ground); KeyError when it has none."""
    for number, (_name, rooms) in enumerate(FLOORS):
        if room in rooms:
            return number
    raise KeyError(room)


def modules(src: Path = SRC) -> dict[str, Path]:
    """Every module of the package under ``src``, by dotted name."""
    out = {}
    for path in sorted((src / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


class _Imports(ast.NodeVisitor):
    """The package's imports in one module, as (name, fallback, line, kind): the arrow goes
    to ``name`` when that is a module, else to ``fallback`` (``from X import name``)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.found: list[tuple[str, str, int, str]] = []
        self._functions = 0
        self._typing = 0

    def _kind(self) -> str:
        return "typing" if self._typing else "lazy" if self._functions else "top"

    def _add(self, name: str, fallback: str, line: int) -> None:
        self.found.append((name, fallback, line, self._kind()))

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self._functions += 1
        self.generic_visit(node)
        self._functions -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
        if name != "TYPE_CHECKING":
            self.generic_visit(node)
            return
        self._typing += 1
        for child in node.body:
            self.visit(child)
        self._typing -= 1
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == PACKAGE:
                self._add(alias.name, alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            where = ".".join(base + ([node.module] if node.module else []))
        else:
            where = node.module or ""
        if where.split(".")[0] != PACKAGE:
            return
        for alias in node.names:
            self._add(f"{where}.{alias.name}", where, node.lineno)


def texts(src: Path = SRC) -> dict[str, str]:
    """The text of every module of the package, by dotted name (a package's name ends in
    ``.__init__`` here, so that relative imports resolve from it; ``arrows`` drops it)."""
    out = {}
    for name, path in modules(src).items():
        key = f"{name}.__init__" if path.name == "__init__.py" else name
        out[key] = path.read_text(encoding="utf-8")
    return out


def arrows(sources: Mapping[str, str]) -> list[Arrow]:
    """Every import between the modules of ``sources`` (``texts()``, or a planted house)."""
    packages = {key.removesuffix(".__init__") for key in sources if key.endswith(".__init__")}
    by_name = {key.removesuffix(".__init__"): text for key, text in sources.items()}
    out: dict[Arrow, None] = {}  # one arrow per import statement
    for module, text in by_name.items():
        for name, fallback, line, kind in _imports(module, module in packages, text):
            target = name if name in by_name else fallback
            while target and target not in by_name:  # flatzero.x.Name -> flatzero.x
                target = target.rpartition(".")[0]
            if target and target != module:
                out[Arrow(module, target, line, kind)] = None
    return list(out)


@functools.lru_cache(maxsize=4096)
def _imports(module: str, is_package: bool, text: str) -> tuple[tuple[str, str, int, str], ...]:
    """The imports of one module, parsed once per text (the tests plant into copies)."""
    visitor = _Imports(module, is_package)
    visitor.visit(ast.parse(text, filename=module))
    return tuple(visitor.found)


def cycles(edges: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The circles of a directed graph: its strongly connected components of more than one
    node, each sorted (Tarjan's algorithm, iterative)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def room_edges(found: Iterable[Arrow]) -> set[tuple[str, str]]:
    """The arrows between rooms (an arrow inside a room is not one)."""
    return {
        (room_of(a.source), room_of(a.target))
        for a in found
        if room_of(a.source) != room_of(a.target)
    }


def upward(found: Iterable[Arrow]) -> list[Arrow]:
    """The arrows that climb to a higher floor."""
    return [
        a
        for a in found
        if room_of(a.source) != room_of(a.target)
        and floor_of(room_of(a.target)) > floor_of(room_of(a.source))
    ]


def inner_name(module: str) -> str:
    """``module`` named inside its room (``flatzero.flatten.driver`` -> ``driver``; a room's
    own ``__init__.py`` is ``__init__``)."""
    room = room_of(module)
    prefix = f"{PACKAGE}.{room}"
    return "__init__" if module == prefix else module.removeprefix(prefix + ".")


def inner_floor_of(
    module: str, inner: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]] = INNER_FLOORS
) -> int | None:
    """The inner floor number of ``module`` in its room (0 is the ground); None when its
    room has no inner floors or does not place it."""
    for number, (_name, names) in enumerate(inner.get(room_of(module), ())):
        if inner_name(module) in names:
            return number
    return None


def inner_upward(
    found: Iterable[Arrow],
    inner: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]] = INNER_FLOORS,
) -> list[Arrow]:
    """The arrows inside a room that climb to a higher inner floor of it."""
    out = []
    for a in found:
        if room_of(a.source) != room_of(a.target):
            continue
        source, target = inner_floor_of(a.source, inner), inner_floor_of(a.target, inner)
        if source is not None and target is not None and target > source:
            out.append(a)
    return out


def inner_problems(
    found: list[Arrow],
    names: Iterable[str],
    allowed: Mapping[tuple[str, str], str] = ALLOWED_UP,
    inner: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]] = INNER_FLOORS,
) -> list[str]:
    """Everything wrong with the floors inside the rooms ``inner`` lists, one line each."""
    out = []
    names = sorted(names)
    rooms = {room_of(n) for n in names}
    out.extend(
        f"INNER_FLOORS names {room!r}, which is no room" for room in inner if room not in rooms
    )
    for room, floors in inner.items():
        here = {inner_name(n) for n in names if room_of(n) == room}
        listed = [m for _floor, on_floor in floors for m in on_floor]
        out.extend(
            f"module {m!r} of room {room!r} has no inner floor: add it to "
            f"INNER_FLOORS[{room!r}] in {_HERE}"
            for m in sorted(here - set(listed))
        )
        out.extend(
            f"INNER_FLOORS[{room!r}] lists {m!r}, which is no module of {room!r}"
            for m in listed
            if m not in here
        )
        out.extend(
            f"INNER_FLOORS[{room!r}] lists {m!r} twice"
            for m in sorted({m for m in listed if listed.count(m) > 1})
        )
    if out:
        return out
    for a in inner_upward(found, inner):
        if (a.source, a.target) not in allowed:
            floors = inner[room_of(a.source)]
            out.append(
                f"{a.source} (inner floor {floors[inner_floor_of(a.source, inner)][0]!r}) "
                f"imports {a.target} (inner floor {floors[inner_floor_of(a.target, inner)][0]!r})"
                f" at line {a.line} ({a.kind}): an arrow up inside {room_of(a.source)!r}"
            )
    return out


def problems(
    found: list[Arrow],
    names: Iterable[str],
    allowed: Mapping[tuple[str, str], str] = ALLOWED_UP,
    inner: Mapping[str, tuple[tuple[str, tuple[str, ...]], ...]] = INNER_FLOORS,
) -> list[str]:
    """Everything wrong with the house of modules ``names`` whose imports are ``found``, one
    line each (empty when it is in order); ``inner`` gives the floors inside rooms."""
    out = []
    names = list(names)
    rooms = sorted({room_of(name) for name in names})
    for room in rooms:
        if not any(room in r for _n, r in FLOORS):
            out.append(
                f"room {room!r} has no floor: add it to FLOORS and ROOMS in scripts/house.py"
            )
    for _name, on_floor in FLOORS:
        out.extend(
            f"FLOORS lists {room!r}, which is no room" for room in on_floor if room not in rooms
        )
    if out:
        return out
    for circle in cycles((a.source, a.target) for a in found):
        out.append(f"modules import each other in a circle: {' -> '.join(circle)}")
    for circle in cycles(room_edges(found)):
        out.append(f"rooms import each other in a circle: {' -> '.join(circle)}")
    for a in upward(found):
        if (a.source, a.target) not in allowed:
            out.append(
                f"{a.source} (floor {FLOORS[floor_of(room_of(a.source))][0]!r}) imports "
                f"{a.target} (floor {FLOORS[floor_of(room_of(a.target))][0]!r}) at line "
                f"{a.line} ({a.kind}): an arrow up"
            )
    out.extend(inner_problems(found, names, allowed, inner))
    for a in found:
        if room_of(a.source) in PRODUCT and room_of(a.target) in TOOLS:
            out.append(f"{a.source} (product) imports {a.target} (a tool) at line {a.line}")
    present = {(a.source, a.target) for a in [*upward(found), *inner_upward(found, inner)]}
    for pair in allowed:
        if pair not in present:
            out.append(f"ALLOWED_UP lists {pair[0]} -> {pair[1]}, which no longer climbs: drop it")
    return out


MAX_FUNCTION_LINES = 75
"""The most lines a function's body may take, its docstring aside."""

MAX_MODULE_LINES = 550
"""The most lines a module may take, but those of ``SIZE_EXEMPT`` rooms."""

SIZE_EXEMPT = ("models", "demo", "cli")
"""Rooms whose modules may be longer: model definitions, the demo's script, the command
line's table of commands."""


def oversized(sources: Mapping[str, str]) -> list[str]:
    """Modules over ``MAX_MODULE_LINES`` lines and functions whose body (docstring aside)
    is over ``MAX_FUNCTION_LINES`` lines, as ``"module: what (N lines)"``."""
    found = []
    for module, text in sources.items():
        lines = text.count("\n")
        if (
            lines > MAX_MODULE_LINES
            and room_of(module.removesuffix(".__init__")) not in SIZE_EXEMPT
        ):
            found.append(f"{module}: the module ({lines} lines)")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body
            if ast.get_docstring(node) is not None and len(body) > 1:
                body = body[1:]
            length = (node.end_lineno or body[-1].lineno) - body[0].lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{module}: {node.name} ({length} lines)")
    return found
