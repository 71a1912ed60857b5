"""From a config to a model, below everything that needs one: building (on a device or on ``meta``),
the parameter counts, and the model-level switches that change neither the parameters nor the math
of one process: the precision cast, activation checkpointing (whole blocks or selective) and compile;
and LoRA (``apply_lora``), which adds adapters and freezes the rest.

The trainer (``train/parallelize.py``) applies them in its fixed order, between the pipeline split,
tensor parallelism and data parallelism; the estimator (``estimate/trace.py``) applies the same
functions to the model it traces on ``meta``, so both see one implementation of each switch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from tokenmill import config as C
from tokenmill.model import lora
from tokenmill.model.gpt import GPT
from tokenmill.model.moe import MoE
from tokenmill.model.recompute import quiet_context_fn_note, save_matmuls_policy

__all__ = ["ParamCounts", "apply_activation_checkpointing", "apply_compile", "apply_document_mask", "apply_lora",
           "compile_scope", "compiles_head",
           "apply_precision", "build_gpt", "checkpointed_blocks", "count_params", "param_counts",
           "lora_model_roles", "lora_on_meta", "one_block_of_each", "save_matmuls_policy", "trainable_params"]


def build_gpt(cfg: C.ModelConfig, vocab_size: int, device: torch.device | str, dtype: torch.dtype | None = None) -> GPT:
    """The GPT of ``cfg`` on ``device``, initialised from the current torch seed. With ``dtype``
    (pure bf16) it is allocated in that dtype at once: no fp32 copy inflating reserved memory."""
    if dtype is None:
        with torch.device(device):
            return GPT(cfg, vocab_size)
    with torch.device("meta"):
        model = GPT(cfg, vocab_size)
    model.to(dtype).to_empty(device=device)
    model.init_weights()
    return model


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a whole model by part (a tied head is the token embedding and counts once)."""

    total: int
    token_embedding: int  # padded rows included
    position_embedding: int  # 0 with rotary embeddings
    untied_head: int  # 0 when tied; padded rows included
    per_block: int  # a dense block (model.mlp)
    inactive: int = 0  # mixture of experts: the routed experts a token skips (active = total - inactive)


def param_counts(cfg: C.ModelConfig, vocab_size: int) -> ParamCounts:
    """Counted on a one-block model on ``meta`` (every dense block has the same parameters, and every
    sparse block: one mixture of experts more, :mod:`tokenmill.model.moe`), so any depth counts at once
    and nothing is allocated."""
    one = C.ModelConfig(**{**cfg.__dict__, "n_layer": 1, "moe_experts": 0, "moe_dense_layers": "",
                           "norm": "native" if cfg.norm == "triton" else cfg.norm})  # same parameters
    with torch.device("meta"):
        model = GPT(one, vocab_size)
        moe = MoE(cfg) if cfg.moe_experts else None
    block = sum(p.numel() for p in model.blocks[0].parameters())
    wpe = model.wpe.weight.numel() if model.wpe is not None else 0
    head = 0 if cfg.tie_embeddings else model.lm_head.weight.numel()
    total = model.num_params() + (cfg.n_layer - 1) * block
    inactive = 0
    if moe is not None:  # sparse layers: their mixture of experts instead of the dense MLP
        n_sparse = len(cfg.sparse_layers())
        total += n_sparse * (sum(p.numel() for p in moe.parameters()) - sum(p.numel() for p in model.blocks[0].mlp.parameters()))
        inactive = n_sparse * (cfg.moe_experts - cfg.moe_top_k) * moe.experts.gate_up[0].numel() * 3 // 2
    return ParamCounts(total, model.wte.weight.numel(), wpe, head, block, inactive)


def count_params(cfg: C.ModelConfig, vocab_size: int) -> int:
    """Parameters of the whole model (every stage and shard)."""
    return param_counts(cfg, vocab_size).total


def apply_precision(model: nn.Module, cfg: C.TrainConfig) -> nn.Module:
    """``train.precision='bf16'``: cast the whole model (pure bf16); other modes keep fp32 weights."""
    if cfg.precision == "bf16":
        model.to(torch.bfloat16)
    return model


def checkpointed_blocks(n_layer: int, every_n: int) -> list[bool]:
    """Which blocks ``memory.activation_checkpointing = every_n`` wraps: 0, n, 2n, ... (0 = none)."""
    return [every_n > 0 and i % every_n == 0 for i in range(n_layer)]


def apply_activation_checkpointing(model: nn.Module, every_n: int, policy: str = "full") -> nn.Module:
    """``memory.activation_checkpointing``: wrap blocks 0, n, 2n, ... so that their activations are
    recomputed in backward instead of stored (non-reentrant ``torch.utils.checkpoint``; 0 = off). The
    wrapper strips its prefix from state dicts, so checkpoints keep the plain parameter names.

    ``policy`` (``memory.activation_checkpointing_policy``): 'full' keeps only each wrapped block's input;
    'save-matmuls' is selective checkpointing: the outputs of the block's matrix products and fused
    attention are cached in the forward (:func:`save_matmuls_policy`) and handed back to the recomputation,
    which then runs only the element-wise ops between them."""
    wrap = checkpointed_blocks(len(model.blocks), every_n)
    kwargs = {}
    if policy == "save-matmuls":
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_matmuls_policy)
        quiet_context_fn_note()
    for i, block in model.present_blocks():
        if wrap[i]:
            model.blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
    return model


def apply_document_mask(model: GPT, cfg: C.DataConfig, eot_id: int | None) -> GPT:
    """``data.document_mask``: attention within each document only, documents ending with ``eot_id``
    (:meth:`GPT.keep_documents_apart`; ``data.document_positions``: positions restart per document).
    Call it on the whole model before any wrapper or compile (it sets what the trunk reads)."""
    if cfg.document_mask:
        model.keep_documents_apart(eot_id, cfg.document_positions)
    return model


def apply_lora(model: nn.Module, cfg: C.LoraConfig, init: bool = True) -> nn.Module:
    """``lora.rank > 0``: adapters on the ``lora.targets`` projections of every block, everything else
    frozen (:func:`tokenmill.model.lora.apply_lora`; ``init=False`` leaves the adapters to be loaded)."""
    return lora.apply_lora(model, cfg, init)


def one_block_of_each(cfg: C.ModelConfig) -> tuple[C.ModelConfig, list[int]]:
    """A config of one block of each kind ``cfg``'s model has (a dense block, then a sparse one: a mixture of
    experts; either may be absent), and how many of ``cfg``'s blocks each stands for: what counts on ``meta``
    build instead of the whole depth (the blocks of a kind have the same parameters and adapters)."""
    n_sparse = len(cfg.sparse_layers())
    counts = [n for n in (cfg.n_layer - n_sparse, n_sparse) if n]
    one = C.ModelConfig(**{**cfg.__dict__, "n_layer": len(counts), "moe_every": len(counts), "moe_dense_layers": "",
                           "norm": "native" if cfg.norm == "triton" else cfg.norm})  # same parameters
    return one, counts


def lora_on_meta(cfg: C.ModelConfig, vocab_size: int, lora_cfg: C.LoraConfig) -> tuple[GPT, list[int]]:
    """:func:`one_block_of_each`'s model on ``meta`` with ``lora_cfg``'s adapters (not drawn), and the counts."""
    one, counts = one_block_of_each(cfg)
    with torch.device("meta"):
        return lora.apply_lora(GPT(one, vocab_size), lora_cfg, init=False), counts


def trainable_params(cfg: C.ModelConfig, vocab_size: int, lora_cfg: C.LoraConfig | None = None) -> int:
    """Parameters that train (get gradients and optimizer state): all of them, or with ``lora.rank > 0``
    the adapters only (attention, MLP and the routed experts' per-expert pairs: counted on one block of each
    kind on ``meta``, :func:`lora_on_meta`)."""
    if lora_cfg is None or lora_cfg.rank == 0:
        return count_params(cfg, vocab_size)
    model, counts = lora_on_meta(cfg, vocab_size, lora_cfg)
    return sum(n * sum(p.numel() for p in block.parameters() if p.requires_grad)
               for n, block in zip(counts, model.blocks))


def lora_model_roles(cfg: C.ModelConfig, lora_cfg: C.LoraConfig) -> tuple[str, ...]:
    """The roles of ``lora.targets`` that ``cfg``'s blocks have (the adapters :func:`apply_lora` makes, in
    :data:`tokenmill.config.LORA_ROLES` order; 'experts' for the routed experts)."""
    model, _ = lora_on_meta(cfg, 1, lora_cfg)
    have = set()
    for m in model.modules():
        if isinstance(m, lora.LoRAExperts):
            have.add("experts")
        elif isinstance(m, lora.LoRALinear):
            have |= set(m.lora_A)
    return tuple(r for r in C.LORA_ROLES if r in have)


def compile_scope(cfg: C.CompileConfig) -> str | None:
    """How :func:`apply_compile` compiles the trunk: None (compile off), 'trunk' (``compile.scope='model'`` with
    ``compile.loss_outside``: one graph up to the final norm), 'blocks' (``compile.scope='block'``: each block
    on its own) or 'model' (one graph of the whole model). Whether the head and the loss are compiled too:
    :func:`compiles_head`. The estimator reads both (``estimate/trace.py compiled_pieces``)."""
    if not cfg.enabled:
        return None
    if cfg.scope == "block":
        return "blocks"
    return "trunk" if cfg.loss_outside else "model"


def compiles_head(cfg: C.CompileConfig, loss_impl: str, pipelined: bool) -> bool:
    """Whether the head and the full cross-entropy (``GPT.head_loss``) run compiled: inside the whole model's
    graph (scope 'model'), or as one graph of their own beside the blocks' (scope 'block', as torchtitan's
    ``build_cross_entropy_loss`` and torchtune's ``compile_loss`` compile the loss beside per-block compile).
    Never with ``compile.loss_outside``, the chunked loss (``model.loss_impl='chunked'``: costed eager) or a
    pipeline (its schedule applies the head and the loss outside the stage)."""
    return compile_scope(cfg) in ("model", "blocks") and not cfg.loss_outside and loss_impl == "full" and not pipelined


def apply_compile(model: nn.Module, cfg: C.CompileConfig) -> nn.Module:
    """``compile.*``: torch.compile in place (``nn.Module.compile``, and the bound ``head_loss`` replaced by its
    compiled form on the instance), so parameter names and checkpoints never carry ``_orig_mod.`` prefixes;
    ``compile.scope='block'`` compiles each block separately and, where :func:`compiles_head`, the head with
    the loss as one more graph; ``compile.loss_outside`` leaves the head and the loss eager (:func:`compile_scope`)."""
    scope = compile_scope(cfg)
    if scope is None:
        return model
    kwargs = {"mode": cfg.mode, "fullgraph": cfg.fullgraph, "dynamic": cfg.dynamic}
    if scope == "trunk":  # the seed's form: compile up to the final norm, head and loss run eagerly
        model.trunk = torch.compile(model.trunk, **kwargs)
    elif scope == "blocks":
        for _, block in model.present_blocks():
            block.compile(**kwargs)
        stage = model.ln_f is None or model.hidden_output  # a pipeline stage, as GPT.forward tells one
        if compiles_head(cfg, model.cfg.loss_impl, stage):
            model.head_loss = torch.compile(model.head_loss, **kwargs)  # an attribute, not a module: no new names
    else:
        model.compile(**kwargs)
    return model
