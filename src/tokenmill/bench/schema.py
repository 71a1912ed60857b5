"""The ladder TOML format: parsing and validation.

A ladder is an ordered list of rungs; each rung's ``set`` overrides are applied cumulatively on the
ladder's base config (see :mod:`tokenmill.bench.configs`). Layout::

    [ladder]
    name = "rasbt"                    # required
    description = "..."               # required, one paragraph
    base_preset = "gpt2-124m"         # optional, a shipped preset
    headline = "tokens_per_sec"       # "tokens_per_sec" | "peak_alloc_mb" | "time_for_samples"
    samples = 10240                   # optional: report the time for this many samples
    requires = "cuda"                 # optional: every rung needs it ("cuda" | "multi-gpu")
    gpu = true                        # optional: written for a CUDA GPU (on a CPU: a warning, no
                                      # reference comparison)
    timeout_s = 900                   # optional: per-rung wall-clock limit

    [ladder.base]                     # overrides on the preset, dotted config keys
    "model.tie_embeddings" = false

    [ladder.measure]                  # optional: how many steps are run and timed
    warmup_steps = 5                  # excluded from tokens/s (log.timing_warmup_steps)
    timed_steps = 40                  # or cover_samples = true with [ladder] samples
    windows = 4                       # timed windows (the median and min/max are reported)
    loss_tolerance = 0.05             # flag a final loss this far (relative) from the baseline's

    [ladder.reference]                # optional: where the rung reference figures come from
    source = "..."
    hardware = "A100, PyTorch 2.6"

    [[rung]]
    name = "tf32"                     # required, unique; letters, digits, '-', '_', '.'
    explain = "..."                   # required, one line
    set = { "train.tf32" = true }     # overrides added at this rung (empty for the baseline)
    requires = "cuda"                 # optional
    needs = ["parallel.dp_shard"]     # optional: config fields that must exist, else skipped
    packages = ["torchao"]            # optional: Python packages that must be installed, else skipped
    launcher = "torchrun"             # optional, with nproc = 2 (implies requires = "multi-gpu")
    reference = { tokens_per_sec = 27648 }   # optional seed figures for this rung

The keys ``train.max_steps``, ``log.every_steps`` and ``log.timing_warmup_steps`` belong to
``[ladder.measure]`` and may not be set elsewhere.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.errors import LadderError

HEADLINES = ("tokens_per_sec", "peak_alloc_mb", "time_for_samples")
REQUIRES = ("cuda", "multi-gpu")
LAUNCHERS = ("torchrun",)
REFERENCE_METRICS = ("tokens_per_sec", "time_for_samples_s", "peak_alloc_mb", "peak_reserved_mb")
MEASURE_KEYS = ("train.max_steps", "log.every_steps", "log.timing_warmup_steps")

_LADDER_KEYS = ("name", "description", "base_preset", "headline", "samples", "requires", "gpu", "timeout_s",
                "base", "measure", "reference")
_RUNG_KEYS = ("name", "explain", "set", "requires", "needs", "packages", "launcher", "nproc", "reference")
_MEASURE_KEYS = ("warmup_steps", "timed_steps", "windows", "cover_samples", "loss_tolerance")
_REFERENCE_INFO_KEYS = ("source", "hardware", "note")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class Measure:
    """Steps run per rung: ``warmup_steps`` untimed, then ``timed_steps`` in ``windows`` windows.
    ``loss_tolerance``: a rung whose final loss differs from the baseline rung's by more than this
    (relative) is flagged in the report."""

    warmup_steps: int = 5
    timed_steps: int = 30
    windows: int = 3
    cover_samples: bool = False
    loss_tolerance: float = 0.05


@dataclass
class Rung:
    name: str
    explain: str
    set: dict[str, Any] = field(default_factory=dict)
    requires: Optional[str] = None
    needs: list[str] = field(default_factory=list)
    packages: list[str] = field(default_factory=list)
    launcher: Optional[str] = None
    nproc: int = 1
    reference: dict[str, float] = field(default_factory=dict)

    def missing_fields(self) -> list[str]:
        """Fields named in ``needs`` that this tokenmill's config does not have (yet)."""
        specs = C.field_specs()
        return [k for k in self.needs if k not in specs]

    def missing_packages(self) -> list[str]:
        """Python packages named in ``packages`` that are not installed here."""
        return [name for name in self.packages if importlib.util.find_spec(name) is None]


@dataclass
class Ladder:
    name: str
    description: str
    rungs: list[Rung]
    base: dict[str, Any] = field(default_factory=dict)
    base_preset: Optional[str] = None
    headline: str = "tokens_per_sec"
    samples: Optional[int] = None
    requires: Optional[str] = None
    gpu: bool = False
    timeout_s: float = 900.0
    measure: Measure = field(default_factory=Measure)
    reference_info: dict[str, str] = field(default_factory=dict)
    source: str = ""

    def requirement(self, rung: Rung) -> Optional[str]:
        """What a rung needs from the machine: 'multi-gpu', 'cuda' or None."""
        if rung.nproc > 1 or rung.requires == "multi-gpu" or self.requires == "multi-gpu":
            return "multi-gpu"
        return rung.requires or self.requires


# ----------------------------------------------------------------------------------------------
# Finding ladders


def shipped_ladders() -> list[str]:
    """Names of the ladders shipped in ``tokenmill/bench/ladders``."""
    files = resources.files("tokenmill.bench.ladders").iterdir()
    return sorted(p.name[:-5] for p in files if p.name.endswith(".toml"))


def read_ladder_toml(name_or_path: str) -> tuple[dict[str, Any], str]:
    """The TOML tree of a shipped ladder (by name) or of a user's ladder file (by path), and the
    source label that error messages use. Parsing and validation: :func:`tokenmill.bench.load.load_ladder`."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.is_file():
        if not p.is_file():
            raise LadderError(f"ladder file '{p}' does not exist; shipped ladders are {shipped_ladders()}.")
        return C.load_toml(p), str(p)
    names = shipped_ladders()
    if name_or_path not in names:
        raise LadderError(
            f"unknown ladder '{name_or_path}'; shipped ladders are {names} (or give a path to a "
            f"ladder .toml file).{C._closest(name_or_path, names)}"
        )
    with resources.files("tokenmill.bench.ladders").joinpath(f"{name_or_path}.toml").open("rb") as f:
        return C.tomllib.load(f), f"shipped ladder '{name_or_path}'"


# ----------------------------------------------------------------------------------------------
# Parsing


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions of one character."""
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def flat_overrides(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{'model': {'n_layer': 2}}`` or ``{'model.n_layer': 2}`` -> ``{'model.n_layer': 2}``."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat_overrides(v, key + "."))
        else:
            out[key] = v
    return out


def _check_keys(table: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for k in table:
        if k not in allowed:
            raise LadderError(f"{where}: unknown key '{k}'; allowed keys are {list(allowed)}.{C._closest(k, list(allowed))}")


def _get(table: dict[str, Any], key: str, types: type | tuple, where: str, default: Any = None,
         required: bool = False) -> Any:
    if key not in table:
        if required:
            raise LadderError(f"{where}: '{key}' is required.")
        return default
    v = table[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise LadderError(f"{where}: '{key}' must be {types}, got {v!r}.")
    if not isinstance(v, types):
        raise LadderError(f"{where}: '{key}' must be {getattr(types, '__name__', types)}, got {v!r}.")
    return v


def _choice(value: Any, choices: tuple[str, ...], where: str) -> Any:
    if value is not None and value not in choices:
        raise LadderError(f"{where}: {value!r} is not one of {list(choices)}.{C._closest(str(value), list(choices))}")
    return value


def _check_overrides(overrides: dict[str, Any], where: str, deferred: list[str] = ()) -> None:
    """Unknown keys and bad values fail through tokenmill.config (closest-key suggestions)."""
    known = {k: v for k, v in overrides.items() if k not in deferred}
    try:
        C.apply_overrides(C.Config(), known, origin=where)
    except C.ConfigError as e:  # a bad value's message names only the key: say which ladder and rung
        msg = str(e)
        raise LadderError(msg if where in msg else f"{where}: {msg}") from None
    owned = [k for k in overrides if k in MEASURE_KEYS]
    if owned:
        raise LadderError(
            f"{where}: {owned} are set by the bench from [ladder.measure] (warmup_steps, timed_steps, windows); "
            "remove them here."
        )


def _parse_measure(t: dict[str, Any], where: str) -> Measure:
    _check_keys(t, _MEASURE_KEYS, where)
    m = Measure(
        warmup_steps=_get(t, "warmup_steps", int, where, 5),
        timed_steps=_get(t, "timed_steps", int, where, 30),
        windows=_get(t, "windows", int, where, 3),
        cover_samples=_get(t, "cover_samples", bool, where, False),
        loss_tolerance=float(_get(t, "loss_tolerance", (int, float), where, 0.05)),
    )
    if m.warmup_steps < 0 or m.timed_steps < 1 or m.windows < 1:
        raise LadderError(f"{where}: need warmup_steps >= 0, timed_steps >= 1 and windows >= 1.")
    if m.loss_tolerance <= 0:
        raise LadderError(f"{where}: loss_tolerance must be > 0 (a relative difference, e.g. 0.05).")
    return m


def _parse_reference(t: dict[str, Any], where: str) -> dict[str, float]:
    _check_keys(t, REFERENCE_METRICS, where)
    for k, v in t.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise LadderError(f"{where}: '{k}' must be a positive number, got {v!r}.")
    return {k: float(v) for k, v in t.items()}


def _parse_rung(t: Any, i: int, where: str) -> Rung:
    if not isinstance(t, dict):
        raise LadderError(f"{where}: every [[rung]] must be a table.")
    name = _get(t, "name", str, where, required=True)
    where = f"{where}, rung {i} '{name}'"
    _check_keys(t, _RUNG_KEYS, where)
    if not _NAME_RE.match(name):
        raise LadderError(f"{where}: a rung name may hold only letters, digits, '-', '_' and '.'.")
    rung = Rung(
        name=name,
        explain=_get(t, "explain", str, where, required=True),
        set=flat_overrides(_get(t, "set", dict, where, {})),
        requires=_choice(_get(t, "requires", str, where), REQUIRES, f"{where}: requires"),
        needs=list(_get(t, "needs", list, where, [])),
        packages=list(_get(t, "packages", list, where, [])),
        launcher=_choice(_get(t, "launcher", str, where), LAUNCHERS, f"{where}: launcher"),
        nproc=_get(t, "nproc", int, where, 1),
        reference=_parse_reference(_get(t, "reference", dict, where, {}), f"{where}: reference"),
    )
    if any(not isinstance(k, str) for k in rung.needs):
        raise LadderError(f"{where}: 'needs' must be a list of config keys such as \"parallel.dp_shard\".")
    if any(not isinstance(k, str) for k in rung.packages):
        raise LadderError(f"{where}: 'packages' must be a list of Python package names such as \"torchao\".")
    _check_needs(rung.needs, where)
    if rung.nproc < 1 or (rung.nproc > 1 and rung.launcher is None):
        raise LadderError(f"{where}: nproc > 1 needs launcher = \"torchrun\" (and nproc >= 1).")
    if rung.launcher and rung.nproc < 2:
        raise LadderError(f"{where}: launcher = \"torchrun\" needs nproc >= 2.")
    _check_overrides(rung.set, where, deferred=rung.needs)
    return rung


def _check_needs(needs: list[str], where: str) -> None:
    """A ``needs`` key one edit away from a real field is a typo, not a future field: it would skip
    the rung forever, so it fails here."""
    specs = list(C.field_specs())
    for key in needs:
        if key in specs:
            continue
        near = min(specs, key=lambda s: edit_distance(key, s))
        if edit_distance(key, near) <= 1:
            raise LadderError(f"{where}: needs '{key}' is not a config field. Did you mean '{near}'? "
                              "(a misspelt key in 'needs' would skip the rung forever)")


def ladder_label(name: str, source: str) -> str:
    """How error messages name a ladder: ``ladder 'mine' (mine.toml)`` or ``shipped ladder 'rasbt'``."""
    return source if source.startswith("shipped ladder") else f"ladder '{name}' ({source})"


def parse_ladder_tree(tree: dict[str, Any], source: str = "ladder") -> Ladder:
    """Validate a ladder TOML tree's structure, keys and per-rung overrides. The rungs' cumulative
    configs are resolved one level up, by :func:`tokenmill.bench.load.parse_ladder`."""
    _check_keys(tree, ("ladder", "rung"), source)
    head = _get(tree, "ladder", dict, source, required=True)
    where = f"{source} [ladder]"
    _check_keys(head, _LADDER_KEYS, where)
    preset = _get(head, "base_preset", str, where)
    if preset is not None and preset not in C.preset_names():
        names = C.preset_names()
        raise LadderError(f"{where}: unknown base_preset '{preset}'; presets are {names}.{C._closest(preset, names)}")
    ladder = Ladder(
        name=_get(head, "name", str, where, required=True),
        description=" ".join(_get(head, "description", str, where, required=True).split()),
        rungs=[],
        base=flat_overrides(_get(head, "base", dict, where, {})),
        base_preset=preset,
        headline=_choice(_get(head, "headline", str, where, "tokens_per_sec"), HEADLINES, f"{where}: headline"),
        samples=_get(head, "samples", int, where),
        requires=_choice(_get(head, "requires", str, where), REQUIRES, f"{where}: requires"),
        gpu=_get(head, "gpu", bool, where, False),
        timeout_s=float(_get(head, "timeout_s", (int, float), where, 900.0)),
        measure=_parse_measure(_get(head, "measure", dict, where, {}), f"{where} measure"),
        reference_info=_get(head, "reference", dict, where, {}),
        source=source,
    )
    _check_keys(ladder.reference_info, _REFERENCE_INFO_KEYS, f"{where} reference")
    where = ladder_label(ladder.name, source)
    _check_overrides(ladder.base, f"{where} [ladder.base]")
    if ladder.samples is not None and ladder.samples < 1:
        raise LadderError(f"{where}: samples must be >= 1.")
    if ladder.headline == "time_for_samples" and not ladder.samples:
        raise LadderError(f"{where}: headline 'time_for_samples' needs [ladder] samples = N.")
    if ladder.measure.cover_samples and not ladder.samples:
        raise LadderError(f"{where}: [ladder.measure] cover_samples needs [ladder] samples = N.")
    rungs = _get(tree, "rung", list, source, required=True)
    if not rungs:
        raise LadderError(f"{where}: needs at least one [[rung]].")
    ladder.rungs = [_parse_rung(t, i, where) for i, t in enumerate(rungs)]
    seen = set()
    for r in ladder.rungs:
        if r.name in seen:
            raise LadderError(f"{where}: two rungs are named '{r.name}'.")
        seen.add(r.name)
    return ladder
