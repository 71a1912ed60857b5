"""The model package: every ModelConfig switch keeps the math, init, parameter counts, FLOPs, MFU peaks.

Switch equivalence is checked on CPU in fp32: the same loss AND the same gradients for every parameter,
within ATOL / RTOL below (reorderings of fp32 sums differ by ~1e-7 relative; the bound leaves room).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tokenmill.config import ModelConfig
from tokenmill.errors import ConfigError
from tokenmill.model import GPT, Block, adapt_state_dict, flops_per_token, math_mode, peak_flops
from tokenmill.model.flops import flop_params
from tokenmill.model.layers import GELU, LayerNorm

ATOL, RTOL = 1e-5, 1e-4  # fp32 CPU tolerance for "the same math"
TINY = dict(block_size=16, n_layer=2, n_head=4, n_embd=32)
V = 50  # vocabulary of the tiny models (padded to 64 with vocab_pad_multiple=64)


def build(seed: int = 0, vocab: int = V, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(ModelConfig(**{**TINY, **kw}), vocab)


def batch(B: int = 3, T: int = 16, vocab: int = V, seed: int = 123) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g), torch.randint(0, vocab, (B, T), generator=g)


@torch.no_grad()
def perturb(model: GPT, seed: int = 7) -> GPT:
    """Move every parameter off its init (biases 0, norm weights 1 would hide bias/affine bugs)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def loss_and_grads(model: GPT, idx: torch.Tensor, tgt: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits, loss = model(idx, tgt)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same_math(ref: GPT, other: GPT) -> None:
    """Copy ref's (perturbed) weights into other's layout; losses and gradients must agree."""
    perturb(ref)
    other.load_state_dict(adapt_state_dict(ref.state_dict(), other))
    idx, tgt = batch()
    logits1, loss1, g1 = loss_and_grads(ref, idx, tgt)
    logits2, loss2, g2 = loss_and_grads(other, idx, tgt)
    assert logits2.shape == logits1.shape == (3, 16, ref.vocab_size)
    torch.testing.assert_close(logits2, logits1, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(loss2, loss1, atol=ATOL, rtol=RTOL)
    g2 = adapt_state_dict(g2, ref)  # gradients in ref's layout (q/k/v split, padding rows dropped)
    assert g2.keys() == g1.keys()
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], atol=ATOL, rtol=RTOL, msg=name)


SWITCHES = [  # (reference form, other form)
    (dict(attention="manual"), dict(attention="sdpa")),
    (dict(attention="sdpa"), dict(attention="sdpa", sdpa_backend="math")),
    (dict(attention="manual", causal_mask="on_the_fly"), dict(attention="manual", causal_mask="buffer")),
    (dict(fused_qkv=True), dict(fused_qkv=False)),
    (dict(fused_qkv=True, attention="manual"), dict(fused_qkv=False, attention="manual")),
    (dict(norm="native"), dict(norm="manual")),
    (dict(norm="native", bias=False), dict(norm="manual", bias=False)),
    (dict(gelu="native"), dict(gelu="manual")),
    (dict(vocab_pad_multiple=1), dict(vocab_pad_multiple=64)),
    (dict(vocab_pad_multiple=1, tie_embeddings=False), dict(vocab_pad_multiple=64, tie_embeddings=False)),
]


def _ids(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("ref_kw,other_kw", SWITCHES, ids=_ids)
def test_switch_keeps_the_math(ref_kw, other_kw):
    ref, other = build(**ref_kw), build(**other_kw)
    # Same seed: the shared parameters got the same initial values (no weight copying needed).
    sd = adapt_state_dict(other.state_dict(), ref)
    for name, t in ref.state_dict().items():
        assert torch.equal(sd[name], t), name
    assert_same_math(ref, other)


@pytest.mark.parametrize("bias", [True, False])
def test_manual_layernorm_and_gelu_match_native(bias):
    """Element-wise, with a tighter bound than the whole-model checks: x spans several units."""
    x = 3.0 * torch.randn(4, 7, 32, generator=torch.Generator().manual_seed(0))
    native, manual = nn.LayerNorm(32, bias=bias), LayerNorm(32, bias=bias)
    with torch.no_grad():
        native.weight.normal_()
        manual.weight.copy_(native.weight)
        if bias:
            native.bias.normal_()
            manual.bias.copy_(native.bias)
    assert manual.state_dict().keys() == native.state_dict().keys()
    torch.testing.assert_close(manual(x), native(x), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(GELU()(x), nn.GELU(approximate="tanh")(x), atol=1e-6, rtol=1e-5)


def test_init_is_a_function_of_seed_and_independent_of_neutral_switches():
    a, b, c = build(seed=0), build(seed=0), build(seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.wte.weight, c.wte.weight)
    # Every neutral switch at once, plus no biases (biases are 0 at init and take no random draws).
    other = build(seed=0, attention="manual", causal_mask="buffer", norm="manual", gelu="manual",
                  fused_qkv=False, vocab_pad_multiple=64, bias=False, qkv_bias=False)
    sd = adapt_state_dict(other.state_dict(), a)
    for name, t in a.state_dict().items():
        if name.endswith("bias"):
            assert name not in sd and not t.any(), name
        else:
            assert torch.equal(sd[name], t), name
    idx, tgt = batch()
    torch.testing.assert_close(other(idx, tgt)[1], a(idx, tgt)[1], atol=ATOL, rtol=RTOL)


def test_meta_build_then_to_empty_and_init_weights_matches_a_cpu_build():
    kw = dict(attention="manual", causal_mask="buffer")
    with torch.device("meta"):
        m = GPT(ModelConfig(**{**TINY, **kw}), V)
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.init_weights()
    ref = build(seed=0, **kw)
    assert m.lm_head.weight is m.wte.weight  # re-tied
    for (n1, t1), (n2, t2) in zip(m.state_dict().items(), ref.state_dict().items()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    assert torch.equal(m.blocks[0].attn.mask, ref.blocks[0].attn.mask)


@pytest.mark.parametrize("src_kw,dst_kw", [
    (dict(fused_qkv=True), dict(fused_qkv=False)),
    (dict(fused_qkv=False), dict(fused_qkv=True)),
    (dict(vocab_pad_multiple=64, tie_embeddings=False), dict(vocab_pad_multiple=1, tie_embeddings=False)),
    (dict(vocab_pad_multiple=1), dict(vocab_pad_multiple=64)),
])
def test_copy_weights_between_forms_round_trips(src_kw, dst_kw):
    src, dst = perturb(build(seed=0, **src_kw)), build(seed=1, **dst_kw)  # different seeds: a real copy
    dst.load_state_dict(adapt_state_dict(src.state_dict(), dst))
    idx, tgt = batch()
    torch.testing.assert_close(dst(idx, tgt)[1], src(idx, tgt)[1], atol=ATOL, rtol=RTOL)
    back = adapt_state_dict(dst.state_dict(), src)
    for name, t in src.state_dict().items():
        if name in ("wte.weight", "lm_head.weight"):  # only the true-vocabulary rows survive a round trip
            assert torch.equal(back[name][:V], t[:V]), name
        else:
            assert torch.equal(back[name], t), name
    for name in ("wte.weight", "lm_head.weight"):
        assert not dst.state_dict()[name][V:].any()  # padding rows are zero


@pytest.mark.parametrize("tied", [True, False])
def test_padded_vocab_is_never_predicted_and_gets_no_gradient(tied):
    ref = perturb(build(tie_embeddings=tied))
    padded = build(tie_embeddings=tied, vocab_pad_multiple=64)
    padded.load_state_dict(adapt_state_dict(ref.state_dict(), padded))
    assert padded.padded_vocab == 64 and padded.wte.weight.shape == (64, 32) and ref.padded_vocab == V
    with torch.no_grad():
        padded.lm_head.weight[V:] = 10.0 * padded.ln_f.weight  # padded columns would win if they were used
    idx, tgt = batch()
    logits, loss, grads = loss_and_grads(padded, idx, tgt)
    _, loss_ref, grads_ref = loss_and_grads(ref, idx, tgt)
    assert logits.shape[-1] == V and int(logits.argmax(-1).max()) < V
    torch.testing.assert_close(loss, loss_ref, atol=ATOL, rtol=RTOL)
    head = "wte.weight" if tied else "lm_head.weight"
    assert not grads[head][V:].any()
    torch.testing.assert_close(grads[head][:V], grads_ref[head], atol=ATOL, rtol=RTOL)
    padded.eval()
    out = padded.generate(idx[:, :4], 12)
    assert int(out.max()) < V


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_dropout(attention):
    idx, tgt = batch()
    plain = build(attention=attention).train()
    assert torch.equal(plain(idx, tgt)[1], plain(idx, tgt)[1])  # dropout=0: deterministic in train mode
    drop = build(attention=attention, dropout=0.2).train()
    loss_a, loss_b = drop(idx, tgt)[1], drop(idx, tgt)[1]
    assert not torch.equal(loss_a, loss_b)  # a fresh mask each call
    drop.eval()
    plain.eval()
    torch.testing.assert_close(drop(idx, tgt)[1], plain(idx, tgt)[1], atol=0, rtol=0)  # same init, no dropout


def _bias_names(model: nn.Module) -> set[str]:
    return {n for n, _ in model.named_parameters() if n.endswith("bias")}


def test_bias_switches():
    assert _bias_names(build(bias=False, qkv_bias=False)) == set()
    assert _bias_names(build(bias=False, qkv_bias=True)) == {f"blocks.{i}.attn.c_attn.bias" for i in range(2)}
    assert _bias_names(build(bias=False, qkv_bias=True, fused_qkv=False)) == {
        f"blocks.{i}.attn.{n}_proj.bias" for i in range(2) for n in "qkv"
    }
    with_bias = _bias_names(build(bias=True, qkv_bias=False))
    assert "ln_f.bias" in with_bias and "blocks.0.mlp.c_fc.bias" in with_bias
    assert not any("c_attn" in n for n in with_bias)
    assert "lm_head.bias" not in _bias_names(build(tie_embeddings=False))
    assert isinstance(build(bias=False, norm="native").ln_f, nn.LayerNorm)


def test_tied_vs_untied_parameter_counts():
    tied, untied = build(tie_embeddings=True), build(tie_embeddings=False)
    assert tied.lm_head.weight is tied.wte.weight and untied.lm_head.weight is not untied.wte.weight
    assert untied.num_params() - tied.num_params() == V * 32
    padded_t, padded_u = build(vocab_pad_multiple=64), build(vocab_pad_multiple=64, tie_embeddings=False)
    assert padded_u.num_params() - padded_t.num_params() == 64 * 32
    # exclude_embeddings drops wpe and wte; an untied head stays counted.
    assert tied.num_params(exclude_embeddings=True) == tied.num_params() - (V + 16) * 32
    assert untied.num_params(exclude_embeddings=True) == tied.num_params(exclude_embeddings=True) + V * 32


def test_gpt2_124m_parameter_count_and_flops():
    with torch.device("meta"):
        m = GPT(ModelConfig(), 50257)  # GPT-2 small: 12 x 768, 12 heads, T 1024, tied
        padded = GPT(ModelConfig(vocab_pad_multiple=64), 50257)
    assert m.wte.weight.is_meta
    assert m.num_params() == 124_439_808
    assert padded.padded_vocab == 50304 and padded.num_params() == 124_475_904
    n = m.num_params(exclude_position=True)
    assert n == 124_439_808 - 1024 * 768
    assert m.num_params(exclude_embeddings=True) == 85_056_000
    # tied and unpadded, the matmul parameters (tokenmill.model.flops.flop_params) are these too;
    # the hand-derived FLOPs checks (tied, untied, padded, gpt2-xl) are in test_flops.py
    assert flop_params(m.cfg, 50257) == n == flop_params(padded.cfg, 50257)
    f = flops_per_token(m.cfg, n, 1024)
    assert f == 6 * n + 12 * 12 * 12 * 64 * 1024
    assert abs(f - 855e6) / 855e6 < 0.001  # ~855 MFLOP per token


def test_peak_flops_and_math_mode():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "tf32") == 494.7e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H200", "fp16") == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == 312e12
    assert peak_flops("NVIDIA A100 80GB PCIe", "tf32") == 156e12
    assert peak_flops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    unknown = ("cpu", "", "Apple M2", "NVIDIA A10G", "NVIDIA Quadro XYZ", "NVIDIA H100 80GB HBM3 MIG 1g.10gb")
    for name in unknown:
        assert peak_flops(name, "bf16") is None, name
    with pytest.raises(ValueError, match="precision"):
        peak_flops("NVIDIA H100 80GB HBM3", "bf16-autocast")
    assert math_mode("fp32", False) == "fp32" and math_mode("fp32", True) == "tf32"
    assert math_mode("bf16-autocast", False) == "bf16" and math_mode("bf16", True) == "bf16"
    assert math_mode("fp16-autocast", True) == "fp16"
    with pytest.raises(ValueError, match="train.precision"):
        math_mode("fp8", False)


def test_gpt2_initialisation():
    L, C = 8, 256
    m = build(n_layer=L, n_embd=C, n_head=8, vocab=64)
    std, proj_std = 0.02, 0.02 / math.sqrt(2 * L)
    mlp_proj, attn_proj = m.blocks[3].mlp.c_proj.weight, m.blocks[5].attn.c_proj.weight
    assert abs(mlp_proj.std().item() / proj_std - 1) < 0.02  # 262k samples: ~0.14% sampling error
    assert abs(attn_proj.std().item() / proj_std - 1) < 0.03
    assert abs(mlp_proj.mean().item()) < 1e-4
    for w in (m.blocks[0].mlp.c_fc.weight, m.blocks[0].attn.c_attn.weight, m.wte.weight, m.wpe.weight):
        assert abs(w.std().item() / std - 1) < 0.03
    for i, part in enumerate(m.blocks[0].attn.c_attn.weight.chunk(3)):  # q, k, v all drawn
        assert abs(part.std().item() / std - 1) < 0.03, i
    assert all(not p.any() for n, p in m.named_parameters() if n.endswith("bias"))
    norm_weights = [p for n, p in m.named_parameters() if "ln_" in n and n.endswith("weight")]
    assert len(norm_weights) == 2 * L + 1 and all(torch.equal(p, torch.ones_like(p)) for p in norm_weights)
    assert isinstance(m.blocks, nn.ModuleList) and all(isinstance(b, Block) for b in m.blocks)


def test_generate():
    m = build().eval()
    prompt = batch(B=2, T=20)[0]  # longer than block_size: the context is cropped
    out = m.generate(prompt, 7, temperature=0.8, top_k=5)
    assert out.shape == (2, 27) and out.dtype == torch.long
    assert torch.equal(out[:, :20], prompt) and int(out.max()) < V and int(out.min()) >= 0
    torch.manual_seed(0)
    greedy = m.generate(prompt[:, :3], 5, temperature=0.0)
    assert torch.equal(m.generate(prompt[:, :3], 5, top_k=1), greedy)


@pytest.mark.parametrize("backend", ["cudnn", "efficient"])
def test_forced_sdpa_backend_that_cannot_run_names_the_field(backend):
    m = build(sdpa_backend=backend)
    idx, tgt = batch()
    with pytest.raises(ConfigError, match=r"model\.sdpa_backend.*try --model\.sdpa_backend auto"):
        m(idx, tgt)  # a ConfigError: the CLI prints it without a traceback


def test_reduced_precision_loss_is_fp32():
    idx, tgt = batch()
    m = perturb(build())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = m(idx, tgt)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    ref_loss = m(idx, tgt)[1]
    manual = build(norm="manual", gelu="manual", attention="manual")
    manual.load_state_dict(m.state_dict())
    for model in (m, manual):  # pure bf16 weights: manual forms stay close to native
        model.to(torch.bfloat16)
        logits, loss = model(idx, tgt)
        assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
        torch.testing.assert_close(loss, ref_loss, atol=0.05, rtol=0.02)


def test_sequence_longer_than_block_size_is_an_error():
    with pytest.raises(ValueError, match="block_size"):
        build()(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.slow
@pytest.mark.parametrize("kw", [
    dict(attention="sdpa", sdpa_backend="math", dropout=0.1),
    dict(attention="manual", causal_mask="buffer", fused_qkv=False, norm="manual", gelu="manual",
         vocab_pad_multiple=64, bias=False, dropout=0.1),
])
def test_traces_as_one_graph(kw):
    """No data-dependent Python control flow or .item(): torch.compile captures forward in one graph
    (backend 'eager' checks the tracing without code generation, to stay fast)."""
    torch._dynamo.reset()
    m = build(**kw)
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    idx, tgt = batch()
    compiled(idx, tgt)[1].backward()
    assert m.wte.weight.grad is not None


# ----------------------------------------------------------------------------------------------
# Seed-faithful switches: model.fp32_islands and model.loss_over_padded_vocab

PURE_BF16_KW = dict(norm="manual", gelu="manual", attention="manual", tie_embeddings=False, vocab_pad_multiple=64)


def _saved_dtypes(model: GPT, idx: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, list[torch.dtype]]:
    """Loss (backward done) and the dtypes of every tensor autograd saved for backward."""
    saved: list[torch.dtype] = []

    def pack(t):
        saved.append(t.dtype)
        return t

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, tgt)
    loss.backward()
    return loss.detach(), saved


def test_fp32_islands_is_a_no_op_in_fp32():
    ref = perturb(build(fp32_islands=True, **PURE_BF16_KW))
    other = build(fp32_islands=False, **PURE_BF16_KW)
    other.load_state_dict(ref.state_dict())
    idx, tgt = batch()
    _, l1, g1 = loss_and_grads(ref, idx, tgt)
    _, l2, g2 = loss_and_grads(other, idx, tgt)
    assert torch.equal(l1, l2) and all(torch.equal(g1[n], g2[n]) for n in g1)


@pytest.mark.parametrize("islands", [True, False])
def test_pure_bf16_with_and_without_fp32_islands_keeps_the_math(islands):
    """Pure bf16 weights (the seed's rungs 5+): without islands the hand-written LayerNorm, the softmax
    and the loss run in bf16 and autograd keeps no fp32 tensor at all; with them, fp32 copies are kept.
    Either way the loss stays within 0.05 of the fp32 model's and every gradient within 5% (relative
    L2 norm; measured ~2% on this model: bf16 has 8 mantissa bits)."""
    ref = perturb(build(**PURE_BF16_KW))
    idx, tgt = batch()
    _, loss32, g32 = loss_and_grads(ref, idx, tgt)
    m = build(fp32_islands=islands, **PURE_BF16_KW)
    m.load_state_dict(ref.state_dict())
    m.to(torch.bfloat16)
    loss, saved = _saved_dtypes(m, idx, tgt)
    assert loss.dtype == (torch.float32 if islands else torch.bfloat16)
    n_fp32 = sum(d == torch.float32 for d in saved)
    assert (n_fp32 > 0) if islands else (n_fp32 == 0), saved
    torch.testing.assert_close(loss.float(), loss32, atol=0.05, rtol=0)
    for name, p in m.named_parameters():
        ref_g = g32[name]
        if ref_g.norm() > 0:
            rel = ((p.grad.float() - ref_g).norm() / ref_g.norm()).item()
            assert rel < 0.05, (name, rel)


def _loss_over_all_columns(model: GPT, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Reference form of the seed's padding rung: mean(logsumexp(all padded logits) - target logit),
    the padded head output captured by a hook, written out without F.cross_entropy."""
    out = {}
    h = model.lm_head.register_forward_hook(lambda mod, inp, o: out.__setitem__("full", o))
    model(idx)
    h.remove()
    z = out["full"].float().reshape(-1, model.padded_vocab)
    return (torch.logsumexp(z, -1) - z.gather(1, tgt.reshape(-1, 1)).squeeze(1)).mean()


@pytest.mark.parametrize("tied", [True, False])
def test_loss_over_padded_vocab_matches_the_seed_form(tied):
    """With the switch the loss is the cross-entropy over all 64 padded columns (the reference form
    above, 1e-5) and the padded head rows get gradients; by default they are sliced off, so the
    padded loss is larger by mean(log(sum_all exp z / sum_real exp z)) > 0."""
    idx, tgt = batch()
    ref = perturb(build(vocab_pad_multiple=64, tie_embeddings=tied, loss_over_padded_vocab=True))
    default = build(vocab_pad_multiple=64, tie_embeddings=tied)
    default.load_state_dict(ref.state_dict())
    logits, loss, grads = loss_and_grads(ref, idx, tgt)
    assert logits.shape[-1] == V  # the returned logits stay the true vocabulary
    ref.zero_grad(set_to_none=True)
    expected = _loss_over_all_columns(ref, idx, tgt)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), atol=ATOL, rtol=RTOL)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=ATOL, rtol=RTOL, msg=name)
    head = "wte.weight" if tied else "lm_head.weight"  # named_parameters lists a tied matrix once
    assert grads[head][V:].abs().sum() > 0  # padded rows are trained (towards -inf)
    _, sliced, g_default = loss_and_grads(default, idx, tgt)
    assert g_default[head][V:].abs().sum() == 0
    assert loss > sliced + 1e-3


def test_loss_over_padded_vocab_chunked_matches_full():
    idx, tgt = batch()
    full = perturb(build(vocab_pad_multiple=64, loss_over_padded_vocab=True))
    chunked = build(vocab_pad_multiple=64, loss_over_padded_vocab=True, loss_impl="chunked", loss_chunk_size=7)
    chunked.load_state_dict(full.state_dict())
    _, l1, g1 = loss_and_grads(full, idx, tgt)
    chunked.zero_grad(set_to_none=True)
    _, l2 = chunked(idx, tgt)
    l2.backward()
    torch.testing.assert_close(l2.detach(), l1, atol=ATOL, rtol=RTOL)
    for name, p in chunked.named_parameters():
        torch.testing.assert_close(p.grad, g1[name], atol=ATOL, rtol=RTOL, msg=name)


def test_loss_over_padded_vocab_without_padding_is_a_no_op():
    idx, tgt = batch()
    a = perturb(build())
    b = build(loss_over_padded_vocab=True)
    b.load_state_dict(a.state_dict())
    assert torch.equal(a(idx, tgt)[1], b(idx, tgt)[1])


@pytest.mark.slow
def test_compiling_the_trunk_leaves_head_and_loss_outside():
    """``model.trunk = torch.compile(model.trunk)`` (compile.loss_outside): one graph without the head
    or the loss, and the same loss and gradients as eager."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    idx, tgt = batch()
    ref = perturb(build(vocab_pad_multiple=64))
    _, l1, g1 = loss_and_grads(ref, idx, tgt)
    m = build(vocab_pad_multiple=64)
    m.load_state_dict(ref.state_dict())
    m.trunk = torch.compile(m.trunk, backend=backend, fullgraph=True)
    _, l2, g2 = loss_and_grads(m, idx, tgt)
    assert len(graphs) == 1
    code = graphs[0].code
    assert "ln_f" in code and "lm_head" not in code and "cross_entropy" not in code
    torch.testing.assert_close(l2, l1, atol=ATOL, rtol=RTOL)
    for n in g1:
        torch.testing.assert_close(g2[n], g1[n], atol=ATOL, rtol=RTOL, msg=n)
    assert m.state_dict().keys() == ref.state_dict().keys()  # no _orig_mod. prefixes
