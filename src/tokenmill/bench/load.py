"""Loading a ladder: find its TOML, parse it (:mod:`tokenmill.bench.schema`), then resolve every
rung's cumulative config, normal and ``--smoke`` (:mod:`tokenmill.bench.configs`), so a bad value
fails when the file is loaded, before anything runs.

This module sits above both: the schema knows nothing of configs, configs know the schema.
"""

from __future__ import annotations

from typing import Any

from tokenmill.bench.configs import check_ladder_configs
from tokenmill.bench.schema import Ladder, ladder_label, parse_ladder_tree, read_ladder_toml
from tokenmill.errors import LadderError, PathError
from tokenmill.paths import safe_name


def parse_ladder(tree: dict[str, Any], source: str = "ladder") -> Ladder:
    """Validate a ladder TOML tree; every rung's cumulative config is resolved to catch bad values."""
    ladder = parse_ladder_tree(tree, source)
    where = ladder_label(ladder.name, source)
    try:
        safe_name(ladder.name, f"{where}: the ladder name")  # it names the output folder (runs/bench-NAME-...)
        for rung in ladder.rungs:  # each names its run folder (OUT/rungs/NN-NAME)
            safe_name(rung.name, f"{where}: the rung name")
    except PathError as e:  # a ladder file's mistake, reported as the others are
        raise LadderError(str(e)) from None
    check_ladder_configs(ladder)
    return ladder


def load_ladder(name_or_path: str) -> Ladder:
    """A shipped ladder by name, or a user's ladder TOML file by path, validated."""
    return parse_ladder(*read_ladder_toml(name_or_path))
