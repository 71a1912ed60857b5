"""The doctor's mixture-of-experts rules (profiling/moe_rules.py): routing imbalance from the logged expert load,
the all-to-all's share of the step, small expert matmuls; each with the switch that helps."""

import pytest

from test_doctor import cuda_facts, facts, write_run
from tokenmill import config as C
from tokenmill.estimate.gpus import GPUS
from tokenmill.profiling.doctor import diagnose
from tokenmill.profiling.facts import Run
from tokenmill.profiling.moe_rules import (
    A2A_SHARE,
    IMBALANCE,
    SMALL_LOSS,
    all_to_all_share,
    group_loss,
    moe_facts,
    routing_imbalance,
    small_expert_matmuls,
)

MOE = {"model.moe_experts": 8, "model.moe_top_k": 2, "model.mlp": "swiglu", "model.n_layer": 2, "model.n_embd": 64,
       "model.n_head": 4, "model.moe_aux_loss_coef": 0.001, "model.moe_intermediate_size": 64}


def rows(loads: list[float]) -> list[dict]:
    """Log rows of a 2-layer MoE: layer 1 carries the given loads, layer 0 stays near balanced."""
    return [{"step": 10 * (i + 1), "loss": 3.0, "step_ms": 100.0, "tokens_per_sec": 1000.0, "moe_load_0": 1.1,
             "moe_load_1": x, "moe_load_max": max(1.1, x)} for i, x in enumerate(loads)]


def test_moe_facts_take_the_median_load_and_the_worst_layer():
    f = moe_facts(rows([1.2, 2.6, 2.4]), {"top_ops": [
        {"name": "c10d::alltoall_base_", "share": 0.2}, {"name": "aten::mm", "share": 0.5}]})
    assert f == {"moe_load_max": 2.4, "moe_load_layer": 1, "moe_a2a_share": 0.2}
    assert moe_facts([{"step": 1, "loss": 2.0, "step_ms": 9.0}]) == {}  # a dense run: nothing


def test_routing_imbalance_fires_with_its_switch_and_a_balanced_run_does_not():
    hot = routing_imbalance(facts(config=MOE, moe_load_max=2.5, moe_load_layer=1, world_size=1))
    assert hot is not None and hot.title == "unbalanced expert routing"
    assert hot.suggestions[0]["switch"] == "--model.moe_aux_loss_coef 0.01"  # 10x the run's 0.001
    assert "2.50x the mean" in hot.evidence[0] and "layer 1" in hot.evidence[0]
    # the switch is a valid override of the run's config
    C.resolve(None, overrides={**MOE, "model.moe_aux_loss_coef": "0.01", "model.vocab_size": "64"})
    assert routing_imbalance(facts(config=MOE, moe_load_max=IMBALANCE - 0.1)) is None
    assert routing_imbalance(facts(moe_load_max=3.0)) is None  # a dense model has no experts to balance
    off = routing_imbalance(facts(config={**MOE, "model.moe_aux_loss_coef": 0.0}, moe_load_max=2.0))
    assert off.suggestions[0]["switch"] == "--model.moe_aux_loss_coef 0.01" and "is off" in off.evidence[1]


def test_expert_parallel_runs_get_advice_not_a_switch_to_try():
    """--try runs one process: under parallel.ep the flags are advice; the score grows with the experts' share."""
    cfg = {**MOE, "parallel.ep": 2, "parallel.dp_shard": 2}
    f = routing_imbalance(facts(config=cfg, moe_load_max=3.0, world_size=2, flops_per_token=1e6))
    assert f.suggestions[0]["switch"] is None and "--model.moe_aux_loss_coef 0.01" in f.suggestions[0]["why"]
    share = 6.0 * 2 * 2 * 3 * 64 * 64 / 1e6  # routed experts' FLOPs per token over the run's
    assert f.score == pytest.approx(max(0.1, share * (1 - 1 / 3.0)))


def test_all_to_all_share_from_the_profile():
    cfg = {**MOE, "parallel.ep": 4, "parallel.dp_shard": 4}
    f = all_to_all_share(cuda_facts(config=cfg, moe_a2a_share=0.3, world_size=4))
    assert f is not None and "30% of the step (the profile's top operators)" in f.evidence[0]
    assert f.suggestions[0]["why"].startswith("--parallel.ep 2") and f.suggestions[0]["switch"] is None
    assert all_to_all_share(cuda_facts(config=cfg, moe_a2a_share=A2A_SHARE / 2, world_size=4)) is None
    assert all_to_all_share(cuda_facts(config=MOE, moe_a2a_share=0.5)) is None  # no expert parallelism


def test_small_expert_matmuls_on_one_gpu_suggest_a_larger_batch_to_try():
    cfg = {**MOE, "model.n_embd": 1024, "model.n_head": 8, "model.moe_experts": 64, "model.moe_intermediate_size": 1024,
           "model.block_size": 256, "train.batch_size": 8}  # 8 x 256 x 2 / 64 = 64 tokens per expert
    f = small_expert_matmuls(cuda_facts(config=cfg, world_size=1, flops_per_token=2e9))
    assert f is not None and "64 tokens per expert" in f.evidence[0]
    # the smallest of 2x, 4x, 8x the tokens per expert at which the estimator's grouped-matmul loss falls under
    # SMALL_LOSS: 4x, 256 tokens per expert (the products' depth, roofline.depth_share, prices the thin weight
    # gradients, whose K is the expert's tokens)
    run, gpu = Run.of(cuda_facts(config=cfg, world_size=1, flops_per_token=2e9)), GPUS["h100-sxm"]
    assert group_loss(run, 64 * 4, gpu) < SMALL_LOSS <= group_loss(run, 64 * 2, gpu)
    assert f.suggestions[0]["switch"] == "--train.batch_size 32"
    big = {**cfg, "train.batch_size": 64}
    assert small_expert_matmuls(cuda_facts(config=big, world_size=1, flops_per_token=2e9)) is None
    assert small_expert_matmuls(facts(config=cfg)) is None  # CPU: no tensor cores to starve


def test_doctor_reads_the_expert_load_from_a_run_directory(tmp_path):
    cfg = C.resolve("tiny-moe", overrides={"model.vocab_size": "64", "data.source": "synthetic"})
    d = write_run(tmp_path, cfg, summary={"world_size": 1, "tokens_per_step": 128, "steps": 40,
                                          "timing_from_step": 0}, metrics=rows([2.2, 2.8, 2.6, 2.7]))
    v = diagnose(d)
    hit = [f for f in v["findings"] if f["key"] == "routing_imbalance"]
    assert hit and "2.65x the mean" in hit[0]["evidence"][0]
