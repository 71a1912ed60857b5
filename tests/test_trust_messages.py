"""Messages a user can trust (issue 28, third pass): a switch that does nothing where it is set is named with
the switch it needs (one table, config/inert.py); every error's advice works when followed (each test follows
it); the start of a run says the CPU-threads note once per process tree and a QLoRA start prints no library
noise."""

import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import typing

import pytest

from conftest import cpu_env, run_cli, tiny_cfg
from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.config import inert
from tokenmill.train import device as D

# ----------------------------------------------------------------------------------------------
# 6. Switches that do nothing where they are set

# what each row needs besides the defaults to be off (the defaults already turn most of them off)
OFF = {"parallel.ddp_bucket_mb": {"parallel.dp_replicate": 1}, "data.cuda_prefetch": {"train.device": "cpu"},
       "data.tokenizer": {"data.path": "some/folder"}, "model.sdpa_backend": {"model.attention": "manual"},
       "model.gelu": {"model.mlp": "swiglu"}, "optim.min_lr": {"optim.schedule": "constant"},
       "train.eval_every_steps": {"train.eval_batches": 0}}


def _other_value(key: str):
    """A valid value of ``key`` other than its default."""
    tp, default, _ = C.field_specs()[key]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Literal:
        return next(a for a in args if a != default)
    tp = args[0] if args else tp
    if tp is bool:
        return not default
    if tp is str:
        return "q" if key == "lora.targets" else "x"
    if default is None:
        return 5
    if tp is float:
        return default / 2 if default else 0.5
    return default + 1


def _rows():
    return [(row, key) for row in inert.INERT for key in row.fields]


@pytest.mark.parametrize("row, key", _rows(), ids=[k for _, k in _rows()])
def test_each_inert_switch_warns_naming_the_switch_it_needs(row, key):
    first = next(k for k in row.fields)
    off = {**OFF.get(first, {}), **OFF.get(key, {})}
    cfg = C.validate(C.apply_overrides(C.Config(), {**off, key: _other_value(key)}))
    assert not row.active(cfg)
    [line] = inert.inert_warnings(cfg)
    assert line.startswith(f"{key} = ") and "does nothing" in line and line.endswith(f"it needs {row.switch}.")
    assert not inert.inert_warnings(C.validate(C.apply_overrides(C.Config(), off)))  # at its default: quiet


@pytest.mark.parametrize("preset", [None, *C.preset_names()])
def test_the_defaults_and_every_preset_have_no_inert_switch(preset):
    assert inert.inert_warnings(C.resolve(preset)) == []


def test_the_inert_warning_is_printed_once_at_start(monkeypatch, capsys):
    monkeypatch.setattr(inert, "_SHOWN", set())
    flag = ["--memory.activation_checkpointing_policy", "save-matmuls"]
    assert main(["config", "--preset", "tiny", *flag]) == 0
    C.resolve("tiny", overrides={"memory.activation_checkpointing_policy": "save-matmuls"})  # resolved again
    err = capsys.readouterr().err
    assert err.count("tokenmill: warning: memory.activation_checkpointing_policy = 'save-matmuls' does nothing") == 1
    assert "--memory.activation_checkpointing 1" in err, err
    monkeypatch.setattr(inert, "_SHOWN", set())  # following it: the warning is gone
    assert main(["config", "--preset", "tiny", *flag, "--memory.activation_checkpointing", "1"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_only_the_users_choices_are_warned_about(tmp_path, monkeypatch, capsys):
    """A preset's value (tiny's data.tokenizer 'bytes') or a run's recorded config.toml is not the user's
    choice; a flag or a hand-written config file is."""
    monkeypatch.setattr(inert, "_SHOWN", set())
    cfg = C.resolve("tiny", overrides={"data.path": "some/folder"})
    assert capsys.readouterr().err == ""
    C.resolve("tiny", overrides={"data.path": "some/folder", "data.tokenizer": "gpt2"})
    assert "data.tokenizer = 'gpt2' does nothing" in capsys.readouterr().err
    cfg.compile.mode = "max-autotune"
    C.save(cfg, tmp_path / "config.toml")  # as a run records it: --resume feeds it back
    C.resolve(config_files=[str(tmp_path / "config.toml")])
    assert capsys.readouterr().err == ""
    (tmp_path / "mine.toml").write_text('[compile]\nmode = "max-autotune"\n')
    C.resolve("tiny", config_files=[str(tmp_path / "mine.toml")])
    assert "compile.mode = 'max-autotune' does nothing in this config: it needs --compile.enabled true" in \
        capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# 8. Advice that works when followed


def _tokenmill(*args, env=None, **kw):
    return subprocess.run([sys.executable, "-m", "tokenmill", *map(str, args)], capture_output=True, text=True,
                          env=env or cpu_env(), timeout=600, **kw)


class _Out(typing.NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def _run(capsys, *args) -> _Out:
    """The command through ``cli.main`` in this process (what a user types, without a new interpreter's start-up:
    the tests that need a real process, its signals or its file descriptors, use :func:`_tokenmill`)."""
    capsys.readouterr()
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return _Out(rc, out.out, out.err)


def _bytes_data(tmp_path):
    (tmp_path / "a.txt").write_text("the cat sat on the mat. " * 400)
    rc = main(["prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "data"), "--tokenizer", "bytes",
               "--no-progress", "--workers", "1"])
    assert rc == 0
    return tmp_path / "data"


TINY = ["--preset", "tiny", "--train.device", "cpu", "--log.progress", "plain", "--train.eval_batches", "0"]


@pytest.mark.slow
def test_a_run_diverging_at_its_second_step_can_follow_its_advice(tmp_path, capsys):
    """The only checkpoint produced the NaN and is set aside: the stop advises --resume after changing a
    setting, and sample says so too; following them trains from step 0 and sample then works."""
    run, data = tmp_path / "run", _bytes_data(tmp_path)
    out = _run(capsys, "train", *TINY, "--data.path", data, "--train.max_steps", 3, "--checkpoint.every_steps", 1,
                     "--log.every_steps", 1, "--optim.lr", "1e30", "--optim.warmup_steps", 0, "--optim.grad_clip", 0,
                     "--run-dir", run)
    assert out.returncode == 1 and "loss became nan at step 2" in out.stderr, out.stderr
    assert "step_00000001.pt.nonfinite" in out.stderr and "resume with --resume after changing a setting" in out.stderr
    sample = _run(capsys, "sample", "--run-dir", run, "--max-new-tokens", 3)
    aside = run / "checkpoints" / "step_00000001.pt.nonfinite"
    assert sample.returncode == 1 and "train first" not in sample.stderr, sample.stderr
    assert f"its only checkpoint ({aside})" in sample.stderr and "non-finite loss" in sample.stderr
    advice = re.search(r"(tokenmill train --resume \S+ \S+ --optim\.lr LR)", sample.stderr).group(1)
    resumed = _run(capsys, *advice.replace("LR", "1e-3").split()[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert "no good checkpoint" in resumed.stdout and "steps 0->3" in resumed.stdout, resumed.stdout
    assert _run(capsys, "sample", "--run-dir", run, "--max-new-tokens", 3, "--prompt", "the").returncode == 0


@pytest.mark.slow
def test_sample_on_a_misspelt_run_directory_names_the_closest_one(tmp_path, capsys):
    from tokenmill.train.trainer import train

    data = _bytes_data(tmp_path)
    train(tiny_cfg(**{"train.max_steps": 1, "train.eval_batches": 0, "data.source": "tokens", "data.path": str(data),
                      "model.vocab_size": None}), tmp_path / "my-run", quiet=True)
    out = _run(capsys, "sample", "--run-dir", tmp_path / "my-rnu", "--max-new-tokens", 3)
    assert out.returncode == 1 and "train first" not in out.stderr, out.stderr
    assert f"there is no run directory {tmp_path / 'my-rnu'}" in out.stderr
    suggested = re.search(r"Did you mean (\S+)\?", out.stderr).group(1)
    assert _run(capsys, "sample", "--run-dir", suggested, "--max-new-tokens", 3).returncode == 0


def _limit_file_size(n_bytes):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))


@pytest.mark.slow
def test_a_prepare_stopped_by_a_file_size_limit_says_its_build_is_kept_and_how_to_resume(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("".join(f"line {i} of a corpus long enough to pass the limit\n" for i in range(12000)))
    cmd = ["prepare", text, "--out", tmp_path / "data", "--tokenizer", "bytes", "--no-progress", "--workers", 1]
    build = tmp_path / ".data.prepare"
    out = _tokenmill(*cmd, preexec_fn=_limit_file_size(200_000))
    assert out.returncode == 1 and "File too large" in out.stderr, out.stderr
    assert f"The partial build is kept in {build}" in out.stderr and "resumes where it stopped" in out.stderr
    rm = re.search(r"rm -r (\S+)$", out.stderr.strip()).group(1)  # the advice to start over
    subprocess.run(["rm", "-r", rm], check=True)
    assert not build.exists()
    assert _tokenmill(*cmd, preexec_fn=_limit_file_size(200_000)).returncode == 1 and build.is_dir()
    resumed = run_cli(*cmd)  # the advice to resume: the same command, the limit raised (from its journal's
    assert resumed.returncode == 0, resumed.stderr  # last line; none yet in a run this short: from the start)
    assert run_cli(*cmd[:3], tmp_path / "clean", *cmd[4:]).returncode == 0  # the same text, never stopped
    splits = [json.loads((tmp_path / d / "meta.json").read_text())["splits"] for d in ("data", "clean")]
    assert [s[k]["tokens"] for s in splits for k in ("train", "val")] == [splits[1]["train"]["tokens"],
                                                                         splits[1]["val"]["tokens"]] * 2
    assert not build.exists()


@pytest.fixture(scope="module")
def hf_with_tokenizer(tmp_path_factory):
    """A tiny GPT-2 folder with its own byte-level BPE tokenizer.json (and text to prepare)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    d = tmp_path_factory.mktemp("hf")
    text = "the cat sat on the mat. the dog ate the bone. " * 200
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    cfg = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=32, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(d)
    (d.parent / "text.txt").write_text(text)
    return d


@pytest.mark.slow
def test_fine_tuning_without_data_names_the_prepare_command_that_then_works(hf_with_tokenizer, tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    args = ["train", "--train.init_from", hf_with_tokenizer, "--train.device", "cpu", "--train.max_steps", 1,
            "--train.eval_batches", 0, "--train.batch_size", 2, "--log.tensorboard", "false"]
    out = _run(capsys, *args, "--run-dir", tmp_path / "a")
    assert out.returncode == 1 and "model.vocab_size" not in out.stderr, out.stderr
    assert out.stderr.count("tokenmill: error:") == 1 and not (tmp_path / "cache").exists()  # nothing prepared
    command = re.search(r"`(tokenmill prepare TEXT --out DIR --tokenizer-from \S+)`", out.stderr).group(1)
    data = tmp_path / "data"
    command = command.replace("TEXT", str(hf_with_tokenizer.parent / "text.txt")).replace("DIR", str(data))
    prepared = _run(capsys, *command.split()[1:], "--no-progress")
    assert prepared.returncode == 0, prepared.stderr
    tuned = _run(capsys, *args, "--data.path", data, "--run-dir", tmp_path / "b")  # "then train with --data.path DIR"
    assert tuned.returncode == 0 and "fine-tuning from the Hugging Face" in tuned.stdout, tuned.stderr


@pytest.mark.slow
def test_lora_without_init_from_warns_that_the_base_is_random(tmp_path, capsys):
    from tokenmill.train.trainer import train

    lora = {"lora.rank": 4, "train.max_steps": 1, "train.eval_batches": 0}
    train(tiny_cfg(**lora), tmp_path / "random")
    err = capsys.readouterr().err
    assert "lora.rank 4 without train.init_from" in err and "randomly initialised" in err
    assert "--train.init_from" in err, err
    train(tiny_cfg(**{"train.max_steps": 1, "train.eval_batches": 0}), tmp_path / "base", quiet=True)
    train(tiny_cfg(**lora, **{"train.init_from": str(tmp_path / "base")}), tmp_path / "tuned")  # the advice
    assert "without train.init_from" not in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# 10. Start-up noise


def test_the_threads_note_is_only_said_when_the_setting_would_change_something():
    busy = {"intra_op": 1, "inter_op": 1, "cpu_count": 2, "local_world_size": 4}  # already one thread each
    assert D.cpu_contention(busy, load=0.0) is None
    assert D.cpu_contention({**busy, "intra_op": 2}, load=0.0) is not None


@pytest.mark.slow
def test_the_threads_note_is_said_once_per_process(tmp_path, monkeypatch, capsys):
    from tokenmill.train.trainer import train

    monkeypatch.delenv(D.NOTED_ENV, raising=False)  # restored after the test: the note marks the process tree
    monkeypatch.setattr(D.os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    monkeypatch.setattr(D.torch, "get_num_threads", lambda: 4)
    for name in ("a", "b"):
        train(tiny_cfg(**{"train.max_steps": 1, "train.eval_batches": 0}), tmp_path / name)
    out = capsys.readouterr().out
    assert out.count("OMP_NUM_THREADS=") == 1 and out.count("parameters on cpu") == 2, out
    assert os.environ[D.NOTED_ENV] == "1"


LADDER = """
[ladder]
name = "noise"
description = "Two CPU rungs."
base_preset = "tiny"
[ladder.base]
"data.source" = "synthetic"
"model.vocab_size" = 64
"train.device" = "cpu"
[ladder.measure]
warmup_steps = 1
timed_steps = 2
windows = 1
[[rung]]
name = "a"
explain = "x"
[[rung]]
name = "b"
explain = "x"
set = { "train.batch_size" = 2 }
"""


@pytest.mark.slow
def test_a_ladder_says_the_threads_note_once_and_its_rungs_never(tmp_path, monkeypatch):
    import torch

    (tmp_path / "noise.toml").write_text(LADDER)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(4, 2 * cores)  # more threads than cores: the note applies
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))  # the rungs' processes start with as many
    monkeypatch.setenv(D.NOTED_ENV, "")  # recorded, so that the ladder's note does not outlive the test
    monkeypatch.delenv(D.NOTED_ENV)
    # the ladder in this process (its rungs in their own), with the threads its interpreter would have taken
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run_cli("bench", "ladder", tmp_path / "noise.toml", "--out", tmp_path / "out")
    finally:
        torch.set_num_threads(before)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (out.stdout + out.stderr).count("OMP_NUM_THREADS=") == 1, out.stdout
    logs = [p.read_text() for p in (tmp_path / "out" / "rungs").glob("*/std*.log")]
    assert len(logs) == 4 and not any("OMP_NUM_THREADS" in log for log in logs)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="needs torchao")
def test_the_qlora_and_fp8_imports_print_no_library_noise():
    code = ("import torch\n"
            "from tokenmill.model.nf4 import _torchao_to_nf4\n"
            "_torchao_to_nf4()(torch.randn(64, 64), 64, 64)\n"
            "from tokenmill import config as C\n"
            "from tokenmill.model.fp8 import fp8_config\n"
            "fp8_config(C.TrainConfig(fp8='tensorwise'))\n"
            "import warnings\n"
            "warnings.warn('still shown')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cpu_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    for noise in ("Failed to load", ".so", "register_constant", "deprecated"):
        assert noise not in out.stderr, out.stderr
    assert "still shown" in out.stderr  # other warnings are not swallowed


def test_inert_rows_name_real_fields():
    specs = C.field_specs()
    keys = [k for row in inert.INERT for k in row.fields]
    assert len(keys) == len(set(keys)) and all(k in specs for k in keys)
