"""Numbers given to command options (``--top-k``, ``--timeout``, ...): the rule of a config field's range
(finite, not a nonzero literal that underflows to 0.0, within a signed 64-bit integer, inside the declared
bounds) for the options that are not config fields, as an argparse ``type=``, so a bad value is argparse's
one-line usage error before any work."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from tokenmill.config.schema import describe_range
from tokenmill.filecheck import check_number


def number(kind: type, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
           lt: float | None = None) -> Callable[[str], float]:
    """An argparse ``type=`` reading an ``int`` or ``float`` in the given bounds; NaN, infinities and
    integers beyond int64 are refused. ``.kind`` and ``.bounds`` say what it reads."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}

    def parse(text: str):
        value = kind(text)  # a ValueError is argparse's "invalid int value: 'x'", as with type=int
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        if kind is float:  # a nonzero literal read as 0.0: filecheck's rule, as argparse's error
            check_number(text, value, "the value", argparse.ArgumentTypeError)
        if kind is int and not -(2**63) <= value < 2**63:
            raise argparse.ArgumentTypeError(f"{text} does not fit in a signed 64-bit integer")
        ok = all((("ge" not in bounds) or value >= bounds["ge"], ("gt" not in bounds) or value > bounds["gt"],
                  ("le" not in bounds) or value <= bounds["le"], ("lt" not in bounds) or value < bounds["lt"]))
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {describe_range(bounds)}, got {text}")
        return value

    parse.__name__ = kind.__name__
    parse.kind, parse.bounds = kind, bounds
    return parse
