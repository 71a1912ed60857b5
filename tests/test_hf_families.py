"""Hugging Face Llama-family folders <-> tokenmill (model/hf_llama.py behind model/hf.py's dispatch):
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``MistralForCausalLM``.

Every Hugging Face model is a small random model built with ``transformers`` and saved here (no
download), every parameter perturbed (norm weights, biases and q/k norms included) so that a mapping
mistake shows in the logits; the reference is always transformers' own forward. Tokenizers are tiny
byte-level BPEs trained here with the ``tokenizers`` library and saved into the model folders.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import tiny_cfg
from tokenmill import checkpoint
from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.errors import CheckpointError, ConfigError
from tokenmill.model import GPT, hf
from tokenmill.train.trainer import train

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tokenmill[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'tokenmill[hf]')")

V, BS, L, E = 97, 32, 2, 32
ATOL = 1e-5  # fp32, same math in the same order up to summation order
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def perturbed(m):
    """Every parameter moved off its init (norm weights off 1, biases off 0), in eval mode."""
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


def hf_family(arch: str, vocab: int = V, seed: int = 0, **kw):
    """A small random ``arch`` model (2 layers, width 32, 4 query heads, MLP width 48, 64 positions)."""
    torch.manual_seed(seed)
    config_class = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    base = dict(vocab_size=vocab, hidden_size=E, intermediate_size=48, num_hidden_layers=L, num_attention_heads=4,
                max_position_embeddings=2 * BS, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "MistralForCausalLM":
        base["sliding_window"] = None
    return perturbed(getattr(transformers, arch)(config_class(**{**base, **kw})))


def tm_model(seed: int = 0, **kw) -> GPT:
    """A small random rotary tokenmill GPT (the Llama family's parts), every parameter perturbed."""
    torch.manual_seed(seed)
    base = dict(vocab_size=V, block_size=BS, n_layer=L, n_head=4, n_embd=E, intermediate_size=48, pos_emb="rope",
                norm_type="rmsnorm", mlp="swiglu", bias=False, qkv_bias=False, norm_eps=1e-6)
    cfg = C.ModelConfig(**{**base, **kw})
    return perturbed(GPT(cfg, cfg.vocab_size))


def ids(T: int = BS, vocab: int = V, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(seed))


def logits(m, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = m(x)
    return out.logits if hasattr(out, "logits") else out[0]


def edit_config(folder: Path, **changes) -> dict:
    conf = json.loads((folder / "config.json").read_text())
    conf.update(changes)
    (folder / "config.json").write_text(json.dumps(conf))
    return conf


# ----------------------------------------------------------------------------------------------
# Hugging Face -> tokenmill


FOLDERS = {
    "llama-tied-mha": ("LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-untied-gqa-llama3": ("LlamaForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False,
                                                         rope_theta=500000.0, rope_scaling=LLAMA3)),
    "llama-mqa-all-biases": ("LlamaForCausalLM", dict(num_key_value_heads=1, attention_bias=True, mlp_bias=True,
                                                      tie_word_embeddings=True)),
    "qwen2-qkv-bias-gqa": ("Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm-head-dim": ("Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                                                       rms_norm_eps=1e-5, rope_theta=1e6)),
    "qwen3-mqa-tied": ("Qwen3ForCausalLM", dict(num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)),
    "mistral-no-window": ("MistralForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(FOLDERS))
@pytest.mark.parametrize("fused,pad,shards", [(False, 1, False), (True, 16, True)],
                         ids=["separate", "fused-padded-sharded"])
def test_hf_folder_to_tokenmill_same_logits(tmp_path, name, fused, pad, shards):
    arch, kw = FOLDERS[name]
    src = hf_family(arch, **kw)
    src.save_pretrained(tmp_path, **({"max_shard_size": "20KB"} if shards else {}))
    assert (tmp_path / "model.safetensors.index.json").is_file() is shards
    assert hf.is_hf_folder(tmp_path) and hf.is_hf_folder(tmp_path, arch) and not hf.is_hf_gpt2_folder(tmp_path)
    base = C.ModelConfig(fused_qkv=fused, vocab_pad_multiple=pad, attention="manual", n_layer=99, pos_emb="learned")
    cfg, sd = hf.load_hf(tmp_path, base)
    # the architecture from the folder, the forms from base
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (V, 2 * BS, L, 4, E)
    assert (cfg.pos_emb, cfg.norm_type, cfg.mlp, cfg.fused_qkv, cfg.attention) == ("rope", "rmsnorm", "swiglu", fused,
                                                                                   "manual")
    assert cfg.kv_heads == kw["num_key_value_heads"] and cfg.tie_embeddings is kw["tie_word_embeddings"]
    assert cfg.head_width == kw.get("head_dim", E // 4) and cfg.qk_norm is arch.startswith("Qwen3")
    assert cfg.qkv_bias is (arch.startswith("Qwen2") or bool(kw.get("attention_bias")))
    assert cfg.bias is bool(kw.get("mlp_bias")) and cfg.rope_scaling == ("llama3" if "rope_scaling" in kw else "none")
    assert hf.hf_model_fields(hf.read_hf_config(tmp_path)) == {k: getattr(cfg, k) for k in [*C.shape_fields(), "block_size"]}
    m = GPT(cfg, cfg.vocab_size)
    m.load_state_dict(sd)  # strict: every name and shape
    m.eval()
    x = ids(2 * BS)
    torch.testing.assert_close(logits(m, x), logits(src, x), atol=ATOL, rtol=0)
    if not kw["tie_word_embeddings"]:  # the untied head really is the folder's lm_head
        assert not torch.equal(m.lm_head.weight[:V], m.wte.weight[:V])
    # a shorter context keeps the same function on it
    cfg16, sd16 = hf.load_hf(tmp_path, base, block_size=16)
    m16 = GPT(cfg16, V)
    m16.load_state_dict(sd16)
    torch.testing.assert_close(logits(m16.eval(), x[:, :16]), logits(src, x[:, :16]), atol=ATOL, rtol=0)
    with pytest.raises(CheckpointError, match=f"block_size 65 exceeds the model's max_position_embeddings {2 * BS}"):
        hf.load_hf(tmp_path, base, block_size=65)


def test_missing_keys_take_transformers_defaults(tmp_path):
    """A config.json that leaves keys out means transformers' defaults for its class (Mistral: 8 k/v heads,
    a 4096-token window, untied, eps 1e-6, theta 1e4): read the same way here and there."""
    src = hf_family("MistralForCausalLM", num_attention_heads=8, num_key_value_heads=8)
    src.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    for key in ("num_key_value_heads", "sliding_window", "tie_word_embeddings", "rms_norm_eps", "rope_parameters",
                "head_dim", "hidden_act", "attention_dropout"):
        conf.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    cfg, sd = hf.load_hf(tmp_path)
    assert (cfg.kv_heads, cfg.head_width, cfg.tie_embeddings, cfg.norm_eps, cfg.rope_theta) == (8, 4, False, 1e-6, 1e4)
    assert cfg.block_size == 2 * BS  # the default window (4096) is longer than the context: no limit
    m = GPT(cfg, V)
    m.load_state_dict(sd)
    reread = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = ids(2 * BS)
    torch.testing.assert_close(logits(m.eval(), x), logits(reread, x), atol=ATOL, rtol=0)


def test_sliding_windows_cap_the_context(tmp_path):
    """Mistral's window (or Qwen's, on the layers it covers) caps block_size: up to it tokenmill's full
    causal attention is the same function, beyond it the load stops with the field named."""
    src = hf_family("MistralForCausalLM", num_key_value_heads=2, sliding_window=16)
    src.save_pretrained(tmp_path / "m")
    assert hf.hf_model_fields(hf.read_hf_config(tmp_path / "m"))["block_size"] == 16
    cfg, sd = hf.load_hf(tmp_path / "m")
    assert cfg.block_size == 16
    m = GPT(cfg, V)
    m.load_state_dict(sd)
    x = ids(16)
    torch.testing.assert_close(logits(m.eval(), x), logits(src, x), atol=ATOL, rtol=0)
    with pytest.raises(CheckpointError, match="sliding_window is 16: MistralForCausalLM attends only to the last 16"):
        hf.load_hf(tmp_path / "m", block_size=32)
    # init_from: an explicit longer block_size names the window
    from tokenmill.train.init_from import adopt_shape, find_source

    cfg32 = C.resolve("tiny", overrides={"model.block_size": 32}, overrides_from_string=False)
    with pytest.raises(ConfigError, match="its sliding_window: MistralForCausalLM attends only to the last 16"):
        adopt_shape(cfg32, find_source(tmp_path / "m"), {"model.block_size"})
    assert adopt_shape(cfg32, find_source(tmp_path / "m"), set()).model.block_size == 16

    hf_family("Qwen2ForCausalLM", num_key_value_heads=2).save_pretrained(tmp_path / "q")
    edit_config(tmp_path / "q", use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None)
    assert hf.hf_model_fields(hf.read_hf_config(tmp_path / "q"))["block_size"] == 8  # layer 1 slides
    edit_config(tmp_path / "q", max_window_layers=L)  # no layer slides
    assert hf.hf_model_fields(hf.read_hf_config(tmp_path / "q"))["block_size"] == 2 * BS
    edit_config(tmp_path / "q", layer_types=["full_attention", "sliding_attention"])  # layer_types decide
    assert hf.hf_model_fields(hf.read_hf_config(tmp_path / "q"))["block_size"] == 8
    edit_config(tmp_path / "q", use_sliding_window=False)
    assert hf.hf_model_fields(hf.read_hf_config(tmp_path / "q"))["block_size"] == 2 * BS


@pytest.mark.parametrize("arch,change,match", [
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type 'linear'"),
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     "rope_parameters' has rope_type 'yarn'"),
    ("LlamaForCausalLM", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "one rotary embedding for every layer"),
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}},
     "lacks 'low_freq_factor'"),
    ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor is 0.5"),
    ("LlamaForCausalLM", {"mlp_bias": True}, "attention_bias is false but mlp_bias is true"),
    ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias is true but mlp_bias is false"),
    ("LlamaForCausalLM", {"attention_dropout": 0.1}, "attention_dropout is 0.1"),
    ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
    ("LlamaForCausalLM", {"vocab_size": None}, "'vocab_size' is null"),
    ("LlamaForCausalLM", {"rms_norm_eps": None}, "'rms_norm_eps' is null"),
    ("LlamaForCausalLM", {"num_hidden_layers": 2.5}, "'num_hidden_layers' must be a positive integer, got 2.5"),
    ("LlamaForCausalLM", {"num_key_value_heads": 3}, r"num_key_value_heads \(3\) must divide"),
    ("LlamaForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2}, "'num_local_experts' is 8: a mixture"),
    ("LlamaForCausalLM", {"quantization_config": {"quant_method": "bitsandbytes"}}, "'quantization_config' is"),
    ("LlamaForCausalLM", {"architectures": ["GemmaForCausalLM"]}, r"architectures is \['GemmaForCausalLM'\]"),
    ("LlamaForCausalLM", {"model_type": "qwen2"}, "model_type is 'qwen2' but architectures names LlamaForCausalLM"),
    ("LlamaForCausalLM", {"architectures": None, "model_type": "phi3"}, "model_type is 'phi3'"),
    ("Qwen2ForCausalLM", {"rope_theta": None, "rope_parameters": None}, "'rope_theta' is null"),
    ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias is true: Qwen3"),
    ("Qwen3ForCausalLM", {"head_dim": None}, "'head_dim' is null"),
    ("MistralForCausalLM", {"max_position_embeddings": None}, "'max_position_embeddings' is null"),
])
def test_what_tokenmill_cannot_compute_is_refused(tmp_path, arch, change, match):
    hf_family(arch, num_key_value_heads=2).save_pretrained(tmp_path)
    edit_config(tmp_path, **change)
    with pytest.raises(CheckpointError, match=match):
        hf.load_hf(tmp_path)
    from tokenmill.train.init_from import find_source

    with pytest.raises(CheckpointError, match=match):  # train.init_from refuses before reading weights
        find_source(tmp_path)


def test_weights_that_contradict_the_config_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_family("LlamaForCausalLM", num_key_value_heads=2).save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    edit_config(tmp_path, intermediate_size=64)
    with pytest.raises(CheckpointError, match=r"'layers.0.self_attn.q_proj.weight'|'layers.0.mlp.gate_proj.weight' "
                                              r"has shape \(48, 32\), but config.json implies \(64, 32\)"):
        hf.load_hf(tmp_path)
    edit_config(tmp_path, intermediate_size=48)
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="tie_word_embeddings is false but 'lm_head.weight' is missing"):
        hf.load_hf(tmp_path)
    save_file({**weights, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not have: layers.0.mlp.extra.weight"):
        hf.load_hf(tmp_path)
    # stored rotary buffers of old checkpoints are not weights
    save_file({**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)},
              str(tmp_path / "model.safetensors"))
    hf.load_hf(tmp_path)


# ----------------------------------------------------------------------------------------------
# tokenmill -> Hugging Face


EXPORTS = {
    "llama-untied-gqa-llama3": ("LlamaForCausalLM", dict(n_kv_head=2, tie_embeddings=False, rope_theta=5e5,
                                                         rope_scaling="llama3", rope_factor=8.0, rope_original_context=16)),
    "llama-all-biases-mqa-padded": ("LlamaForCausalLM", dict(n_kv_head=1, bias=True, qkv_bias=True,
                                                             vocab_pad_multiple=16, fused_qkv=True)),
    "qwen2-qkv-bias": ("Qwen2ForCausalLM", dict(n_kv_head=2, qkv_bias=True, tie_embeddings=True)),
    "qwen3-qknorm-head-dim": ("Qwen3ForCausalLM", dict(n_kv_head=2, qk_norm=True, head_dim=16, fused_qkv=True,
                                                       tie_embeddings=False, norm="manual")),
    "mistral-heads-not-dividing-width": ("MistralForCausalLM", dict(n_head=3, n_kv_head=1, head_dim=8)),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_tokenmill_to_hf_folder_same_logits(tmp_path, name):
    arch, kw = EXPORTS[name]
    m = tm_model(**kw)
    if m.padded_vocab > V:
        with torch.no_grad():  # padding rows hold junk: the export must cut them off
            m.lm_head.weight[V:] = 7.0
    assert hf.export_architecture(m.cfg) == arch
    out = hf.save_hf(m.state_dict(), m.cfg, tmp_path / "hf", vocab_size=V, eot_id=V - 1)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [arch] and conf["vocab_size"] == V and conf["eos_token_id"] == V - 1
    assert conf["max_position_embeddings"] == BS and conf["tie_word_embeddings"] is m.cfg.tie_embeddings
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == arch
    x = ids()
    torch.testing.assert_close(logits(loaded, x), logits(m, x), atol=ATOL, rtol=0)
    # and back: the same tokenmill fields
    cfg, _ = hf.load_hf(out)
    assert {k: getattr(cfg, k) for k in C.shape_fields()} == {k: getattr(m.cfg, k) for k in C.shape_fields()} | {
        "n_kv_head": m.cfg.kv_heads, "head_dim": m.cfg.head_width, "intermediate_size": m.cfg.mlp_width}


def test_round_trip_keeps_the_source_class_and_tensors(tmp_path):
    """Mistral -> tokenmill (fused, padded) -> Mistral again when the source's config is given, with the
    source's token ids and exactly its tensors; without it the same model is written as Llama."""
    src = hf_family("MistralForCausalLM", num_key_value_heads=2, bos_token_id=1, eos_token_id=2)
    src.save_pretrained(tmp_path / "a")
    cfg, sd = hf.load_hf(tmp_path / "a", C.ModelConfig(fused_qkv=True, vocab_pad_multiple=64))
    m = GPT(cfg, V)
    m.load_state_dict(sd)
    like = hf.read_hf_config(tmp_path / "a")
    hf.save_hf(m.state_dict(), cfg, tmp_path / "b", like=like)
    conf = json.loads((tmp_path / "b" / "config.json").read_text())
    assert conf["architectures"] == ["MistralForCausalLM"] and conf["sliding_window"] is None
    assert (conf["bos_token_id"], conf["eos_token_id"]) == (1, 2)
    back = transformers.MistralForCausalLM.from_pretrained(tmp_path / "b").eval()
    for k, v in src.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    hf.save_hf(m.state_dict(), cfg, tmp_path / "c")
    as_llama = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "c").eval()
    assert type(as_llama).__name__ == "LlamaForCausalLM"
    x = ids()
    torch.testing.assert_close(logits(as_llama, x), logits(src, x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kw,match", [
    (dict(norm_type="layernorm"), "model.norm_type='layernorm'"),
    (dict(mlp="gelu"), "model.mlp='gelu'"),
    (dict(qk_norm=True, qkv_bias=True), r"Qwen3ForCausalLM holds \(bias=false, qkv_bias=false, qk_norm=true\)"),
    (dict(bias=True, qkv_bias=False), "this model has model.bias=true, model.qkv_bias=false"),
    (dict(bias=True, qkv_bias=True, n_head=3, head_dim=8), "LlamaConfig needs hidden_size divisible"),
])
def test_export_refuses_what_no_class_expresses(tmp_path, kw, match):
    m = tm_model(**kw)
    with pytest.raises(CheckpointError, match=match):
        hf.save_hf(m.state_dict(), m.cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("extra,arch", [({}, "LlamaForCausalLM"),
                                        ({"model.qk_norm": True, "model.head_dim": 16}, "Qwen3ForCausalLM")])
def test_export_of_a_run_trained_from_scratch(tmp_path, capsys, extra, arch):
    """``tokenmill export`` of a rotary run (the tiny-llama preset) picks the class that holds it."""
    cfg = C.resolve("tiny-llama", overrides={"data.source": "synthetic", "model.vocab_size": 64, "train.device": "cpu",
                                             "train.max_steps": 1, "train.eval_batches": 0, **extra},
                    overrides_from_string=False)
    train(cfg, tmp_path / "r", quiet=True)
    assert main(["export", "--run-dir", str(tmp_path / "r"), "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["architectures"] == [arch]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o").eval()
    model, _, _ = checkpoint.load_model(tmp_path / "r")
    x = ids(T=32, vocab=64)
    torch.testing.assert_close(logits(loaded, x), logits(model.eval(), x), atol=ATOL, rtol=0)
    assert main(["export", "--run-dir", str(tmp_path / "r"), "--out", str(tmp_path / "o")]) == 1  # not overwritten
    assert "not empty" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Tokenizers and the command line

TEXT = "def area(r):\n    return 3.14 * r ** 2  # aire du cercle, 円の面積\n\nclass Point:\n    x: int = 0\n" * 40
NEW = "def volume(r, h):\n    return area(r) * h  # volume du cylindre, 円柱\n\nprint(volume(2, 3))\n" * 30
TRAIN = ["--train.device", "cpu", "--log.progress", "plain", "--log.tensorboard", "false", "--model.block_size", "32",
         "--train.batch_size", "2", "--train.eval_batches", "1", "--optim.warmup_steps", "1"]
# class, its settings, special tokens (first = bos), eos, extra embedding rows beyond the tokenizer's ids
FAMILIES = {
    "llama": ("LlamaForCausalLM", dict(num_key_value_heads=2, rope_theta=5e5, rope_scaling=LLAMA3,
                                       tie_word_embeddings=True), ["<s>", "</s>"], "</s>", 0),
    "qwen2": ("Qwen2ForCausalLM", dict(num_key_value_heads=1, tie_word_embeddings=False),
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", 0),
    "qwen3": ("Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
              ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", 11),
    "mistral": ("MistralForCausalLM", dict(num_key_value_heads=2), ["<unk>", "<s>", "</s>"], "</s>", 0),
}


def source_and_data(tmp_path: Path, name: str = "llama"):
    """A random ``name`` folder in ``tmp_path/src`` and NEW prepared with its tokenizer in ``tmp_path/data``
    through the CLI (the start of every fine-tuning walk); returns (source, its tokenizer)."""
    from tokenmill.cli import main

    src = tmp_path / "src"
    tok = hf_folder(src, name)
    (tmp_path / "new.txt").write_text(NEW)
    assert main(["prepare", str(tmp_path / "new.txt"), "--out", str(tmp_path / "data"), "--tokenizer-from", str(src),
                 "--no-progress", "--workers", "1"]) == 0
    return src, tok


def hf_folder(folder: Path, name: str, seed: int = 0):
    """A random ``name`` model of a tiny BPE's vocabulary (plus extra embedding rows, as Qwen pads its
    own), saved in shards with the tokenizer files; returns the ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    arch, kw, specials, eos, extra = FAMILIES[name]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT, NEW], trainer=trainer)
    ids_ = {"bos_token_id": tok.token_to_id(specials[0]), "eos_token_id": tok.token_to_id(eos)}
    model = hf_family(arch, vocab=tok.get_vocab_size() + extra, seed=seed, **kw, **ids_)
    model.save_pretrained(folder, max_shard_size="100KB")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": eos}))
    return tok


@pytest.mark.parametrize("name,eot", [("llama", "</s>"), ("qwen2", "<|endoftext|>")])
def test_tokenizer_from_a_family_folder_ends_documents_with_its_eos(tmp_path, name, eot):
    """``prepare --tokenizer-from`` a Llama folder separates documents with its '</s>' (from config.json),
    a Qwen folder with its '<|endoftext|>'; the prepared folder's tokenizer keeps that id."""
    from tokenmill.data import load_tokenizer_for_data
    from tokenmill.data.prepare_cli import tokenizer_from

    tok = hf_folder(tmp_path / "src", name)
    want = tok.token_to_id(eot)
    assert tokenizer_from(tmp_path / "src").eot_id == want
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text(NEW)
    (tmp_path / "docs" / "b.txt").write_text(TEXT)
    assert main(["prepare", str(tmp_path / "docs"), "--out", str(tmp_path / "data"), "--tokenizer-from",
                 str(tmp_path / "src"), "--no-progress", "--workers", "1", "--val-fraction", "0"]) == 0
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    assert meta["tokenizer"]["eot_id"] == want and meta["vocab_size"] == tok.get_vocab_size()
    train_ids = np.fromfile(tmp_path / "data" / "train.bin", dtype=meta["dtype"])
    assert train_ids.tolist() == tok.encode(NEW).ids + [want] + tok.encode(TEXT).ids + [want]
    assert load_tokenizer_for_data(tmp_path / "data").eot_id == want


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_prepare_train_sample_eval_export_through_the_cli(tmp_path, capsys, name):
    """The whole fine-tuning path for each family: prepare with the folder's tokenizer, 3 steps from its
    weights, sample, eval (against transformers on the same windows), export as the source's class;
    transformers gives the trained tokenmill model's logits."""
    arch = FAMILIES[name][0]
    src = tmp_path / "src"
    tok = hf_folder(src, name)
    assert (src / "model.safetensors.index.json").is_file()
    (tmp_path / "new.txt").write_text(NEW)
    assert main(["prepare", str(tmp_path / "new.txt"), "--out", str(tmp_path / "data"), "--tokenizer-from", str(src),
                 "--no-progress", "--workers", "1"]) == 0
    run = tmp_path / "run"
    assert main(["train", "--train.init_from", str(src), "--data.path", str(tmp_path / "data"), "--run-dir", str(run),
                 "--train.max_steps", "3", "--log.every_steps", "1", "--optim.lr", "1e-2", *TRAIN]) == 0
    assert f"fine-tuning from the Hugging Face {arch} folder" in capsys.readouterr().out
    model, cfg, _ = checkpoint.load_model(run)
    model.eval()
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    assert (cfg.model.vocab_size, cfg.model.block_size, cfg.model.pos_emb) == (vocab, 32, "rope")
    x = ids(T=32, vocab=tok.get_vocab_size())
    original = logits(transformers.AutoModelForCausalLM.from_pretrained(src).eval(), x)
    assert (logits(model, x) - original).abs().max() > 1e-2  # training changed the model

    assert main(["sample", "--run-dir", str(run), "--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    assert main(["eval", "--run-dir", str(run), "--device", "cpu", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)

    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "out")]) == 0
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((src / "config.json").read_text())
    assert conf["architectures"] == [arch] and conf["eos_token_id"] == source["eos_token_id"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported).__name__ == arch
    torch.testing.assert_close(logits(exported, x), logits(model, x), atol=ATOL, rtol=0)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert auto.decode(auto(NEW[:200], add_special_tokens=False)["input_ids"]) == NEW[:200]

    # eval's loss is transformers' on the same consecutive windows of the val split
    meta = json.loads((tmp_path / "data" / "meta.json").read_text())
    val = np.fromfile(tmp_path / "data" / "val.bin", dtype=meta["dtype"]).astype(np.int64)
    nats = 0.0
    with torch.no_grad():
        for s in range(0, len(val) - 1, 32):
            w = torch.from_numpy(val[s : s + 33])[None]
            nats += torch.nn.functional.cross_entropy(exported(w[:, :-1]).logits[0], w[0, 1:], reduction="sum").item()
    assert r["tokens"] == len(val) - 1 and r["val_loss"] == pytest.approx(nats / r["tokens"], rel=1e-5)
    assert math.isfinite(r["bits_per_byte"])


@pytest.mark.slow
def test_init_from_a_family_folder_with_the_python_api(tmp_path):
    """``train()`` with train.init_from: the shape comes from the folder; 0 steps saves the converted
    model, whose logits are transformers'."""
    src = hf_family("Qwen3ForCausalLM", vocab=64, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    src.save_pretrained(tmp_path / "q")
    cfg = tiny_cfg(**{"train.init_from": str(tmp_path / "q"), "train.max_steps": 0,
                      "train.eval_batches": 0})
    with pytest.raises(ConfigError, match="conflicts with train.init_from the Hugging Face Qwen3ForCausalLM folder"):
        train(cfg, tmp_path / "bad", quiet=True)  # tiny's 2 heads: an explicit (non-default) choice
    cfg = C.resolve(None, overrides={"data.source": "synthetic", "model.vocab_size": 64, "train.device": "cpu",
                                     "train.init_from": str(tmp_path / "q"), "train.max_steps": 0,
                                     "train.eval_batches": 0, "model.block_size": 32}, overrides_from_string=False)
    train(cfg, tmp_path / "r", quiet=True)
    model, run_cfg, _ = checkpoint.load_model(tmp_path / "r")
    assert (run_cfg.model.qk_norm, run_cfg.model.head_dim, run_cfg.model.n_kv_head) == (True, 16, 2)
    x = ids(T=32, vocab=64)
    torch.testing.assert_close(logits(model.eval(), x), logits(src, x), atol=ATOL, rtol=0)


@pytest.mark.slow
def test_readme_llama_finetuning_walkthrough_works_as_written(tmp_path, monkeypatch, capsys):
    """Every command of the README's Llama-family walkthrough, in a fresh folder holding what it starts
    from (a tiny random Llama folder as ``models/llama-3.2-1b``, text in ``my_texts/``); only the training
    length, context and batch are cut (appended overrides) to keep it fast."""
    import shlex

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    body = text.split("<!-- finetune-llama-example:start -->", 1)[1].split("<!-- finetune-llama-example:end -->")[0]
    code = body.split("```bash", 1)[1].split("```", 1)[0]
    lines = [ln for ln in code.replace("\\\n", " ").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    commands = [shlex.split(ln, comments=True) for ln in lines]
    assert [c[1] for c in commands] == ["prepare", "train", "eval", "sample", "export"]
    hf_folder(tmp_path / "models" / "llama-3.2-1b", "llama")
    (tmp_path / "my_texts").mkdir()
    (tmp_path / "my_texts" / "a.txt").write_text(NEW)
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        if argv[1] == "train":
            argv += ["--train.max_steps", "2", "--model.block_size", "32", "--train.batch_size", "2",
                     "--train.device", "cpu", "--train.eval_batches", "1"]
        if argv[1] in ("eval", "sample"):
            argv += ["--device", "cpu"]
        assert main(argv[1:]) == 0, argv
    assert "perplexity" in capsys.readouterr().out
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama-ft")
    assert type(exported).__name__ == "LlamaForCausalLM"
