"""A block's matrices described once (config/matrices.py): the built model has exactly those weights, the size
check counts the built model's parameters from them, and FP8 (which the estimator and the doctor read) converts
exactly the linears they name."""

import pytest
import torch

from tokenmill import config as C
from tokenmill.config.matrices import block_matrices, model_matrices
from tokenmill.config.size import param_count
from tokenmill.model.fp8 import block_linear_shapes, fp8_linears, fp8_matrix
from tokenmill.model.gpt import GPT

SHRINK = {"model.n_layer": 2, "model.n_embd": 64, "model.n_head": 4, "model.block_size": 32, "model.vocab_size": 96}
PRESETS = {
    "gpt2-124m": {},
    "llama3.2-1b": {"model.n_kv_head": 2, "model.intermediate_size": 96},
    "qwen3-0.6b": {"model.n_kv_head": 2, "model.head_dim": 32, "model.intermediate_size": 80, "model.fused_qkv": False},
    "tiny-moe": {"model.moe_shared_experts": 1, "model.moe_shared_gate": True, "model.moe_dense_layers": "0"},
}


def _model(preset):
    over = {"data.source": "synthetic", **SHRINK, **PRESETS[preset]}
    if preset == "tiny-moe":
        over = {"data.source": "synthetic", "model.vocab_size": 96, **PRESETS[preset]}
    cfg = C.resolve(preset, overrides=over, overrides_from_string=False)
    with torch.device("meta"):
        return cfg, GPT(cfg.model, cfg.model.vocab_size)


@pytest.mark.parametrize("preset", [*(p for p in PRESETS if p != "tiny-moe"),  # an MoE layer imports torch._dynamo
                                    pytest.param("tiny-moe", marks=pytest.mark.slow)])
def test_the_matrices_are_the_built_blocks_weights_and_count_its_parameters(preset):
    cfg, model = _model(preset)
    m = cfg.model
    assert sum(p.numel() for p in model.parameters()) == param_count(m, m.vocab_size)
    matrices = model_matrices(m)
    if preset == "tiny-moe":
        assert m.sparse_layers() and len(m.sparse_layers()) < m.n_layer  # a dense and a sparse layer
        assert {x.role for x in matrices[m.sparse_layers()[0]]} >= {"router", "experts_gate_up", "shared_router"}
    fused = {id(p): tuple(rows) for p, rows in model.hidden_matrices() if rows}  # the model's own q/k/v split
    for block, mats in zip(model.blocks, matrices):
        weights = {n.removesuffix(".weight"): p for n, p in block.named_parameters() if p.dim() >= 2}
        assert sorted(weights) == sorted(x.path for x in mats)
        for x in mats:
            assert tuple(weights[x.path].shape) == x.shape, x
            assert x.split == fused.get(id(weights[x.path]), x.split) and sum(x.split or x.shape[-2:-1]) == x.shape[-2]
            linear = block.get_submodule(x.path) if x.linear else None
            assert (linear is not None and linear.bias is not None) == x.bias, x


@pytest.mark.parametrize("preset", ["gpt2-124m", "llama3.2-1b", "qwen3-0.6b"])
def test_fp8_and_its_readers_take_the_matrices_fp8_converts(preset):
    cfg, model = _model(preset)
    converted = [(n, lin) for n, lin in fp8_linears(model) if n.startswith("blocks.0.")]
    eligible = [x for x in block_matrices(cfg.model) if fp8_matrix(x)]
    assert sorted(n.removeprefix("blocks.0.") for n, _ in converted) == sorted(x.path for x in eligible)
    assert sorted((lin.in_features, lin.out_features) for _, lin in converted) == sorted(block_linear_shapes(cfg.model))


def test_the_estimators_fp8_products_are_the_eligible_matrices():
    from tokenmill.estimate.recorder import OpCost
    from tokenmill.estimate.techniques import fp8_linear_op

    cfg, _ = _model("llama3.2-1b")  # q 64 x 64, k and v 32 x 64 (separate), MLP 96 wide
    tokens = 40  # no matrix size

    def mm(*dims):
        return OpCost("mm", flops=2.0, dims=(1, *dims))

    assert fp8_linear_op(mm(tokens, 64, 96), cfg)  # forward of up: (tokens x in) @ (in x out)
    assert fp8_linear_op(mm(96, tokens, 64), cfg)  # its weight gradient
    assert not fp8_linear_op(mm(tokens, 64, 24), cfg)  # no such matrix (a LoRA-like skinny product)
    assert not fp8_linear_op(OpCost("bmm", flops=2.0, dims=(8, tokens, 16, tokens)), cfg)


def test_mfu_fp8_and_the_estimate_read_one_gpu_table(monkeypatch):
    import dataclasses

    from tokenmill.estimate.gpus import gpu_spec
    from tokenmill.model import gpus
    from tokenmill.model.flops import peak_flops
    from tokenmill.model.fp8 import fp8_peak_flops, has_fp8

    name = "NVIDIA H100 80GB HBM3"
    h100 = gpu_spec("h100-sxm")
    assert gpus.gpu_facts(name).key == "h100-sxm" and gpus.gpu_facts(name).memory_mb == h100.memory_mb
    assert peak_flops(name, "bf16") == h100.peak("bf16") == gpus.gpu_facts(name).peaks["bf16"] and h100.fp8
    row = gpus.gpu_facts(name)
    changed = dataclasses.replace(row, peaks={**row.peaks, "bf16": 1e15}, fp8=False)
    monkeypatch.setattr(gpus, "GPU_TABLE", tuple(changed if r is row else r for r in gpus.GPU_TABLE))
    assert peak_flops(name, "bf16") == 1e15  # MFU's peak
    assert h100.peak("bf16") == 1e15  # the estimator's
    assert not has_fp8(name) and not h100.fp8 and fp8_peak_flops(name) is None  # FP8's capability
    assert peak_flops("NVIDIA A100-SXM4-80GB MIG 1g.10gb", "bf16") is None  # a slice: no full-GPU peak
