"""How counts read in messages: ``plural(1, "rank")`` is "1 rank", ``plural(2, "rank")``
"2 ranks"."""

from __future__ import annotations

__all__ = ["plural"]


def plural(count: int | float, noun: str, plural_form: str | None = None) -> str:
    """``count`` and ``noun``, the noun in the plural unless ``count`` is 1 (``plural_form``
    for nouns not made plural by an ``s``)."""
    word = noun if count == 1 else (plural_form or f"{noun}s")
    return f"{count:g} {word}" if isinstance(count, float) else f"{count} {word}"
