"""Reading a DeepSpeed config: the dict itself, and typed reads of its sections that name
the key path, the value, the rule and the fix in every error.

``Section`` wraps one JSON object. Every read marks its key as known; ``finish`` then
handles the keys nobody read (an error inside a section flatzero parses, a line in the
"no effect" list at the top level). Keys that are accepted without effect and keys that
ask for a DeepSpeed feature flatzero lacks go through ``no_effect`` and ``refuse``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import UnsupportedFeatureError

__all__ = ["MISSING", "Section", "fmt", "load_config_dict"]

MISSING = object()
"""The default of a read that has none: the key must be given."""

_AUTO_FIX = (
    "'auto' is a placeholder that the Hugging Face Trainer fills in before it calls "
    "deepspeed.initialize; flatzero.initialize needs the value itself: write the number "
    "(or remove the key to take DeepSpeed's default)"
)


def fmt(value: Any) -> str:
    """A value as an error message shows it (its repr, cut at 80 characters)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def load_config_dict(config: Any) -> dict[str, Any]:
    """The config as a dict: a mapping (copied), or the path of a JSON file."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise ValueError(
                f"config file {path!r} does not exist; pass a dict or the path of a DeepSpeed "
                "JSON config"
            ) from None
        except json.JSONDecodeError as error:
            raise ValueError(f"config file {path!r} is not valid JSON: {error}") from error
        if not isinstance(data, dict):
            raise TypeError(f"config file {path!r} must hold a JSON object, not a {type(data)}")
        return data
    raise TypeError(
        f"config must be a dict or the path of a JSON file, got {type(config).__name__}"
    )


class Section:
    """One JSON object of the config: typed reads by key, with the key path in errors.

    Args:
        data: the object.
        path: its key path (``"zero_optimization"``; ``""`` for the top level).
        ignored: the ``(key, reason)`` list of keys without effect, shared by all sections.
    """

    def __init__(self, data: Any, path: str, ignored: list[tuple[str, str]]) -> None:
        if not isinstance(data, Mapping):
            raise TypeError(
                f"config key {path!r} must be a JSON object (dict), got "
                f"{type(data).__name__} {fmt(data)}"
            )
        self.data = data
        self.path = path
        self.ignored = ignored
        self.used: set[str] = set()

    def key(self, name: str) -> str:
        """The key path of ``name``."""
        return f"{self.path}.{name}" if self.path else name

    def __contains__(self, name: str) -> bool:
        self.used.add(name)  # asked about: a key this parser knows
        return name in self.data

    def raw(self, name: str, default: Any = MISSING, *, auto_ok: bool = False) -> Any:
        """The value as given (``default`` when absent); ``"auto"`` is an error unless
        ``auto_ok``."""
        self.used.add(name)
        value = self.data.get(name, default)
        if not auto_ok and name in self.data and isinstance(value, str) and value == "auto":
            raise ValueError(f"config key {self.key(name)!r} is 'auto': {_AUTO_FIX}")
        return value

    def fail(self, name: str, value: Any, rule: str, fix: str) -> ValueError:
        """The error for a value that breaks ``rule``."""
        return ValueError(f"config key {self.key(name)!r} is {fmt(value)}: {rule}; {fix}")

    def unsupported(
        self, name: str, value: Any, rule: str, fix: str, feature: str
    ) -> UnsupportedFeatureError:
        """The error for a value asking for a DeepSpeed feature flatzero lacks."""
        return UnsupportedFeatureError(
            f"config key {self.key(name)!r} is {fmt(value)}: {rule}; {fix}",
            key=self.key(name),
            feature=feature,
        )

    def _type_error(self, name: str, what: str, value: Any) -> TypeError:
        return TypeError(
            f"config key {self.key(name)!r} must be {what}, got {type(value).__name__} {fmt(value)}"
        )

    def int(self, name: str, default: Any, *, minimum: int = 1, unit: str = "") -> Any:
        """A whole number >= ``minimum`` (``unit`` follows it in errors), or None."""
        value = self.raw(name, default)
        if value is None or value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._type_error(name, f"an integer{unit}", value)
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise self.fail(name, value, f"it must be a whole number{unit}", "write an integer")
        if value < minimum:
            raise self.fail(
                name, value, f"it must be >= {minimum}{unit}", f"use a value >= {minimum}"
            )
        return int(value)

    def number(self, name: str, default: Any, *, minimum: float | None = None) -> Any:
        """A finite number >= ``minimum``, or None."""
        value = self.raw(name, default)
        if value is None or value is default:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._type_error(name, "a number", value)
        if not math.isfinite(value):
            raise self.fail(name, value, "it must be finite", "write a finite number")
        if minimum is not None and value < minimum:
            raise self.fail(
                name, value, f"it must be >= {minimum:g}", f"use a value >= {minimum:g}"
            )
        return float(value)

    def bool(self, name: str, default: Any) -> bool:
        """``true`` or ``false``."""
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise self._type_error(name, "true or false", value)
        return value

    def string(self, name: str, default: Any) -> Any:
        """A string, or None."""
        value = self.raw(name, default)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"config key {self.key(name)!r} must be a string, got {fmt(value)}")
        return value

    def choice(self, name: str, default: Any, choices: tuple[str, ...]) -> Any:
        """One of ``choices`` (``"auto"`` only when it is one of them)."""
        value = self.raw(name, default, auto_ok="auto" in choices)
        if value is default:
            return value
        if value not in choices:
            raise self.fail(
                name,
                value,
                f"it must be one of {', '.join(map(repr, choices))}",
                "pick one of them",
            )
        return value

    def section(self, name: str) -> Section:
        """The object under ``name`` (empty when absent or null)."""
        value = self.raw(name, {})
        return Section({} if value is None else value, self.key(name), self.ignored)

    def no_effect(self, name: str, reason: str) -> None:
        """``name``, when present, is accepted and listed as having no effect."""
        self.used.add(name)
        if name in self.data:
            self.ignored.append((self.key(name), reason))

    def refuse(self, name: str, active: Callable[[Any], bool], what: str, fix: str) -> None:
        """``name`` is an ``UnsupportedFeatureError`` when present with a value ``active``
        says asks for ``what`` (``"it asks for X"``); otherwise (off, default, ``"none"``) it
        is accepted as without effect."""
        self.used.add(name)
        if name not in self.data:
            return
        value = self.data[name]
        if active(value):
            raise self.unsupported(
                name,
                value,
                f"{what}, which flatzero does not implement",
                fix,
                what.removeprefix("it asks ").removeprefix("for ").removeprefix("to "),
            )
        self.ignored.append((self.key(name), "off; no effect"))

    def finish(self, *, unknown: str, main: tuple[str, ...] | None = None) -> None:
        """Handle keys nobody read: ``unknown="error"`` or ``"ignore"`` (listed). An error
        lists the known keys (or ``main`` ones, for a long list)."""
        for name in self.data:
            if name in self.used:
                continue
            if unknown == "error":
                known = ", ".join(main) + ", ..." if main else ", ".join(sorted(self.used))
                raise ValueError(
                    f"config key {self.key(name)!r} is not a key of {self.path!r} that "
                    f"DeepSpeed or flatzero knows (known: {known}); fix its spelling or "
                    "remove it"
                )
            self.ignored.append((self.key(name), "unknown key; no effect"))
