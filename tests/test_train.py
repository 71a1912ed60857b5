"""The training loop: metrics, accumulation, precision, optimizer modes, checkpoints, resume, errors."""

import json
import math

import pytest
import torch

from conftest import tiny_cfg
from tokenmill import checkpoint as ckpt
from tokenmill.errors import CheckpointError, TrainingError
from tokenmill.optim import lr_at
from tokenmill.train.metrics import read_metrics
from tokenmill.train.trainer import Callbacks, build_model, train


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r and r["loss"] is not None}


def final_weights(run_dir):
    path, state = ckpt.read_latest(run_dir)
    return state["model"]


@pytest.mark.slow
def test_metrics_and_run_dir(tmp_path):
    cfg = tiny_cfg(**{"train.max_steps": 6, "log.every_steps": 2, "train.eval_every_steps": 4,
                      "log.timing_warmup_steps": 1})
    summary = train(cfg, tmp_path, quiet=True)
    rows = read_metrics(tmp_path)
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [2, 4, 6]
    for r in steps:
        assert {"step", "loss", "lr", "tokens_per_sec", "grad_norm", "data_ms", "forward_ms"} <= set(r)
        assert math.isfinite(r["loss"]) and r["tokens_per_sec"] > 0
    vals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in vals] == [4, 6]
    assert (tmp_path / "config.toml").exists()
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [6]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["tokens_per_sec"] == summary["tokens_per_sec"] > 0
    assert saved["mfu"] is None  # CPU: no MFU rather than a guess
    # first loss close to ln(vocab) for a fresh model
    assert abs(steps[0]["loss"] - math.log(64)) < 1.0


@pytest.mark.slow
def test_gradient_accumulation_equals_big_batch(tmp_path):
    common = {"train.max_steps": 3, "optim.grad_clip": 1.0}
    train(tiny_cfg(**common, **{"train.batch_size": 8, "train.grad_accum_steps": 1}), tmp_path / "a", quiet=True)
    train(tiny_cfg(**common, **{"train.batch_size": 4, "train.grad_accum_steps": 2}), tmp_path / "b", quiet=True)
    train(tiny_cfg(**common, **{"train.batch_size": 2, "train.grad_accum_steps": 4}), tmp_path / "c", quiet=True)
    a, b, c = (final_weights(tmp_path / x) for x in "abc")
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6)  # fp32 summation-order tolerance
        torch.testing.assert_close(c[k], a[k], rtol=1e-5, atol=1e-6)
    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert la.keys() == lb.keys() and all(abs(la[s] - lb[s]) < 1e-5 for s in la)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["for-loop", "fused"])
def test_adamw_impls_match_foreach(tmp_path, impl):
    train(tiny_cfg(**{"train.max_steps": 3, "optim.impl": "foreach"}), tmp_path / "ref", quiet=True)
    train(tiny_cfg(**{"train.max_steps": 3, "optim.impl": impl}), tmp_path / impl, quiet=True)
    ref, got = final_weights(tmp_path / "ref"), final_weights(tmp_path / impl)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision,tol", [("bf16-autocast", 0.05), ("bf16", 0.05), ("fp16-autocast", 0.02)]
)
def test_precision_modes_train_close_to_fp32(tmp_path, precision, tol):
    train(tiny_cfg(**{"train.max_steps": 5}), tmp_path / "fp32", quiet=True)
    train(tiny_cfg(**{"train.max_steps": 5, "train.precision": precision}), tmp_path / precision, quiet=True)
    ref, got = losses(tmp_path / "fp32"), losses(tmp_path / precision)
    for s in ref:
        assert abs(got[s] - ref[s]) / ref[s] < tol, (s, got[s], ref[s])
    if precision == "bf16":
        state = final_weights(tmp_path / precision)
        assert state["wte.weight"].dtype == torch.bfloat16


def test_activation_checkpointing_same_gradients():
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 32))
    y = torch.randint(0, 64, (4, 32))
    grads = {}
    for every in (0, 1, 2):
        cfg = tiny_cfg(**{"memory.activation_checkpointing": every, "model.dropout": 0.1})
        model = build_model(cfg, 64, torch.device("cpu"))
        torch.manual_seed(1)  # same dropout masks: recomputation must replay them
        _, loss = model(x, y)
        loss.backward()
        grads[every] = {k.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                        for k, p in model.named_parameters()}
        assert set(ckpt.clean_state_dict(model.state_dict())) == set(model.state_dict()) or every
    for every in (1, 2):
        assert grads[every].keys() == grads[0].keys()
        for k in grads[0]:
            torch.testing.assert_close(grads[every][k], grads[0][k], rtol=0, atol=0)  # bit-identical


def test_lr_schedule():
    from tokenmill.config import OptimConfig

    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.55)
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)
    cfg.schedule = "constant"
    assert lr_at(50, cfg, 110) == 1.0


class Crash(RuntimeError):
    pass


@pytest.mark.slow
def test_resume_is_bit_exact_after_crash(tmp_path):
    over = {"train.max_steps": 10, "log.every_steps": 1, "checkpoint.every_steps": 3, "model.dropout": 0.1,
            "checkpoint.keep_last": 5}
    train(tiny_cfg(**over), tmp_path / "full", quiet=True)

    def crash(step):
        if step == 7:
            raise Crash("simulated crash")

    with pytest.raises(Crash):
        train(tiny_cfg(**over), tmp_path / "cut", quiet=True, callbacks=Callbacks(on_step_end=crash))
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "cut")] == [3, 6]
    with pytest.raises(TrainingError, match="--resume"):
        train(tiny_cfg(**over), tmp_path / "cut", quiet=True)  # never overwrite a run by accident
    train(tiny_cfg(**over), tmp_path / "cut", resume=True, quiet=True)
    full, cut = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert list(cut) == list(range(1, 11))
    assert cut == full  # bit-exact: same floats, not merely close
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "cut")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    from tokenmill.checkpoint import files

    state = {"step": 1, "w": torch.arange(10.0)}
    (tmp_path / "checkpoints").mkdir()
    files.atomic_torch_save(state, files.file_path(tmp_path, 1))

    real_save = torch.save

    def broken_save(obj, f, *a, **k):
        f.write(b"partial bytes")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="could not write checkpoint .*step_00000002.pt: No space left on device; free disk space"):
        files.atomic_torch_save({"step": 2, "w": torch.zeros(10)}, files.file_path(tmp_path, 2))
    monkeypatch.setattr(files.torch, "save", real_save)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1]
    assert list((tmp_path / "checkpoints").iterdir()) == [tmp_path / "checkpoints" / "step_00000001.pt"]
    path, loaded = ckpt.read_latest(tmp_path)
    assert torch.equal(loaded["w"], state["w"])


def test_checkpoint_loading_refuses_arbitrary_objects(tmp_path):
    from tokenmill.checkpoint import files

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "checkpoints").mkdir()
    torch.save({"step": 1, "x": Evil()}, tmp_path / "checkpoints" / "step_00000001.pt")
    with pytest.raises(CheckpointError, match="refused to load .*step_00000001.pt"):
        files.read_file(tmp_path / "checkpoints" / "step_00000001.pt")


@pytest.mark.slow
def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    cfg = tiny_cfg(**{"train.max_steps": 20, "checkpoint.every_steps": 4, "log.every_steps": 5})
    holder = {}

    def poison(step):
        if step == 9:
            with torch.no_grad():
                next(holder["model"].parameters()).fill_(float("nan"))

    with pytest.raises(TrainingError, match=r"loss became nan at step 10.*step_00000008\.pt"):
        train(cfg, tmp_path, quiet=True,
              callbacks=Callbacks(on_model_built=lambda m: holder.__setitem__("model", m), on_step_end=poison))
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [4, 8]
    _, state = ckpt.read_latest(tmp_path)
    assert all(torch.isfinite(v).all() for v in state["model"].values())


@pytest.mark.slow
def test_oom_is_reported_with_switches(tmp_path):
    def oom_model(model):
        def boom(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        model.forward = boom

    with pytest.raises(TrainingError) as e:
        train(tiny_cfg(**{"train.max_steps": 2}), tmp_path, quiet=True, callbacks=Callbacks(on_model_built=oom_model))
    msg = str(e.value)
    assert "out of memory" in msg and "batch_size=4" in msg
    assert "--memory.activation_checkpointing 1" in msg and "--train.grad_accum_steps 2" in msg


@pytest.mark.slow
def test_compile_keeps_the_math_and_checkpoint_names(tmp_path):
    """torch.compile (Inductor on CPU: ~1 min of compilation) gives the eager losses, plain names; the
    compiled run's summary.json has compile_s > 0 from torch's own counters, within the run's wall time, and
    the whole-run peaks (None on a CPU) (tests/test_compile_cost.py's topic, checked on this run: one
    compiled tiny run, not two)."""
    from tokenmill.train.metrics import compile_seconds

    assert compile_seconds() is not None  # this torch keeps the counters
    over = {"train.max_steps": 3, "log.every_steps": 1}
    train(tiny_cfg(**over), tmp_path / "eager", quiet=True)
    torch._dynamo.reset()
    train(tiny_cfg(**over, **{"compile.enabled": True}), tmp_path / "compiled", quiet=True)
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    for s in eager:
        assert abs(compiled[s] - eager[s]) < 1e-4, (s, compiled[s], eager[s])  # fused-kernel rounding
    keys = set(final_weights(tmp_path / "compiled"))
    assert keys == set(final_weights(tmp_path / "eager"))
    assert not any("_orig_mod" in k for k in keys)
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert isinstance(summary["compile_s"], float) and 0 < summary["compile_s"] < summary["wall_s"]
    assert summary["peak_alloc_mb_run"] is None and summary["peak_reserved_mb_run"] is None


@pytest.mark.slow
def test_keep_last_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = tiny_cfg(**{"train.max_steps": 8, "checkpoint.every_steps": 2, "checkpoint.keep_last": 2,
                      "log.tensorboard": True, "log.every_steps": 2})
    train(cfg, tmp_path, quiet=True)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [6, 8]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [2, 4, 6, 8]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(list(losses(tmp_path).values()))


PHASE_KEYS = ("data_ms", "h2d_ms", "forward_ms", "backward_ms", "optimizer_ms")


@pytest.mark.slow
@pytest.mark.parametrize("every_ckpt,logged", [(3, [4, 8, 12]), (0, [4, 8])])
def test_phase_breakdown_adds_up_to_step_time(tmp_path, every_ckpt, logged):
    """A slow timing warm-up (like compilation), with and without checkpoints off the log steps: each
    logged row's phases are averaged over exactly the steps of its step_ms window, so phases +
    other_ms = step_ms."""
    import time

    done = [0]

    def slow_warmup(model):
        forward = model.forward

        def slow_forward(*args, **kwargs):
            if done[0] < 2:  # the two warm-up steps: 30 ms more forward each
                time.sleep(0.03)
            return forward(*args, **kwargs)

        model.forward = slow_forward

    cfg = tiny_cfg(**{"train.max_steps": logged[-1], "log.every_steps": 4, "checkpoint.every_steps": every_ckpt,
                      "log.timing_warmup_steps": 2, "checkpoint.keep_last": 5})
    train(cfg, tmp_path, quiet=True, callbacks=Callbacks(on_model_built=slow_warmup, on_step_end=lambda step: done.__setitem__(0, step)))
    rows = [r for r in read_metrics(tmp_path) if "step_ms" in r]
    assert [r["step"] for r in rows] == logged
    for r in rows:
        total = sum(r[k] for k in PHASE_KEYS) + r["other_ms"]
        # by construction up to float rounding; 5% + 0.5 ms leaves room for clock noise
        assert abs(total - r["step_ms"]) <= 0.05 * r["step_ms"] + 0.5, r
        assert r["other_ms"] >= 0, r  # phases are timed inside the step-time window


def test_phase_timer_counts_its_own_steps():
    from tokenmill.train.timing import PhaseTimer

    timer = PhaseTimer(torch.device("cpu"))
    timer.add_host("data", 5.0)  # a warm-up step, dropped by the reset
    timer.step_done()
    timer.reset()
    for _ in range(3):
        timer.add_host("data", 1.0)
        timer.step_done()
    assert timer.collect() == ({"data": 3.0}, 3)
    assert timer.collect() == ({}, 0)


@pytest.mark.slow
def test_tensor_learning_rate_is_logged_as_float(tmp_path):
    """Optimizers like torchao's AdamW8bit keep lr as a tensor: metrics.jsonl still gets a float."""
    from tokenmill.train.metrics import MetricsWriter

    def tensor_lr(optimizer):
        for group in optimizer.param_groups:
            group["lr"] = torch.tensor(group["lr"])

    cfg = tiny_cfg(**{"train.max_steps": 2, "log.every_steps": 1, "optim.impl": "for-loop"})
    train(cfg, tmp_path / "run", quiet=True, callbacks=Callbacks(on_optimizer_built=tensor_lr))
    lrs = [r["lr"] for r in read_metrics(tmp_path / "run") if "lr" in r]
    assert len(lrs) == 2 and all(type(v) is float for v in lrs)
    assert lrs == pytest.approx([lr_at(s, cfg.optim, 2) for s in range(2)], rel=1e-6)  # float32 lr

    writer = MetricsWriter(tmp_path / "w", tensorboard=False)
    (tmp_path / "w").mkdir()
    writer.write({"step": 1, "lr": torch.tensor(0.5), "loss": float("nan")})
    assert read_metrics(tmp_path / "w") == [{"step": 1, "lr": 0.5, "loss": None}]


def test_optimizer_8bit_without_torchao_is_a_user_error(tmp_path, monkeypatch, capsys):
    import sys

    from tokenmill.cli import main

    monkeypatch.setitem(sys.modules, "torchao", None)  # import fails whether or not it is installed
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    argv = ["train", "--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64",
            "--train.device", "cpu", "--train.max_steps", "1", "--memory.optimizer_8bit", "true",
            "--run-dir", str(tmp_path)]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: error: memory.optimizer_8bit needs torchao")
    assert "pip install torchao" in err and "drop --memory.optimizer_8bit" in err


def test_dropout_seed_differs_per_data_parallel_rank():
    from tokenmill.train.trainer import seed_dropout

    def masks(dp_rank, start_step=0):
        torch.manual_seed(1234)  # what build_model leaves behind, the same on every rank
        seed_dropout(1337, dp_rank, start_step)
        return torch.rand(64)

    torch.manual_seed(1234)
    unchanged = torch.rand(64)
    assert torch.equal(masks(0), unchanged)  # rank 0 (and one process): exactly as before
    assert torch.equal(masks(0, start_step=5), unchanged)  # rank 0 keeps the restored RNG on resume
    assert torch.equal(masks(1), masks(1))  # TP ranks / PP stages of one DP group: equal masks
    draws = [masks(0), masks(1), masks(2), masks(1, start_step=5)]
    assert len({tuple(d.tolist()) for d in draws}) == len(draws)
