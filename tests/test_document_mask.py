"""data.document_mask (and data.document_positions): attention stays inside each document of a packed window.

The reference for every check is the plain causal model run on each document on its own: the same weights
(two models built from the same seed), the document's tokens alone as the window."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.data.prepare import prepare
from tokenmill.errors import ConfigError, DataError
from tokenmill.model.build import apply_document_mask, build_gpt
from tokenmill.model.layers import document_positions
from tokenmill.train.parallelize import document_eot_id

V, EOT = 64, 63
LENGTHS = ((5, 9, 6), (12, 3, 5))  # two windows of 20 tokens, three documents each; the last one is cut


def _cfg(preset: str, attention: str, **over) -> C.Config:
    base = {"model.vocab_size": V, "model.attention": attention, "train.device": "cpu", "data.source": "synthetic"}
    return C.resolve(preset, overrides={**base, **over}, overrides_from_string=False)


def _models(preset: str, attention: str, positions: bool):
    """(plain causal model, the same weights with data.document_mask) in fp32 on the CPU."""
    cfg = _cfg(preset, attention)
    torch.manual_seed(0)
    plain = build_gpt(cfg.model, V, "cpu")
    torch.manual_seed(0)
    masked = build_gpt(cfg.model, V, "cpu")
    masked.keep_documents_apart(EOT, positions)
    return plain, masked


def _window(lengths: tuple[int, ...], seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Documents of random non-eot ids, each but the last ending with the eot id; their concatenation."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, EOT, (n,), generator=g) for n in lengths]
    docs = [torch.cat([d, torch.tensor([EOT])]) if i < len(docs) - 1 else d for i, d in enumerate(docs)]
    return torch.cat(docs), docs


def _batch():
    """Two packed windows (B=2, T=20) and each row's document spans (start, end)."""
    wins = [_window(L, seed) for seed, L in enumerate(LENGTHS)]
    x = torch.stack([w for w, _ in wins])
    spans = []
    for _, docs in wins:
        s, row = 0, []
        for d in docs:
            row.append((s, s + len(d)))
            s += len(d)
        spans.append(row)
    return x, spans


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_packed_window_equals_each_document_alone(preset, attention):
    """With positions restarting, every document's logits, its share of the loss and the gradients equal the
    plain model run on that document alone (fp32, within 1e-5); learned positions (GPT-2) and RoPE with
    grouped-query attention (Llama), SDPA and manual attention."""
    plain, masked = _models(preset, attention, positions=True)
    x, spans = _batch()
    inp, tgt = x[:, :-1], x[:, 1:]  # an end-of-text position's target: the next document's first token
    logits, loss = masked(inp, tgt)
    ref_loss = torch.zeros(())
    for b, row in enumerate(spans):
        for s, e in row:
            e = min(e, inp.size(1))
            ref_logits, _ = plain(inp[b : b + 1, s:e])
            torch.testing.assert_close(logits[b, s:e], ref_logits[0], atol=1e-5, rtol=0)
            ref_loss = ref_loss + F.cross_entropy(ref_logits[0], tgt[b, s:e], reduction="sum")
    ref_loss = ref_loss / tgt.numel()
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=0)
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(masked.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=0, msg=name)
    # without the mask the same window gives other logits: the check above can fail
    assert (plain(inp)[0] - logits).abs().max() > 1e-2


@pytest.mark.parametrize("attention", ["sdpa", "manual"])
def test_without_position_restart(attention):
    """Positions running on over the window: (learned, GPT-2) a document's logits do not depend on the other
    documents' tokens at all (each one replaced: bit-identical logits), and the first document equals itself
    alone; (RoPE, Llama) attention sees only relative positions, so every document equals itself alone up to
    the rounding of its rotation angles (1e-4)."""
    plain, masked = _models("tiny", attention, positions=False)
    x, spans = _batch()
    logits, _ = masked(x)
    for b, row in enumerate(spans):
        for k, (s, e) in enumerate(row):
            other = x.clone()
            for j, (s2, e2) in enumerate(row):
                if j != k:  # other tokens, the same document boundaries
                    other[b, s2 : e2 - 1] = (other[b, s2 : e2 - 1] + 7) % EOT
            assert torch.equal(masked(other)[0][b, s:e], logits[b, s:e])
        s, e = row[0]
        torch.testing.assert_close(logits[b, s:e], plain(x[b : b + 1, s:e])[0][0], atol=1e-5, rtol=0)
    plain, masked = _models("tiny-llama", attention, positions=False)
    logits, _ = masked(x)
    for b, row in enumerate(spans):
        for s, e in row:
            torch.testing.assert_close(logits[b, s:e], plain(x[b : b + 1, s:e])[0][0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("attention", ["sdpa", "manual"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_no_end_of_text_is_plain_causal(preset, attention, positions):
    """A window without an end-of-text id is one document: the masked model's logits and gradients equal
    the plain causal model's (within 1e-6)."""
    plain, masked = _models(preset, attention, positions)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, EOT, (2, 32), generator=g)
    y = torch.randint(0, V, (2, 32), generator=g)
    (lm, loss_m), (lp, loss_p) = masked(x, y), plain(x, y)
    torch.testing.assert_close(lm, lp, atol=1e-6, rtol=0)
    loss_m.backward()
    loss_p.backward()
    for p, q in zip(masked.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=0)


def test_positions_restart_after_each_end_of_text():
    """The end-of-text token is the last of the document it ends; the next token is position 0."""
    x = torch.tensor([[4, 5, EOT, 6, EOT, EOT, 7, 8], [EOT, 1, 2, 3, 4, 5, 6, 7]])
    assert document_positions(x, EOT).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 0, 1, 2, 3, 4, 5, 6]]


# ----------------------------------------------------------------------------------------------
# Through the trainer, and its refusals

DOC_WORDS = ("alpha beta gamma", "one two three four", "red green blue", "cat dog bird fish")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    for i in range(120):  # short documents: several end-of-text tokens in every 32-token window
        (root / f"d{i:03d}.txt").write_text(DOC_WORDS[i % 4] + f" {i % 7}\n", encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def bpe_data(corpus, tmp_path_factory) -> Path:
    return prepare(corpus, tmp_path_factory.mktemp("bpe"), "bpe", vocab_size=300, workers=1, progress=False,
                   glob="*.txt")


@pytest.mark.slow
def test_training_with_document_mask_learns(bpe_data, tmp_path):
    """tokenmill.train with data.document_mask and document_positions on prepared BPE data: the model it
    trains keeps documents apart by the data's end-of-text id (meta.json), and the loss falls; `tokenmill eval`
    of the run applies the mask too (its validation loss is the trainer's final one, over the same windows)."""
    from tokenmill.train.evaluate import evaluate_run
    from tokenmill.train.trainer import Callbacks, train

    eot = json.loads((bpe_data / "meta.json").read_text())["tokenizer"]["eot_id"]
    cfg = C.resolve("tiny", overrides={"data.path": str(bpe_data), "data.document_mask": True,
                                       "data.document_positions": True, "train.device": "cpu",
                                       "train.max_steps": 20, "train.eval_batches": 2, "log.every_steps": 5,
                                       "optim.lr": 1e-2},
                    overrides_from_string=False)
    seen = []
    summary = train(cfg, tmp_path / "run", quiet=True, callbacks=Callbacks(on_model_built=lambda m: seen.append(
        (m.doc_eot_id, m.doc_positions))))
    assert seen == [(eot, True)]
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.7 * losses[0], losses
    ev = evaluate_run(tmp_path / "run", batches=2, write=False)
    assert ev["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-5), (ev, summary)


def test_refusals_by_message(bpe_data, corpus, tmp_path, capsys):
    """What cannot work stops with one line naming the switch."""
    cfg = _cfg("tiny", "sdpa", **{"data.document_positions": True})
    with pytest.raises(ConfigError, match="data.document_positions .* needs data.document_mask"):
        document_eot_id(cfg, bpe_data)
    cfg = _cfg("tiny", "sdpa", **{"data.document_mask": True, "model.sdpa_backend": "flash"})
    with pytest.raises(ConfigError, match="flash kernel does not take"):
        document_eot_id(cfg, bpe_data)
    cfg = _cfg("tiny", "sdpa", **{"data.document_mask": True, "parallel.pp": 2, "model.tie_embeddings": False,
                                  "train.batch_size": 4})
    with pytest.raises(ConfigError, match="parallel.pp > 1"):
        document_eot_id(cfg, bpe_data)
    assert document_eot_id(_cfg("tiny", "sdpa"), None) is None  # off: nothing read
    byte_data = prepare(corpus, tmp_path / "bytes", "bytes", workers=1, progress=False, glob="*.txt")
    cfg = _cfg("tiny", "manual", **{"data.document_mask": True, "data.source": "tokens"})
    with pytest.raises(DataError, match="tokenizer 'bytes'.* has none"):
        document_eot_id(cfg, byte_data)
    # a folder whose meta.json predates the eot_id key: its tokenizer's end-of-text id
    meta = json.loads((bpe_data / "meta.json").read_text())
    old = tmp_path / "old"
    old.mkdir()
    for f in bpe_data.iterdir():
        (old / f.name).write_bytes(f.read_bytes())
    del meta["tokenizer"]["eot_id"]
    (old / "meta.json").write_text(json.dumps(meta))
    assert document_eot_id(cfg, old) == json.loads((bpe_data / "meta.json").read_text())["tokenizer"]["eot_id"]
    # through the command line: one line, no traceback (what the configs above printed is not its output)
    capsys.readouterr()
    rc = main(["train", "--preset", "tiny", "--run-dir", str(tmp_path / "r"), "--data.source", "synthetic",
               "--model.vocab_size", "64", "--data.document_mask", "true", "--train.device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("tokenmill: config error: data.document_mask needs prepared token data")
    assert "Traceback" not in err


def test_apply_document_mask_off_leaves_the_model():
    cfg = _cfg("tiny", "sdpa")
    model = apply_document_mask(build_gpt(cfg.model, V, "meta"), cfg.data, None)
    assert model.doc_eot_id is None
    with pytest.raises(ValueError, match="outside the vocabulary"):
        model.keep_documents_apart(V)


# ----------------------------------------------------------------------------------------------
# The estimator's term (estimate/techniques.py)


def _est_cfg(**over) -> C.Config:
    base = {"data.source": "synthetic", "model.vocab_size": 512, "model.n_layer": 2, "model.n_embd": 128,
            "model.n_head": 4, "model.block_size": 1024, "train.batch_size": 4, "train.device": "cpu",
            "model.document_attention": "explicit"}  # the explicit mask's costs (FlexAttention's: test_flex_attention)
    return C.resolve(None, overrides={**base, **over}, overrides_from_string=False)


def _attention_extra_ms(B: int, T: int, L: int, H: int, D: int, over_flex: bool = False) -> float:
    """The H100 bf16 estimate's extra milliseconds per step from data.document_mask: each fused attention kernel
    (forward, and backward at 2.5 times its FLOPs) computes the whole T x T instead of the causal half (twice the
    time), and reads the bf16 mask once. ``over_flex``: over FlexAttention's time instead (synthetic data: every
    causal tile, at its published speed over FlashAttention-2's, estimate/attention.py FLEX_VS_FA2)."""
    from tokenmill.estimate import gpu_spec
    from tokenmill.estimate import roofline as R
    from tokenmill.estimate.bandwidth import memory_bandwidth

    spec = gpu_spec("h100-sxm")
    fwd = 2 * 2 * B * H * T * T * D * 0.5  # causal: the half the flash kernel computes
    from tokenmill.estimate.attention import attention_efficiency

    share = attention_efficiency((B * H, T, D), spec.cc, spec.sm)  # FlashAttention-2's, at this shape
    kernel = [max(f / (spec.peak("bf16") * share), R.KERNEL_MIN_US * 1e-6) for f in (fwd, 2.5 * fwd)]
    read = B * T * T * 2 / memory_bandwidth(spec)
    flex = sum(k * (1 - 1 / speed) for k, speed in zip(kernel, (1.25, 1.03))) if over_flex else 0.0
    return L * (sum(k + read for k in kernel) + flex) * 1e3


def test_estimate_counts_the_mask_and_the_lost_causal_skip():
    """With data.document_mask the estimate's peak grows by the (B, 1, T, T) mask (fp32 on a CPU: 4 bytes,
    bf16 autocast on an H100: 2 bytes per entry), and on the H100 the fused attention's time doubles (the whole
    T x T instead of the causal half: the flash kernel cannot take the mask) plus one read of the mask per
    forward and per backward; with grouped-query attention, the repeated keys and values."""
    from tokenmill.estimate import estimate

    B, T = 4, 1024
    cpu = [estimate(_est_cfg(**{"train.precision": "fp32", "data.document_mask": on}), "cpu") for on in (False, True)]
    assert cpu[1].peak_alloc_mb - cpu[0].peak_alloc_mb == pytest.approx(B * T * T * 4 / 2**20)
    gpu = [estimate(_est_cfg(**{"train.precision": "bf16-autocast", "data.document_mask": on}), "h100-sxm")
           for on in (False, True)]
    assert gpu[1].peak_alloc_mb - gpu[0].peak_alloc_mb == pytest.approx(B * T * T * 2 / 2**20)
    grown = gpu[1].time_breakdown_ms["matmul_ms"] - gpu[0].time_breakdown_ms["matmul_ms"]
    assert grown == pytest.approx(_attention_extra_ms(B, T, 2, 4, 32), rel=1e-6)
    assert gpu[1].step_ms >= gpu[0].step_ms
    # grouped-query attention (4 query heads, 2 key/value heads): the kernel that takes the mask has no grouped
    # form, so each layer's keys and values, repeated per query head, are kept for backward too
    gqa = [estimate(_est_cfg(**{"train.precision": "bf16-autocast", "model.n_kv_head": 2, "data.document_mask": on}),
                    "h100-sxm") for on in (False, True)]
    repeated = 2 * 2 * B * T * (4 - 2) * 32 * 2  # layers x (k, v) x B x T x extra heads x head width x bf16
    assert gqa[1].peak_alloc_mb - gqa[0].peak_alloc_mb == pytest.approx((B * T * T * 2 + repeated) / 2**20)


def test_doctor_names_the_cost_of_document_masking():
    """The doctor rule: data.document_mask on the explicit path with SDPA on an H100 (a GPU-bound step; a run
    config without model.document_attention predates FlexAttention's path) reports the estimate's extra step time
    over FlexAttention (the attention term above) and the mask's bytes (B x T x T x 2 in bf16), and names
    model.document_attention first; nothing on a CPU, with manual attention, with the switch off, or with
    FlexAttention ('flex', or 'auto' without dropout); 'auto' with dropout suggests dropping the dropout."""
    from tokenmill.profiling.docmask_rules import document_mask_cost
    from tokenmill.profiling.rules import RULES

    B, T = 16, 2048
    run = {"data.source": "synthetic", "model.vocab_size": 512, "model.n_layer": 2, "model.n_embd": 256,
           "model.n_head": 4, "model.block_size": T, "train.batch_size": B, "train.precision": "bf16-autocast",
           "data.document_mask": True}
    facts = {"device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "device_total_mb": 81559, "world_size": 1,
             "config": run}
    assert document_mask_cost in RULES
    assert document_mask_cost({**facts, "device": "cpu"}) is None
    assert document_mask_cost({**facts, "config": {**run, "model.attention": "manual"}}) is None
    assert document_mask_cost({**facts, "config": {**run, "data.document_mask": False}}) is None
    for impl in ("auto", "flex"):
        assert document_mask_cost({**facts, "config": {**run, "model.document_attention": impl}}) is None
    dropout = document_mask_cost({**facts, "config": {**run, "model.document_attention": "auto", "model.dropout": 0.1}})
    assert dropout.suggestions[0]["switch"] == "--model.document_attention auto --model.dropout 0.0"
    found = document_mask_cost(facts)
    assert found is not None and "without the flash kernel" in found.title
    assert f"{_attention_extra_ms(B, T, 2, 4, 64, over_flex=True):.1f} ms of " in found.evidence[1], found.evidence
    assert f"{B * T * T * 2 / 2**20:.0f} MB more at the peak" in found.evidence[1]
    assert found.suggestions[0]["switch"] == "--model.document_attention auto"
    assert found.suggestions[1]["switch"] == "--data.document_mask false"
    assert 0.05 < found.score < 0.5
