"""Fine-tuning estimates start from the recipe fine-tuners run (bf16 weights, activation checkpointing, the chunked
loss) and say so; the memory advice searches the switches (those with the same numerics, then pure bf16, 8-bit
AdamW, an NF4 base) before it suggests more GPUs. Every figure is compared with the estimator run on the config
with those switches set by hand, never with a number written here."""

from __future__ import annotations

import re

import pytest

from tokenmill import config as C
from tokenmill.cli import main
from tokenmill.config.memory_switches import FINETUNE_RECIPE
from tokenmill.estimate import estimate, memory_advice
from tokenmill.estimate import finetune as ft

SHAPE = {"model.block_size": 2048, "train.batch_size": 1}


def _row(out: str, gpu: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith(f"  {gpu} "))


def _gb(cfg: C.Config, gpu: str = "l4") -> float:
    return round(estimate(cfg, gpu).peak_reserved_mb / 1024, 1)


def test_finetune_estimate_of_8b_starts_from_the_usual_recipe(monkeypatch, capsys):
    """``estimate --finetune --preset llama3.1-8b``: LoRA and QLoRA as the estimator puts them with bf16
    weights, checkpointing and the chunked loss set explicitly (the report says it set them); a field the
    user set is kept and named."""
    monkeypatch.setattr(ft, "GPUS", {"l4": ft.GPUS["l4"]})  # one GPU: two estimates, not fourteen
    argv = ["estimate", "--preset", "llama3.1-8b", *(f"--{k}={v}" for k, v in SHAPE.items()), "--finetune"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    row = _row(out, "l4")
    lora = C.resolve("llama3.1-8b", overrides={**SHAPE, **FINETUNE_RECIPE, "lora.rank": 16},
                     overrides_from_string=False)
    assert float(row[6]) == _gb(lora)  # LoRA, the base in bf16 as the recipe says
    qlora = C.resolve("llama3.1-8b", overrides={**SHAPE, **FINETUNE_RECIPE, "lora.rank": 16,
                                                "lora.quantize_base": "nf4"}, overrides_from_string=False)
    assert float(row[9]) == _gb(qlora)  # QLoRA: the same adapters over the NF4 base
    assert float(row[9]) < float(row[6]) < 24  # a 24 GB GPU takes either, as fine-tuners expect
    assert ("set here: --memory.activation_checkpointing 1 --model.loss_impl chunked --train.precision bf16"
            in out)
    assert "precision bf16\n" in out.splitlines()[0] + "\n"

    # the user's own precision is kept and named; the rest of the recipe still applies
    mine = C.resolve("llama3.1-8b", overrides={**SHAPE, "train.precision": "bf16-autocast"},
                     overrides_from_string=False)
    kept, taken = ft.with_recipe(mine, {"train.precision"})
    assert kept.train.precision == "bf16-autocast" and taken == ["--memory.activation_checkpointing 1",
                                                                 "--model.loss_impl chunked"]
    assert "kept as you set it: train.precision bf16-autocast" in ft._recipe_line(kept, taken)


def test_recipe_skips_the_fields_the_user_chose():
    cfg = C.resolve("tiny-llama", overrides={"memory.activation_checkpointing": 0}, overrides_from_string=False)
    out, taken = ft.with_recipe(cfg, {"memory.activation_checkpointing", "train.batch_size"})
    assert out.memory.activation_checkpointing == 0 and out.train.precision == "bf16"
    assert out.model.loss_impl == "chunked" and taken == ["--model.loss_impl chunked", "--train.precision bf16"]
    assert out.train.batch_size == cfg.train.batch_size  # the user's micro-batch kept
    same, none = ft.with_recipe(out, ())  # already the recipe but for the chosen fields: those are set now
    assert same.memory.activation_checkpointing == 1 and none[0] == "--memory.activation_checkpointing 1"
    b = cfg.train.batch_size  # the preset's micro-batch becomes one sequence, accumulated to the same global batch
    assert none[1:] == [f"--train.batch_size 1 --train.grad_accum_steps {b}"] and b > 1
    assert (same.train.batch_size, same.train.grad_accum_steps) == (1, b)


def test_the_bare_finetune_command_answers_with_a_fine_tuning_micro_batch(monkeypatch, capsys):
    """``estimate --finetune --preset llama3.1-8b`` with nothing else: the preset's pre-training micro-batch
    (8 x 8,192 tokens) is not what a fine-tune on one GPU runs; the recipe's one sequence accumulated to the same
    global batch is, and the report says so. LoRA then fits a 24 GB GPU; a micro-batch the user sets is kept."""
    monkeypatch.setattr(ft, "GPUS", {"rtx-4090": ft.GPUS["rtx-4090"]})
    assert main(["estimate", "--preset", "llama3.1-8b", "--finetune"]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 1 x 8192 tokens" in out.splitlines()[0]
    assert "--train.batch_size 1 --train.grad_accum_steps 8" in out and "accumulating to the same global batch" in out
    lora = C.resolve("llama3.1-8b", overrides={**FINETUNE_RECIPE, "train.batch_size": 1, "train.grad_accum_steps": 8,
                                               "lora.rank": 16}, overrides_from_string=False)
    assert float(_row(out, "rtx-4090")[6]) == _gb(lora, "rtx-4090") < 23.6
    mine = C.resolve("llama3.1-8b", overrides={"train.batch_size": 4}, overrides_from_string=False)
    kept, taken = ft.with_recipe(mine, {"train.batch_size"})
    assert kept.train.batch_size == 4 and not any("batch_size" in t for t in taken)
    assert "kept as you set it: train.batch_size 4" in ft._recipe_line(kept, taken)


def _switches(text: str) -> dict[str, str]:
    m = re.search(r"; with (--\S+ \S+(?: --\S+ \S+)*) it needs about ([\d.]+) GB", text)
    assert m, text
    words = m.group(1).split()
    return {k[2:]: v for k, v in zip(words[::2], words[1::2])}


def test_advice_finds_a_memory_recipe_before_more_gpus():
    """A LoRA fine-tune whose same-numerics switches (checkpointing, the chunked loss) do not bring it under the
    GPU: the advice goes on to pure bf16 weights (its cost named) and stops there, where it used to say
    "shard over more GPUs"; the switches it names, set by hand, give the figure it says and fit."""
    base = {"lora.rank": 16, "train.batch_size": 1, "model.n_layer": 4, "model.n_embd": 1024, "model.n_head": 8,
            "model.intermediate_size": 2816, "model.block_size": 1024, "model.vocab_size": 32000}
    cfg = C.resolve("tiny-llama", overrides=base, overrides_from_string=False)
    tier1 = C.resolve("tiny-llama", overrides={**base, "memory.activation_checkpointing": 1,
                                               "model.loss_impl": "chunked"}, overrides_from_string=False)
    recipe = C.resolve("tiny-llama", overrides={**base, **FINETUNE_RECIPE}, overrides_from_string=False)
    low, high = estimate(recipe, "l4").peak_reserved_mb, estimate(tier1, "l4").peak_reserved_mb
    cap = (low + high) / 2  # the same-numerics switches do not fit, the recipe does
    text = memory_advice(cfg, "l4", capacity_mb=cap)
    assert "shard" not in text and "more GPUs" not in text, text
    chosen = _switches(text)
    assert chosen.get("train.precision") == "bf16" and "pure bf16" in text
    fixed = C.validate(C.apply_overrides(C.from_dict(cfg.to_dict()), chosen, from_string=True))
    after = estimate(fixed, "l4").peak_reserved_mb
    assert after <= cap and float(re.search(r"it needs about ([\d.]+) GB", text).group(1)) == pytest.approx(
        after / 1024, abs=0.05)
    for key in chosen:  # nothing named that is not needed: without any one of them it does not fit
        rest = {k: v for k, v in chosen.items() if k != key and not (key == "train.batch_size"
                                                                      and k == "train.grad_accum_steps")}
        less = C.validate(C.apply_overrides(C.from_dict(cfg.to_dict()), rest, from_string=True))
        assert estimate(less, "l4").peak_reserved_mb > cap, key


def test_advice_on_a_config_that_fits_says_so():
    """A LoRA fine-tune well under the GPU with nothing left to switch: the advice says it fits, not "use more
    GPUs" (which it said before, sending a run that fits onto more hardware)."""
    cfg = C.resolve("tiny-llama", overrides={**FINETUNE_RECIPE, "train.batch_size": 1, "lora.rank": 8},
                    overrides_from_string=False)
    text = memory_advice(cfg, "h100-sxm")
    assert text.endswith("it fits as it is: no memory switch is needed") and "more GPUs" not in text


def test_a_peak_within_the_expected_error_of_the_gpu_is_tight():
    """A fine-tune whose estimated peak fits the GPU by less than the estimate's expected memory error is shown as
    tight (Llama 3.1 8B's full fine-tune, 79.1 GB on an 80 GB H100, had said "fits"), with the error it is read
    against; the error is the uncertainty table's for the column's regime."""
    assert ft._cell(79.1 * 1024, 79.2 * 1024, 0.058).split()[-1] == "tight"
    assert ft._cell(20.1 * 1024, 22.0 * 1024, 0.058).split()[-1] == "fits"
    assert ft._cell(23.0 * 1024, 22.0 * 1024, 0.058).split()[-1] == "no"
    from tokenmill.estimate.uncertainty import error_for

    cfg = C.resolve("tiny-llama", overrides={"lora.rank": 8}, overrides_from_string=False)
    errs = ft._memory_errors(cfg, cfg, 1)
    assert errs["lora"] == error_for(cfg, 1)["memory"] and set(errs) == {"full", "lora", "qlora"}
    assert all(0 < e < 0.5 for e in errs.values())
