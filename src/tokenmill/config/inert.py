"""Switches that do nothing where they are set: the one table of (fields, the switch they need, whether the
config has it). A field set to a value other than its default while the switch it needs is off changes
nothing, so :func:`warn_inert` (called once, where a run's config is resolved: ``config.resolve``) warns,
naming the switch it needs. Only what the user chose is warned about (flags and their own config files):
a preset's values and a run's recorded config.toml are the base it is compared with. A warning, not an error: the config still runs as it would without the field.

A new switch that only acts under another one adds a row here; ``tests/test_trust_messages.py`` checks
that every row warns, and that the defaults and every preset do not.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["INERT", "Needs", "inert_warnings", "warn_inert"]


@dataclass(frozen=True)
class Needs:
    """``fields`` ('section.field') act only when ``active(cfg)`` holds; ``switch`` says how to turn it
    on, as typed on the command line."""

    fields: tuple[str, ...]
    switch: str
    active: Callable[[Any], bool]


def _ddp(c) -> bool:  # DDP wraps the model only with replicas and no FSDP sharding (-1: the world size)
    return c.parallel.dp_replicate != 1 and c.parallel.dp_shard == 1


def _embedded(c) -> bool:  # the embedded corpus: prepared with data.tokenizer when no folder is given
    return not (c.data.path or c.data.mixture)


INERT: tuple[Needs, ...] = (
    Needs(("compile.mode", "compile.fullgraph", "compile.dynamic", "compile.scope", "compile.loss_outside"),
          "--compile.enabled true", lambda c: c.compile.enabled),
    Needs(("memory.activation_checkpointing_policy",), "--memory.activation_checkpointing 1 (or every n-th block: N)",
          lambda c: c.memory.activation_checkpointing > 0),
    Needs(("parallel.ddp_bucket_mb", "parallel.ddp_grad_as_bucket_view"),
          "DDP: --parallel.dp_replicate > 1 (or -1 under torchrun) with --parallel.dp_shard 1", _ddp),
    Needs(("parallel.fsdp_reshard_after_forward", "parallel.fsdp_mixed_precision"),
          "FSDP: --parallel.dp_shard > 1 (or -1 under torchrun)", lambda c: c.parallel.dp_shard != 1),
    Needs(("parallel.pp_schedule", "parallel.pp_microbatches"), "--parallel.pp > 1", lambda c: c.parallel.pp > 1),
    Needs(("parallel.sync_every_microbatch",), "--train.grad_accum_steps > 1",
          lambda c: c.train.grad_accum_steps > 1),
    Needs(("lora.alpha", "lora.dropout", "lora.targets"), "--lora.rank > 0", lambda c: c.lora.rank > 0),
    Needs(("data.document_positions", "model.document_attention"), "--data.document_mask true",
          lambda c: c.data.document_mask or c.data.chat_packing == "pack"),  # pack: chat data's sequences
    Needs(("data.prefetch_factor", "data.persistent_workers"), "--data.num_workers > 0",
          lambda c: c.data.num_workers > 0),
    Needs(("data.cuda_prefetch",), "a CUDA device (--train.device cuda or auto on a GPU)",
          lambda c: c.train.device not in ("cpu", "mps")),
    Needs(("data.tokenizer", "data.bpe_vocab_size"),
          "the embedded corpus (no --data.path or --data.mixture: a prepared folder keeps its own tokenizer)",
          lambda c: _embedded(c) or c.data.source != "tokens"),
    Needs(("model.moe_top_k", "model.moe_intermediate_size", "model.moe_shared_experts", "model.moe_every",
           "model.moe_dense_layers", "model.moe_router", "model.moe_aux_loss_coef", "model.moe_z_loss_coef",
           "model.moe_impl", "model.moe_bias_update_rate"), "--model.moe_experts > 0", lambda c: c.model.moe_experts > 0),
    Needs(("model.moe_shared_intermediate_size", "model.moe_shared_gate"),
          "--model.moe_shared_experts > 0 (with --model.moe_experts > 0)",
          lambda c: c.model.moe_experts > 0 and c.model.moe_shared_experts > 0),
    Needs(("model.qk_norm_width",), "--model.qk_norm true", lambda c: c.model.qk_norm),
    Needs(("model.loss_chunk_size",), "--model.loss_impl chunked", lambda c: c.model.loss_impl == "chunked"),
    Needs(("model.return_logits",), "the loss compiled (--compile.enabled true, no compile.loss_outside, "
          "model.loss_impl 'full', parallel.pp 1)",
          lambda c: (c.compile.enabled and not c.compile.loss_outside
                     and c.model.loss_impl == "full" and c.parallel.pp == 1)),
    Needs(("model.causal_mask",), "--model.attention manual", lambda c: c.model.attention == "manual"),
    Needs(("model.sdpa_backend",), "--model.attention sdpa", lambda c: c.model.attention == "sdpa"),
    Needs(("model.gelu",), "--model.mlp gelu", lambda c: c.model.mlp == "gelu"),
    Needs(("model.rope_theta",), "--model.pos_emb rope", lambda c: c.model.pos_emb == "rope"),
    Needs(("model.rope_factor", "model.rope_low_freq_factor", "model.rope_high_freq_factor",
           "model.rope_original_context"), "--model.rope_scaling llama3", lambda c: c.model.rope_scaling == "llama3"),
    Needs(("model.loss_over_padded_vocab",), "--model.vocab_pad_multiple > 1",
          lambda c: c.model.vocab_pad_multiple > 1),
    Needs(("optim.muon_lr", "optim.muon_momentum", "optim.muon_weight_decay"), "--optim.name muon",
          lambda c: c.optim.name == "muon"),
    Needs(("optim.min_lr", "optim.decay_steps"), "--optim.schedule cosine", lambda c: c.optim.schedule == "cosine"),
    Needs(("train.fp8_all_gather",), "--train.fp8 tensorwise", lambda c: c.train.fp8 == "tensorwise"),
    Needs(("train.sample_tokens", "train.sample_prompt"), "--train.sample_at_end true",
          lambda c: c.train.sample_at_end),
    Needs(("train.eval_every_steps",), "--train.eval_batches > 0", lambda c: c.train.eval_batches > 0),
    Needs(("log.wandb_project", "log.wandb_name", "log.wandb_mode"), "--log.wandb true", lambda c: c.log.wandb),
    Needs(("eval.tasks_limit", "eval.tasks_every_steps", "eval.include_path"), "--eval.tasks NAME[,NAME...]",
          lambda c: bool(c.eval.tasks)),
)


def _value(cfg: Any, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def _default(cfg: Any, key: str) -> Any:
    section, name = key.split(".")
    f = next(f for f in dataclasses.fields(getattr(cfg, section)) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def inert_warnings(cfg: Any, base: Any = None) -> list[str]:
    """One line per field of :data:`INERT` that the user set (its value differs from ``base``: the config
    before the user's files and flags, the defaults and preset; None: the defaults) while the switch it
    needs is off. A preset's value is not the user's choice: ``--preset tiny --data.path DIR`` says nothing
    of the preset's data.tokenizer."""
    out = []
    for row in INERT:
        if row.active(cfg):
            continue
        for key in row.fields:
            value = _value(cfg, key)
            if value != (_default(cfg, key) if base is None else _value(base, key)):
                out.append(f"{key} = {value!r} does nothing in this config: it needs {row.switch}.")
    return out


_SHOWN: set[str] = set()  # the lines this process has printed: each is said once, however often a config resolves


def warn_inert(cfg: Any, base: Any = None) -> list[str]:
    """Print each of :func:`inert_warnings` once per process on stderr (``tokenmill: warning: ...``); returns
    the lines printed now."""
    new = [w for w in inert_warnings(cfg, base) if w not in _SHOWN]
    for w in new:
        _SHOWN.add(w)
        print(f"tokenmill: warning: {w}", file=sys.stderr, flush=True)
    return new
