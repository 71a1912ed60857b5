"""FLOPs per token: the one convention (tokenmill.model.flops), checked against hand-derived values.

flops_per_token = 6 * N + 12 * L * H * Q * T, N = matmul parameters: the blocks, the final LayerNorm
and the head's matrix over the true vocabulary once; embeddings (lookups) never count. So tied and
untied heads of one shape count the same, and vocabulary padding adds nothing.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill import config as C
from tokenmill.config import ModelConfig
from tokenmill.model.flops import flop_params, flops_per_token
from tokenmill.model.gpt import GPT

# GPT-2 124M (C=768, L=12, H=12, Q=64, T=1024, V=50257), by hand:
#   one block: Linear weights 12*C^2 = 7,077,888 (qkv 3C^2, attn proj C^2, fc 4C^2, mlp proj 4C^2)
#              biases 9C = 6,912 (qkv 3C, attn proj C, fc 4C, mlp proj C); two LayerNorms 4C = 3,072
#              -> 7,087,872; x 12 blocks = 85,054,464; + ln_f 2C = 1,536 -> 85,056,000
#   head matrix V*C = 50,257 * 768 = 38,597,376 (once, tied or untied)
#   N = 123,653,376; 6N = 741,920,256
#   attention 12*L*H*Q*T = 12 * 12 * 768 * 1024 = 113,246,208
#   total 855,166,464 FLOP/token (~855 MFLOP), tied AND untied.
#   The old count (all parameters but wpe) added the untied head's V*C again: 6 * 38,597,376 more
#   = 1,086,750,720 (the "1,087" of issue 13).
GPT2_124M_N = 123_653_376
GPT2_124M_FLOPS = 855_166_464
# The rasbt README baseline is that shape untied without q/k/v bias: N less 12 * 3C = 27,648,
# 6 * 27,648 = 165,888 fewer FLOPs: 855,000,576.
RASBT_FLOPS = 855_000_576
# GPT-2 XL (C=1600, L=48, H=25, Q=64, T=1024, V=50257):
#   one block: 12*C^2 = 30,720,000 + biases 9C = 14,400 + LayerNorms 4C = 6,400 -> 30,740,800
#   x 48 = 1,475,558,400; + ln_f 3,200 -> 1,475,561,600; head V*C = 80,411,200
#   N = 1,555,972,800 (+ wpe 1,638,400 = 1,557,611,200, GPT-2 XL's known total); 6N = 9,335,836,800
#   attention 12 * 48 * 1600 * 1024 = 943,718,400; total 10,279,555,200 (~10.28 GFLOP/token)
GPT2_XL_N = 1_555_972_800
GPT2_XL_FLOPS = 10_279_555_200


def preset_model(name: str, **kw) -> ModelConfig:
    cfg = C.resolve(name, overrides={f"model.{k}": v for k, v in kw.items()}, overrides_from_string=False)
    return cfg.model


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_124m_tied_and_untied_count_the_same(tied):
    m = preset_model("gpt2-124m", tie_embeddings=tied)
    n = flop_params(m, 50257)
    assert n == GPT2_124M_N
    assert flops_per_token(m, n, 1024) == GPT2_124M_FLOPS


def test_rasbt_baseline_is_about_855_mflop():
    m = preset_model("gpt2-124m", tie_embeddings=False, qkv_bias=False)
    f = flops_per_token(m, flop_params(m, 50257), 1024)
    assert f == RASBT_FLOPS
    assert abs(f / 1e6 - 855) < 0.5  # not 1,087: the untied head's matmul counts once


def test_gpt2_xl():
    m = preset_model("gpt2-xl")
    n = flop_params(m, 50257)
    assert n == GPT2_XL_N
    assert flops_per_token(m, n, 1024) == GPT2_XL_FLOPS
    assert flop_params(preset_model("gpt2-xl", tie_embeddings=False), 50257) == GPT2_XL_N


@pytest.mark.parametrize("kw", [dict(vocab_pad_multiple=64), dict(vocab_pad_multiple=64, tie_embeddings=False),
                                dict(bias=False, qkv_bias=False), dict(fused_qkv=False, norm="manual")])
def test_padding_and_layout_switches(kw):
    """Padding rows are not model math; biases are counted when present; layout switches change nothing."""
    m = preset_model("gpt2-124m", **kw)
    n = flop_params(m, 50257)
    if "bias" in kw:  # no Linear/LayerNorm biases: 12 blocks x (9C + 2C) + C (ln_f) fewer
        assert n == GPT2_124M_N - 12 * 11 * 768 - 768
    else:
        assert n == GPT2_124M_N


def test_tiny_untied_no_longer_counts_the_head_twice():
    """The issue's example: the tiny preset untied counted 1.69x its tied form; now 1.0x."""
    tied, untied = preset_model("tiny"), preset_model("tiny", tie_embeddings=False)
    f_t = flops_per_token(tied, flop_params(tied, 64), 32)
    f_u = flops_per_token(untied, flop_params(untied, 64), 32)
    assert f_u == f_t
    # tiny: C=32, L=2; block 12C^2 + 9C + 4C = 12,704; x2 + ln_f 64 = 25,472; head 64*32 = 2,048
    assert flop_params(tied, 64) == 27_520
    assert f_t == 6 * 27_520 + 12 * 2 * 32 * 32


def test_counted_on_the_model():
    """flop_params equals the matmul parameters of a built model: all but the embeddings, head once."""
    for tied in (True, False):
        cfg = ModelConfig(block_size=16, n_layer=2, n_head=4, n_embd=32, tie_embeddings=tied, vocab_pad_multiple=64)
        torch.manual_seed(0)
        model = GPT(cfg, 50)
        blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("blocks.", "ln_f.")))
        assert flop_params(cfg, 50) == blocks + 50 * 32


# ----------------------------------------------------------------------------------------------
# The Llama family: grouped-query attention, SwiGLU, RMSNorm, no biases, no position embedding

# Llama 3.2 1B (C=2048, L=16, H=32 query heads, KV=8 key/value heads, Q=64, I=8192, V=128256, T=8192):
#   one block: q C*H*Q = 4,194,304; k and v 2*C*KV*Q = 2,097,152; o H*Q*C = 4,194,304;
#              gate and up 2*C*I = 33,554,432; down I*C = 16,777,216; two RMSNorm weights 2C = 4,096
#              -> 60,821,504; x 16 = 973,144,064; + final RMSNorm C = 2,048 -> 973,146,112
#   head V*C = 262,668,288 (tied: it is the token embedding, counted once as the head)
#   N = 1,235,814,400 (= the published 1.24B, every parameter counted once); 6N = 7,414,886,400
#   attention 12 * L * H * Q * T = 12 * 16 * 32 * 64 * 8192 = 3,221,225,472
#   total 10,636,111,872 FLOP/token (~10.6 GFLOP)
LLAMA32_1B_N = 1_235_814_400
LLAMA32_1B_FLOPS = 10_636_111_872


def llama_n_by_hand(C: int, L: int, H: int, KV: int, Q: int, I: int, V: int) -> int:  # noqa: E741
    """N of the convention for a Llama block stack, from the shape alone (no model built)."""
    q, kv, o = C * H * Q, 2 * C * KV * Q, H * Q * C
    mlp = 2 * C * I + I * C  # gate, up, down
    norms = 2 * C
    return L * (q + kv + o + mlp + norms) + C + V * C  # blocks, final norm, head once


def test_llama32_1b_by_hand():
    m = preset_model("llama3.2-1b")
    assert (m.n_embd, m.n_layer, m.n_head, m.kv_heads, m.head_width, m.mlp_width) == (2048, 16, 32, 8, 64, 8192)
    n = llama_n_by_hand(2048, 16, 32, 8, 64, 8192, 128256)
    assert n == LLAMA32_1B_N == flop_params(m, 128256)
    attention = 12 * 16 * 32 * 64 * 8192
    assert flops_per_token(m, n, 8192) == 6 * n + attention == LLAMA32_1B_FLOPS


def test_llama31_8b_untied_head_counts_once():
    m = preset_model("llama3.1-8b")
    n = llama_n_by_hand(4096, 32, 32, 8, 128, 14336, 128256)
    assert flop_params(m, 128256) == n == 7_504_924_672  # 8,030,261,248 parameters less the 525,336,576 embedding
    assert flop_params(preset_model("llama3.1-8b", tie_embeddings=True), 128256) == n


def test_gqa_swiglu_qk_norm_and_qkv_bias_each_add_what_they_should():
    """Each family switch changes N by exactly its matrices and vectors; the attention term counts query
    heads only (grouped keys and values add no score or weighted-sum work)."""
    C, L, H, Q, I, V, T = 64, 2, 8, 8, 160, 300, 128  # noqa: E741
    base = dict(n_embd=C, n_layer=L, n_head=H, block_size=T, intermediate_size=I, pos_emb="rope",
                norm_type="rmsnorm", bias=False, qkv_bias=False)
    mha = ModelConfig(**base, mlp="swiglu")
    gqa = ModelConfig(**base, mlp="swiglu", n_kv_head=2)
    mqa = ModelConfig(**base, mlp="swiglu", n_kv_head=1)
    gelu = ModelConfig(**base, mlp="gelu", n_kv_head=2)
    assert flop_params(mha, V) == llama_n_by_hand(C, L, H, H, Q, I, V)
    assert flop_params(mha, V) - flop_params(gqa, V) == L * 2 * C * (H - 2) * Q  # k and v of 6 fewer heads
    assert flop_params(gqa, V) - flop_params(mqa, V) == L * 2 * C * Q
    assert flop_params(gqa, V) - flop_params(gelu, V) == L * C * I  # SwiGLU's gate matrix
    qk = ModelConfig(**base, mlp="swiglu", n_kv_head=2, qk_norm=True)
    assert flop_params(qk, V) - flop_params(gqa, V) == L * 2 * Q  # one RMSNorm weight of head_dim each for q and k
    bias = ModelConfig(**{**base, "qkv_bias": True}, mlp="swiglu", n_kv_head=2)
    assert flop_params(bias, V) - flop_params(gqa, V) == L * (H + 2 * 2) * Q  # q, k, v biases (Qwen2)
    wide = ModelConfig(**base, mlp="swiglu", n_kv_head=2, head_dim=16)  # Qwen3: heads wider than C / H
    assert flop_params(wide, V) - flop_params(gqa, V) == L * (C * H + 2 * C * 2 + H * C) * (16 - Q)
    attn = {flops_per_token(m, 0, T) for m in (mha, gqa, mqa, gelu, qk, bias)}
    assert attn == {12.0 * L * H * Q * T}
    assert flops_per_token(wide, 0, T) == 12.0 * L * H * 16 * T
    for cfg in (gqa, qk, bias, wide):  # and the count is the built model's: all but the embedding, head once
        torch.manual_seed(0)
        model = GPT(cfg, V)
        blocks = sum(p.numel() for n, p in model.named_parameters() if n.startswith(("blocks.", "ln_f.")))
        assert flop_params(cfg, V) == blocks + V * C
