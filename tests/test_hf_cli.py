"""Fine-tuning and the Hugging Face world through the command line: ``train --train.init_from``,
``export``, ``eval``, ``sample``'s options, and the README's fine-tuning example as written.

Every Hugging Face model is a small random ``transformers.GPT2LMHeadModel`` saved here (no download),
its parameters perturbed so that a mapping mistake shows in the logits; its tokenizer is a byte-level
BPE trained here on a small text, written as Hugging Face tokenizer files into the model folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli, tiny_cfg
from tokenmill import checkpoint
from tokenmill.cli import main
from tokenmill.errors import CheckpointError, ConfigError
from tokenmill.train.metrics import read_metrics
from tokenmill.train.trainer import train

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tokenmill[hf]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'tokenmill[hf]')")

ROOT = Path(__file__).resolve().parents[1]
TEXT = "def area(r):\n    return 3.14 * r ** 2  # aire du cercle, 円の面積\n\nclass Point:\n    x: int = 0\n" * 60
NEW = "def volume(r, h):\n    return area(r) * h  # volume du cylindre, 円柱\n\nprint(volume(2, 3))\n" * 40
N_POS = 64
TRAIN = ["--train.device", "cpu", "--log.progress", "plain", "--log.tensorboard", "false", "--model.block_size", "32",
         "--train.batch_size", "2", "--train.eval_batches", "1", "--optim.warmup_steps", "1"]


def hf_gpt2(folder: Path, tok, tie: bool, seed: int = 0, safetensors: bool = True) -> Path:
    """A random GPT-2 of ``tok``'s vocabulary saved in ``folder`` with ``tok``'s HF tokenizer files."""
    from tokenmill.data.tokenizers import write_hf_tokenizer

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=tok.vocab_size, n_positions=N_POS, n_embd=48, n_layer=3, n_head=4,
                                  tie_word_embeddings=tie, bos_token_id=tok.eot_id, eos_token_id=tok.eot_id,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    m = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    m.save_pretrained(folder)
    if not safetensors:  # the older form: a pickled state dict (read with weights_only=True)
        (folder / "model.safetensors").unlink()
        torch.save(m.state_dict(), folder / "pytorch_model.bin")
    write_hf_tokenizer(tok, folder)
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A BPE data folder (the 'pretraining' tokenizer), two GPT-2 folders using it (tied: safetensors;
    untied: pytorch_model.bin), and new text prepared with --tokenizer-from the tied folder."""
    from tokenmill.data import load_tokenizer_for_data, prepare

    d = tmp_path_factory.mktemp("hfcli")
    (d / "base.txt").write_text(TEXT)
    (d / "new.txt").write_text(NEW)
    base = prepare(d / "base.txt", d / "base", "bpe", vocab_size=320, workers=1, progress=False)
    tok = load_tokenizer_for_data(base)
    hf_gpt2(d / "gpt2-tied", tok, tie=True)
    hf_gpt2(d / "gpt2-untied", tok, tie=False, seed=1, safetensors=False)
    assert (d / "gpt2-untied" / "pytorch_model.bin").is_file()
    assert main(["prepare", str(d / "new.txt"), "--out", str(d / "data"), "--tokenizer-from", str(d / "gpt2-tied"),
                 "--no-progress", "--workers", "1"]) == 0
    return d


def ids(vocab: int, n: int = 3, T: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (n, T), generator=torch.Generator().manual_seed(seed))


def vocab(folder: Path) -> int:
    return json.loads((folder / "config.json").read_text())["vocab_size"]


def hf_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    m = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return m(x).logits


def tm_logits(run: Path, x: torch.Tensor) -> torch.Tensor:
    model, _, _ = checkpoint.load_model(run)
    with torch.no_grad():
        return model.eval()(x)[0]


# ----------------------------------------------------------------------------------------------
# init_from -> export -> transformers


@pytest.mark.slow
@pytest.mark.parametrize("tie,forms", [(True, []), (False, ["--model.fused_qkv", "false", "--model.vocab_pad_multiple", "64"])],
                         ids=["tied-safetensors", "untied-bin-separate-qkv-padded"])
def test_round_trip_gives_the_original_then_the_trained_logits(world, tmp_path, tie, forms):
    src = world / ("gpt2-tied" if tie else "gpt2-untied")
    x = ids(vocab(src))
    original = hf_logits(src, x)

    # 0 steps: the run's step-0 checkpoint is the source model; exported, transformers gives its logits
    run0 = tmp_path / "ft0"
    assert main(["train", "--train.init_from", str(src), "--data.path", str(world / "data"), "--run-dir", str(run0),
                 "--train.max_steps", "0", *TRAIN, *forms]) == 0
    assert [s for s, _ in checkpoint.list_checkpoints(run0)] == [0]
    assert main(["export", "--run-dir", str(run0), "--out", str(tmp_path / "hf0")]) == 0
    files = sorted(p.name for p in (tmp_path / "hf0").iterdir())
    assert files == ["config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json",
                     "tokenizer_config.json"]
    conf = json.loads((tmp_path / "hf0" / "config.json").read_text())
    assert conf["tie_word_embeddings"] is tie and conf["n_positions"] == 32  # the run's block_size
    torch.testing.assert_close(hf_logits(tmp_path / "hf0", x), original, atol=1e-4, rtol=0)
    torch.testing.assert_close(tm_logits(run0, x), original, atol=1e-4, rtol=0)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf0")
    assert auto.decode(auto(NEW[:200])["input_ids"]) == NEW[:200]

    # 3 steps: fresh optimizer and schedule from step 0 (1 warm-up step: the full lr at once); the
    # export equals the trained tokenmill model
    run3 = tmp_path / "ft3"
    assert main(["train", "--train.init_from", str(src), "--data.path", str(world / "data"), "--run-dir", str(run3),
                 "--train.max_steps", "3", "--log.every_steps", "1", "--optim.lr", "1e-2", *TRAIN, *forms]) == 0
    rows = [r for r in read_metrics(run3) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["lr"] == pytest.approx(1e-2)  # warm-up of 1 step
    assert main(["export", "--run-dir", str(run3), "--out", str(tmp_path / "hf3")]) == 0
    trained = tm_logits(run3, x)
    assert (trained - original).abs().max() > 1e-2  # training changed the model
    torch.testing.assert_close(hf_logits(tmp_path / "hf3", x), trained, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_init_from_a_run_converts_forms_and_starts_fresh(tmp_path):
    """A tokenmill run as the source: the new run may use other forms (separate q/k/v, padding, a
    shorter block, an untied head); at step 0 it computes the source's logits; its schedule starts at
    step 0."""
    src_cfg = tiny_cfg(**{"train.max_steps": 3, "train.eval_batches": 0})
    train(src_cfg, tmp_path / "src", quiet=True)
    over = {"train.init_from": str(tmp_path / "src"), "train.max_steps": 0, "train.eval_batches": 0,
            "model.fused_qkv": False, "model.vocab_pad_multiple": 16, "model.block_size": 16,
            "model.tie_embeddings": False}
    train(tiny_cfg(**over), tmp_path / "ft", quiet=True)
    x = ids(64, T=16)
    torch.testing.assert_close(tm_logits(tmp_path / "ft", x), tm_logits(tmp_path / "src", x), atol=1e-6, rtol=0)
    assert checkpoint.load_model(tmp_path / "ft")[1].model.tie_embeddings is False
    # a checkpoint file of a run works as a source too; two steps from step 0 with a fresh schedule
    ckpt = checkpoint.list_checkpoints(tmp_path / "src")[-1][1]
    over.update({"train.init_from": str(ckpt), "train.max_steps": 2, "log.every_steps": 1})
    train(tiny_cfg(**over), tmp_path / "ft2", quiet=True)
    assert [r["step"] for r in read_metrics(tmp_path / "ft2") if "loss" in r] == [1, 2]
    _, state = checkpoint.read_latest(tmp_path / "ft2")
    assert state["step"] == 2 and state["config"]["train"]["init_from"] == str(ckpt)


@pytest.mark.slow
def test_shape_conflicts_and_vocabulary_mismatch_are_clear(world, tmp_path, capsys):
    src = world / "gpt2-tied"

    def run(name: str, *extra: str, data: Path = world / "data") -> int:
        return main(["train", "--train.init_from", str(src), "--data.path", str(data), "--run-dir",
                     str(tmp_path / name), "--train.max_steps", "0", *TRAIN, *extra])

    assert run("a", "--model.n_layer", "2") == 2
    err = capsys.readouterr().err
    assert "config error" in err and "model.n_layer = 2" in err and "n_layer = 3" in err and str(src) in err
    assert run("a", "--model.block_size", "128") == 2
    assert "exceeds the context" in capsys.readouterr().err and not (tmp_path / "a").exists()
    # a preset's shape is not a choice: the source's wins (tiny has 2 layers of width 32)
    assert run("b", "--preset", "tiny") == 0
    assert (checkpoint.load_model(tmp_path / "b")[1].model.n_layer, checkpoint.load_model(tmp_path / "b")[1].model.n_embd) == (3, 48)
    # Python API: a value other than the default that contradicts the source is a conflict
    with pytest.raises(ConfigError, match="model.n_layer = 2 conflicts"):
        train(tiny_cfg(**{"data.source": "tokens", "data.path": str(world / "data"), "model.vocab_size": None,
                          "train.init_from": str(src)}), tmp_path / "api")
    # data tokenized with another tokenizer: the fix is prepare --tokenizer-from
    from tokenmill.data import prepare

    prepare(world / "new.txt", tmp_path / "bytes", "bytes", workers=1, progress=False)
    assert run("c", data=tmp_path / "bytes") == 1
    err = capsys.readouterr().err
    assert "vocabulary of 256 ids" in err and f"--tokenizer-from {src}" in err and "Traceback" not in err
    # the same number of ids but other tokens (e.g. a BPE trained anew on the new text): refused too
    import shutil

    shutil.copytree(world / "data", tmp_path / "other")
    tj = tmp_path / "other" / "tokenizer.json"
    t = json.loads(tj.read_text())
    k1, k2 = list(t["model"]["vocab"])[-2:]
    t["model"]["vocab"][k1], t["model"]["vocab"][k2] = t["model"]["vocab"][k2], t["model"]["vocab"][k1]
    tj.write_text(json.dumps(t))
    assert run("d", data=tmp_path / "other") == 1
    assert "tokens differ" in capsys.readouterr().err
    assert main(["train", "--train.init_from", str(tmp_path / "nowhere"), "--run-dir", str(tmp_path / "n"), *TRAIN]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_ignores_init_from(world, tmp_path, capsys):
    """--resume continues the run's own checkpoint (bit-exactly, as an uninterrupted run) even when
    --train.init_from names another model."""

    def run(name: str, *extra: str) -> int:
        return main(["train", "--data.path", str(world / "data"), "--run-dir", str(tmp_path / name), *TRAIN, *extra])

    assert run("r", "--train.init_from", str(world / "gpt2-tied"), "--train.max_steps", "1") == 0
    capsys.readouterr()
    assert run("r", "--resume", "--train.init_from", str(world / "gpt2-untied"), "--train.max_steps", "2") == 0
    out = capsys.readouterr()
    assert "--train.init_from is ignored" in out.err and "resumed from" in out.out
    assert run("straight", "--train.init_from", str(world / "gpt2-tied"), "--train.max_steps", "2") == 0
    x = ids(vocab(world / "gpt2-tied"), T=8)
    assert torch.equal(tm_logits(tmp_path / "r", x), tm_logits(tmp_path / "straight", x))


# ----------------------------------------------------------------------------------------------
# export


@pytest.mark.slow
def test_export_refuses_what_gpt2_cannot_express_and_never_overwrites(tmp_path, capsys):
    train(tiny_cfg(**{"train.max_steps": 1, "model.bias": False, "train.eval_batches": 0}), tmp_path / "nobias", quiet=True)
    assert main(["export", "--run-dir", str(tmp_path / "nobias"), "--out", str(tmp_path / "o")]) == 1
    assert "model.bias=false" in capsys.readouterr().err and not (tmp_path / "o").exists()

    train(tiny_cfg(**{"train.max_steps": 2, "checkpoint.every_steps": 1, "train.eval_batches": 0}), tmp_path / "r",
          quiet=True)
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        from tokenmill.checkpoint.export import export_hf

        export_hf(tmp_path / "r", out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    first = checkpoint.list_checkpoints(tmp_path / "r")[0][1]
    # --overwrite replaces only an earlier export: a folder with other files is refused, untouched
    assert main(["export", "--run-dir", str(tmp_path / "r"), "--out", str(out), "--overwrite"]) == 1
    assert "keep.txt" in capsys.readouterr().err and sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert main(["export", "--run-dir", str(tmp_path / "r"), "--out", str(out)]) == 1  # not empty
    (out / "keep.txt").unlink()
    assert main(["export", "--run-dir", str(tmp_path / "r"), "--out", str(out)]) == 0  # an earlier export
    capsys.readouterr()
    assert main(["export", "--run-dir", str(tmp_path / "r"), "--out", str(out), "--overwrite", "--checkpoint",
                 str(first)]) == 0
    printed = capsys.readouterr()
    assert "synthetic tokens" in printed.err and str(first) in printed.out  # no tokenizer files, and why
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".o.*"))  # no temporary folders left
    x = ids(64, T=16)
    model, _, _ = checkpoint.load_model(tmp_path / "r", first)
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(out, x), model.eval()(x)[0], atol=1e-4, rtol=0)


def fsdp_args(d: Path) -> list[str]:
    return ["--train.init_from", str(d / "gpt2-untied"), "--data.path", str(d / "data"), "--train.max_steps", "2",
            *TRAIN]


def two_rank_jobs(tmp: Path) -> list[dict]:
    """The FSDP run of test_fsdp_init_from_and_sharded_export, from an untied GPT-2 folder and text prepared
    with its tokenizer (built here first, in ``tmp``), trained in the shared 2-rank launch
    (conftest.two_rank_launch, TWO_RANK)."""
    from tokenmill.data import load_tokenizer_for_data, prepare

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "base.txt").write_text(TEXT)
    (tmp / "new.txt").write_text(NEW)
    tok = load_tokenizer_for_data(prepare(tmp / "base.txt", tmp / "base", "bpe", vocab_size=320, workers=1,
                                          progress=False))
    hf_gpt2(tmp / "gpt2-untied", tok, tie=False, seed=1, safetensors=False)
    assert main(["prepare", str(tmp / "new.txt"), "--out", str(tmp / "data"), "--tokenizer-from",
                 str(tmp / "gpt2-untied"), "--no-progress", "--workers", "1"]) == 0
    return [{"argv": [*fsdp_args(tmp), "--parallel.dp_shard", "2"], "run_dir": str(tmp / "fsdp")}]


@pytest.mark.slow
def test_fsdp_init_from_and_sharded_export(two_rank_launch, tmp_path):
    """FSDP over 2 gloo processes (the shared torchrun launch): the HF weights are loaded before sharding (the
    run equals one process on the same global batch), its DCP checkpoint exports to the same logits."""
    d = two_rank_launch / "hf"
    path = checkpoint.list_checkpoints(d / "fsdp")[-1][1]
    assert path.suffix == ".dcp" and len(list(path.glob("*.distcp"))) == 2
    assert main(["train", *fsdp_args(d), "--train.batch_size", "4", "--run-dir", str(tmp_path / "one")]) == 0  # the same global batch
    x = ids(vocab(d / "gpt2-untied"))
    fsdp = tm_logits(d / "fsdp", x)
    torch.testing.assert_close(fsdp, tm_logits(tmp_path / "one", x), atol=1e-4, rtol=0)
    assert main(["export", "--run-dir", str(d / "fsdp"), "--out", str(tmp_path / "hf")]) == 0
    torch.testing.assert_close(hf_logits(tmp_path / "hf", x), fsdp, atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------
# eval


@pytest.mark.slow
def test_eval_whole_split_counts_every_token_and_byte(world, tmp_path, capsys):
    from tokenmill.data import load_tokenizer_for_data
    from tokenmill.train.evaluate import EVAL_FILE, token_byte_lengths

    run = tmp_path / "r"
    assert main(["train", "--train.init_from", str(world / "gpt2-tied"), "--data.path", str(world / "data"),
                 "--run-dir", str(run), "--train.max_steps", "0", *TRAIN]) == 0
    capsys.readouterr()
    assert main(["eval", "--run-dir", str(run), "--device", "cpu", "--batch-size", "3"]) == 0
    out = capsys.readouterr().out
    r = json.loads((run / EVAL_FILE).read_text())
    assert f"perplexity {r['perplexity']:.3f}" in out and "bits/byte" in out
    val = np.fromfile(world / "data" / "val.bin", dtype=np.uint16).astype(np.int64)
    tok = load_tokenizer_for_data(world / "data")
    assert r["tokens"] == len(val) - 1 and r["whole_split"] and r["step"] == 0
    # bytes: each token's exact byte string (multi-byte characters split over tokens included); the
    # tokens of the whole text add up to its UTF-8 length (the end-of-text id counts 0)
    lengths = token_byte_lengths(tok, tok.vocab_size)
    assert lengths[tok.encode(NEW) + [tok.eot_id]].sum() == len(NEW.encode("utf-8"))
    assert r["bytes"] == lengths[val[1:]].sum()
    # reference: the source model over the same consecutive windows, by transformers
    m = transformers.GPT2LMHeadModel.from_pretrained(world / "gpt2-tied").eval()
    nats = 0.0
    with torch.no_grad():
        for s in range(0, len(val) - 1, 32):
            w = torch.from_numpy(val[s : s + 33])[None]
            logits = m(w[:, :-1]).logits
            nats += torch.nn.functional.cross_entropy(logits[0], w[0, 1:], reduction="sum").item()
    assert r["val_loss"] == pytest.approx(nats / r["tokens"], rel=1e-5)
    assert r["perplexity"] == pytest.approx(math.exp(r["val_loss"]), rel=1e-9)
    assert r["bits_per_byte"] == pytest.approx(nats / math.log(2) / r["bytes"], rel=1e-5)


@pytest.mark.slow
def test_eval_batches_equal_training_val_loss_and_json(tmp_path, capsys):
    """``--batches N`` evaluates the training run's own validation windows: the same val_loss."""
    from tokenmill.data import prepare

    (tmp_path / "t.txt").write_text(NEW)
    data = prepare(tmp_path / "t.txt", tmp_path / "data", "bytes", workers=1, progress=False)
    cfg = tiny_cfg(**{"data.source": "tokens", "data.path": str(data), "model.vocab_size": None,
                      "train.max_steps": 2, "train.eval_batches": 3})
    summary = train(cfg, tmp_path / "r", quiet=True)
    assert main(["eval", "--run-dir", str(tmp_path / "r"), "--batches", "3", "--json", "--device", "cpu"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert r["batches"] == 3 and r["windows"] == 12 and r["tokens"] == 12 * 32 and r["bytes"] == r["tokens"]
    assert json.loads((tmp_path / "r" / "eval.json").read_text()) == r
    # other data with another tokenizer, and a synthetic run without --data.path: clear errors
    prepare(tmp_path / "t.txt", tmp_path / "bpe", "bpe", vocab_size=300, workers=1, progress=False)
    assert main(["eval", "--run-dir", str(tmp_path / "r"), "--data.path", str(tmp_path / "bpe"), "--device", "cpu"]) == 1
    assert "--tokenizer-from" in capsys.readouterr().err
    train(tiny_cfg(**{"train.max_steps": 1, "train.eval_batches": 0}), tmp_path / "s", quiet=True)
    assert main(["eval", "--run-dir", str(tmp_path / "s"), "--device", "cpu"]) == 1
    assert "synthetic" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# sample


@pytest.mark.slow
def test_sample_options(tmp_path, capsys):
    from tokenmill.data import prepare

    (tmp_path / "t.txt").write_text(NEW)
    data = prepare(tmp_path / "t.txt", tmp_path / "data", "bytes", workers=1, progress=False)
    train(tiny_cfg(**{"data.source": "tokens", "data.path": str(data), "model.vocab_size": None, "train.max_steps": 4,
                      "train.eval_batches": 0, "checkpoint.every_steps": 2}), tmp_path / "r", quiet=True)
    run = str(tmp_path / "r")

    def sample(*extra) -> str:
        assert main(["sample", "--run-dir", run, "--prompt", "def ", "--max-new-tokens", "40", *extra]) == 0
        return capsys.readouterr().out

    greedy = sample("--temperature", "0")
    assert greedy.startswith("def ") and greedy == sample("--temperature", "0", "--no-kv-cache")
    assert greedy == sample("--temperature", "0", "--seed", "5", "--top-p", "0.3")  # greedy ignores the draws
    many = sample("--num-samples", "3", "--top-p", "0.9", "--temperature", "1.5", "--top-k", "0")
    parts = re.split(r"--- sample \d/3 ---\n", many)
    assert parts[0] == "" and len(parts) == 4 and all(p.startswith("def ") for p in parts[1:])
    assert len(set(parts[1:])) > 1 and many == sample("--num-samples", "3", "--top-p", "0.9", "--temperature", "1.5",
                                                      "--top-k", "0")  # seeded
    first = checkpoint.list_checkpoints(run)[0][1]
    assert sample("--temperature", "0", "--checkpoint", str(first)).startswith("def ")
    for bad, msg in ((["--top-p", "0"], "--top-p"), (["--num-samples", "0"], "--num-samples"),
                     (["--checkpoint", str(tmp_path / "none.pt")], "does not exist")):
        assert main(["sample", "--run-dir", run, *bad]) == 1
        assert msg in capsys.readouterr().err
    helptext = run_cli("sample", "--help").stdout
    for opt in ("--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--num-samples", "--seed",
                "--device", "--checkpoint", "--no-kv-cache"):
        entry = re.search(rf"\n  {opt}\b(.*?)(?=\n  -|\Z)", helptext, re.S)
        assert entry and "default" in entry.group(1), opt


# ----------------------------------------------------------------------------------------------
# The README's fine-tuning example, as written


def readme_example() -> list[str]:
    text = (ROOT / "README.md").read_text()
    body = text.split("<!-- finetune-example:start -->", 1)[1].split("<!-- finetune-example:end -->", 1)[0]
    code = body.split("```bash", 1)[1].split("```", 1)[0]
    lines = [ln for ln in code.replace("\\\n", " ").splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [shlex.split(ln, comments=True) for ln in lines]


@pytest.mark.slow
def test_readme_finetuning_example_works_as_written(world, tmp_path, monkeypatch, capsys):
    """Runs every command of the README's example in a fresh folder holding what it starts from: a
    Hugging Face GPT-2 folder ``models/gpt2`` and a folder of text ``my_texts/``. Only the
    training length and the context are cut (appended overrides) to keep the test fast."""
    import shutil

    shutil.copytree(world / "gpt2-tied", tmp_path / "models" / "gpt2")
    (tmp_path / "my_texts").mkdir()
    (tmp_path / "my_texts" / "a.txt").write_text(NEW)
    monkeypatch.chdir(tmp_path)
    commands = readme_example()
    assert [c[:2] for c in commands] == [["tokenmill", "prepare"], ["tokenmill", "train"], ["tokenmill", "eval"],
                                         ["tokenmill", "export"], ["tokenmill", "sample"]]
    for argv in commands:
        if argv[1] == "train":
            argv += ["--train.max_steps", "2", "--model.block_size", "32", "--train.device", "cpu"]
        if argv[1] in ("eval", "sample"):
            argv += ["--device", "cpu"]
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    assert "perplexity" in out
    exported = [Path(a) for c in commands if c[1] == "export" for a in c[c.index("--out") + 1 : c.index("--out") + 2]]
    assert (exported[0] / "model.safetensors").is_file() and (exported[0] / "tokenizer.json").is_file()
    assert os.path.isdir("runs")
