"""Estimator terms of four switches: Muon (``optim.name = 'muon'``), FP8 matmuls (``train.fp8``), document
masking (``data.document_mask``) and activation offloading's time (``memory.offload_activations``).

**Muon** (:mod:`tokenmill.optim.muon`) steps the blocks' 2-D matrices (a block parameter with two
dimensions: what ``GPT.hidden_matrices`` lists) and leaves the rest to AdamW:

- state: one momentum buffer per hidden matrix, in the parameter's dtype (AdamW keeps two);
- temporaries: one matrix at a time, the Nesterov update (fp32), its bf16 copy, the iterate and the Gram
  matrices; under FSDP2 or TP the gathered whole matrix too;
- time: the momentum's memory traffic (``MUON_PASSES`` passes over the matrix), five Newton-Schulz
  iterations of ``4 s^2 l + 2 s^3`` FLOPs (``s``, ``l``: the smaller and larger size) in bf16 on tensor cores,
  about ``MUON_KERNELS`` launches per matrix (the loop is per matrix, not multi-tensor); sharded, every rank
  orthogonalises every whole matrix and all-gathers its update first. A fused q/k/v matrix is three (its q, k
  and v rows, each orthogonalised on its own), the experts' ``gate_up`` two (:func:`muon_matrices`).

**FP8** (:mod:`tokenmill.model.fp8`): the block linears' matrix products (not attention's) run at twice
the bf16 rate on a GPU with FP8 tensor cores, plus the casts' memory traffic
(:func:`~tokenmill.model.fp8.fp8_matmul_seconds`); on a GPU without FP8 nothing changes (the trainer refuses
it there). Memory: saved activations do not change (torchao keeps the high-precision input and weight and
casts again in backward; under 'save-matmuls' checkpointing the op policy is asked about ``aten.mm`` on the
float8 operands, above the subclass's ``_scaled_mm``, and keeps each product's high-precision output, as for
bf16: ``tests/test_fp8_sac.py``); the float8 copies are transient, one linear at a time.

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
dropout; :func:`docmask_flex`) none of that: the block mask is block indices only (:func:`block_mask_bytes`:
eight int32 tables of B x n or B x n x n, n = T/128 tiles, plus each token's document start), grouped heads stay
grouped, and the kernel skips the tiles outside the causal half like flash does; its time is counted as the fused
causal kernel's (the further tiles it skips across documents, and its lower throughput than flash, are not
modelled). The positions' angles stay. Packed chat windows (``data.chat_packing='pack'`` on a
chat folder, :func:`~tokenmill.estimate.sft.packs_chat`) are kept apart the same way, positions restarting.

**Activation offloading** (:mod:`tokenmill.model.offload`): the copies run on a side stream, down during the
forward and back during the backward, each direction on its own copy engine over the host link
(``roofline.host_link_bytes_s``), so the step pays only what the compute cannot hide (:func:`offload_stall_seconds`): a
tensor goes down once saved, at most ``IN_FLIGHT`` copies ahead of the compute (the pace is the slower of compute
and link); a tensor whose copy has not landed when the forward ends stays on the device; in backward, reading a
tensor brings back the ones saved before it, as many bytes as its own ahead, and the compute waits for its own
copy only (:mod:`tokenmill.model.offload`, replayed tensor by tensor). Memory: the last ``IN_FLIGHT`` tensors
saved stay on the device from the forward's end through the head's backward (``step.offload_kept_bytes``, an upper
bound); the two in flight during the forward are not counted.
"""

from __future__ import annotations

from tokenmill import config as C
from tokenmill.estimate.sft import packs_chat
from tokenmill.estimate.timeline import Param
from tokenmill.model.build import checkpointed_blocks
from tokenmill.model.fp8 import block_linear_shapes, fp8_matmul_seconds, has_fp8
from tokenmill.model.offload import IN_FLIGHT

NS_STEPS = 5
MUON_PASSES = 12  # fp32 reads and writes per element: momentum and Nesterov lerps, bf16 cast, decay, update
MUON_KERNELS = 25  # launches per matrix: 2 lerps, cast, norm, divide, 5 x 3 products, decay, update, ...
MUON_PART_KERNELS = 20  # launches per further part of a split matrix (fused q/k/v, gate_up): cast, norm, clamp,
# divide, 5 x 3 products, update (optim/muon.py newton_schulz and orthogonal_parts)


# a mixture of experts' gates, AdamW's under Muon (optim/muon.py ``_moe_parameters``; the estimator may not import
# optim/, its sibling floor: tests/test_moe_loose_ends.py checks these against a real step of MuonWithAdamW)
MUON_GATES = (".mlp.router.weight", ".mlp.shared_gate.weight")


def muon_hidden(cfg: C.Config, p: Param) -> bool:
    """Whether Muon steps ``p``, as ``optim/muon.py build_muon`` decides: a trainable 2-D matrix of a block other
    than a mixture of experts' router and shared-expert gate (AdamW's), or a routed experts' 3-D stack (its
    ``gate_up``/``down`` and their per-expert LoRA adapters: E matrices, each orthogonalised on its own)."""
    if not (cfg.optim.name == "muon" and p.trainable and p.piece == "block"):
        return False
    if len(p.shape) == 3:
        return ".mlp.experts." in p.name
    return len(p.shape) == 2 and not p.name.endswith(MUON_GATES)


def muon_matrices(cfg: C.Config, p: Param) -> list[tuple[int, tuple[int, int]]]:
    """The parts Muon orthogonalises in ``p``, one after another, as optim/muon.py ``orthogonal_parts`` splits it:
    each (how many matrices at once, each one's (rows, cols)). A 2-D matrix is one part, but the fused q/k/v
    ``c_attn`` three (its q, k and v rows: ``GPT.hidden_matrices``); an expert stack is one batched part of E
    matrices, the experts' ``gate_up`` two (its gate rows, then its up rows)."""
    if len(p.shape) == 2:
        rows, cols = p.shape
        if p.name.endswith("c_attn.weight"):  # rows q : k : v = n_head : kv_heads : kv_heads (any TP share alike)
            m = cfg.model
            q = rows * m.n_head // (m.n_head + 2 * m.kv_heads)
            return [(1, (q, cols)), (1, ((rows - q) // 2, cols)), (1, ((rows - q) // 2, cols))]
        return [(1, (rows, cols))]
    e, rows, cols = p.shape
    return [(e, (rows // 2, cols))] * 2 if p.name.endswith("experts.gate_up") else [(e, (rows, cols))]


def state_buffers(cfg: C.Config, p: Param) -> int:
    """Optimizer state tensors of ``p``, each of its size: Muon's momentum (1) or AdamW's moments (2)."""
    return 1 if muon_hidden(cfg, p) else 2


def ns_flops(shape: tuple) -> float:
    """FLOPs of the five Newton-Schulz iterations of a matrix of ``shape``."""
    s, big = min(shape), max(shape)
    return NS_STEPS * (4.0 * s * s * big + 2.0 * s ** 3)


def muon_temp_bytes(cfg: C.Config, params: list[Param], sharded: bool) -> int:
    """The largest hidden matrix's step temporaries: the fp32 update, its bf16 copy, the bf16 iterate and
    the new one, two bf16 Gram matrices (``s x s``) of the part being orthogonalised (:func:`muon_matrices`), and
    the gathered fp32 matrix when sharded."""
    sizes = [(p.numel, max(2 * 2 * k * min(shape) ** 2 for k, shape in muon_matrices(cfg, p)))
             for p in params if muon_hidden(cfg, p)]
    if not sizes:
        return 0
    return max(int(n * (4 + 3 * 2) + gram + (4 * n if sharded else 0)) for n, gram in sizes)


def muon_seconds(cfg: C.Config, params: list[Param], peak_bf16: float, matmul_eff: float, hbm_bytes_s: float,
                 link_bytes_s: float, shard: int, launch_s: float) -> tuple[float, float]:
    """(seconds of Muon's share of the optimizer step, launches) for the hidden matrices in ``params``
    (unsharded shapes; ``shard`` ranks hold pieces of each): traffic over this rank's share, the
    orthogonalisation of every whole matrix on every rank, the update's all-gather when sharded."""
    hidden = [p for p in params if muon_hidden(cfg, p)]
    traffic = sum(p.numel * 4 * MUON_PASSES for p in hidden) / shard / hbm_bytes_s
    mats = [part for p in hidden for part in muon_matrices(cfg, p)]  # an expert stack: E matrices (batched)
    flops = sum(k * ns_flops(shape) for k, shape in mats)
    mm = sum(k * ns_flops(shape) / (peak_bf16 * matmul_eff * min(shape) / (min(shape) + 512)) for k, shape in mats)
    gather = sum(p.numel * 4 for p in hidden) * (shard - 1) / shard / link_bytes_s if shard > 1 else 0.0
    kernels = MUON_KERNELS * len(hidden) + MUON_PART_KERNELS * (len(mats) - len(hidden))
    gpu = traffic + (mm if flops else 0.0) + gather
    return max(gpu, kernels * launch_s), kernels


def fp8_on(cfg: C.Config, gpu_name: str) -> bool:
    return cfg.train.fp8 != "off" and has_fp8(gpu_name)


def fp8_linear_op(op, cfg: C.Config) -> bool:
    """Whether a traced block op is a product of a linear layer that FP8 converts (``mm``/``addmm``; not
    attention's ``bmm`` or fused kernels): two of its sizes (M, K, N) are the ``(in, out)`` of one of the block's
    matrices FP8 takes (``model/fp8.py block_linear_shapes``, from ``config/matrices.py``), either size split
    over ``parallel.tp``; a product without recorded sizes counts."""
    if not op.flops or op.attention or "bmm" in op.name:
        return False
    if not op.dims:
        return True
    sizes, tp = list(op.dims[1:]), cfg.parallel.tp
    for i, o in block_linear_shapes(cfg.model):
        for a, b in {(i, o), (i // tp, o), (i, o // tp)}:
            rest = list(sizes)
            if a in rest and (rest.remove(a) or b in rest):
                return True
    return False


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


def block_mask_bytes(batch: int, seq: int) -> int:
    """FlexAttention's block mask of a (batch, seq) micro-batch (``model.layers.document_block_mask``): for n =
    seq/128 tiles a side, four int32 tables of (batch, 1, n) visible-tile counts and four of (batch, 1, n, n) tile
    indices (partial and full tiles, by row and by column for the backward), and each token's document start
    (int64) that its mask function reads. No T x T term."""
    n = -(-seq // 128)
    return 16 * batch * n * (n + 1) + 8 * batch * seq


def docmask_bytes(cfg: C.Config, batch: int, seq: int, cuda: bool = False) -> int:
    """Device bytes ``data.document_mask`` holds from a micro-batch's first block to its last block's backward
    (module doc); 0 when off. On CUDA with grouped key/value heads and SDPA, the keys and values repeated per
    query head (the kernel that takes a mask has no grouped form) are kept for backward by every block that is
    not recomputed: counted here for the whole span, which leaves the peak at the forward's end unchanged."""
    packed = packs_chat(cfg)  # packed chat windows: the same mask, positions restarting
    if not cfg.data.document_mask and not packed:
        return 0
    m = cfg.model
    size = 2 if cfg.train.precision in ("bf16", "bf16-autocast", "fp16-autocast") else 4
    restart = cfg.data.document_positions or packed
    angles = 2 * batch * seq * m.head_width * 4 if restart and m.pos_emb == "rope" else 0
    if docmask_flex(cfg, cuda):
        return angles + block_mask_bytes(batch, seq)
    mask = batch * seq * seq * (1 if m.attention == "manual" else size)
    repeated = 0
    if cuda and m.attention == "sdpa" and m.kv_heads < m.n_head:
        kept = cfg.model.n_layer - sum(checkpointed_blocks(m.n_layer, cfg.memory.activation_checkpointing))
        tp = max(1, cfg.parallel.tp)
        repeated = kept * 2 * batch * seq * (m.n_head - m.kv_heads) // tp * m.head_width * size
    return mask + angles + repeated


def docmask_attention_seconds(seconds: float, cfg: C.Config, batch: int, seq: int, hbm_bytes_s: float,
                              cuda: bool = True, backward: bool = False, cc: tuple = (8, 0)) -> float:
    """A fused attention kernel's seconds (forward or backward, causal: the half of T x T the flash kernel
    computes) with ``data.document_mask``: the whole T x T computed (twice the time) plus one read of the
    additive mask (module doc); with FlexAttention (:func:`docmask_flex`) the share of the causal tiles its block
    mask keeps (packed chat windows: :func:`tokenmill.estimate.sft.packed_tile_share`; other documents are not
    read here: all of them) at FlexAttention's published speed relative to FlashAttention-2's
    (:data:`tokenmill.estimate.attention.FLEX_VS_FA2`, on a GPU of compute capability ``cc``)."""
    if not (cfg.data.document_mask or packs_chat(cfg)) or cfg.model.attention != "sdpa":
        return seconds
    if docmask_flex(cfg, cuda):
        from tokenmill.estimate.attention import FLEX_VS_FA2, arch
        from tokenmill.estimate.sft import packed_tile_share

        return seconds * packed_tile_share(cfg) / FLEX_VS_FA2[arch(cc)][1 if backward else 0]
    low = cfg.train.precision in ("bf16", "bf16-autocast", "fp16-autocast")
    return 2.0 * seconds + batch * seq * seq * (2 if low else 4) / hbm_bytes_s


def nf4_base_bytes(cfg: C.Config, vocab: int, rank: int) -> tuple[int, int, int]:
    """(bytes of the NF4 base's weights at the weights' width, their bytes as NF4, the largest one's transient
    bytes: its dequantised copy in the forward beside its int32 codes, 2 bytes a weight: model/nf4.py
    nf4_dequantize) for ``cfg``'s ``lora.targets`` at ``rank`` (QLoRA,
    ``lora.quantize_base = 'nf4'``): the NF4 weights ``model/lora.py`` makes (:func:`~tokenmill.model.lora.nf4_weights`:
    every block projection, and each adapted routed experts' stack as one tensor), counted on one block of each kind
    (``model/build.py lora_on_meta``)."""
    from tokenmill.model.build import lora_on_meta
    from tokenmill.model.lora import nf4_bytes, nf4_weights

    lo = C.LoraConfig(**{**cfg.lora.__dict__, "rank": rank, "quantize_base": "nf4"})
    model, counts = lora_on_meta(cfg.model, vocab, lo)
    sizes = [(k, n) for n, block in zip(counts, model.blocks) for k, _ in nf4_weights(block)]  # (elements, blocks)
    width = 2 if C.concrete(cfg, "cuda").train.precision == "bf16" else 4
    return (width * sum(k * n for k, n in sizes), sum(n * nf4_bytes(k) for k, n in sizes),
            max(k for k, _ in sizes) * (width + 2))


def offload_stall_seconds(fwd_s: list[float], bwd_s: list[float], sizes: list[list[int]], link_bytes_s: float) -> float:
    """Seconds the compute waits for activation offloading's copies in one forward and backward (module doc), tensor
    by tensor as the trainer's hooks move them. ``fwd_s``, ``bwd_s``, ``sizes``: each piece's forward and backward
    GPU seconds and the bytes of each tensor it offloads, in forward order; a piece's tensors are saved evenly
    through its forward and read evenly through its backward, the last saved first."""
    t = free = 0.0
    landed: list[float] = []  # when each tensor is on the host
    for g, piece in zip(fwd_s, sizes):
        for b in piece:
            if len(landed) > IN_FLIGHT:  # the last save waited for the copy IN_FLIGHT before it
                t = max(t, landed[-IN_FLIGHT - 1])
            t += g / len(piece)
            free = max(free, t) + b / link_bytes_s
            landed.append(free)
        t += 0.0 if piece else g
    flat = [b for piece in sizes for b in piece]
    kept = {i for i, at in enumerate(landed) if at > t}  # still going down when the forward ended
    back: dict[int, float] = {}  # tensor -> when it is on the device again
    free, lowest, i = 0.0, len(flat), len(flat)
    for k in reversed(range(len(fwd_s))):
        if not sizes[k]:
            t += bwd_s[k]
        for _ in sizes[k]:
            i -= 1
            if i not in kept and i not in back:
                free = back[i] = max(free, t, landed[i]) + flat[i] / link_bytes_s
                lowest = min(lowest, i)
            ahead = sum(flat[j] for j in back if j < i)
            j = min(i, lowest) - 1
            while j >= 0 and ahead < (1 if i in kept else flat[i]):  # the tensors saved just before come next
                if j not in kept:
                    free = back[j] = max(free, t, landed[j]) + flat[j] / link_bytes_s
                    ahead, lowest = ahead + flat[j], j
                j -= 1
            t = max(t, back.pop(i, t)) + bwd_s[k] / len(sizes[k])
    return t - sum(fwd_s) - sum(bwd_s)
