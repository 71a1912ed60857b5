"""From a config to a ready model: :func:`build_model` builds the GPT and :func:`parallelize` applies every
model-level switch, in one fixed order:

0. ``apply_lora`` (``lora.rank``): adapters on the chosen projections, every other weight frozen. First, on
   the whole model as built (and loaded from ``train.init_from``): every rank draws the same adapters; the
   precision cast then casts them with the base; the checkpoint wrappers and compiled graphs see the
   adapted modules; DDP and FSDP see which parameters are frozen (no gradient reduction for them). Not with
   tensor or pipeline parallelism (refused by the config).
1. ``apply_pipeline_split`` (``parallel.pp``): each rank keeps its own stage's blocks first, so every
   later step touches only the modules this rank holds.
2. ``apply_precision`` (``train.precision='bf16'``): cast before any sharding, so TP and FSDP shard the
   bf16 parameters (casting DTensors or FSDP's sharded parameters afterwards would break their views).
2a. ``apply_fp8`` (``train.fp8``, :mod:`tokenmill.model.fp8`): the block linears become torchao's
   ``Float8Linear`` after the cast (their weights keep their final dtype) and before anything wraps or
   shards them (torchtitan converts first too): the checkpoint wrappers and compiled graphs trace the FP8
   forward (compile fuses its casts), and FSDP2's float8 all-gather needs the converted weights.
3. ``apply_tensor_parallel`` (``parallel.tp``): split the blocks' matrices into DTensors before anything
   wraps the blocks, so the checkpoint wrappers and compiled graphs see the parallel modules.
3a. ``apply_expert_parallel`` (``parallel.ep``): each rank keeps its shard of every MoE layer's routed experts
   (DTensors over the ``ep`` mesh dimension) and the layers dispatch tokens by all-to-all. After the cast (the
   shards keep their final dtype) and, like TP, before the checkpoint wrappers and compiled graphs see the
   layers; under FSDP it also shards the experts over the ranks holding the same ones, which must precede
   step 6 (FSDP on a block skips the modules FSDP already manages).
4. ``apply_activation_checkpointing`` (``memory.activation_checkpointing``, with
   ``memory.activation_checkpointing_policy``): wrap blocks before compiling, so the recomputation (and a
   selective policy's choice of what to keep) is traced into the compiled graph.
5. ``apply_compile`` (``compile.*``): compile the blocks (or the model) before data parallelism, so FSDP's
   per-block communication hooks stay outside the compiled graphs (torchtitan's order).
6. ``apply_data_parallel`` (``parallel.dp_replicate``/``dp_shard``): DDP or FSDP2 last, over the final
   modules (FSDP composes with TP's DTensors into 2-D sharding).

Building, LoRA, the precision cast, activation checkpointing, compile and the parameter count live in
:mod:`tokenmill.model.build`, below the estimator, which applies the same functions to the model it
traces. The pipeline schedule (:class:`~tokenmill.parallel.pipeline.Pipeline`) runs the split model;
the trainer builds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from tokenmill import config as C
from tokenmill.config.data import SEQUENCE_START_FLAG
from tokenmill.data.meta import read_meta
from tokenmill.errors import ConfigError, DataError
from tokenmill.model.build import (
    apply_activation_checkpointing,
    apply_compile,
    apply_document_mask,
    apply_lora,
    apply_precision,
    build_gpt,
    count_params,
)
from tokenmill.model.fp8 import apply_fp8
from tokenmill.parallel import World, apply_data_parallel
from tokenmill.parallel.expert_parallel import apply_expert_parallel
from tokenmill.parallel.pipeline import apply_pipeline_split
from tokenmill.parallel.tensor_parallel import apply_tensor_parallel

__all__ = ["build_model", "count_params", "document_eot_id", "keep_documents_apart", "packs_chat", "parallelize",
           "seed_dropout"]


def build_model(cfg: C.Config, vocab_size: int, device: torch.device, world: Optional[World] = None,
                weights: Optional[Mapping[str, torch.Tensor]] = None,
                data_dir: Optional[Path] = None) -> nn.Module:
    """The GPT with every model-level switch applied, on ``device`` (this rank's pipeline stage and
    shards under ``world``); initialised from ``train.seed``, identically on every rank.

    ``weights`` (``train.init_from``, see :mod:`tokenmill.train.init_from`): a state dict of the whole
    plain GPT, loaded before any switch, so the pipeline split, tensor parallelism and FSDP split the
    loaded values. ``data_dir``: the prepared folder the run reads (None: synthetic data), whose
    end-of-text id ``data.document_mask`` separates documents by (:func:`document_eot_id`), or whose chat
    sequences ``data.chat_packing='pack'`` keeps apart (:func:`keep_documents_apart`)."""
    eot = document_eot_id(cfg, data_dir, device)  # checked before anything is built
    torch.manual_seed(cfg.train.seed)
    dtype = torch.bfloat16 if cfg.train.precision == "bf16" else None
    model = build_gpt(cfg.model, vocab_size, device, dtype)
    if weights is not None:
        model.load_state_dict(weights)  # strict: the source matches this GPT's names and shapes
    keep_documents_apart(model, cfg, data_dir, eot)  # read by the trunk: before anything wraps or compiles it
    return parallelize(model, cfg, world or World(device=device))


def packs_chat(cfg: C.Config, data_dir: Optional[Path]) -> bool:
    """Whether the run packs a chat folder's conversations (``data.chat_packing='pack'``, the folder's loss mask
    used): the model then keeps them apart by the start flags of the ids (:mod:`tokenmill.data.chat_windows`)."""
    d = cfg.data
    if d.chat_packing != "pack" or d.loss_mask is False or d.mixture or d.source == "synthetic" or data_dir is None:
        return False
    return isinstance(read_meta(data_dir).get("chat"), dict)


def keep_documents_apart(model: nn.Module, cfg: C.Config, data_dir: Optional[Path], eot: Optional[int]) -> nn.Module:
    """The one place documents are kept apart: packed chat sequences by their start flags (positions restarting),
    else ``data.document_mask`` by ``eot`` (:func:`document_eot_id`; ``apply_document_mask``)."""
    if packs_chat(cfg, data_dir):
        model.keep_documents_apart(-1, True, start_flag=SEQUENCE_START_FLAG)
        return model
    return apply_document_mask(model, cfg.data, eot)


def flex_documents(m: C.ModelConfig, device: Optional[torch.device]) -> bool:
    """Whether training attends within documents through FlexAttention (``model.document_attention``: 'flex', or
    'auto' on CUDA without attention dropout), which bypasses SDPA's kernels, the flash one included."""
    cuda = device is not None and torch.device(device).type == "cuda"
    return m.attention == "sdpa" and (m.document_attention == "flex"
                                      or (m.document_attention == "auto" and cuda and m.dropout == 0))


def document_eot_id(cfg: C.Config, data_dir: Optional[Path], device: Optional[torch.device] = None) -> Optional[int]:
    """``data.document_mask``: the end-of-text id that ends each document of the data in ``data_dir``
    (its meta.json's ``tokenizer.eot_id``; a folder whose meta.json predates that key: its tokenizer's);
    None when the switch is off (or packed chat sequences are kept apart by their start flags instead). Refuses,
    with one line, what cannot work: ``model.sdpa_backend='flash'`` only where the explicit mask would be used
    (``device``: where the model trains; None counts as the CPU)."""
    d, m = cfg.data, cfg.model
    if d.document_positions and not d.document_mask:
        raise ConfigError("data.document_positions restarts positions per document: it needs data.document_mask true.")
    packed = packs_chat(cfg, data_dir)
    if not d.document_mask and not packed:
        return None
    what = "data.chat_packing='pack'" if packed else "data.document_mask"
    if cfg.parallel.pp > 1:
        raise ConfigError(f"{what} derives documents from the token ids, which only the first pipeline "
                          "stage sees: it does not work with parallel.pp > 1.")
    if m.attention == "sdpa" and m.sdpa_backend == "flash" and not flex_documents(m, device):
        raise ConfigError(f"{what} with model.document_attention={m.document_attention!r} passes SDPA an explicit "
                          "mask here, which the flash kernel does not take: use --model.document_attention flex "
                          "(FlexAttention, CUDA, model.dropout 0) or --model.sdpa_backend auto.")
    if packed:
        return None
    if d.source == "synthetic" or data_dir is None:
        raise ConfigError("data.document_mask needs prepared token data whose documents end with an end-of-text "
                          "token; synthetic data has no documents.")
    meta = read_meta(data_dir)
    if isinstance(meta.get("chat"), dict) and d.loss_mask is not False:
        raise ConfigError(f"data.document_mask separates documents by an end-of-text id, which the chat folder "
                          f"'{data_dir}' has none of: use --data.chat_packing pack (conversations kept apart by its "
                          "start bits) and --data.document_mask false.")
    info = meta["tokenizer"]
    eot = info.get("eot_id") if isinstance(info, dict) else None
    if isinstance(info, dict) and "eot_id" not in info:  # an early folder: ask its tokenizer
        from tokenmill.data.tokenizers import load_tokenizer_for_data

        eot = load_tokenizer_for_data(data_dir).eot_id
    if not isinstance(eot, int) or isinstance(eot, bool):
        name = info.get("name") if isinstance(info, dict) else None
        raise DataError(f"data.document_mask needs an end-of-text token between documents, but the data in "
                        f"'{data_dir}' (tokenizer {name!r}) has none (documents end with a newline); prepare it "
                        "with --tokenizer bpe or gpt2, or turn data.document_mask off.")
    return eot


_RESUME_SEED_STRIDE = 1_000_003  # > any data-parallel degree: (rank, step) pairs get distinct seeds


def seed_dropout(seed: int, dp_rank: int, start_step: int = 0) -> None:
    """Give each data-parallel rank its own dropout masks (call once the model is built and
    initialised, identically on every rank, from ``seed``).

    DP rank 0 keeps the RNG as it is (as build_model left it, or restored from the checkpoint), so a
    single process is unchanged and resumes bit-exactly. Rank r > 0 is reseeded from ``seed``, r and
    ``start_step`` (a checkpoint holds rank 0's RNG state only). Tensor-parallel ranks and pipeline
    stages of one DP group share the DP rank, hence the masks (TP's replicated activations need
    equal masks)."""
    if dp_rank > 0:
        torch.manual_seed(seed + dp_rank + _RESUME_SEED_STRIDE * start_step)


def parallelize(model: nn.Module, cfg: C.Config, world: World) -> nn.Module:
    """Apply the switches in the order of the module docstring; returns the model to train."""
    if cfg.lora.rank and cfg.lora.quantize_base == "nf4":  # parallel.dp_shard -1 resolved: every NF4 weight splits
        C.check_nf4_shards(cfg.model, world.dp_shard)
    apply_lora(model, cfg.lora)
    apply_pipeline_split(model, world)
    apply_precision(model, cfg.train)
    apply_fp8(model, cfg.train, cfg.parallel, world.device)
    apply_tensor_parallel(model, world)
    apply_expert_parallel(model, world, cfg.parallel)
    apply_activation_checkpointing(model, cfg.memory.activation_checkpointing,
                                   cfg.memory.activation_checkpointing_policy)
    apply_compile(model, cfg.compile)
    return apply_data_parallel(model, world, cfg.parallel)
