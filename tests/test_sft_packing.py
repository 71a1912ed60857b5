"""Chat windows by ``data.chat_packing``: a packed window is its conversations trained one by one; the stream
resumes exactly; padding and learned shares are logged; ``tokenmill eval`` gives the trainer's validation loss;
``model.sdpa_backend='flash'`` is refused only where the explicit mask is used.

The chat folder is prepared here with the small Llama 3 tokenizer of tests/test_chat_prepare.py (every conversation
begins with the template's system header, ~45 tokens, so windows of 256 tokens hold 2 to 4 conversations)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from test_chat_prepare import TEMPLATES, _build  # noqa: E402
from test_sft_train import conversations, write_jsonl  # noqa: E402
from tokenmill import config as C  # noqa: E402
from tokenmill.cli import main  # noqa: E402
from tokenmill.config import DataConfig  # noqa: E402
from tokenmill.config.data import SEQUENCE_START_FLAG  # noqa: E402
from tokenmill.data.chat import ChatTemplate  # noqa: E402
from tokenmill.data.chat_prepare import prepare_chat  # noqa: E402
from tokenmill.data.chat_windows import sequence_starts  # noqa: E402
from tokenmill.data.dataset import IGNORE_INDEX  # noqa: E402
from tokenmill.data.loader import build_datasets, build_train_loader  # noqa: E402
from tokenmill.errors import ConfigError  # noqa: E402
from tokenmill.model.build import build_gpt  # noqa: E402
from tokenmill.profiling.sft_rules import FEW_LEARNED, HEAVY_PADDING, few_learned_tokens, heavy_padding  # noqa: E402
from tokenmill.train.parallelize import build_model, document_eot_id  # noqa: E402

T = 256


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    d = tmp_path_factory.mktemp("pack")
    model = _build("llama3", d / "model", (TEMPLATES / "llama3.jinja").read_text())
    src = write_jsonl(d / "chats.jsonl", conversations(60))
    return prepare_chat(src, d / "data", ChatTemplate(model), workers=1, progress=False, val_fraction=0.2)


def model_cfg(preset: str, vocab: int, **over) -> C.Config:
    base = {"data.source": "tokens", "model.vocab_size": vocab, "model.block_size": T, "model.dropout": 0.0,
            "model.document_attention": "explicit", "train.device": "cpu", "train.precision": "fp32",
            "train.tf32": False, "log.progress": "plain", "log.tensorboard": False, **over}
    return C.resolve(preset, overrides=base, overrides_from_string=False)


# ----------------------------------------------------------------------------------------------
# the windows


def test_windows_start_at_conversations_and_hold_whole_ones(chat):
    pad = build_datasets(DataConfig(path=str(chat), chat_packing="pad"), T, 0)
    pack = build_datasets(DataConfig(path=str(chat), chat_packing="pack"), T, 0)
    tf = pad.train.token_file
    lengths = np.diff(np.append(sequence_starts(tf), len(tf)))
    assert pad.train.n_windows == len(lengths) and pack.train.n_windows < len(lengths) / 2  # several per window
    assert pad.train.padding(range(40)) == sum(T - min(n, T) for n in lengths[[pad.train.item(k) for k in range(40)]])
    assert pack.train.padding_share() < 0.5 * pad.train.padding_share()
    for j in range(pack.train.n_windows):  # whole conversations, the flags exactly at their starts
        x, y = pack.train.window(j)
        off, used = int(pack.train.offsets[j]), int(pack.train.used[j])
        flags = ((x & SEQUENCE_START_FLAG) != 0).nonzero().flatten().tolist()
        starts = [s - off for s in sequence_starts(tf).tolist() if off <= s < off + used]
        assert flags[: len(starts)] == starts and flags[len(starts):] == ([used] if used < T else [])
        assert torch.equal(x[:used] & (SEQUENCE_START_FLAG - 1), torch.from_numpy(tf.tokens[off:off + used].astype(np.int64)))
        assert (y[used - 1:] == IGNORE_INDEX).all() and (x[used + 1:] == 0).all()
        assert all(y[s - 1] == IGNORE_INDEX for s in starts[1:])  # never a target across a boundary


def test_loader_resume_is_exact(chat):
    """Steps 3.. of a stream started at step 3 (or at its sample) are the uninterrupted stream's, batch for batch."""
    ds = build_datasets(DataConfig(path=str(chat), chat_packing="pack"), T, 0).train
    full = list(build_train_loader(ds, DataConfig(), 2, 2, 0, 6))
    for resumed in (build_train_loader(ds, DataConfig(), 2, 2, 3, 6),
                    build_train_loader(ds, DataConfig(), 4, 1, 3, 6, start_sample=12)):
        got = [torch.cat(b) for b in zip(*[(x, y) for x, y in resumed])]
        want = [torch.cat(b) for b in zip(*[(x, y) for x, y in full[6:]])]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len({tuple(x[0].tolist()) for x, _ in full}) > 3  # a stream of different windows


# ----------------------------------------------------------------------------------------------
# a packed window is its conversations one by one


def packed_and_one_by_one(chat, preset: str, device: str, **over) -> dict:
    """The packed window holding the most conversations, through the packed model (:func:`build_model`: the flags,
    positions restarting), and the same conversations padded one at a time through the plain model with the same
    weights: their summed losses over the learned targets and gradients."""
    pack = build_datasets(DataConfig(path=str(chat), chat_packing="pack"), T, 0).train
    pad = build_datasets(DataConfig(path=str(chat), chat_packing="pad"), T, 0).train
    j = max(range(pack.n_windows), key=lambda i: int(((pack.window(i)[0] & SEQUENCE_START_FLAG) != 0).sum()))
    off, used = pack.offsets[j], pack.used[j]
    one_by_one = np.flatnonzero((pad.offsets >= off) & (pad.offsets < off + used))
    assert len(one_by_one) >= 3
    cfg = model_cfg(preset, pack.vocab_size, **{"data.path": str(chat), "data.chat_packing": "pack", **over})
    packed = build_model(cfg, pack.vocab_size, torch.device(device), data_dir=chat)
    assert packed.doc_start_flag == SEQUENCE_START_FLAG
    plain = model_cfg(preset, pack.vocab_size, **{"model.document_attention": "auto", "model.sdpa_backend": "auto"})
    alone = build_gpt(plain.model, pack.vocab_size, device)
    alone.load_state_dict(packed.state_dict())
    params = [[p for p in m.parameters() if p.requires_grad] for m in (packed, alone)]
    x, y = (t[None].long().to(device) for t in pack.window(j))
    loss = packed(x, y, reduction="sum")[1]
    ref = sum(alone(*(t[None].long().to(device) for t in pad.window(i)), reduction="sum")[1] for i in one_by_one)
    assert int((y != IGNORE_INDEX).sum()) == sum(int((pad.window(i)[1] != IGNORE_INDEX).sum()) for i in one_by_one)
    return {"loss": loss, "ref": ref, "grads": torch.autograd.grad(loss, params[0]),
            "ref_grads": torch.autograd.grad(ref, params[1]), "leaky": alone(x & (SEQUENCE_START_FLAG - 1), y,
                                                                              reduction="sum")[1]}


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])  # learned positions; rotary, grouped k/v, RMSNorm
def test_packed_window_equals_its_conversations_trained_one_by_one(chat, preset):
    """The summed loss over the learned targets and its gradients, packed (explicit mask, positions restarting) and
    padded one by one: equal within fp32 summation order (loss rtol 1e-5; gradients atol 1e-5 on values of ~1)."""
    r = packed_and_one_by_one(chat, preset, "cpu")
    torch.testing.assert_close(r["loss"], r["ref"], rtol=1e-5, atol=0)
    for a, b in zip(r["grads"], r["ref_grads"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(r["leaky"], r["ref"], rtol=1e-5, atol=0)  # packed without the mask: the check can fail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention trains on CUDA only")
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_packed_flex_on_cuda_equals_conversations_one_by_one(chat, preset):
    """FlexAttention's block mask from the start flags (compiled), with model.sdpa_backend='flash' allowed: the
    packed loss and gradients equal the padded conversations' through SDPA's causal kernel (fp32; loss rtol 1e-4,
    gradients rtol 1e-3 / atol 1e-4: two kernels' summation orders)."""
    r = packed_and_one_by_one(chat, preset, "cuda", **{"model.document_attention": "flex", "model.sdpa_backend": "flash"})
    torch.testing.assert_close(r["loss"], r["ref"], rtol=1e-4, atol=0)
    for a, b in zip(r["grads"], r["ref_grads"]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


# ----------------------------------------------------------------------------------------------
# flash: refused only for the explicit mask


def test_flash_is_refused_only_where_the_explicit_mask_is_used(chat, tmp_path):
    """At the config level, before a model is built: packed chat sequences and data.document_mask (a copy of the
    folder whose meta.json names an end-of-text id)."""
    import json
    import shutil

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    text = shutil.copytree(chat, tmp_path / "eot")
    meta = json.loads((text / "meta.json").read_text())
    (text / "meta.json").write_text(json.dumps({**meta, "tokenizer": {**meta["tokenizer"], "eot_id": 3}}))
    for over in ({"data.chat_packing": "pack"}, {"data.document_mask": True, "data.loss_mask": False}):
        folder = chat if "data.chat_packing" in over else text
        flash = {"data.path": str(folder), "model.sdpa_backend": "flash", **over}
        name = "data.chat_packing='pack'" if "data.chat_packing" in over else "data.document_mask"
        for attention, device in (("explicit", cuda), ("auto", cpu), ("explicit", cpu)):
            with pytest.raises(ConfigError, match=f"{name} with model.document_attention='{attention}' passes SDPA "
                                                  "an explicit mask here.*--model.document_attention flex"):
                document_eot_id(model_cfg("tiny", 512, **flash, **{"model.document_attention": attention}), folder, device)
        with pytest.raises(ConfigError, match="'auto' passes SDPA an explicit mask"):  # auto with dropout: explicit
            document_eot_id(model_cfg("tiny", 512, **flash, **{"model.document_attention": "auto",
                                                                "model.dropout": 0.1}), folder, cuda)
        for attention, device in (("flex", cuda), ("flex", cpu), ("auto", cuda)):
            got = document_eot_id(model_cfg("tiny", 512, **flash, **{"model.document_attention": attention}), folder,
                                  device)
            assert got == (None if name.startswith("data.chat") else 3)
    assert document_eot_id(model_cfg("tiny", 512, **{"data.path": str(chat)}), chat) is None  # padded: no mask
    with pytest.raises(ConfigError, match="has none of: use --data.chat_packing pack"):  # no end-of-text in chat data
        document_eot_id(model_cfg("tiny", 512, **{"data.path": str(chat), "data.document_mask": True}), chat)


# ----------------------------------------------------------------------------------------------
# a packed run: the shares logged, and `tokenmill eval` over the learned tokens


@pytest.mark.slow  # trains
def test_packed_run_logs_its_shares_and_eval_gives_its_val_loss(chat, tmp_path, capsys):
    """Two steps on packed windows: every record has learned_frac and padding_frac, the summary their means and
    learned tokens/s; `tokenmill eval` with the run's batches gives the trainer's val_loss of the same checkpoint
    (rel 1e-6), and over the whole split the mean over every val conversation's learned targets, computed one
    conversation at a time (rel 1e-5)."""
    from tokenmill import checkpoint
    from tokenmill.train.evaluate import evaluate_run
    from tokenmill.train.metrics import read_metrics
    from tokenmill.train.trainer import train

    cfg = model_cfg("tiny", None, **{"data.path": str(chat), "data.chat_packing": "pack", "train.max_steps": 2,
                                     "train.batch_size": 2, "train.eval_batches": 2, "log.every_steps": 1})
    summary = train(cfg, tmp_path / "run", quiet=True)
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2 and all(0 < r["learned_frac"] < 1 and 0 <= r["padding_frac"] < 1 for r in rows)
    assert summary["padding_frac"] == pytest.approx(np.mean([r["padding_frac"] for r in rows]))
    assert summary["learned_frac"] == pytest.approx(np.mean([r["learned_frac"] for r in rows]))
    assert summary["learned_tokens_per_sec"] is None or summary["learned_tokens_per_sec"] > 0
    ds = build_datasets(DataConfig(path=str(chat), chat_packing="pack"), T, cfg.train.seed).train
    g = cfg.train.batch_size * cfg.train.grad_accum_steps
    first = [ds[k] for k in range(g)]  # the first step's samples; padding: the trailing ids 0
    pads = [T - 1 - int((x & (SEQUENCE_START_FLAG - 1)).nonzero().max()) for x, _ in first]
    assert rows[0]["padding_frac"] == pytest.approx(sum(pads) / (g * T)) and sum(pads) > 0
    assert rows[0]["learned_tokens"] == sum(int((y != IGNORE_INDEX).sum()) for _, y in first)
    ev = evaluate_run(tmp_path / "run", batches=2, write=False)
    assert ev["learned_only"] and ev["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6)
    whole = evaluate_run(tmp_path / "run", write=False)
    model = checkpoint.load_model(tmp_path / "run")[0].eval()  # plain: one conversation per forward
    val = build_datasets(DataConfig(path=str(chat), chat_packing="pad"), T, 0).val
    with torch.no_grad():
        terms = [(model(x[None].long(), y[None].long(), reduction="sum")[1].item(), int((y != IGNORE_INDEX).sum()))
                 for x, y in (val.window(j) for j in range(val.n_windows))]
    assert whole["tokens"] == sum(n for _, n in terms)
    assert whole["val_loss"] == pytest.approx(sum(s for s, _ in terms) / whole["tokens"], rel=1e-5)
    capsys.readouterr()
    assert main(["doctor", str(tmp_path / "run")]) == 0  # its summary read, typed: few learned tokens, light padding
    out = capsys.readouterr().out
    assert "few learned tokens per step" in out and "--train.grad_accum_steps" in out
    assert "padding takes" not in out and summary["padding_frac"] < HEAVY_PADDING


def test_doctor_names_heavy_padding_and_few_learned_tokens():
    """The rules on the facts the doctor reads from summary.json: a threshold each, the switch that helps."""
    f = {"config": {"data.chat_packing": "pad"}, "padding_frac": 0.7, "learned_frac": 0.1, "tokens_per_step": 8192}
    heavy, few = heavy_padding(f), few_learned_tokens(f)
    assert heavy.score == pytest.approx(0.7) and "3.33x" in heavy.evidence[1]
    assert heavy.suggestions[0]["switch"] == "--data.chat_packing pack"
    assert [s["switch"] for s in few.suggestions[:2]] == ["--train.grad_accum_steps 3", "--data.chat_packing pack"]
    assert "819 learned tokens per step" in few.evidence[0]
    packed = {**f, "config": {"data.chat_packing": "pack"}, "padding_frac": 0.3}
    assert heavy_padding(packed).suggestions[0]["switch"] is None  # packed already: advice on the window
    assert heavy_padding({**f, "padding_frac": HEAVY_PADDING - 0.01}) is None
    assert few_learned_tokens({**f, "learned_frac": FEW_LEARNED / 8192}) is None
    assert heavy_padding({"config": {}}) is None and few_learned_tokens({"config": {}}) is None  # not a chat run


def test_estimate_reports_learned_tokens_per_second_of_chat_windows(chat, capsys):
    """The padding and learned shares the estimator reads from the folder are the windows' own (every window's
    targets counted here; no conversation is cut at T = 256), and learned tokens/s = tokens/s x learned share."""
    from tokenmill.estimate import estimate

    for packing in ("pad", "pack"):
        cfg = model_cfg("tiny", None, **{"data.path": str(chat), "data.chat_packing": packing})
        est = estimate(cfg, "h100-sxm")
        ds = build_datasets(DataConfig(path=str(chat), chat_packing=packing), T, 0).train
        assert ds.n_cut == 0
        windows = [ds.window(j) for j in range(ds.n_windows)]
        learned = np.mean([int((y != IGNORE_INDEX).sum()) for _, y in windows]) / T
        padding = np.mean([T - 1 - int((x & (SEQUENCE_START_FLAG - 1)).nonzero().max()) for x, _ in windows]) / T
        assert est.chat["learned_share"] == pytest.approx(learned, rel=1e-9)
        assert est.chat["padding_share"] == pytest.approx(padding, rel=1e-9)
        assert est.chat["learned_tokens_per_sec"] == pytest.approx(est.tokens_per_sec * learned, rel=1e-9)
    assert main(["estimate", "--preset", "tiny", "--data.path", str(chat), "--model.block_size", str(T)]) == 0
    assert "chat windows (pad):" in capsys.readouterr().out


@pytest.mark.slow
def test_packed_run_extended_by_resume_is_bit_identical(chat, tmp_path):
    """Packed windows with accumulation: 2 steps resumed to 4 give the uninterrupted run's losses, learned counts,
    padding shares and validation losses bit for bit."""
    from tokenmill.train.metrics import read_metrics
    from tokenmill.train.trainer import train

    over = {"data.path": str(chat), "data.chat_packing": "pack", "train.batch_size": 2, "train.grad_accum_steps": 2,
            "train.eval_batches": 1, "train.eval_every_steps": 2, "log.every_steps": 1, "optim.decay_steps": 4}
    train(model_cfg("tiny-llama", None, **over, **{"train.max_steps": 4}), tmp_path / "full", quiet=True)
    train(model_cfg("tiny-llama", None, **over, **{"train.max_steps": 2}), tmp_path / "cut", quiet=True)
    train(model_cfg("tiny-llama", None, **over, **{"train.max_steps": 4}), tmp_path / "cut", resume=True, quiet=True)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    for key in ("loss", "learned_tokens", "padding_frac", "val_loss"):
        want = [(r["step"], r[key]) for r in full if key in r]
        assert [(r["step"], r[key]) for r in cut if key in r] == want and len(want) >= 2, key
