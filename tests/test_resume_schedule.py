"""Resume and the learning-rate schedule: a new train.max_steps re-stretches the cosine, and the resume
says so and names the flag that keeps the old decay (optim.decay_steps)."""

import json

import pytest

from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.optim.schedule import lr_at

BASE = ["--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64", "--train.device", "cpu",
        "--log.progress", "plain", "--log.tensorboard", "false", "--log.every_steps", "1",
        "--optim.warmup_steps", "1", "--optim.lr", "1e-2", "--optim.min_lr", "1e-4", "--train.eval_batches", "0"]


def lrs(run):
    return {r["step"]: r["lr"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if "lr" in r}


@pytest.mark.slow
def test_resume_with_more_steps_says_the_schedule_changed_and_decay_steps_keeps_it(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *BASE, "--run-dir", str(run), "--train.max_steps", "6"]) == 0
    capsys.readouterr()
    stretched = tmp_path / "stretched"
    import shutil

    shutil.copytree(run, stretched)
    assert main(["train", *BASE, "--run-dir", str(stretched), "--train.max_steps", "12", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "train.max_steps changed from 6 to 12" in out and "--optim.decay_steps 6" in out, out
    # the re-stretched schedule: the learning rate went back up from the floor
    assert lrs(stretched)[7] > 10 * 1e-4
    assert main(["train", *BASE, "--run-dir", str(run), "--train.max_steps", "12", "--resume",
                 "--optim.decay_steps", "6"]) == 0
    out = capsys.readouterr().out
    assert "re-stretches" not in out
    kept = lrs(run)
    assert all(abs(kept[s] - 1e-4) < 1e-9 for s in range(7, 13)), kept  # at the floor, as the old decay left it


def test_decay_steps_ends_the_cosine_early():
    cfg = C.OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=0, decay_steps=10)
    assert abs(lr_at(10, cfg, 100) - 0.1) < 1e-12 and abs(lr_at(50, cfg, 100) - 0.1) < 1e-12
    assert abs(lr_at(5, cfg, 100) - 0.55) < 1e-12  # half way down the cosine at half of decay_steps
