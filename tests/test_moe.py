"""The mixture-of-experts MLP (model/moe.py) against transformers' sparse blocks built from small random
configs with the same weights: outputs, routing decisions and every gradient within 1e-5 in fp32, for both
ways of running the experts (one matmul per expert, one grouped matmul); the router losses against
transformers' ``load_balancing_loss_func``; the config's refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill import config as C
from tokenmill.config import ModelConfig
from tokenmill.model import GPT
from tokenmill.model.moe import MoE, grouped_mm_runs, router_loss, router_stats

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral import modeling_mixtral as hf_mixtral  # noqa: E402
from transformers.models.olmoe import modeling_olmoe as hf_olmoe  # noqa: E402
from transformers.models.qwen2_moe import modeling_qwen2_moe as hf_qwen2_moe  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen3_moe  # noqa: E402

TOL = 1e-5
IMPLS = ["loop", pytest.param("grouped", marks=pytest.mark.skipif(
    not grouped_mm_runs("cpu", torch.float32), reason="torch._grouped_mm does not run on this CPU build"))]
BASE = dict(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, mlp="swiglu", pos_emb="rope",
            norm_type="rmsnorm", bias=False, qkv_bias=False)
HF_BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
               num_experts_per_tok=3)


def _families():
    """(name, transformers block, our config) for each family; 6 experts, 3 per token."""
    return {
        "mixtral": (lambda: hf_mixtral.MixtralSparseMoeBlock(transformers.MixtralConfig(
            **HF_BASE, intermediate_size=24, num_local_experts=6)),
            ModelConfig(**BASE, intermediate_size=24, moe_experts=6, moe_top_k=3, moe_router="softmax-topk-renorm")),
        "qwen3_moe": (lambda: hf_qwen3_moe.Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(
            **HF_BASE, moe_intermediate_size=16, num_experts=6, norm_topk_prob=False)),
            ModelConfig(**BASE, moe_intermediate_size=16, moe_experts=6, moe_top_k=3, moe_router="softmax-topk")),
        "qwen3_moe_norm": (lambda: hf_qwen3_moe.Qwen3MoeSparseMoeBlock(transformers.Qwen3MoeConfig(
            **HF_BASE, moe_intermediate_size=16, num_experts=6, norm_topk_prob=True)),
            ModelConfig(**BASE, moe_intermediate_size=16, moe_experts=6, moe_top_k=3)),
        "olmoe": (lambda: hf_olmoe.OlmoeSparseMoeBlock(transformers.OlmoeConfig(
            **HF_BASE, intermediate_size=16, num_experts=6)),
            ModelConfig(**BASE, intermediate_size=16, moe_experts=6, moe_top_k=3, moe_router="softmax-topk")),
        "qwen2_moe": (lambda: hf_qwen2_moe.Qwen2MoeSparseMoeBlock(transformers.Qwen2MoeConfig(
            **HF_BASE, moe_intermediate_size=16, num_experts=6, shared_expert_intermediate_size=24)),
            ModelConfig(**BASE, moe_intermediate_size=16, moe_experts=6, moe_top_k=3, moe_router="softmax-topk",
                        moe_shared_experts=1, moe_shared_intermediate_size=24, moe_shared_gate=True)),
    }


def _pair(family: str, impl: str):
    make_hf, cfg = _families()[family]
    torch.manual_seed(0)
    ours = MoE(dataclasses.replace(cfg, moe_impl=impl))
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0.0, 0.2)
    hf = make_hf()
    names = {"gate.weight": "router.weight", "experts.gate_up_proj": "experts.gate_up",
             "experts.down_proj": "experts.down", "shared_expert.gate_proj.weight": "shared.c_gate.weight",
             "shared_expert.up_proj.weight": "shared.c_fc.weight", "shared_expert.down_proj.weight": "shared.c_proj.weight",
             "shared_expert_gate.weight": "shared_gate.weight"}
    mine = dict(ours.named_parameters())
    hf.load_state_dict({k: mine[names[k]].detach().clone() for k in hf.state_dict()})
    assert len(mine) == len(hf.state_dict())
    return ours, hf, names


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe_norm", "olmoe", "qwen2_moe"])
def test_sparse_block_matches_transformers(family, impl):
    ours, hf, names = _pair(family, impl)
    x = torch.randn(3, 10, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.no_grad():  # identical routing decisions and weights
        _, w_ref, idx_ref = hf.gate(x.reshape(-1, 32))
        _, w, idx = ours.route(ours.router(x.reshape(-1, 32)))
    assert torch.equal(idx, idx_ref)
    assert torch.allclose(w.to(w_ref.dtype), w_ref, atol=TOL, rtol=0)
    assert len(set(idx.flatten().tolist())) == 6  # every expert has tokens: the test exercises all of them
    ya, yb = ours(xa), hf(xb)
    assert torch.allclose(ya, yb, atol=TOL, rtol=0), (ya - yb).abs().max()
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.allclose(xa.grad, xb.grad, atol=TOL, rtol=0)
    mine = dict(ours.named_parameters())
    for k, p in hf.named_parameters():
        assert torch.allclose(mine[names[k]].grad, p.grad, atol=TOL, rtol=0), k


@pytest.mark.skipif(not grouped_mm_runs("cpu", torch.float32), reason="torch._grouped_mm does not run here")
@pytest.mark.parametrize("align", [1, 16], ids=["unpadded", "padded-as-on-cuda"])
def test_grouped_experts_equal_loop_with_idle_experts(align, monkeypatch):
    """Experts without tokens (a group of size 0) and one expert taking most: the grouped path equals the loop,
    also with each group padded to 16 rows as on CUDA (the static buffer whose tail the last group takes)."""
    from tokenmill.model import moe

    monkeypatch.setattr(moe, "_align", lambda xs: align)
    cfg = ModelConfig(**BASE, intermediate_size=16, moe_experts=8, moe_top_k=2)
    torch.manual_seed(1)
    a = MoE(dataclasses.replace(cfg, moe_impl="loop"))
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0.0, 0.2)
        a.router.weight[5:] = 0.0  # experts 5-7 only win ties: most get no token
        a.router.weight[0] *= 4
    b = MoE(dataclasses.replace(cfg, moe_impl="grouped"))
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 7, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = a(xa), b(xb)
    counts = a.stats["counts"]
    assert (counts == 0).any() and counts.sum() == 28
    tol = dict(atol=1e-5, rtol=1e-5)  # float sums in another order (the padded product blocks differently)
    torch.testing.assert_close(ya, yb, **tol)
    (ya.square().sum()).backward()
    (yb.square().sum()).backward()
    torch.testing.assert_close(xa.grad, xb.grad, **tol)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **tol)


def _moe_gpt(**kw) -> GPT:
    cfg = ModelConfig(**{**BASE, "n_layer": 3, "intermediate_size": 24, "moe_experts": 4, "moe_top_k": 2,
                         "moe_intermediate_size": 16, "moe_dense_layers": "1", **kw})
    torch.manual_seed(0)
    return GPT(cfg, 64)


def _router_logits(model: GPT) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    for m in model.modules():
        if isinstance(m, MoE):
            m.router.register_forward_hook(lambda mod, inp, out: seen.append(out))
    return seen


def test_router_losses_match_load_balancing_loss_func():
    """Layers 0 and 2 sparse, 1 dense; the training loss = cross-entropy + coefs x (load balancing, z)."""
    model = _moe_gpt(moe_aux_loss_coef=0.5, moe_z_loss_coef=0.25)
    assert [i for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)] == [0, 2]
    seen = _router_logits(model)
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    model.train()
    _, loss = model(x, y)
    assert len(seen) == 2
    ref_aux = hf_mixtral.load_balancing_loss_func(tuple(seen), 4, 2)
    ref_z = torch.cat(seen).logsumexp(-1).square().mean()
    model.eval()
    _, ce = model(x, y)  # evaluation: the cross-entropy alone
    assert torch.allclose(loss, ce + 0.5 * ref_aux + 0.25 * ref_z, atol=1e-6, rtol=0)
    # gradients: the router losses' gradient on the routers equals transformers' through the same logits
    model.train()
    seen.clear()
    model(x, y)
    ours = router_loss(model, y)
    ref = 0.5 * hf_mixtral.load_balancing_loss_func(tuple(seen), 4, 2) + 0.25 * torch.cat(seen).logsumexp(-1).square().mean()
    routers = [m.router.weight for m in model.modules() if isinstance(m, MoE)]
    g_ours = torch.autograd.grad(ours, routers, retain_graph=True)
    g_ref = torch.autograd.grad(ref, routers)
    for a, b in zip(g_ours, g_ref):
        assert b.abs().max() > 0 and torch.allclose(a, b, atol=1e-6, rtol=0)
    # a summed loss (loss mask) scales the router losses by the learned tokens, so they stay a mean
    y[0, :5] = -100
    _, s = model(x, y, reduction="sum")
    _, m = model(x, y)
    assert torch.allclose(s / 27, m, atol=1e-5, rtol=0)


def test_router_stats_logged():
    model = _moe_gpt()
    x = torch.randint(0, 64, (2, 16))
    model(x)
    st = router_stats(model)
    counts = [m.stats["counts"] for m in model.modules() if isinstance(m, MoE)]
    assert all(int(c.sum()) == 2 * 16 * 2 for c in counts)
    loads = [round(float(c.max() / c.mean()), 4) for c in counts]
    assert [st["moe_load_0"], st["moe_load_2"]] == loads and "moe_load_1" not in st  # layer 1 is dense
    assert st["moe_load_max"] == max(loads) >= 1.0
    assert st["moe_aux_loss"] > 0 and st["moe_z_loss"] > 0
    dense = GPT(ModelConfig(**BASE), 64)
    dense(x)
    assert router_stats(dense) == {}


@pytest.mark.parametrize("overrides, message", [
    ({"model.moe_experts": "4", "model.moe_top_k": "5"}, r"model\.moe_top_k \(5\) must be at most model\.moe_experts \(4\)"),
    ({"model.moe_experts": "4", "model.moe_dense_layers": "0,x"}, r"model\.moe_dense_layers: 'x' is not a layer index"),
    ({"model.moe_experts": "4", "model.moe_dense_layers": "0,2"}, r"model\.moe_dense_layers: layer 2 is outside 0 \.\. 1"),
    ({"model.moe_experts": "4", "model.moe_dense_layers": "1,1"}, r"model\.moe_dense_layers: layer 1 is listed twice"),
    ({"model.moe_experts": "4", "model.moe_dense_layers": "0,1"}, r"leave no sparse layer"),
    ({"model.moe_experts": "4", "model.moe_router": "sigmoid"}, r"model\.moe_router: 'sigmoid' is not one of"),
    ({"model.moe_experts": "4", "model.mlp": "gelu"}, r"needs --model\.mlp swiglu"),
    ({"model.moe_experts": "4", "parallel.pp": "2"}, r"does not combine with parallel\.pp: the load-balancing loss"),
])
def test_bad_moe_configs_are_refused(overrides, message):
    base = {"model.n_layer": "2", "model.mlp": "swiglu"}
    with pytest.raises(C.ConfigError, match=message):
        C.resolve("tiny", overrides={**base, **overrides})


# published config.json shapes (the reference) and the counts their cards state, in billions (total, active)
PUBLISHED = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                             moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                             num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                             norm_topk_prob=True, tie_word_embeddings=False), (30.5, 3.3)),
    "mixtral-8x7b": ("MixtralConfig", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                           num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                           num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False),
                     (46.7, 12.9)),
    "olmoe-1b-7b": ("OlmoeConfig", dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                        num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                                        num_experts_per_tok=8, tie_word_embeddings=False), (6.9, 1.3)),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_counts_equal_transformers_and_the_published_ones(preset):
    """Total parameters equal transformers' model of the published config.json (built on meta); active
    parameters (total minus the routed experts a token skips) round to the published figure; the FLOPs
    count uses the active ones."""
    from tokenmill.config.size import param_count
    from tokenmill.model.build import param_counts
    from tokenmill.model.flops import flop_params

    name, kw, (total_b, active_b) = PUBLISHED[preset]
    config = getattr(transformers, name)(**kw)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(config)
    hf_total = sum(p.numel() for p in hf_model.parameters())
    experts = next(m for m in hf_model.modules() if type(m).__name__.endswith("Experts"))
    per_expert = sum(p.numel() for p in experts.parameters()) // experts.num_experts
    hf_active = hf_total - kw["num_hidden_layers"] * (experts.num_experts - kw["num_experts_per_tok"]) * per_expert
    cfg = C.resolve(preset).model
    counts = param_counts(cfg, cfg.vocab_size)
    assert counts.total == hf_total == param_count(cfg, cfg.vocab_size)
    assert counts.total - counts.inactive == hf_active
    assert (hf_total / 1e9, hf_active / 1e9) == pytest.approx((total_b, active_b), abs=0.06)  # as published: 0.1B
    emb = cfg.vocab_size * cfg.n_embd  # the token embedding: a lookup, not in N
    assert flop_params(cfg, cfg.vocab_size) == hf_active - emb


def test_lora_on_attention_with_experts_and_the_estimator():
    """LoRA adapters on q, k, v, o of a model with sparse layers: only they train, the experts stay frozen;
    an MLP role no layer has is refused naming the field; the estimator traces the MoE preset on meta."""
    from tokenmill.estimate import estimate
    from tokenmill.model.build import apply_lora

    cfg = C.resolve("tiny-moe", overrides={"lora.rank": "4", "lora.targets": "q,k,v,o", "model.vocab_size": "64"})
    torch.manual_seed(0)
    model = apply_lora(GPT(cfg.model, 64), cfg.lora)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".attn." in n and "lora" in n for n in trainable)
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    assert all(p.grad is None for n, p in model.named_parameters() if "experts" in n or "router" in n)
    with pytest.raises(C.ConfigError, match=r"lora\.targets names up, but every layer of this model is a mixture"):
        C.resolve("tiny-moe", overrides={"lora.rank": "4", "lora.targets": "q,up"})
    small = C.resolve("tiny-moe", overrides={"data.source": "synthetic", "model.vocab_size": "64"})
    assert estimate(small, "h100").params == sum(p.numel() for p in GPT(small.model, 64).parameters())


@pytest.mark.slow
def test_grouped_experts_compile_to_one_graph():
    """In bf16 (where torch._grouped_mm's shape kernel runs) the whole MoE forward, routing statistics
    included, is one graph without breaks: no host sync, no data-dependent Python control flow."""
    if not grouped_mm_runs("cpu", torch.bfloat16):
        pytest.skip("torch._grouped_mm does not run in bf16 on this CPU build")
    from torch import _dynamo

    cfg = ModelConfig(**BASE, intermediate_size=16, moe_experts=4, moe_top_k=2, moe_impl="grouped")
    m = MoE(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.2)
    _dynamo.reset()
    explained = _dynamo.explain(m)(torch.randn(2, 8, 32, dtype=torch.bfloat16))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_olmoe_model_matches_transformers():
    """A whole tiny OLMoE (q and k normalised over all heads together: model.qk_norm_width='all'; experts
    in every layer, softmax then top-k without renormalising) with transformers' weights: the same logits."""
    torch.manual_seed(0)
    hf_cfg = transformers.OlmoeConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=3,
                                      max_position_embeddings=64, pad_token_id=None, eos_token_id=None, bos_token_id=None)
    ref = transformers.OlmoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    cfg = ModelConfig(**{**BASE, "n_layer": 2, "n_kv_head": 2, "fused_qkv": False, "tie_embeddings": False,
                         "qk_norm": True, "qk_norm_width": "all", "intermediate_size": 16, "moe_experts": 6,
                         "moe_top_k": 3, "moe_router": "softmax-topk", "block_size": 64})
    ours = GPT(cfg, 64).eval()
    names = {"embed_tokens": "wte", "self_attn.o_proj": "attn.c_proj", "self_attn": "attn",
             "input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "mlp.gate": "mlp.router",
             "experts.gate_up_proj": "experts.gate_up", "experts.down_proj": "experts.down", "layers": "blocks"}
    sd = {}
    for k, v in ref.state_dict().items():
        k = "ln_f.weight" if k == "model.norm.weight" else k.removeprefix("model.")
        for a, b in names.items():
            k = k.replace(a, b)
        sd[k] = v
    ours.load_state_dict(sd)
    assert ours.blocks[0].attn.q_norm.weight.shape == (32,) and ours.blocks[0].attn.k_norm.weight.shape == (16,)
    x = torch.randint(0, 64, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], ref(x).logits, atol=TOL, rtol=0)


def test_activation_checkpointing_keeps_loss_and_gradients_with_router_losses():
    """Checkpointed sparse blocks (recomputed in backward, routing statistics recorded again) give the same
    training loss, router losses included, and the same gradients."""
    from tokenmill.model.build import apply_activation_checkpointing

    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    grads = []
    for every in (0, 1):
        model = apply_activation_checkpointing(_moe_gpt(moe_z_loss_coef=0.1), every)
        _, loss = model(x, y)
        loss.backward()
        grads.append((loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad
                                      for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = grads
    assert torch.allclose(l0, l1, atol=1e-6, rtol=0) and g0.keys() == g1.keys()
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-6, rtol=0), n


@pytest.mark.skipif(not grouped_mm_runs("cpu", torch.bfloat16), reason="torch._grouped_mm does not run in bf16 here")
def test_grouped_experts_under_bf16_autocast():
    """fp32 weights under bf16 autocast (the usual GPU precision): the grouped path runs its products in
    bf16, as autocast runs the loop's Linears, and both agree to bf16 precision; the output keeps the
    residual stream's fp32."""
    cfg = ModelConfig(**BASE, intermediate_size=16, moe_experts=4, moe_top_k=2)
    torch.manual_seed(0)
    a, b = MoE(dataclasses.replace(cfg, moe_impl="loop")), MoE(dataclasses.replace(cfg, moe_impl="grouped"))
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0.0, 0.2)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = a(x), b(x)
    assert ya.dtype == yb.dtype == torch.float32
    torch.testing.assert_close(ya, yb, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(yb, b(x), atol=5e-2, rtol=5e-2)  # and near the fp32 output
