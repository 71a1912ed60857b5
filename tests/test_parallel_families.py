"""The parallel layouts on the Llama-family test model (preset ``tiny-llama``: rotary positions, RMSNorm,
SwiGLU, no biases, grouped-query attention with 4 query heads over 2 key/value heads, separate q/k/v and
an untied head), under torchrun with 2 and 4 gloo processes.

The same promise as tests/test_parallel.py for GPT-2: every layout trains on the same global batches
as one process, so its per-step losses, gradient norms (clipping at 0.1 is active in every step) and
validation losses equal the single-process run's within 1e-5 relative. A representative set, to keep
CI short (GPT-2 covers every switch): DDP, ZeRO-1, FSDP2, TP (k/v projections of one head per rank),
PP 1F1B with 4 micro-batches (rotary tables on both stages), FSDP x TP and HSDP, and TP of a model
with q/k norm (Qwen3); a 2-rank FSDP DCP checkpoint resumes into TP and into one process; the sharded
FSDP, TP and PP checkpoints, read whole, hold the single-process weights. No torchrun launch of its own:
its jobs run in tests/test_parallel.py's 2-rank and 4-rank launches (conftest.two_rank_launch and
four_rank_launch; the workers are test_parallel.py's).
"""

from __future__ import annotations

import json

import pytest
import torch

from test_parallel import _cut_run, assert_same_losses, common, losses, metric, preset_cfg, single

PRESET = "tiny-llama"
# every run: clipping active, evaluation at steps 3 and 6 (the pipeline's eval schedule too). Every rank
# evaluates the same train.eval_batches micro-batches of the first validation samples, so a run with
# micro-batch 4 evaluates the samples of its reference (micro-batch 4 x dp, one eval batch) with dp batches.
BASE = {"optim.grad_clip": 0.1, "train.eval_every_steps": 3}
# name -> (overrides of the distributed run, data-parallel degree = the reference's batch multiple)
TWO = {
    "ddp": ({}, 2),
    "zero1": ({"parallel.zero1": True}, 2),
    "fsdp": ({"parallel.dp_shard": 2, "checkpoint.every_steps": 3, "checkpoint.keep_last": 5}, 2),
    "tp": ({"parallel.tp": 2, "checkpoint.every_steps": 3}, 1),
    "pp_1f1b": ({"parallel.pp": 2, "parallel.pp_schedule": "1f1b", "parallel.pp_microbatches": 4}, 1),
}
FOUR = {
    "fsdp_tp": ({"parallel.dp_shard": 2, "parallel.tp": 2}, 2),
    "hsdp": ({"parallel.dp_replicate": 2, "parallel.dp_shard": 2}, 4),
}
QK_NORM = {"model.qk_norm": True}  # Qwen3's RMSNorm over each head of q and k, before RoPE
LAYOUT = {"ddp": "ddp", "zero1": "ddp", "fsdp": "fsdp", "tp": "tp", "pp_1f1b": "pp", "fsdp_tp": "fsdp+tp",
          "hsdp": "hsdp"}


def job(name: str, run_dir, dp: int, **over) -> dict:
    """A torchrun job on the test preset; ``dp``: the data-parallel degree of its reference."""
    over = {"train.eval_batches": dp, **over}
    return {"cfg": common(**BASE, **over), "run_dir": str(run_dir / name), "preset": PRESET}


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """Single-process references with the global batch of 1, 2 and 4 data-parallel ranks."""
    tmp = tmp_path_factory.mktemp("family_refs")
    for dp in (1, 2, 4):
        single(tmp, f"dp{dp}", dp=dp, preset=PRESET, **BASE, **{"train.eval_batches": 1})
    return tmp


def two_rank_jobs(tmp) -> list[dict]:
    """Every 2-rank layout, then the FSDP run's step-3 DCP checkpoint resumed under TP (batch 8 on the
    one data-parallel rank: the FSDP run's global batch): run in one 2-rank launch with other files' 2-rank
    jobs (conftest.two_rank_launch, TWO_RANK)."""
    jobs = [job(name, tmp, dp, **over) for name, (over, dp) in TWO.items()]
    jobs.append(job("tp_qk_norm", tmp, 1, **{"parallel.tp": 2, **QK_NORM}))
    jobs.append({**job("fsdp_to_tp", tmp, 1, **{"parallel.tp": 2, "train.batch_size": 8}), "resume": True,
                 "cut": {"src": str(tmp / "fsdp"), "step": 3}})
    return jobs


def four_rank_jobs(tmp) -> list[dict]:
    """The 4-rank layouts, run in one 4-rank launch with tests/test_parallel.py's (conftest.four_rank_launch)."""
    return [job(name, tmp, dp, **over) for name, (over, dp) in FOUR.items()]


@pytest.fixture(scope="module")
def two_rank_runs(two_rank_launch):
    return two_rank_launch / "llama"


def assert_like_reference(run, ref, what: str) -> None:
    assert_same_losses(losses(run), losses(ref), what=what)
    assert_same_losses(metric(run, "grad_norm"), metric(ref, "grad_norm"), what=f"{what} grad_norm")
    assert_same_losses(metric(run, "val_loss"), metric(ref, "val_loss"), what=f"{what} val_loss")
    assert sorted(metric(run, "val_loss")) == [3, 6]


@pytest.mark.slow
def test_two_rank_layouts_match_single_process(two_rank_runs, refs):
    for name, (_, dp) in TWO.items():
        run = two_rank_runs / name
        assert_like_reference(run, refs / f"dp{dp}", name)
        summary = json.loads((run / "summary.json").read_text())
        assert (summary["layout"], summary["world_size"]) == (LAYOUT[name], 2), name
        assert summary["params"] == json.loads((refs / "dp1" / "summary.json").read_text())["params"]


@pytest.mark.slow
def test_four_rank_layouts_match_single_process(four_rank_launch, refs):
    """FSDP x TP (column-wise TP weights carry FSDP's strided shard) and HSDP (2 replicas x 2 shards)."""
    tmp = four_rank_launch / "llama"
    for name, (_, dp) in FOUR.items():
        assert_like_reference(tmp / name, refs / f"dp{dp}", name)
        assert json.loads((tmp / name / "summary.json").read_text())["layout"] == LAYOUT[name]


@pytest.mark.slow
def test_fsdp_dcp_checkpoint_resumes_under_tp_and_in_one_process(two_rank_runs, refs, tmp_path):
    """The step-3 checkpoint of the 2-rank FSDP run (no position embedding in its state dict; the rotary
    tables are rebuilt, not saved) goes on under TP 2 and in one process to the uninterrupted losses."""
    from tokenmill.checkpoint import list_checkpoints
    from tokenmill.train.trainer import train

    fsdp = two_rank_runs / "fsdp"
    assert [p.name for _, p in list_checkpoints(fsdp)] == ["step_00000003.dcp", "step_00000006.dcp"]
    assert json.loads((two_rank_runs / "fsdp_to_tp" / "summary.json").read_text())["start_step"] == 3
    assert_like_reference(two_rank_runs / "fsdp_to_tp", refs / "dp2", "fsdp->tp")
    cut = tmp_path / "fsdp_to_single"
    _cut_run(fsdp, cut, 3)
    over = common(**BASE, **{"train.eval_batches": 1})
    over["train.batch_size"] *= 2
    train(preset_cfg(PRESET, **over), cut, resume=True, quiet=True)
    assert_like_reference(cut, refs / "dp2", "fsdp->single")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["fsdp", "tp", "pp_1f1b"])
def test_sharded_checkpoint_holds_the_single_process_weights(two_rank_runs, refs, name):
    """The final DCP checkpoint of an FSDP, TP (k/v projections split one head per rank) or PP run
    (each stage saves its own blocks), read whole in one process, holds the single-process run's
    weights under the plain model's names."""
    from tokenmill.checkpoint import load_model

    got, _, path = load_model(two_rank_runs / name)
    want, _, _ = load_model(refs / f"dp{TWO[name][1]}")
    assert path.suffix == ".dcp" and got.wpe is None
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert got_sd.keys() == want_sd.keys() and "blocks.0.attn.k_proj.weight" in want_sd
    for k in want_sd:
        # a weight that was not trained, or not loaded, is off by about lr = 1e-3
        assert torch.allclose(got_sd[k], want_sd[k], rtol=1e-4, atol=2e-5), (name, k)


def test_tp_plan_sums_the_qk_norm_grads_over_the_ranks():
    """The q/k norm weights are whole on every TP rank, which normalises only its own heads: the plan must
    declare them 'per_head' (Block.tp_plan, model/layers.py), the style that sums their gradients over the
    tp ranks (parallel/tensor_parallel.py). Without it each rank's gradient is a partial sum: the gradient
    norm is off and the ranks' norm weights drift apart (the torchrun test below measures it)."""
    from tokenmill.model import GPT
    from tokenmill.parallel.tensor_parallel import styles

    with torch.device("meta"):
        model = GPT(preset_cfg(PRESET, **QK_NORM).model, 64)
    plan = model.tp_plan(2)
    assert {k: v for k, v in plan.items() if "norm" in k} == {"attn.q_norm": "per_head", "attn.k_norm": "per_head"}
    assert {type(s).__name__ for k, s in styles(plan).items() if "norm" in k} == {"PerHead"}
    with torch.device("meta"):
        plain = GPT(preset_cfg(PRESET).model, 64)  # no q/k norm: nothing per head
    assert "per_head" not in plain.tp_plan(2).values()


@pytest.mark.slow
def test_tp_with_qk_norm_matches_single_process(two_rank_runs, tmp_path):
    """q/k norm under TP: each rank normalises its own heads with the whole (replicated) norm weight, whose
    gradient is summed over the tp ranks ('per_head'); without the sum the gradient norm is off by
    ~4e-5 relative and the ranks' norm weights drift apart."""
    ref = tmp_path / "ref"
    single(tmp_path, "ref", dp=1, preset=PRESET, **BASE, **QK_NORM, **{"train.eval_batches": 1})
    assert_like_reference(two_rank_runs / "tp_qk_norm", ref, "tp qk_norm")


def test_tp_refuses_fewer_kv_heads_than_ranks():
    """Grouped-query attention under TP: each rank takes whole key/value heads, so tp must divide them."""
    from tokenmill.errors import ParallelError
    from tokenmill.train.trainer import build_model

    model = build_model(preset_cfg(PRESET), 64, torch.device("cpu"))
    assert model.tp_plan(2)["attn.k_proj"] == "colwise"
    with pytest.raises(ParallelError, match=r"key/value heads \(2\) must be divisible by parallel.tp \(4\)"):
        model.tp_plan(4)
