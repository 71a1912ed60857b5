"""The estimator on models that mix dense and sparse layers (``model.moe_every`` > 1, ``model.moe_dense_layers``):
one traced block of each kind (estimate/trace.py), counted by how many blocks of that kind the model has, checked
against the built model's parameters and the model's own FLOPs count; the fine-tuning report's LoRA roles on a
MoE preset; Muon's Newton-Schulz work on a fused q/k/v matrix (three matrices, as optim/muon.py splits it)
against the matrices a real step orthogonalises. Tiny models: 2-4 layers, width 32, 4 experts, T 32."""

from __future__ import annotations

import pytest
import torch

from tokenmill import config as C

V = 64


def resolved(**over) -> C.Config:
    return C.concrete(C.resolve("tiny-moe", overrides={"model.vocab_size": V, **over}, overrides_from_string=False),
                      "cpu")


def planned(cfg: C.Config):
    from tokenmill.estimate.core import _plan, resolve_layout

    return _plan(cfg, resolve_layout(cfg, 1), V, False, 0)


def kept_activations(pieces) -> int:
    """Bytes every block of the model keeps for its backward (each block counted by its traced kind)."""
    from tokenmill.estimate.core import _per_block

    per = _per_block(pieces)
    return sum(per[k] for k in pieces.kinds)


MIXED = [{"model.n_layer": 2, "model.moe_every": 2},  # the sparse layer second: a one-layer trace had none
         {"model.n_layer": 3, "model.moe_dense_layers": "0"},
         {"model.n_layer": 4, "model.moe_every": 2, "memory.activation_checkpointing": 2}]


@pytest.mark.parametrize("over", MIXED)
def test_mixed_model_traced_by_kind(over):
    """Parameters (names, shapes, bytes) equal the built model's; the blocks' kept activations and the peak lie
    strictly between the same shape all dense and all sparse; the traced matmul FLOPs per token equal the model's
    FLOPs count (model/flops.py: 6 N) less its norm gains (no matmul)."""
    from tokenmill.model.build import build_gpt
    from tokenmill.model.flops import flop_params

    cfg = resolved(**over)
    plan, pieces = planned(cfg)
    n_sparse = len(cfg.model.sparse_layers())
    assert sum(k.endswith("sparse") for k in pieces.kinds) == n_sparse and 0 < n_sparse < cfg.model.n_layer
    model = build_gpt(cfg.model, V, "meta")
    assert {p.name: (tuple(p.shape), p.nbytes) for p in plan.params} == \
        {n: (tuple(p.shape), p.numel() * p.element_size()) for n, p in model.named_parameters()}
    m = cfg.model
    dense = resolved(**{**over, "model.moe_experts": 0, "model.moe_every": 1, "model.moe_dense_layers": ""})
    sparse = resolved(**{**over, "model.moe_every": 1, "model.moe_dense_layers": ""})
    acts = [kept_activations(planned(c)[1]) for c in (dense, cfg, sparse)]
    assert acts[0] < acts[1] < acts[2], acts

    def flops(tr) -> float:
        r = tr.rounds[0]
        return sum(c.flops for c in r.fwd_costs + r.bwd_costs if c.flops and not c.attention)

    # the model's count leaves recomputation out: the same model with activation checkpointing off
    pieces = planned(resolved(**{**over, "memory.activation_checkpointing": 0}))[1]
    traced = flops(pieces.embed) + flops(pieces.head) + sum(flops(pieces.blocks[k]) for k in pieces.kinds)
    gains = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 1)  # RMSNorm weights, no bias
    assert traced / (pieces.batch * pieces.seq) == 6 * (flop_params(m, V) - gains)


def test_mixed_model_peak_between_dense_and_sparse():
    """The whole estimate's peak for the mixed model lies between the all-dense and all-sparse models'."""
    from tokenmill.estimate import estimate

    over = MIXED[0]
    peaks = [estimate(resolved(**o), "h100-sxm").peak_alloc_mb for o in (
        {**over, "model.moe_experts": 0, "model.moe_every": 1}, over, {**over, "model.moe_every": 1})]
    assert peaks[0] < peaks[1] < peaks[2], peaks


def test_finetune_report_names_the_roles_the_moe_model_has():
    """``tokenmill estimate --finetune`` on OLMoE (every layer sparse, no shared experts): the LoRA line names
    the attention projections and the routed experts, not a dense MLP's gate/up/down."""
    from conftest import run_cli

    r = run_cli("estimate", "--finetune", "--preset", "olmoe-1b-7b", "--model.n_layer", "1", "--model.block_size",
                "128", "--train.batch_size", "1")
    assert r.returncode == 0, r.stderr
    line = next(s for s in r.stdout.splitlines() if s.startswith("LoRA: rank"))
    assert " on q,k,v,o,experts: " in line, line


@pytest.mark.slow  # one real optimizer step
def test_muon_estimate_follows_the_matrices_orthogonalised(monkeypatch):
    """optim.name='muon', fused q/k/v with grouped k/v (4 query heads, 2 k/v heads): the estimator's Newton-Schulz
    parts and FLOPs equal the matrices one real MuonWithAdamW step hands to newton_schulz (q, k and v apart;
    the experts' gate and up apart), and its temporaries count the largest part's Gram matrices."""
    from conftest import count_newton_schulz
    from tokenmill.estimate.techniques import muon_hidden, muon_matrices, muon_temp_bytes, ns_flops
    from tokenmill.model.build import build_gpt
    from tokenmill.optim import build_optimizer

    cfg = resolved(**{"optim.name": "muon", "model.fused_qkv": True, "model.moe_intermediate_size": 16,
                      "model.n_layer": 2, "model.moe_every": 2})
    plan, _ = planned(cfg)
    estimated = sorted((k, s) for p in plan.params if muon_hidden(cfg, p) for k, s in muon_matrices(cfg, p))
    assert (1, (32, 32)) in estimated and (1, (16, 32)) in estimated  # c_attn (64 x 32): q 32 rows, k and v 16
    seen = count_newton_schulz(monkeypatch)
    torch.manual_seed(0)
    model = build_gpt(cfg.model, V, "cpu")
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(1))
    model(x, x)[1].backward()
    opt.step()
    assert sorted(seen) == estimated
    assert sum(k * ns_flops(s) for k, s in seen) == sum(k * ns_flops(s) for k, s in estimated)
    # the largest hidden tensor, the experts' gate_up (4 x 32 x 32, fp32): its fp32 update, bf16 copy, iterate and
    # new iterate (4 + 3 x 2 bytes an element), and two bf16 Gram matrices of one part at a time (4 experts x 16 x 16)
    assert (4, (16, 32)) in seen and muon_temp_bytes(cfg, plan.params, False) == 4 * 32 * 32 * 10 + 2 * 2 * 4 * 16 * 16
