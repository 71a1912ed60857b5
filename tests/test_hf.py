"""Hugging Face GPT-2 <-> tokenmill conversion (model/hf.py) and tokenizer export (data/tokenizers.py).

Every Hugging Face model here is a randomly initialised ``transformers.GPT2LMHeadModel`` built and
saved locally (no download); its parameters are perturbed so that biases and LayerNorm weights are
not the trivial 0/1 of a fresh init and a mapping mistake shows in the logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import config as C
from tokenmill.errors import CheckpointError
from tokenmill.model import GPT, hf

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tokenmill[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'tokenmill[hf]')")

V, BS, L, H, E = 61, 16, 2, 4, 32
ATOL = 1e-4


def hf_model(tie: bool = True, seed: int = 0, **kw) -> transformers.GPT2LMHeadModel:
    """A small random GPT-2 with every parameter perturbed (biases and LayerNorm weights included)."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=BS, n_embd=E, n_layer=L, n_head=H,
                                  tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **kw)
    m = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


def tm_model(tie: bool = True, fused: bool = True, pad: int = 1, seed: int = 0, **kw) -> GPT:
    """A small random tokenmill GPT, every parameter perturbed."""
    torch.manual_seed(seed)
    cfg = C.ModelConfig(vocab_size=V, block_size=BS, n_layer=L, n_head=H, n_embd=E, tie_embeddings=tie,
                        fused_qkv=fused, vocab_pad_multiple=pad, **kw)
    m = GPT(cfg, V)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m.eval()


def ids(B: int = 2, T: int = BS, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def tm_logits(m: GPT, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(x)[0]


def hf_logits(m, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return m(x).logits


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("fused,pad", [(True, 1), (False, 1), (True, 16), (False, 16)],
                         ids=["fused", "separate", "fused-padded", "separate-padded"])
def test_hf_folder_to_tokenmill_same_logits(tmp_path, tie, fused, pad):
    src = hf_model(tie)
    src.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    base = C.ModelConfig(fused_qkv=fused, vocab_pad_multiple=pad, attention="manual", n_layer=99)
    cfg, sd = hf.load_hf_gpt2(tmp_path, base)
    # shape from the source, the rest from base
    assert (cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (V, BS, L, H, E)
    assert cfg.tie_embeddings is tie and cfg.fused_qkv is fused and cfg.attention == "manual"
    m = GPT(cfg, cfg.vocab_size)
    m.load_state_dict(sd)  # strict: every name and shape matches
    m.eval()
    if pad > 1:
        assert m.padded_vocab == 64 and not m.wte.weight[V:].any()
    x = ids()
    torch.testing.assert_close(tm_logits(m, x), hf_logits(src, x), atol=ATOL, rtol=0)
    if not tie:  # the untied head really is the folder's lm_head, not the embedding
        assert not torch.equal(m.lm_head.weight[:V], m.wte.weight[:V])


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("fused,pad", [(True, 1), (False, 1), (True, 16), (False, 16)],
                         ids=["fused", "separate", "fused-padded", "separate-padded"])
def test_tokenmill_to_hf_folder_same_logits(tmp_path, tie, fused, pad):
    m = tm_model(tie, fused, pad)
    if pad > 1:
        with torch.no_grad():  # padding rows hold junk: export must cut them off
            m.lm_head.weight[V:] = 7.0
    out = hf.save_hf_gpt2(m.state_dict(), m.cfg, tmp_path / "hf", vocab_size=V, eot_id=V - 1)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    conf = json.loads((out / "config.json").read_text())
    assert conf["vocab_size"] == V and conf["tie_word_embeddings"] is tie and conf["eos_token_id"] == V - 1
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert (loaded.lm_head.weight is loaded.transformer.wte.weight) is tie
    x = ids()
    torch.testing.assert_close(hf_logits(loaded, x), tm_logits(m, x), atol=ATOL, rtol=0)


def test_round_trip_and_manual_forms(tmp_path):
    """HF -> tokenmill (manual norm/GELU/attention, separate qkv) -> HF gives the original logits."""
    src = hf_model(tie=False, seed=3)
    src.save_pretrained(tmp_path / "a")
    base = C.ModelConfig(norm="manual", gelu="manual", attention="manual", fused_qkv=False)
    cfg, sd = hf.load_hf_gpt2(tmp_path / "a", base)
    m = GPT(cfg, V)
    m.load_state_dict(sd)
    hf.save_hf_gpt2(m.state_dict(), cfg, tmp_path / "b")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "b").eval()
    x = ids(seed=5)
    torch.testing.assert_close(hf_logits(back, x), hf_logits(src, x), atol=ATOL, rtol=0)
    # exactly the same tensors after the round trip (transposes undone)
    for k, v in src.state_dict().items():
        if not k.endswith(".attn.bias"):
            assert torch.equal(back.state_dict()[k], v), k


def test_pytorch_model_bin_sharded_and_block_crop(tmp_path):
    src = hf_model(seed=4)
    torch.save(src.state_dict(), tmp_path / "pytorch_model.bin")
    src.config.to_json_file(tmp_path / "config.json")
    cfg, sd = hf.load_hf_gpt2(tmp_path, block_size=8)
    assert cfg.block_size == 8 and sd["wpe.weight"].shape == (8, E)
    m = GPT(cfg, V)
    m.load_state_dict(sd)
    m.eval()
    x = ids(T=8)
    torch.testing.assert_close(tm_logits(m, x), hf_logits(src, x), atol=ATOL, rtol=0)
    with pytest.raises(CheckpointError, match="exceeds the model's n_positions 16"):
        hf.load_hf_gpt2(tmp_path, block_size=32)
    # sharded safetensors (the index names the shards)
    shard = tmp_path / "sharded"
    src.save_pretrained(shard, max_shard_size="20KB")
    assert (shard / "model.safetensors.index.json").is_file()
    _, sd2 = hf.load_hf_gpt2(shard)
    assert sd2.keys() == hf.load_hf_gpt2(tmp_path)[1].keys()
    assert all(torch.equal(sd2[k], v) for k, v in hf.load_hf_gpt2(tmp_path)[1].items())


def test_original_gpt2_layout_without_prefix_and_with_mask_buffers(tmp_path):
    """The original GPT-2 checkpoints name weights without 'transformer.' and store each layer's
    causal mask ('h.N.attn.bias') and 'h.N.attn.masked_bias' buffers: names understood, buffers skipped."""
    src = hf_model(seed=6)
    sd = dict(src.transformer.state_dict())
    for i in range(L):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(BS, BS)).view(1, 1, BS, BS)
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    from safetensors.torch import save_file

    save_file(sd, str(tmp_path / "model.safetensors"))
    src.config.to_json_file(tmp_path / "config.json")
    cfg, tm_sd = hf.load_hf_gpt2(tmp_path)
    m = GPT(cfg, V)
    m.load_state_dict(tm_sd)
    m.eval()
    x = ids()
    torch.testing.assert_close(tm_logits(m, x), hf_logits(src, x), atol=ATOL, rtol=0)


class NotATensor:
    """An arbitrary pickled object: torch.load(weights_only=True) must refuse it."""


def test_pickled_objects_are_refused(tmp_path):
    src = hf_model()
    src.config.to_json_file(tmp_path / "config.json")
    torch.save({"weights": src.state_dict(), "note": NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"weights_only=True"):
        hf.load_hf_gpt2(tmp_path)


@pytest.mark.parametrize("change,match", [
    ({"activation_function": "gelu"}, "not the tanh-approximation GELU"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon is 1e-06"),
    ({"n_inner": 3 * E}, "n_inner is 96"),
    ({"scale_attn_by_inverse_layer_idx": True}, "attention scaling"),
    ({"model_type": "llama"}, "model_type is 'llama'"),
])
def test_hf_forms_tokenmill_cannot_compute_are_refused(tmp_path, change, match):
    src = hf_model()
    src.save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.update(change)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match=match):
        hf.load_hf_gpt2(tmp_path)


def test_weights_that_contradict_config_are_refused(tmp_path):
    hf_model().save_pretrained(tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["n_embd"], conf["n_head"] = 48, 4
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match=r"'wte.weight' has shape \(61, 32\), but config.json implies \(61, 48\)"):
        hf.load_hf_gpt2(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        hf.load_hf_gpt2(tmp_path)
    with pytest.raises(CheckpointError, match="config.json' is missing"):
        hf.load_hf_gpt2(tmp_path / "nowhere")


@pytest.mark.parametrize("kw,match", [
    ({"bias": False}, "model.bias=false"),
    ({"qkv_bias": False}, "model.qkv_bias=false"),
])
def test_export_refuses_forms_gpt2_cannot_express(tmp_path, kw, match):
    m = tm_model(**kw)
    with pytest.raises(CheckpointError, match=match):
        hf.save_hf_gpt2(m.state_dict(), m.cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_refuses_inconsistent_state_dict(tmp_path):
    m = tm_model(tie=True)
    sd = m.state_dict()
    sd["lm_head.weight"] = sd["lm_head.weight"].clone() + 1
    with pytest.raises(CheckpointError, match="differs from wte.weight"):
        hf.to_hf_state_dict(sd, m.cfg)
    sd = dict(m.state_dict(), extra_thing=torch.zeros(2))
    with pytest.raises(CheckpointError, match="no place for: extra_thing"):
        hf.to_hf_state_dict(sd, m.cfg)
    # compile / DDP prefixes are understood
    wrapped = {f"_orig_mod.{k}": v for k, v in m.state_dict().items()}
    assert hf.to_hf_state_dict(wrapped, m.cfg).keys() == hf.to_hf_state_dict(m.state_dict(), m.cfg).keys()


def test_hf_model_fields():
    """Every architecture field comes from the source (GPT-2's family: learned positions, LayerNorm 1e-5,
    GELU MLP of 4 * n_embd, as many k/v heads as query heads), so a run's preset cannot leave a
    rotary or RMSNorm choice on a GPT-2 model."""
    src = hf_model(tie=False)
    fields = hf.hf_model_fields(src.config.to_dict())
    assert set(fields) == set(C.shape_fields()) | {"block_size"}
    assert {k: fields[k] for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "qkv_bias",
                                   "tie_embeddings")} == {"vocab_size": V, "block_size": BS, "n_layer": L, "n_head": H,
                                                          "n_embd": E, "bias": True, "qkv_bias": True,
                                                          "tie_embeddings": False}
    assert (fields["pos_emb"], fields["norm_type"], fields["mlp"], fields["norm_eps"]) == ("learned", "layernorm",
                                                                                          "gelu", 1e-5)
    assert fields["n_kv_head"] is fields["head_dim"] is fields["intermediate_size"] is None
    assert fields["qk_norm"] is False
    # a rotary base config gets GPT-2's family back
    base = C.ModelConfig(pos_emb="rope", norm_type="rmsnorm", mlp="swiglu", n_kv_head=2, norm_eps=1e-6)
    cfg, _ = hf.from_hf_state_dict(src.state_dict(), src.config.to_dict(), base)
    assert (cfg.pos_emb, cfg.norm_type, cfg.mlp, cfg.kv_heads, cfg.norm_eps) == ("learned", "layernorm", "gelu", H, 1e-5)


@pytest.mark.parametrize("kw,match", [
    ({"norm_type": "rmsnorm"}, "model.norm_type='rmsnorm'"),
    ({"mlp": "swiglu"}, "model.mlp='swiglu'"),
    ({"norm_eps": 1e-6}, "model.norm_eps=1e-06"),
    ({"n_kv_head": 2}, "n_kv_head=2"),
    ({"intermediate_size": 3 * E}, "model.intermediate_size=96"),
])
def test_gpt2_export_refuses_other_families(tmp_path, kw, match):
    """A learned-position model with another family's part has no GPT-2 form: refused, not mis-written."""
    m = tm_model(**kw)
    with pytest.raises(CheckpointError, match=match):
        hf.save_hf(m.state_dict(), m.cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# Tokenizer files for an exported folder

TEXT = "def f(x):\n    return x ** 2  # carré, 日本\n\n\tclass A:  pass\n" * 20


def mini_tiktoken():
    """A small tiktoken Encoding trained here with GPT-2's split pattern (stands in for the real GPT-2
    BPE, whose files would have to be downloaded)."""
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is not installed")
    try:
        from tiktoken._educational import bpe_train
        from tiktoken_ext.openai_public import r50k_pat_str
    except ImportError:
        pytest.skip("this tiktoken has no tiktoken._educational.bpe_train to train a small encoding")
    ranks = bpe_train(TEXT[:3000] + "hello world, the quick brown fox" * 20, 290, r50k_pat_str, visualise=None)
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": len(ranks)})


def check_auto_tokenizer(folder, tok):
    """transformers.AutoTokenizer loads ``folder`` and gives tokenmill's ids and text back."""
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tok.encode(TEXT)
    assert auto(TEXT, add_special_tokens=False)["input_ids"] == ids
    assert auto.decode(ids) == TEXT
    if tok.eot_id is not None:
        assert auto.eos_token_id == tok.eot_id and auto.convert_tokens_to_ids("<|endoftext|>") == tok.eot_id


@pytest.mark.parametrize("name", ["bpe", "bytes", "gpt2"])
def test_tokenizer_files_for_data_folder(tmp_path, monkeypatch, name):
    from tokenmill.data import load_tokenizer_for_data, prepare
    from tokenmill.data import tokenizers as T

    if name == "gpt2":
        enc = mini_tiktoken()
        monkeypatch.setattr(T, "_load_tiktoken", lambda encoding_name: enc)
    (tmp_path / "t.txt").write_text(TEXT)
    data = prepare(tmp_path / "t.txt", tmp_path / "data", name, vocab_size=300, workers=1, progress=False)
    files, reason = T.write_hf_tokenizer_for_data(data, tmp_path / "hf", model_max_length=BS)
    assert reason is None and files == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["model_max_length"] == BS
    check_auto_tokenizer(tmp_path / "hf", load_tokenizer_for_data(data))


def test_tokenizer_files_say_why_not(tmp_path, monkeypatch):
    from tokenmill.data import prepare
    from tokenmill.data import tokenizers as T
    from tokenmill.errors import DataError

    enc = mini_tiktoken()
    monkeypatch.setattr(T, "_load_tiktoken", lambda encoding_name: enc)
    (tmp_path / "t.txt").write_text(TEXT)
    data = prepare(tmp_path / "t.txt", tmp_path / "data", "gpt2", workers=1, progress=False)

    def offline(encoding_name):
        raise DataError("tokenizer 'gpt2': tiktoken could not load its BPE files (TIKTOKEN_CACHE_DIR=<unset>)")

    monkeypatch.setattr(T, "_load_tiktoken", offline)  # as on a machine without tiktoken's cache
    files, reason = T.write_hf_tokenizer_for_data(data, tmp_path / "hf")
    assert files == [] and "TIKTOKEN_CACHE_DIR" in reason and not (tmp_path / "hf").exists()
    files, reason = T.write_hf_tokenizer_for_data(tmp_path / "nowhere", tmp_path / "hf")
    assert files == [] and "does not exist" in reason


def test_byte_table_is_hugging_face_byte_level_alphabet():
    from tokenizers import pre_tokenizers

    from tokenmill.data.tokenizers import bytes_to_unicode

    table = bytes_to_unicode()
    assert len(set(table.values())) == 256 and set(table.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    assert table[ord("A")] == "A" and table[ord(" ")] == "\u0120" and table[ord("\n")] == "\u010a"
