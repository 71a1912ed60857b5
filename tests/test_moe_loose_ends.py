"""What counts, saves and prints around a mixture of experts follows what the model and the optimizer do:
LoRA's trainable count with expert adapters (model/build.py ``trainable_params``), selective checkpointing
keeping the experts' grouped products ('save-matmuls'), the estimator's Muon state and QLoRA bytes against a
real optimizer step and a real NF4 model (estimate/techniques.py), and the fine-tuning line naming the roles the
model has (train/init_from.py). Tiny models: 2-3 layers, width 32, 4 experts, top-2, T 16."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenmill import config as C
from tokenmill.model import GPT
from tokenmill.model.build import (
    apply_activation_checkpointing,
    apply_lora,
    lora_model_roles,
    trainable_params,
)
from tokenmill.model.moe import grouped_mm_runs

V = 64


def moe_cfg(**kw) -> C.ModelConfig:
    return C.ModelConfig(**{"vocab_size": V, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "pos_emb": "rope",
                            "norm_type": "rmsnorm", "mlp": "swiglu", "bias": False, "qkv_bias": False,
                            "tie_embeddings": False, "fused_qkv": False, "dropout": 0.0, "moe_experts": 4,
                            "moe_top_k": 2, "moe_intermediate_size": 16, "intermediate_size": 24, **kw})


def moe_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(moe_cfg(**kw), V)


def ids(seed: int = 1, T: int = 16) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


# three layers, the middle one dense (with a shared expert in the sparse ones), and two all-sparse layers
SHAPES = [{"n_layer": 3, "moe_dense_layers": "1", "moe_shared_experts": 1}, {}]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("targets", ["experts", "all", "q,down,experts"])
def test_trainable_params_count_the_expert_adapters(shape, targets):
    """trainable_params (the estimator's and the advice's count) equals the parameters that require gradients in
    the built model, expert adapters (E x r x (in + out) per stack) included."""
    if targets == "q,down,experts" and not shape:
        targets = "q,experts"  # every layer sparse without shared experts: no 'down'
    lo = C.LoraConfig(rank=4, targets=targets)
    model = apply_lora(moe_gpt(**shape), lo)
    built = sum(p.numel() for p in model.parameters() if p.requires_grad)
    experts = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".experts.lora_" in n)
    n_sparse = 2
    assert experts == n_sparse * 4 * 4 * ((32 + 32) + (16 + 32))  # gate_up (2I x C), down (C x I): E r (in + out)
    assert trainable_params(moe_cfg(**shape), V, lo) == built


def test_lora_model_roles_are_the_adapted_ones():
    """The roles printed for a run: those the model's blocks have ('all' on an all-sparse model without shared
    experts: attention and the experts; no gate/up/down)."""
    assert lora_model_roles(moe_cfg(), C.LoraConfig(rank=4)) == ("q", "k", "v", "o", "experts")
    assert lora_model_roles(moe_cfg(n_layer=3, moe_dense_layers="1"), C.LoraConfig(rank=4, targets="v,up,experts")) \
        == ("v", "up", "experts")
    assert lora_model_roles(moe_cfg(moe_experts=0), C.LoraConfig(rank=4)) == ("q", "k", "v", "o", "gate", "up", "down")


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._grouped_mm.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _grouped_calls(policy: str | None) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(grouped products in the forward, in the backward, the gradients) of the grouped-experts model with every
    block checkpointed under ``policy`` (None: not checkpointed)."""
    model = moe_gpt(moe_impl="grouped")
    if policy:
        apply_activation_checkpointing(model, 1, policy)
    fwd, bwd = _Count(), _Count()
    with fwd:
        loss = model(ids(), ids(2))[1]
    with bwd:
        loss.backward()
    return fwd.n, bwd.n, {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_grouped_mm") or not grouped_mm_runs("cpu", torch.float32),
                    reason="this torch has no grouped matmul on the CPU")
def test_save_matmuls_keeps_the_grouped_expert_products():
    """'save-matmuls' saves the experts' _grouped_mm outputs: the backward runs exactly as many grouped products as
    without checkpointing (no recomputed one), 'full' recomputes every forward one; gradients equal the
    uncheckpointed ones within 1e-6."""
    fwd, plain, ref = _grouped_calls(None)
    assert fwd == 2 * 2  # 2 layers x (gate_up, down)
    _, saved, got = _grouped_calls("save-matmuls")
    _, full, _ = _grouped_calls("full")
    assert saved == plain and full == plain + fwd
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, atol=1e-6, rtol=0, msg=n)


MIXED = {"model.n_layer": 3, "model.moe_dense_layers": "1", "model.moe_shared_experts": 1, "model.moe_shared_gate": True}


@pytest.mark.parametrize("lora", [0, 4])
def test_estimated_muon_state_equals_a_real_steps_state(lora):
    """optim.name='muon' on a MoE with a gated shared expert: the estimator's optimizer-state
    bytes (Muon's one momentum per hidden matrix and expert stack, AdamW's two moments for the router, the
    shared-expert gate and everything else) equal the state tensors of one real MuonWithAdamW step on the
    built model; with LoRA on the experts and attention, the adapters' state (expert adapter stacks: Muon's)."""
    from tokenmill.estimate.core import _plan, resolve_layout
    from tokenmill.estimate.step import _state_bytes
    from tokenmill.estimate.techniques import muon_hidden
    from tokenmill.model.build import build_gpt
    from tokenmill.optim import build_optimizer

    over = {"model.moe_shared_experts": 1, "model.moe_shared_gate": True, "optim.name": "muon", "model.vocab_size": V,
            "lora.rank": lora, "lora.targets": "q,v,experts" if lora else "all"}  # every layer sparse: traced as one
    cfg = C.concrete(C.resolve("tiny-moe", overrides=over, overrides_from_string=False), "cpu")
    plan, _ = _plan(cfg, resolve_layout(cfg, 1), V, False, 0)
    estimated = sum(_state_bytes(cfg, p, 1.0)[0] for p in plan.params if p.trainable)
    muon = {p.name for p in plan.params if muon_hidden(cfg, p)}
    assert ("blocks.0.mlp.experts.lora_B.gate_up" if lora else "blocks.0.mlp.experts.gate_up") in muon
    assert not any("router" in n or "shared_gate" in n for n in muon)
    torch.manual_seed(0)
    model = apply_lora(build_gpt(cfg.model, V, "cpu"), cfg.lora)
    opt = build_optimizer(model, cfg)
    model(ids(), ids(2))[1].backward()
    opt.step()
    real = sum(t.numel() * t.element_size() for p, s in opt.state.items() for t in s.values()
               if torch.is_tensor(t) and t.shape == p.shape)
    assert real > 0 and estimated == real
    names = {id(p): n for n, p in model.named_parameters()}
    assert muon == {names[id(p)] for p in opt.muon.param_groups[0]["params"]}


@pytest.mark.parametrize("targets", ["experts", "all"])
def test_nf4_sizing_counts_the_expert_stacks(targets):
    """QLoRA on a MoE (a dense layer, a shared expert): the estimator's NF4 weights' bytes at the weights'
    width equal those weights in the built LoRA model, and its NF4 bytes the stored bytes (codes, scales,
    factors, mean, code table) of every NF4 tensor of the built QLoRA model, expert stacks included."""
    pytest.importorskip("torchao", reason="torchao is not installed")
    from tokenmill.estimate.techniques import nf4_base_bytes
    from tokenmill.model.lora import LoRAExperts, LoRALinear

    over = {**MIXED, "model.vocab_size": V, "lora.rank": 4, "lora.targets": targets, "lora.quantize_base": "nf4"}
    cfg = C.resolve("tiny-moe", overrides=over, overrides_from_string=False)
    full, nf4, transient = nf4_base_bytes(cfg, V, 4)
    torch.manual_seed(0)
    model = apply_lora(GPT(cfg.model, V), cfg.lora)
    weights = [getattr(m, n) for m in model.modules() if isinstance(m, (LoRAExperts, LoRALinear)) for n in m._nf4_names()]
    assert sum(isinstance(m, LoRAExperts) for m in model.modules()) == 2
    # the 2 expert stacks of the 2 sparse layers, and (adapted or not) q, k, v, o of the 3 layers, gate, up, down
    # of the dense MLP and of the 2 shared experts
    assert len(weights) == 4 + 3 * 4 + 3 + 2 * 3

    def stored(w) -> int:
        return sum(t.numel() * t.element_size() for t in
                   (w.quantized_data, w.quantized_scalers, w.quantization_factor, w.scaler_mean, w.nf4))

    assert nf4 == sum(map(stored, weights))
    assert full == 4 * sum(w.numel() for w in weights)  # fp32 weights: train.precision fp32 on the CPU
    assert transient == max(w.numel() for w in weights) * (4 + 2)


def test_fine_tuning_line_names_the_roles_the_model_has(tmp_path, capsys):
    """train.init_from a Mixtral folder with lora.targets 'all': the line names attention and the experts (every
    layer is sparse, no shared experts: no gate, up, down); 'v,experts' names those two."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    from tokenmill.train.init_from import prepare_init_from

    transformers.MixtralConfig(  # its config.json is what the line is made from (the weights load later)
        vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
        architectures=["MixtralForCausalLM"]).save_pretrained(tmp_path / "src")
    for targets, roles in (("all", "q,k,v,o,experts"), ("v,experts", "v,experts")):
        cfg = C.resolve(None, overrides={"train.init_from": str(tmp_path / "src"), "lora.rank": 4, "lora.targets": targets,
                                         "data.source": "synthetic", "model.vocab_size": V}, overrides_from_string=False)
        cfg, src = prepare_init_from(cfg, has_checkpoints=False)
        assert cfg.model.moe_experts == 4 and src is not None
        out = capsys.readouterr().out
        assert f"LoRA adapters of rank 4 on {roles}, its weights frozen" in out, out


def test_grouped_experts_where_they_cannot_run_is_a_config_error(monkeypatch):
    """model.moe_impl='grouped' asked where torch's grouped product cannot run: refused at resolve when compile
    is on with non-bf16 products (the traced kernel takes bf16 only), and, where only the device can tell
    (precision 'auto'), at the first forward, by message; 'auto' falls back to the per-expert loop instead."""
    from tokenmill.errors import ConfigError
    from tokenmill.model import moe

    over = {"model.vocab_size": V, "model.moe_impl": "grouped", "compile.enabled": True, "train.precision": "fp32"}
    with pytest.raises(ConfigError, match="moe_impl='grouped' under compile.enabled needs bf16 products"):
        C.resolve("tiny-moe", overrides=over, overrides_from_string=False)
    cfg = C.resolve("tiny-moe", overrides={"model.vocab_size": V, "model.moe_impl": "grouped"},
                    overrides_from_string=False)
    torch.manual_seed(0)
    model = GPT(cfg.model, V)
    monkeypatch.setattr(moe, "grouped_mm_runs", lambda device, dtype: False)
    x = torch.randint(0, V, (1, 8))
    with pytest.raises(ConfigError, match="grouped matrix product cannot run for float32 products on cpu"):
        model(x, x)
    for m in model.modules():
        if isinstance(m, moe.MoE):
            m.impl = "auto"
    assert torch.isfinite(model(x, x)[1])
