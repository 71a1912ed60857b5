"""Defaults a user expects: on a GPU with bf16 the fast precision (bf16 autocast + TF32), on a CPU fp32;
'auto' is decided in one place (config.concrete) and recorded as what it became."""

import pytest

from conftest import tiny_cfg
from tokenmill import config as C
from tokenmill.cli import main


@pytest.mark.parametrize("device, bf16, precision, tf32", [
    ("cuda", True, "bf16-autocast", True),
    ("cuda", False, "fp32", True),  # e.g. a V100: no bf16 tensor cores
    ("cpu", False, "fp32", False),
    ("mps", False, "fp32", False),
])
def test_auto_precision_per_device(device, bf16, precision, tf32):
    cfg = C.resolve("gpt2-124m")
    assert cfg.train.precision == "auto" and cfg.train.tf32 is None
    got = C.concrete(cfg, device, bf16).train
    assert (got.precision, got.tf32) == (precision, tf32)
    assert cfg.train.precision == "auto"  # the input is not modified


def test_explicit_choices_win_over_auto():
    cfg = C.resolve("gpt2-124m", overrides={"train.precision": "fp32", "train.tf32": "false"},
                    overrides_from_string=True)
    got = C.concrete(cfg, "cuda", True).train
    assert (got.precision, got.tf32) == ("fp32", False)


def test_estimate_on_a_gpu_defaults_to_bf16(capsys):
    assert main(["estimate", "--preset", "gpt2-124m", "--gpu", "h100"]) == 0
    assert "precision bf16-autocast + tf32" in capsys.readouterr().out
    assert main(["estimate", "--preset", "gpt2-124m", "--gpu", "h100", "--train.precision", "fp32",
                 "--train.tf32", "false"]) == 0
    out = capsys.readouterr().out
    assert "precision fp32" in out and "tf32" not in out.split("precision fp32")[1].splitlines()[0]


@pytest.mark.slow
def test_a_cpu_run_records_what_auto_became(tmp_path):
    from tokenmill.train.trainer import train

    train(tiny_cfg(**{"train.max_steps": 1, "train.eval_batches": 0, "train.precision": "auto", "train.tf32": None}),
          tmp_path, quiet=True)
    recorded = C.resolve(config_files=[str(tmp_path / "config.toml")])
    assert (recorded.train.precision, recorded.train.tf32) == ("fp32", False)


def test_every_ladder_states_its_precision_and_tf32():
    """Seed-faithful settings live in the ladders, not in the defaults: each ladder's base (or every rung)
    says which precision and TF32 it measures, so 'auto' never decides a measured figure."""
    from tokenmill.bench.configs import rung_config
    from tokenmill.bench.load import load_ladder
    from tokenmill.bench.schema import shipped_ladders

    for name in shipped_ladders():
        ladder = load_ladder(name)
        for i in range(len(ladder.rungs)):
            t = rung_config(ladder, i).config.train
            assert t.precision != "auto" and t.tf32 is not None, (name, ladder.rungs[i].name)
