"""The estimator's validation tooling and the optimizer's multi-tensor-apply bandwidth (issue 21): the optimizer's
GPU time by hand, the validation cases' source-difference fields, and benchmarks/validation/update.py writing back
exactly what the files hold (no estimator run: the slow test in test_estimate_validation.py recomputes them)."""

import importlib.util
from pathlib import Path

import pytest

from tokenmill import config as C
from tokenmill.estimate import estimate, gpu_spec, roofline, uncertainty
from tokenmill.estimate.validation import Case, load, measured_mib, run_case

ROOT = Path(__file__).resolve().parents[1]
FILE = ROOT / "benchmarks" / "validation" / "published.toml"


def _update_module():
    spec = importlib.util.spec_from_file_location("validation_update", ROOT / "benchmarks" / "validation" / "update.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cfg(**over):
    return C.resolve("gpt2-124m", overrides={"data.source": "synthetic", "train.batch_size": 1, **over},
                     overrides_from_string=False)


@pytest.mark.parametrize("impl,passes,bandwidth", [("foreach", 19, "mta"), ("fused", 7, "mta"),
                                                   ("for-loop", 19, "plain")])
def test_optimizer_gpu_time_by_hand(impl, passes, bandwidth):
    # GPT-2 124M, fp32 parameters: AdamW's passes over them, and clipping's norm and scale (3 passes) through
    # multi-tensor-apply kernels at PR #134373's 1,458 GB/s share of the H100's 3,350 GB/s; for-loop AdamW's
    # own kernels are ordinary element-wise ones, streaming (roofline.STREAM_MEMORY_EFFICIENCY of the bandwidth)
    est = estimate(_cfg(**{"optim.impl": impl}), "h100-sxm")
    param_bytes = 4 * est.params
    mta = 3350e9 * 1458 / 3350
    own = mta if bandwidth == "mta" else roofline.streaming_bandwidth(gpu_spec("h100-sxm"))
    expected_ms = 1000 * (passes * param_bytes / own + 3 * param_bytes / mta)
    assert est.time_breakdown_ms["optimizer_ms"] == pytest.approx(expected_ms, rel=1e-6)
    assert roofline.FOREACH_MEMORY_EFFICIENCY == pytest.approx(0.435, abs=0.001)


def test_case_fields_for_source_differences(monkeypatch):
    import tokenmill.estimate as E

    seen = []
    real = E.estimate

    def spy(cfg, gpu, nproc=1):
        seen.append(gpu)
        return real(cfg, gpu, nproc)

    monkeypatch.setattr(E, "estimate", spy)
    base = dict(id="x", family="gpt2", source="https://github.com/x/y", config="c", gpu="a100-40gb", preset="gpt2-124m",
                flags={"train.batch_size": 1}, memory_mib=3000.0, tokens_per_sec=1.0)
    plain = run_case(Case(**base))
    odd = run_case(Case(**base, other_mib=100.0, extra_mib=400.0, capacity_mib=30000.0))
    # the source's capacity, moved by what the config holds more (extra) and less (other): the source's headroom
    assert seen[0].memory_mb == 40_536 and seen[1].memory_mb == 30_000 + 400 - 100 and seen[1].name == seen[0].name
    # the estimate is compared with the measurement less other_mib plus extra_mib
    assert plain["memory_error"] == pytest.approx(plain["est_memory_mib"] / 3000 - 1)
    assert odd["memory_error"] == pytest.approx(odd["est_memory_mib"] / 3300 - 1)
    assert measured_mib(Case(**base, other_mib=84, extra_mib=19456)) == 3000 - 84 + 19456


def test_update_writes_back_what_the_files_hold():
    upd = _update_module()
    cases, _ = load(FILE)
    recorded = [{"id": c.id, "memory_error": c.memory_error, "speed_error": c.speed_error} for c in cases]
    text = FILE.read_text()
    assert upd._toml(text, recorded) == text  # every recorded error in place, the rest untouched
    moved = [dict(r, speed_error=0.5) if r["id"] == cases[0].id else r for r in recorded]
    changed = upd._toml(text, moved)
    assert changed != text and load_text(changed)[0].speed_error == 0.5
    # REGIME_ERRORS and OVERALL rewritten from a summary that gives them back unchanged
    summary = {"regimes": {k: {"memory": m, "n_memory": nm, "speed": s, "n_speed": ns}
                           for k, (m, nm, s, ns) in uncertainty.REGIME_ERRORS.items()},
               "memory": uncertainty.OVERALL["memory"][0], "n_memory": uncertainty.OVERALL["memory"][1],
               "speed": uncertainty.OVERALL["speed"][0], "n_speed": uncertainty.OVERALL["speed"][1]}
    source = (ROOT / "src" / "tokenmill" / "estimate" / "uncertainty.py").read_text()
    assert upd._uncertainty(source, summary) == source
    # the doc's regime table is the one the printed ranges use
    doc = (ROOT / "docs" / "estimate.md").read_text()
    table = doc.split("<!-- regime-table:start -->")[1].split("<!-- regime-table:end -->")[0].strip()
    assert table == uncertainty.regime_markdown()
    assert "| eager, small, one GPU, full |" in table


def load_text(text: str):
    import tomllib

    return [Case(**c) for c in tomllib.loads(text)["case"]]


@pytest.mark.slow
def test_advice_offers_full_recomputation_over_selective():
    # every block checkpointed selectively: the list of switches offers no more checkpointing, but full
    # recomputation keeps less, under torch.compile too, and the advice names it when that is what fits
    from tokenmill.estimate.advice import candidate_switches, memory_advice

    over = {"train.batch_size": 16, "train.precision": "bf16-autocast",
            "memory.activation_checkpointing": 1, "memory.activation_checkpointing_policy": "save-matmuls",
            "model.loss_impl": "chunked"}
    full = {"memory.activation_checkpointing_policy": "full"}
    cfg = _cfg(**over)
    assert ("--memory.activation_checkpointing_policy full", full) in candidate_switches(cfg)
    assert all(text != "--memory.activation_checkpointing_policy full" for text, _ in
               candidate_switches(_cfg(**{**over, **full})))
    # what save-matmuls keeps beyond full recomputation, by hand, per token of 16 x 1024, 12 blocks: eager, the bf16
    # outputs of the q/k/v, attention, output, fc and fc2 products, (3 + 1 + 1 + 4 + 1) x 768 values (the policy
    # caches every product for the recomputation); compiled, what the backward needs of them: not fc2's output
    # (only the residual add reads it), but the attention's fp32 log-sum-exp, 12 heads
    kept = {False: 12 * 16 * 1024 * 10 * 768 * 2 / 2**20, True: 12 * 16 * 1024 * (9 * 768 * 2 + 12 * 4) / 2**20}
    for compiled in (True, False):
        sel = estimate(_cfg(**{**over, "compile.enabled": compiled}), "l4")
        low = estimate(_cfg(**{**over, **full, "compile.enabled": compiled}), "l4")
        saved = sel.breakdown_mb["activations"] - low.breakdown_mb["activations"]
        assert saved == pytest.approx(kept[compiled], rel=0.01), (compiled, saved)
    cap = (low.peak_reserved_mb + sel.peak_reserved_mb) / 2
    advice = memory_advice(cfg, "l4", capacity_mb=cap)  # eager: one estimate per candidate
    assert "--memory.activation_checkpointing_policy full" in advice, advice
