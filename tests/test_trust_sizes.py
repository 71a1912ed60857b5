"""Absurd sizes recorded in a run folder stop at once with the numbers: a checkpoint whose config asks for
a billion layers (or an absurd width) is refused before any model is built, by every command that reads it."""

import time

import pytest
import torch

from conftest import run_cli, tiny_cfg
from tokenmill import checkpoint as ckpt
from tokenmill.train.trainer import train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    train(tiny_cfg(**{"train.max_steps": 1, "train.eval_batches": 0}), d, quiet=True)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("field, value", [("n_layer", 10**9), ("n_embd", 2**40)])
@pytest.mark.parametrize("command", ["sample", "export"])
def test_an_absurd_recorded_size_stops_at_once(run, tmp_path, field, value, command):
    [(_, path)] = ckpt.list_checkpoints(run)[-1:]
    original = path.read_bytes()
    state = torch.load(path, weights_only=True)
    state["config"]["model"][field] = value
    torch.save(state, path)
    try:
        args = {"sample": ["sample", "--run-dir", str(run), "--max-new-tokens", "2"],
                "export": ["export", "--run-dir", str(run), "--out", str(tmp_path / "hf")]}[command]
        t0 = time.perf_counter()
        out = run_cli(*args)
        elapsed = time.perf_counter() - t0
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        assert "absurd" in out.stderr and f"{value:,}" in out.stderr, out.stderr  # config/size.py check_size
        assert elapsed < 30  # refused before anything is built; building 10**9 blocks would take hours
    finally:
        path.write_bytes(original)
