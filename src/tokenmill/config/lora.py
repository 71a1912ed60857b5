"""The ``[lora]`` section: LoRA fine-tuning's fields, and the projection roles ``lora.targets`` names (the
model maps each role to its modules: :meth:`tokenmill.model.layers.Block.projections`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tokenmill.config.field import F
from tokenmill.config.matrices import block_matrices
from tokenmill.config.model import ModelConfig
from tokenmill.errors import ConfigError

__all__ = ["LORA_ROLES", "NF4_BLOCK", "NF4_SCALE_GROUP", "LoraConfig", "check_expert_targets", "check_nf4_shards",
           "lora_roles", "nf4_groups", "nf4_pieces"]

LORA_ROLES = ("q", "k", "v", "o", "gate", "up", "down", "experts")  # the projections lora.targets may name
NF4_BLOCK = 64  # weights per absmax scale (QLoRA's block, torchao's default)
NF4_SCALE_GROUP = 256  # scales per double-quantisation group, at most (torchao's default)


def nf4_groups(numel: int) -> tuple[int, int]:
    """(blocks of :data:`NF4_BLOCK` weights, scales per double-quantisation group) of an NF4 weight of ``numel``
    elements: the group is the largest divisor of the block count up to :data:`NF4_SCALE_GROUP` that is a
    power of two (torchao needs the groups to tile the scales). The layout of ``lora.quantize_base = 'nf4'``,
    read by ``model/nf4.py`` (the quantisation), the estimator (its bytes) and :func:`check_nf4_shards`."""
    return numel // NF4_BLOCK, math.gcd(numel // NF4_BLOCK, NF4_SCALE_GROUP)


def nf4_pieces(shape: tuple[int, ...]) -> int:
    """The most equal pieces an NF4 weight of ``shape`` (out, in) splits into along its rows: the pieces must
    hold whole rows and whole double-quantisation groups (torchao's split of its codes, scales and factors)."""
    blocks, group = nf4_groups(shape[0] * shape[1])
    return math.gcd(shape[0], blocks // group)


def check_nf4_shards(m: ModelConfig, shards: int) -> None:
    """QLoRA under FSDP: ``fully_shard`` splits each NF4 weight's rows, codes, scales and scale factors into
    ``shards`` equal pieces (torchao's NF4 tensor splits no other way: no padding, no stacked experts), so every
    block projection's rows and its double-quantisation groups must be multiples of ``shards`` (the block's
    matrices: ``config/matrices.py``). One line naming the first that is not, and the shard counts that work.
    ``shards`` -1 (every process not replicating, known once they start) is checked then, by the trainer and the
    estimator with the resolved count."""
    if shards <= 1:
        return
    if m.moe_experts:
        raise ConfigError("lora.quantize_base='nf4' with parallel.dp_shard > 1 cannot shard a mixture of experts' "
                          "stacked NF4 expert weights (torchao splits 2-D NF4 weights only). Use DDP "
                          "(--parallel.dp_shard 1 --parallel.dp_replicate N) or --lora.quantize_base none.")
    matrices = block_matrices(m)
    for mat in matrices:
        pieces = nf4_pieces(mat.shape)
        if pieces % shards:
            ok = [n for n in (2, 4, 8, 16, 32, 64) if all(nf4_pieces(x.shape) % n == 0 for x in matrices)]
            blocks, group = nf4_groups(mat.shape[0] * mat.shape[1])
            groups = blocks // group
            raise ConfigError(
                f"lora.quantize_base='nf4' under FSDP splits every NF4 weight into parallel.dp_shard={shards} "
                f"equal shards (rows, 4-bit codes and scale groups alike), but the {mat.role} projection "
                f"{tuple(mat.shape)} has {mat.shape[0]} rows and {groups} double-quantisation "
                f"group{'s' if groups > 1 else ''} of {group} scales: it splits into at most {pieces} equal "
                f"part{'s' if pieces > 1 else ''}. "
                + (f"Use --parallel.dp_shard {' or '.join(map(str, ok))}, or " if ok else "Use ")
                + "DDP (--parallel.dp_shard 1 --parallel.dp_replicate N: the 4-bit base is replicated), or "
                "--lora.quantize_base none.")


def lora_roles(targets: str, mlp: str, experts: bool = False) -> tuple[str, ...]:
    """The roles ``lora.targets`` names, in block order (``'all'``: every projection a block of this MLP
    kind has, and the routed experts when ``experts``: a mixture of experts). Unknown names, ``gate`` without a
    SwiGLU MLP, or ``experts`` without experts, are left to :func:`tokenmill.config.validate`."""
    names = [t.strip() for t in targets.split(",") if t.strip()]
    if "all" in names:
        return tuple(r for r in LORA_ROLES if (r != "gate" or mlp == "swiglu") and (r != "experts" or experts))
    return tuple(r for r in LORA_ROLES if r in names)


def check_expert_targets(lora: LoraConfig, m: ModelConfig) -> None:
    """``lora.targets`` and a mixture of experts: no 'experts' in a dense model, no MLP role in a model whose
    every layer is sparse without shared experts (one line naming the field)."""
    names = {t.strip() for t in lora.targets.split(",")}
    if "experts" in names and not m.moe_experts:
        raise ConfigError("lora.targets names 'experts', but this model has no mixture of experts "
                          "(model.moe_experts = 0); its projections are q, k, v, o, gate, up, down.")
    mlp = sorted({"gate", "up", "down"} & names)
    if mlp and m.moe_experts and len(m.sparse_layers()) == m.n_layer and not m.moe_shared_experts:
        raise ConfigError(f"lora.targets names {', '.join(mlp)}, but every layer of this model is a mixture of "
                          "experts without shared experts: name 'experts' for the routed experts.")


@dataclass
class LoraConfig:
    """LoRA fine-tuning: low-rank adapters on chosen projections, every other weight frozen."""

    rank: int = F(
        0,
        "Rank r of the adapters (0 = off: every weight trains). On: each chosen projection W (out x in) gets "
        "A (r x in, Kaiming-uniform) and B (out x r, zero), its output becomes W x + (alpha / r) B A dropout(x), "
        "and every other weight (embeddings, norms, head, biases, W itself) is frozen: no gradients and no "
        "optimizer state for them. Starts as the base model exactly (B = 0); use with train.init_from. "
        "Checkpoints hold base and adapters; sample, eval and export merge them (W + alpha/r B A). Not with "
        "parallel.tp or parallel.pp.",
        ge=0,
    )
    alpha: float = F(16.0, "LoRA scale numerator: the adapters' output is multiplied by alpha / rank.", gt=0)
    targets: str = F(
        "all",
        "The projections of every block that get adapters, comma-separated: q, k, v (query, key, value; parts "
        "of the fused q/k/v matrix with model.fused_qkv, each with its own adapter), o (attention output), "
        "gate, up, down (the MLP: gate only in a SwiGLU MLP; up/down are GPT-2's c_fc/c_proj; in a sparse layer, "
        "the shared experts' projections), experts (the routed experts of a mixture of experts: a low-rank pair "
        "per expert on its gate/up and down weights), or 'all' (every projection the model has; a role a block "
        "lacks is skipped there).",
    )
    dropout: float = F(0.0, "Dropout on the adapters' input (the frozen path sees x unchanged).", ge=0, lt=1)
    quantize_base: Literal["none", "nf4"] = F(
        "none",
        "QLoRA: 'nf4' stores the frozen weight of every block projection (q, k, v, o, gate, up, down, adapted or "
        "not, as QLoRA does; the routed experts where adapted) as 4-bit NormalFloat (torchao's "
        "NF4: blocks of 64 weights with an int8 scale each, the scales double-quantised in groups of up to 256; "
        "about 4.13 bits per weight), dequantised to the input's dtype in each forward and backward; the adapters, "
        "embeddings, norms and head keep the compute dtype. Needs torchao and lora.rank > 0; each such "
        "matrix's size must be a multiple of 64 (the routed experts: each stack of E matrices is one NF4 tensor). "
        "Checkpoints keep the NF4 base exactly (codes and scales: resume is exact); sample, eval and export merge "
        "the adapters into the dequantised base. One process, DDP, or FSDP (parallel.dp_shard: each NF4 weight "
        "is sharded and all-gathered in its 4-bit form, as torchtune's QLoRA does; its rows and scale groups "
        "must split evenly over the shards, and a mixture of experts is not sharded).",
    )
