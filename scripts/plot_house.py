"""Draw the house of ``src/flatzero`` from its imports: ``docs/house.png``.

Usage: python scripts/plot_house.py [OUT.png] [--docs]

Rooms (top-level modules and subpackages) stand on their floors (``scripts/house.py``);
an arrow from one room to another means some module of the first imports some module of
the second (its width grows with the number of such imports); black arrows go down a
floor, blue ones stay on a floor, and a red one would climb (there are none: the test
``tests/test_house_order.py`` keeps it so). ``--docs`` also rewrites the floors table
between the ``house:begin`` and ``house:end`` markers of ``docs/architecture.md``.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import house

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- house:begin -->", "<!-- house:end -->"


def _positions(weights: dict[tuple[str, str], int]) -> dict[str, tuple[float, float]]:
    """x, y of every room: y its floor; x spread over the floor, ordered by the mean x of
    the rooms it imports (floors placed from the ground up), which keeps arrows short."""
    pos: dict[str, tuple[float, float]] = {}
    for number, (_name, rooms) in enumerate(house.FLOORS):

        def below(room: str) -> float:
            xs = [pos[b][0] for (a, b) in weights if a == room and b in pos]
            return sum(xs) / len(xs) if xs else 0.5

        ordered = sorted(rooms, key=below) if number else list(rooms)
        for i, room in enumerate(ordered):
            pos[room] = ((i + 1) / (len(ordered) + 1), float(number))
    return pos


def draw(out: Path) -> str:
    """Draw the house into ``out``; returns its one-line summary."""
    found = house.arrows(house.texts())
    weights: collections.Counter[tuple[str, str]] = collections.Counter(
        (house.room_of(a.source), house.room_of(a.target))
        for a in found
        if house.room_of(a.source) != house.room_of(a.target)
    )
    pos = _positions(weights)
    up = house.upward(found)
    circles = house.cycles(weights)
    fig, ax = plt.subplots(figsize=(15, 11))
    for number, (name, _rooms) in enumerate(house.FLOORS):
        ax.axhspan(number - 0.42, number + 0.42, color="0.95" if number % 2 else "0.9", lw=0)
        ax.text(-0.005, number, f"{number} {name}", ha="right", va="center", fontsize=10)
    for (a, b), n in sorted(weights.items()):
        (xa, ya), (xb, yb) = pos[a], pos[b]
        climbs = yb > ya
        color = "red" if climbs else "tab:blue" if ya == yb else "black"
        ax.add_patch(
            FancyArrowPatch(
                (xa, ya - (0.16 if ya != yb else -0.16)),
                (xb, yb + 0.16),
                arrowstyle="-|>",
                mutation_scale=9,
                lw=0.4 + 0.25 * min(n, 12),
                color=color,
                alpha=0.9 if climbs else 0.28,
                connectionstyle="arc3,rad=0.35" if ya == yb else "arc3,rad=0.04",
                zorder=1,
            )
        )
    for room, (x, y) in pos.items():
        product = room in house.PRODUCT
        tool = room in house.TOOLS
        face = "#ffe9c7" if tool else "#d9ecff" if product else "white"
        ax.text(
            x,
            y,
            room,
            ha="center",
            va="center",
            fontsize=9,
            zorder=3,
            bbox={"boxstyle": "round,pad=0.3", "fc": face, "ec": "0.3", "lw": 0.8},
        )
    rooms = len(pos)
    summary = (
        f"{rooms} rooms on {len(house.FLOORS)} floors, {sum(weights.values())} imports between "
        f"rooms ({len(weights)} arrows), {len(up)} climbing, {len(circles)} circles"
    )
    ax.set_title(
        f"src/flatzero, drawn from its imports by scripts/plot_house.py: {summary}\n"
        "blue boxes: the product's path; orange: tools it may not import; black arrows go "
        "down, blue ones stay on a floor",
        fontsize=11,
    )
    ax.set_xlim(-0.16, 1.0)
    ax.set_ylim(-0.6, len(house.FLOORS) - 0.4)
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return summary


def floors_table() -> str:
    """The floors as a Markdown table, the top floor first: floor, room, what it owns."""
    lines = ["| floor | room | owns |", "|---|---|---|"]
    for number, (name, rooms) in reversed(list(enumerate(house.FLOORS))):
        for i, room in enumerate(rooms):
            where = f"`{room}/`" if (house.SRC / house.PACKAGE / room).is_dir() else f"`{room}.py`"
            if room == house.PACKAGE:
                where = "`__init__.py`"
            floor = f"{number} {name}" if i == 0 else ""
            lines.append(f"| {floor} | {where} | {house.ROOMS[room]} |")
    return "\n".join(lines)


def write_docs(summary: str) -> None:
    """Replace the generated block of ``docs/architecture.md``."""
    text = DOCS.read_text(encoding="utf-8")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    block = f"\n{summary}.\n\n{floors_table()}\n"
    DOCS.write_text(text[:start] + block + text[end:], encoding="utf-8")


def main(argv: list[str]) -> int:
    paths = [a for a in argv if not a.startswith("--")]
    out = Path(paths[0]) if paths else ROOT / "docs" / "house.png"
    summary = draw(out)
    if "--docs" in argv:
        write_docs(summary)
    print(f"{out}: {summary}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
