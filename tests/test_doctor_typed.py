"""The doctor's typed run (``profiling/facts.py``): the run's config as a ``Config`` (its values over the config's
own defaults and derived sizes), the measured facts as frozen dataclasses checked once, and rules written for it
giving the same findings whether handed the typed run or the flat facts."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill import config as C
from tokenmill.errors import DoctorError
from tokenmill.profiling import fp8_rules, optim_rules, rules, technique_rules
from tokenmill.profiling.doctor import rank
from tokenmill.profiling.facts import Run, typed_config

MIGRATED = (rules.data_bound, rules.logits_peak, rules.activation_memory, rules.optimizer_state_memory,
            rules.allocator_thrash, fp8_rules.fp8_cannot_pay, *optim_rules.RULES, technique_rules.lora_finetune,
            technique_rules.qlora_finetune, technique_rules.selective_recompute, rules.layer_forms, rules.compile_off,
            rules.fp32_math, rules.attention, rules.copy_bound, rules.host_sync, rules.launch_overhead,
            rules.micro_batch, rules.optimizer_impl, rules.activation_recompute, rules.memory_savers_with_room,
            rules.thread_oversubscription, rules.outside_steady_state)


def test_the_config_is_typed_with_its_own_defaults_and_sizes():
    run = Run.of({"config": {"model.n_head": 8, "model.n_embd": 512, "model.n_kv_head": 2,
                             "data.num_workers": 3, "nosuch.field": 1}})
    m = run.config.model
    assert (m.head_width, m.kv_heads) == (64, 2)  # derived by the config, not re-derived by a rule
    assert m.mlp_width == C.ModelConfig(n_head=8, n_embd=512).mlp_width
    assert run.config.data.num_workers == 3 and run.config.train == C.Config().train  # the rest: defaults
    # a value this version's field refuses keeps the default (load_run has warned about it)
    assert typed_config({"data.num_workers": "many"}).data.num_workers == C.Config().data.num_workers
    with pytest.raises(AttributeError):
        run.config.data.num_worker  # noqa: B018  # a misspelt field is an error where it is read


def test_measured_facts_are_checked_once_and_frozen():
    f = {"config": {}, "device": "cuda", "step_ms": 100, "data_ms": 20.0, "data_share": 0.2, "peak_mb": 900.0,
         "peak_reserved_mb": 1000.0, "device_total_mb": 4000.0, "threads": {"cpu_count": 8, "intra_op": 2,
                                                                            "load_avg": 3.4}}
    run = Run.of(f)
    assert run.timing.step_ms == 100.0 and isinstance(run.timing.step_ms, float)
    assert run.memory_fill() == 0.25 and Run.of({**f, "device": "cpu"}).memory_fill() is None
    assert (run.host.cores, run.host.training_threads) == (5, 2)  # 8 cores less the other load, rounded
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.timing.step_ms = 1.0  # type: ignore[misc]
    with pytest.raises(AttributeError):
        run.timing.stepms  # noqa: B018
    for bad in ("12", True, float("nan")):
        with pytest.raises(DoctorError, match="'data_ms' is .* not a finite number"):
            Run.of({**f, "data_ms": bad})


def _gpu_facts(**kw) -> dict:
    base = {"config": {"train.batch_size": 8, "train.grad_accum_steps": 1, "model.loss_impl": "full"},
            "device": "cuda", "step_ms": 100.0, "data_ms": 40.0, "data_share": 0.4, "memory_total_mb": 70000.0,
            "vocab_sized_mb": 30000.0, "peak_reserved_mb": 75000.0, "device_total_mb": 80000.0,
            "peak_region": "forward", "peak_op": "aten::cross_entropy_loss",
            "threads": {"cpu_count": 16, "intra_op": 4, "local_world_size": 1}}
    base.update(kw)
    return base


def test_typed_rules_take_the_run_or_the_flat_facts_alike():
    f = _gpu_facts()
    run = Run.of(f)
    assert all(getattr(rule, "typed", False) for rule in MIGRATED)
    untyped = {r.__name__ for r in rules.RULES if not getattr(r, "typed", False)}
    assert not untyped, untyped  # every rule reads the typed run
    for rule in MIGRATED:
        assert rule(run) == rule(f), rule.__name__
    logits = rules.logits_peak(run)
    assert logits.suggestions[0]["switch"] == "--model.loss_impl chunked"
    # the batch split is the one list's (config/memory_switches.py), offered only where it stays valid
    assert logits.suggestions[1]["switch"] == "--train.batch_size 4 --train.grad_accum_steps 2"
    odd = rules.logits_peak(_gpu_facts(config={"train.batch_size": 3, "model.loss_impl": "full"}))
    assert odd.suggestions[1]["switch"] is None
    data = rules.data_bound(run)
    assert data.suggestions[0]["switch"] == f"--data.num_workers {rules.loading_plan(run)['workers']}"
    keys = [x["key"] for x in rank(f)]  # rank types the facts once and hands the run to these rules
    assert "data_bound" in keys and "logits_peak" in keys


def test_the_windows_and_the_confidence_are_typed():
    """The split's windows (``Run.timing.windows``) and each finding's rating are frozen dataclasses read by
    attribute: a misspelt one is an AttributeError, a windows fact of the wrong type a DoctorError naming it."""
    from tokenmill.profiling import confidence
    from tokenmill.profiling.facts import Windows

    w = confidence.window_set([100.0, 102.0, 400.0, 98.0], {"data": [40.0, 41.0, 40.0, 39.0], "h2d": [1.0]},
                              "log window")
    assert isinstance(w, Windows) and (w.used, w.left_out, w.total) == ((1, 2, 4), (3,), 4)
    assert w.shares["data"] == pytest.approx((0.4, 41 / 102, 39 / 98)) and "h2d" not in w.shares  # no figure each
    assert confidence.describe(w) == ("log windows 1-2, 4 of 4 (log window 3 left out: >= 3x the median step, "
                                      "machine busy)")
    with pytest.raises(AttributeError):
        w.usde  # noqa: B018
    f = {"config": {}, "step_ms": 100.0, "data_ms": 40.0, "data_share": 0.4, "windows": w}
    run = Run.of(f)
    assert run.timing.windows is w
    c = rank(run)[0]["confidence"]
    assert isinstance(c, confidence.Confidence) and c.level == "high" and c.windows == 3 and c.phase == "data"
    assert c.spread == (min(w.shares["data"]), max(w.shares["data"])) and not c.noisy
    with pytest.raises(AttributeError):
        c.levle  # noqa: B018
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.level = "low"  # type: ignore[misc]
    with pytest.raises(DoctorError, match="'windows' is a dict, not Windows"):
        Run.of({**f, "windows": {"shares": {"data": [0.4, 0.4]}}})  # the old untyped form
