"""``tokenmill estimate --finetune``: which GPU a fine-tune of a config needs, with LoRA and without.

One estimate per GPU of the table (:data:`~tokenmill.estimate.gpus.GPUS`) for the config as a full
fine-tune (``lora.rank = 0``: every weight trains, with its gradient and AdamW state) and as a LoRA
fine-tune (the config's ``lora.*``, or rank 16 on every projection when it has none: the base frozen,
gradients and optimizer state for the adapters only), on ``nproc`` processes of that GPU, and as a QLoRA
fine-tune (the same adapters over an NF4 base, ``lora.quantize_base = 'nf4'``).

Every column starts from the recipe fine-tuners run (:data:`~tokenmill.config.memory_switches.FINETUNE_RECIPE`:
bf16 weights, activation checkpointing, the chunked loss; and a micro-batch of one sequence accumulated to the same
global batch; :func:`with_recipe`), except where the user chose the field (on the command line or in a ``--config``
file): the report names what it set.

QLoRA's column is the estimate of the LoRA config with ``lora.quantize_base = 'nf4'`` (:func:`with_qlora`):
every block projection's weight (adapted or not, as QLoRA quantises every Linear of the blocks) held in the
step's timeline as torchao stores it (:func:`~tokenmill.model.nf4.nf4_parts`: half a byte per weight, an int8
scale per 64 and an fp32 factor per group of up to 256 scales, 4.13 bits per weight), sharded so under FSDP,
and each projection's dequantisation where it runs (estimate/core.py ``_nf4_base``). Not the LoRA estimate less
the NF4 saving: near a GPU's capacity the caching allocator of a run with the full-width base is not the one
of the QLoRA run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenmill import config as C
from tokenmill.estimate.core import MB, estimate, vocab_size_of
from tokenmill.estimate.gpus import GPU, GPUS
from tokenmill.estimate.sft import chat_shares
from tokenmill.estimate.techniques import docmask_flex

GB = 1024 * MB
DEFAULT_RANK = 16


@dataclass
class FinetuneRow:
    """One GPU: its memory and the peak reserved memory (MiB) of each fine-tune, and whether it fits."""

    gpu: str
    memory_mb: float
    full_mb: float
    lora_mb: float
    qlora_mb: float = 0.0

    @property
    def qlora_fits(self) -> bool:
        return self.qlora_mb <= self.memory_mb

    @property
    def full_fits(self) -> bool:
        return self.full_mb <= self.memory_mb

    @property
    def lora_fits(self) -> bool:
        return self.lora_mb <= self.memory_mb


def with_lora(cfg: C.Config, rank: int) -> C.Config:
    """``cfg`` with ``lora.rank = rank`` (0: a full fine-tune) over an unquantised base, validated."""
    out = C.from_dict(cfg.to_dict())
    out.lora.rank, out.lora.quantize_base = rank, "none"
    return C.validate(out)


def with_recipe(cfg: C.Config, chosen: Iterable[str] = ()) -> tuple[C.Config, list[str]]:
    """``cfg`` with the switches of the fine-tuning recipe it does not use yet, except those on a field in
    ``chosen`` (the keys the user set), validated; and the flags it set (``--key value``)."""
    from tokenmill.config.memory_switches import finetune_recipe, flags, getter

    taken = [s for s in finetune_recipe(getter(cfg)) if not set(s.overrides) & set(chosen)]
    if not taken:
        return cfg, []
    out = C.apply_overrides(C.from_dict(cfg.to_dict()), {k: v for s in taken for k, v in s.overrides.items()})
    return C.validate(out), [flags(s) for s in taken]


def with_qlora(lora: C.Config) -> C.Config:
    """The LoRA config ``lora`` over an NF4 base (``lora.quantize_base = 'nf4'``), validated."""
    out = C.from_dict(lora.to_dict())
    out.lora.quantize_base = "nf4"
    return C.validate(out)


def finetune_rows(cfg: C.Config, nproc: int = 1) -> tuple[list[FinetuneRow], C.Config]:
    """The rows of every GPU of the table, smallest memory first, and the LoRA config they used."""
    full = with_lora(cfg, 0)
    lora = with_lora(cfg, cfg.lora.rank or DEFAULT_RANK)
    qlora = with_qlora(lora)
    rows = []
    for gpu in sorted((g for g in GPUS.values() if g.key != "cpu"), key=lambda g: g.memory_mb):
        a, b, c = (estimate(x, gpu, nproc) for x in (full, lora, qlora))
        rows.append(FinetuneRow(gpu.key, gpu.memory_mb, a.peak_reserved_mb, b.peak_reserved_mb, c.peak_reserved_mb))
    return rows, lora


def format_finetune(cfg: C.Config, nproc: int = 1, chosen: Iterable[str] = ()) -> str:
    """The report: the recipe, a line per GPU, then the smallest GPU that fits each way. ``chosen``: the keys
    the user set, which the recipe leaves as they are (:func:`with_recipe`)."""
    from tokenmill.model.build import count_params, lora_model_roles, trainable_params

    cfg, taken = with_recipe(cfg, chosen)
    rows, lora = finetune_rows(cfg, nproc)
    vocab = vocab_size_of(cfg)
    total, trained = count_params(cfg.model, vocab), trainable_params(lora.model, vocab, lora.lora)
    t, m, lo = cfg.train, cfg.model, lora.lora
    roles = ",".join(lora_model_roles(lora.model, lo))  # the roles the blocks have (MoE: 'experts', no dense MLP)
    lines = [
        f"fine-tuning {total / 1e6:,.1f}M parameters, micro-batch {t.batch_size} x {m.block_size} tokens, "
        f"{nproc} process(es) per run, precision {C.concrete(cfg, 'cuda').train.precision}",
        _recipe_line(cfg, taken),
        f"LoRA: rank {lo.rank}, alpha {lo.alpha:g} on {roles}: {trained / 1e6:,.2f}M trainable parameters "
        f"({100 * trained / total:.2f}%), the base frozen (no gradients, no optimizer state)",
        "",
        "QLoRA: the same adapters over the blocks' projection weights stored as NF4 (lora.quantize_base nf4, "
        "about 4.1 bits per weight)",
        "",
        f"  {'GPU':<12}{'memory':>10}   {'full fine-tune':<22}{'LoRA':<22}{'QLoRA':<22}",
    ]
    err = _memory_errors(cfg, lora, nproc)
    for r in rows:
        lines.append(f"  {r.gpu:<12}{r.memory_mb / 1024:>7.1f} GB   "
                     f"{_cell(r.full_mb, r.memory_mb, err['full']):<22}{_cell(r.lora_mb, r.memory_mb, err['lora']):<22}"
                     f"{_cell(r.qlora_mb, r.memory_mb, err['qlora']):<22}")
    lines.append("")
    for what, key in (("a full fine-tune", "full"), ("LoRA", "lora"), ("QLoRA", "qlora")):
        fit = next((r for r in rows if getattr(r, f"{key}_fits")), None)
        tight = fit is not None and _verdict(getattr(fit, f"{key}_mb"), fit.memory_mb, err[key]) == "tight"
        lines.append(f"{what}: " + (f"the smallest GPU that fits is {fit.gpu} ({fit.memory_mb / 1024:.0f} GB"
                                    + (f"; tight: within the estimate's +-{100 * err[key]:.0f}% of its memory)"
                                       if tight else ")") if fit
                                    else "no GPU of the table fits; lower train.batch_size (more train.grad_accum_steps), "
                                         "search the memory switches for one GPU (`tokenmill estimate --advice --gpu "
                                         "KEY`), or shard with --nproc N --parallel.dp_shard -1"))
    lines.append("(peak reserved memory per GPU, estimated; `tokenmill estimate --gpu KEY` details one; tight: fits by "
                 "the estimate, but within its expected error of the GPU's memory)")
    fit = next((r for r in rows if r.lora_fits), rows[-1])
    lines += finetune_chat_lines(lora, GPUS[fit.gpu], nproc)  # a chat folder: padded and packed, learned tokens/s
    return "\n".join(lines)


def lora_advice(cfg: C.Config, gpu: str, nproc: int = 1, chosen: Iterable[str] = ()) -> str:
    """``--finetune --advice``: the memory switches that bring the LoRA fine-tune of the report (the recipe
    applied) under ``gpu``'s memory (:func:`~tokenmill.estimate.advice.memory_advice`)."""
    from tokenmill.estimate.advice import memory_advice

    lora = with_lora(with_recipe(cfg, chosen)[0], cfg.lora.rank or DEFAULT_RANK)
    return f"LoRA on {gpu}: {memory_advice(lora, gpu, nproc)}"


def _recipe_line(cfg: C.Config, taken: list[str]) -> str:
    """What the estimate assumes: the recipe, the switches of it set here, and the user's own choices kept."""
    from tokenmill.config.memory_switches import FINETUNE_MICRO_BATCH, FINETUNE_RECIPE

    recipe = {**FINETUNE_RECIPE, "train.batch_size": FINETUNE_MICRO_BATCH}
    mine = [f"{k} {C.concrete(cfg, 'cuda').train.precision if k == 'train.precision' else _value(cfg, k)}"
            for k, v in recipe.items() if _value(cfg, k) != v]
    line = ("the usual fine-tuning recipe (" + ", ".join(f"{k} {v}" for k, v in recipe.items())
            + ", accumulating to the same global batch)")
    if taken:
        line += f"; set here: {' '.join(taken)}"
    if mine:
        line += f"; kept as you set it: {', '.join(mine)}"
    return line


def _value(cfg: C.Config, key: str) -> object:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _verdict(mb: float, memory_mb: float, err: float) -> str:
    """A peak against the GPU's memory: fits, tight (fits, but within the estimate's expected error ``err``), no."""
    return "no" if mb > memory_mb else "tight" if mb * (1 + err) > memory_mb else "fits"


def _cell(mb: float, memory_mb: float, err: float) -> str:
    return f"{mb / 1024:6.1f} GB  {_verdict(mb, memory_mb, err)}"


def _memory_errors(cfg: C.Config, lora: C.Config, nproc: int) -> dict[str, float]:
    """The estimate's expected memory error (:func:`~tokenmill.estimate.uncertainty.error_for`) of each column."""
    from tokenmill.estimate.uncertainty import error_for

    return {"full": error_for(with_lora(cfg, 0), nproc)["memory"], "lora": error_for(lora, nproc)["memory"],
            "qlora": error_for(with_qlora(lora), nproc)["memory"]}


def finetune_chat_lines(lora: C.Config, gpu: GPU, nproc: int = 1) -> list[str]:
    """``estimate --finetune`` on a chat folder: the LoRA fine-tune on ``gpu`` with its windows padded and packed,
    tokens/s beside learned tokens/s for each (padding costs compute and teaches nothing; packing keeps the
    conversations apart with FlexAttention's block mask on CUDA, or the explicit mask where that path is used);
    none for other data."""
    if chat_shares(lora) is None:
        return []
    lines = [f"chat windows, LoRA on {gpu.key} (data.chat_packing; tokens/s, and the learned targets' share of them):"]
    for packing in ("pad", "pack"):
        cfg = C.from_dict(lora.to_dict())
        cfg.data.chat_packing = packing
        est = estimate(C.validate(cfg), gpu, nproc)
        c = est.chat
        mask = ""
        if packing == "pack":
            mask = ", FlexAttention block mask" if docmask_flex(cfg, True) else ", explicit (B, 1, T, T) mask"
        lines.append(f"  {packing:<5}{100 * c['padding_share']:>4.0f}% padding{mask}: {est.tokens_per_sec:,.0f} tokens/s, "
                     f"{c['learned_tokens_per_sec']:,.0f} learned tokens/s ({100 * c['learned_share']:.0f}% learned)")
    return lines
