"""The doctor's confidence and its data-loading advice, on RECORDED inputs (no live timing).

Each run directory is written by hand the way the trainer writes it (a ``metrics.jsonl`` row per log window,
``step_ms`` = tokens per step / the window's tokens/s, ``summary.json`` from the same windows), so the
verdicts do not depend on this machine's speed or load.
"""

from __future__ import annotations

import json
import math
import statistics

import pytest

from conftest import count_newton_schulz, tiny_cfg
from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.profiling import confidence, optim_rules, rules, trial
from tokenmill.profiling.doctor import diagnose, format_verdict, rank
from tokenmill.train.metrics import steady_figures

TOKENS = 128  # tokens per step of the recorded runs


def window(step: int, step_ms: float, data_ms: float) -> dict:
    """One log window as the trainer records it; the rest of the step split 40/50/10 between the phases."""
    rest = step_ms - data_ms
    return {"step": step, "loss": 4.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1000.0 * TOKENS / step_ms,
            "mfu": None, "data_ms": data_ms, "h2d_ms": 0.0, "forward_ms": 0.4 * rest, "backward_ms": 0.5 * rest,
            "optimizer_ms": 0.1 * rest, "step_ms": step_ms, "other_ms": 0.0}


def recorded_run(d, windows: list[tuple[float, float]], **cfg_overrides):
    """A run directory from (step_ms, data_ms) per window: config.toml, metrics.jsonl, summary.json."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = tiny_cfg(**{"log.every_steps": 10, "log.timing_warmup_steps": 5, **cfg_overrides})
    C.save(cfg, d / "config.toml")
    rows = [window(10 * (i + 1), s, w) for i, (s, w) in enumerate(windows)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"steps": 10 * len(rows), "start_step": 0, "tokens_per_step": TOKENS, "device": "cpu",
               "threads": {"intra_op": 1, "inter_op": 1, "cpu_count": 8, "local_world_size": 1},
               **steady_figures([r["tokens_per_sec"] for r in rows], TOKENS), "timing_from_step": 5}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


CLEAN = [(100.0 + (i % 3), 40.0 + (i % 2)) for i in range(10)]  # data 40% of every window
NOISY_SHARES = [0.02, 0.38, 0.05, 0.36, 0.04, 0.39, 0.03, 0.37, 0.06, 0.30]  # 20% on average, 2-39% per window
# 70% of every step waiting for data; two windows where other work on the machine made the step 20x longer
SPIKED = [(10.0, 7.0)] * 8 + [(200.0, 7.0)] * 2


def test_a_clean_data_bound_run_is_named_with_high_confidence(tmp_path):
    v = diagnose(recorded_run(tmp_path, CLEAN))
    assert v["main"] == "data_bound"
    c = v["findings"][0]["confidence"]
    assert c["level"] == "high" and c["windows"] == 10 and c["z"] > confidence.HIGH
    assert c["spread"][0] == pytest.approx(40 / 102, rel=1e-6) and c["spread"][1] == pytest.approx(41 / 100)
    assert "confidence high: data 40% of the step vs the 15% threshold" in format_verdict(v)


def test_the_same_run_with_heavy_noise_is_too_noisy_to_judge(tmp_path, capsys):
    d = recorded_run(tmp_path, [(100.0, 100.0 * s) for s in NOISY_SHARES])
    v = diagnose(d)
    top = v["findings"][0]
    assert top["key"] == "data_bound" and not top["minor"]  # the rule fires: 20% of the step on average
    assert top["confidence"]["level"] == confidence.NOISY and top["confidence"]["z"] < confidence.ENOUGH
    assert v["main"] is None and v["verdict"].startswith("too noisy to judge")
    assert main(["doctor", str(d)]) == 0
    out = capsys.readouterr().out
    assert "Too noisy to judge" in out and "OMP_NUM_THREADS" in out and "more steps" in out
    assert main(["doctor", str(d), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["findings"][0]["confidence"]["level"] == confidence.NOISY and js["main"] is None


def test_a_70_percent_data_wait_with_busy_windows_is_caught(tmp_path):
    """Summed over every window the wait is under the 15% threshold (two windows 20x slower drown it); the
    doctor leaves those windows out, says so, and names the 70% wait with high confidence."""
    assert sum(w for _, w in SPIKED) / sum(s for s, _ in SPIKED) < 0.15  # what a plain average would see
    v = diagnose(recorded_run(tmp_path, SPIKED))
    assert v["main"] == "data_bound"
    assert v["figures"]["data_share"] == pytest.approx(0.7)
    assert v["findings"][0]["confidence"]["level"] == "high"
    assert "log windows 1-8 of 10" in v["figures"]["windows"] and "9-10 left out" in v["figures"]["windows"]


TIMED_KEYS = ["level", "effect", "threshold", "z", "windows", "spread", "phase", "why"]  # --json's, as before typing
FIGURE_KEYS = ["step_ms", "data_share", "h2d_share", "forward_share", "backward_share", "optimizer_share",
               "idle_share", "tokens_per_step", "tokens_per_sec", "phase_source", "step_source",
               "tokens_per_sec_source", "windows"]


def test_the_json_keeps_its_keys(tmp_path, capsys):
    """``doctor --json`` serialises the typed ratings at the edge with the keys it always had, per kind of rating,
    and the text output reads them back typed."""
    d = recorded_run(tmp_path, CLEAN)
    assert main(["doctor", str(d), "--json"]) == 0
    js = json.loads(capsys.readouterr().out)
    c = js["findings"][0]["confidence"]
    assert list(c) == TIMED_KEYS and c["phase"] == "data" and len(c["spread"]) == 2
    assert list(js["figures"]) == FIGURE_KEYS and isinstance(js["figures"]["tokens_per_step"], int)
    assert confidence.Confidence.of_json(c).to_json() == c  # the text output reads it back
    untimed = confidence.rate({"key": "host_sync"}, {"config": {}})
    assert untimed.to_json() == {"level": "not timed", "why": untimed.why}
    few = confidence.rate({"key": "data_bound"}, {"config": {}, "data_share": 0.4})
    assert list(few.to_json()) == ["level", "windows", "effect", "threshold", "why"] and few.windows == 0
    with pytest.raises(TypeError):
        confidence.Confidence.of_json({**c, "levle": "high"})


def test_the_doctors_step_time_is_the_summarys(tmp_path):
    """Even number of windows: the median step time differs from tokens per step / median tokens/s; the
    doctor reports the summary's figure."""
    d = recorded_run(tmp_path, CLEAN)
    summary = json.loads((d / "summary.json").read_text())
    fig = diagnose(d)["figures"]
    assert fig["step_ms"] == pytest.approx(summary["step_time_ms"], rel=1e-12)
    assert fig["step_ms"] * summary["tokens_per_sec"] == pytest.approx(1000 * TOKENS, rel=1e-12)
    assert fig["tokens_per_sec"] == summary["tokens_per_sec"]


def test_confidence_without_a_spread_and_for_untimed_rules():
    base = {"config": {}, "step_ms": 100.0, "data_ms": 40.0, "data_share": 0.4}
    one = rank({**base, "windows": confidence.window_set([100.0], {"data": [40.0]}, "log window")})
    assert one[0]["confidence"].level == "unknown"  # one window: no spread to judge by
    sync = rank({"config": {"log.every_steps": 1}, "syncs_per_step": 2.0})
    assert sync[0]["key"] == "host_sync" and sync[0]["confidence"].level == "not timed"


# ------------------------------------------------------------------------------------------------
# Data-loading advice that can be taken on the machine


def data_facts(cores: int, intra: int, data_ms: float, workers: int = 0, work_ms: float = 0.0) -> dict:
    return {"config": {"data.num_workers": workers, "data.cpu_work_ms": work_ms, "train.batch_size": 8},
            "device": "cpu", "step_ms": 100.0, "data_ms": data_ms, "data_share": data_ms / 100.0,
            "threads": {"intra_op": intra, "cpu_count": cores, "local_world_size": 1}}


def suggestions(f: dict) -> list[dict]:
    return rules.data_bound(f).suggestions


def test_a_small_machine_with_heavy_per_sample_work_is_told_so():
    """2 cores, 2 training threads, 90% of the step loading: no split of the cores helps."""
    f = data_facts(cores=2, intra=2, data_ms=90.0, work_ms=10.0)
    plan = rules.loading_plan(f)
    assert plan.too_small and plan.cores_needed == 2 + math.ceil(1.25 * 90 / 10)
    sug = suggestions(f)
    assert not any((s["switch"] or "").startswith(("--data.num_workers", "--data.prefetch_factor")) for s in sug)
    assert "too small for the per-sample work" in sug[0]["why"]


def test_a_big_machine_gets_more_workers():
    """16 cores, 8 training threads: 8 workers (the 12 that would keep up do not fit beside the threads)."""
    sug = suggestions(data_facts(cores=16, intra=8, data_ms=90.0))
    assert sug[0]["switch"] == "--data.num_workers 8" and "env" not in sug[0]


def test_workers_that_need_cores_take_them_from_the_training_threads():
    """4 cores all used by training, loading 60 ms against 40 ms of compute: 1 worker and 3 threads predict
    max(40 x 4/3, 60) = 60 ms per step, under 80% of today's 100 ms."""
    f = data_facts(cores=4, intra=4, data_ms=60.0)
    plan = rules.loading_plan(f)
    assert (plan.workers, plan.threads) == (1, 3) and plan.predicted_ms == pytest.approx(60.0)
    top = suggestions(f)[0]
    assert top["switch"] == "--data.num_workers 1" and top["env"] == {"OMP_NUM_THREADS": "3"}


def test_prefetch_is_offered_only_when_the_workers_keep_up():
    keep_up = data_facts(cores=16, intra=4, data_ms=20.0, workers=4, work_ms=2.0)  # 16 ms/step over 4 workers
    assert any(s["switch"] == "--data.prefetch_factor 4" for s in suggestions(keep_up))
    behind = data_facts(cores=16, intra=4, data_ms=20.0, workers=1, work_ms=20.0)
    assert not any(s["switch"] == "--data.prefetch_factor 4" for s in suggestions(behind))


# ------------------------------------------------------------------------------------------------
# --try: whether the difference exceeds the noise


def test_try_reports_the_ratio_and_whether_it_exceeds_the_noise():
    def runs(*tps, spread=0.1):
        return [{"ok": True, "round": i, "tokens_per_sec": t, "wall_tokens_per_sec": t, "peak_mb": 1.0,
                 "window_spread": spread} for i, t in enumerate(tps)]

    base = runs(1000, 1010, 990)
    worse = trial.compare(base, runs(930, 935, 925), "speed")  # the measured 7% loss of a bad suggestion
    assert worse["status"] == "worse" and worse["exceeds_noise"]
    assert worse["changes"]["speed"]["ratio"] == pytest.approx(statistics.median([0.93, 935 / 1010, 925 / 990]))
    assert worse["window_spread"] == pytest.approx(0.1)
    same = trial.compare(base, runs(1005, 1000, 1012), "speed")
    assert same["status"] == "not confirmed" and not same["exceeds_noise"]
    text = "\n".join(trial.format_trials({"repeats": 3, "steps": 30, "order": ["A", "B1"], "baseline": base,
                                         "tries": [{**same, "switch": "--x 1", "env": {}, "finding": "k"}]}))
    assert "B/A ratio" in text and "does not exceed the noise" in text
    # a verdict with nothing measurable: --try runs nothing and says so, without an empty "Tried (...)" header
    nothing = {"steps": 30, "repeats": 3, "order": [], "baseline": [], "tries": [], "note": "no suggestion of x"}
    assert trial.format_trials(nothing) == ["\nNothing tried: no suggestion of x"]


# ------------------------------------------------------------------------------------------------
# Muon


def muon_facts(tokens: int, **config) -> dict:
    flat = C.flatten(tiny_cfg(**{"optim.name": "muon", **config}).to_dict())  # 2 blocks, width 32
    return {"config": flat, "device": "cpu", "flops_per_token": 2.0e5, "tokens_per_step": tokens}


def test_muon_newton_schulz_share_is_counted_from_the_models_matrices():
    """GPT-2 blocks of width E: q, k, v, the attention projection (E x E: 5 x 6 E^3 FLOPs each) and the two
    MLP matrices (4E x E: 5 x (16 + 2) E^3 each): 300 E^3 per block."""
    e, layers = 32, 2
    ns = layers * 300 * e**3
    f = muon_facts(128)
    assert optim_rules.newton_schulz_flops(f) == pytest.approx(ns)
    found = optim_rules.muon_newton_schulz(f)
    share = ns / (ns + 2.0e5 * 128)
    assert found.score == pytest.approx(0.8 * share) and f"{100 * share:.0f}% of the step's FLOPs" in found.evidence[0]
    assert [s["switch"] for s in found.suggestions] == ["--train.grad_accum_steps 4", "--train.batch_size 16",
                                                        "--optim.name adamw"]
    assert rank(f)[0]["key"] == "muon_newton_schulz"  # registered, named first on this run
    for s in found.suggestions:  # each one resolves on the run's config
        words = s["switch"].split()
        C.resolve("tiny", overrides={"optim.name": "muon", **{k[2:]: v for k, v in zip(words[::2], words[1::2])}})


def test_muon_rule_is_quiet_on_large_batches_and_adamw():
    assert optim_rules.muon_newton_schulz(muon_facts(128 * 64)) is None  # 1.5% of the step's FLOPs
    assert optim_rules.muon_newton_schulz(muon_facts(128, **{"optim.name": "adamw"})) is None


def test_muon_on_a_fine_tune_is_a_minor_note():
    f = muon_facts(128 * 64, **{"train.init_from": "models/hf-folder"})
    found = {x["key"]: x for x in rank(f)}
    assert found["muon_finetune"]["minor"] and "--optim.name adamw" in found["muon_finetune"]["suggestions"][0]["why"]


@pytest.mark.slow  # one real optimizer step
def test_muon_newton_schulz_on_a_mixture_of_experts_counts_what_muon_orthogonalises(monkeypatch):
    """Dense and sparse blocks mixed (3 layers, layer 0 dense), 4 routed experts, a gated shared expert, a fused
    q/k/v with grouped k/v: the rule's Newton-Schulz FLOPs equal those of the matrices one real MuonWithAdamW step
    hands to newton_schulz (each expert's gate, up and down on its own; the router and shared gate on AdamW)."""
    import torch

    from tokenmill.estimate.techniques import ns_flops
    from tokenmill.model.build import build_gpt
    from tokenmill.optim import build_optimizer

    cfg = C.resolve("tiny-moe", overrides={"model.vocab_size": 64, "optim.name": "muon", "model.n_layer": 3,
                                           "model.moe_dense_layers": "0", "model.fused_qkv": True,
                                           "model.moe_intermediate_size": 16, "model.moe_shared_experts": 1,
                                           "model.moe_shared_gate": True}, overrides_from_string=False)
    assert cfg.model.sparse_layers() == [1, 2]
    seen = count_newton_schulz(monkeypatch)
    torch.manual_seed(0)
    model = build_gpt(cfg.model, 64, "cpu")
    opt = build_optimizer(model, cfg)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(x, x)[1].backward()
    opt.step()
    assert (4, (16, 32)) in seen and (4, (32, 16)) in seen and (1, (1, 32)) not in seen  # experts; no gate
    real_flops = sum(k * ns_flops(s) for k, s in seen)
    f = {"config": C.flatten(cfg.to_dict()), "device": "cpu", "flops_per_token": 2.0e4, "tokens_per_step": 64}
    assert optim_rules.newton_schulz_flops(f) == pytest.approx(real_flops, rel=1e-12)
    counted = sorted(p for block in optim_rules.model_matrices(cfg.model) for x in block
                     for p in optim_rules.muon_parts(x))
    assert counted == sorted(seen)  # the same matrices, not only the same total
    found = optim_rules.muon_newton_schulz(f)
    assert found is not None and "4 routed experts in each of 2 sparse layer(s)" in found.evidence[1]
    lora = {**f, "config": {**f["config"], "lora.rank": 4}}  # LoRA: Muon steps only the rank-4 adapters
    assert optim_rules.newton_schulz_flops(lora) is None and optim_rules.muon_newton_schulz(lora) is None
