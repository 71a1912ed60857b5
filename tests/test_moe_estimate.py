"""tokenmill estimate on mixtures of experts (estimate/moe.py): expert memory sharded by parallel.ep and
FSDP against a hand count from the preset's shapes, the all-to-all bytes, the grouped matmuls' efficiency at
their real shapes, the report, bad layouts, and a tiny MoE's CPU estimate against a measured run."""

import math

import pytest

from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.errors import ParallelError
from tokenmill.estimate import estimate
from tokenmill.estimate.bandwidth import LINK_EFFICIENCY, link_bandwidth
from tokenmill.estimate.gpus import gpu_spec
from tokenmill.estimate.moe import _seconds, a2a_bytes, expert_matmuls, tokens_per_expert

MiB = 1024 * 1024


def qwen(**over) -> C.Config:
    """Qwen3-30B-A3B's shapes, 4 of its 48 layers, a short micro-batch (quick to replay)."""
    base = {"model.block_size": 512, "train.batch_size": 1, "model.vocab_size": 151936, "model.n_layer": 4}
    base.update(over)
    return C.resolve("qwen3-30b-a3b", overrides=base, overrides_from_string=False)


def test_qwen3_30b_a3b_ep8_fsdp8_parts_against_a_hand_count():
    cfg = qwen(**{"parallel.dp_shard": 8, "parallel.ep": 8})
    est = estimate(cfg, "h100-sxm", 8)
    t = est.moe
    E, k, C_, I_, L = 128, 8, 2048, 768, 4  # the preset's shapes (Qwen3-30B-A3B's config.json), 4 layers
    expert_params = L * E * 3 * I_ * C_  # gate_up (E, 2I, C) and down (E, C, I) per sparse layer
    assert t["expert_params"] == expert_params
    assert (t["experts_per_rank"], t["expert_ranks"]) == (E // 8, 8)
    width = 4  # bf16-autocast keeps fp32 weights
    assert t["expert_weights_mb"] == pytest.approx(expert_params * width / 8 / MiB, rel=1e-9)
    assert t["expert_gradients_mb"] == pytest.approx(t["expert_weights_mb"], rel=1e-9)
    assert t["expert_optimizer_mb"] == pytest.approx(2 * expert_params * width / 8 / MiB, rel=1e-3)  # AdamW: 2 moments
    tokens = 512
    assert t["tokens_per_expert"] == tokens * k * 8 / E == 256
    act = 4  # the residual stream under autocast is fp32: what the dispatch carries
    per_layer = 4 * tokens * k * C_ * act * 7 / 8  # dispatch + combine, forward + backward, 7/8 leave the rank
    assert t["all_to_all_mb"] == pytest.approx(L * per_layer / MiB, rel=1e-9)
    link = gpu_spec("h100-sxm").link_gbs * 1e9 * LINK_EFFICIENCY["h100"]  # NVLink 4 on a Hopper
    assert link == link_bandwidth(gpu_spec("h100-sxm"))
    assert t["all_to_all_ms"] == pytest.approx(1000 * L * per_layer / link, rel=1e-9)
    assert est.time_breakdown_ms["all_to_all_ms"] == t["all_to_all_ms"]
    ra = t["routed_activations_mb"]
    assert ra["expert hidden"] == pytest.approx(tokens * k * 3 * I_ * act / MiB)
    assert ra["router logits"] == pytest.approx(tokens * E * 12 / MiB)
    # the estimate's breakdown still sums to its peak after the MoE terms
    assert sum(est.breakdown_mb.values()) == pytest.approx(est.peak_alloc_mb, rel=1e-6)


def test_all_to_all_bytes_formula_and_one_rank_sends_nothing():
    assert a2a_bytes(1024, 2, 4096, 2, 8) == 4 * 1024 * 2 * 4096 * 2 * 7 / 8
    assert a2a_bytes(1024, 2, 4096, 2, 8, passes=6) == 6 * 1024 * 2 * 4096 * 2 * 7 / 8  # recomputed forward
    assert a2a_bytes(1024, 2, 4096, 2, 1) == 0
    assert tokens_per_expert(4096, 2, 8, 1) == 1024 and tokens_per_expert(4096, 2, 8, 4) == 4096


def test_small_expert_groups_run_at_lower_efficiency():
    """Many small groups (the same FLOPs) take longer than one large product, by the roofline's own pricing."""
    cfg, gpu = qwen(), gpu_spec("h100-sxm")
    big = expert_matmuls(1, 65536, 2048, 768, "bf16", True, False)
    small = expert_matmuls(4096, 16, 2048, 768, "bf16", True, False)
    assert sum(c.flops for c in big) == sum(c.flops for c in small)
    assert _seconds(small, cfg, gpu) > 1.5 * _seconds(big, cfg, gpu)


def test_the_expert_loop_costs_host_time_the_grouped_product_does_not():
    from tokenmill.estimate.host import HOST_OP_US
    from tokenmill.estimate.moe import LOOP_OPS_BWD, LOOP_OPS_FWD

    cfg = C.resolve("tiny-moe", overrides={"model.vocab_size": 64, "model.moe_impl": "loop"}, overrides_from_string=False)
    loop = estimate(cfg, "h100-sxm")
    cfg.model.moe_impl = "grouped"
    grouped = estimate(cfg, "h100-sxm")
    host = 2 * 4 * (LOOP_OPS_FWD + LOOP_OPS_BWD) * HOST_OP_US / 1000  # 2 sparse layers, 4 experts, ms
    assert (loop.moe["impl"], grouped.moe["impl"]) == ("loop", "grouped")
    assert loop.moe["grouped_matmul_ms"] == pytest.approx(host)  # tiny experts: the host sets the pace
    assert loop.step_ms - grouped.step_ms == pytest.approx(host - grouped.moe["grouped_matmul_ms"], rel=1e-6)


def test_expert_parallelism_over_ddp_cuts_the_expert_state():
    """ep over DDP replicas (no FSDP): each rank keeps 1/ep of every expert's weights and optimizer state."""
    over = {"model.n_layer": 2, "model.block_size": 256}
    one = estimate(qwen(**over, **{"parallel.dp_replicate": 4}), "h200", 4)
    ep = estimate(qwen(**over, **{"parallel.dp_replicate": 4, "parallel.ep": 4}), "h200", 4)
    saved = one.breakdown_mb["parameters"] - ep.breakdown_mb["parameters"]
    assert saved == pytest.approx(3 / 4 * one.moe["expert_weights_mb"], rel=1e-6)
    state = one.breakdown_mb["optimizer state"] - ep.breakdown_mb["optimizer state"]
    assert state == pytest.approx(3 / 4 * one.moe["expert_optimizer_mb"], rel=1e-6)


def test_an_ep_that_does_not_divide_the_world_names_the_field():
    with pytest.raises(ParallelError, match=r"parallel.ep.*8.*must divide the data-parallel world size"):
        estimate(qwen(**{"parallel.dp_shard": 4, "parallel.ep": 8}), "h100-sxm", 4)


def test_estimate_report_shows_the_moe_parts(capsys):
    rc = main(["estimate", "--preset", "tiny-moe", "--model.vocab_size", "64", "--gpu", "h100-sxm"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "mixture of experts: 4 experts, 2 per token, 2 sparse layer(s)" in out
    assert "grouped expert matmuls: 64 tokens per expert" in out  # 4 x 32 tokens x 2 / 4 experts
    assert "routed activations per sparse layer" in out


@pytest.mark.slow
def test_tiny_moe_cpu_estimate_agrees_with_a_measured_run(tmp_path):
    from test_estimate import measured_peak_mb

    cfg = C.resolve("tiny-moe", overrides={"data.source": "synthetic", "model.vocab_size": 256, "model.n_embd": 64,
                                           "model.moe_intermediate_size": 128, "train.batch_size": 8,
                                           "model.block_size": 64, "train.max_steps": 3, "train.device": "cpu",
                                           "train.eval_batches": 0, "log.progress": "plain",
                                           "checkpoint.save_final": False, "log.every_steps": 1},
                    overrides_from_string=False)
    est = estimate(cfg, "cpu").peak_alloc_mb
    meas = measured_peak_mb(cfg, tmp_path)
    assert math.isfinite(est) and abs(est / meas - 1) <= 0.15, f"estimate {est:.2f} MiB, measured {meas:.2f} MiB"


@pytest.mark.slow
def test_moe_ladder_smoke_runs_the_loop_and_grouped_experts_to_the_same_loss(tmp_path, monkeypatch):
    """The moe ladder's first two rungs through the real bench on a CPU (--smoke): both train, and the grouped
    experts give the loop's loss (the same numbers, a different schedule)."""
    import json

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the rungs' processes
    monkeypatch.setenv("TOKENMILL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    assert main(["bench", "ladder", "moe", "--smoke", "--quiet", "--out", str(out), "--rungs", "baseline,grouped",
                 "--steps", "2", "--set", "model.moe_experts=8"]) == 0
    rungs = {r["name"]: r for r in json.loads((out / "ladder.json").read_text())["rungs"]}
    seen = {n: (r["status"], r.get("reason")) for n, r in rungs.items()}
    assert [n for n, r in rungs.items() if r["status"] == "measured"] == ["baseline", "grouped"], seen
    assert rungs["compile"]["reason"].startswith("not selected (--rungs)")
    a, b = (rungs[n]["metrics"]["final_loss"] for n in ("baseline", "grouped"))
    assert math.isfinite(a) and a == pytest.approx(b, rel=1e-4), (a, b)
    assert rungs["grouped"]["config"]["model"]["moe_impl"] == "grouped"
