"""The doctor's typed run (``profiling/facts.py``): the run's config as a ``Config`` (its values over the config's
own defaults and derived sizes), the measured facts as frozen dataclasses checked once, and rules written for it
giving the same findings whether handed the typed run or the flat facts."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

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
    assert data.suggestions[0]["switch"] == f"--data.num_workers {rules.loading_plan(run).workers}"
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


# ----------------------------------------------------------------------------------------------
# every fact a rule reads is typed: no rule reads the flat dict, and each fact is checked where it is typed

RULE_FILES = sorted((Path(rules.__file__).parent).glob("*rules*.py"))


def test_no_rule_reads_the_flat_facts():
    """Every rule module reads the typed run only: no attribute named ``facts`` on anything (``run.facts``), so a
    misspelt fact is an AttributeError where it is read, never a silent None from ``dict.get``."""
    assert {p.name for p in RULE_FILES} >= {"rules.py", "data_rules.py", "memory_rules.py", "model_rules.py",
                                            "fp8_rules.py", "optim_rules.py", "technique_rules.py", "sft_rules.py",
                                            "docmask_rules.py", "moe_rules.py"}
    reads = [f"{p.name}:{node.lineno}" for p in RULE_FILES for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Attribute) and node.attr == "facts"]
    assert not reads, reads
    planted = ast.parse("def rule(run):\n    return run.facts.get('world_size')\n")  # what the walk catches
    assert any(isinstance(n, ast.Attribute) and n.attr == "facts" for n in ast.walk(planted))


SOURCE = {"call": "cudaStreamSynchronize", "op": "aten::item", "parent": "aten::copy_", "region": "h2d",
          "python": "train.py(12): step", "per_step": 2.0, "ms_per_step": 0.5}
NEW_FACTS = {"config": {"model.norm": "manual", "model.document_attention": "explicit"}, "world_size": 4,
             "sync_sources": [SOURCE], "layer_forms": {"model.norm": {"total": 500, "matmul": 50, "extra": 150}},
             "moe_load_max": 2, "moe_load_layer": 1, "moe_a2a_share": 0.3,
             "learned_frac": 0.4, "padding_frac": 0.25, "threads": {"intra_op": 8, "cpu_count": 2}}


def test_the_newly_typed_facts_are_read_by_attribute():
    from tokenmill.profiling.facts import FormOps, Moe, Sft, SyncSource

    run = Run.of(NEW_FACTS)
    assert run.timing.sync_sources == (SyncSource(**SOURCE),) and run.timing.sync_sources[0].per_step == 2.0
    assert run.layer_forms == {"model.norm": FormOps(total=500, matmul=50, extra=150)}
    assert run.moe == Moe(load_max=2.0, load_layer=1, a2a_share=0.3)
    assert run.sft == Sft(padding_frac=0.25, learned_frac=0.4) and run.world_size == 4
    assert run.recorded == {"model.norm", "model.document_attention"} and run.host.intra_op_known
    bare = Run.of({"config": {}})  # absent: empty, None, one process, intra_op taken as 1 but not known
    assert (bare.timing.sync_sources, bare.layer_forms, bare.moe, bare.sft) == ((), {}, Moe(), Sft())
    assert (bare.world_size, bare.recorded, bare.host.intra_op, bare.host.intra_op_known) == (1, frozenset(), 1, False)
    for obj, misspelt in ((run.timing.sync_sources[0], "regoin"), (run.moe, "load_maxx"), (run.sft, "learned"),
                          (run.layer_forms["model.norm"], "extras"), (run, "worldsize"),
                          (rules.loading_plan(_gpu_facts()), "worker")):
        with pytest.raises(AttributeError):
            getattr(obj, misspelt)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.moe.load_max = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("key, bad, says", [
    ("sync_sources", [1], "'sync_sources' is [1], not a list of objects"),
    ("sync_sources", "h2d", "'sync_sources' is 'h2d', not a list of objects"),
    ("sync_sources", [{**SOURCE, "region": 3}], "'sync_sources[0].region' is 3, not text"),
    ("sync_sources", [{**SOURCE, "per_step": "2"}], "'sync_sources[0].per_step' is '2', not a finite number"),
    ("layer_forms", [], "'layer_forms' is [], not an object"),
    ("layer_forms", {"model.norm": 150}, "'layer_forms.model.norm' is 150, not an object"),
    ("layer_forms", {"model.norm": {"total": 5, "matmul": 1, "extra": "2"}},
     "'layer_forms.model.norm.extra' is '2', not an integer"),
    ("layer_forms", {"model.norm": {"total": 5}}, "'layer_forms.model.norm' is {'total': 5}, without its total"),
    ("moe_load_max", "2.5", "'moe_load_max' is '2.5', not a finite number"),
    ("moe_load_layer", 1.5, "'moe_load_layer' is 1.5, not an integer"),
    ("world_size", True, "'world_size' is True, not an integer"),
    ("moe_a2a_share", [0.3], "'moe_a2a_share' is [0.3], not a finite number"),
    ("world_size", 2.0, "'world_size' is 2.0, not an integer"),
    ("learned_frac", "0.4", "'learned_frac' is '0.4', not a finite number"),
    ("padding_frac", float("inf"), "'padding_frac' is inf, not a finite number"),
    ("config", ["model.norm"], "'config' is ['model.norm'], not an object"),
    ("threads", [8], "'threads' is [8], not an object"),
    ("threads", {"intra_op": "8"}, "'threads.intra_op' is '8', not an integer"),
])
def test_a_damaged_fact_is_a_doctor_error_naming_it(key, bad, says):
    Run.of(NEW_FACTS)  # the undamaged facts type
    with pytest.raises(DoctorError, match=re.escape(says)):
        Run.of({**NEW_FACTS, key: bad})


def test_the_run_files_processes_reach_the_typed_run_and_a_damaged_one_is_one_line(tmp_path, capsys):
    """summary.json's ``world_size`` is ``run.world_size`` (the estimates of technique_rules and docmask_rules ask
    for that many processes); a damaged one, or profile.json sync sources that are not objects, end
    ``tokenmill doctor`` with one line naming the file and the field, exit 1, no traceback."""
    import json

    from conftest import tiny_cfg
    from tokenmill.cli import main
    from tokenmill.profiling.doctor import gather_facts, load_run

    rows = [{"step": s, "loss": 4.0, "tokens_per_sec": 1000.0, "data_ms": 1.0, "h2d_ms": 0.1, "forward_ms": 40.0,
             "backward_ms": 50.0, "optimizer_ms": 8.0, "step_ms": 100.1, "other_ms": 1.0} for s in (2, 4, 6, 8)]
    summary = {"steps": 8, "device": "cpu", "world_size": 2, "tokens_per_step": 128}

    def run_dir(name: str, summary: dict, profile: dict | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        C.save(tiny_cfg(), d / "config.toml")
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (d / "summary.json").write_text(json.dumps(summary))
        if profile is not None:
            (d / "profile.json").write_text(json.dumps(profile))
        return d

    assert Run.of(gather_facts(load_run(run_dir("run", summary)))).world_size == 2
    for name, d, says in (
            ("summary.json", run_dir("summary", {**summary, "world_size": "2"}), "'world_size' must be an integer"),
            ("profile.json", run_dir("profile", summary, {"version": 1, "device": "cpu", "syncs": {"sources": [1]}}),
             "'syncs.sources[0]' must be an object, got 1")):
        capsys.readouterr()
        assert main(["doctor", str(d)]) == 1
        out = capsys.readouterr()
        assert not out.out and "Traceback" not in out.err, out
        assert out.err.count("\n") == 1 and out.err.startswith("tokenmill: error: "), out.err
        assert f"{d / name}'" in out.err and says in out.err, out.err
