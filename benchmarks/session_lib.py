"""What a GPU-session part leaves and reads: the output layout the device returns (at most 8 files of at
most 16 MiB, no sub-folders; the details packed in one archive) and the shipped ladders' TOML."""

from __future__ import annotations

import tarfile
from pathlib import Path
from typing import Any

MAX_FILES, MAX_BYTES = 8, 16 * 2**20


def read_ladder(name: str) -> dict[str, Any]:
    from importlib import resources

    import tomllib

    with resources.files("tokenmill.bench.ladders").joinpath(f"{name}.toml").open("rb") as f:
        return tomllib.load(f)


def runnable_here(rung: dict[str, Any], ladder: dict[str, Any], cuda: bool, smoke: bool) -> bool:
    """Whether the ladder would measure (and so carry) this rung here: its CUDA needs, packages,
    config fields, and torch.compile on a CPU in --smoke (skipped by the ladder)."""
    import importlib.util

    from tokenmill import config as C

    sets = rung.get("set", {})
    if (rung.get("requires") or ladder["ladder"].get("requires")) in ("cuda", "multi-gpu") and not cuda:
        return False
    if rung.get("launcher") or rung.get("requires") == "multi-gpu":
        return False
    if any(importlib.util.find_spec(p) is None for p in rung.get("packages", [])):
        return False
    if any(k not in C.field_specs() for k in rung.get("needs", [])):
        return False
    return not (smoke and not cuda and sets.get("compile.enabled"))


def pack(s: Any) -> dict[str, Any]:
    """The details archive (shrunk to fit), the log and the checks of the output layout."""
    archive = s.out / f"{s.part}-details.tar.gz"
    members = sorted((p for p in s.work.rglob("*") if p.is_file() and not _excluded(p)),
                     key=lambda p: p.stat().st_size)
    dropped: list[str] = []
    while members and members[-1].stat().st_size > 6 * MAX_BYTES:  # hopeless even compressed: no retry
        big = members.pop()
        dropped.append(f"{big.relative_to(s.work)} ({big.stat().st_size / 2**20:.1f} MiB)")
    while True:
        with tarfile.open(archive, "w:gz", compresslevel=6) as tar:
            for p in members:
                tar.add(p, arcname=str(p.relative_to(s.work)))
        if archive.stat().st_size <= MAX_BYTES or not members:
            break
        big = members.pop()  # the largest raw file goes first
        dropped.append(f"{big.relative_to(s.work)} ({big.stat().st_size / 2**20:.1f} MiB)")
    copy_log(s)
    return {"name": archive.name, "members": len(members), "dropped_to_fit_16MiB": dropped}


def copy_log(s: Any) -> None:
    """The part's log into the output folder (its last 16 MiB)."""
    text = s.log_path.read_bytes() if s.log_path.exists() else b""
    (s.out / f"{s.part}.log").write_bytes(text[-(MAX_BYTES - 4096):])


def _excluded(p: Path) -> bool:
    """Checkpoints are never returned (weights, not results)."""
    return "checkpoints" in p.parts or p.suffix in (".pt", ".distcp") or any(x.endswith(".dcp") for x in p.parts)


def layout(out: Path) -> dict[str, Any]:
    """What the device would return of ``out``: files, sizes, depth."""
    files = [p for p in out.rglob("*") if p.is_file()]
    too_big = [p.name for p in files if p.stat().st_size > MAX_BYTES]
    deep = [str(p.relative_to(out)) for p in files if len(p.relative_to(out).parts) > 3]
    return {"files": sorted(str(p.relative_to(out)) for p in files), "count": len(files),
            "ok": len(files) <= MAX_FILES and not too_big and not deep, "too_big": too_big, "too_deep": deep}


def slice_ladder(name: str, rungs: list[str], deferred: list[str], cuda: bool, smoke: bool,
                 fold_all: bool = False) -> dict[str, Any]:
    """The shipped ladder ``name`` cut to ``rungs`` (in that order): the ``set`` of every earlier rung
    (``fold_all``: every other rung) the ladder would carry goes into the base, except the ``deferred``."""
    tree = read_ladder(name)
    by_name = {r["name"]: i for i, r in enumerate(tree["rung"])}
    unknown = [r for r in rungs + deferred if r not in by_name]
    if unknown:
        raise SystemExit(f"ladder '{name}' has no rung {unknown}; it has {list(by_name)}")
    first = min(by_name[r] for r in rungs)
    folded = [r for r in tree["rung"][: None if fold_all else first]
              if r["name"] not in deferred and r["name"] not in rungs and runnable_here(r, tree, cuda, smoke)]
    base = dict(tree["ladder"].get("base", {}))
    for r in folded:
        base.update(r.get("set", {}))
    head = dict(tree["ladder"], base=base)
    note = f"Rungs {', '.join(rungs)} of the shipped ladder '{name}'"
    if folded:
        note += f", on top of the earlier rungs {', '.join(r['name'] for r in folded)} (in the base)"
    if deferred:
        note += f"; without {', '.join(deferred)} (measured in another part)"
    head["description"] = note + ".\n" + tree["ladder"]["description"]
    return {"ladder": head, "rung": [tree["rung"][by_name[r]] for r in rungs]}
