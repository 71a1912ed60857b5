"""Memory switches keep the math: same loss and gradients (or weights) as the reference on CPU.

Tolerances: fp32, only the order of floating-point sums may differ -> rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import os

import pytest
import torch

from conftest import block_import, tiny_cfg
from tokenmill import checkpoint as ckpt
from tokenmill.config import ConfigError
from tokenmill.train.metrics import read_metrics
from tokenmill.train.trainer import Callbacks, build_model, train

TOL = {"rtol": 1e-5, "atol": 1e-6}


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r.get("loss") is not None}


def final_weights(run_dir):
    return ckpt.read_latest(run_dir)[1]["model"]


def assert_runs_match(a, b, weight_atol=TOL["atol"]):
    """Same per-step losses (1e-5 relative) and final weights. AdamW divides by sqrt(v): an element whose
    gradient is ~0 can move by up to ~lr on a rounding difference, hence ``weight_atol`` where the
    gradient summation order changes."""
    la, lb = losses(a), losses(b)
    assert la.keys() == lb.keys()
    for s in la:
        assert abs(la[s] - lb[s]) <= 1e-5 * abs(la[s]), (s, la[s], lb[s])
    wa, wb = final_weights(a), final_weights(b)
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=TOL["rtol"], atol=weight_atol)


def _stop_at(n):
    def stop(step):
        if step == n:
            raise KeyboardInterrupt  # a crash after step n (checkpoints every 3 steps)

    return stop


# -- chunked linear + cross-entropy ---------------------------------------------------------------


@pytest.mark.parametrize("tied,pad", [(True, 1), (False, 48)])
def test_chunked_loss_same_loss_and_grads(tied, pad):
    torch.manual_seed(0)
    x, y = torch.randint(0, 64, (4, 32)), torch.randint(0, 64, (4, 32))
    out = {}
    for impl in ("full", "chunked"):
        cfg = tiny_cfg(**{"model.loss_impl": impl, "model.loss_chunk_size": 48, "model.tie_embeddings": tied,
                          "model.vocab_pad_multiple": pad})
        model = build_model(cfg, 64, torch.device("cpu"))
        logits, loss = model(x, y)
        assert (logits is None) == (impl == "chunked")
        loss.backward()
        with torch.no_grad():
            _, eval_loss = model(x, y)  # evaluation path (no gradients)
        out[impl] = (loss.detach(), eval_loss, {k: p.grad for k, p in model.named_parameters()})
    torch.testing.assert_close(out["chunked"][0], out["full"][0], **TOL)
    torch.testing.assert_close(out["chunked"][1], out["full"][0], **TOL)
    for k, g in out["full"][2].items():
        torch.testing.assert_close(out["chunked"][2][k], g, **TOL)


@pytest.mark.slow
def test_chunked_loss_trains_like_full(tmp_path):
    common = {"train.max_steps": 4, "log.every_steps": 1}
    train(tiny_cfg(**common), tmp_path / "full", quiet=True)
    train(tiny_cfg(**common, **{"model.loss_impl": "chunked", "model.loss_chunk_size": 40}), tmp_path / "ch",
          quiet=True)
    assert_runs_match(tmp_path / "full", tmp_path / "ch", weight_atol=1e-5)


# -- optimizer step in backward -------------------------------------------------------------------


@pytest.mark.slow
def test_optimizer_in_backward_same_training(tmp_path):
    common = {"train.max_steps": 4, "log.every_steps": 1, "optim.grad_clip": 0.0}
    train(tiny_cfg(**common), tmp_path / "ref", quiet=True)
    train(tiny_cfg(**common, **{"memory.optimizer_in_backward": True}), tmp_path / "bwd", quiet=True)
    assert_runs_match(tmp_path / "ref", tmp_path / "bwd")


@pytest.mark.parametrize("over,msg", [
    ({"train.grad_accum_steps": 2, "optim.grad_clip": 0.0}, "grad_accum_steps=1"),
    ({}, "--optim.grad_clip 0"),
    ({"optim.grad_clip": 0.0, "memory.optimizer_offload": True}, "choose one of"),
])
def test_optimizer_in_backward_refuses(over, msg):
    with pytest.raises(ConfigError, match=msg):
        tiny_cfg(**{"memory.optimizer_in_backward": True, **over})


# -- CPU offload of the optimizer -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("switch,extra", [
    ("memory.optimizer_in_backward", {"optim.grad_clip": 0.0}),
    ("memory.optimizer_offload", {}),
])
def test_memory_optimizers_resume_bit_exact(tmp_path, switch, extra):
    over = {"train.max_steps": 6, "log.every_steps": 1, "checkpoint.every_steps": 3, switch: True, **extra}
    train(tiny_cfg(**over), tmp_path / "full", quiet=True)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_cfg(**over), tmp_path / "cut", quiet=True, callbacks=Callbacks(on_step_end=_stop_at(4)))
    train(tiny_cfg(**over), tmp_path / "cut", resume=True, quiet=True)
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_optimizer_offload_same_training(tmp_path, impl):
    """On CPU the offload path runs in full (master copies, gradient copies, CPU step, copy back); the
    device and host are the same memory, so it must give the plain optimizer's numbers."""
    common = {"train.max_steps": 4, "log.every_steps": 1, "optim.impl": impl}
    train(tiny_cfg(**common), tmp_path / "ref", quiet=True)
    train(tiny_cfg(**common, **{"memory.optimizer_offload": True}), tmp_path / "off", quiet=True)
    assert_runs_match(tmp_path / "ref", tmp_path / "off")
    # its checkpoints hold an ordinary AdamW state dict: resumable without the switch
    state = ckpt.read_latest(tmp_path / "off")[1]["optimizer"]
    assert set(state) == {"state", "param_groups"} and len(state["state"]) > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the real offload moves state off it")
def test_optimizer_offload_keeps_state_off_gpu():
    from tokenmill.optim.memory import CPUOffloadOptimizer

    cfg = tiny_cfg(**{"train.device": "cuda"})
    model = build_model(cfg, 64, torch.device("cuda"))
    opt = CPUOffloadOptimizer(model, cfg.optim)
    x = torch.randint(0, 64, (4, 32), device="cuda")
    model(x, x)[1].backward()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    torch.cuda.synchronize()
    assert all(t.device.type == "cpu" for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


# -- 8-bit AdamW ----------------------------------------------------------------------------------


def test_8bit_adamw_without_torchao_names_the_install(tmp_path, monkeypatch):
    block_import(monkeypatch, "torchao")
    from tokenmill.optim.memory import MemoryOptionError

    with pytest.raises(MemoryOptionError, match="pip install torchao"):
        train(tiny_cfg(**{"train.max_steps": 1, "memory.optimizer_8bit": True}), tmp_path, quiet=True)


@pytest.mark.slow
def test_8bit_adamw_trains_close(tmp_path):
    pytest.importorskip("torchao.optim", reason="torchao is not installed")
    common = {"train.max_steps": 5, "log.every_steps": 1}
    train(tiny_cfg(**common), tmp_path / "ref", quiet=True)
    train(tiny_cfg(**common, **{"memory.optimizer_8bit": True}), tmp_path / "q", quiet=True)
    a, b = losses(tmp_path / "ref"), losses(tmp_path / "q")
    assert all(abs(a[s] - b[s]) / a[s] < 0.02 for s in a)  # quantised moments: close, not equal


# -- allocator ------------------------------------------------------------------------------------


ALLOC_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


@pytest.fixture
def alloc_env(monkeypatch):
    """Both allocator variables unset, CUDA not initialised, and the environment restored after the test
    (each variable set before it is removed, so monkeypatch restores it even when it was absent: the code
    under test writes os.environ itself)."""
    for var in ALLOC_VARS:
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    return monkeypatch


def test_expandable_segments_sets_env_before_cuda(alloc_env):
    from tokenmill.config import MemoryConfig
    from tokenmill.train.device import apply_allocator_settings

    assert not apply_allocator_settings(MemoryConfig())
    assert not any(v in os.environ for v in ALLOC_VARS)
    assert apply_allocator_settings(MemoryConfig(expandable_segments=True))
    assert [os.environ[v] for v in ALLOC_VARS] == ["expandable_segments:True"] * 2
    alloc_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    alloc_env.delenv("PYTORCH_ALLOC_CONF")
    apply_allocator_settings(MemoryConfig(expandable_segments=True))
    assert [os.environ[v] for v in ALLOC_VARS] == ["max_split_size_mb:128,expandable_segments:True"] * 2


def test_allocator_settings_merge_both_variables(alloc_env):
    """torch >= 2.9 reads PYTORCH_ALLOC_CONF (and PYTORCH_CUDA_ALLOC_CONF only when that is unset): what the
    user put in either is kept, the newer one's value wins a key both set, and both variables get the whole
    merged setting, so whichever this torch reads holds it."""
    from tokenmill.config import MemoryConfig
    from tokenmill.train.device import allocator_conf, apply_allocator_settings

    alloc_env.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64,roundup_power2_divisions:4")
    alloc_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:32,backend:native")
    entries, source = allocator_conf()
    assert entries == {"max_split_size_mb": "64", "backend": "native", "roundup_power2_divisions": "4"}
    assert source["max_split_size_mb"] == source["roundup_power2_divisions"] == "PYTORCH_ALLOC_CONF"
    assert source["backend"] == "PYTORCH_CUDA_ALLOC_CONF"
    assert apply_allocator_settings(MemoryConfig(expandable_segments=True, gc_threshold=0.5))
    want = "max_split_size_mb:64,backend:native,roundup_power2_divisions:4,expandable_segments:True," \
           "garbage_collection_threshold:0.5"
    assert [os.environ[v] for v in ALLOC_VARS] == [want] * 2
    # a key the user set differently is left, and the warning names the variable that set it
    with pytest.warns(UserWarning, match=r"PYTORCH_ALLOC_CONF='.*' already sets max_split_size_mb; leaving it"):
        assert not apply_allocator_settings(MemoryConfig(max_split_size_mb=128))
    assert allocator_conf()[0]["max_split_size_mb"] == "64"
    # only the newer variable set, empty legacy one: it is the one read, and it gets the setting
    alloc_env.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:16")
    alloc_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    assert apply_allocator_settings(MemoryConfig(expandable_segments=True))
    assert os.environ["PYTORCH_ALLOC_CONF"] == "max_split_size_mb:16,expandable_segments:True"


def test_expandable_segments_after_cuda_init_warns_or_applies(alloc_env):
    from tokenmill.config import MemoryConfig
    from tokenmill.train import device as allocator

    alloc_env.setattr(torch.cuda, "is_initialized", lambda: True)
    alloc_env.setattr(torch.cuda.memory, "_set_allocator_settings", None, raising=False)
    with pytest.warns(UserWarning, match="already initialised.*PYTORCH_ALLOC_CONF=expandable_segments:True"):
        assert not allocator.apply_allocator_settings(MemoryConfig(expandable_segments=True))
    applied = []
    alloc_env.setattr(torch.cuda.memory, "_set_allocator_settings", applied.append, raising=False)
    assert allocator.apply_allocator_settings(MemoryConfig(expandable_segments=True))
    assert applied == ["expandable_segments:True"] and os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_offload_gradients_same_training(tmp_path, accum):
    """Gradients leave for the CPU inside backward (hook), accumulate there, and are clipped there: with
    clipping active (grad_clip 0.05 < the norms) and accumulation, the losses and logged gradient norms
    equal the plain optimizer's within 1e-5 relative (summation order of the accumulation and norm)."""
    common = {"train.max_steps": 4, "log.every_steps": 1, "optim.grad_clip": 0.05, "train.grad_accum_steps": accum}
    train(tiny_cfg(**common), tmp_path / "ref", quiet=True)
    train(tiny_cfg(**common, **{"memory.optimizer_offload": True, "memory.offload_gradients": True}),
          tmp_path / "off", quiet=True)
    ref, off = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "off")
    ref = [r for r in ref if "grad_norm" in r]
    off = [r for r in off if "grad_norm" in r]
    assert len(ref) == len(off) == 4 and all(r["grad_norm"] > 0.05 for r in ref)  # clipping was active
    for a, b in zip(ref, off):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_offload_gradients_frees_device_grads_in_backward():
    """After backward no parameter holds a gradient: each went to its CPU buffer in its hook."""
    from tokenmill.optim.memory import CPUOffloadOptimizer

    cfg = tiny_cfg(**{"memory.optimizer_offload": True, "memory.offload_gradients": True})
    model = build_model(cfg, 64, torch.device("cpu"))
    opt = CPUOffloadOptimizer(model, cfg.optim, offload_grads=True)
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(opt.got_grad) and any(float(b.abs().sum()) > 0 for b in opt.grad_bufs)


def test_offload_gradients_needs_optimizer_offload():
    with pytest.raises(ConfigError, match="add --memory.optimizer_offload true"):
        tiny_cfg(**{"memory.offload_gradients": True})
