"""memory.offload_activations in the estimator: the bytes it moves to the host are the bytes the saved-tensor
hooks (tokenmill.model.offload) move on the real model (eager, compiled, with and without activation checkpointing),
compiled pieces stay compiled under it, and the step waits only for the copies the compute cannot hide."""

import pytest
import torch

from tokenmill import config as C
from tokenmill.estimate import estimate
from tokenmill.estimate import roofline as R
from tokenmill.estimate.gpus import gpu_spec
from tokenmill.estimate.trace import compiled_pieces, trace_pieces
from tokenmill.model.build import apply_activation_checkpointing, build_gpt
from tokenmill.model.offload import ActivationOffload

VOCAB = 128


def _cfg(**over):
    ov = {"data.source": "synthetic", "model.n_layer": 2, "model.n_embd": 64, "model.n_head": 2, "model.block_size": 32,
          "model.vocab_size": VOCAB, "train.batch_size": 2, "memory.offload_activations": True,
          "train.precision": "fp32", "model.dropout": 0.0, "model.attention": "manual", **over}
    return C.resolve("gpt2-124m", overrides=ov, overrides_from_string=False)


def _estimated_host_sizes(cfg) -> list[int]:
    """The tensors the estimate moves in one forward, in the order the pieces save them (what the step's replay of
    the copies and the tensors kept at the forward's end, step.offload_kept_bytes, read)."""
    p = trace_pieces(cfg, VOCAB, "cuda")
    return p.embed.host_sizes + [b for k in p.kinds for b in p.blocks[k].host_sizes] + p.head.host_sizes


def _estimated_host_bytes(cfg) -> int:
    return sum(_estimated_host_sizes(cfg))


def _real_host_sizes(cfg, compiled: bool) -> list[int]:
    """What tokenmill's offload moves (tokenmill.model.offload.ActivationOffload, the trainer's hooks) in one
    forward of the real model on the CPU, compiled block by block as apply_compile does."""
    torch.manual_seed(0)
    model = build_gpt(cfg.model, VOCAB, "cpu")
    if cfg.memory.activation_checkpointing:
        apply_activation_checkpointing(model, cfg.memory.activation_checkpointing)
    if compiled:
        for block in model.blocks:
            block.compile()
    idx = torch.randint(0, VOCAB, (2, 32))
    with ActivationOffload(model, torch.device("cpu")) as hooks:
        model(idx, idx)
    assert sum(s for *_, s in hooks.saved) == hooks.moved
    return [s for *_, s in hooks.saved]


def _real_host_bytes(cfg, compiled: bool) -> int:
    return sum(_real_host_sizes(cfg, compiled))


@pytest.mark.parametrize("ac", [0, 1])
def test_eager_offload_moves_what_the_hooks_see(ac):
    """Tensor by tensor, in order: the replay of the copies and the last tensors kept read this list."""
    cfg = _cfg(**{"memory.activation_checkpointing": ac})
    assert _estimated_host_sizes(cfg) == _real_host_sizes(cfg, compiled=False)


@pytest.mark.slow
def test_compiled_offload_moves_what_the_hooks_see():
    """AOTAutograd saves its graph's tensors through the hooks: without checkpointing those, parameters aside; a
    compiled checkpointed block saves its input and its parameters, of which only the input moves."""
    for ac in (0, 1):
        cfg = _cfg(**{"memory.activation_checkpointing": ac, "compile.enabled": True, "compile.scope": "block",
                      "compile.loss_outside": True})  # the blocks alone, as _real_host_sizes compiles them
        assert compiled_pieces(cfg) == {"block"}  # offloading no longer turns the compiled trace into an eager one
        est, real = _estimated_host_bytes(cfg), _real_host_bytes(cfg, compiled=True)
        assert est == real > 0, ac


@pytest.mark.slow
def test_offload_waits_only_for_what_the_compute_cannot_hide_and_frees_device_memory(monkeypatch):
    """GPT-2 124M at batch 4, compiled, on an H100: without checkpointing the blocks save far more than the link
    moves in a forward (the step waits, never longer than the two copies in a row would take); a link 1000 times
    faster hides the copies altogether."""
    base = {"data.source": "synthetic", "train.batch_size": 4, "compile.enabled": True}

    def pair(**extra):
        on = C.resolve("gpt2-124m", overrides={**base, **extra, "memory.offload_activations": True},
                       overrides_from_string=False)
        off = C.resolve("gpt2-124m", overrides={**base, **extra}, overrides_from_string=False)
        assert compiled_pieces(on) == compiled_pieces(off) == {"embed", "block", "head"}
        return estimate(on, "h100-sxm"), estimate(off, "h100-sxm")

    e_on, e_off = pair()
    moved, waited = e_on.host_mb * 2 ** 20, e_on.time_breakdown_ms["activation_offload_ms"]
    assert moved > 0 and e_off.host_mb == 0 and e_on.peak_alloc_mb < e_off.peak_alloc_mb
    link = R.host_link_bytes_s(gpu_spec("h100-sxm"))
    assert moved / link * 1e3 > e_off.step_ms  # one direction alone outlasts the step without it
    assert e_off.step_ms < waited < 2 * moved / link * 1e3
    assert e_on.step_ms == pytest.approx(e_off.step_ms + waited, rel=0.02)
    monkeypatch.setattr(R, "PCIE_PAYLOAD_SHARE", R.PCIE_PAYLOAD_SHARE * 1000)
    fast, _ = pair()
    assert fast.time_breakdown_ms["activation_offload_ms"] < 0.01 * e_off.step_ms
