"""Every error that carries a message meant for the user (ground floor: imports nothing of tokenmill).

``tokenmill.cli.main`` catches :class:`TokenmillError` and prints ``tokenmill: error: <message>``
(``tokenmill: config error: ...`` for :class:`ConfigError`) without a traceback. Raise the most
specific subclass; its message names what went wrong, the file or key, and what to do.
"""

from __future__ import annotations


class TokenmillError(Exception):
    """Base of every user-facing tokenmill error; the message says what to do."""


class ConfigError(TokenmillError, ValueError):
    """A config key or value is wrong; the message names it and the fix."""


class LadderError(ConfigError):
    """A bad benchmark ladder file, rung or ladder option."""


class DataError(TokenmillError, ValueError):
    """Bad or missing data. The message names the file, the problem and the fix."""


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
