"""Every memory switch on the Llama-family test model (preset ``tiny-llama``: RoPE, RMSNorm, SwiGLU, no
biases, grouped-query attention 4:2, untied head), through the real trainer, against the same run
without the switch, as tests/test_memory.py and tests/test_switches.py check for GPT-2:

- bit-identical losses and validation losses (CPU, fp32): activation offloading, ``optim.zero_grad
  after_forward`` (with and without accumulation), activation checkpointing of every block and of
  every 2nd (with dropout: the recomputation replays the masks and the rotary tables are buffers);
- 1e-5 relative losses and final weights (summation order only): the optimizer step in backward, the
  CPU-offloaded optimizer (foreach and fused), gradient offloading (clipping active, with
  accumulation), the chunked loss (with a padded vocabulary);
- resumes of the memory optimizers: bit-identical loss trajectories;
- 8-bit AdamW: without torchao the error names the install; with it, close to AdamW.
"""

from __future__ import annotations

import pytest
import torch

from conftest import block_import
from test_memory import _stop_at, assert_runs_match, losses
from test_parallel import preset_cfg
from tokenmill import checkpoint as ckpt
from tokenmill.train.metrics import read_metrics
from tokenmill.train.trainer import Callbacks, build_model, train

PRESET = "tiny-llama"
COMMON = {"train.max_steps": 4, "log.every_steps": 1, "train.eval_every_steps": 2, "train.eval_batches": 2}
ACCUM = {"train.grad_accum_steps": 2, "train.batch_size": 2}


def cfg(**over):
    return preset_cfg(PRESET, **{**COMMON, **over})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """``run(**overrides)`` -> the run directory of a trained ``tiny-llama`` run; runs with the same
    overrides are trained once per module (the references shared by several tests)."""
    done: dict[tuple, object] = {}

    def go(**over):
        key = tuple(sorted(over.items()))
        if key not in done:
            done[key] = tmp_path_factory.mktemp("run")
            train(cfg(**over), done[key], quiet=True)
        return done[key]

    return go


def rows(run_dir, key: str) -> list[float]:
    return [r[key] for r in read_metrics(run_dir) if key in r]


@pytest.mark.slow
@pytest.mark.parametrize("over,base", [
    ({"memory.offload_activations": True}, {}),
    ({"optim.zero_grad": "after_forward"}, {}),
    ({"optim.zero_grad": "after_forward"}, ACCUM),
    ({"memory.activation_checkpointing": 1}, {"model.dropout": 0.1}),
    ({"memory.activation_checkpointing": 2}, {"model.dropout": 0.1, **ACCUM}),
], ids=["offload-activations", "zero-grad-after-forward", "zero-grad-after-forward-accum", "checkpoint-every-block",
        "checkpoint-every-2nd-accum"])
def test_switch_is_bit_identical(run, over, base):
    """The switch changes where tensors live, when they are freed or recomputed, not the math."""
    ref, got = run(**base), run(**base, **over)
    assert rows(got, "loss") == rows(ref, "loss") and len(rows(ref, "loss")) == 4
    assert rows(got, "val_loss") == rows(ref, "val_loss") and len(rows(ref, "val_loss")) == 2
    assert rows(got, "grad_norm") == rows(ref, "grad_norm")


def test_checkpointed_blocks_are_wrapped():
    """The bit-identical runs above did recompute: every block (1) or every 2nd block (2) is wrapped."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for every, want in ((1, [True, True]), (2, [True, False])):
        model = build_model(cfg(**{"memory.activation_checkpointing": every}), 64, torch.device("cpu"))
        assert [isinstance(b, CheckpointWrapper) for b in model.blocks] == want


@pytest.mark.slow
def test_optimizer_in_backward_same_training(run):
    over = {"optim.grad_clip": 0.0}
    assert_runs_match(run(**over), run(**over, **{"memory.optimizer_in_backward": True}))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_optimizer_offload_same_training(run, impl):
    over = {"optim.impl": impl}
    off = run(**over, **{"memory.optimizer_offload": True})
    assert_runs_match(run(**over), off)
    state = ckpt.read_latest(off)[1]["optimizer"]  # an ordinary AdamW state dict: resumable without it
    assert set(state) == {"state", "param_groups"} and len(state["state"]) == len(list(
        build_model(cfg(), 64, torch.device("cpu")).parameters()))


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_offload_gradients_same_training(run, accum):
    """Gradients go to the CPU in backward, accumulate and are clipped there (clipping active)."""
    over = {"optim.grad_clip": 0.05, "train.grad_accum_steps": accum}
    ref = run(**over)
    off = run(**over, **{"memory.optimizer_offload": True, "memory.offload_gradients": True})
    norms = rows(ref, "grad_norm")
    assert len(norms) == 4 and all(n > 0.05 for n in norms)
    for a, b in zip(norms, rows(off, "grad_norm")):
        assert b == pytest.approx(a, rel=1e-5)
    assert_runs_match(ref, off)


@pytest.mark.slow
def test_chunked_loss_trains_like_full(run):
    pad = {"model.vocab_pad_multiple": 48}  # 64 -> 96 rows: padded columns never enter the chunks' loss
    chunked = run(**pad, **{"model.loss_impl": "chunked", "model.loss_chunk_size": 40})
    assert_runs_match(run(**pad), chunked, weight_atol=1e-5)
    for a, b in zip(rows(run(**pad), "val_loss"), rows(chunked, "val_loss")):
        assert b == pytest.approx(a, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("switch,extra", [
    ("memory.optimizer_in_backward", {"optim.grad_clip": 0.0}),
    ("memory.optimizer_offload", {"memory.offload_gradients": True}),
])
def test_memory_optimizers_resume_bit_exact(tmp_path, switch, extra):
    over = {"train.max_steps": 6, "checkpoint.every_steps": 3, "train.eval_batches": 0, switch: True, **extra}
    train(cfg(**over), tmp_path / "full", quiet=True)
    with pytest.raises(KeyboardInterrupt):
        train(cfg(**over), tmp_path / "cut", quiet=True, callbacks=Callbacks(on_step_end=_stop_at(4)))
    train(cfg(**over), tmp_path / "cut", resume=True, quiet=True)
    assert losses(tmp_path / "cut") == losses(tmp_path / "full") and len(losses(tmp_path / "full")) == 6


def test_8bit_adamw_without_torchao_names_the_install(tmp_path, monkeypatch):
    block_import(monkeypatch, "torchao")
    from tokenmill.optim.memory import MemoryOptionError

    with pytest.raises(MemoryOptionError, match="pip install torchao"):
        train(cfg(**{"train.max_steps": 1, "memory.optimizer_8bit": True}), tmp_path, quiet=True)


@pytest.mark.slow
def test_8bit_adamw_trains_close(run):
    pytest.importorskip("torchao.optim", reason="torchao is not installed")
    a, b = rows(run(), "loss"), rows(run(**{"memory.optimizer_8bit": True}), "loss")
    assert all(abs(x - y) / x < 0.02 for x, y in zip(a, b))  # quantised moments: close, not equal
