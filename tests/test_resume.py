"""Resume edge cases: no checkpoint yet, a changed global batch, a changed model shape."""

import pytest
import torch

from conftest import tiny_cfg
from tokenmill import checkpoint as ckpt
from tokenmill.data.loader import StreamBatchSampler
from tokenmill.errors import TrainingError
from tokenmill.parallel.world import World
from tokenmill.train.metrics import read_metrics
from tokenmill.train.resume import check_same_model
from tokenmill.train.trainer import Callbacks, build_model, train


class Crash(RuntimeError):
    pass


def crash_at(step):
    def hook(done):
        if done == step:
            raise Crash(f"simulated crash after step {done}")

    return hook


@pytest.mark.slow
def test_restart_without_checkpoint_restarts_metrics(tmp_path, monkeypatch):
    """A torchrun restart before the first checkpoint trains from step 0 again: no duplicated metric rows.
    A user's --resume with nothing to resume is an error instead, and writes nothing."""
    over = {"train.max_steps": 4, "log.every_steps": 1}
    with pytest.raises(Crash):
        train(tiny_cfg(**over), tmp_path, quiet=True, callbacks=Callbacks(on_step_end=crash_at(3)))
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert ckpt.list_checkpoints(tmp_path) == []
    before = (tmp_path / "metrics.jsonl").read_bytes()
    with pytest.raises(TrainingError, match="has no checkpoint to resume from"):
        train(tiny_cfg(**over), tmp_path, resume=True, quiet=True)
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # what torchrun sets in a restarted worker
    train(tiny_cfg(**over), tmp_path, quiet=True)
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_before_the_first_save_names_the_command_that_restarts_the_run(tmp_path, capsys):
    """Ctrl-C before the first checkpoint leaves config.toml and no checkpoint: ``train --resume`` says so
    and prints the command that starts the run again from its recorded config, which then completes."""
    from tokenmill.cli import main

    over = {"train.max_steps": 4, "checkpoint.every_steps": 2, "log.every_steps": 1}
    with pytest.raises(Crash):
        train(tiny_cfg(**over), tmp_path, quiet=True, callbacks=Callbacks(on_step_end=crash_at(1)))
    assert (tmp_path / "config.toml").is_file() and ckpt.list_checkpoints(tmp_path) == []
    capsys.readouterr()
    assert main(["train", "--resume", "--run-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    command = f"tokenmill train --config {tmp_path / 'config.toml'} --run-dir {tmp_path}"
    assert "stopped before its first save" in err and err.rstrip().endswith(command), err
    assert main(command.split()[1:]) == 0
    assert [r["step"] for r in read_metrics(tmp_path) if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_resume_with_another_global_batch_continues_the_stream(tmp_path, capsys):
    """Saved with grad_accum 2 (global batch 8, as 2 data-parallel ranks of 4), resumed with grad_accum
    1 (global batch 4): the data goes on at sample 3 x 8 = 24, neither replayed nor skipped."""
    over = {"train.max_steps": 5, "checkpoint.every_steps": 3, "log.every_steps": 1}
    with pytest.raises(Crash):
        train(tiny_cfg(**over, **{"train.grad_accum_steps": 2}), tmp_path, quiet=True, callbacks=Callbacks(on_step_end=crash_at(4)))
    _, state = ckpt.read_latest(tmp_path)
    assert state["data_position"] == {"step": 3, "global_samples": 24, "global_batch": 8}

    loaders = []
    capsys.readouterr()
    train(tiny_cfg(**over), tmp_path, resume=True, callbacks=Callbacks(on_train_start=lambda t: loaders.append(t.loader)))
    assert "global batch changed from 8 to 4 samples per step" in capsys.readouterr().out
    (loader,) = loaders
    uninterrupted = [i for b in StreamBatchSampler(4, 2, 0, 5) for i in b]
    resumed = [i for b in loader.batch_sampler for i in b]
    assert resumed == uninterrupted[24:32]  # steps 3 and 4 at 4 samples each
    x, _ = next(iter(loader))
    assert torch.equal(x, torch.stack([loader.dataset[i][0] for i in uninterrupted[24:28]]))
    _, state = ckpt.read_latest(tmp_path)  # the final checkpoint counts the true samples
    assert state["data_position"] == {"step": 5, "global_samples": 32, "global_batch": 4}


def test_checkpoint_data_position_counts_the_data_parallel_degree(tmp_path):
    """A 2-rank data-parallel job's checkpoint records its whole global batch (world stubbed in one
    process: rank 0 of dp 2 writes the single file)."""
    from tokenmill.optim import build_optimizer, build_scheduler

    cfg = tiny_cfg(**{"train.max_steps": 5})
    model = build_model(cfg, 64, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg)
    world = World(dp_replicate=2)
    ckpt.save_checkpoint(tmp_path, 3, model, optimizer, build_scheduler(optimizer, cfg.optim, 5), None, cfg, world)
    _, state = ckpt.read_latest(tmp_path)
    assert state["data_position"] == {"step": 3, "global_samples": 24, "global_batch": 8}
    assert ckpt.saved_global_samples(state) == 24
    # an older checkpoint (global_samples without the data-parallel degree): step x current batch
    assert ckpt.saved_global_samples({"data_position": {"step": 3, "global_samples": 12}}) is None
    assert ckpt.saved_global_samples({}) is None


def test_stream_sampler_starts_at_a_given_sample():
    sampler = StreamBatchSampler(2, 1, start_step=3, max_steps=5, dp_rank=1, dp_size=2, start_sample=10)
    assert list(sampler) == [[12, 13], [16, 17]]  # rank 1's half of samples 10..13, then 14..17
    assert list(StreamBatchSampler(2, 1, 3, 4, 1, 2)) == [[14, 15]]  # default: step x global batch


def test_changed_model_switch_message_names_the_fix():
    cfg = tiny_cfg(**{"model.fused_qkv": False})
    with pytest.raises(TrainingError) as e:
        check_same_model({"model": {"fused_qkv": True}}, cfg)
    msg = str(e.value)
    assert "model.fused_qkv: checkpoint True vs now False" in msg
    assert "--model.fused_qkv true" in msg  # resume with the checkpoint's value
    assert "train from the start" in msg and "--model.tie_embeddings false" in msg


@pytest.mark.slow
def test_llama_family_run_extended_by_resume_is_bit_identical(tmp_path):
    """A finished tiny-llama run (RoPE, RMSNorm, SwiGLU, grouped-query attention; dropout on) of N steps,
    resumed to 2N, gives the uninterrupted 2N-step run's losses and final weights bit for bit (the
    cosine decays over optim.decay_steps = 2N in both, so the longer max_steps does not re-stretch it)."""
    from test_parallel import preset_cfg

    over = {"log.every_steps": 1, "model.dropout": 0.1, "optim.decay_steps": 8, "train.eval_every_steps": 2,
            "train.eval_batches": 1}
    train(preset_cfg("tiny-llama", **over, **{"train.max_steps": 8}), tmp_path / "full", quiet=True)
    train(preset_cfg("tiny-llama", **over, **{"train.max_steps": 4}), tmp_path / "cut", quiet=True)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "cut")] == [4]
    train(preset_cfg("tiny-llama", **over, **{"train.max_steps": 8}), tmp_path / "cut", resume=True, quiet=True)
    full, cut = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "cut")
    for key in ("loss", "val_loss", "grad_norm", "lr"):
        want = [(r["step"], r[key]) for r in full if key in r]
        assert [(r["step"], r[key]) for r in cut if key in r] == want and len(want) >= 4, key
    a, b = ckpt.read_latest(tmp_path / "full")[1]["model"], ckpt.read_latest(tmp_path / "cut")[1]["model"]
    assert a.keys() == b.keys() and "blocks.0.mlp.c_gate.weight" in a and "wpe.weight" not in a
    for k in a:
        assert torch.equal(a[k], b[k]), k
