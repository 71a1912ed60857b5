"""The error types that carry a message meant for the user (printed without a traceback)."""

from __future__ import annotations


def _user_errors() -> tuple[type[BaseException], ...]:
    from tokenmill.data.errors import DataError
    from tokenmill.memory.optimizers import MemoryOptionError
    from tokenmill.parallel.world import ParallelError
    from tokenmill.train.precision import PrecisionError
    from tokenmill.train.sample import SampleError
    from tokenmill.train.trainer import TrainingError

    errors: list[type[BaseException]] = [
        DataError, MemoryOptionError, ParallelError, PrecisionError, SampleError, TrainingError,
    ]
    # the bench and profiling sub-commands live in their own packages, which may be left out
    for module, name in (("tokenmill.bench.sizing", "SizingError"), ("tokenmill.profiling.doctor", "DoctorError")):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except ModuleNotFoundError as e:
            if e.name not in (module, module.rsplit(".", 1)[0]):
                raise
    return tuple(errors)


def __getattr__(name: str):
    if name == "USER_ERRORS":
        return _user_errors()
    raise AttributeError(name)
