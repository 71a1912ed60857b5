"""Switches that must keep the math: the run with the switch gives the same losses as the reference form.

Allocator settings (``memory.max_split_size_mb``, ``memory.gc_threshold``), activation offloading to the
CPU (``memory.offload_activations``), the gradient-freeing placement (``optim.zero_grad``), evaluation under
inference mode (``train.eval_inference_mode``), and that ``compile.loss_outside`` goes with either scope.
"""

import os

import pytest
import torch

from conftest import tiny_cfg
from tokenmill.config import MemoryConfig
from tokenmill.errors import ConfigError
from tokenmill.train.metrics import read_metrics
from tokenmill.train.trainer import train


def run_losses(run_dir, **over):
    cfg = tiny_cfg(**{"train.max_steps": 4, "log.every_steps": 1, "train.eval_every_steps": 2,
                      "train.eval_batches": 2, **over})
    train(cfg, run_dir, quiet=True)
    rows = read_metrics(run_dir)
    return [r["loss"] for r in rows if "loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run_losses(tmp_path_factory.mktemp("ref"))


ACCUM = {"train.grad_accum_steps": 2, "train.batch_size": 2}


@pytest.mark.slow
@pytest.mark.parametrize("over,base", [
    ({"memory.offload_activations": True}, {}),
    ({"optim.zero_grad": "after_forward"}, {}),
    ({"optim.zero_grad": "after_forward"}, ACCUM),
    ({"train.eval_inference_mode": False}, {}),
], ids=["offload-activations", "zero-grad-after-forward", "zero-grad-after-forward-accum", "eval-no-grad"])
def test_switch_keeps_the_losses(tmp_path, reference, over, base):
    """Bit-identical on CPU: the switch changes where tensors live or when they are freed, not the math."""
    ref = run_losses(tmp_path / "ref", **base) if base else reference
    train_losses, val_losses = run_losses(tmp_path / "switch", **base, **over)
    assert train_losses == ref[0] and val_losses == ref[1]
    assert len(train_losses) == 4 and len(val_losses) == 2


def test_allocator_settings_compose_the_environment(monkeypatch):
    from tokenmill.train.device import apply_allocator_settings

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):  # unset, and restored after the test
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    assert apply_allocator_settings(MemoryConfig(max_split_size_mb=256, gc_threshold=0.8))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256,garbage_collection_threshold:0.8"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    with pytest.warns(UserWarning, match="already sets max_split_size_mb"):
        assert not apply_allocator_settings(MemoryConfig(max_split_size_mb=256, expandable_segments=True))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True"


@pytest.mark.parametrize("key,value", [("memory.gc_threshold", 1.5), ("memory.max_split_size_mb", -1)])
def test_allocator_settings_out_of_range(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        tiny_cfg(**{key: value})


def test_loss_outside_goes_with_either_scope():  # 'block': only the blocks compiled (tests/test_compile_head.py)
    assert tiny_cfg(**{"compile.loss_outside": True, "compile.scope": "block"}).compile.loss_outside
