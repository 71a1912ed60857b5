"""tokenmill bench: ladder files, smoke runs through the real CLI, failing rungs, sizing searches."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from tokenmill import config as C
from tokenmill.bench import report
from tokenmill.bench.cli import parse_sets, sizing_config
from tokenmill.bench.configs import plan_steps, rung_config
from tokenmill.bench.env import git_facts
from tokenmill.bench.ladder import _record, gpu_warning, run_ladder, skip_reason
from tokenmill.bench.load import load_ladder
from tokenmill.bench.runner import failure_reason
from tokenmill.bench.schema import LadderError, Measure, shipped_ladders
from tokenmill.bench.sizing import (
    Probe,
    SizingError,
    count_params,
    model_shapes,
    search_max_batch,
    search_max_model,
)
from tokenmill.cli import build_parser, main

CPU_ONLY = not torch.cuda.is_available()
CPU_ENV = {"cuda_available": False, "gpu_count": 0, "gpu_names": [], "torch": torch.__version__, "cuda": None}
GPU_ENV = {"cuda_available": True, "gpu_count": 1, "gpu_names": ["NVIDIA H100 80GB HBM3"], "torch": "2.x", "cuda": "12.x"}
SHIPPED = ["best", "book-memory", "book-perf", "document-mask", "llama", "memory", "moe", "optimizers", "rasbt",
           "scale-out", "sft"]


# ----------------------------------------------------------------------------------------------
# Ladder files


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_ladder_parses_and_every_rung_resolves(name):
    assert shipped_ladders() == SHIPPED  # a new ladder is added to this test
    ladder = load_ladder(name)  # parsing resolves every cumulative config, normal and --smoke
    assert ladder.gpu  # every shipped ladder is written for a GPU: a CPU run warns
    for i, rung in enumerate(ladder.rungs):
        assert rung.explain and not rung.missing_fields()
        for smoke in (False, True):
            cfg = rung_config(ladder, i, smoke=smoke).config
            assert C.validate(cfg) is cfg
            for key, value in rung.set.items() if not smoke else ():  # the rung's own switch is in its config
                section, field = key.split(".")
                assert getattr(getattr(cfg, section), field) == value
            assert cfg.log.progress == "plain" and cfg.checkpoint.save_final is False


def test_no_shipped_rung_carries_a_switch_that_does_nothing():
    """A rung that turns off what a setting acts under restates the setting (no inert-switch warning in a ladder)."""
    from tokenmill.config.inert import inert_warnings

    found = []
    for name in shipped_ladders():
        ladder = load_ladder(name)
        base = C.resolve(ladder.base_preset, overrides={}, overrides_from_string=False)
        for i, rung in enumerate(ladder.rungs):
            found += [f"{name}/{rung.name}: {w}" for w in inert_warnings(rung_config(ladder, i).config, base)]
    assert not found, "\n".join(found)


def test_rasbt_ladder_is_faithful():
    ladder = load_ladder("rasbt")
    assert [r.name for r in ladder.rungs] == [
        "baseline", "mask-on-the-fly", "tf32", "fused-adamw", "pin-memory", "bf16", "native-norm-gelu",
        "flash-attention", "compile", "vocab-pad-64", "batch-32", "ddp-4gpu"]
    base = rung_config(ladder, 0).config
    m, o = base.model, base.optim
    assert (m.tie_embeddings, m.qkv_bias, m.fused_qkv, m.attention, m.causal_mask, m.norm, m.gelu) == (
        False, False, False, "manual", "buffer", "manual", "manual")
    assert (m.dropout, m.block_size, base.train.batch_size, base.train.precision, base.data.num_workers) == (
        0.1, 1024, 8, "fp32", 4)
    assert (o.lr, o.weight_decay, o.decay_groups, o.schedule, o.grad_clip) == (5e-4, 0.1, False, "constant", 0.0)
    assert 162e6 < count_params(base) < 164e6  # the README's 163M (untied head)
    last = rung_config(ladder, 10).config  # batch-32: the last single-GPU rung
    assert (last.train.precision, last.train.tf32, last.optim.impl, last.data.pin_memory) == ("bf16", True, "fused", True)
    assert (last.model.attention, last.compile.enabled, last.model.vocab_pad_multiple, last.train.batch_size) == (
        "sdpa", True, 64, 32)
    assert all(r.reference.get("tokens_per_sec") for r in ladder.rungs)
    # the seed's forms: pure bf16 without fp32 islands from rung 5, the model compiled with the loss
    # outside, the loss over the padded vocabulary; its 4-GPU DDP row
    assert rung_config(ladder, 4).config.model.fp32_islands and not rung_config(ladder, 5).config.model.fp32_islands
    assert rung_config(ladder, 8).config.compile.loss_outside
    assert rung_config(ladder, 9).config.model.loss_over_padded_vocab
    ddp = ladder.rungs[-1]
    assert (ddp.name, ddp.nproc, ladder.requirement(ddp)) == ("ddp-4gpu", 4, "multi-gpu")


def test_book_ladders_shapes():
    mem = load_ladder("book-memory")
    assert 700e6 < count_params(rung_config(mem, 0).config) < 720e6  # the book's ~709M
    assert mem.rungs[-1].nproc == 2 and mem.requirement(mem.rungs[-1]) == "multi-gpu"
    # minGPT frees gradients after the forward; the book's FSDP reduce-scatters every micro-batch
    assert rung_config(mem, 0).config.optim.zero_grad == "after_forward"
    assert rung_config(mem, len(mem.rungs) - 1).config.parallel.sync_every_microbatch
    perf = load_ladder("book-perf")
    plan = rung_config(perf, 0).plan
    assert plan.covers_samples and plan.timed_samples >= 10240
    assert perf.requirement(perf.rungs[-1]) == "multi-gpu"


def _cpu_smoke_plan(ladder):
    """(rung name, skip reason) in a --smoke run on a CPU, carrying as the runner does."""
    carried, out = [], []
    for i, rung in enumerate(ladder.rungs):
        why = skip_reason(ladder, rung, rung_config(ladder, i, carried, smoke=True).config, CPU_ENV, True)
        out.append((rung.name, why))
        if why is None:
            carried.append(i)
    return out


def test_memory_ladder_one_rung_per_switch():
    ladder = load_ladder("memory")
    assert (ladder.headline, ladder.base_preset) == ("peak_alloc_mb", "gpt2-medium")
    assert [r.name for r in ladder.rungs] == [
        "baseline", "bf16", "chunked-loss", "activation-checkpointing", "offload-activations",
        "allocator-split-gc", "expandable-segments", "optimizer-in-backward", "adamw-8bit", "optimizer-offload",
        "offload-gradients", "lora", "lora-llama3.1-8b", "qlora-llama3.1-8b"]
    base = rung_config(ladder, 0).config
    assert 350e6 < count_params(base) < 360e6 and base.model.block_size == 1024
    last = rung_config(ladder, len(ladder.rungs) - 3).config
    assert (last.train.precision, last.model.loss_impl, last.memory.activation_checkpointing,
            last.memory.expandable_segments) == ("bf16", "chunked", 1, True)
    switches = ("optimizer_in_backward", "optimizer_8bit", "optimizer_offload")
    for name, on in zip(("optimizer-in-backward", "adamw-8bit", "optimizer-offload"), switches):
        i = [r.name for r in ladder.rungs].index(name)
        mem = rung_config(ladder, i).config.memory
        assert [getattr(mem, k) for k in switches] == [k == on for k in switches]  # exclusive: one at a time
    grads = rung_config(ladder, 10).config.memory
    assert grads.optimizer_offload and grads.offload_gradients  # the last rung adds the gradients
    inb = rung_config(ladder, 7).config
    assert (inb.optim.grad_clip, inb.train.grad_accum_steps) == (0.0, 1)
    eight = ladder.rungs[8]
    assert eight.packages == ["torchao"] and ladder.requirement(eight) == "cuda"
    why = skip_reason(ladder, eight, rung_config(ladder, 8).config, GPU_ENV, False)
    assert (why is None) == (not eight.missing_packages())
    if eight.missing_packages():
        assert "torchao" in why and "pip install torchao" in why
    assert [n for n, why in _cpu_smoke_plan(ladder) if why is None] == [
        "baseline", "bf16", "chunked-loss", "activation-checkpointing", "optimizer-in-backward", "lora",
        "lora-llama3.1-8b", "qlora-llama3.1-8b"]


@pytest.mark.slow
def test_memory_ladder_lora_rungs_fine_tune_the_largest_preset_a_24gb_gpu_holds():
    """LoRA instead of the optimizer switches (plain AdamW over the adapters), then Llama 3.1 8B, the largest
    preset, which fits a 24 GB GPU (rtx-4090) with LoRA by estimate, and does not as a full fine-tune."""
    from tokenmill.estimate import estimate

    ladder = load_ladder("memory")
    names = [r.name for r in ladder.rungs]
    lora = rung_config(ladder, names.index("lora")).config
    assert lora.lora.rank == 16 and not any(getattr(lora.memory, k) for k in (
        "optimizer_in_backward", "optimizer_8bit", "optimizer_offload", "offload_gradients"))
    big = rung_config(ladder, names.index("lora-llama3.1-8b")).config
    preset = C.resolve("llama3.1-8b").model
    shape = [k for k in C.shape_fields() if k != "vocab_size"]
    assert {k: getattr(big.model, k) for k in shape} == {k: getattr(preset, k) for k in shape}
    assert big.model.vocab_size == preset.vocab_size and count_params(big) == count_params(C.resolve("llama3.1-8b"))
    dense = [p for p in C.preset_names() if not C.resolve(p).model.moe_experts]  # MoE presets: their own questions
    assert max(count_params(C.resolve(p)) for p in dense) == count_params(big)  # the largest dense preset
    assert estimate(big, "rtx-4090").fits
    full = C.from_dict(big.to_dict())
    full.lora.rank = 0
    assert not estimate(full, "rtx-4090").fits


def test_best_ladder_smoke_runs_the_cpu_rungs():
    ladder = load_ladder("best")
    assert ladder.requires is None  # CUDA is required rung by rung
    plan = dict(_cpu_smoke_plan(ladder))
    assert [n for n, why in plan.items() if why is None] == [
        "baseline", "vocab-pad-64", "batch-32", "batch-64", "chunked-loss", "batch-128", "checkpoint-blocks",
        "selective-checkpointing"]
    assert all("CUDA" in plan[n] for n in ("cudnn-attention", "compile", "compile-max-autotune"))
    names = [r.name for r in ladder.rungs]
    assert names.index("batch-128") == names.index("chunked-loss") + 1
    assert rung_config(ladder, names.index("batch-128")).config.train.batch_size == 128


LLAMA_RUNGS = ["baseline", "tf32", "fused-adamw", "pin-memory", "bf16-autocast", "native-rmsnorm", "sdpa",
               "fused-qkv", "compile", "batch-4", "chunked-loss", "batch-8", "checkpoint-blocks", "selective-checkpointing"]


def test_llama_ladder_from_naive_to_fastest():
    ladder = load_ladder("llama")
    assert ladder.base_preset == "llama3.2-1b" and [r.name for r in ladder.rungs] == LLAMA_RUNGS
    base = rung_config(ladder, 0).config
    m = base.model
    assert (m.pos_emb, m.norm_type, m.mlp, m.n_head, m.kv_heads, m.block_size) == ("rope", "rmsnorm", "swiglu", 32, 8, 2048)
    # the naive forms: hand-written RMSNorm, manual attention with a mask buffer, three q/k/v projections
    assert (m.norm, m.attention, m.causal_mask, m.fused_qkv, m.loss_impl) == ("manual", "manual", "buffer", False, "full")
    t = base.train
    assert (t.precision, t.tf32, t.batch_size, base.optim.impl, base.compile.enabled, base.data.pin_memory) == (
        "fp32", False, 2, "foreach", False, False)
    assert 1.23e9 < count_params(base) < 1.24e9  # Llama 3.2 1B, tied head
    # no vocabulary-padding rung: 128,256 ids are a multiple of 64 already
    assert m.vocab_size % 64 == 0 and not any("model.vocab_pad_multiple" in r.set for r in ladder.rungs)
    last = rung_config(ladder, LLAMA_RUNGS.index("batch-8")).config
    assert (last.model.norm, last.model.attention, last.model.fused_qkv, last.model.loss_impl) == (
        "native", "sdpa", True, "chunked")
    assert (last.train.precision, last.train.tf32, last.optim.impl, last.compile.enabled, last.train.batch_size) == (
        "bf16-autocast", True, "fused", True, 8)
    assert (last.data.pin_memory, last.data.non_blocking) == (True, True)
    # --smoke keeps the family's forms on tiny shapes: grouped-query attention, SwiGLU's ratio, RoPE
    small = rung_config(ladder, 0, smoke=True).config.model
    assert (small.n_head, small.kv_heads, small.n_embd, small.mlp_width, small.pos_emb) == (2, 1, 64, 256, "rope")
    plan = dict(_cpu_smoke_plan(ladder))
    assert [n for n, why in plan.items() if why is None] == [
        "baseline", "fused-adamw", "bf16-autocast", "native-rmsnorm", "sdpa", "fused-qkv", "batch-4", "chunked-loss",
        "batch-8", "checkpoint-blocks", "selective-checkpointing"]
    assert all("CUDA" in plan[n] for n in ("tf32", "pin-memory", "compile"))


def test_docs_list_the_llama_rungs_as_the_ladder_has_them():
    """docs/bench.md's rung table of the llama ladder is the ladder's own: names, switches, needs."""
    def fmt(v):
        return str(v).lower() if isinstance(v, bool) else (f'"{v}"' if isinstance(v, str) else str(v))

    ladder = load_ladder("llama")
    rows = ["| # | rung | switch (kept by every later rung) | needs |", "|---|---|---|---|"]
    for i, r in enumerate(ladder.rungs):
        sw = ", ".join(f"`{k} = {fmt(v)}`" for k, v in r.set.items()) or "(the base)"
        rows.append(f"| {i} | `{r.name}` | {sw} | {ladder.requirement(r) or ''} |")
    text = (Path(__file__).resolve().parent.parent / "docs" / "bench.md").read_text()
    block = text.split("<!-- llama-rungs:start -->\n")[1].split("\n<!-- llama-rungs:end -->")[0]
    assert block == "\n".join(rows)


@pytest.mark.parametrize("preset", C.preset_names())
def test_smoke_shapes_keep_every_presets_family(preset):
    """--smoke shrinks any shipped preset to 2 heads of width 64 and keeps its forms: grouped k/v heads
    stay grouped, a declared head width and MLP width stay declared, and the config is valid."""
    from tokenmill.bench.configs import smoke_overrides

    def resolved():
        return C.resolve(preset, overrides={"data.source": "synthetic", "model.vocab_size": 1000},
                         overrides_from_string=False)

    cfg = resolved()
    small = C.apply_overrides(resolved(), smoke_overrides(cfg))
    assert C.validate(small) is small
    m, s = cfg.model, small.model
    assert (s.n_head, s.n_embd, s.vocab_size) == (2, 64, 500)
    assert (s.kv_heads < s.n_head) == (m.kv_heads < m.n_head)
    assert (s.mlp, s.pos_emb, s.norm_type, s.qk_norm) == (m.mlp, m.pos_emb, m.norm_type, m.qk_norm)
    assert (s.head_dim is None) == (m.head_dim is None) and (s.intermediate_size is None) == (m.intermediate_size is None)
    if m.intermediate_size:
        assert s.mlp_width / s.n_embd == pytest.approx(m.mlp_width / m.n_embd, rel=0.05)


@pytest.mark.slow
def test_llama_ladder_estimate_fits_one_80gb_gpu_and_each_memory_rung_pays(tmp_path, capsys):
    """The ladder's design, by `tokenmill estimate`: every rung fits one H100 80 GB (the naive one at batch 2),
    SDPA and the chunked loss lower the peak, and the batch the chunked loss makes room for still fits."""
    out = tmp_path / "est"
    assert main(["bench", "ladder", "llama", "--estimate", "--gpu", "h100-sxm", "--out", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads((out / "ladder.json").read_text())
    rungs = {r["name"]: r for r in doc["rungs"]}
    assert list(rungs) == LLAMA_RUNGS and all(r["status"] == "estimated" for r in rungs.values())
    assert all(r["estimate_detail"]["fits"] for r in rungs.values())
    peak = {n: r["estimate"]["peak_alloc_mb"] for n, r in rungs.items()}
    assert peak["sdpa"] < 0.7 * peak["native-rmsnorm"]  # no (B, 32, T, T) score matrices
    assert peak["chunked-loss"] < peak["batch-4"] < peak["batch-8"]
    speed = {n: r["estimate"]["tokens_per_sec"] for n, r in rungs.items()}
    assert speed["batch-8"] > 5 * speed["baseline"]


def _write(tmp_path, text, name="mine.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


USER_LADDER = """
[ladder]
name = "mine"
description = "A user's ladder."
base_preset = "tiny"
[ladder.base]
"data.source" = "synthetic"
"model.vocab_size" = 64
[ladder.measure]
warmup_steps = 1
timed_steps = 4
windows = 2
"""


def test_unknown_override_key_gets_closest_suggestion(tmp_path, capsys):
    path = _write(tmp_path, USER_LADDER + '[[rung]]\nname = "a"\nexplain = "x"\nset = { "train.batchsize" = 4 }\n')
    with pytest.raises(LadderError, match=r"unknown config key 'train.batchsize'.*Did you mean 'train.batch_size'"):
        load_ladder(str(path))
    assert main(["bench", "ladder", str(path), "--out", str(tmp_path / "out")]) == 2
    assert "Did you mean 'train.batch_size'" in capsys.readouterr().err
    bad_table = _write(tmp_path, USER_LADDER.replace("[ladder.measure]", "[ladder.measur]") + '[[rung]]\nname = "a"\n'
                       'explain = "x"\n', "bad.toml")
    with pytest.raises(LadderError, match="Did you mean 'measure'"):
        load_ladder(str(bad_table))
    owned = _write(tmp_path, USER_LADDER + '[[rung]]\nname = "a"\nexplain = "x"\nset = { "train.max_steps" = 4 }\n',
                   "owned.toml")
    with pytest.raises(LadderError, match=r"\[ladder.measure\]"):
        load_ladder(str(owned))
    with pytest.raises(LadderError, match="Did you mean 'rasbt'"):
        load_ladder("rasbtt")


def test_bad_rung_value_names_the_ladder_and_rung(tmp_path):
    path = _write(tmp_path, USER_LADDER + '[[rung]]\nname = "base"\nexplain = "x"\n[[rung]]\nname = "fast"\n'
                  'explain = "x"\nset = { "model.attention" = "flashy" }\n')
    with pytest.raises(LadderError, match=r"^ladder 'mine' \(.*mine\.toml\), rung 1 'fast': "
                                          r"model\.attention: 'flashy' is not one of \['manual', 'sdpa'\]"):
        load_ladder(str(path))


def test_needs_typo_fails_and_a_future_field_is_skipped_with_a_hint(tmp_path):
    typo = _write(tmp_path, USER_LADDER + '[[rung]]\nname = "a"\nexplain = "x"\nneeds = ["train.batchsize"]\n')
    with pytest.raises(LadderError, match=r"rung 0 'a': needs 'train.batchsize' is not a config field\. "
                                          r"Did you mean 'train.batch_size'\?"):
        load_ladder(str(typo))
    future = _write(tmp_path, USER_LADDER + '[[rung]]\nname = "a"\nexplain = "x"\nneeds = ["train.batch_sizes_2"]\n'
                    'set = { "train.batch_sizes_2" = 4 }\n', "future.toml")
    ladder = load_ladder(str(future))  # two edits away: may be a field of a later tokenmill
    doc = run_ladder(ladder, tmp_path / "out", env=CPU_ENV, log=lambda s: None)
    reason = doc["rungs"][0]["reason"]
    assert doc["rungs"][0]["status"] == "skipped"
    assert "train.batch_sizes_2 (not a tokenmill config field yet)" in reason and "Did you mean 'train.batch_size'" in reason


def test_rungs_names_are_checked_against_the_ladder(tmp_path, capsys):
    assert main(["bench", "ladder", "llama", "--smoke", "--rungs", "baseline,sdpaa", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "ladder 'llama' has no rung 'sdpaa'" in err and "sdpa" in err.split("no rung 'sdpaa'")[1]
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_set_rejects_the_step_keys_the_bench_owns(capsys):
    for key in ("train.max_steps", "log.every_steps", "log.timing_warmup_steps"):
        with pytest.raises(C.ConfigError, match="--steps"):
            parse_sets([f"{key}=4"])
    assert parse_sets(["train.seed=3"]) == {"train.seed": "3"}
    assert main(["bench", "ladder", "rasbt", "--set", "train.max_steps=4"]) == 2
    assert "use --steps N" in capsys.readouterr().err


def test_sizing_commands_take_a_positional_config(tmp_path):
    first = _write(tmp_path, "[train]\nbatch_size = 5\n[model]\nn_layer = 3\n", "first.toml")
    second = _write(tmp_path, "[train]\nbatch_size = 6\n", "second.toml")
    for cmd in ("max-batch", "max-model"):
        args = build_parser().parse_args(["bench", cmd, str(first), "--preset", "tiny", "--config", str(second),
                                          "--model.n_head", "2"])
        cfg = sizing_config(args)
        assert (cfg.model.n_layer, cfg.train.batch_size, cfg.model.n_head) == (3, 6, 2)  # --config after it
        args = build_parser().parse_args(["bench", cmd, "--preset", "tiny"])
        assert sizing_config(args).train.batch_size == C.resolve("tiny").train.batch_size


def test_plan_steps_whole_windows():
    cfg = C.resolve("tiny", overrides={"train.batch_size": 32}, overrides_from_string=False)
    p = plan_steps(Measure(warmup_steps=5, timed_steps=40, windows=4), cfg, 1, None)
    assert (p.warmup_steps, p.timed_steps, p.every_steps, p.max_steps) == (10, 40, 10, 50)
    p = plan_steps(Measure(warmup_steps=10, windows=4, cover_samples=True), cfg, 2, 10240)
    assert p.samples_per_step == 64 and p.timed_samples >= 10240 and p.covers_samples
    assert p.max_steps == p.warmup_steps + p.timed_steps and p.timed_steps % p.every_steps == 0


def test_failure_reason_lines():
    assert failure_reason("noise\ntokenmill: error: train.device='cuda' but no GPU\n", 1) == (
        "train.device='cuda' but no GPU")
    tb = "Traceback (most recent call last):\n  File x\nRuntimeError: cuDNN attention cannot run here\n"
    assert failure_reason(tb, 1) == "RuntimeError: cuDNN attention cannot run here"
    assert "exit status 3" in failure_reason("", 3)


# ----------------------------------------------------------------------------------------------
# Running ladders


@pytest.mark.slow
def test_failing_rung_is_reported_and_the_ladder_goes_on(tmp_path):
    rungs = """
[[rung]]
name = "broken-data"
explain = "points at token data that does not exist"
set = { "data.source" = "tokens", "data.path" = "/nonexistent/tokenmill-data" }

[[rung]]
name = "gpu-only"
explain = "declared to need CUDA"
set = { "train.precision" = "bf16" }
requires = "cuda"

[[rung]]
name = "future-field"
explain = "needs a field this tokenmill lacks"
set = { "model.no_such_field" = 1 }
needs = ["model.no_such_field"]

[[rung]]
name = "batch-2"
explain = "still runs, without the failed rung's switch"
set = { "train.batch_size" = 2 }
reference = { tokens_per_sec = 1000 }
"""
    gpu_ladder = USER_LADDER.replace('base_preset = "tiny"', 'base_preset = "tiny"\ngpu = true')
    ladder = load_ladder(str(_write(tmp_path, gpu_ladder + rungs)))
    lines = []
    doc = run_ladder(ladder, tmp_path / "out", env=CPU_ENV, log=lines.append, cli_set={"train.device": "cpu"})
    by = {r["name"]: r for r in doc["rungs"]}
    assert by["broken-data"]["status"] == "failed"
    assert "/nonexistent/tokenmill-data" in by["broken-data"]["reason"]
    assert by["gpu-only"]["status"] == "skipped" and "CUDA" in by["gpu-only"]["reason"]
    assert by["future-field"]["status"] == "skipped" and "model.no_such_field" in by["future-field"]["reason"]
    after = by["batch-2"]
    assert after["status"] == "measured", after["reason"]
    assert after["dropped"] == ["broken-data", "gpu-only", "future-field"]
    assert after["config"]["data"]["source"] == "synthetic" and after["config"]["train"]["batch_size"] == 2
    assert after["metrics"]["tokens_per_sec"] > 0 and doc["baseline_rung"] == "batch-2"
    saved = json.loads((tmp_path / "out" / "ladder.json").read_text())
    assert [r["status"] for r in saved["rungs"]] == ["failed", "skipped", "skipped", "measured"]
    md = (tmp_path / "out" / "ladder.md").read_text()
    assert "failed:" in md and "/nonexistent/tokenmill-data" in md
    assert any("failed" in ln for ln in lines)
    # written for a GPU, run on a CPU: a warning, and no comparison with the seed's figures
    assert len(doc["warnings"]) == 1 and "written for a CUDA GPU" in doc["warnings"][0]
    assert any("warning" in ln and "written for a CUDA GPU" in ln for ln in lines)
    assert after["reference_check"] is None and "agrees" not in md and "not compared" in md
    assert doc["tokenmill_version"]


def test_gpu_warning_only_for_real_runs_off_the_gpu():
    ladder = load_ladder("rasbt")
    assert "no CUDA GPU is visible" in gpu_warning(ladder, CPU_ENV, False, None)
    assert "train.device=cpu" in gpu_warning(ladder, GPU_ENV, False, {"train.device": "cpu"})
    assert gpu_warning(ladder, CPU_ENV, True, None) is None  # --smoke
    assert gpu_warning(ladder, GPU_ENV, False, None) is None


def _fake_doc(name, env, smoke, summary):
    """A ladder document as a run would leave it, with ``summary(i)`` as rung i's trainer summary
    (None: skipped)."""
    ladder = load_ladder(name)
    doc = report.new_document(ladder, env, smoke, None)
    carried = []
    for i, rung in enumerate(ladder.rungs):
        rec = _record(ladder, i, rung, carried)
        rc = rung_config(ladder, i, carried, smoke=smoke)
        rec["config"], rec["plan"] = rc.config.to_dict(), rc.plan.to_dict()
        rec["summary"] = summary(i)
        rec["status"], rec["reason"] = ("measured", None) if rec["summary"] else ("skipped", "needs 2 CUDA GPUs")
        if rec["summary"]:
            carried.append(i)
        doc["rungs"].append(rec)
    report.derive(doc)
    return doc


def test_report_loss_flag_mfu_bf16_and_reference_gating(tmp_path):
    def summary(device, gpu=None):
        def make(i):
            if i == 4:
                return None
            return {"tokens_per_sec": 1e5 * (i + 1), "tokens_per_sec_min": 1, "tokens_per_sec_max": 2,
                    "step_time_ms": 100.0, "mfu": 0.1, "peak_alloc_mb": 30000.0 - 5000 * i,
                    "peak_reserved_mb": 32000.0 - 5000 * i, "final_loss": 4.0 if i != 2 else 3.0, "params": 1,
                    "flops_per_token": 4e9, "world_size": 1, "device": device, **({"gpu_name": gpu} if gpu else {})}
        return make

    gpu = _fake_doc("book-memory", GPU_ENV, False, summary("cuda", "NVIDIA H100 80GB HBM3"))
    m = [r["metrics"] for r in gpu["rungs"]]
    assert m[0]["mfu_bf16"] == pytest.approx(4e9 * 1e5 / 989.4e12)
    assert [x and x["loss_flag"] for x in m] == [False, False, True, False, None]
    assert m[2]["loss_change_vs_baseline"] == pytest.approx(-0.25)
    assert gpu["rungs"][1]["reference_check"]["agrees"] is True  # -17% here, -31% in the book
    md = report.markdown(gpu)
    assert "agrees" in md and "3.0000 ⚠ -25% vs base" in md and "MFU bf16 peak" in md
    from tokenmill.bench.plot import write_png

    assert write_png(gpu, tmp_path / "gpu.png") is None  # references drawn, inside the memory axis

    cpu = _fake_doc("book-memory", CPU_ENV, False, summary("cpu"))
    assert all(r["reference_check"] is None for r in cpu["rungs"]) and not report.compares_references(cpu)
    assert cpu["rungs"][0]["metrics"]["mfu_bf16"] is None
    md = report.markdown(cpu)
    assert "agrees" not in md and "not compared: this run was not on a CUDA GPU" in md
    smoke = _fake_doc("book-memory", GPU_ENV, True, summary("cuda", "NVIDIA H100 80GB HBM3"))
    assert not report.compares_references(smoke) and "not compared: a --smoke run" in report.markdown(smoke)


def test_report_shows_the_task_scores_a_rung_measured():
    """A ladder run with --set eval.tasks=...: each rung's last task scores (summary.json tasks/TASK/METRIC) in a
    column per score beside tokens/s; a rung without one reads n/a, a skipped rung nothing."""
    def make(i):
        if i == 3:
            return None
        tasks = {} if i == 2 else {"tasks/arc_easy/acc": 0.25 + 0.01 * i, "tasks/arc_easy/acc_norm": 0.3}
        return {"tokens_per_sec": 1e5, "tokens_per_sec_min": 1, "tokens_per_sec_max": 2, "step_time_ms": 10.0,
                "mfu": 0.1, "peak_alloc_mb": 1.0, "peak_reserved_mb": 2.0, "final_loss": 3.0, "params": 1,
                "flops_per_token": 1e6, "device": "cpu", "tasks/bad": float("nan"), **tasks}

    doc = _fake_doc("optimizers", CPU_ENV, False, make)
    assert doc["rungs"][1]["metrics"]["tasks"] == {"arc_easy/acc": 0.26, "arc_easy/acc_norm": 0.3}
    lines = report.markdown_table(doc).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[-3:] == ["arc_easy/acc", "arc_easy/acc_norm", "status"]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [r[-3] for r in rows] == ["0.2500", "0.2600", "n/a", ""]
    no_tasks = _fake_doc("optimizers", CPU_ENV, False, lambda i: {**make(2), "tasks/arc_easy/acc": None})
    assert "arc_easy" not in report.markdown_table(no_tasks)


def test_device_facts_come_from_this_process_only_where_torch_can_reach_no_gpu(monkeypatch):
    """A torch built without CUDA and ROCm can create no GPU context: its facts are read in the bench process;
    a CUDA or ROCm build reads them in a subprocess (so the bench process holds no GPU memory)."""
    from tokenmill.bench import env as E

    asked = []
    monkeypatch.setattr(E, "device_facts_subprocess", lambda timeout_s: asked.append(timeout_s) or {"torch": "sub"})
    monkeypatch.setattr(E, "driver_version", lambda: {"driver": None})
    monkeypatch.setattr(E, "host_facts", lambda: {"host": "h"})
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    facts = E.probe_environment(timeout_s=7.0)
    assert not asked and facts == {**E.device_facts(), "driver": None, "host": "h"}
    assert facts["torch"] == torch.__version__ and facts["cuda_available"] == torch.cuda.is_available()
    for build in ("cuda", "hip"):
        monkeypatch.setattr(torch.version, build, "12.4")
        assert E.probe_environment(timeout_s=7.0) == {"torch": "sub", "driver": None, "host": "h"}
        monkeypatch.setattr(torch.version, build, None)
    assert asked == [7.0, 7.0]


@pytest.mark.slow
def test_git_commit_only_from_tokenmills_own_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("TOKENMILL_GIT_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git + ["init", "-q", str(tmp_path)], check=True)
    (tmp_path / "other.txt").write_text("another project\n")
    subprocess.run(git + ["add", "other.txt"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "x"], cwd=tmp_path, check=True)
    installed = tmp_path / "venv" / "env.py"  # an installed copy inside another project's repository
    installed.parent.mkdir()
    installed.write_text("# tokenmill\n")
    assert git_facts(installed) == {"git_commit": None, "git_dirty": None}
    subprocess.run(git + ["add", str(installed)], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-q", "-m", "y"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert git_facts(installed) == {"git_commit": head, "git_dirty": False}
    monkeypatch.setenv("TOKENMILL_GIT_COMMIT", "abc123")
    assert git_facts(installed)["git_commit"] == "abc123"


SMOKE_RUNGS = {"rasbt": ["baseline", "batch-32"],
               "book-memory": ["baseline", "fsdp-2gpu"],
               "llama": ["baseline", "batch-8"]}


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
    """rasbt, book-memory and llama --smoke through the CLI (in this process; each rung in its own), each on a
    few of its rungs, 2 timed steps a rung. Every rung's config is resolved by
    test_shipped_ladder_parses_and_every_rung_resolves; here the machinery runs: a measured baseline, a measured
    switch (rasbt's batch-32: a larger batch, its speedup reported), a batch rung --smoke flattens to the batch
    before it (llama's batch-8, whose speedup is not reported; it trains every Llama switch carried to it), a
    multi-GPU rung skipped (book-memory's fsdp-2gpu), and rungs left out by --rungs whose configs are still
    resolved and carried. Each ladder runs once for the three tests below."""
    root = tmp_path_factory.mktemp("bench-smoke")
    results = {}
    from tokenmill.train.device import NOTED_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # the rungs' processes inherit it (as from conftest.cpu_env)
        mp.setenv(NOTED_ENV, "")  # recorded, so that a threads note said here does not outlive the fixture
        mp.delenv(NOTED_ENV)
        mp.setenv("TOKENMILL_CACHE", str(root / "cache"))
        for name, chosen in SMOKE_RUNGS.items():
            p = run_cli("bench", "ladder", name, "--smoke", "--quiet", "--steps", "2", "--out", root / name,
                        "--rungs", ",".join(chosen))
            results[name] = (p.returncode, p.stdout, p.stderr, root / name)
    return results


def _check_smoke(result, name):
    rc, out, err, folder = result
    assert rc == 0, f"{out}\n{err}"
    ladder = load_ladder(name)
    doc = json.loads((folder / "ladder.json").read_text())
    assert doc["smoke"] and doc["ladder"]["name"] == name and doc["torch"]
    assert "git_commit" in doc and doc["date"] and doc["host"]
    assert [r["name"] for r in doc["rungs"]] == [r.name for r in ladder.rungs]
    prev = base = None
    chosen = SMOKE_RUNGS[name]
    for r in doc["rungs"]:
        assert r["status"] in ("measured", "skipped"), (r["name"], r["reason"])
        if r["name"] not in chosen:  # listed, not run; its config still resolved (where its fields exist)
            assert r["status"] == "skipped" and r["reason"].startswith("not selected (--rungs)"), r["name"]
            continue
        if r["status"] == "skipped":
            assert r["reason"] and r["metrics"] is None
            continue
        m = r["metrics"]
        assert m["tokens_per_sec"] > 0 and m["tokens_per_sec_min"] <= m["tokens_per_sec"] <= m["tokens_per_sec_max"]
        assert math.isfinite(m["final_loss"]) and m["step_time_ms"] > 0
        base = base or m
        assert m["speedup_vs_baseline"] == pytest.approx(m["tokens_per_sec"] / base["tokens_per_sec"])
        whole = bool(m.get("flattened")) and len(m["flattened"]) == len(r["set"])  # --smoke undid its switch
        if prev is None or whole:
            assert m["speedup_vs_prev"] is None
        else:
            assert m["speedup_vs_prev"] == pytest.approx(m["tokens_per_sec"] / prev["tokens_per_sec"])
        prev = m
    md = (folder / "ladder.md").read_text()
    assert all(r.name in md for r in ladder.rungs)
    assert (folder / "ladder.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report.markdown_table(doc) in out  # the table is printed at the end
    return {r["name"]: r for r in doc["rungs"]}


@pytest.mark.slow
def test_smoke_rasbt(smoke_runs):
    rungs = _check_smoke(smoke_runs["rasbt"], "rasbt")
    assert rungs["baseline"]["status"] == "measured" and rungs["batch-32"]["status"] == "measured"
    assert rungs["batch-32"]["config"]["train"]["batch_size"] > rungs["baseline"]["config"]["train"]["batch_size"]
    m = rungs["batch-32"]["metrics"]  # a switch --smoke keeps: its speedup over the rung before is reported
    assert m["flattened"] == [] and m["vs_rung"] == "baseline" and m["speedup_vs_prev"] is not None
    assert rungs["baseline"]["config"]["model"]["n_layer"] == 2
    if CPU_ONLY:
        for name in ("tf32", "pin-memory", "bf16"):
            assert rungs[name]["status"] == "skipped" and "CUDA" in rungs[name]["reason"]
        assert rungs["compile"]["status"] == "skipped" and "torch.compile" in rungs["compile"]["reason"]
        assert rungs["native-norm-gelu"]["config"]["train"]["precision"] == "fp32"  # bf16 was not carried


@pytest.mark.slow
def test_smoke_book_memory(smoke_runs):
    rungs = _check_smoke(smoke_runs["book-memory"], "book-memory")
    acc = rungs["grad-accum-2"]["config"]["train"]
    assert (acc["grad_accum_steps"], rungs["adamw-for-loop"]["config"]["optim"]["impl"]) == (2, "for-loop")
    fsdp = rungs["fsdp-2gpu"]
    assert fsdp["status"] == "skipped" and "2 CUDA GPUs" in fsdp["reason"]
    if CPU_ONLY:
        assert rungs["baseline"]["metrics"]["peak_alloc_mb"] is None  # no CUDA memory figures on a CPU


@pytest.mark.slow
def test_smoke_llama_through_the_cli(smoke_runs):
    """The llama ladder --smoke on a CPU: the Llama forms (RMSNorm, SwiGLU, RoPE, grouped-query attention)
    run rung by rung on tiny shapes, the CUDA rungs are skipped with the reason, the rest carried."""
    rungs = _check_smoke(smoke_runs["llama"], "llama")
    base = rungs["baseline"]["config"]["model"]
    assert (base["norm_type"], base["norm"], base["mlp"], base["n_head"], base["n_kv_head"]) == (
        "rmsnorm", "manual", "swiglu", 2, 1)
    last = rungs["batch-8"]
    assert last["status"] == "measured" and last["config"]["model"]["loss_impl"] == "chunked"
    # --smoke shrinks batch 8 to the baseline's batch: flattened, no speedup over the rung before reported
    assert last["metrics"]["flattened"] == ["train.batch_size"] and last["metrics"]["speedup_vs_prev"] is None
    assert "flattened by --smoke" in smoke_runs["llama"][1]
    measured = [r for r in rungs.values() if r["status"] == "measured"]
    assert not any(r["metrics"]["loss_flag"] for r in measured)  # every form keeps the loss near ln(500)
    if CPU_ONLY:
        assert all(rungs[n]["status"] == "skipped" and "CUDA" in rungs[n]["reason"]
                   for n in ("tf32", "pin-memory", "compile"))
        assert rungs["native-rmsnorm"]["config"]["train"]["precision"] == "bf16-autocast"  # carried


# ----------------------------------------------------------------------------------------------
# Sizing


def _probe(fits):
    calls = []

    def probe(value):
        calls.append(value)
        return Probe(value=value, status="fits" if fits(value) else "too-big", step_time_ms=1.0)

    return probe, calls


def test_max_batch_search():
    probe, calls = _probe(lambda b: b <= 23)
    res = search_max_batch(probe, log=lambda s: None)
    assert res["max_batch"] == 23 and not res["hit_limit"]
    assert calls == [1, 2, 4, 8, 16, 32, 24, 20, 22, 23]
    probe, _ = _probe(lambda b: True)
    assert search_max_batch(probe, start=4, limit=16, log=lambda s: None) == {
        **search_max_batch(probe, start=4, limit=16, log=lambda s: None), "max_batch": 16, "hit_limit": True}
    probe, calls = _probe(lambda b: b <= 2)
    assert search_max_batch(probe, start=8, log=lambda s: None)["max_batch"] == 2 and calls == [8, 4, 2, 3]
    probe, _ = _probe(lambda b: False)
    assert search_max_batch(probe, log=lambda s: None)["max_batch"] == 0

    def broken(b):
        return Probe(value=b, status="error", reason="RuntimeError: bad config")

    with pytest.raises(SizingError, match="bad config"):
        search_max_batch(broken, log=lambda s: None)


def test_max_model_search():
    cfg = C.resolve("gpt2-124m", overrides={"data.source": "synthetic"}, overrides_from_string=False)
    shapes = model_shapes(cfg)
    params = [s["params"] for s in shapes]
    assert params == sorted(params) and len(shapes) == 10
    assert 124e6 < params[0] < 125e6 and 19e9 < params[-1] < 21e9
    probe, calls = _probe(lambda s: s["params"] <= 3e9)
    res = search_max_model(shapes, probe, log=lambda s: None)
    assert res["largest"]["name"] == "gpt3-2.7b" and not res["hit_limit"]
    assert len(calls) <= 4
    probe, _ = _probe(lambda s: False)
    assert search_max_model(shapes, probe, log=lambda s: None)["largest"] is None
    assert [s["name"] for s in model_shapes(cfg, max_params=1e9)] == [
        "gpt2-124m", "gpt2-medium-350m", "gpt2-large-774m"]


@pytest.mark.slow
def test_max_batch_real_probes_on_cpu(tmp_path, monkeypatch):
    out = tmp_path / "mb"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the probe's process inherits it (as from conftest.cpu_env)
    # the search in this process (the probe still runs in its own process): one interpreter start less
    p = run_cli("bench", "max-batch", "--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", "64",
                "--train.device", "cpu", "--start", "4", "--max-batch-limit", "4", "--run-dir", out)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((out / "max-batch.json").read_text())
    assert res["max_batch"] == 4 and res["hit_limit"]
    assert res["environment"]["torch"] and res["environment"]["date"] and "git_commit" in res["environment"]
    assert [q["value"] for q in res["probes"]] == [4]  # one real probe; the search is tested above
    assert res["probes"][0]["status"] == "fits" and res["probes"][0]["step_time_ms"] > 0
    assert (out / "probes" / "batch-4" / "rung.toml").exists()
    assert "largest micro-batch that fits: 4" in p.stdout


# ----------------------------------------------------------------------------------------------
# Sizing and ladders with the estimate (tokenmill.estimate)


def test_searches_start_from_the_estimates_guess():
    probe, calls = _probe(lambda b: b <= 23)
    res = search_max_batch(probe, log=lambda s: None, guess=23)
    assert res["max_batch"] == 23 and calls == [23, 25, 24]  # a right guess: three probes instead of ten
    for guess in (5, 40, 1, 1024):  # wrong guesses still find the answer
        probe, calls = _probe(lambda b: b <= 23)
        assert search_max_batch(probe, log=lambda s: None, guess=guess)["max_batch"] == 23
    for guess in (20, 26):  # a guess within 15%: at most five probes
        probe, calls = _probe(lambda b: b <= 23)
        assert search_max_batch(probe, log=lambda s: None, guess=guess)["max_batch"] == 23 and len(calls) <= 5
    probe, _ = _probe(lambda b: False)
    assert search_max_batch(probe, log=lambda s: None, guess=8)["max_batch"] == 0
    probe, _ = _probe(lambda b: True)
    assert search_max_batch(probe, limit=64, log=lambda s: None, guess=8)["hit_limit"]
    cfg = C.resolve("gpt2-124m", overrides={"data.source": "synthetic"}, overrides_from_string=False)
    shapes = model_shapes(cfg)
    probe, calls = _probe(lambda s: s["params"] <= 3e9)
    res = search_max_model(shapes, probe, log=lambda s: None, guess=5)
    assert res["largest"]["name"] == "gpt3-2.7b" and len(calls) == 2
    probe, calls = _probe(lambda s: s["params"] <= 3e9)
    assert search_max_model(shapes, probe, log=lambda s: None, guess=8)["largest"]["name"] == "gpt3-2.7b"


@pytest.mark.slow
def test_max_batch_estimate_only_runs_nothing(tmp_path, capsys):
    out = tmp_path / "mb"
    assert main(["bench", "max-batch", "--preset", "gpt2-124m", "--data.source", "synthetic", "--estimate-only",
                 "--gpu", "a100-40gb", "--start", "8", "--max-batch-limit", "64", "--run-dir", str(out)]) == 0
    text = capsys.readouterr().out
    res = json.loads((out / "max-batch.json").read_text())
    assert res["estimate_only"] and res["gpu"] == "NVIDIA A100-SXM4-40GB" and not (out / "probes").exists()
    b = res["max_batch"]
    assert 8 <= b < 64 and f"largest micro-batch that fits: {b} (estimated, nothing run)" in text
    fits = {p["value"]: p["status"] for p in res["probes"]}
    assert fits[b] == "fits" and fits.get(b + 1, "too-big") == "too-big"
    assert all("estimate:" in p["reason"] for p in res["probes"])


@pytest.mark.slow
def test_ladder_estimate_mode_writes_estimates_beside_the_references(tmp_path, capsys):
    path = _write(tmp_path, USER_LADDER + """
[[rung]]
name = "base"
explain = "x"
reference = { peak_alloc_mb = 20.0, tokens_per_sec = 1000000 }
[[rung]]
name = "bigger"
explain = "x"
set = { "train.batch_size" = 64 }
reference = { peak_alloc_mb = 40.0 }
[[rung]]
name = "future"
explain = "x"
needs = ["model.future_switch_of_tokenmill"]
""")
    out = tmp_path / "est"
    assert main(["bench", "ladder", str(path), "--estimate", "--gpu", "l4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "ladder.json").read_text())
    assert doc["mode"] == "estimated" and doc["estimate"]["gpu"] == "NVIDIA L4"
    base, bigger, future = doc["rungs"]
    assert set(base["estimate"]) == {"peak_alloc_mb", "peak_reserved_mb", "step_ms", "tokens_per_sec"}
    assert bigger["estimate"]["peak_alloc_mb"] > base["estimate"]["peak_alloc_mb"]
    assert base["estimate_error"]["peak_alloc_mb"] == pytest.approx(base["estimate"]["peak_alloc_mb"] / 20.0 - 1)
    assert future["status"] == "skipped" and "model.future_switch_of_tokenmill" in future["reason"]
    assert "est peak alloc GB | ref alloc GB | err" in printed and "mean absolute error" in printed
    md = (out / "ladder.md").read_text()
    assert "estimated for NVIDIA L4" in md and "nothing was run" in md
    assert main(["bench", "ladder", str(path), "--estimate", "--smoke", "--out", str(out)]) == 2
    assert main(["bench", "ladder", str(path), "--gpu", "l4", "--out", str(out)]) == 2
