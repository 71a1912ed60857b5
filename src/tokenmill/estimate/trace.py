"""Tracing the model's own code on the ``meta`` device, one piece at a time.

Nothing is computed and nothing is allocated: a ``meta`` tensor has a shape, a dtype and a storage
size but no data, so one transformer block of gpt2-xl traces in milliseconds. The model is traced in
*pieces* (:func:`trace_pieces`): the embeddings, one transformer block of each kind the config has
(plain or activation-checkpointed, dense or sparse: a mixture of experts) and the head with the loss,
each under a :class:`Recorder` (:mod:`.recorder`: storage events and kernel costs) and a
:class:`DeviceModel` (:mod:`.device`: CUDA's or the CPU's memory behaviour). Each piece runs forward and
backward between boundary tensors made by the harness (its input, the gradient of its output), once with
the gradients created and, where the step accumulates, a second time with them already there.
:mod:`tokenmill.estimate.timeline` strings the pieces into whole training steps.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from tokenmill import config as C
from tokenmill.estimate.device import DeviceModel
from tokenmill.estimate.pieces import PieceTrace, Round, nf4_names  # noqa: F401
from tokenmill.estimate.recorder import Recorder
from tokenmill.model.lora import nf4_params, nf4_weights


class _Source(torch.autograd.Function):
    """The piece's input: a fresh (B, T, C) tensor whose gradient is recorded and then dropped."""

    @staticmethod
    def forward(ctx, anchor, shape, dtype, box):
        ctx.box = box
        return torch.empty(shape, dtype=dtype, device="meta")

    @staticmethod
    def backward(ctx, g):
        ctx.box["gx"] = ctx.box["rec"].sid(g, "gx")
        return None, None, None, None


class _Sink(torch.autograd.Function):
    """A scalar from the piece's output whose backward makes the output's gradient (as the next
    piece's backward would hand it over)."""

    @staticmethod
    def forward(ctx, y, box):
        ctx.box, ctx.shape, ctx.dtype = box, y.shape, y.dtype
        return torch.zeros((), device="meta")

    @staticmethod
    def backward(ctx, g):
        gy = torch.empty(ctx.shape, dtype=ctx.dtype, device="meta")
        ctx.box["gy"] = ctx.box["rec"].sid(gy, "gy")
        return gy, None


def _named(model: nn.Module, module: nn.Module) -> dict[str, nn.Parameter]:
    prefix = {m: n for n, m in model.named_modules()}[module]
    return {f"{prefix}.{n}" if prefix else n: p for n, p in module.named_parameters()}


def _external(model: nn.Module) -> set[int]:
    return {t.untyped_storage()._cdata for t in list(model.parameters()) + list(model.buffers())}


def _grads(rec: Recorder, params: dict[str, nn.Parameter]) -> dict[str, int]:
    return {n: rec.sid(p.grad, "grad") for n, p in params.items() if p.grad is not None}


def _finish(trace: PieceTrace, params: dict[str, nn.Parameter]) -> PieceTrace:
    trace.param_bytes = {n: p.numel() * p.element_size() for n, p in params.items()}
    trace.param_dtype = {n: p.dtype for n, p in params.items()}
    trace.param_shape = {n: tuple(p.shape) for n, p in params.items()}
    trace.param_trainable = {n: p.requires_grad for n, p in params.items()}
    for p in params.values():
        p.grad = None
    return trace


def trace_block(model: nn.Module, block: nn.Module, shape: tuple, act_dtype: torch.dtype,
                devmode: DeviceModel, accum: int = 1, rounds: int = 2) -> PieceTrace:
    """Forward and backward of one transformer block on a (B, T, C) input."""
    params = _named(model, block)
    rec = Recorder(_external(model) | devmode.gathered_ids)
    anchor = torch.zeros((), device="meta", requires_grad=True)
    trace, box = PieceTrace("block", [], rec.sizes), {"rec": rec}
    trace.buffer_bytes = sum(b.numel() * b.element_size() for b in block.buffers())
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    rope = (model.rope_cos, model.rope_sin) if model.cfg.pos_emb == "rope" else None
    nf4 = nf4_params(block)
    devmode.nf4_weights(nf4)  # QLoRA: each NF4 product's dequantisation in the timeline
    with devmode.autocast_forward(inner), devmode, rec:  # the recomputation runs under autocast too
        for _ in range(rounds):
            box.clear()
            box["rec"] = rec
            x = _Source.apply(anchor, shape, act_dtype, box)
            bx = rec.sid(x, "x")
            rec.mark("fwd")
            devmode.packed = []
            with devmode.saved_on_host(model):
                y = block(x, rope)
            trace.host_sizes = devmode.packed
            by = rec.sid(y, "y")
            del x
            n_fwd, n_fwd_ops = len(rec.costs), rec.n_ops
            s = _Sink.apply(y, box)
            del y
            rec.mark("bwd")
            (s / accum).backward()
            del s
            rec.mark("end")
            rnd = _split(rec, n_fwd, _grads(rec, params), n_fwd_ops)
            rnd.x, rnd.y, rnd.gy, rnd.gx = bx, by, box.get("gy"), box.get("gx")
            trace.rounds.append(rnd)
            rec.events, rec.costs, rec.n_ops = [], [], 0
    trace.nf4_sizes = nf4_weights(block, nf4)
    trace.param_nf4 = nf4_names(params, nf4)
    trace.nf4_traced = {id(w) for w in nf4} <= devmode.nf4_seen
    devmode.nf4_weights([])
    return _finish(trace, params)


def trace_embed(model: nn.Module, batch: int, seq: int, devmode: DeviceModel, tied_grad: bool,
                accum: int = 1, rounds: int = 2) -> PieceTrace:
    """Token + position embeddings (and their dropout) of a (B, T) batch of ids."""
    params = {n: p for n, p in model.named_parameters() if n.startswith(("wte.", "wpe."))}
    rec = Recorder(_external(model) | devmode.gathered_ids)
    trace, box = PieceTrace("embed", [], rec.sizes), {"rec": rec}
    idx = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    rec.external.add(idx.untyped_storage()._cdata)  # the batch: counted by the timeline
    blocks, ln_f = model.blocks, model.ln_f
    model.blocks, model.ln_f = nn.ModuleList(), None  # trunk() = the embeddings only
    try:
        with devmode, rec:
            for r in range(rounds):
                box.clear()
                box["rec"] = rec
                if tied_grad and r == 0:  # the tied head's gradient is already there (the head ran first)
                    model.wte.weight.grad = torch.zeros_like(model.wte.weight)
                    trace.harness.add(rec.sid(model.wte.weight.grad, "grad"))
                rec.mark("fwd")
                devmode.packed = []
                with devmode.autocast_region(), devmode.saved_on_host(model):
                    y = model.trunk(idx)
                trace.host_sizes = devmode.packed
                by = rec.sid(y, "y")
                n_fwd, n_fwd_ops = len(rec.costs), rec.n_ops
                trained = y.requires_grad  # False with LoRA: frozen embeddings have no backward
                s = _Sink.apply(y, box) if trained else None
                del y
                rec.mark("bwd")
                if trained:
                    (s / accum).backward()
                del s
                rec.mark("end")
                rnd = _split(rec, n_fwd, _grads(rec, params), n_fwd_ops)
                rnd.y, rnd.gy = by, box.get("gy")
                trace.rounds.append(rnd)
                rec.events, rec.costs, rec.n_ops = [], [], 0
    finally:
        model.blocks, model.ln_f = blocks, ln_f
    return _finish(trace, params)


def trace_head(model: nn.Module, shape: tuple, act_dtype: torch.dtype, devmode: DeviceModel,
               accum: int = 1, rounds: int = 2) -> PieceTrace:
    """Final LayerNorm, head and loss on (B, T, C) hidden states; ``y`` = the logits the trainer keeps
    until the end of the step (None with the chunked loss)."""
    params = {n: p for n, p in model.named_parameters() if n.startswith(("ln_f.", "lm_head."))}
    if model.cfg.tie_embeddings:
        params["wte.weight"] = model.wte.weight
    rec = Recorder(_external(model) | devmode.gathered_ids)
    anchor = torch.zeros((), device="meta", requires_grad=True)
    trace, box = PieceTrace("head", [], rec.sizes), {"rec": rec}
    targets = torch.zeros(shape[0], shape[1], dtype=torch.long, device="meta")
    rec.external.add(targets.untyped_storage()._cdata)
    with devmode, rec:
        for _ in range(rounds):
            box.clear()
            box["rec"] = rec
            x = _Source.apply(anchor, shape, act_dtype, box)
            bx = rec.sid(x, "x")
            rec.mark("fwd")
            devmode.packed = []
            with devmode.autocast_region(), devmode.saved_on_host(model):
                logits, loss = model.head_loss(model.ln_f(x), targets)
            trace.host_sizes = devmode.packed
            del x
            by = rec.sid(logits, "logits") if logits is not None else None
            n_fwd, n_fwd_ops = len(rec.costs), rec.n_ops
            rec.mark("bwd")
            (loss / accum).backward()
            del loss
            rec.mark("end")
            rnd = _split(rec, n_fwd, _grads(rec, params), n_fwd_ops)
            rnd.x, rnd.y, rnd.gx = bx, by, box.get("gx")
            trace.rounds.append(rnd)
            del logits
            rec.events, rec.costs, rec.n_ops = [], [], 0
    return _finish(trace, params)


def _split(rec: Recorder, n_fwd: int, grads: dict[str, int], n_fwd_ops: int = 0) -> Round:
    """Cut the recorded events at the 'bwd' marker."""
    ev = rec.events
    cut = next(i for i, e in enumerate(ev) if e[0] == "m" and e[1] == "bwd")
    return Round(ev[:cut], ev[cut:], rec.costs[:n_fwd], rec.costs[n_fwd:], grads, fwd_ops=n_fwd_ops,
                 bwd_ops=rec.n_ops - n_fwd_ops)


# ----------------------------------------------------------------------------------------------
# Building the traced model


def meta_model(cfg: C.Config, vocab_size: int, n_layer: int, tp: int = 1, dense_layers: str = "") -> nn.Module:
    """A GPT on ``meta`` with ``n_layer`` blocks, with the trainer's own switches applied
    (:mod:`tokenmill.model.build`: LoRA's adapters and frozen base, the precision cast, activation
    checkpointing of block i when i % n == 0 with its policy) and its blocks cut to one tensor-parallel
    rank's share of the model's own plan when ``tp`` > 1. With a mixture of experts every block is sparse but
    those of ``dense_layers`` (comma-separated indices)."""
    from tokenmill.model.build import apply_activation_checkpointing, apply_lora, apply_precision, build_gpt

    m = cfg.model
    mcfg = C.ModelConfig(**{**m.__dict__, "n_layer": n_layer, "moe_every": 1, "moe_dense_layers": dense_layers,
                            "norm": "native" if m.norm == "triton" else m.norm})  # Triton LN: same memory
    model = build_gpt(mcfg, vocab_size, "meta")
    apply_lora(model, cfg.lora)
    apply_precision(model, cfg.train)
    if tp > 1:
        plan = model.tp_plan(tp)
        for block in model.blocks:
            _tp_local(block, plan, tp)
    apply_activation_checkpointing(model, cfg.memory.activation_checkpointing,
                                   cfg.memory.activation_checkpointing_policy)
    model.train()
    return model


def _tp_local(block: nn.Module, plan: dict[str, str], tp: int) -> None:
    """One tensor-parallel rank's block under the model's plan: a 'colwise' Linear keeps 1/tp of its
    output features, a 'rowwise' one 1/tp of its input features."""
    for path, kind in plan.items():
        if kind not in ("colwise", "rowwise"):  # 'per_head' q/k norm weights stay whole on every rank
            continue
        parent_path, _, name = path.rpartition(".")
        parent = block.get_submodule(parent_path)
        lin = getattr(parent, name, None)
        if lin is None:
            continue
        cols = kind == "colwise"
        new = nn.Linear(lin.in_features if cols else lin.in_features // tp,
                        lin.out_features // tp if cols else lin.out_features,
                        bias=lin.bias is not None, device="meta", dtype=lin.weight.dtype)
        setattr(parent, name, new)


def activation_dtype(cfg: C.Config) -> torch.dtype:
    """The dtype of the residual stream between blocks (bf16 only for pure bf16)."""
    return torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32


def autocast_dtype(cfg: C.Config) -> Optional[torch.dtype]:
    return {"bf16-autocast": torch.bfloat16, "fp16-autocast": torch.float16}.get(cfg.train.precision)


def block_kind(checkpointed: bool, sparse: bool) -> str:
    """The name of a kind of block: 'plain' or 'checkpointed' (``memory.activation_checkpointing``), with
    ' sparse' for a mixture-of-experts layer (``model.sparse_layers``)."""
    return ("checkpointed" if checkpointed else "plain") + (" sparse" if sparse else "")


@dataclass
class Pieces:
    """Every piece of one rank's model, traced for a micro-batch of ``batch`` sequences."""

    embed: PieceTrace
    blocks: dict[str, PieceTrace]  # by kind (:func:`block_kind`): 'plain', 'checkpointed', 'plain sparse', ...
    head: PieceTrace
    kinds: list[str]  # the kind of each block of the full model
    batch: int
    seq: int
    buffers: list[int] = field(default_factory=list)  # bytes of each model-level buffer (the RoPE tables)


def trace_pieces(cfg: C.Config, vocab_size: int, device: str, batch: Optional[int] = None,
                 tp: int = 1, pipelined: bool = False, pad_balance: Optional[float] = None) -> Pieces:
    """Trace the embeddings, each kind of block and the head of ``cfg``'s model for ``device``
    ('cuda' or 'cpu') with micro-batches of ``batch`` sequences (default ``train.batch_size``).
    Configs that differ only in what the trace does not see (optimizer, tf32, data, layout) share it.
    ``pad_balance``: the GPU's FLOP/byte balance, for Inductor's padding of misaligned matrix products in
    compiled pieces (:func:`tokenmill.estimate.inductor.plan_graph`)."""
    key = trace_key(cfg, vocab_size, device, batch, tp, pipelined, pad_balance)
    hit = _CACHE.get(key) if CACHE_SIZE else None
    if hit is None:
        hit = _trace_pieces(cfg, vocab_size, device, batch, tp, pipelined, pad_balance)
        if CACHE_SIZE:
            _CACHE[key] = hit
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return hit


def trace_key(cfg: C.Config, vocab_size: int, device: str, batch: Optional[int] = None, tp: int = 1,
              pipelined: bool = False, pad_balance: Optional[float] = None) -> tuple:
    """Every value :func:`_trace_pieces` reads: two calls with the same key trace the same pieces. The whole
    model and LoRA sections; of ``train``, the precision, the micro-batch and whether gradients accumulate
    (the second round; the factor only scales a scalar); of ``memory``, checkpointing, its policy and the
    activation offload; the pieces ``torch.compile`` covers. ``pad_balance`` (the GPU's) only where a piece
    is compiled: an eager trace never reads it, so one trace serves every GPU of the table."""
    parts = tuple(sorted(compiled_pieces(cfg, pipelined)))
    return (tuple(sorted(cfg.model.__dict__.items())), cfg.train.precision, batch or cfg.train.batch_size,
            cfg.train.grad_accum_steps > 1, cfg.memory.activation_checkpointing,
            cfg.memory.activation_checkpointing_policy, tuple(sorted(cfg.lora.__dict__.items())),
            cfg.memory.offload_activations, vocab_size, device, tp, pipelined, parts,
            pad_balance if parts else None)


# traced pieces by :func:`trace_key`, least recently used first; the pieces are only read downstream (the
# timeline, the roofline), never changed. ``CACHE_SIZE`` 0: no cache (every call traces).
_CACHE: OrderedDict[tuple, Pieces] = OrderedDict()
CACHE_SIZE = 16


HEAD_ONLY = frozenset({"return_logits", "loss_impl", "loss_chunk_size", "loss_over_padded_vocab"})


def compiled_pieces(cfg: C.Config, pipelined: bool = False) -> set[str]:
    """The pieces ``torch.compile`` covers under ``cfg.compile`` (:mod:`.compiled`), as
    :func:`tokenmill.model.build.apply_compile` compiles them (its :func:`~tokenmill.model.build.compile_scope`
    and :func:`~tokenmill.model.build.compiles_head`): {'embed', 'block'} for the whole model or its trunk,
    {'block'} for ``compile.scope='block'``, each with 'head' where the head and the loss are compiled too
    (not with ``compile.loss_outside``, the chunked loss or a pipeline's loss); empty when compile is off.
    Offloaded activations (``memory.offload_activations``) go through the compiled graphs' saved tensors
    (:func:`tokenmill.estimate.compiled.offloaded`)."""
    from tokenmill.model.build import compile_scope, compiles_head

    scope = compile_scope(cfg.compile)
    if scope is None:
        return set()
    parts = {"block"} if scope == "blocks" else {"embed", "block"}
    return parts | ({"head"} if compiles_head(cfg.compile, cfg.model.loss_impl, pipelined) else set())


def _trace_pieces(cfg: C.Config, vocab_size: int, device: str, batch: Optional[int], tp: int,
                  pipelined: bool, pad_balance: Optional[float] = None) -> Pieces:
    m, t = cfg.model, cfg.train
    B, T = batch or t.batch_size, m.block_size
    from tokenmill.model.build import checkpointed_blocks

    every = cfg.memory.activation_checkpointing
    sparse = set(m.sparse_layers())
    kinds = [block_kind(c, i in sparse) for i, c in enumerate(checkpointed_blocks(m.n_layer, every))]
    need = set(kinds)
    # one traced block of each kind the model has: dense blocks first, then sparse ones (a mixture of experts);
    # of each, a checkpointed and a plain one when only some blocks are checkpointed (i % every == 0)
    per = 1 if every in (0, 1) else 2
    mixed = 0 < len(sparse) < m.n_layer
    model = meta_model(cfg, vocab_size, n_layer=per * (2 if mixed else 1), tp=tp,
                       dense_layers=",".join(map(str, range(per))) if mixed else "")
    traced_sparse = set(model.cfg.sparse_layers())
    devmode = DeviceModel(device, autocast_dtype(cfg), m.sdpa_backend, m.dropout,
                          cfg.memory.offload_activations)
    devmode.pad_balance = pad_balance
    if cfg.parallel.dp_shard != 1 and cfg.parallel.fsdp_mixed_precision == "bf16" and autocast_dtype(cfg) == torch.bfloat16:
        devmode.gather_params(model, torch.bfloat16)  # FSDP hands the forward bf16 parameters: no autocast copies
    dt = activation_dtype(cfg)
    accum = t.grad_accum_steps
    rounds = 2 if (accum > 1 or pipelined) else 1  # the second round: gradients accumulated
    shape = (B, T, m.n_embd)
    traced: dict[str, PieceTrace] = {}
    parts = compiled_pieces(cfg, pipelined)
    if parts:
        from tokenmill.estimate import compiled as CP
    if not model.wte.weight.requires_grad:  # frozen embeddings (LoRA): no backward to compile
        parts.discard("embed")
    # what a compiled piece's graphs depend on (compiled.captured): the traced model and its input, not the
    # GPU's balance, the rounds or a whole-block checkpoint wrapper (such a block's graphs are its inner block's);
    # the loss's fields only for the head (GPT.head_loss is the one place that reads them)
    graphs = (t.precision, tuple(sorted(cfg.lora.__dict__.items())), cfg.memory.offload_activations, vocab_size,
              device, tp, B, len(model.blocks), mixed)
    whole = tuple(sorted(m.__dict__.items()))
    body = tuple((k, v) for k, v in whole if k not in HEAD_ONLY)
    for i, (block, checkpointed) in enumerate(zip(model.blocks, checkpointed_blocks(len(model.blocks), every))):
        kind = block_kind(checkpointed, i in traced_sparse)
        if kind in need and kind not in traced:
            # a selectively checkpointed block (a policy other than 'full') is captured with its policy
            # (compiled.selective): its graphs depend on the policy, its key names it
            policy = cfg.memory.activation_checkpointing_policy if checkpointed else "full"
            traced[kind] = (CP.compiled_block(model, block, shape, dt, devmode, rounds,
                                              (body, graphs, "block", i) + ((policy,) if policy != "full" else ()))
                            if "block" in parts else trace_block(model, block, shape, dt, devmode, accum, rounds))
    head = (CP.compiled_head(model, shape, dt, devmode, rounds, (whole, graphs, "head")) if "head" in parts
            else trace_head(model, shape, dt, devmode, accum, rounds))
    embed = (CP.compiled_embed(model, B, T, devmode, rounds, (body, graphs, "embed")) if "embed" in parts
             else trace_embed(model, B, T, devmode, tied_grad=m.tie_embeddings, accum=accum, rounds=rounds))
    buffers = [b.numel() * b.element_size() for n, b in model.named_buffers() if not n.startswith("blocks.")]
    return Pieces(embed, traced, head, kinds, B, T, buffers)
