import os

import pytest
import torch

from tokenmill import config as C

torch.set_num_threads(1)  # tiny models: more threads only add contention on 2-core CI


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Each test session prepares the embedded corpus in its own cache folder, never the user's."""
    cache = tmp_path_factory.getbasetemp() / "tokenmill-cache"
    monkeypatch.setenv("TOKENMILL_CACHE", str(cache))
    monkeypatch.setenv("TOKENMILL_TEST", "1")


def tiny_cfg(**overrides) -> C.Config:
    """The tiny preset on synthetic tokens (vocab 64), quiet, on CPU."""
    base = {
        "data.source": "synthetic",
        "model.vocab_size": 64,
        "train.device": "cpu",
        "log.progress": "plain",
        "log.tensorboard": False,
        "train.precision": "fp32",  # what 'auto' gives on a CPU, recorded as such (test_defaults.py tests 'auto')
        "train.tf32": False,
    }
    base.update(overrides)
    return C.resolve("tiny", overrides=base, overrides_from_string=False)


def cpu_env() -> dict:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


def block_import(monkeypatch, prefix: str) -> None:
    """Make ``import prefix...`` fail as if the package were not installed (for the install messages)."""
    import builtins

    real = builtins.__import__

    def refuse(name, *a, **k):
        if name.startswith(prefix):
            raise ImportError(f"No module named '{name}'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", refuse)
