"""Values read from files, checked where they are read: the one way every file-read entry point (a Hugging
Face ``config.json`` and shard index, a prepared folder's ``meta.json``, a saved dataset's ``state.json`` /
``dataset_dict.json``, a TOML config, a JSONL record) turns a file into values.

:func:`read_json` / :func:`read_toml` read a whole file; a document that is not valid JSON/TOML, not UTF-8,
nested too deep for Python (``RecursionError``) or unreadable becomes one error naming the file.
:func:`get` reads one field of a parsed document: a wrong type (a JSON ``true`` is not an integer, the
string ``"false"`` is not a boolean, ``null`` is not a number), a number outside its range or not finite is
refused naming the file, the field and the value. :func:`check_number` is the rule for a number given as
text (a flag, a TOML float): infinite, NaN and a nonzero literal that underflows to 0.0 are refused.
Every function takes the :class:`~tokenmill.errors.TokenmillError` subclass its caller raises (``err``).
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from tokenmill.errors import DataError, TokenmillError

__all__ = ["MISSING", "Number", "check_number", "get", "parse_json", "read_json", "read_toml", "shown"]

MISSING = object()
_KIND_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "an object",
               list: "a list"}
_NONZERO_DIGIT = re.compile(r"^[^eE]*[1-9]")  # a literal whose digits before any exponent are not all zero


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (and safe for values nested too deep to print)."""
    try:
        text = repr(value)
    except RecursionError:
        return f"a {type(value).__name__} nested too deep"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Number(float):
    """A float parsed from JSON or TOML that remembers its literal (``.text``), so an overflow to infinity or
    an underflow to 0.0 is refused naming the field it is read into (:func:`check_number`)."""

    text: str

    def __new__(cls, text: str) -> Number:
        out = super().__new__(cls, text)
        out.text = text
        return out


def parse_json(text: str, where: str, err: type[TokenmillError] = DataError, fix: str = "") -> Any:
    """``json.loads(text)``; invalid JSON or nesting too deep is ``err`` naming ``where`` (``fix``: a
    sentence saying what to do, appended)."""
    try:
        return json.loads(text, parse_float=Number)  # the literal kept: get() refuses an underflow to 0.0
    except RecursionError:
        raise err(f"{where} is nested too deep (JSON arrays/objects inside each other beyond what Python "
                  f"reads); it cannot be read.{fix}") from None
    except ValueError as e:
        raise err(f"{where} is not valid JSON ({e}).{fix}") from None


def read_json(path: str | Path, what: str = "", err: type[TokenmillError] = DataError, kind: type | None = dict,
              fix: str = "") -> Any:
    """The parsed JSON of ``path`` (of type ``kind`` when given: an object by default), or ``err`` naming the
    file (``what``: what the file is, for the message)."""
    where = f"{what} '{path}'" if what else f"'{path}'"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise err(f"{where} is not valid JSON (not UTF-8 text: {e.reason} at byte {e.start}).{fix}") from None
    except OSError as e:
        raise err(f"{where} cannot be read ({e.strerror or e}).{fix}") from None
    doc = parse_json(text, where, err, fix)
    if kind is not None and not _is(doc, kind):
        raise err(f"{where} must hold {_KIND_WORDS[kind]}, got {shown(doc)}.{fix}")
    return doc


def read_toml(path: str | Path, what: str = "config file", err: type[TokenmillError] = DataError) -> dict:
    """The parsed TOML of ``path``, or ``err`` naming the file: invalid TOML, not UTF-8, nested too deep,
    unreadable. Its floats are :class:`Number` (the literal kept for :func:`check_number`)."""
    where = f"{what} '{path}'"
    try:
        with open(path, "rb") as f:
            return tomllib.load(f, parse_float=Number)
    except RecursionError:
        raise err(f"{where} is nested too deep (arrays/tables inside each other beyond what Python reads).") from None
    except tomllib.TOMLDecodeError as e:
        raise err(f"{where} is not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise err(f"{where} is not UTF-8 text; save it as UTF-8 TOML.") from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise err(f"{where} cannot be read: {str(e).split(';')[0]}.") from None
    except OSError as e:  # unreadable (permissions), or vanished meanwhile
        raise err(f"{where} cannot be read: {e.strerror or e}.") from None


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and math.isfinite(value) and value.is_integer())
    return isinstance(value, kind)


def _finite(value: float) -> bool:
    """Finite, and (an integer) within what a float holds: 10**400 is refused, not an OverflowError."""
    if isinstance(value, int):
        return abs(value) <= sys.float_info.max
    return math.isfinite(value)


def _want(kind: type, lo: float | None, hi: float | None, gt: float | None) -> str:
    if kind is int and lo == 1 and hi is None:
        return "a positive integer"
    if kind is float and gt == 0 and lo is None and hi is None:
        return "a positive number"
    bounds = [f"{op} {b:g}" for op, b in ((">", gt), (">=", lo), ("<=", hi)) if b is not None]
    return " ".join([_KIND_WORDS[kind], " and ".join(bounds)]) if bounds else _KIND_WORDS[kind]


def get(doc: Any, key: str, kind: type, where: str, *, err: type[TokenmillError] = DataError, lo: float | None = None,
        hi: float | None = None, gt: float | None = None, default: Any = MISSING, nullable: bool = False,
        fix: str = "") -> Any:
    """``doc[key]`` checked: of ``kind`` (bool, int, float, str, dict, list: a bool is not a number, a string
    is not a bool, an integral float is an int), finite, ``lo <= value <= hi``, ``value > gt``. Absent:
    ``default`` (absent with no default, or null unless ``nullable`` or a None default: an error). ``where``
    names the file; the message names the field and the value (``fix``: a sentence appended)."""
    if not isinstance(doc, dict):
        raise err(f"{where} must hold an object with '{key}', got {shown(doc)}.{fix}")
    value = doc.get(key, default)
    if value is MISSING:
        raise err(f"{where} lacks '{key}' ({_KIND_WORDS[kind]}).{fix}")
    if value is None and (nullable or default is None):
        return None
    want = _want(kind, lo, hi, gt)
    if not _is(value, kind):
        raise err(f"{where}: '{key}' must be {want}, got {shown(value)}.{fix}")
    if kind in (int, float):
        if isinstance(value, Number):
            check_number(value.text, value, f"{where}: '{key}'", err)
        if not _finite(value) or any((lo is not None and value < lo, hi is not None and value > hi,
                                            gt is not None and value <= gt)):
            raise err(f"{where}: '{key}' must be {want}, got {shown(value)}.{fix}")
        return kind(value)
    return value


def check_number(text: str, value: float, what: str, err: type[TokenmillError] = DataError) -> float:
    """``value`` (parsed from ``text``) when finite and not a nonzero literal that underflowed to 0.0."""
    if not math.isfinite(value):
        raise err(f"{what} must be a finite number, got {text}.")
    if value == 0.0 and _NONZERO_DIGIT.match(text.strip().lstrip("+-")):
        raise err(f"{what}: {text} is too small for a float (it would be read as 0.0); write 0 or a larger number.")
    return value
