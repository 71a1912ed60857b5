
import pytest

from conftest import run_cli
from tokenmill import config as C
from tokenmill.cli import main


def test_resolution_order(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[train]\nbatch_size = 7\nmax_steps = 11\n[model]\nn_layer = 3\n")
    cfg = C.resolve("tiny", [str(f)], {"train.max_steps": "13"})
    assert cfg.model.n_embd == 32  # preset
    assert cfg.model.n_layer == 3 and cfg.train.batch_size == 7  # file over preset
    assert cfg.train.max_steps == 13  # CLI over file
    assert C.Config().model.n_embd == 768  # defaults untouched


def test_unknown_key_suggests_closest(tmp_path):
    with pytest.raises(C.ConfigError, match=r"unknown config key 'train\.batchsize'.*'train\.batch_size'"):
        C.resolve(overrides={"train.batchsize": "3"})
    f = tmp_path / "c.toml"
    f.write_text("[optimizer]\nlr = 1.0\n")
    with pytest.raises(C.ConfigError, match=r"unknown config section '\[optimizer\]'.*'optim'"):
        C.resolve(config_files=[str(f)])
    with pytest.raises(C.ConfigError, match="unknown preset 'gpt2-smal'.*'gpt2-small'|unknown preset 'gpt2-smal'"):
        C.resolve("gpt2-smal")


def test_bad_values_named():
    with pytest.raises(C.ConfigError, match=r"model\.attention: 'sdp' is not one of.*'sdpa'"):
        C.resolve(overrides={"model.attention": "sdp"})
    with pytest.raises(C.ConfigError, match=r"train\.batch_size: expected an integer, got 'eight'"):
        C.resolve(overrides={"train.batch_size": "eight"})
    with pytest.raises(C.ConfigError, match=r"train\.tf32: expected true or false"):
        C.resolve(overrides={"train.tf32": "maybe"})
    with pytest.raises(C.ConfigError, match=r"divisible by model\.n_head"):
        C.resolve(overrides={"model.n_embd": "100", "model.n_head": "12"})
    with pytest.raises(C.ConfigError, match=r"needs model\.vocab_size"):
        C.resolve(overrides={"data.source": "synthetic"})


def test_every_field_documented_and_round_trips(tmp_path):
    for key, (_, _, doc) in C.field_specs().items():
        assert len(doc) > 10, f"{key} has no docstring"
    cfg = C.resolve("demo", overrides={"model.vocab_size": "300", "train.precision": "bf16-autocast"})
    C.save(cfg, tmp_path / "config.toml")
    again = C.resolve(config_files=[str(tmp_path / "config.toml")])
    assert again == cfg


@pytest.mark.parametrize("name", C.preset_names())
def test_presets_resolve(name):
    cfg = C.resolve(name)
    assert cfg.model.n_embd % cfg.model.n_head == 0


def test_cli_help_lists_every_field():
    out = run_cli("train", "--help")
    assert out.returncode == 0
    for key in C.field_specs():
        assert f"--{key}" in out.stdout


def test_cli_unknown_override_exits_with_suggestion(capsys):
    assert main(["train", "--preset", "tiny", "--train.max_step", "3"]) == 2
    err = capsys.readouterr().err
    assert "train.max_step" in err and "train.max_steps" in err


def test_readme_config_reference_in_sync():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    start, end = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
    body = readme[readme.index(start) + len(start): readme.index(end)].strip()
    assert body == C.reference_markdown().strip(), (
        "README config reference is stale: regenerate it from `tokenmill config --reference`"
    )


@pytest.mark.parametrize("argv, meant", [
    (["--train.block_size", "64"], "model.block_size"),  # the right field in the wrong section
    (["--train.lr", "1e-3"], "optim.lr"),
    (["--optim.learning_rate", "1e-3"], "optim.lr"),  # nanoGPT / Hugging Face names
    (["--train.max_iters", "10"], "train.max_steps"),
    (["--model.n_layers", "2"], "model.n_layer"),
    (["--model.hidden_size", "64"], "model.n_embd"),
    (["--model.num_key_value_heads", "2"], "model.n_kv_head"),
    (["--train.micro_batch_size", "4"], "train.batch_size"),  # litgpt
    (["--train.batchsize", "4"], "train.batch_size"),  # a typo
    (["--lr", "1e-3"], "--optim.lr"),  # a bare name from another tool
    (["--max_iters", "10"], "--train.max_steps"),
    (["--seq_len", "128"], "--model.block_size"),  # torchtitan
])
def test_did_you_mean_knows_other_sections_and_other_tools(capsys, argv, meant):
    assert main(["train", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert f"Did you mean '{meant}'?" in err and "Traceback" not in err, err


def test_did_you_mean_in_a_config_file(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nlearning_rate = 0.001\n")
    assert main(["config", "--preset", "tiny", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "train.learning_rate" in err and "Did you mean 'optim.lr'?" in err


def test_every_alias_names_a_real_key():
    keys = set(C.field_specs())
    assert {v for v in C.ALIASES.values()} <= keys
