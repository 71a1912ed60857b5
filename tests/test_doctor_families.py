"""``tokenmill doctor`` on Llama-family runs: the rules name the family's own forms (a hand-written RMSNorm,
grouped key/value heads, a declared head width) and suggest only switches that exist for it.

Recorded inputs (facts, run directories written by hand) check what each rule says; one CPU profile of
the tiny Llama through the CLI checks the whole path. Nothing here judges the machine's speed: the
assertions are on which findings and suggestions appear, operator counts and FLOP shares."""

from __future__ import annotations

import contextlib
import io
import json
import shlex

import pytest

from conftest import tiny_cfg
from test_doctor import PLANTED, PLANTED_CUDA, cuda_facts, facts, write_run
from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.model.flops import flop_params, flops_per_token
from tokenmill.profiling import rules
from tokenmill.profiling.doctor import gather_facts, layer_form_ops, load_run, rank


def llama_cfg(**overrides) -> C.Config:
    """The tiny Llama (RoPE, RMSNorm, SwiGLU, 4 query heads sharing 2 key/value heads, separate q/k/v)."""
    return tiny_cfg(**{"model.pos_emb": "rope", "model.norm_type": "rmsnorm", "model.mlp": "swiglu",
                       "model.n_head": 4, "model.n_kv_head": 2, "model.intermediate_size": 64, "model.bias": False,
                       "model.qkv_bias": False, "model.fused_qkv": False, **overrides})


def flat(cfg: C.Config) -> dict:
    return C.flatten(cfg.to_dict())


def switches(finding) -> list[str]:
    return [s["switch"] or "" for s in finding["suggestions"]]


def by_key(found) -> dict:
    return {f["key"]: f for f in found}


NAIVE = {"model.norm": "manual", "model.gelu": "manual", "model.attention": "manual"}


# ------------------------------------------------------------------------------------------------
# Hand-written layers


def test_hand_written_rmsnorm_is_named_as_such_and_native_suggested_on_cuda():
    """A CUDA run of a Llama with a hand-written RMSNorm and separate q/k/v: the finding names the RMSNorm
    (not a LayerNorm), suggests nn.RMSNorm (there is no Triton RMSNorm) and the fused projection, and
    leaves the GELU switch out (a SwiGLU model has no GELU)."""
    config = flat(llama_cfg(**NAIVE))
    counts = layer_form_ops(config, cuda=True)
    assert set(counts) == {"model.norm", "model.fused_qkv"}  # no model.gelu: SwiGLU
    assert all(c["extra"] > 0 for c in counts.values())
    f = cuda_facts(config=config, layer_forms=counts, forward_share=0.3, backward_share=0.6, gemm_share=0.2)
    found = by_key(rank(f))["layer_forms"]
    assert switches(found) == ["--model.norm native", "--model.fused_qkv true"]
    text = " ".join(found["evidence"] + [s["why"] for s in found["suggestions"]])
    assert "hand-written RMSNorm" in text and "LayerNorm" not in text and "nn.RMSNorm" in text
    assert "4 query and 2 key/value heads" in text and "(4 + 2 + 2 heads)" in text
    assert found["title"] == "hand-written layers: norm, fused_qkv as many small operators"
    assert "triton" not in " ".join(switches(found)) and "gelu" not in found["title"]


def test_on_a_cpu_the_hand_written_rmsnorm_costs_nothing_and_is_not_blamed():
    """On a CPU nn.RMSNorm dispatches the same operators as the hand-written module (no fused CPU
    kernel): counted on the model, the norm adds no operator there, so only the q/k/v form is named."""
    config = flat(llama_cfg(**NAIVE))
    cpu, cuda = layer_form_ops(config), layer_form_ops(config, cuda=True)
    assert cpu["model.norm"]["extra"] == 0 < cuda["model.norm"]["extra"]
    assert cpu["model.fused_qkv"] == cuda["model.fused_qkv"]  # matrix products: the same on both
    found = by_key(rank(facts(config=config, layer_forms=cpu, forward_share=0.3, backward_share=0.6)))
    assert switches(found["layer_forms"]) == ["--model.fused_qkv true"]
    only_norm = flat(llama_cfg(**{"model.norm": "manual", "model.fused_qkv": True}))
    assert rules.slow_forms(only_norm) == ["model.norm"]
    f = facts(config=only_norm, layer_forms=layer_form_ops(only_norm), forward_share=0.3, backward_share=0.6)
    assert "layer_forms" not in by_key(rank(f))


def test_gpt2_forms_are_still_named_as_before():
    """The same rule on GPT-2: LayerNorm and GELU, both with their native kernels."""
    config = flat(tiny_cfg(**NAIVE))
    assert rules.slow_forms(config) == ["model.norm", "model.gelu"]
    counts = layer_form_ops(config)
    assert counts == layer_form_ops(config, cuda=True)  # no RMSNorm: the device changes nothing
    found = by_key(rank(facts(config=config, layer_forms=counts, forward_share=0.3, backward_share=0.6)))
    assert switches(found["layer_forms"]) == ["--model.norm native", "--model.gelu native"]
    assert "hand-written LayerNorm" in found["layer_forms"]["evidence"][0]


def test_tensor_parallel_keeps_separate_projections_out_of_the_advice():
    config = flat(llama_cfg(**{"model.norm": "manual", "parallel.tp": 2}))
    assert rules.slow_forms(config) == ["model.norm"]


# ------------------------------------------------------------------------------------------------
# Attention: grouped key/value heads and the FLOPs of a declared head width


def test_manual_grouped_attention_names_the_copied_kv_heads():
    found = by_key(rank(facts(config=flat(llama_cfg(**NAIVE)), attention_flop_share=0.2)))["attention"]
    assert switches(found)[0] == "--model.attention sdpa"
    assert any("2 key/value heads are copied to all 4 query heads" in e for e in found["evidence"])
    gpt2 = by_key(rank(facts(config=flat(tiny_cfg(**NAIVE)), attention_flop_share=0.2)))["attention"]
    assert not any("key/value heads" in e for e in gpt2["evidence"])


def test_attention_flop_share_counts_query_heads_times_the_declared_head_width(tmp_path):
    """A Qwen3-shaped run (16 heads of 128 on a width of 1024: H x Q = 2048, not n_embd): the attention
    share is 12 L H Q T over the run's own FLOPs per token (summary.json), as model/flops.py counts them."""
    cfg = C.resolve(None, overrides={"data.source": "synthetic", "model.vocab_size": 1000, "model.n_layer": 2,
                                     "model.n_head": 16, "model.n_kv_head": 8, "model.n_embd": 1024,
                                     "model.head_dim": 128, "model.block_size": 256, "model.pos_emb": "rope",
                                     "model.norm_type": "rmsnorm", "model.mlp": "swiglu", "model.qk_norm": True,
                                     "model.intermediate_size": 3072, "train.precision": "fp32"},
                    overrides_from_string=False)
    m = cfg.model
    fpt = flops_per_token(m, flop_params(m, 1000), m.block_size)
    rows = [{"step": s, "loss": 6.0, "step_ms": 100.0, "forward_ms": 30.0, "backward_ms": 60.0, "optimizer_ms": 8.0,
             "data_ms": 1.0, "h2d_ms": 0.5, "other_ms": 0.5} for s in (2, 4, 6, 8)]
    write_run(tmp_path, cfg=cfg, metrics=rows, summary={"params": 10**7, "flops_per_token": fpt, "steps": 8})
    f = gather_facts(load_run(tmp_path))
    att = 12.0 * 2 * 16 * 128 * 256
    assert f["attention_flop_share"] == pytest.approx(att / fpt)
    assert f["attention_flop_share"] > 12.0 * 2 * 1024 * 256 / fpt  # n_embd would undercount it by half
    assert rules.attention_flop_share(2, 16, 128, 256, None, 10**7) == pytest.approx(att / (6e7 + att))


# ------------------------------------------------------------------------------------------------
# Every suggestion on a Llama-family run is a valid config


@pytest.mark.parametrize("variant", [
    NAIVE,
    {"model.fused_qkv": True, "model.loss_impl": "chunked", "memory.activation_checkpointing": 1},
    {"train.precision": "bf16", "model.norm": "manual", "train.batch_size": 2, "train.grad_accum_steps": 8},
])
def test_every_suggestion_on_a_llama_run_resolves(tmp_path, variant):
    """Each switch any rule prints for a Llama-family run, added to the run's config as a user would
    (`--config RUN/config.toml --key value`), passes the config resolver: e.g. never model.norm=triton,
    which is refused for an RMSNorm model."""
    run_cfg = llama_cfg(**variant)
    path = tmp_path / "config.toml"
    C.save(run_cfg, path)
    config = flat(run_cfg)
    printed = set()
    for f in [facts(**x) for x in PLANTED] + [cuda_facts(**x) for x in PLANTED_CUDA]:
        f["config"] = config
        if "layer_forms" in f:
            f["layer_forms"] = layer_form_ops(config, cuda=f["device"] == "cuda")
        for rule in rules.RULES:
            found = rule(f)
            printed |= {s["switch"] for s in (found.suggestions if found else []) if s["switch"]}
    assert printed
    for text in printed:
        words = shlex.split(text)
        C.resolve(None, [str(path)], {k[2:]: v for k, v in zip(words[::2], words[1::2])})
    assert not any("model.gelu" in s or "model.norm triton" in s for s in printed)


# ------------------------------------------------------------------------------------------------
# Through the CLI: a profile of the tiny Llama


@pytest.fixture(scope="module")
def llama_profile(tmp_path_factory):
    """`tokenmill profile` of the tiny-llama preset with manual attention, separate q/k/v, the native
    RMSNorm and activation checkpointing, then `tokenmill doctor --json` on it."""
    d = tmp_path_factory.mktemp("llama-profile")
    args = ["profile", "--preset", "tiny-llama", "--data.source", "synthetic", "--model.vocab_size", "64",
            "--train.device", "cpu", "--train.precision", "fp32", "--train.eval_batches", "0", "--log.progress",
            "plain", "--model.attention", "manual", "--memory.activation_checkpointing", "1",
            "--wait", "1", "--warmup", "1", "--active", "3", "--quiet", "--run-dir", str(d)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args) == 0
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["doctor", str(d), "--json"]) == 0
    return d, json.loads(buf.getvalue())


@pytest.mark.slow
def test_doctor_on_a_llama_profile_names_the_family_forms(llama_profile):
    d, verdict = llama_profile
    found = by_key(verdict["findings"])
    att = found["attention"]
    assert switches(att)[0] == "--model.attention sdpa"
    assert any("2 key/value heads are copied to all 4 query heads" in e for e in att["evidence"])
    assert switches(found["layer_forms"]) == ["--model.fused_qkv true"]  # the norm is native already
    # repeating the grouped k/v heads (repeat_interleave with an int) is a copy, never a host sync
    prof = json.loads((d / "profile.json").read_text())
    assert not any(s["op"] == "aten::repeat_interleave" for s in prof["syncs"]["sources"])
    assert not any("repeat_interleave" in e for x in verdict["findings"] if x["key"] == "host_sync"
                   for e in x["evidence"])
    for text in (s["switch"] for x in verdict["findings"] for s in x["suggestions"] if s["switch"]):
        words = shlex.split(text)
        C.resolve(None, [str(d / "config.toml")], {k[2:]: v for k, v in zip(words[::2], words[1::2])})


@pytest.mark.slow
def test_the_recompute_of_a_llama_block_counts_its_norms_and_silu(llama_profile):
    """Activation checkpointing recomputes each block's forward in backward; the profile finds it by the
    layers' outermost forward operators, the family's included: per block 2 rms_norm, 7 linear (q, k,
    v, o, gate, up, down), 1 softmax (manual attention), 1 silu; 2 blocks."""
    d, _verdict = llama_profile
    rec = json.loads((d / "profile.json").read_text())["breakdown"]["recompute"]
    assert rec["ops_per_step"] == 2 * (2 + 7 + 1 + 1)


@pytest.mark.parametrize("device, precision, tf32", [("cuda", "bf16-autocast", True), ("cpu", "fp32", False)])
def test_automatic_precision_is_read_as_the_run_made_it(tmp_path, device, precision, tf32):
    """A config with train.precision='auto' and train.tf32 unset (as written before the trainer made them):
    the rules read what the trainer chose on the run's device, not 'auto'."""
    cfg = llama_cfg(**{"train.precision": "auto", "train.tf32": None})
    rows = [{"step": s, "loss": 4.0, "step_ms": 100.0, "forward_ms": 30.0, "backward_ms": 60.0, "optimizer_ms": 8.0,
             "data_ms": 1.0, "h2d_ms": 0.5, "other_ms": 0.5} for s in (2, 4, 6, 8)]
    write_run(tmp_path, cfg=cfg, metrics=rows, summary={"device": device, "steps": 8})
    config = gather_facts(load_run(tmp_path))["config"]
    assert (config["train.precision"], config["train.tf32"]) == (precision, tf32)
