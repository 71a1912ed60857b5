"""Every error that carries a message meant for the user (ground floor: imports nothing of tokenmill).

``tokenmill.cli.main`` catches :class:`TokenmillError` and prints ``tokenmill: error: <message>``
(``tokenmill: config error: ...`` for :class:`ConfigError`) without a traceback. Raise the most
specific subclass; its message names what went wrong, the file or key, and what to do.
"""

from __future__ import annotations

import errno


class TokenmillError(Exception):
    """Base of every user-facing tokenmill error; the message says what to do."""


class ConfigError(TokenmillError, ValueError):
    """A config key or value is wrong; the message names it and the fix."""


class LadderError(ConfigError):
    """A bad benchmark ladder file, rung or ladder option."""


class DataError(TokenmillError, ValueError):
    """Bad or missing data. The message names the file, the problem and the fix."""


class BadRecordError(DataError):
    """One input record that cannot be used (e.g. a conversation the chat template refuses): ``prepare`` counts
    and reports it, and stops on it only with ``--on-bad-record stop``. The message is the reason alone."""


class PathError(TokenmillError, ValueError):
    """An output path that overlaps an input, or a name that would leave its folder."""


class CheckpointError(TokenmillError):
    """A checkpoint that cannot be written or read safely (damaged, foreign or refused content)."""


class TrainingError(TokenmillError, RuntimeError):
    """A run stopped for a reason the user can act on; the message says what to do."""


class PrecisionError(TokenmillError, RuntimeError):
    """A precision mode this device cannot run."""


class MemoryOptionError(TokenmillError, RuntimeError):
    """A memory switch that cannot run here; the message says why and what to do."""


class ParallelError(TokenmillError, RuntimeError):
    """A parallel layout that cannot run (world size, mesh, unsupported combination)."""


class SampleError(TokenmillError, RuntimeError):
    """Text generation cannot run on this run directory or with these options."""


class DoctorError(TokenmillError, RuntimeError):
    """A run directory or profile the doctor cannot read."""


class SizingError(TokenmillError, RuntimeError):
    """A max-batch / max-model search that cannot run."""


_OS_FIXES = {
    errno.ENOSPC: "free disk space, then run the command again (a run continues with --resume)",
    errno.EDQUOT: "free disk space (quota exceeded), then run the command again",
    errno.EFBIG: "the file is over a size limit of this system or its file system; free space or raise the limit",
    errno.EACCES: "make it readable/writable for you, or choose another path",
    errno.EPERM: "make it readable/writable for you, or choose another path",
    errno.EROFS: "the file system is read-only: choose a path on a writable one",
    errno.ENOTDIR: "a file stands where a folder is needed: move it away, or choose another path",
    errno.EEXIST: "something already exists there: move it away, or choose another path",
    errno.EISDIR: "a folder stands where a file is needed: give a file's path",
    errno.ENOENT: "check the path",
}


def describe_os_error(e: OSError, what: str = "") -> str:
    """``<what> <path>: <reason>; <what to do>`` for an operating-system error (disk full, permission
    denied, read-only file system, a file where a folder should be, ...)."""
    path = e.filename if e.filename is not None else ""
    head = " ".join(x for x in (what, str(path)) if x)
    fix = _OS_FIXES.get(e.errno, "check the path and the disk")
    return f"{head}: {e.strerror or e}; {fix}." if head else f"{e.strerror or e}; {fix}."


class AlreadyTrained(TokenmillError):
    """On resume: the run already reached ``train.max_steps``. ``train()`` reports it and returns
    without writing anything (not an error for the user)."""


class GraphCaptured(TokenmillError):
    """Not a user error: the estimator's signal that a compiled backward graph has been captured and need not run
    (``estimate/compiled.py``: a graph replaying saved random-number states could not run on fake tensors)."""
