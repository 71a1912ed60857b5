"""LoRA on a mixture of experts: per-expert adapters on the routed experts' stacked weights (role 'experts',
model/lora.py ``LoRAExperts``) and on attention. The reference is PEFT's LoRA on transformers' Mixtral
(``target_parameters`` on the stacked ``experts.gate_up_proj`` / ``experts.down_proj``: one (r x in, out x r)
pair per expert, the layout tokenmill keeps), with the same adapter values, within 1e-5 in fp32."""

from __future__ import annotations

import pytest
import torch

from tokenmill import config as C
from tokenmill.model import GPT, hf
from tokenmill.model.build import apply_lora
from tokenmill.model.lora import LoRAExperts, LoRALinear, merge_lora
from tokenmill.model.moe import Experts, grouped_mm_runs

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tokenmill[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'tokenmill[hf]')")

V, E, R = 64, 4, 4
ATOL = 1e-5
IMPLS = ["loop", "grouped"] if grouped_mm_runs("cpu", torch.float32) else ["loop"]


def mixtral(path):
    """A tiny random Mixtral (2 layers, width 32, 4 experts, top-2), saved to ``path``, and tokenmill's copy."""
    torch.manual_seed(0)
    hf_cfg = transformers.MixtralConfig(vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                                        num_experts_per_tok=2, max_position_embeddings=32, bos_token_id=None,
                                        eos_token_id=None, pad_token_id=None)
    src = transformers.MixtralForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    src.save_pretrained(path)
    cfg, sd = hf.load_hf(path, base=C.ModelConfig(fused_qkv=False))
    ours = GPT(cfg, V)
    ours.load_state_dict(sd)
    return src, ours.eval()


def ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(seed))


def peft_copy(src, ours: GPT):
    """PEFT's LoRA on ``src`` (attention and the stacked experts) holding ``ours``' adapter values."""
    peft = pytest.importorskip("peft", reason="peft is not installed")
    pm = peft.get_peft_model(src, peft.LoraConfig(r=R, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                  target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    with torch.no_grad():
        for blk, layer in zip(ours.blocks, pm.base_model.model.model.layers):
            a = layer.self_attn
            for role, mine, theirs in (("q", blk.attn.q_proj, a.q_proj), ("k", blk.attn.k_proj, a.k_proj),
                                       ("v", blk.attn.v_proj, a.v_proj), ("o", blk.attn.c_proj, a.o_proj)):
                theirs.lora_A["default"].weight.copy_(mine.lora_A[role])
                theirs.lora_B["default"].weight.copy_(mine.lora_B[role])
            ex = blk.mlp.experts
            for name, wrap in (("gate_up", layer.mlp.experts.base_layer), ("down", layer.mlp.experts)):
                a_, b_ = ex.lora_A[name], ex.lora_B[name]  # (E, r, in), (E, out, r): PEFT's (E r, in), (out, r E)
                wrap.lora_A["default"].weight.copy_(a_.reshape(-1, a_.size(-1)))
                wrap.lora_B["default"].weight.copy_(b_.permute(1, 2, 0).reshape(b_.size(1), -1))
    return pm.eval()


@pytest.mark.parametrize("impl", IMPLS)
def test_expert_adapters_equal_peft_and_merge(tmp_path, impl):
    """Fresh adapters (B = 0): the base model's logits exactly. Random adapters: PEFT's logits within 1e-5
    (loop and grouped experts), and merging them gives the same logits within 1e-5."""
    src, ours = mixtral(tmp_path)
    for blk in ours.blocks:
        blk.mlp.impl = impl
    x = ids()
    with torch.no_grad():
        base = ours(x)[0]
    apply_lora(ours, C.LoraConfig(rank=R, alpha=8.0, targets="all"))
    assert all(isinstance(b.mlp.experts, LoRAExperts) for b in ours.blocks)
    assert ours.blocks[0].mlp.experts.lora_A["gate_up"].shape == (E, R, 32)
    assert ours.blocks[0].mlp.experts.lora_B["down"].shape == (E, 32, R)
    with torch.no_grad():
        assert torch.equal(ours(x)[0], base)
    adapted = perturb_adapters(ours)
    assert (adapted - base).abs().max() > 1e-2
    torch.testing.assert_close(adapted, peft_copy(src, ours)(x).logits, atol=ATOL, rtol=0)
    merged = merge_lora(ours)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert type(merged.blocks[0].mlp.experts) is Experts
    with torch.no_grad():
        torch.testing.assert_close(merged(x)[0], adapted, atol=ATOL, rtol=0)


def perturb_adapters(model) -> torch.Tensor:
    """Every adapter's B gets random values (so the adapters act); returns the adapted logits on ``ids()``."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
        return model(ids())[0]


def test_one_step_changes_only_the_adapters(tmp_path):
    """One AdamW step of a LoRA MoE model: only adapters change, every base weight (experts, router,
    attention, embeddings) is bit-for-bit the same and got no gradient; the expert adapters did change."""
    from tokenmill.optim import build_adamw

    _, ours = mixtral(tmp_path)
    ours.train()
    apply_lora(ours, C.LoraConfig(rank=R, targets="q,v,experts"))
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    opt = build_adamw(ours, C.OptimConfig(lr=1e-2, weight_decay=0.0))
    x = ids()
    ours(x, ids(2))[1].backward()
    opt.step()
    changed = {n for n, p in ours.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert changed <= trainable and all("lora_" in n for n in trainable)
    assert {"blocks.0.mlp.experts.lora_B.gate_up", "blocks.1.mlp.experts.lora_B.down"} <= changed
    assert not any(".k_proj." in n or ".c_proj." in n for n in trainable)
    assert all(p.grad is None for n, p in ours.named_parameters() if "lora_" not in n)


def test_shared_experts_take_the_mlp_roles():
    """In a sparse layer with shared experts, gate, up and down adapt the shared experts' projections; a
    dense layer keeps its MLP roles; fresh adapters leave the logits as they were, merged ones agree."""
    cfg = C.ModelConfig(vocab_size=V, block_size=16, n_layer=2, n_head=4, n_embd=32, pos_emb="rope", norm_type="rmsnorm",
                        mlp="swiglu", bias=False, qkv_bias=False, intermediate_size=24, moe_experts=E, moe_top_k=2,
                        moe_intermediate_size=16, moe_shared_experts=1, moe_dense_layers="1")
    torch.manual_seed(0)
    model = GPT(cfg, V).eval()
    x = ids()
    with torch.no_grad():
        base = model(x)[0]
    apply_lora(model, C.LoraConfig(rank=R, targets="gate,down,experts"))
    trainable = {n.rsplit(".lora_", 1)[0] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"blocks.0.mlp.shared.c_gate", "blocks.0.mlp.shared.c_proj", "blocks.0.mlp.experts",
                         "blocks.1.mlp.c_gate", "blocks.1.mlp.c_proj"}
    with torch.no_grad():
        assert torch.equal(model(x)[0], base)
    adapted = perturb_adapters(model)
    with torch.no_grad():
        torch.testing.assert_close(merge_lora(model)(x)[0], adapted, atol=ATOL, rtol=0)


@pytest.mark.parametrize("overrides, match", [
    ({"model.moe_experts": "0", "lora.targets": "q,experts"}, r"names 'experts', but this model has no mixture"),
    ({"lora.targets": "q,up"}, r"names up, but every layer of this model is a mixture of experts"),
    ({"lora.targets": "experts,gates"}, r"lora\.targets: 'gates' is not a projection"),
])
def test_bad_targets_are_refused(overrides, match):
    with pytest.raises(C.ConfigError, match=match):
        C.resolve("tiny-moe", overrides={"lora.rank": "4", **overrides})


def test_all_targets_on_the_moe_preset_resolve():
    """'all' on tiny-moe (every layer sparse, no shared experts): attention and the experts, nothing refused."""
    cfg = C.resolve("tiny-moe", overrides={"lora.rank": "4", "model.vocab_size": str(V)})
    with torch.device("meta"):
        model = apply_lora(GPT(cfg.model, V), cfg.lora, init=False)
    kinds = {n.split(".")[-3] for n, p in model.named_parameters() if p.requires_grad}
    assert kinds == {"q_proj", "k_proj", "v_proj", "c_proj", "experts"}


@pytest.mark.slow
def test_train_and_export_merged_through_the_cli(tmp_path, capsys):
    """A Mixtral folder, 2 LoRA steps on attention and experts through the CLI, export: transformers gives
    the run's logits (the adapters merged into the experts) within 1e-5."""
    from tokenmill import checkpoint
    from tokenmill.cli import main

    src, _ = mixtral(tmp_path / "src")
    run = tmp_path / "run"
    assert main(["train", "--train.init_from", str(tmp_path / "src"), "--data.source", "synthetic",
                 "--model.vocab_size", str(V), "--run-dir", str(run), "--train.max_steps", "2", "--optim.lr", "1e-2",
                 "--lora.rank", "4", "--train.device", "cpu", "--log.progress", "plain", "--log.tensorboard", "false",
                 "--model.block_size", "16", "--train.batch_size", "2", "--train.eval_batches", "1",
                 "--optim.warmup_steps", "1"]) == 0
    _, cfg, path = checkpoint.load_model(run)
    assert cfg.lora.targets == "all" and cfg.model.moe_experts == E
    model = apply_lora(GPT(cfg.model, V), cfg.lora, init=False)  # the run's model as it trained: not merged
    model.load_state_dict(checkpoint.read_state(path)["model"])
    assert isinstance(model.blocks[1].mlp.experts, LoRAExperts)
    model.eval()
    x = ids()
    with torch.no_grad():
        ran = model(x)[0]
        assert (ran - src(x).logits).abs().max() > 1e-4  # the adapters trained
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "out")]) == 0
    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(out(x).logits, ran, atol=ATOL, rtol=0)


def tiny_moe(**kw) -> GPT:
    cfg = C.ModelConfig(vocab_size=V, block_size=16, n_layer=2, n_head=4, n_embd=32, pos_emb="rope", norm_type="rmsnorm",
                        mlp="swiglu", bias=False, qkv_bias=False, fused_qkv=False, moe_experts=E, moe_top_k=2,
                        moe_intermediate_size=16, **kw)
    torch.manual_seed(0)
    return GPT(cfg, V)


@pytest.mark.parametrize("impl", IMPLS)
def test_qlora_experts_equal_lora_on_the_dequantised_base(impl):
    """QLoRA on the experts (each stack one NF4 tensor, dequantised in forward and backward): the logits and
    the adapters' gradients of plain LoRA over the dequantised stacks (1e-5); no gradient for the base; the
    state dict holds the codes in the stack's shape and reloads to the same logits exactly; merged, the
    same logits (1e-5)."""
    pytest.importorskip("torchao", reason="torchao is not installed")
    q = tiny_moe(moe_impl=impl)
    apply_lora(q, C.LoraConfig(rank=R, targets="q,experts", quantize_base="nf4"))
    ex = q.blocks[0].mlp.experts
    assert ex._nf4_names() == ["gate_up", "down"] and not ex.gate_up.requires_grad
    with torch.no_grad():
        for n, p in q.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    ref = tiny_moe(moe_impl=impl)
    apply_lora(ref, C.LoraConfig(rank=R, targets="q,experts"))
    sd = {k: v for k, v in q.state_dict().items() if "_nf4_" not in k}
    for i, blk in enumerate(q.blocks):  # the dequantised bases: the experts' stacks and every projection
        for name in ("gate_up", "down"):
            w = getattr(blk.mlp.experts, name)
            sd[f"blocks.{i}.mlp.experts.{name}"] = w.get_original_weight().view(blk.mlp.experts.stacks[name])
    for name, m in q.named_modules():
        if isinstance(m, LoRALinear):
            sd[f"{name}.weight"] = m.base_weight()
    ref.load_state_dict(sd)
    x, y = ids(), ids(2)
    got, want = q(x, y), ref(x, y)
    torch.testing.assert_close(got[0], want[0], atol=ATOL, rtol=0)
    got[1].backward()
    want[1].backward()
    mine, theirs = dict(q.named_parameters()), dict(ref.named_parameters())
    for n, p in mine.items():
        if "lora_" in n:
            torch.testing.assert_close(p.grad, theirs[n].grad, atol=ATOL, rtol=0, msg=n)
        else:
            assert p.grad is None, n
    state = q.state_dict()
    codes = state["blocks.1.mlp.experts.down"]
    assert codes.dtype == torch.uint8 and codes.shape == (E, 32, 16) and "blocks.1.mlp.experts.down_nf4_scales" in state
    again = tiny_moe(moe_impl=impl)
    apply_lora(again, C.LoraConfig(rank=R, targets="q,experts", quantize_base="nf4"), init=False)
    again.load_state_dict(state)
    with torch.no_grad():
        assert torch.equal(again(x)[0], got[0])
        torch.testing.assert_close(merge_lora(q)(x)[0], got[0], atol=ATOL, rtol=0)


@pytest.mark.slow
def test_compiled_qlora_experts_train_as_eager():
    """An NF4 expert stack's product compiled (model/nf4.py nf4_product; the QLoRA flag, not the tensor, picks
    the path, which torch.compile cannot ask): the eager output and adapter and input gradients (1e-5), and no
    dequantised expert weight kept for the backward (nothing weight-sized saved)."""
    pytest.importorskip("torchao", reason="torchao is not installed")

    def run(compiled: bool):
        q = tiny_moe(moe_impl="loop")
        apply_lora(q, C.LoraConfig(rank=R, targets="experts", quantize_base="nf4"))
        ex = q.blocks[0].mlp.experts
        with torch.no_grad():
            ex.lora_B["gate_up"].normal_(0.0, 0.1, generator=torch.Generator().manual_seed(2))
        xs = torch.randn(5, 32, requires_grad=True, generator=torch.Generator().manual_seed(3))
        fn = torch.compile(lambda h: ex.product("gate_up", h, None, 1)) if compiled else (
            lambda h: ex.product("gate_up", h, None, 1))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: (saved.append((tuple(t.shape), type(t).__name__)), t)[1], lambda t: t):
            y = fn(xs)
        y.square().sum().backward()
        return y.detach(), {"A": ex.lora_A["gate_up"].grad, "B": ex.lora_B["gate_up"].grad, "x": xs.grad}, saved

    y, grads, _ = run(False)
    cy, cgrads, saved = run(True)
    torch.testing.assert_close(cy, y, atol=ATOL, rtol=0)
    for n, g in grads.items():
        torch.testing.assert_close(cgrads[n], g, atol=ATOL, rtol=0, msg=n)
    assert not [s for s, kind in saved if kind != "NF4Tensor" and s in ((2 * 16, 32), (E, 2 * 16, 32))], saved
