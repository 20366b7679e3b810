"""Reading a DeepSpeed config: the dict itself, and typed reads of its sections that name
the key path, the value, the rule and the fix in every error.

``Section`` wraps one JSON object. Every read marks its key as known; ``finish`` then
handles the keys nobody read (an error inside a section flatzero parses, a line in the
"no effect" list at the top level). Keys that are accepted without effect and keys that
ask for a DeepSpeed feature flatzero lacks go through ``no_effect`` and ``refuse``.
"""

from __future__ import annotations

import base64
import binascii
import collections
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import UnsupportedFeatureError

__all__ = ["MISSING", "Section", "fmt", "load_config_dict"]

MISSING = object()
"""The default of a read that has none: the key must be given."""

MAX_INT = 2**53
"""The largest whole number a config key may hold: JSON's (a double's) exact integers; a
count beyond it is a typo, and it would drive loops or allocations."""

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
    """The config as a dict, read as ``deepspeed.DeepSpeedConfig`` reads it: a mapping
    (copied); the path of an existing file (JSON, or hjson: comments, trailing commas);
    else a URL-safe base64 string of such a text. Unlike DeepSpeed, a duplicate key is an
    error in a base64 string too. Every error is a ``ValueError`` or ``TypeError`` naming
    the input and the fix."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (os.PathLike, str)):
        path = os.fspath(config)
        if isinstance(config, str) and not os.path.lexists(path):
            from_base64 = _base64_config(config)
            if from_base64 is not None:
                return from_base64
        return _parse_text(_read_text(path), f"config file {path!r}")
    raise TypeError(
        "config must be a dict, the path of a DeepSpeed JSON config or a base64 string of "
        f"one, got {type(config).__name__}"
    )


def _read_text(path: str) -> str:
    """The UTF-8 text of the file at ``path``; a ``ValueError`` naming it and what the OS
    said when it cannot be read."""
    if not os.path.lexists(path):
        raise ValueError(
            f"config file {path!r} does not exist (nor is it a base64 string of a JSON "
            "object); pass a dict, the path of a DeepSpeed JSON config, or a base64 string of "
            "one"
        )
    if os.path.isdir(path):
        raise ValueError(
            f"config file {path!r} is a directory; pass the path of the JSON file in it"
        )
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as error:
        raise ValueError(
            f"cannot read config file {path!r}: {error.strerror or error}; check the path "
            "and its permissions"
        ) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"config file {path!r} is not UTF-8 text (byte {error.start} is "
            f"{raw[error.start : error.start + 1]!r}); save it as UTF-8 JSON"
        ) from None


def _base64_config(text: str) -> dict[str, Any] | None:
    """The config in ``text`` read as URL-safe base64 of a JSON object (DeepSpeed's third
    form); None when it is not one (then ``text`` is taken for a missing file's path)."""
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii")).decode("utf-8")
        return _parse_text(decoded, "the base64 config string")
    except (ValueError, TypeError, binascii.Error):
        return None


class _DuplicateKeyError(ValueError):
    """A JSON object with a key given twice."""


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` that refuses duplicate keys (as DeepSpeed does)."""
    result = dict(pairs)
    if len(result) != len(pairs):
        counts = collections.Counter(key for key, _ in pairs)
        raise _DuplicateKeyError(sorted(k for k, n in counts.items() if n > 1))
    return result


def _parse_text(text: str, what: str) -> dict[str, Any]:
    """The JSON (or hjson, as DeepSpeed accepts) object in ``text`` (``what`` it is)."""
    if not text.strip():  # hjson reads nothing as {}; DeepSpeed's json.load refuses it
        raise ValueError(f"{what} is empty; write the config's JSON object in it")
    try:
        data = _loads(text)
    except _DuplicateKeyError as error:
        raise ValueError(
            f"{what} has duplicate keys {error.args[0]} (DeepSpeed refuses them too); keep "
            "one of each"
        ) from None
    except ValueError as error:
        raise ValueError(f"{what} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise TypeError(f"{what} must hold a JSON object, not {type(data).__name__} {fmt(data)}")
    return data


def _loads(text: str) -> Any:
    """Strict JSON first; then hjson (comments, trailing commas, ...), which DeepSpeed
    reads with, when it is installed (it comes with DeepSpeed)."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicates)
    except _DuplicateKeyError:
        raise
    except json.JSONDecodeError as strict_error:
        try:
            import hjson
        except ImportError:
            raise ValueError(
                f"{strict_error} (comments and trailing commas need the hjson package, "
                "which DeepSpeed installs: pip install hjson)"
            ) from None
        try:
            return hjson.loads(text, object_pairs_hook=_refuse_duplicates)
        except hjson.HjsonDecodeError:
            raise ValueError(str(strict_error)) from None


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

    def int(
        self,
        name: str,
        default: Any,
        *,
        minimum: int = 1,
        maximum: int = MAX_INT,
        unit: str = "",
    ) -> Any:
        """A whole number in ``[minimum, maximum]`` (``unit`` follows it in errors), or
        None."""
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
        if value > maximum:
            raise self.fail(
                name, value, f"it must be <= {maximum:,}{unit}", f"use a value <= {maximum:,}"
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
        """The object under ``name`` (empty when absent); null is an error (DeepSpeed fails
        on it too), not the defaults."""
        value = self.raw(name, {})
        if value is None:
            raise self.fail(
                name, value, "it must be a JSON object", "write {} for the defaults or remove it"
            )
        return Section(value, self.key(name), self.ignored)

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
