"""Training on chat data (``data.loss_mask``): only the learned tokens count, and the loss is the mean over the
learned tokens of the whole global batch, whatever the accumulation split, process count or loss form.

The chat folders are prepared here (``prepare_chat`` / ``tokenmill prepare --format chat``) from varied
conversations with the small Llama 3 tokenizer of tests/test_chat_prepare.py, so windows hold different numbers of
learned tokens: a per-micro-batch mean averaged over micro-batches would give other numbers."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from conftest import run_cli, tiny_cfg  # noqa: E402
from test_chat_prepare import TEMPLATES, _build  # noqa: E402
from tokenmill import checkpoint as ckpt  # noqa: E402
from tokenmill.config import DataConfig  # noqa: E402
from tokenmill.data.chat import ChatTemplate  # noqa: E402
from tokenmill.data.chat_prepare import prepare_chat  # noqa: E402
from tokenmill.data.dataset import IGNORE_INDEX  # noqa: E402
from tokenmill.data.loader import build_datasets  # noqa: E402
from tokenmill.errors import DataError  # noqa: E402
from tokenmill.model.loss import _chunked_op, chunked_cross_entropy  # noqa: E402
from tokenmill.train.metrics import read_metrics  # noqa: E402
from tokenmill.train.tasks import scores  # noqa: E402
from tokenmill.train.trainer import Callbacks, train  # noqa: E402

TASKS = Path(__file__).parent / "data" / "tasks"  # local lm-eval tasks (tests/test_tasks.py)

T = 32


def conversations(n: int) -> list[dict]:
    """Conversations of varied shapes and lengths: with or without a system message, one or two exchanges."""
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"What is {i} plus {i % 7}?"},
                {"role": "assistant", "content": f"{i} plus {i % 7} is {i + i % 7}." + " Indeed." * (i % 5)}]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "You are a helpful assistant. " * (1 + i % 4)})
        if i % 4 == 1:
            msgs += [{"role": "user", "content": "And the capital of France?" * (1 + i % 3)},
                     {"role": "assistant", "content": "Paris."}]
        out.append({"messages": msgs})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def prepare_data(d: Path) -> Path:
    """In folder ``d``: a Llama 3 tokenizer folder ``model`` (with its chat template), ``chats.jsonl`` and the
    chat folder ``data`` prepared from them with it (its path)."""
    model = _build("llama3", d / "model", (TEMPLATES / "llama3.jinja").read_text())
    assert model == d / "model"
    src = write_jsonl(d / "chats.jsonl", conversations(80))
    return prepare_chat(src, d / "data", ChatTemplate(model), workers=1, progress=False, val_fraction=0.2)


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> dict[str, Path]:
    """A Llama 3 tokenizer folder (with its chat template), a chat folder prepared with it, and a text folder."""
    from tokenmill.data import prepare

    d = tmp_path_factory.mktemp("sft")
    data = prepare_data(d)
    (d / "text.txt").write_text("plain text, learned everywhere. " * 200)
    text = prepare(d / "text.txt", d / "text", "bytes", workers=1, progress=False)
    return {"model": d / "model", "data": data, "text": text, "jsonl": d / "chats.jsonl", "dir": d}


def chat_over(folder: Path, **over) -> dict:
    return {"data.source": "tokens", "data.path": str(folder), "model.vocab_size": None, "model.block_size": T,
            "model.dropout": 0.0, "train.eval_batches": 0, "log.every_steps": 1, **over}


# ----------------------------------------------------------------------------------------------
# the switch


def test_switch_auto_true_false_and_refusals(chat):
    auto = build_datasets(DataConfig(path=str(chat["data"])), T, 0)
    assert auto.loss_mask and (auto.train[3][1] == IGNORE_INDEX).any() and (auto.val[0][1] == IGNORE_INDEX).any()
    off = build_datasets(DataConfig(path=str(chat["data"]), loss_mask=False), T, 0)
    assert not off.loss_mask and not (off.train[3][1] == IGNORE_INDEX).any()
    assert auto.train.token_file.masks[auto.train.offsets[auto.train.item(3)]] & 2  # masked: from a conversation's start
    assert not build_datasets(DataConfig(path=str(chat["text"])), T, 0).loss_mask  # auto on text: every token
    with pytest.raises(DataError) as e:
        build_datasets(DataConfig(path=str(chat["text"]), loss_mask=True), T, 0)
    assert "data.loss_mask is true" in str(e.value) and "--format chat" in str(e.value)
    with pytest.raises(DataError, match="data.loss_mask is true, but data.source = 'synthetic'"):
        build_datasets(DataConfig(source="synthetic", loss_mask=True), T, 0, 64)
    copy = chat["dir"] / "data-copy"
    if not copy.exists():
        shutil.copytree(chat["data"], copy)
    mix = DataConfig(mixture=f"{chat['data']}:1,{copy}:1")
    with pytest.raises(DataError, match="holds chat data with a loss mask, but data.mixture"):
        build_datasets(mix, T, 0)
    assert not build_datasets(DataConfig(mixture=mix.mixture, loss_mask=False), T, 0).loss_mask


# ----------------------------------------------------------------------------------------------
# the chunked loss honours ignore_index


def _chunked_case(seed: int = 0, n: int = 37, c: int = 16, v: int = 50, vp: int = 56):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g, dtype=torch.float64).float().requires_grad_()
    w = torch.randn(vp, c, generator=g).mul(0.3).requires_grad_()  # padded rows past v: never scored
    t = torch.randint(0, v, (n,), generator=g)
    t[torch.rand(n, generator=g) < 0.4] = IGNORE_INDEX
    return h, w, t, v


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_with_ignored_targets_equals_plain(reduction):
    h, w, t, v = _chunked_case()
    assert 0 < (t == IGNORE_INDEX).sum() < len(t)
    ref = F.cross_entropy(h @ w[:v].t(), t, reduction=reduction)
    ref_gh, ref_gw = torch.autograd.grad(ref, (h, w))
    got = chunked_cross_entropy(h, w, t, v, 8, reduction=reduction)
    gh, gw = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gh, ref_gh, rtol=0, atol=1e-6)
    torch.testing.assert_close(gw, ref_gw, rtol=0, atol=1e-6)
    assert gw[v:].abs().max() == 0 and gh[t == IGNORE_INDEX].abs().max() == 0
    with torch.no_grad():  # evaluation: the loop without gradients
        torch.testing.assert_close(chunked_cross_entropy(h, w, t, v, 8, reduction=reduction), ref.detach(),
                                   rtol=1e-6, atol=1e-6)
    # the operator torch.compile records, run eagerly: the same sum and gradients
    total = _chunked_op(h, w, t, v, 8, IGNORE_INDEX, True, True)[0]
    op = total / (t != IGNORE_INDEX).sum() if reduction == "mean" else total
    oh, ow = torch.autograd.grad(op, (h, w))
    torch.testing.assert_close(op, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(oh, ref_gh, rtol=0, atol=1e-6)
    torch.testing.assert_close(ow, ref_gw, rtol=0, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_of_an_all_ignored_batch_is_zero_with_zero_gradients(reduction):
    h, w, t, v = _chunked_case(1)
    t[:] = IGNORE_INDEX
    loss = chunked_cross_entropy(h, w, t, v, 8, reduction=reduction)
    gh, gw = torch.autograd.grad(loss, (h, w))
    assert loss.item() == 0.0 and gh.abs().max() == 0 and gw.abs().max() == 0
    assert torch.isfinite(gh).all() and torch.isfinite(gw).all()
    assert F.cross_entropy(h @ w[:v].t(), t, reduction="sum").item() == 0.0  # the plain sum agrees


def test_model_sum_reduction_is_the_same_for_both_loss_forms(chat):
    from tokenmill.model.build import build_gpt

    data = build_datasets(DataConfig(path=str(chat["data"])), T, 0)
    x, y = (torch.stack(v).long() for v in zip(*(data.train[k] for k in range(4))))
    losses, grads = [], []
    for impl in ("full", "chunked"):
        torch.manual_seed(0)
        chunk = {"model.loss_chunk_size": 24} if impl == "chunked" else {}
        cfg = tiny_cfg(**{"model.vocab_size": data.vocab_size, "model.block_size": T, "model.loss_impl": impl, **chunk})
        model = build_gpt(cfg.model, data.vocab_size, torch.device("cpu"))
        loss = model(x, y, reduction="sum")[1]
        losses.append(loss)
        grads.append(torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad]))
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    for a, b in zip(*grads):  # sums over 128 tokens: gradients of a few units, fp32 summation order
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# the loss over the global batch's learned tokens


def reference(trainer, global_batch: int, split: int) -> dict:
    """By hand, on the run's model before its first step: the global batch's per-token mean (cross-entropy
    with ignore_index, summed, / learned count) and its gradients; and the per-micro-batch means averaged over
    ``split`` micro-batches, which differs when the micro-batches hold different learned counts."""
    model, ds = trainer.model, trainer.data.train
    x, y = (torch.stack(v).long() for v in zip(*(ds[k] for k in range(global_batch))))
    params = [p for p in model.parameters() if p.requires_grad]
    logits = model(x)[0]
    ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none")
    learned = (y != IGNORE_INDEX).reshape(-1)
    loss = ce.sum() / learned.sum()
    naive = torch.stack([c.sum() / k.sum() for c, k in zip(ce.chunk(split), learned.chunk(split))]).mean()
    with torch.no_grad():  # validation: the mean over every val batch's learned targets
        vx, vy = (torch.cat(v).long() for v in zip(*trainer.val))
        val = F.cross_entropy(model(vx)[0].flatten(0, 1), vy.flatten(), reduction="sum") / (vy != IGNORE_INDEX).sum()
    return {"loss": loss.item(), "grads": torch.autograd.grad(loss, params, retain_graph=True),
            "val": val.item(), "evaluated": trainer.evaluate(),
            "naive": torch.autograd.grad(naive, params), "learned": int(learned.sum()), "params": params,
            "counts": [int(k.sum()) for k in learned.chunk(split)]}


def one_step(folder: Path, run: Path, impl: str, batch: int, accum: int) -> dict:
    seen: dict = {}

    def on_optimizer(opt):  # the accumulated gradients the optimizer gets
        opt.register_step_pre_hook(
            lambda *_: seen.update(grads=[p.grad.detach().clone() for p in seen["ref"]["params"]]))

    chunk = {"model.loss_chunk_size": 40} if impl == "chunked" else {}
    cfg = tiny_cfg(**chat_over(folder, **{"model.loss_impl": impl, **chunk, "train.max_steps": 1,
                                          "train.batch_size": batch, "train.grad_accum_steps": accum,
                                          "optim.grad_clip": 0.0, "checkpoint.save_final": False,
                                          "train.eval_batches": 3}))
    cb = Callbacks(on_optimizer_built=on_optimizer,
                   on_train_start=lambda tr: seen.update(ref=reference(tr, batch * accum, 4)))
    summary = train(cfg, run, quiet=True, callbacks=cb)
    return {**seen, "row": [r for r in read_metrics(run) if "loss" in r][0], "summary": summary}


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["full", "chunked"])
def test_masked_loss_is_the_global_token_mean_for_every_accumulation_split(chat, tmp_path, impl):
    for batch, accum in ((8, 1), (4, 2), (2, 4)):
        got = one_step(chat["data"], tmp_path / f"{impl}-{accum}", impl, batch, accum)
        ref = got["ref"]
        assert got["row"]["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=0)
        for g, r in zip(got["grads"], ref["grads"]):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-6)
        assert got["row"]["learned_tokens"] == ref["learned"]
        assert got["row"]["learned_frac"] == pytest.approx(ref["learned"] / (8 * T))
        assert ref["evaluated"] == pytest.approx(ref["val"], rel=1e-6)
    assert len(set(ref["counts"])) > 1  # the micro-batches differ, so the split matters:
    assert max((a - b).abs().max().item() for a, b in zip(ref["naive"], ref["grads"])) > 1e-4  # naive means differ


TASKS_2 = {"eval.tasks": "tokenmill_tiny_mc,tokenmill_tiny_ppl", "eval.tasks_limit": 4,
           "eval.include_path": str(TASKS)} if importlib.util.find_spec("lm_eval") else {}
RUNS_2 = {"ddp": {"train.grad_accum_steps": 2, **TASKS_2},  # eval.tasks: the ranks split the documents
          "fsdp": {"parallel.dp_shard": 2, "model.loss_impl": "chunked", "model.loss_chunk_size": 40}}


def two_rank_jobs(tmp: Path) -> list[dict]:
    """DDP and FSDP on 2 gloo processes, on a chat folder prepared here first (in ``tmp/chat``), trained in the
    shared 2-rank launch (conftest.two_rank_launch: one launch's imports for several files)."""
    from test_parallel import common

    data = prepare_data(tmp / "chat")
    return [{"cfg": common(**chat_over(data, **over)), "run_dir": str(tmp / name)} for name, over in RUNS_2.items()]


@pytest.mark.slow
def test_two_processes_give_the_one_process_loss(two_rank_launch, tmp_path):
    """DDP with accumulation (plain loss) and FSDP (chunked loss) on 2 gloo processes (the shared torchrun launch):
    the per-step losses of one process with the same global batch."""
    from test_parallel import assert_same_losses, losses, single

    runs, tasks = two_rank_launch / "sft", TASKS_2
    data = runs / "chat" / "data"
    for name, over in RUNS_2.items():
        over = {k: v for k, v in over.items() if not k.startswith(("parallel.", "eval."))}
        ref = single(tmp_path, f"ref-{name}", **chat_over(data, **over))
        assert_same_losses(losses(runs / name), ref, what=name)
        rows = [r for r in read_metrics(runs / name) if "loss" in r]
        assert all(0 < r["learned_frac"] < 1 for r in rows)
    if tasks:  # the scores two ranks gathered at the end equal one process scoring the same final weights
        split = {k: v for k, v in json.loads((runs / "ddp" / "summary.json").read_text()).items()
                 if k.startswith("tasks/")}
        out = tmp_path / "one.json"
        r = run_cli("eval", runs / "ddp", "--tasks", tasks["eval.tasks"], "--limit", 4, "--include-path", TASKS,
                    "--device", "cpu", "--out", out)
        assert r.returncode == 0, r.stderr
        one = scores(json.loads(out.read_text()))
        assert set(split) == set(one) and any("word_perplexity" in k for k in one), (split, one)
        assert all(split[k] == pytest.approx(one[k], rel=1e-6) for k in one), (split, one)


@pytest.mark.slow
def test_chat_run_extended_by_resume_is_bit_identical(chat, tmp_path):
    """tiny-llama on the chat folder with accumulation, dropout and masked evaluation: N steps resumed to 2N give
    the uninterrupted run's losses, validation losses, learned counts and weights bit for bit."""
    from test_parallel import preset_cfg

    over = chat_over(chat["data"], **{"model.dropout": 0.1, "optim.decay_steps": 8, "train.eval_every_steps": 2,
                                      "train.eval_batches": 1, "train.grad_accum_steps": 2, "train.batch_size": 2})
    train(preset_cfg("tiny-llama", **over, **{"train.max_steps": 8}), tmp_path / "full", quiet=True)
    train(preset_cfg("tiny-llama", **over, **{"train.max_steps": 4}), tmp_path / "cut", quiet=True)
    train(preset_cfg("tiny-llama", **over, **{"train.max_steps": 8}), tmp_path / "cut", resume=True, quiet=True)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    for key in ("loss", "val_loss", "grad_norm", "learned_tokens"):
        want = [(r["step"], r[key]) for r in full if key in r]
        assert [(r["step"], r[key]) for r in cut if key in r] == want and len(want) >= 4, key
    assert all(math.isfinite(v) for _, v in [(r["step"], r["val_loss"]) for r in full if "val_loss" in r])
    a, b = ckpt.read_latest(tmp_path / "full")[1]["model"], ckpt.read_latest(tmp_path / "cut")[1]["model"]
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ----------------------------------------------------------------------------------------------
# the command line: prepare a chat JSONL with a Llama folder, fine-tune it


@pytest.mark.slow
def test_cli_prepares_and_fine_tunes_a_llama_folder_on_chat_data(chat, tmp_path, capsys):
    import transformers

    from tokenmill.cli import main

    folder = tmp_path / "llama"
    _build("llama3", folder, (TEMPLATES / "llama3.jinja").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    data, run = tmp_path / "data", tmp_path / "run"
    assert main(["prepare", str(chat["jsonl"]), "--out", str(data), "--format", "chat", "--tokenizer-from",
                 str(folder), "--workers", "1", "--no-progress", "--val-fraction", "0.2"]) == 0
    args = ["--train.init_from", str(folder), "--data.path", str(data), "--train.device", "cpu", "--log.progress",
            "plain", "--log.tensorboard", "false", "--model.block_size", str(T), "--train.batch_size", "2",
            "--train.grad_accum_steps", "2", "--train.max_steps", "3", "--log.every_steps", "1",
            "--train.eval_batches", "1", "--log.timing_warmup_steps", "1"]
    assert main(["train", "--run-dir", str(run), *args]) == 0
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and 0 < r["learned_frac"] < 1 for r in rows)
    assert all(r["learned_tokens"] == round(r["learned_frac"] * 4 * T) for r in rows)
    summary = json.loads((run / "summary.json").read_text())
    assert 0 < summary["learned_tokens_per_sec"] < summary["tokens_per_sec"]
    assert math.isfinite(summary["val_loss"])
    # data.loss_mask true on a folder without masks: one line naming the field and the fix
    capsys.readouterr()
    assert main(["train", "--run-dir", str(tmp_path / "text"), "--preset", "tiny", "--data.path", str(chat["text"]),
                 "--data.loss_mask", "true", "--train.device", "cpu", "--train.max_steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "data.loss_mask is true" in err and "--format chat" in err and "Traceback" not in err


@pytest.mark.slow
def test_compiled_chunked_loss_skips_ignored_targets():
    """The chunked loss compiled (one operator) with ignored targets: the eager sum and gradients; an all-ignored
    batch gives 0 and zero gradients."""
    from tokenmill.model.build import build_gpt

    torch.manual_seed(0)
    cfg = tiny_cfg(**{"model.block_size": T, "model.loss_impl": "chunked", "model.loss_chunk_size": 24})
    model = build_gpt(cfg.model, 64, torch.device("cpu"))
    x = torch.randint(0, 64, (3, T), generator=torch.Generator().manual_seed(1))
    y = torch.where(torch.rand(3, T, generator=torch.Generator().manual_seed(2)) < 0.5, x.roll(-1, 1), IGNORE_INDEX)
    params = [p for p in model.parameters() if p.requires_grad]
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for target in (y, torch.full_like(y, IGNORE_INDEX)):
        want = model(x, target, reduction="sum")[1]
        got = compiled(x, target, reduction="sum")[1]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(want, params)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert got.item() == 0.0 and all(g.abs().max() == 0 for g in torch.autograd.grad(compiled(x, target)[1], params))
