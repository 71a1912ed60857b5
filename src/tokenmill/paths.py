"""Paths a command writes: outputs never overlap inputs, and user-chosen names never leave their folder.

Every writing command goes through :func:`check_output` before it writes anything: an output path that
equals, contains or lies inside any input the command reads (a run directory, a checkpoint, a data
folder, a Hugging Face source, a text corpus) is refused, whatever the flags (``--overwrite`` replaces an
earlier output, never an input). Names that become paths (ladder and rung names, run names) go through
:func:`safe_name`; file names that a file supplies (a shard index, a meta.json shard, a saved dataset's
state.json or dataset_dict.json) through :func:`inside`, which keeps them in the folder the user named. Paths a user types are expanded (``~``, ``$VAR``) by :func:`expand_path` (config
resolution calls it for every field declared ``F(..., path=...)``); a name that is not valid text (bytes
that are not UTF-8) is refused by :func:`check_text` before anything reads or writes it; a folder's file
pattern is checked by :func:`check_glob`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from tokenmill.errors import ConfigError, PathError

__all__ = ["check_glob", "check_output", "check_text", "expand_path", "inside", "one_folder", "overlaps",
           "safe_name"]


def _real(p: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(os.fspath(p))).resolve()


def overlaps(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` are the same path or one lies inside the other (links resolved)."""
    ra, rb = _real(a), _real(b)
    return ra == rb or ra in rb.parents or rb in ra.parents


def check_output(out: str | os.PathLike, inputs: Mapping[str, Optional[str | os.PathLike]], flag: str = "--out") -> None:
    """Refuse ``out`` when it is not UTF-8 text (:func:`check_text`: the libraries that write inside it, such
    as torch's profiler and ``tokenizers``, take text paths only) or overlaps one of ``inputs`` (what -> path;
    None entries are skipped), naming both and what to do."""
    check_text(out, flag)
    for what, path in inputs.items():
        if path is None or os.fspath(path) == "":
            continue
        if overlaps(out, path):
            ra, rb = _real(out), _real(path)
            how = "is" if ra == rb else ("lies inside" if rb in ra.parents else "contains")
            raise PathError(f"{flag} {out} {how} {what} {path}, which this command reads: writing there could "
                            "destroy it. Choose an output folder outside it; nothing was written.")


def safe_name(name: str, what: str) -> str:
    """``name`` when it is a plain file name (no separator, not '.' or '..', no control characters), so
    ``folder / name`` stays in ``folder``; else a :class:`PathError`."""
    bad = (not name or name in (".", "..") or "/" in name or "\\" in name or os.sep in name
           or (os.altsep and os.altsep in name) or any(ord(c) < 32 for c in name))
    if bad:
        raise PathError(f"{what} {name!r} cannot be used as a file name: use letters, digits, '-', '_' or '.' "
                        "without a path separator.")
    return name


def inside(folder: str | os.PathLike, name: object, what: str, err: type[Exception] = PathError) -> Path:
    """``folder / name`` for a file name that a file inside ``folder`` supplies (a shard index's weight_map, a
    meta.json shard, a saved dataset's data file or split), when ``name`` stays in ``folder``: a non-empty
    relative text path with no control characters that no ``..`` takes out of the folder, judged on the
    name as written (a symlink inside the folder, as the Hugging Face cache lays out, stays allowed). Else
    ``err`` naming the entry (``what``: the file and its field)."""
    if not isinstance(name, str):
        raise err(f"{what} must name a file (a string), got {name!r:.60}.")
    text = name.replace("\\", "/")
    bad = (not text or any(ord(c) < 32 for c in text) or os.path.isabs(text) or text.startswith("~")
           or re.match(r"^[A-Za-z]:", text) or os.path.normpath(text) in (".", "..")
           or os.path.normpath(text).startswith("../"))
    if bad:
        raise err(f"{what} names the file {name!r:.200}; it must be a file name inside the folder '{folder}' (not "
                  "empty or absolute, no '..' climbing out): tokenmill reads only files inside the folder you name. "
                  "Fix the entry, or save the folder again.")
    return Path(folder) / os.path.normpath(text)


_UNSET_VAR = re.compile(r"\$(\w+|\{[^}]*\})")


def expand_path(value: str, what: str) -> str:
    """``value`` with a leading ``~`` (or ``~user``) and every ``$VAR`` / ``${VAR}`` expanded; a variable
    that is not set is a :class:`PathError` naming it, unless a file of that literal name exists."""
    out = os.path.expandvars(os.path.expanduser(check_text(value, what)))
    unset = _UNSET_VAR.search(out)
    literal = os.path.lexists(out) or os.path.lexists(out.rpartition(":")[0])  # a name with a '$' (or PATH:WEIGHT)
    if unset and not literal:
        raise PathError(f"{what} {value!r} names the environment variable {unset.group(0)}, which is not set: "
                        "set it, or write the path out.")
    return out


def check_text(path: str | bytes | os.PathLike, what: str) -> str:
    """``path`` as text: a bytes path is decoded as the file system does; one whose bytes are not valid
    UTF-8 (Python keeps them as lone surrogates) is a :class:`PathError` showing the bytes, so no later
    print, JSON record or hash fails on it."""
    text = os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(text)
        raise PathError(f"{what} {shown!r} is not valid UTF-8 text: tokenmill records names in JSON and TOML "
                        "files, which hold text only. Rename it (e.g. `convmv -f latin1 -t utf-8`).") from None
    return text


def check_glob(pattern: str, flag: str = "--glob") -> str:
    """A folder's file pattern: not empty, relative, and inside the folder (no '..' part)."""
    text = check_text(pattern, flag)
    if not text.strip():
        raise PathError(f"{flag} is empty: give a pattern relative to the input folder, such as '**/*.txt'.")
    if os.path.isabs(text) or text.startswith("~"):
        raise PathError(f"{flag} {text!r} is an absolute path: it is matched inside each input folder, so give it "
                        "relative (e.g. '**/*.txt'), or pass the whole pattern as INPUT (quoted).")
    if ".." in text.replace("\\", "/").split("/"):
        raise PathError(f"{flag} {text!r} climbs out of the input folder ('..'): give a pattern inside it, or pass "
                        "the other folder as INPUT.")
    return text


def one_folder(positional: Optional[str], flag: Optional[str], usage: str) -> str:
    """The one folder a command reads, named by position or by ``--run-dir`` (as ``train`` names a run's folder);
    none, or two different ones: a ConfigError that says ``usage``."""
    given = [p for p in (positional, flag) if p is not None]
    if not given or (len(given) == 2 and given[0] != given[1]):
        raise ConfigError(usage + (f"; got {given[0]} and {given[1]}" if len(given) == 2 else ""))
    return given[0]
