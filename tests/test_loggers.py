"""The metrics loggers (train/loggers.py): metrics.jsonl unchanged, TensorBoard tags grouped by section,
Weights & Biases in offline mode (no network), and clear errors when a back end is missing."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from conftest import tiny_cfg
from tokenmill.errors import ConfigError
from tokenmill.train.loggers import JsonlLogger, build_loggers, scalars, tag
from tokenmill.train.metrics import MetricsWriter, read_metrics
from tokenmill.train.trainer import Callbacks, train


def test_tags_are_grouped_by_section():
    assert [tag(k) for k in ("loss", "lr", "grad_norm", "val_loss", "eval_ms", "tokens_per_sec", "mfu", "step_ms",
                             "forward_ms", "other_ms", "peak_alloc_mb", "peak_reserved_mb")] == [
        "train/loss", "train/lr", "train/grad_norm", "eval/val_loss", "eval/eval_ms", "perf/tokens_per_sec",
        "perf/mfu", "perf/step_ms", "perf/forward_ms", "perf/other_ms", "memory/peak_alloc_mb",
        "memory/peak_reserved_mb"]
    rec = {"step": 3, "loss": 2.5, "mfu": None, "event": "x", "flag": True, "grad_norm": float("nan"), "n": 4}
    assert scalars(rec) == {"train/loss": 2.5, "train/n": 4.0}


def test_jsonl_lines_are_unchanged(tmp_path):
    """metrics.jsonl keeps its format: the record's keys in order, NaN/inf as null, tensors as numbers."""
    w = MetricsWriter(tmp_path, tensorboard=False)
    w.write({"step": 1, "loss": 2.0, "lr": torch.tensor(0.5), "grad_norm": float("inf"), "mfu": None})
    w.write({"step": 1, "val_loss": 1.5, "eval_ms": 3.0})
    w.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == [
        '{"step": 1, "loss": 2.0, "lr": 0.5, "grad_norm": null, "mfu": null}',
        '{"step": 1, "val_loss": 1.5, "eval_ms": 3.0}',
    ]
    assert [type(x) for x in build_loggers(tmp_path, tiny_cfg().log)] == [JsonlLogger]  # tensorboard off
    off = MetricsWriter(tmp_path / "other", tensorboard=False, enabled=False)  # ranks other than 0
    off.write({"step": 1, "loss": 1.0})
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
def test_tensorboard_tags_by_section(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tiny_cfg(**{"train.max_steps": 4, "log.every_steps": 2, "log.tensorboard": True, "train.eval_every_steps": 2}),
          tmp_path, quiet=True)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_sec", "perf/forward_ms",
            "eval/val_loss"} <= tags and "loss" not in tags
    rows = read_metrics(tmp_path)
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [r["step"] for r in rows if "loss" in r] == [2, 4]
    assert [e.value for e in events] == pytest.approx([r["loss"] for r in rows if "loss" in r], rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/val_loss")] == [2, 4]
    # CUDA memory numbers go under memory/
    from tokenmill.train.loggers import TensorBoardLogger

    tb = TensorBoardLogger(tmp_path / "mem")
    tb.log({"step": 7, "peak_alloc_mb": 123.0})
    tb.close()
    acc = EventAccumulator(str(tmp_path / "mem" / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("memory/peak_alloc_mb")] == [(7, 123.0)]


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'tokenmill[wandb]')")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    calls = []

    def spy(trainer):
        from tokenmill.train.loggers import WandbLogger

        (wb,) = [lg for lg in trainer.writer.loggers if isinstance(lg, WandbLogger)]
        real = wb.run.log
        wb.run.log = lambda values, step: (calls.append((step, dict(values))), real(values, step=step))

    cfg = tiny_cfg(**{"train.max_steps": 4, "log.every_steps": 2, "log.wandb": True, "log.wandb_project": "tm-test"})
    train(cfg, tmp_path / "run", quiet=True, callbacks=Callbacks(on_train_start=spy))
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    logged = [(s, v["train/loss"]) for s, v in calls if "train/loss" in v]
    assert logged == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert any("eval/val_loss" in v for _, v in calls) and all(math.isfinite(x) for _, v in calls for x in v.values())
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    data = run_file.read_bytes()  # the offline record holds the tags and the run config
    assert b"train/loss" in data and b"eval/val_loss" in data and b"tm-test" in data and b"n_layer" in data


def test_missing_wandb_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails whether or not it is installed
    with pytest.raises(ConfigError, match=r"pip install 'tokenmill\[wandb\]'"):
        build_loggers(tmp_path, tiny_cfg(**{"log.wandb": True}).log)
    from tokenmill.cli import main

    assert main(["train", "--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64",
                 "--train.device", "cpu", "--train.max_steps", "1", "--log.wandb", "true", "--run-dir",
                 str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "log.wandb needs the wandb package" in err and "Traceback" not in err
