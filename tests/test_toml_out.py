"""tokenmill's own TOML writer (``config/toml_out.py``): what it writes reads back, with the standard library's
``tomllib``, as the same tree, for every shipped preset and ladder, every resolved preset config and the value
kinds they use; what TOML cannot hold (None, NaN, infinity, integers past 64 bits, other objects) is refused
with the key named."""

from __future__ import annotations

import datetime
import math
from importlib import resources

import pytest

from tokenmill import config as C
from tokenmill.config.resolve import tomllib
from tokenmill.config.toml_out import dumps
from tokenmill.errors import ConfigError


def shipped(package: str) -> list[str]:
    return sorted(p.name for p in resources.files(package).iterdir() if p.name.endswith(".toml"))


def read(package: str, name: str) -> dict:
    return tomllib.loads(resources.files(package).joinpath(name).read_text())


@pytest.mark.parametrize("name", shipped("tokenmill.presets"))
def test_every_preset_round_trips(name):
    tree = read("tokenmill.presets", name)
    assert tomllib.loads(dumps(tree)) == tree
    cfg = C.resolve(name.removesuffix(".toml"))  # the resolved config as config.toml writes it
    assert C.from_dict(tomllib.loads(C.to_toml(cfg))) == cfg


@pytest.mark.parametrize("name", shipped("tokenmill.bench.ladders"))
def test_every_ladder_round_trips_with_its_rungs(name):
    tree = read("tokenmill.bench.ladders", name)
    text = dumps(tree)
    assert tomllib.loads(text) == tree
    assert text.count("[[rung]]") == len(tree["rung"])  # an array of tables, one header per rung


def test_value_kinds_round_trip():
    tree = {
        "plain": "a \"quoted\" back\\slash\ttab\nnew line \x01 \x7f é ✓",
        "key with space": True, "dotted.key": False, "": 0,
        "ints": [0, -1, 2**63 - 1, -(2**63)], "floats": [0.1, -2.5e-08, 1e300, -0.0, 5e-4],
        "nested": [[1, 2], ["x"], []], "inline": [{"a": 1}, 2], "empty": {},
        "section": {"x": 1, "sub": {"y": "z", "deeper": {"w": [1.5]}}, "rows": [{"n": 1}, {"n": 2, "t": {"k": 1}}]},
        "rung": [{"name": "a", "set": {"model.norm": "triton"}}, {}],
    }
    back = tomllib.loads(dumps(tree))
    assert back == tree
    assert math.copysign(1, back["floats"][3]) == -1


def test_escapes_are_the_basic_string_ones():
    assert dumps({"s": 'a"b\\c\n\x00'}) == 's = "a\\"b\\\\c\\n\\u0000"\n'
    assert dumps({"a.b": 1, "ok_key-1": 2}) == '"a.b" = 1\nok_key-1 = 2\n'
    assert dumps({}) == ""


@pytest.mark.parametrize("value, message", [
    (float("nan"), r"'t.x' = nan is not a finite number"),
    (float("inf"), r"'t.x' = inf is not a finite number"),
    ([1.0, float("-inf")], r"'t.x\[1\]' = -inf is not a finite number"),
    (None, r"'t.x' is None \(TOML has no null"),
    (2**63, r"'t.x' = 9223372036854775808 does not fit a 64-bit integer"),
    (datetime.date(2026, 1, 1), r"'t.x' is a date"),
    ({"y": {1, 2}}, r"'t.x.y' is a set"),
])
def test_what_toml_cannot_hold_is_refused_naming_the_key(value, message):
    with pytest.raises(ConfigError, match=message):
        dumps({"t": {"x": value}})
    with pytest.raises(ConfigError, match="not a string"):
        dumps({1: 2})
