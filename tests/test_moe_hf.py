"""Hugging Face mixture-of-experts folders <-> tokenmill (model/hf_moe.py behind hf_llama's dispatch):
``MixtralForCausalLM``, ``Qwen3MoeForCausalLM`` and ``Qwen2MoeForCausalLM``. Every folder is a small
random model built by ``transformers`` and saved here (no download), every parameter perturbed; the
reference is transformers' own forward, within 1e-5 in fp32."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import checkpoint
from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.errors import CheckpointError
from tokenmill.model import GPT, hf
from tokenmill.model.moe import MoE
from tokenmill.train.metrics import read_metrics

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tokenmill[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'tokenmill[hf]')")

V, BS = 97, 32
ATOL = 1e-5
BASE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2 * BS, bos_token_id=None, eos_token_id=None, pad_token_id=None)
FOLDERS = {  # class, its settings, (experts, top-k, sparse layers)
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=None), [0, 1, 2]),
    "qwen3_moe-renorm-step2": ("Qwen3MoeForCausalLM", dict(intermediate_size=40, moe_intermediate_size=16, num_experts=6,
                                                           num_experts_per_tok=3, norm_topk_prob=True, head_dim=16,
                                                           decoder_sparse_step=2, tie_word_embeddings=True), [1]),
    "qwen3_moe-dense-layer": ("Qwen3MoeForCausalLM", dict(intermediate_size=40, moe_intermediate_size=16, num_experts=5,
                                                          num_experts_per_tok=2, norm_topk_prob=False,
                                                          mlp_only_layers=[1]), [0, 2]),
    "olmoe": ("OlmoeForCausalLM", dict(intermediate_size=16, num_experts=4, num_experts_per_tok=2), [0, 1, 2]),
    "qwen2_moe-shared": ("Qwen2MoeForCausalLM", dict(intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                                                     num_experts_per_tok=2, shared_expert_intermediate_size=24), [0, 1, 2]),
}


def hf_moe(arch: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    m = getattr(transformers, arch)(config_class(**{**BASE, **kw}))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


def ids(T: int = BS, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(seed))


def logits(m, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = m(x)
    return out.logits if hasattr(out, "logits") else out[0]


@pytest.mark.parametrize("name", list(FOLDERS))
def test_moe_folder_in_and_out_same_logits(tmp_path, name):
    """HF folder -> tokenmill (same logits, same routing layers) -> HF folder of the same class (same
    logits, the source's tensors exactly)."""
    arch, kw, sparse = FOLDERS[name]
    src = hf_moe(arch, **kw)
    src.save_pretrained(tmp_path / "src")
    cfg, sd = hf.load_hf(tmp_path / "src", base=C.ModelConfig(fused_qkv=name.startswith(("q", "o"))))
    model = GPT(cfg, cfg.vocab_size)
    model.load_state_dict(sd)
    model.eval()
    assert [i for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)] == sparse
    x = ids()
    torch.testing.assert_close(logits(model, x), logits(src, x), atol=ATOL, rtol=0)

    like = json.loads((tmp_path / "src" / "config.json").read_text())
    assert hf.export_architecture(cfg) == arch
    hf.save_hf(model.state_dict(), cfg, tmp_path / "out", like=like)
    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(out).__name__ == arch
    torch.testing.assert_close(logits(out, x), logits(src, x), atol=ATOL, rtol=0)
    for (k, a), b in zip(src.state_dict().items(), out.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("change, match", [
    (dict(router_jitter_noise=0.1), r"router_jitter_noise is 0\.1"),
    (dict(num_experts_per_tok=7), r"num_experts_per_tok \(7\) exceeds num_local_experts \(5\)"),
    (dict(mlp_only_layers=[3]), r"mlp_only_layers is \[3\]"),
    (dict(first_k_dense_replace=1), r"'first_k_dense_replace' is 1: not a field"),
    (dict(qkv_bias=False, architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe",
          shared_expert_intermediate_size=8), r"qkv_bias is false"),
])
def test_what_tokenmill_cannot_compute_is_refused(tmp_path, change, match):
    src = hf_moe("Qwen3MoeForCausalLM", **FOLDERS["qwen3_moe-dense-layer"][1])
    src.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**conf, **change}))
    with pytest.raises(CheckpointError, match=match):
        hf.load_hf(tmp_path)


@pytest.mark.parametrize("kw, match", [
    (dict(moe_router="topk-softmax"), r"moe_router='topk-softmax'"),
    (dict(moe_router="softmax-topk", moe_shared_experts=1), r"Qwen2MoeForCausalLM holds .*qkv_bias=true"),
    (dict(moe_every=2), r"MixtralForCausalLM has experts in every layer"),
])
def test_export_refuses_what_no_class_holds(kw, match):
    cfg = C.ModelConfig(vocab_size=V, block_size=BS, n_layer=2, n_head=4, n_embd=32, pos_emb="rope", norm_type="rmsnorm",
                        mlp="swiglu", bias=False, qkv_bias=False, moe_experts=4, moe_top_k=2, **kw)
    with pytest.raises(CheckpointError, match=match):
        hf.export_architecture(cfg)


@pytest.mark.slow
def test_init_from_train_export_through_the_cli(tmp_path, capsys):
    """A Qwen3-MoE folder: 3 training steps from its weights through the CLI (router losses on, their
    numbers logged), export as Qwen3-MoE: transformers gives the trained model's logits."""
    arch, kw, _ = FOLDERS["qwen3_moe-dense-layer"]
    src = hf_moe(arch, **kw)
    src.save_pretrained(tmp_path / "src")
    run = tmp_path / "run"
    assert main(["train", "--train.init_from", str(tmp_path / "src"), "--data.source", "synthetic", "--model.vocab_size", str(V),
                 "--run-dir", str(run), "--train.max_steps", "3", "--log.every_steps", "1", "--optim.lr", "1e-2",
                 "--train.device", "cpu", "--log.progress", "plain", "--log.tensorboard", "false",
                 "--model.block_size", "32", "--train.batch_size", "2", "--train.eval_batches", "1",
                 "--optim.warmup_steps", "1", "--model.moe_z_loss_coef", "0.001"]) == 0
    assert "expert load" in capsys.readouterr().out
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert len(rows) == 3 and all({"moe_load_0", "moe_load_2"} <= set(r) and r["moe_load_max"] >= 1 and r["moe_aux_loss"] > 0
                                  for r in rows)
    model, cfg, _ = checkpoint.load_model(run)
    model.eval()
    x = ids()
    assert (cfg.model.moe_experts, cfg.model.moe_dense_layers) == (5, "1")
    assert (logits(model, x) - logits(src, x)).abs().max() > 1e-2  # training changed the model
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "out")]) == 0
    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(out).__name__ == arch
    torch.testing.assert_close(logits(out, x), logits(model, x), atol=ATOL, rtol=0)


def test_folder_written_by_hand_takes_transformers_defaults(tmp_path):
    """A Mixtral config.json with only its shape: the missing keys take MixtralConfig's defaults (rms eps
    1e-5, rope theta 1e6, 8 experts, 2 per token)."""
    src = hf_moe("MixtralForCausalLM", **FOLDERS["mixtral"][1])
    src.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    keep = ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "num_local_experts", "max_position_embeddings")
    (tmp_path / "config.json").write_text(json.dumps({k: conf[k] for k in keep}))
    cfg = hf.load_hf(tmp_path)[0]
    d = transformers.MixtralConfig()
    assert (cfg.norm_eps, cfg.rope_theta, cfg.moe_top_k) == (d.rms_norm_eps, d.rope_parameters["rope_theta"],
                                                             d.num_experts_per_tok)


def test_transformers_5_stacked_expert_names_are_read(tmp_path):
    """A folder holding the experts as transformers 5 keeps them in memory (``experts.gate_up_proj``,
    ``experts.down_proj``) loads to the same model as the per-expert files transformers writes."""
    from safetensors.torch import save_file

    arch, kw, _ = FOLDERS["qwen3_moe-dense-layer"]
    src = hf_moe(arch, **kw)
    src.save_pretrained(tmp_path)
    per_expert = hf.load_hf(tmp_path)[1]
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    cfg, stacked = hf.load_hf(tmp_path)
    assert "model.layers.0.mlp.experts.gate_up_proj" in src.state_dict()
    assert stacked.keys() == per_expert.keys() and all(torch.equal(stacked[k], per_expert[k]) for k in stacked)


def test_generation_with_the_kv_cache_equals_without():
    """Sampling a MoE model (greedy): the KV-cache path (one new token at a time through the experts) gives
    the tokens of the full recomputation."""
    cfg = C.resolve("tiny-moe", overrides={"model.vocab_size": str(V)}).model
    torch.manual_seed(0)
    model = GPT(cfg, V)
    x = ids(T=5)
    a = model.generate(x, 12, temperature=0, use_cache=True)
    b = model.generate(x, 12, temperature=0, use_cache=False)
    assert a.shape == (2, 17) and torch.equal(a, b)
