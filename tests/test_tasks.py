"""Task scores through EleutherAI's lm-evaluation-harness (train/tasks.py, train/lm_eval_model.py).

The reference is lm-eval's own Hugging Face backend (``lm_eval.models.huggingface.HFLM``) on tokenmill's export of
the same model, run through the same ``lm_eval.evaluator.evaluate`` (``simple_evaluate`` adds an environment report
that starts processes: pip, git). The models are small random GPT-2 and Llama models built with transformers and
a byte-level BPE trained here, imported into a run with ``train.init_from`` (0 steps: the run's step-0 checkpoint
is the imported model). The tasks are the offline ones in tests/data/tasks (multiple choice, generation until a
newline, rolling log-likelihood): nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenmill.cli import main

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tokenmill[hf]')")
pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'tokenmill[eval]')")

TASKS_DIR = Path(__file__).parent / "data" / "tasks"
TASKS = ["tokenmill_tiny_mc", "tokenmill_tiny_gen", "tokenmill_tiny_ppl"]
TEXT = ("def area(r):\n    return 3.14 * r ** 2  # aire du cercle\n\nclass Point:\n    x: int = 0\n    y: int = 0\n"
        "import math\nprint(volume(2, 3))\n") * 20
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")
ATOL = 1e-4  # log-likelihoods: fp32, the same math up to summation order


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def tokenizer(specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def hf_folder(folder: Path, family: str) -> Path:
    """A random ``family`` model (2 layers, width 32, 128 positions) with its tokenizer, every weight perturbed."""
    specials = ["<|endoftext|>"] if family == "gpt2" else ["<s>", "</s>"]
    tok = tokenizer(specials)
    bos, eos = tok.token_to_id(specials[0]), tok.token_to_id(specials[-1])
    torch.manual_seed(0)
    if family == "gpt2":
        m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=tok.get_vocab_size(), n_positions=128, n_embd=32, n_layer=2, n_head=4, bos_token_id=bos,
            eos_token_id=eos))
    else:
        m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=bos,
            eos_token_id=eos, tie_word_embeddings=False))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    m.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    chat = {"chat_template": CHAT_TEMPLATE} if family == "llama" else {}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": specials[0], "eos_token": specials[-1], **chat}))
    return folder


def run_from(folder: Path, d: Path) -> Path:
    """A run directory whose step-0 checkpoint is ``folder``'s model, on text tokenized by its tokenizer."""
    (d / "text.txt").write_text(TEXT)
    assert main(["prepare", str(d / "text.txt"), "--out", str(d / "data"), "--tokenizer-from", str(folder),
                 "--no-progress", "--workers", "1"]) == 0
    assert main(["train", "--train.init_from", str(folder), "--data.path", str(d / "data"), "--train.max_steps", "0",
                 "--train.device", "cpu", "--log.progress", "plain", "--log.tensorboard", "false",
                 "--model.block_size", "128", "--train.eval_batches", "0", "--run-dir", str(d / "run")]) == 0
    return d / "run"


def reference(folder: Path, tasks: list[str] = TASKS, chat: bool = False) -> dict:
    """lm-eval's Hugging Face backend on ``folder`` (batch 1, fp32)."""
    from lm_eval.models.huggingface import HFLM

    from tokenmill.train.tasks import run_tasks, task_manager

    lm = HFLM(pretrained=str(folder), dtype="float32", device="cpu", batch_size=1)
    return run_tasks(lm, tasks, task_manager(tasks, str(TASKS_DIR)), chat=chat, log_samples=True, bootstrap_iters=0)


def assert_same_samples(ours: dict, ref: dict, tasks: list[str] = TASKS) -> None:
    """Every document's responses equal: log-likelihoods within ATOL, greedy flags and generated text exactly."""
    for task in tasks:
        a = sorted(ours["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(ref["samples"][task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in a] == [s["doc_id"] for s in b] and a
        for x, y in zip(a, b):
            for rx, ry in zip(x["resps"], y["resps"]):
                rx, ry = rx[0], ry[0]
                if isinstance(ry, str):
                    assert rx == ry, (task, x["doc_id"])
                elif isinstance(ry, (int, float)):  # loglikelihood_rolling: one number
                    assert abs(rx - ry) <= ATOL, (task, x["doc_id"], rx, ry)
                else:  # (log-likelihood, is greedy)
                    assert abs(rx[0] - ry[0]) <= ATOL and bool(rx[1]) == bool(ry[1]), (task, x["doc_id"], rx, ry)
        for key, v in ref["results"][task].items():
            if "," in key and "_stderr" not in key:
                assert ours["results"][task][key] == pytest.approx(v, abs=1e-6), (task, key)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_scores_equal_lm_evals_hf_backend_on_the_export(tmp_path, capsys, family):
    """A run and the Hugging Face folder it came from, side by side in one call: each document's log-likelihoods
    within 1e-4 of lm-eval's own HF backend on the run's export, the generations and accuracies equal; the run's
    results JSON in the run directory, the comparison in --out, nothing written into the model folder."""
    pytest.importorskip("accelerate", reason="lm-eval's HF backend needs accelerate (pip install 'lm_eval[hf]')")
    src = hf_folder(tmp_path / "src", family)
    run = run_from(src, tmp_path)
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "export")]) == 0
    before = sorted(p.name for p in src.iterdir())
    capsys.readouterr()
    assert main(["eval", str(run), str(src), "--tasks", ",".join(TASKS), "--include-path", str(TASKS_DIR),
                 "--device", "cpu", "--batch-size", "3", "--log-samples", "--out", str(tmp_path / "both.json")]) == 0
    out = capsys.readouterr().out
    assert "| task | metric |" in out and str(run) in out and "tokenmill_tiny_mc" in out and "acc" in out
    assert sorted(p.name for p in src.iterdir()) == before
    both = json.loads((tmp_path / "both.json").read_text())
    ref = reference(tmp_path / "export")
    assert_same_samples(both[str(run)], ref)
    assert both[str(run)]["tokenmill"]["step"] == 0 and both[str(src)]["tokenmill"]["kind"] == "hf"
    for task in ("tokenmill_tiny_mc", "tokenmill_tiny_gen"):  # the folder's own tokenizer: the same ids here
        assert both[str(src)]["results"][task] == both[str(run)]["results"][task]
    assert not list(run.glob("tasks-*.json"))  # --out given: written there only
    assert main(["eval", "--run-dir", str(run), "--tasks", "tokenmill_tiny_mc", "--include-path", str(TASKS_DIR),
                 "--device", "cpu", "--limit", "2"]) == 0
    written = json.loads(next(run.glob("tasks-*.json")).read_text())
    assert written["results"]["tokenmill_tiny_mc"]["sample_len"] == 2 and "samples" not in written
    if family == "llama":  # --apply-chat-template: the folder's template, as lm-eval's HF backend applies it
        assert main(["eval", str(src), "--tasks", "tokenmill_tiny_mc", "--include-path", str(TASKS_DIR), "--device",
                     "cpu", "--apply-chat-template", "--log-samples", "--out", str(tmp_path / "chat.json")]) == 0
        chat = json.loads((tmp_path / "chat.json").read_text())
        assert chat["samples"]["tokenmill_tiny_mc"][0]["arguments"][0][0].startswith("<s>user: Question:")
        assert_same_samples(chat, reference(src, ["tokenmill_tiny_mc"], chat=True), ["tokenmill_tiny_mc"])


# ----------------------------------------------------------------------------------------------
# Bad input: one line each, nothing written


def _one_line_error(capsys, argv: list[str], *wanted: str) -> str:
    capsys.readouterr()
    assert main(argv) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert all(w in err for w in wanted), err
    return err


@pytest.mark.slow  # imports lm-eval (seconds)
def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys, monkeypatch):
    """A run with no checkpoint, a missing path, an unsupported family, a model without a tokenizer, a bad
    --include-path, lm-eval missing: one line each, nothing written; eval.tasks refused at set-up for a sharded
    model and for synthetic tokens."""
    from conftest import block_import

    tasks = ["--tasks", "tokenmill_tiny_mc", "--include-path", str(TASKS_DIR), "--device", "cpu"]
    (tmp_path / "empty-run").mkdir()
    _one_line_error(capsys, ["eval", str(tmp_path / "empty-run"), *tasks], "has no checkpoint", "empty-run")
    _one_line_error(capsys, ["eval", str(tmp_path / "nowhere"), *tasks], "no run directory")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    _one_line_error(capsys, ["eval", str(tmp_path / "bert"), *tasks], "BertModel", "GPT2LMHeadModel")
    torch.manual_seed(0)  # a GPT-2 folder without tokenizer files: the tasks' text cannot become ids
    transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1,
                                                         n_head=2)).save_pretrained(tmp_path / "notok")
    _one_line_error(capsys, ["eval", str(tmp_path / "notok"), *tasks, "--out", str(tmp_path / "r.json")],
                    "has no tokenizer")
    _one_line_error(capsys, ["eval", str(tmp_path / "notok"), "--tasks", "tokenmill_tiny_mc", "--include-path",
                             str(tmp_path / "missing")], "--include-path", "not a folder")
    weights = sorted((tmp_path / "notok").glob("model.*"))[0]  # --out over what is read: the weights stay
    before = weights.read_bytes()
    _one_line_error(capsys, ["eval", str(tmp_path / "notok"), *tasks, "--out", str(weights)], "lies inside",
                    "the model folder")
    assert weights.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert", "empty-run", "notok"]
    assert not (tmp_path / "empty-run").exists() or not list((tmp_path / "empty-run").iterdir())
    from conftest import tiny_cfg
    from tokenmill.errors import ConfigError
    from tokenmill.parallel import World
    from tokenmill.train.tasks import TaskEval

    cfg = tiny_cfg(**{"eval.tasks": "tokenmill_tiny_mc", "eval.include_path": str(TASKS_DIR)})
    with pytest.raises(ConfigError, match=r"not with a sharded model \(fsdp\)"):
        TaskEval(cfg, World(fsdp=True), tmp_path)
    with pytest.raises(ConfigError, match="trains on synthetic tokens"):
        TaskEval(cfg, World(), None)
    block_import(monkeypatch, "lm_eval")
    _one_line_error(capsys, ["eval", str(tmp_path / "notok"), *tasks], "pip install 'tokenmill[eval]'")


@pytest.mark.slow  # imports lm-eval (seconds)
def test_an_unknown_task_names_the_closest_ones():
    """Checked against lm-eval's index of --include-path (lm-eval's whole index is the same function on more
    names; building it reads every task file lm-eval ships, about 15 s)."""
    from tokenmill.errors import ConfigError
    from tokenmill.train.tasks import check_names, task_manager

    manager = task_manager(["tokenmill_tiny_mc"], str(TASKS_DIR))
    assert set(TASKS) <= set(manager.all_tasks)
    with pytest.raises(ConfigError, match="unknown task 'tokenmill_tiny_mcq'.*Closest: tokenmill_tiny_mc"):
        check_names(["tokenmill_tiny_gen", "tokenmill_tiny_mcq"], manager.all_tasks, [str(TASKS_DIR)])
    check_names(TASKS, manager.all_tasks)


def test_scores_are_logged_under_their_task():
    from tokenmill.train.loggers import scalars
    from tokenmill.train.tasks import scores

    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strict": 1.0,
                                 "sample_len": 4}}}
    got = scores(results)
    assert got == {"tasks/t/acc": 0.5, "tasks/t/exact_match/strict": 1.0}
    assert scalars({"step": 3, **got, "tasks_ms": 12.0}) == {"tasks/t/acc": 0.5, "tasks/t/exact_match/strict": 1.0,
                                                              "eval/tasks_ms": 12.0}


# ----------------------------------------------------------------------------------------------
# docs/evaluation.md's example: training with eval.tasks, then tokenmill eval and a comparison


def doc_example() -> list[list[str]]:
    import shlex

    text = (Path(__file__).parents[1] / "docs" / "evaluation.md").read_text()
    body = text.split("<!-- evaluation-example:start -->", 1)[1].split("<!-- evaluation-example:end -->", 1)[0]
    code = body.split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(ln) for ln in code.splitlines() if ln.strip()]


@pytest.mark.slow
def test_doc_example_scores_during_training_and_after(tmp_path, monkeypatch, capsys):
    """The example's commands as written (only the device fixed to the CPU): the task scores at steps 10 and 20
    in metrics.jsonl, summary.json and the progress line, their time counted as evaluation; `tokenmill eval` of
    the final checkpoint gives step 20's scores; the run and its export side by side are equal."""
    import shutil

    shutil.copytree(TASKS_DIR, tmp_path / "tests" / "data" / "tasks")
    monkeypatch.chdir(tmp_path)
    commands = doc_example()
    assert [c[:2] for c in commands] == [["tokenmill", "train"], ["tokenmill", "eval"], ["tokenmill", "export"],
                                         ["tokenmill", "eval"]]
    for argv in commands:
        argv += ["--train.device", "cpu"] if argv[1] == "train" else ["--device", "cpu"] if argv[1] == "eval" else []
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "runs/tiny/metrics.jsonl").read_text().splitlines()]
    task_rows = [r for r in rows if "tasks/tokenmill_tiny_mc/acc" in r]
    assert [r["step"] for r in task_rows] == [10, 20] and all(r["tasks_ms"] > 0 for r in task_rows)
    summary = json.loads((tmp_path / "runs/tiny/summary.json").read_text())
    last = task_rows[-1]
    assert summary["tasks/tokenmill_tiny_mc/acc"] == last["tasks/tokenmill_tiny_mc/acc"]
    assert summary["evals"] >= 3 and summary["eval_s"] * 1000 >= sum(r["tasks_ms"] for r in task_rows) * 0.99
    assert f"step     20 | tokenmill_tiny_mc/acc {last['tasks/tokenmill_tiny_mc/acc']:.4f}" in out
    after = json.loads(next((tmp_path / "runs/tiny").glob("tasks-*.json")).read_text())["results"]
    for metric in ("acc", "acc_norm"):
        assert after["tokenmill_tiny_mc"][f"{metric},none"] == last[f"tasks/tokenmill_tiny_mc/{metric}"]
    both = json.loads((tmp_path / "compare.json").read_text())
    assert both["runs/tiny"]["results"]["tokenmill_tiny_mc"] == both["exported/tiny"]["results"]["tokenmill_tiny_mc"]
