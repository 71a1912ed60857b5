"""The error types that carry a message meant for the user (printed without a traceback)."""

from __future__ import annotations


def _user_errors() -> tuple[type[BaseException], ...]:
    from tokenmill.bench.sizing import SizingError
    from tokenmill.data.errors import DataError
    from tokenmill.memory.optimizers import MemoryOptionError
    from tokenmill.parallel.world import ParallelError
    from tokenmill.profiling.doctor import DoctorError
    from tokenmill.train.precision import PrecisionError
    from tokenmill.train.sample import SampleError
    from tokenmill.train.trainer import TrainingError

    return (DataError, DoctorError, MemoryOptionError, ParallelError, PrecisionError, SampleError, SizingError,
            TrainingError)


def __getattr__(name: str):
    if name == "USER_ERRORS":
        return _user_errors()
    raise AttributeError(name)
