"""What the doctor's rules share: the :class:`Finding` they return, the switch/advice builders that
resolve every suggestion against the config definitions, and readers of the facts and the run's config."""

from __future__ import annotations

import functools
import typing
from typing import Any, Literal, NamedTuple, Optional

from tokenmill.config import field_specs

MIN_SCORE = 0.10  # below this a finding is reported as minor ("nothing stands out" otherwise)
# CPU: below this many model FLOPs per operator the step is per-operator overhead (see launch_overhead)
CPU_OVERHEAD_FLOPS_PER_OP = 4096


class Finding(NamedTuple):
    score: float
    title: str
    evidence: list[str]
    suggestions: list[dict[str, Any]]
    measure: str = "speed"  # what --try compares: "speed" (steady tokens/s), "wall" (end to end), "memory"


@functools.cache
def _specs() -> dict:
    return field_specs()  # fixed for the process; building it is slow (type hints of every section)


def default(key: str) -> Any:
    """The default of config field ``key``, from the config definitions."""
    return _specs()[key][1]


def doc(key: str) -> str:
    """The first sentence of config field ``key``'s documentation."""
    text = _specs()[key][2]
    return text.split(". ")[0].rstrip(".")


def _accepts(tp: Any, value: Any) -> bool:
    """Whether a field annotated ``tp`` takes ``value`` (so a suggestion never names a wrong value)."""
    if typing.get_origin(tp) is typing.Union:
        return any(_accepts(a, value) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is Literal:
        return value in typing.get_args(tp)
    if tp is bool or isinstance(value, bool):
        return tp is bool and isinstance(value, bool)
    return isinstance(value, tp) or (tp is float and isinstance(value, int))


def switch(key: str, value: Any, why: str, fallback: Optional[str] = None,
           also: Optional[dict[str, Any]] = None) -> dict[str, Optional[str]]:
    """A suggestion ``--key value`` (followed by the ``also`` overrides it needs to be valid); plain
    advice (``fallback``, else ``why``) where this version of the config lacks a field or a value does
    not fit it."""
    words = []
    for k, val in {key: value, **(also or {})}.items():
        spec = _specs().get(k)
        if spec is None or not _accepts(spec[0], val):
            return advice(fallback or why)
        words.append(f"--{k} {str(val).lower() if isinstance(val, bool) else val}")
    return {"switch": " ".join(words), "why": why}


def advice(why: str, switch_text: Optional[str] = None) -> dict[str, Optional[str]]:
    return {"switch": switch_text, "why": why}


def env_setting(name: str, value: Any, why: str) -> dict[str, Any]:
    """A suggestion that is an environment variable (the config has no field for it)."""
    return {"switch": None, "why": f"{name}={value} in the environment: {why}", "env": {name: str(value)}}


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def config_value(config: dict, key: str) -> Any:
    """The run's value of config field ``key``; the field's default where the run's config lacks it (a
    config written by another version). An unknown key raises KeyError: a typo in a rule, not user input."""
    return config[key] if key in config else default(key)


def cfg(f: dict, key: str) -> Any:
    """:func:`config_value` of the facts' ``config``."""
    return config_value(f["config"], key)


def _clamp(x: float, lo: float = 0.0, hi: float = 0.95) -> float:
    return max(lo, min(hi, x))


TIGHT_MEMORY = 0.8  # peak / device memory above which memory-saving switches are worth their time
