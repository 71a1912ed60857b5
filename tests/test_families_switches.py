"""Every existing model switch on the new blocks: a tiny Llama-style model (RoPE, RMSNorm, SwiGLU, grouped-query
attention 2:1, no biases) and a tiny Qwen-style one (multi-query, q/k norm, head_dim 16 != n_embd / n_head,
q/k/v biases) keep the math under each switch, as tests/test_model.py checks for GPT-2: the same logits,
loss and gradients of every parameter as the reference form (fp32 CPU, test_model's ATOL / RTOL); bf16
forms within a bf16 tolerance; generation with the KV cache gives the uncached tokens and logits. Last, a
short training run of a Llama-style model through the real trainer lowers the loss.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from conftest import tiny_cfg
from test_model import ATOL, RTOL, assert_same_math, batch, build, loss_and_grads, perturb
from tokenmill.config import ModelConfig
from tokenmill.model import GPT, adapt_state_dict
from tokenmill.model.gpt import KVCache
from tokenmill.train import precision
from tokenmill.train.metrics import read_metrics
from tokenmill.train.parallelize import build_model
from tokenmill.train.trainer import train

FAMILIES = {  # on test_model's TINY: block_size 16, 2 layers, 4 heads, width 32
    "llama": dict(pos_emb="rope", norm_type="rmsnorm", mlp="swiglu", n_kv_head=2, intermediate_size=48, bias=False,
                  qkv_bias=False, tie_embeddings=False),
    "qwen": dict(pos_emb="rope", norm_type="rmsnorm", mlp="swiglu", n_kv_head=1, head_dim=16, qk_norm=True,
                 intermediate_size=48, bias=False, qkv_bias=True, norm_eps=1e-6),
}


def test_the_families_have_the_intended_structure():
    llama, qwen = build(**FAMILIES["llama"]), build(**FAMILIES["qwen"])
    for m in (llama, qwen):
        assert m.wpe is None and m.rope_cos.shape == (16, m.cfg.head_width)
        assert isinstance(m.ln_f, nn.RMSNorm) and hasattr(m.blocks[0].mlp, "c_gate")
        assert "rope_cos" not in m.state_dict()  # tables, not parameters
    assert not any(n.endswith("bias") for n, _ in llama.named_parameters())
    assert llama.blocks[0].attn.c_attn.weight.shape == ((4 + 2 + 2) * 8, 32)
    assert llama.lm_head.weight is not llama.wte.weight
    assert {n for n, _ in qwen.named_parameters() if n.endswith("bias")} == {"blocks.0.attn.c_attn.bias",
                                                                             "blocks.1.attn.c_attn.bias"}
    assert qwen.blocks[0].attn.c_attn.weight.shape == ((4 + 1 + 1) * 16, 32)
    assert qwen.blocks[0].attn.c_proj.weight.shape == (32, 64) and qwen.blocks[0].attn.q_norm.weight.shape == (16,)
    assert qwen.lm_head.weight is qwen.wte.weight


SWITCHES = [  # (reference form, other form), on top of a family
    (dict(attention="manual"), dict(attention="sdpa")),
    (dict(attention="sdpa"), dict(attention="sdpa", sdpa_backend="math")),
    (dict(attention="manual", causal_mask="on_the_fly"), dict(attention="manual", causal_mask="buffer")),
    (dict(fused_qkv=True), dict(fused_qkv=False)),
    (dict(fused_qkv=True, attention="manual"), dict(fused_qkv=False, attention="manual")),
    (dict(norm="native"), dict(norm="manual")),
    (dict(vocab_pad_multiple=1, tie_embeddings=False), dict(vocab_pad_multiple=64, tie_embeddings=False)),
    (dict(vocab_pad_multiple=1, tie_embeddings=True), dict(vocab_pad_multiple=64, tie_embeddings=True)),
    (dict(fused_qkv=True, vocab_pad_multiple=1, norm="native", attention="sdpa"),
     dict(fused_qkv=False, vocab_pad_multiple=64, norm="manual", attention="manual", causal_mask="buffer")),
]


def _ids(kw: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("ref_kw,other_kw", SWITCHES, ids=[_ids(o) for _, o in SWITCHES])
@pytest.mark.parametrize("family", FAMILIES)
def test_switch_keeps_the_math(family, ref_kw, other_kw):
    """Same seed: the same initial values in the shared parameters; after perturbing the reference and
    copying it into the other form (adapt_state_dict: fused <-> separate q/k/v with grouped k/v rows,
    vocabulary padding), the same logits, loss and gradients."""
    ref, other = build(**{**FAMILIES[family], **ref_kw}), build(**{**FAMILIES[family], **other_kw})
    sd = adapt_state_dict(other.state_dict(), ref)
    for name, t in ref.state_dict().items():
        assert torch.equal(sd[name], t), name
    assert_same_math(ref, other)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_loss_keeps_the_math(family, tied):
    """model.loss_impl='chunked' (chunks of 7 rows: the last one short) gives the full loss and gradients."""
    idx, tgt = batch()
    full = perturb(build(**{**FAMILIES[family], "tie_embeddings": tied, "vocab_pad_multiple": 64}))
    chunked = build(**{**FAMILIES[family], "tie_embeddings": tied, "vocab_pad_multiple": 64, "loss_impl": "chunked",
                       "loss_chunk_size": 7})
    chunked.load_state_dict(full.state_dict())
    _, loss_full, g_full = loss_and_grads(full, idx, tgt)
    chunked.zero_grad(set_to_none=True)
    logits, loss = chunked(idx, tgt)
    loss.backward()
    assert logits is None
    torch.testing.assert_close(loss.detach(), loss_full, atol=ATOL, rtol=RTOL)
    for name, p in chunked.named_parameters():
        torch.testing.assert_close(p.grad, g_full[name], atol=ATOL, rtol=RTOL, msg=name)


# ----------------------------------------------------------------------------------------------
# Precision: fp32 islands, pure bf16, bf16 autocast

BF16_LOSS_ATOL, BF16_GRAD_REL = 0.05, 0.05  # bf16: 8 mantissa bits; measured <= 0.011 and <= 3% here


def _assert_bf16_close(loss, grads: dict[str, torch.Tensor], loss32, g32) -> None:
    torch.testing.assert_close(loss.float(), loss32, atol=BF16_LOSS_ATOL, rtol=0)
    for name, g in grads.items():
        if g32[name].norm() > 0:
            rel = ((g.float() - g32[name]).norm() / g32[name].norm()).item()
            assert rel < BF16_GRAD_REL, (name, rel)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_islands_is_a_no_op_in_fp32(family):
    kw = dict(FAMILIES[family], norm="manual", attention="manual")
    ref, other = perturb(build(**kw, fp32_islands=True)), build(**kw, fp32_islands=False)
    other.load_state_dict(ref.state_dict())
    idx, tgt = batch()
    _, l1, g1 = loss_and_grads(ref, idx, tgt)
    _, l2, g2 = loss_and_grads(other, idx, tgt)
    assert torch.equal(l1, l2) and all(torch.equal(g1[n], g2[n]) for n in g1)


@pytest.mark.parametrize("islands", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_pure_bf16_with_and_without_fp32_islands(family, islands):
    """Pure bf16 weights, hand-written RMSNorm (q/k norms too) and manual softmax: with islands their
    statistics, the softmax and the loss run in fp32, without them in bf16 (the loss is then bf16);
    either way the loss and gradients stay within the bf16 tolerance of the fp32 model's."""
    kw = dict(FAMILIES[family], norm="manual", attention="manual")
    ref = perturb(build(**kw))
    idx, tgt = batch()
    _, loss32, g32 = loss_and_grads(ref, idx, tgt)
    m = build(**kw, fp32_islands=islands)
    m.load_state_dict(ref.state_dict())
    m.to(torch.bfloat16)
    _, loss, grads = loss_and_grads(m, idx, tgt)
    assert loss.dtype == (torch.float32 if islands else torch.bfloat16)
    assert m.rope_cos.dtype == torch.bfloat16  # the tables follow the model (cast to q's dtype in apply_rope)
    _assert_bf16_close(loss, grads, loss32, g32)


def model_overrides(family: str, **extra) -> dict:
    """``model.*`` overrides of the tiny preset for a family."""
    return {f"model.{k}": v for k, v in {**FAMILIES[family], **extra}.items()}


def _fp32_reference(family: str, **extra):
    cfg = tiny_cfg(**model_overrides(family, **extra))
    model = perturb(build_model(cfg, 64, torch.device("cpu")))
    g = torch.Generator().manual_seed(0)
    idx, tgt = torch.randint(0, 64, (4, 32), generator=g), torch.randint(0, 64, (4, 32), generator=g)
    return cfg, model, idx, tgt


@pytest.mark.parametrize("mode", ["bf16", "bf16-autocast"])
@pytest.mark.parametrize("family", FAMILIES)
def test_train_precision_bf16_close_to_fp32(family, mode):
    """train.precision through the trainer's own functions: 'bf16' = build_model casts the model (bf16
    weights and gradients, fp32 loss); 'bf16-autocast' = fp32 weights, bf16 matmuls under
    ``precision.autocast``. Loss and gradients within the bf16 tolerance of fp32."""
    cfg32, ref, idx, tgt = _fp32_reference(family)
    _, loss32, g32 = loss_and_grads(ref, idx, tgt)
    cfg = tiny_cfg(**model_overrides(family), **{"train.precision": mode})
    m = build_model(cfg, 64, torch.device("cpu"))
    m.load_state_dict({k: v.to(next(m.parameters()).dtype) for k, v in ref.state_dict().items()})
    want = torch.bfloat16 if mode == "bf16" else torch.float32
    assert all(p.dtype == want for p in m.parameters())
    m.zero_grad(set_to_none=True)
    with precision.autocast(cfg.train, torch.device("cpu")):
        logits, loss = m(idx, tgt)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    _assert_bf16_close(loss.detach(), {n: p.grad for n, p in m.named_parameters()}, loss32, g32)


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_same_gradients(family):
    """memory.activation_checkpointing through build_model, every block or every 2nd, with dropout:
    bit-identical gradients (the recomputation replays the dropout masks and the rotary tables)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (4, 32), generator=g), torch.randint(0, 64, (4, 32), generator=g)
    grads = {}
    for every in (0, 1, 2):
        cfg = tiny_cfg(**model_overrides(family, dropout=0.1), **{"memory.activation_checkpointing": every})
        model = build_model(cfg, 64, torch.device("cpu"))
        wrapped = [isinstance(b, CheckpointWrapper) for b in model.blocks]
        assert wrapped == {0: [False, False], 1: [True, True], 2: [True, False]}[every]
        torch.manual_seed(1)  # the same dropout masks in every run
        model(x, y)[1].backward()
        grads[every] = {k.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                        for k, p in model.named_parameters()}
    for every in (1, 2):
        assert grads[every].keys() == grads[0].keys()
        for k in grads[0]:
            torch.testing.assert_close(grads[every][k], grads[0][k], rtol=0, atol=0, msg=k)


COMPILE_TOL = 1e-4  # Inductor's fused kernels reorder fp32 sums


@pytest.mark.slow
@pytest.mark.parametrize("compile_kw", [
    {"compile.scope": "model"},
    {"compile.scope": "block"},
    {"compile.scope": "model", "compile.loss_outside": True},
], ids=["model", "block", "loss-outside"])
def test_compile_keeps_the_math(compile_kw):
    """compile.enabled through build_model (Inductor on CPU, one graph required): the eager loss and
    gradients of the Qwen-style model (GQA, RoPE, q/k norm), parameter names without prefixes; under scope
    'block' the head and the loss compiled too (their graph's gradients among those compared)."""
    torch._dynamo.reset()
    _, ref, idx, tgt = _fp32_reference("qwen")
    _, loss_ref, g_ref = loss_and_grads(ref, idx, tgt)
    cfg = tiny_cfg(**model_overrides("qwen"), **{"compile.enabled": True, "compile.fullgraph": True, **compile_kw})
    m = build_model(cfg, 64, torch.device("cpu"))
    # scope 'block' compiles the head and the loss as one more graph (model/build.py compiles_head); loss_outside not
    assert ("head_loss" in vars(m)) == (compile_kw.get("compile.scope") == "block")
    m.load_state_dict(ref.state_dict())
    _, loss, grads = loss_and_grads(m, idx, tgt)
    assert grads.keys() == g_ref.keys()
    torch.testing.assert_close(loss, loss_ref, atol=COMPILE_TOL, rtol=COMPILE_TOL)
    for n in g_ref:
        torch.testing.assert_close(grads[n], g_ref[n], atol=COMPILE_TOL, rtol=COMPILE_TOL, msg=n)


# ----------------------------------------------------------------------------------------------
# Generation

GEN_V, GEN_BS = 61, 24


def gen_model(**kw) -> GPT:
    """init_std 0.3: peaked logits, so a wrong cached key or rotary position changes the greedy tokens."""
    torch.manual_seed(0)
    return GPT(ModelConfig(**{**FAMILIES["qwen"], "n_kv_head": 2, "block_size": GEN_BS, "n_layer": 2, "n_head": 4,
                              "n_embd": 32, "init_std": 0.3, **kw}), GEN_V)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_greedy_same_with_and_without_kv_cache(attention, fused):
    """GQA 2:1 + RoPE + q/k norm: 30 new tokens from 5 pass block_size (24), where the cached path hands
    over to whole-window steps; every token matches the uncached generation."""
    m = gen_model(attention=attention, fused_qkv=fused, vocab_pad_multiple=16, dropout=0.1)
    p = torch.randint(0, GEN_V, (3, 5), generator=torch.Generator().manual_seed(1))
    cached = m.generate(p, 30, temperature=0.0, use_cache=True)
    plain = m.generate(p, 30, temperature=0.0, use_cache=False)
    assert cached.shape == (3, 35) and torch.equal(cached[:, :5], p)
    assert torch.equal(cached, plain)
    assert len(set(cached[:, 5:].flatten().tolist())) > 3  # not one repeated token
    assert m.training  # restored


@pytest.mark.parametrize("attention", ["manual", "sdpa"])
def test_cached_logits_equal_the_full_forward_at_every_position(attention):
    """Prefill 4 tokens, then 1 at a time, then a chunk of 5 after cached positions (the offset causal
    mask): the logits at every position equal one full forward's."""
    m = gen_model(attention=attention).eval()
    seq = torch.randint(0, GEN_V, (2, GEN_BS), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(seq)[0]
    cache = KVCache(m.cfg.n_layer, GEN_BS)
    pieces = [(0, 4)] + [(t, t + 1) for t in range(4, 10)] + [(10, 15), (15, GEN_BS)]
    out = []
    with torch.inference_mode():
        for a, b in pieces:
            assert cache.pos == a
            out.append(m.lm_head(m.trunk(seq[:, a:b], cache))[..., :GEN_V])
    torch.testing.assert_close(torch.cat(out, 1), full, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# Training through the real trainer


@pytest.mark.slow
def test_llama_style_model_trains(tmp_path):
    """A tiny Llama-style model (RoPE, RMSNorm, SwiGLU, GQA 2:1, no biases, untied head) on a small
    byte-level text through tokenmill.train.trainer.train: the loss falls from about ln(256) well below it."""
    from tokenmill.data import prepare

    text = tmp_path / "text.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(300)))
    data = prepare(text, tmp_path / "data", "bytes", workers=1, progress=False)
    over = {**model_overrides("llama", n_head=4), "data.source": "tokens", "data.path": str(data),
            "model.vocab_size": None, "train.max_steps": 40, "log.every_steps": 1, "train.eval_every_steps": 40,
            "optim.lr": 3e-3, "optim.min_lr": 3e-4}
    train(tiny_cfg(**over), tmp_path / "run", quiet=True)
    rows = read_metrics(tmp_path / "run")
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 1.5  # starts near uniform over the bytes
    assert losses[-1] < losses[0] - 1.5 and val[-1] < losses[0] - 1.5, (losses, val)
