"""model.document_attention: documents kept apart by FlexAttention's block mask, against the explicit mask.

The reference is the explicit path (``model.document_attention='explicit'``, the (B, 1, T, T) mask that
tests/test_document_mask.py checks against each document run alone): the same weights (two models built from
the same seed), the same random packed windows. FlexAttention has no backward on the CPU, so the CPU checks
compare outputs (eager, and once compiled); the gradients are compared on CUDA (``-m gpu``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from tokenmill import config as C
from tokenmill.errors import ConfigError
from tokenmill.model.build import apply_document_mask, build_gpt
from tokenmill.model.layers import document_block_mask, document_mask, document_positions

V, EOT = 64, 63
CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _quiet_eager_flex():
    """Eager FlexAttention (the CPU's) warns that it runs unfused: expected here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")
        yield


def packed(B: int, T: int, seed: int) -> torch.Tensor:
    """(B, T) windows cut at a random offset from back-to-back documents of random lengths (1 to T/2 tokens,
    each ending with the eot id): a window starts inside a document and its last document runs past its end."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        docs = []
        while sum(len(d) for d in docs) < 2 * T:
            n = int(torch.randint(1, T // 2 + 1, (1,), generator=g))
            docs.append(torch.cat([torch.randint(0, EOT, (n,), generator=g), torch.tensor([EOT])]))
        stream = torch.cat(docs)
        start = int(torch.randint(1, T // 2, (1,), generator=g))
        rows.append(stream[start : start + T])
    return torch.stack(rows)


def _model(preset: str, positions: bool, impl: str, device: str = "cpu", **over):
    """A model with ``model.document_attention = impl``, keeping documents apart, fp32, seed 0."""
    over = {"model.vocab_size": V, "train.device": device, "data.source": "synthetic",
            "model.document_attention": impl, **over}
    cfg = C.resolve(preset, overrides=over, overrides_from_string=False)
    torch.manual_seed(0)
    model = build_gpt(cfg.model, V, device)
    model.keep_documents_apart(EOT, positions)
    return model


def _models(preset: str, positions: bool, device: str = "cpu", **over):
    """(explicit, flex) models with the same weights."""
    return [_model(preset, positions, impl, device, **over) for impl in ("explicit", "flex")]


@pytest.mark.parametrize("T", [40, 300])
def test_block_mask_is_the_explicit_mask(T):
    """The block mask's rule, evaluated on every (query, key) pair, is exactly the explicit mask's complement,
    and its block table lists exactly the 128 x 128 tiles that hold a visible pair (T = 300: three tiles a side,
    the last one partial)."""
    from torch.nn.attention.flex_attention import create_mask

    x = packed(3, T, seed=T)
    pos = document_positions(x, EOT)
    assert (pos[:, 1:] == 0).any() and (pos[:, -1] > 0).all()  # boundaries inside, a document cut at the end
    block = document_block_mask(pos)
    blocked = document_mask(pos, "manual", torch.float32)  # (B, 1, T, T) bool, True where i may not look
    assert torch.equal(create_mask(block.mask_mod, 3, 1, T, T, device="cpu"), ~blocked)
    n = -(-T // 128)
    visible = torch.nn.functional.pad(~blocked, (0, n * 128 - T, 0, n * 128 - T))
    tiles = visible.view(3, 1, n, 128, n, 128).any(dim=5).any(dim=3)
    assert torch.equal(block.to_dense().bool(), tiles)


@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_flex_forward_equals_explicit(preset, positions):
    """Logits and loss of FlexAttention equal the explicit mask's within 1e-5 (fp32, eager on the CPU) on random
    packed windows: GPT-2 (learned positions) and Llama (RoPE, 4 query heads on 2 key/value heads), positions
    running on or restarting per document. Without the document mask the logits differ: the check can fail."""
    explicit, flex = _models(preset, positions)
    x = packed(3, 32, seed=7)
    y = packed(3, 32, seed=8)
    with torch.no_grad():
        (le, loss_e), (lf, loss_f) = explicit(x, y), flex(x, y)
        torch.testing.assert_close(lf, le, atol=1e-5, rtol=0)
        torch.testing.assert_close(loss_f, loss_e, atol=1e-6, rtol=0)
        explicit.doc_eot_id = None  # plain causal over the whole window
        assert (explicit(x)[0] - lf).abs().max() > 1e-2


def test_the_mask_each_setting_builds_on_the_cpu():
    """'auto' and 'explicit' build the explicit mask on the CPU; 'flex' builds a block mask for a forward without
    gradients; manual attention always takes the explicit mask."""
    pos = document_positions(packed(2, 16, seed=1), EOT)
    for impl in ("auto", "explicit"):
        assert isinstance(_model("tiny", False, impl).document_attention_mask(pos, torch.float32), torch.Tensor)
    flex = _model("tiny", False, "flex")
    with torch.no_grad():
        assert not isinstance(flex.document_attention_mask(pos, torch.float32), torch.Tensor)
    manual = _model("tiny", False, "flex", **{"model.attention": "manual"})
    with torch.no_grad():
        assert manual.document_attention_mask(pos, torch.float32).dtype == torch.bool


def test_flex_refusals_name_the_field():
    """Forced 'flex' is refused where it cannot train: on the CPU with gradients (no FlexAttention backward
    there), and with attention dropout (FlexAttention has none); 'auto' leaves both to the explicit mask."""
    flex = _model("tiny", False, "flex")
    with pytest.raises(ConfigError, match="model.document_attention='flex' cannot train on cpu"):
        flex(packed(2, 16, seed=2), packed(2, 16, seed=3))
    with pytest.raises(ConfigError, match="model.dropout=0.1.*--model.document_attention auto"):
        _model("tiny", False, "flex", **{"model.dropout": 0.1})
    cfg = C.resolve("tiny", overrides={"model.vocab_size": V, "data.source": "synthetic", "model.dropout": 0.1,
                                       "data.document_mask": True}, overrides_from_string=False)
    model = apply_document_mask(build_gpt(cfg.model, V, "cpu"), cfg.data, EOT)
    assert model.cfg.document_attention == "auto"
    _, loss = model(packed(2, 16, seed=2), packed(2, 16, seed=3))
    loss.backward()  # auto: the explicit mask, with dropout, trains on the CPU


@pytest.mark.slow
def test_compiled_flex_equals_explicit_on_the_cpu():
    """Each block compiled (``compile.scope='block'``): the eager block mask passed into the compiled blocks and
    FlexAttention's fused CPU kernel give the explicit path's logits within 1e-5 (GQA and RoPE), on two windows
    with different boundaries and no recompilation for the second. (The whole model compiled, the block mask
    built inside the graph, is what CUDA runs; torch 2.13's CPU lowering refuses it: forward-only there anyway.)"""
    import torch._dynamo

    explicit, flex = _models("tiny-llama", True)
    torch._dynamo.reset()
    for block in flex.blocks:
        block.compile()
    with torch.no_grad():
        for i, seed in enumerate((11, 12)):
            x = packed(2, 32, seed=seed)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                lf = flex(x)[0]
            torch.testing.assert_close(lf, explicit(x)[0], atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="FlexAttention's backward needs a CUDA GPU")
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_flex_gradients_equal_explicit_on_cuda(preset):
    """On CUDA ('auto' picks flex there): logits within 1e-5, the loss within 1e-6 and every gradient within
    1e-4 of the explicit mask's (fp32, compiled FlexAttention kernels), on random packed windows."""
    explicit, flex = _model(preset, True, "explicit", "cuda"), _model(preset, True, "auto", "cuda")
    x, y = packed(4, 32, seed=21).cuda(), packed(4, 32, seed=22).cuda()
    assert not isinstance(flex.document_attention_mask(document_positions(x, EOT), torch.float32), torch.Tensor)
    (le, loss_e), (lf, loss_f) = explicit(x, y), flex(x, y)
    torch.testing.assert_close(lf, le, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_f, loss_e, atol=1e-6, rtol=0)
    loss_e.backward()
    loss_f.backward()
    for (name, p), q in zip(flex.named_parameters(), explicit.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=0, msg=name)
    flex.compile()  # compile.enabled's default scope: the block mask built inside the one graph
    torch.testing.assert_close(flex(x)[0], le, atol=1e-5, rtol=0)


def test_estimate_counts_no_mask_for_flex():
    """The estimator's term (estimate/techniques.py): on an H100, 'auto' (FlexAttention) adds only its block mask's
    few bytes (no T x T term), no repeated grouped keys and values, and the same attention tiles at FlexAttention's
    speed; with dropout
    'auto' is the explicit mask again (B x T x T bf16 entries), and so is 'auto' on a CPU (fp32 entries)."""
    from tokenmill.estimate import estimate

    B, T = 4, 1024
    base = {"data.source": "synthetic", "model.vocab_size": 512, "model.n_layer": 2, "model.n_embd": 128,
            "model.n_head": 4, "model.n_kv_head": 2, "model.block_size": T, "train.batch_size": B,
            "train.device": "cpu", "train.precision": "bf16-autocast"}

    def est(device: str, **over):
        return estimate(C.resolve(None, overrides={**base, **over}, overrides_from_string=False), device)

    off, flex = est("h100-sxm"), est("h100-sxm", **{"data.document_mask": True})
    from tokenmill.estimate.techniques import block_mask_bytes

    assert flex.peak_alloc_mb - off.peak_alloc_mb == pytest.approx(block_mask_bytes(B, T) / 2**20)
    assert block_mask_bytes(B, T) == B * (4 * 8 * 4 + 4 * 8 * 8 * 4 + 8 * T)  # 8 x 8 tiles of 128: tables, starts
    # the same causal tiles (synthetic text: its documents are not read), at FlexAttention's published H100 speed
    # over FlashAttention-2's (estimate/attention.py): less matmul time, never more
    assert flex.time_breakdown_ms["matmul_ms"] < off.time_breakdown_ms["matmul_ms"]
    from tokenmill.estimate import attention as A

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "FLEX_VS_FA2", {"a100": (1.0, 1.0), "h100": (1.0, 1.0)})
        same = est("h100-sxm", **{"data.document_mask": True})
    assert same.time_breakdown_ms["matmul_ms"] == pytest.approx(off.time_breakdown_ms["matmul_ms"])
    drop = [est("h100-sxm", **{"model.dropout": 0.1, "data.document_mask": on}) for on in (False, True)]
    assert drop[1].peak_alloc_mb - drop[0].peak_alloc_mb >= B * T * T * 2 / 2**20
    assert drop[1].time_breakdown_ms["matmul_ms"] > drop[0].time_breakdown_ms["matmul_ms"]
    cpu = [est("cpu", **{"train.precision": "fp32", "data.document_mask": on}) for on in (False, True)]
    assert cpu[1].peak_alloc_mb - cpu[0].peak_alloc_mb == pytest.approx(B * T * T * 4 / 2**20)
