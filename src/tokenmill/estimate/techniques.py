"""Estimator terms of two switches: Muon (``optim.name = 'muon'``) and FP8 matmuls (``train.fp8``).

**Muon** (:mod:`tokenmill.optim.muon`) steps the blocks' 2-D matrices (a block parameter with two
dimensions: what ``GPT.hidden_matrices`` lists) and leaves the rest to AdamW:

- state: one momentum buffer per hidden matrix, in the parameter's dtype (AdamW keeps two);
- temporaries: one matrix at a time, the Nesterov update (fp32), its bf16 copy, the iterate and the Gram
  matrices; under FSDP2 or TP the gathered whole matrix too;
- time: the momentum's memory traffic (``MUON_PASSES`` passes over the matrix), five Newton-Schulz
  iterations of ``4 s^2 l + 2 s^3`` FLOPs (``s``, ``l``: the smaller and larger size) in bf16 on tensor cores,
  about ``MUON_KERNELS`` launches per matrix (the loop is per matrix, not multi-tensor); sharded, every rank
  orthogonalises every whole matrix and all-gathers its update first.

**FP8** (:mod:`tokenmill.model.fp8`): the block linears' matrix products (not attention's) run at twice
the bf16 rate on a GPU with FP8 tensor cores, plus the casts' memory traffic
(:func:`~tokenmill.model.fp8.fp8_matmul_seconds`); on a GPU without FP8 nothing changes (the trainer refuses
it there). Memory: saved activations do not change (torchao keeps the high-precision input and weight and
casts again in backward); the float8 copies are transient, one linear at a time.

**Document masking** (``data.document_mask``, :func:`tokenmill.model.layers.document_mask`): one (B, 1, T, T)
mask per micro-batch, built before the first block and kept until the last block's backward (every layer
shares it, and SDPA keeps it for backward as it is): additive in the attention's dtype for SDPA, bool for
manual attention; with ``data.document_positions`` and RoPE, each token's (cos, sin) angles (B, T, head
width) in fp32. Time, SDPA only (manual attention computes the whole T x T anyway): an explicit mask rules out
the flash kernel, and the kernel that takes one (memory-efficient on CUDA, the CPU's flash kernel with a mask)
computes every tile of the T x T scores, not the causal half: twice the fused attention's FLOPs; and it reads
the mask, once in the forward and once in the backward (heads share it through the cache). On CUDA with
grouped-query attention the keys and values are repeated per query head for that kernel, and kept for backward
(:func:`docmask_bytes`). With FlexAttention (``model.document_attention``: 'flex', or 'auto' on CUDA without
dropout; :func:`docmask_flex`) none of that: the block mask is a few block indices (B x (T/128)^2, not counted),
grouped heads stay grouped, and the kernel skips the tiles outside the causal half like flash does; its time is
counted as the fused causal kernel's (the further tiles it skips across documents, and its lower throughput than
flash, are not modelled). The positions' angles stay.
"""

from __future__ import annotations

from tokenmill import config as C
from tokenmill.estimate.timeline import Param
from tokenmill.model.build import checkpointed_blocks
from tokenmill.model.fp8 import fp8_matmul_seconds, has_fp8

NS_STEPS = 5
MUON_PASSES = 12  # fp32 reads and writes per element: momentum and Nesterov lerps, bf16 cast, decay, update
MUON_KERNELS = 25  # launches per matrix: 2 lerps, cast, norm, divide, 5 x 3 products, decay, update, ...


def muon_hidden(cfg: C.Config, p: Param) -> bool:
    """Whether Muon steps ``p``: a trainable 2-D parameter of a block."""
    return cfg.optim.name == "muon" and p.trainable and p.piece == "block" and len(p.shape) == 2


def state_buffers(cfg: C.Config, p: Param) -> int:
    """Optimizer state tensors of ``p``, each of its size: Muon's momentum (1) or AdamW's moments (2)."""
    return 1 if muon_hidden(cfg, p) else 2


def ns_flops(shape: tuple) -> float:
    """FLOPs of the five Newton-Schulz iterations of a matrix of ``shape``."""
    s, big = min(shape), max(shape)
    return NS_STEPS * (4.0 * s * s * big + 2.0 * s ** 3)


def muon_temp_bytes(cfg: C.Config, params: list[Param], sharded: bool) -> int:
    """The largest hidden matrix's step temporaries: the fp32 update, its bf16 copy, the bf16 iterate and
    the new one, two bf16 Gram matrices (``s x s``), and the gathered fp32 matrix when sharded."""
    sizes = [(p.numel, min(p.shape)) for p in params if muon_hidden(cfg, p)]
    if not sizes:
        return 0
    n, s = max(sizes)
    return int(n * (4 + 3 * 2) + 2 * 2 * s * s + (4 * n if sharded else 0))


def muon_seconds(cfg: C.Config, params: list[Param], peak_bf16: float, matmul_eff: float, hbm_bytes_s: float,
                 link_bytes_s: float, shard: int, launch_s: float) -> tuple[float, float]:
    """(seconds of Muon's share of the optimizer step, launches) for the hidden matrices in ``params``
    (unsharded shapes; ``shard`` ranks hold pieces of each): traffic over this rank's share, the
    orthogonalisation of every whole matrix on every rank, the update's all-gather when sharded."""
    hidden = [p for p in params if muon_hidden(cfg, p)]
    traffic = sum(p.numel * 4 * MUON_PASSES for p in hidden) / shard / hbm_bytes_s
    flops = sum(ns_flops(p.shape) for p in hidden)
    mm = sum(ns_flops(p.shape) / (peak_bf16 * matmul_eff * min(p.shape) / (min(p.shape) + 512)) for p in hidden)
    gather = sum(p.numel * 4 for p in hidden) * (shard - 1) / shard / link_bytes_s if shard > 1 else 0.0
    kernels = MUON_KERNELS * len(hidden)
    gpu = traffic + (mm if flops else 0.0) + gather
    return max(gpu, kernels * launch_s), kernels


def fp8_on(cfg: C.Config, gpu_name: str) -> bool:
    return cfg.train.fp8 != "off" and has_fp8(gpu_name)


def fp8_linear_op(op) -> bool:
    """Whether a traced block op is a linear layer's product that FP8 converts (``mm``/``addmm``; not
    attention's ``bmm`` or fused kernels)."""
    return bool(op.flops) and not op.attention and "bmm" not in op.name


FP8_CAST_KERNELS = 3  # eager: an amax, a scale and a cast kernel per product's token-sized operand


def fp8_op_seconds(bf16_seconds: float, op, cfg: C.Config, hbm_bytes_s: float, kernel_min_s: float) -> tuple[float, int]:
    """(seconds, kernels) of a block linear's product with FP8, from the same product's bf16 time: half of it
    plus the casts' traffic; eager, the casts are kernels of their own (each at least ``kernel_min_s``),
    compiled they are fused into their neighbours."""
    t = max(fp8_matmul_seconds(bf16_seconds, op.flops, op.min_dim, hbm_bytes_s, cfg.compile.enabled), kernel_min_s)
    extra = 0 if cfg.compile.enabled else FP8_CAST_KERNELS
    return t + extra * kernel_min_s, 1 + extra


def docmask_flex(cfg: C.Config, cuda: bool) -> bool:
    """Whether ``data.document_mask`` runs FlexAttention (``model.document_attention``, as
    :meth:`tokenmill.model.GPT.document_attention_mask` picks it for training) rather than the explicit mask."""
    m = cfg.model
    return m.attention == "sdpa" and (m.document_attention == "flex" or (m.document_attention == "auto" and cuda
                                                                         and m.dropout == 0))


def docmask_bytes(cfg: C.Config, batch: int, seq: int, cuda: bool = False) -> int:
    """Device bytes ``data.document_mask`` holds from a micro-batch's first block to its last block's backward
    (module doc); 0 when off. On CUDA with grouped key/value heads and SDPA, the keys and values repeated per
    query head (the kernel that takes a mask has no grouped form) are kept for backward by every block that is
    not recomputed: counted here for the whole span, which leaves the peak at the forward's end unchanged."""
    if not cfg.data.document_mask:
        return 0
    m = cfg.model
    size = 2 if cfg.train.precision in ("bf16", "bf16-autocast", "fp16-autocast") else 4
    angles = 2 * batch * seq * m.head_width * 4 if cfg.data.document_positions and m.pos_emb == "rope" else 0
    if docmask_flex(cfg, cuda):
        return angles
    mask = batch * seq * seq * (1 if m.attention == "manual" else size)
    repeated = 0
    if cuda and m.attention == "sdpa" and m.kv_heads < m.n_head:
        kept = cfg.model.n_layer - sum(checkpointed_blocks(m.n_layer, cfg.memory.activation_checkpointing))
        tp = max(1, cfg.parallel.tp)
        repeated = kept * 2 * batch * seq * (m.n_head - m.kv_heads) // tp * m.head_width * size
    return mask + angles + repeated


def docmask_attention_seconds(seconds: float, cfg: C.Config, batch: int, seq: int, hbm_bytes_s: float,
                              cuda: bool = True) -> float:
    """A fused attention kernel's seconds (forward or backward, causal: the half of T x T the flash kernel
    computes) with ``data.document_mask``: the whole T x T computed (twice the time) plus one read of the
    additive mask (module doc); unchanged with FlexAttention (:func:`docmask_flex`)."""
    if not cfg.data.document_mask or cfg.model.attention != "sdpa" or docmask_flex(cfg, cuda):
        return seconds
    low = cfg.train.precision in ("bf16", "bf16-autocast", "fp16-autocast")
    return 2.0 * seconds + batch * seq * seq * (2 if low else 4) / hbm_bytes_s


def nf4_base_bytes(cfg: C.Config, vocab: int, rank: int) -> tuple[int, int, int]:
    """(bytes of the adapted projections' weights at the weights' width, their bytes as NF4, the largest
    one's transient bytes: its dequantised copy in the forward) for ``cfg``'s ``lora.targets`` at ``rank`` on
    every block (QLoRA, ``lora.quantize_base = 'nf4'``)."""
    import torch

    from tokenmill.model import GPT
    from tokenmill.model.lora import LoRALinear, apply_lora, nf4_bytes

    m = cfg.model
    one = C.ModelConfig(**{**m.__dict__, "n_layer": 1, "norm": "native" if m.norm == "triton" else m.norm})
    lo = C.LoraConfig(**{**cfg.lora.__dict__, "rank": rank, "quantize_base": "none"})
    with torch.device("meta"):
        sizes = [mod.weight.numel() for mod in apply_lora(GPT(one, vocab), lo, init=False).modules()
                 if isinstance(mod, LoRALinear)]
    width = 2 if C.concrete(cfg, "cuda").train.precision == "bf16" else 4
    return (m.n_layer * width * sum(sizes), m.n_layer * sum(nf4_bytes(n) for n in sizes),
            max(sizes) * (width + 2))
