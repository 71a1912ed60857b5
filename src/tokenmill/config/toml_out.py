"""Writing TOML: the one writer of configs (``config.toml``) and ladder files, with no dependency.

:func:`dumps` writes what configs, presets and ladders hold: strings (escaped as basic strings), booleans,
integers (64-bit, as TOML allows), finite floats, arrays, tables (nested tables become ``[a.b]`` headers)
and arrays of tables (a non-empty list whose items are all tables: ``[[rung]]``; a table inside an inline
array is an inline table). Anything else (None, NaN, infinity, dates, other objects) is refused with a
:class:`ConfigError` naming the key: TOML has no null and no non-finite number a reader would take back
as the same value. ``tomllib.loads(dumps(tree)) == tree`` for every tree it accepts.
"""

from __future__ import annotations

import math
import re
from typing import Any

from tokenmill.errors import ConfigError

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_INT_LIMIT = 2**63  # TOML integers are signed 64-bit


def dumps(tree: dict[str, Any]) -> str:
    """``tree`` as a TOML document (see the module doc)."""
    if not isinstance(tree, dict):
        raise ConfigError(f"TOML: a document is a table (dict), got {type(tree).__name__}")
    lines: list[str] = []
    _table(tree, [], lines, header=None)
    return "\n".join(lines).lstrip("\n") + "\n" if lines else ""


def _key(k: Any, path: list[str]) -> str:
    if not isinstance(k, str):
        raise ConfigError(f"TOML: key {k!r} in {_where(path)} is not a string")
    return k if _BARE_KEY.fullmatch(k) else _string(k)


def _where(path: list[str]) -> str:
    return "the top level" if not path else "'" + ".".join(path) + "'"


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _table(body: dict[str, Any], path: list[str], lines: list[str], header: str | None) -> None:
    """One table: its header (if any), its plain values, then its sub-tables and arrays of tables."""
    plain = {k: v for k, v in body.items() if not isinstance(v, dict) and not _is_table_array(v)}
    if header is not None:
        lines += ["", header]
    for k, v in plain.items():
        lines.append(f"{_key(k, path)} = {_value(v, [*path, str(k)])}")
    for k, v in body.items():
        if k in plain:
            continue
        sub = [*path, str(k)]
        name = ".".join(_key(p, path) for p in sub)
        if isinstance(v, dict):
            _table(v, sub, lines, f"[{name}]")
        else:
            for item in v:
                _table(item, sub, lines, f"[[{name}]]")


def _value(v: Any, path: list[str]) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        if not -_INT_LIMIT <= v < _INT_LIMIT:
            raise ConfigError(f"TOML: {_where(path)} = {v} does not fit a 64-bit integer")
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ConfigError(f"TOML: {_where(path)} = {v!r} is not a finite number (TOML would not read it "
                              "back as this value)")
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, [*path[:-1], f"{path[-1]}[{i}]"]) for i, x in enumerate(v)) + "]"
    if isinstance(v, dict):
        items = (f"{_key(k, path)} = {_value(x, [*path, str(k)])}" for k, x in v.items())
        return "{ " + ", ".join(items) + " }" if v else "{}"
    what = "None (TOML has no null: leave the key out)" if v is None else f"a {type(v).__name__}"
    raise ConfigError(f"TOML: {_where(path)} is {what}, which tokenmill does not write as TOML")


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
