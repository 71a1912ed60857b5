"""What a GPU-session part leaves and reads: the output layout the device returns (at most 8 files of at
most 16 MiB, no sub-folders; the details packed in one archive), the shipped ladders' TOML, and how a part
ends: SIGINT/SIGTERM raise :class:`Stopped` in the part (it stops its step, packs and writes its files), and
every process a step started carries the part's tag in its environment, so the part (or, when the part is
killed with SIGKILL, its reaper) ends each of them (:func:`kill_tagged`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

MAX_FILES, MAX_BYTES = 8, 16 * 2**20
TAG_VAR = "TOKENMILL_SESSION_TAG"  # in every step's environment (inherited by everything it starts)
BEST_DEFERRED = ["compile-max-autotune"]  # minutes of autotuning: measured alone, in its own part
RECOMPUTE = ("checkpoint-blocks", "selective-checkpointing")  # the last rungs of best and llama: speed for memory


class Stopped(BaseException):
    """SIGINT or SIGTERM reached the part: it stops the running step and ends with its files."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_signals() -> dict[int, Any]:
    """SIGINT/SIGTERM raise :class:`Stopped` once; a later one is ignored (the part is already ending, and
    SIGKILL is there for the impatient). Returns the previous handlers."""
    seen: list[int] = []

    def handler(signum: int, frame: Any) -> None:
        if not seen:
            seen.append(signum)
            raise Stopped(signum)

    return {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}


def tagged_pids(tag: str) -> list[int]:
    """The processes (other than this one) whose environment carries ``TAG_VAR=tag`` (Linux /proc)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                found.append(int(d.name))
        except OSError:  # gone, or not ours
            continue
    return found


def kill_tagged(tag: str, rounds: int = 3) -> list[int]:
    """SIGKILL every process carrying ``tag`` (a few rounds: one may start another while dying)."""
    killed: list[int] = []
    for _ in range(rounds):
        pids = tagged_pids(tag)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except OSError:
                pass
        time.sleep(0.2)
    return killed


def start_reaper(tag: str) -> subprocess.Popen:
    """A watcher in its own session: when this process is gone (even by SIGKILL), it kills every process
    carrying ``tag``. The part ends it when the part ends normally."""
    env = {k: v for k, v in os.environ.items() if k != TAG_VAR}
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--reap", str(os.getpid()), tag],
                            env=env, start_new_session=True, stdin=subprocess.DEVNULL)


def _reap(parent: int, tag: str) -> None:
    while os.getppid() == parent:
        time.sleep(0.25)
    kill_tagged(tag, rounds=10)


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


def fastest_best_sets(cuda: bool, smoke: bool) -> tuple[dict[str, Any], list[str]]:
    """The switches of the best ladder's fastest rung as the ladder would carry them here: its base and every
    rung runnable here but the deferred max-autotune and the recompute rungs (speed traded for memory).
    Returns (the config overrides, the rungs folded in)."""
    tree = read_ladder("best")
    sets = dict(tree["ladder"].get("base", {}))
    names = []
    for r in tree["rung"]:
        if r["name"] in (*BEST_DEFERRED, *RECOMPUTE) or not runnable_here(r, tree, cuda, smoke):
            continue
        sets.update(r.get("set", {}))
        names.append(r["name"])
    return sets, names


if __name__ == "__main__" and sys.argv[1:2] == ["--reap"]:
    _reap(int(sys.argv[2]), sys.argv[3])
