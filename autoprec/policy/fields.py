"""Field checks shared by the policy dataclasses: each raises a PolicyError naming source and field.

``source`` is what the message starts with (a file path when loading, else the class being
built); ``path`` is the field's place in the policy file layout, e.g. ``"rules[2].dtype"``
(``""`` for the object itself). See ``docs/architecture.md#policy-file``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import Any

from autoprec.errors import PolicyError

#: Deepest nesting of lists and objects accepted in ``provenance`` (and by :func:`jsonable`):
#: deeper data is refused with a PolicyError instead of overflowing Python's stack.
MAX_DEPTH = 64


def fail(source: str, path: str, msg: str) -> PolicyError:
    """The error ``"<source>: <path>: <msg>"`` (``"<source>: <msg>"`` when ``path`` is empty)."""
    return PolicyError(f"{source}: {path}: {msg}" if path else f"{source}: {msg}")


def join(path: str, name: str) -> str:
    """``path.name``, or ``name`` at the top level."""
    return f"{path}.{name}" if path else name


def type_name(value: Any) -> str:
    """The JSON-ish name of ``value``'s type (``"null"`` for None)."""
    return "null" if value is None else type(value).__name__


def described(value: Any) -> str:
    """``value`` for an error message: its type and repr (``str 'bf17'``), or ``null`` alone."""
    return "null" if value is None else f"{type_name(value)} {value!r}"


def check_str(value: Any, source: str, path: str) -> str:
    """``value`` as a str. Raises: PolicyError: it is not a string."""
    if not isinstance(value, str):
        raise fail(source, path, f"expected a string, got {described(value)}")
    return str(value)


def check_choice(value: Any, valid: tuple[str, ...] | list[str], what: str, source: str, path: str) -> str:
    """``value`` if it is one of ``valid``. Raises: PolicyError: listing the valid choices."""
    value = check_str(value, source, path)
    if value not in valid:
        raise fail(source, path, f"{value!r} is not a valid {what}; valid: {', '.join(valid)}")
    return value


def check_number(value: Any, source: str, path: str) -> float:
    """A finite int or float (bool is not a number), returned as float.

    Raises:
        PolicyError: not a number, or inf/NaN.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(source, path, f"expected a number, got {described(value)}")
    if not math.isfinite(value):
        raise fail(source, path, f"{value!r} is not a finite number")
    return float(value)


def check_keys(d: Mapping, valid: tuple[str, ...], what: str, source: str, path: str) -> None:
    """Every key of ``d`` is in ``valid``. Raises: PolicyError: naming the key, with a close match."""
    for key in d:
        if key not in valid:
            hint = difflib.get_close_matches(str(key), valid, n=1)
            did = f"did you mean {hint[0]!r}? " if hint else ""
            raise fail(source, join(path, str(key)), f"unknown {what} key; {did}valid: {', '.join(valid)}")


def check_mapping(value: Any, source: str, path: str) -> Mapping:
    """``value`` if it is a mapping. Raises: PolicyError: it is not (a JSON object)."""
    if not isinstance(value, Mapping):
        raise fail(source, path, f"expected a JSON object, got {described(value)}")
    return value


def jsonable(value: Any, source: str, path: str, depth: int = 0) -> Any:
    """A plain-JSON deep copy of ``value`` (tuples become lists, keys must be strings).

    Raises:
        PolicyError: a float is non-finite, a value is not JSON-serialisable, or lists and objects
            nest deeper than :data:`MAX_DEPTH`.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise fail(source, path, f"{value!r} is not a finite number; JSON cannot hold it")
        return float(value)
    if isinstance(value, (list, tuple, Mapping)) and depth >= MAX_DEPTH:
        raise fail(source, path, f"nested deeper than {MAX_DEPTH} levels of lists and objects")
    if isinstance(value, (list, tuple)):
        return [jsonable(v, source, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise fail(source, path, f"keys must be strings, got {described(k)}")
            out[str(k)] = jsonable(v, source, join(path, k), depth + 1)
        return out
    raise fail(source, path, f"{described(value)} is not JSON-serialisable; convert it to str")


def build(cls: type, values: Mapping[str, Any], source: str, path: str = "") -> Any:
    """An instance of the frozen policy dataclass ``cls``, validated once naming ``source``/``path``.

    Like ``cls(**values)`` (missing fields take their defaults), except that the checks in
    ``cls._validate(source, path)`` run in place of ``__post_init__``'s (which name the class),
    so a file's errors name the file and the field's path in it, and nothing is checked twice.

    Raises:
        PolicyError: from ``cls._validate``.
    """
    obj = object.__new__(cls)
    for f in dataclasses.fields(cls):
        if f.name in values:
            value = values[f.name]
        elif f.default is not dataclasses.MISSING:
            value = f.default
        else:
            value = f.default_factory()  # type: ignore[misc]
        object.__setattr__(obj, f.name, value)
    obj._validate(source, path)
    return obj


class DuplicateKey(Exception):
    """A JSON object of a policy file repeats a key (``args[0]``)."""


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` ``object_pairs_hook`` that refuses a repeated key.

    Raises:
        DuplicateKey: naming the key.
    """
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(k)
        out[k] = v
    return out
