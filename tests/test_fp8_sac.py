"""FP8 under activation checkpointing: what a block keeps for backward.

The estimator traces the unconverted model and charges FP8 no saved activations of its own
(``estimate/techniques.py``). That holds because of where the checkpoint's op policy sits: its dispatch mode
is above torchao's float8 tensor subclass, so the policy is asked about ``aten.mm`` on the float8 operands
(never about the ``_scaled_mm`` the subclass issues inside it) and keeps the product's high-precision output,
the bytes a bf16 block keeps. The same placement makes torchtitan's op policy (every second ``aten.mm``) keep
float8 products too (``benchmarks/validation/published.toml``, the torchao float8 section)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from test_sac import Alive
from tokenmill import config as C
from tokenmill.model import build
from tokenmill.model.build import apply_activation_checkpointing, build_gpt
from tokenmill.model.fp8 import apply_fp8

V = 96
SAVE_MATMULS = build.save_matmuls_policy
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="the emulation tests need torchao (`pip install torchao`)")


def kept_and_asked(recipe: str, policy: str, monkeypatch) -> tuple[int, list[tuple[str, str]]]:
    """Bytes one Llama block keeps after its forward (its output aside), and the (op, first operand's type) the
    selective policy was asked about."""
    cfg = C.resolve("tiny-llama", overrides={"model.vocab_size": V}, overrides_from_string=False).model
    torch.manual_seed(0)
    model = build_gpt(cfg, V, "cpu")
    if recipe != "off":
        apply_fp8(model, C.TrainConfig(fp8=recipe), C.ParallelConfig(), torch.device("cpu"), emulate=True)
        assert type(model.blocks[0].mlp.c_fc).__name__ == "Float8Linear"
    asked = []

    def policy_fn(ctx, op, *args, **kwargs):
        if not ctx.is_recompute:
            asked.append((str(op), type(args[0]).__name__ if args else ""))
        return SAVE_MATMULS(ctx, op, *args, **kwargs)

    monkeypatch.setattr(build, "save_matmuls_policy", policy_fn)
    apply_activation_checkpointing(model, 1, policy)
    x = torch.randn(2, cfg.block_size, cfg.n_embd, requires_grad=True)
    mode = Alive([x, *model.parameters(), *model.buffers()])
    with mode:
        y = model.blocks[0](x, (model.rope_cos, model.rope_sin))
    kept = mode.alive() - y.untyped_storage().nbytes()
    y.sum().backward()
    assert x.grad is not None
    return kept, asked


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_blocks_keep_what_bf16_blocks_keep(recipe, monkeypatch):
    cfg = C.resolve("tiny-llama", overrides={"model.vocab_size": V}, overrides_from_string=False).model
    ref, asked_ref = kept_and_asked("off", "save-matmuls", monkeypatch)
    kept, asked = kept_and_asked(recipe, "save-matmuls", monkeypatch)
    # the products' outputs at least: q, k, v (grouped), the attention output, o, gate and up, down
    B, T, E, kv = 2, cfg.block_size, cfg.n_embd, cfg.n_kv_head * (cfg.n_embd // cfg.n_head)
    assert ref >= 4 * B * T * (3 * E + 2 * kv + 2 * cfg.mlp_width)
    assert kept == ref
    mms = [a for a in asked if a[0] == "aten.mm.default"]
    assert len(mms) == len([a for a in asked_ref if a[0] in ("aten.mm.default", "aten.addmm.default")]) == 7
    assert all(t.startswith("Float8") for _, t in mms), mms  # the subclass's operands, not its inner kernels
    assert not [a for a in asked if "_scaled_mm" in a[0]]
    assert kept_and_asked(recipe, "full", monkeypatch)[0] == 0
