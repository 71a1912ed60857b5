"""Every architecture switch of the model families against the reference modules of Hugging Face
``transformers`` (Llama, Qwen2, Qwen3), module by module, on CPU in fp32.

RoPE (default and Llama 3.1's 'llama3' scaling), RMSNorm (native ``nn.RMSNorm`` and the hand-written
``layers.RMSNorm``), SwiGLU, attention (multi-head, grouped-query 2:1 and 4:1, multi-query; Qwen2's q/k/v
biases; Qwen3's q/k norm and explicit head_dim), a whole decoder layer, and the whole model with a tied and
an untied head. Each Hugging Face module is built at random (its parameters perturbed, so norm weights are
not 1), its tensors copied by name into the tokenmill module (the name map below), and the outputs AND the
gradients (of the input and of every parameter, for one random cotangent) compared within ATOL / RTOL.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tokenmill.config import ModelConfig
from tokenmill.model import GPT
from tokenmill.model.layers import (
    Block,
    CausalSelfAttention,
    RMSNorm,
    SwiGLU,
    apply_rope,
    make_norm,
    rope_inv_freq,
    rope_tables,
)

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tokenmill[hf]')")
from transformers.models.llama import modeling_llama as hf_llama  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2 as hf_qwen2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3 as hf_qwen3  # noqa: E402

ATOL, RTOL = 1e-5, 1e-5  # fp32 on CPU: the same math, up to the rounding of reordered sums
B, T, C, V = 2, 16, 64, 50

# tokenmill module name of each Hugging Face name segment (Llama, Qwen2 and Qwen3 share them)
SEGMENTS = {"self_attn": "attn", "o_proj": "c_proj", "gate_proj": "c_gate", "up_proj": "c_fc", "down_proj": "c_proj",
            "input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "layers": "blocks",
            "embed_tokens": "wte"}


def tm_name(hf: str) -> str:
    """The tokenmill parameter name of a Hugging Face one (``model.norm`` is the final norm ``ln_f``)."""
    if hf == "model.norm.weight":
        return "ln_f.weight"
    parts = hf.split(".")
    if parts[0] == "model":
        parts = parts[1:]
    return ".".join(SEGMENTS.get(p, p) for p in parts)


# ----------------------------------------------------------------------------------------------
# Building both sides


def hf_config(family: str = "llama", attn: str = "eager", **kw):
    """A small Hugging Face config of ``family``; ``kw`` in Hugging Face's names."""
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    base = dict(hidden_size=C, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                num_hidden_layers=1, max_position_embeddings=128, vocab_size=V, rms_norm_eps=1e-5,
                attention_dropout=0.0, attn_implementation=attn)
    return cls[family](**{**base, **kw})


def tm_config(hf_cfg, **kw) -> ModelConfig:
    """The tokenmill ModelConfig of a Hugging Face config (the fields these tests need)."""
    rope = hf_cfg.rope_parameters
    base = dict(n_embd=hf_cfg.hidden_size, n_head=hf_cfg.num_attention_heads, n_kv_head=hf_cfg.num_key_value_heads,
                head_dim=getattr(hf_cfg, "head_dim", None), intermediate_size=hf_cfg.intermediate_size, n_layer=hf_cfg.num_hidden_layers,
                block_size=T, pos_emb="rope", rope_theta=rope["rope_theta"], norm_type="rmsnorm",
                norm_eps=hf_cfg.rms_norm_eps, mlp="swiglu", bias=False, qkv_bias=False, fused_qkv=False, dropout=0.0,
                tie_embeddings=hf_cfg.tie_word_embeddings, attention="manual")
    if rope["rope_type"] == "llama3":
        base.update(rope_scaling="llama3", rope_factor=rope["factor"], rope_low_freq_factor=rope["low_freq_factor"],
                    rope_high_freq_factor=rope["high_freq_factor"],
                    rope_original_context=rope["original_max_position_embeddings"])
    return ModelConfig(**{**base, **kw})


@torch.no_grad()
def perturb(module: nn.Module, seed: int = 7, scale: float = 0.1) -> nn.Module:
    """Move every parameter off its init (norm weights 1 and zero biases would hide mapping mistakes)."""
    g = torch.Generator().manual_seed(seed)
    for p in module.parameters():
        p.add_(scale * torch.randn(p.shape, generator=g))
    return module


def to_tm(hf_tensors: dict[str, torch.Tensor], fused: bool = False) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (weights or gradients) under tokenmill's names; ``fused``: q, k, v concatenated
    into ``c_attn`` (rows [q; k; v])."""
    sd = {tm_name(k): v for k, v in hf_tensors.items()}
    if fused:
        for key in [k for k in sd if k.endswith(("q_proj.weight", "q_proj.bias"))]:
            base, kind = key[: -len("q_proj.weight")], key.rsplit(".", 1)[1]
            sd[f"{base}c_attn.{kind}"] = torch.cat([sd.pop(f"{base}{n}_proj.{kind}") for n in "qkv"])
    return sd


def copy_weights(tm: nn.Module, hf: nn.Module, fused: bool = False) -> None:
    """Load ``hf``'s tensors into ``tm`` by name (strict: every tokenmill tensor gets exactly one)."""
    tm.load_state_dict(to_tm(hf.state_dict(), fused), strict=True)


def hf_rope(hf_cfg) -> nn.Module:
    return hf_llama.LlamaRotaryEmbedding(hf_cfg)


def hf_mask(attn: str) -> torch.Tensor | None:
    """The causal mask the Hugging Face attention takes: additive (eager), or None = causal (sdpa)."""
    return torch.full((T, T), float("-inf")).triu(1)[None, None] if attn == "eager" else None


def run(fn, module: nn.Module, x: torch.Tensor, cotangent: torch.Tensor):
    """Output, input gradient and parameter gradients of ``fn(x)`` for one backward with ``cotangent``."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(cotangent)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def assert_same(tm: nn.Module, hf: nn.Module, tm_fn, hf_fn, x: torch.Tensor, fused: bool = False) -> None:
    """Same output and same gradients (the input's and every parameter's, in tokenmill's layout)."""
    cot = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    y_hf, dx_hf, g_hf = run(hf_fn, hf, x, cot)
    y_tm, dx_tm, g_tm = run(tm_fn, tm, x, cot)
    torch.testing.assert_close(y_tm, y_hf, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(dx_tm, dx_hf, atol=ATOL, rtol=RTOL)
    g_ref = to_tm(g_hf, fused)
    assert g_ref.keys() == g_tm.keys()
    for name, grad in g_ref.items():
        # fp32 sums reordered (thread count, kernel): the rounding scales with the gradient's size
        scale = max(1.0, grad.abs().max().item())
        torch.testing.assert_close(g_tm[name], grad, atol=ATOL * scale, rtol=RTOL, msg=name)


def inputs(seed: int = 0, width: int = C) -> torch.Tensor:
    return torch.randn(B, T, width, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------
# RoPE

LLAMA3_TINY = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
LLAMA31 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # Llama 3.1 8B's config.json


@pytest.mark.parametrize("rope,heads,head_dim", [
    ({"rope_type": "default", "rope_theta": 10000.0}, 8, 8),
    ({"rope_type": "default", "rope_theta": 1e6}, 4, 32),
    (LLAMA3_TINY, 8, 8),  # wavelengths 6.3 (kept), 63 (blended), 628 and 6283 (divided by 8)
    (LLAMA31, 2, 128),
], ids=["default", "default-theta1e6-hd32", "llama3-three-regimes", "llama3.1-8b"])
def test_rope_matches_llama_rotary_embedding(rope, heads, head_dim):
    """Frequencies, the (cos, sin) tables of every position and the rotation of q and k (2 k/v heads)
    equal LlamaRotaryEmbedding + apply_rotary_pos_emb."""
    hf_cfg = hf_config(hidden_size=heads * head_dim, num_attention_heads=heads, head_dim=head_dim,
                       rope_parameters=rope)
    cfg = tm_config(hf_cfg, block_size=128)
    ref = hf_rope(hf_cfg)
    assert ref.attention_scaling == 1.0
    torch.testing.assert_close(rope_inv_freq(cfg), ref.inv_freq, atol=0, rtol=1e-6)
    if rope is LLAMA3_TINY:  # the three regimes of the llama3 scaling all occur
        plain = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim))
        ratio = plain / rope_inv_freq(cfg)
        assert ratio[0] == 1.0 and 1.0 < ratio[1] < 8.0 and torch.allclose(ratio[2:], torch.tensor(8.0))
    x = torch.randn(1, 128, heads * head_dim)
    cos_ref, sin_ref = ref(x, torch.arange(128)[None])
    cos, sin = rope_tables(cfg)
    assert cos.shape == sin.shape == (128, head_dim)
    torch.testing.assert_close(cos, cos_ref[0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(sin, sin_ref[0], atol=ATOL, rtol=RTOL)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(B, heads, 128, head_dim, generator=g), torch.randn(B, 2, 128, head_dim, generator=g)
    q_ref, k_ref = hf_llama.apply_rotary_pos_emb(q, k, cos_ref, sin_ref)
    torch.testing.assert_close(apply_rope(q, cos, sin), q_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(apply_rope(k, cos, sin), k_ref, atol=ATOL, rtol=RTOL)
    assert not torch.allclose(q_ref, q)  # the rotation does something


def test_rope_keeps_norms_and_depends_on_relative_position_only():
    """Properties of a rotation by position: each pair keeps its norm, and q_m . k_n depends on m - n only."""
    cfg = ModelConfig(n_embd=64, n_head=4, block_size=32, pos_emb="rope")
    cos, sin = rope_tables(cfg)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)
    rq = apply_rope(q.expand(32, 16)[None, None], cos, sin)[0, 0]
    rk = apply_rope(k.expand(32, 16)[None, None], cos, sin)[0, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(32), atol=ATOL, rtol=RTOL)
    dots = rq @ rk.T  # (m, n)
    for shift in (0, 3, 10):
        diag = torch.diagonal(dots, offset=shift)
        torch.testing.assert_close(diag, diag[0].expand_as(diag), atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# RMSNorm and SwiGLU


@pytest.mark.parametrize("eps", [1e-5, 1e-6])
@pytest.mark.parametrize("form", ["native", "manual"])
def test_rmsnorm_matches_llama_rmsnorm(form, eps):
    cfg = ModelConfig(n_embd=C, n_head=4, norm_type="rmsnorm", norm=form, norm_eps=eps)
    norm = make_norm(cfg)
    assert isinstance(norm, nn.RMSNorm if form == "native" else RMSNorm)
    ref = perturb(hf_llama.LlamaRMSNorm(C, eps=eps))
    copy_weights(norm, ref)
    x = 3.0 * inputs()
    x[0, 0] = 1e-3  # a row where eps matters
    assert_same(norm, ref, norm, ref, x)


def test_manual_rmsnorm_in_bf16_equals_llama_rmsnorm():
    """In bf16 the hand-written RMSNorm takes the reference's steps (fp32 statistics, cast, then the
    weight in bf16): bit-identical."""
    ref = perturb(hf_llama.LlamaRMSNorm(C, eps=1e-6)).to(torch.bfloat16)
    norm = RMSNorm(C, eps=1e-6).to(torch.bfloat16)
    copy_weights(norm, ref)
    x = (3.0 * inputs()).to(torch.bfloat16)
    y = norm(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, ref(x))


def test_swiglu_matches_llama_mlp():
    hf_cfg = hf_config()
    ref = perturb(hf_llama.LlamaMLP(hf_cfg))
    mlp = SwiGLU(tm_config(hf_cfg))
    copy_weights(mlp, ref)
    assert_same(mlp, ref, mlp, ref, inputs())


# ----------------------------------------------------------------------------------------------
# Attention

HEADS = {"mha": (8, 8), "gqa-2to1": (8, 4), "gqa-4to1": (8, 2), "mqa": (8, 1)}  # (query heads, k/v heads)


def check_attention(module_cls, hf_cfg, attention: str, fused: bool, seed: int = 0, **tm_kw) -> None:
    """tokenmill's attention (its own rope tables) vs the Hugging Face module (its own rotary embedding);
    tokenmill's manual form against Hugging Face's eager one, sdpa against sdpa."""
    ref = perturb(module_cls(hf_cfg, layer_idx=0), seed=seed)
    cfg = tm_config(hf_cfg, attention=attention, fused_qkv=fused, **tm_kw)
    attn = CausalSelfAttention(cfg)
    copy_weights(attn, ref, fused=fused)
    rope = rope_tables(cfg)
    x = inputs(seed)
    pos = hf_rope(hf_cfg)(x, torch.arange(T)[None])
    mask = hf_mask(hf_cfg._attn_implementation)
    assert_same(attn, ref, lambda h: attn(h, rope), lambda h: ref(h, position_embeddings=pos, attention_mask=mask)[0],
                x, fused=fused)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
@pytest.mark.parametrize("heads", HEADS, ids=list(HEADS))
def test_attention_matches_llama_attention(heads, attention, fused):
    n_head, n_kv = HEADS[heads]
    hf_cfg = hf_config(num_attention_heads=n_head, num_key_value_heads=n_kv,
                       attn="eager" if attention == "manual" else "sdpa")
    check_attention(hf_llama.LlamaAttention, hf_cfg, attention, fused)


def test_attention_with_llama3_rope_scaling():
    hf_cfg = hf_config(rope_parameters=LLAMA3_TINY, num_attention_heads=4, num_key_value_heads=2)  # head_dim 16
    check_attention(hf_llama.LlamaAttention, hf_cfg, "manual", False)


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_qwen2_qkv_biases_match_qwen2_attention(attention, fused):
    """Qwen2: biases on q, k and v only (model.qkv_bias true, model.bias false)."""
    hf_cfg = hf_config("qwen2", attn="eager" if attention == "manual" else "sdpa")
    ref = hf_qwen2.Qwen2Attention(hf_cfg, 0)
    assert ref.q_proj.bias is not None and ref.o_proj.bias is None
    check_attention(hf_qwen2.Qwen2Attention, hf_cfg, attention, fused, qkv_bias=True)


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
@pytest.mark.parametrize("norm", ["native", "manual"])
def test_qwen3_qk_norm_and_head_dim_match_qwen3_attention(attention, norm):
    """Qwen3: an RMSNorm over each head of q and k, and a head_dim (32) that is not n_embd / n_head (16)."""
    hf_cfg = hf_config("qwen3", attn="eager" if attention == "manual" else "sdpa", num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6)
    assert hf_cfg.head_dim * hf_cfg.num_attention_heads != C
    check_attention(hf_qwen3.Qwen3Attention, hf_cfg, attention, False, qk_norm=True, norm=norm)
    check_attention(hf_qwen3.Qwen3Attention, hf_cfg, attention, True, qk_norm=True, norm=norm)


def test_attention_is_causal():
    """Changing the last position changes no earlier output (the mask is in place, not only matched)."""
    cfg = tm_config(hf_config())
    attn = perturb(CausalSelfAttention(cfg))
    x = inputs()
    y1 = attn(x, rope_tables(cfg))
    x[:, -1] += 1.0
    y2 = attn(x, rope_tables(cfg))
    torch.testing.assert_close(y2[:, :-1], y1[:, :-1], atol=0, rtol=0)
    assert not torch.allclose(y2[:, -1], y1[:, -1])


# ----------------------------------------------------------------------------------------------
# A decoder layer and the whole model

LAYERS = {
    "llama": (hf_llama.LlamaDecoderLayer, dict(), dict()),
    "llama3-rope": (hf_llama.LlamaDecoderLayer, dict(rope_parameters=LLAMA3_TINY), dict()),
    "qwen2": (hf_qwen2.Qwen2DecoderLayer, dict(), dict(qkv_bias=True)),
    "qwen3": (hf_qwen3.Qwen3DecoderLayer, dict(head_dim=16, num_attention_heads=4, rms_norm_eps=1e-6),
              dict(qk_norm=True)),
}


@pytest.mark.parametrize("norm", ["native", "manual"])
@pytest.mark.parametrize("family", LAYERS)
def test_block_matches_decoder_layer(family, norm):
    layer_cls, hf_kw, tm_kw = LAYERS[family]
    hf_name = {"llama3-rope": "llama"}.get(family, family)
    hf_cfg = hf_config(hf_name, **hf_kw)
    ref = perturb(layer_cls(hf_cfg, layer_idx=0))
    cfg = tm_config(hf_cfg, norm=norm, **tm_kw)
    block = Block(cfg)
    copy_weights(block, ref)
    rope = rope_tables(cfg)
    x = inputs()
    pos = hf_rope(hf_cfg)(x, torch.arange(T)[None])
    assert_same(block, ref, lambda h: block(h, rope),
                lambda h: ref(h, attention_mask=hf_mask("eager"), position_embeddings=pos), x)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_whole_model_with_tied_and_untied_head(tied, rope):
    """Two layers, GQA 4:1: logits, the loss and every parameter's gradient equal LlamaForCausalLM's.
    Tied, the head is the embedding matrix in both and its gradient sums both uses."""
    params = LLAMA3_TINY if rope == "llama3" else {"rope_type": "default", "rope_theta": 10000.0}
    hf_cfg = hf_config(num_hidden_layers=2, tie_word_embeddings=tied, rope_parameters=params)
    torch.manual_seed(0)
    ref = perturb(transformers.LlamaForCausalLM(hf_cfg)).eval()
    assert (ref.lm_head.weight is ref.model.embed_tokens.weight) == tied
    model = GPT(tm_config(hf_cfg), V)
    assert (model.lm_head.weight is model.wte.weight) == tied
    copy_weights(model, ref)
    g = torch.Generator().manual_seed(5)
    idx, tgt = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    logits_ref = ref(idx).logits
    loss_ref = F.cross_entropy(logits_ref.reshape(-1, V), tgt.reshape(-1))
    loss_ref.backward()
    logits, loss = model(idx, tgt)
    loss.backward()
    torch.testing.assert_close(logits, logits_ref, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(loss, loss_ref, atol=ATOL, rtol=RTOL)
    assert abs(loss.item() - math.log(V)) > 0.1  # the perturbed model is not uniform
    grads = dict(model.named_parameters())
    ref_params = dict(ref.named_parameters())
    assert {tm_name(n) for n in ref_params} == set(grads)
    for name, p in ref_params.items():
        torch.testing.assert_close(grads[tm_name(name)].grad, p.grad, atol=ATOL, rtol=RTOL, msg=name)
