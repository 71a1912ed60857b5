"""Mixture of experts under data parallelism, through the command line: the logged expert loads are the whole
batch's (summed over the ranks, not rank 0's own), and a sharded (DCP) checkpoint resumes after
``model.moe_bias_update_rate`` switched between 0 and > 0 as a single-file one does (the routing bias starting
at zero, or a non-zero one refused in one line). The 2-rank FSDP runs train in the shared torchrun launch
(conftest.two_rank_launch)."""

from __future__ import annotations

import shutil

import pytest

CFG = {"data.source": "synthetic", "model.vocab_size": 64, "model.n_layer": 2, "train.device": "cpu",
       "train.precision": "fp32", "train.tf32": False, "log.progress": "plain", "log.tensorboard": False,
       "train.max_steps": 2, "train.batch_size": 2, "log.every_steps": 1, "train.eval_batches": 0,
       "model.moe_z_loss_coef": 0.001}
BIAS = 0.01  # the routing bias's step (model.moe_bias_update_rate) of the run trained with it


def _flags(cfg: dict) -> list[str]:
    return ["--preset", "tiny-moe", *(a for k, v in cfg.items()
                                      for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)))]


def two_rank_jobs(tmp) -> list[dict]:
    """tiny-moe (2 layers) on 2 gloo processes under FSDP, 2 steps, a DCP checkpoint at the end: without the
    routing bias, and (1 step) with it."""
    return [{"preset": "tiny-moe", "cfg": {**CFG, "parallel.dp_shard": 2}, "run_dir": str(tmp / "fsdp")},
            {"preset": "tiny-moe", "cfg": {**CFG, "parallel.dp_shard": 2, "train.max_steps": 1,
                                           "model.moe_bias_update_rate": BIAS}, "run_dir": str(tmp / "bias")}]


def _rows(run) -> list[dict]:
    from tokenmill.train.metrics import read_metrics

    return [r for r in read_metrics(run) if "loss" in r]


def _resume(src, dst, *flags) -> int:
    """``tokenmill train --resume`` of a copy of 2-rank run ``src`` in one process (the same global batch)."""
    from tokenmill.cli import main

    shutil.copytree(src, dst)
    return main(["train", "--resume", "--run-dir", str(dst), "--parallel.dp_shard", "1", "--train.batch_size", "4",
                 *flags])


@pytest.mark.slow
def test_logged_expert_load_is_the_whole_batchs_under_fsdp(two_rank_launch, tmp_path):
    """The 2-rank FSDP run logs the expert loads of one process trained on the same global batch (each rank
    holds half of it), within 1e-5: the slot counts are summed over the ranks before max / mean."""
    from tokenmill.cli import main

    assert main(["train", *_flags({**CFG, "train.batch_size": 4}), "--run-dir", str(tmp_path / "one")]) == 0
    rows = {"fsdp": _rows(two_rank_launch / "moe_metrics" / "fsdp"), "one": _rows(tmp_path / "one")}
    assert len(rows["fsdp"]) == len(rows["one"]) == 2
    for a, b in zip(rows["fsdp"], rows["one"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=0)  # the same tokens and weights
    # step 1 routes with the same initial weights; after it the reduce-scatter's summation order moves the
    # weights by ~1e-7, enough to flip near-tied routing choices of this tiny router, so only step 1 is exact
    a, b = rows["fsdp"][0], rows["one"][0]
    assert a["moe_load_max"] > 1
    for k in ("moe_load_0", "moe_load_1", "moe_load_max"):
        assert a[k] == pytest.approx(b[k], abs=1e-5), k


@pytest.mark.slow
def test_dcp_checkpoint_resumes_with_the_routing_bias_switched_on(two_rank_launch, tmp_path):
    """A DCP checkpoint saved without the routing bias resumes with ``model.moe_bias_update_rate`` > 0: the bias
    starts at zero and moves by the rate at the next step (the old code failed in DCP's missing-key check)."""
    run = tmp_path / "on"
    assert _resume(two_rank_launch / "moe_metrics" / "fsdp", run, "--model.moe_bias_update_rate", str(BIAS),
                   "--train.max_steps", "3") == 0
    assert [r["step"] for r in _rows(run)] == [1, 2, 3]
    from tokenmill.checkpoint import list_checkpoints, read_state

    step, path = list_checkpoints(run)[-1]
    model = read_state(path)["model"]
    biases = [v for k, v in model.items() if k.endswith("router_bias")]
    assert step == 3 and len(biases) == 2
    for b in biases:  # one step from zero: every expert moved by exactly +-rate (or 0 at the mean)
        assert all(x == 0 or x == pytest.approx(BIAS) for x in b.abs().tolist()) and b.abs().sum() > 0


@pytest.mark.slow
def test_dcp_checkpoint_with_a_non_zero_bias_refuses_the_switch_off(two_rank_launch, tmp_path, capsys):
    """A DCP checkpoint whose routing bias moved, resumed with ``model.moe_bias_update_rate`` 0: refused in one
    line naming the switch (it would route differently), as a single-file checkpoint is."""
    assert _resume(two_rank_launch / "moe_metrics" / "bias", tmp_path / "off", "--model.moe_bias_update_rate", "0",
                   "--train.max_steps", "2") != 0
    err = capsys.readouterr().err
    assert "router_bias' is non-zero" in err and "--model.moe_bias_update_rate > 0" in err
    assert "Traceback" not in err, err
