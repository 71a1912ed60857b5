"""Where the memory peak of one Lit-GPT QLoRA step (bitsandbytes NF4, no checkpointing) falls, and what is alive there.

What it measures: one training step (forward, chunked loss, backward, AdamW over the adapters) of a Llama 2 model at
its real widths but only ``--layers`` blocks, built the way Lit-GPT (commit 8641822) builds it for
``finetune/lora.py --quantize bnb.nf4-dq --precision bf16-true``, run on the CPU under ``torch.profiler`` with
``profile_memory=True``. Every CPU allocation and free of the step is read back in time order (the profiler's
``[memory]`` events, each with its byte delta, pointer, timestamp and the op it happened inside), so the running
total of the bytes the step holds is known at every allocation, relative to the bytes alive before the forward (the
built model). Named marks (zero-length ``record_function`` ranges, fired from module forward pre-hooks, full backward
pre-hooks and the loop) split the step into phases ('forward block 1 mlp', 'forward head chunk 3', 'loss chunk 3',
'backward head chunk 10', 'backward block 0 attn', ...). The report gives the peak, its phase, the largest tensors
alive at it (size, phase and op chain that made them), whether a dequantised head weight (32000 x width, 2 bytes an
element) is among them, the running total when the backward starts and when the first head backward starts, and the
maximum of every phase with its distance below the peak.

Why: to locate, from the source's own code path, where a bitsandbytes QLoRA step's peak falls. The question is whether
a Lit-GPT QLoRA step without checkpointing peaks in the head's backward, where bitsandbytes holds its dequantised
bf16 head (32000 x 4096 x 2 B = 250 MiB for 7B) beside the 4-bit one. Which tensors are alive at once is decided by
the code (what each op and autograd node keeps, what the caller keeps), not by the device, so the CPU answers it.
Depth: every phase from the last block's forward through the head and loss to the last block's backward holds the
saved activations of all blocks, so adding blocks lifts those phases equally and cannot change which of them is
highest; the phases of earlier blocks hold only part of them and fall further behind with depth. 'kept per block' in the
report is the slope, for whoever wants to extrapolate to 32 (7B) or 40 (13B) layers.

Run (bitsandbytes is not a tokenmill dependency; the script exits with a message if it is missing, except --plain):

    python benchmarks/validation/bnb_peak.py                       # 7B widths, 2 layers, installed bitsandbytes
    python benchmarks/validation/bnb_peak.py --size 13b            # 13B widths (5120, 13824, 40 heads)
    python benchmarks/validation/bnb_peak.py --plain               # control: frozen bf16 nn.Linear, no bitsandbytes
    python benchmarks/validation/bnb_peak.py --emulate-0411        # the matmul with bitsandbytes 0.41.1's lifetimes
    python benchmarks/validation/bnb_peak.py --steps 2             # two steps, Lit-GPT's variable lifetimes between

On two AVX2 cores (2 layers, one step): 7B 2.8 min and 3.1 GiB of RAM with bitsandbytes, 1.2 min and 3.3 GiB
plain; 13B 4.9 min and 3.8 GiB, 1.6 min and 4.3 GiB; 7B --emulate-0411 --steps 2: 2.7 min, 3.7 GiB.

The model, as read in the source (our own code below, written to make the same tensors in the same order):
  * Lit-GPT 8641822, lit_gpt/model.py (Block, CausalSelfAttention, LLaMAMLP, build_rope_cache, apply_rope),
    lit_gpt/lora.py (GPT.forward with lm_head_chunk_size, LoRAQKVLinear, LoRALinear), lit_gpt/rmsnorm.py,
    lit_gpt/utils.py (chunked_cross_entropy), finetune/lora.py (r 8, alpha 16, dropout 0.05 on q and v;
    ``logits = model(input_ids, lm_head_chunk_size=128)``; ``logits[-1] = logits[-1][..., :-1, :]``;
    ``loss = chunked_cross_entropy(logits, targets[..., 1:])``; ``logits`` and ``loss`` stay bound until the next
    iteration rebinds them; bnb.optim.PagedAdamW over the LoRA parameters):
    https://github.com/Lightning-AI/litgpt/blob/8641822b3249bb94f068c254aa5d13decbc9f0a0/lit_gpt/model.py
    https://github.com/Lightning-AI/litgpt/blob/8641822b3249bb94f068c254aa5d13decbc9f0a0/lit_gpt/lora.py
    https://github.com/Lightning-AI/litgpt/blob/8641822b3249bb94f068c254aa5d13decbc9f0a0/lit_gpt/rmsnorm.py
    https://github.com/Lightning-AI/litgpt/blob/8641822b3249bb94f068c254aa5d13decbc9f0a0/lit_gpt/utils.py
    https://github.com/Lightning-AI/litgpt/blob/8641822b3249bb94f068c254aa5d13decbc9f0a0/finetune/lora.py
    Details that change which tensors exist: RMSNorm computes in bf16 (no float upcast); the RoPE cache is fp16 under
    bf16-true (build_rope_cache returns ``.half()``), so ``x * cos`` promotes to fp32 temporaries; q, k, v are
    reshaped out of the permuted fused qkv (copies); the LoRA branch is dropout -> linear(lora_A) -> grouped conv1d
    (lora_B) -> zero_pad (new_zeros + index_copy into the 3C-wide output) -> * scaling -> added to the base output.
  * Lightning 71aed751 (pinned by Lit-GPT 8641822), src/lightning/fabric/plugins/precision/bitsandbytes.py:
    BitsandbytesPrecision('nf4-dq', bf16) replaces every nn.Linear (the lm_head too) by _NF4DQLinear (Linear4bit,
    nf4, compress_statistics=True, blocksize 64), quantised from the weight cast to fp16 (``.to(dtype=torch.half)``,
    so the quant state's dtype is fp16), compute dtype bf16:
    https://github.com/Lightning-AI/lightning/blob/71aed751f7f0ca8422ddca256e602099070f490b/src/lightning/fabric/plugins/precision/bitsandbytes.py
  * bitsandbytes 0.41.1 (commit 18e827d "Version 0.41.1."), bitsandbytes/autograd/_functions.py MatMul4Bit and
    matmul_4bit, bitsandbytes/nn/modules.py Linear4bit.forward, bitsandbytes/functional.py dequantize_4bit:
    https://github.com/bitsandbytes-foundation/bitsandbytes/blob/18e827d666fa2b70a12d539ccedc17aa51b2c97c/bitsandbytes/autograd/_functions.py
    https://github.com/bitsandbytes-foundation/bitsandbytes/blob/18e827d666fa2b70a12d539ccedc17aa51b2c97c/bitsandbytes/functional.py
  * bitsandbytes 0.50.2 as installed (site-packages/bitsandbytes/autograd/_functions.py, backends/cpu/ops.py,
    backends/default/ops.py, functional.py, nn/modules.py).

What the matmul does, 0.41.1 (CUDA, the source) against 0.50.2 (CPU, measured here):
  * 0.41.1 forward: for any input with more than one row, MatMul4Bit: dequantise the whole weight to the quant
    state's dtype (fp16, Lightning quantised from fp16), cast that to bf16 (a second full copy, both alive during
    the cast), linear. It keeps ``ctx.tensors = (A, B)`` when the input needs grad: A, the layer's input, is held as a
    plain ctx attribute, which autograd does not release after the node's backward; it lives until the graph is
    freed (checked here: see the self-test), i.e. until ``loss`` and ``logits`` are rebound in the next iteration.
    0.41.1 backward: dequantise again to fp16, cast to bf16 (two full copies again), matmul.
  * 0.50.2 CPU forward: when the input needs no grad, no autograd node: the ``bitsandbytes::gemm_4bit`` op, whose CPU
    kernel is the default one (no CPU-specific gemm_4bit: dequantise the nested absmax to fp32, dequantise the weight
    straight to the input's dtype, bf16, one full copy, then F.linear); when it needs grad, MatMul4Bit, which calls
    the same op and keeps only ``(None, B)``: the input A is NOT kept. 0.50.2 backward: ``dequantize_4bit`` to the
    quant state's dtype (fp16) and ``.to(bf16)``: two full copies, as in 0.41.1. The gemv fast path (``gemv_4bit``,
    AVX512-BF16 packed weights) is taken only in eval mode with an input that needs no grad, never in training (and
    this machine has no AVX512). On CUDA, 0.50.2's gemm_4bit picks, per GPU architecture and shape, a fused 4-bit
    GEMM (no full dequantised weight) for up to 1536 rows or the same dequantise-then-linear fallback, so its CUDA
    forward may hold less than either the CPU path or 0.41.1; its backward is the same two full copies everywhere.
  * ``--emulate-0411`` swaps in our own autograd function with 0.41.1's lifetimes (fp16 dequantisation, bf16 cast,
    A kept as a ctx attribute, used for every input) calling the installed ``bitsandbytes.functional.dequantize_4bit``.

Limits:
  * The CPU path of bitsandbytes 0.50.2, not the CUDA kernels of 0.41.1: the differences are the ones listed above.
    Only memory from PyTorch's CPU allocator is counted (every tensor, bitsandbytes' outputs and its fp32 absmax
    included); library scratch outside it (oneDNN here, cuBLAS workspaces there) is not. Sizes of tensors are the
    same on both devices, but the CUDA caching allocator rounds every block up to a multiple of 512 B and
    max_memory_allocated counts the rounded sizes; that rounding is not here (it is small for these tensors).
  * Speed workaround: large bf16 matmuls outside bitsandbytes' own op run in fp32 scratch that is not counted (see
    FastCpuMatmul; ``--exact-mm`` turns it off and takes hours at these widths).
  * Attention is torch's CPU SDPA (the CPU flash kernel in bf16: output and fp32 logsumexp saved), not flash-attn 2
    or torch 2.1's CUDA flash kernel; those save the same output and logsumexp, but their backward workspaces
    differ.
  * Only ``--layers`` blocks (the report gives the per-block slope); random weights; the optimizer is torch's AdamW
    stepped every step, not bnb.optim.PagedAdamW stepped every gradient_accumulation_iters micro-steps (paged states
    live in CUDA managed memory that max_memory_allocated does not count; the adapters' states and gradients are
    tiny either way). Lit-GPT's loss / gradient_accumulation_iters is a scalar and is left out.
  * ``--steps 2`` feeds 1304 tokens to every step; the source feeds the longest sample (1304) only to iteration 0
    (get_batch(..., longest_seq_ix if iter_num == 0 else None)) and random, mostly shorter, samples after it, so a
    second step here is an upper bound on what a previous step's leftovers add to the next one.
  * Frees of tensors allocated before the profiler started are not reported by it; everything the step makes is
    made inside the window, and the model is built and collected before it opens.
"""

from __future__ import annotations

import argparse
import gc
import math
import resource
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import TorchDispatchMode

try:  # not a tokenmill dependency; only the default and --emulate-0411 modes need it
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF
except ImportError:  # pragma: no cover - depends on the environment
    bnb = bnbF = None

MiB = 2**20
VOCAB = 32_000  # Llama 2 (padded_vocab_size 32000 in lit_gpt/config.py)
SIZES = {  # n_embd, n_head (= n_query_groups: no GQA), intermediate_size
    "7b": (4096, 32, 11008),
    "13b": (5120, 40, 13824),
}
SEQ = 1304  # micro-batch 1 x 1304 tokens (the longest Alpaca sample in the source's table)
HEAD_CHUNK = 128  # lm_head_chunk_size in finetune/lora.py
LORA_R, LORA_ALPHA, LORA_DROPOUT = 8, 16, 0.05
NORM_EPS = 1e-5
DTYPE = torch.bfloat16


# --------------------------------------------------------------------------------------------------------------------
# Marks: zero-length record_function ranges; the profiler gives each a timestamp on the same clock as the [memory]
# events, so every allocation belongs to the last mark before it.
# --------------------------------------------------------------------------------------------------------------------

PREFIX = [""]  # "s1 " etc. when several steps are run
SCRATCH = "scratch:"  # ranges whose allocations the tracker leaves out (see FastCpuMatmul)
HEAD_BWD_ROWS: list[int] = []  # rows of each head-chunk gradient, in the order the head backwards ran


def bare(phase: str) -> str:
    """A phase's name without its step prefix."""
    head, _, rest = phase.partition(" ")
    return rest if head[:1] == "s" and head[1:].isdigit() else phase


def mark(name: str) -> None:
    with record_function("mark:" + PREFIX[0] + name):
        pass


# --------------------------------------------------------------------------------------------------------------------
# The tracker: reads the profiler's event tree after the run.
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class Alloc:  # one allocation, from its [memory] event to the matching free
    size: int
    phase: str
    chain: str
    i_alloc: int  # index in the time-ordered event list
    i_free: int | None = None


@dataclass
class Timeline:
    """Every CPU allocation/free of the profiled window in time order, with the running total and the phases."""

    peak: int = 0
    i_peak: int = -1
    phase_of_peak: str = ""
    blocks: list = field(default_factory=list)
    phases: dict = field(default_factory=dict)  # name -> [total at start, max inside, index of max, first index]
    phase_order: list = field(default_factory=list)
    totals: list = field(default_factory=list)
    n_events: int = 0
    final: int = 0  # bytes still alive at the end of the window

    @classmethod
    def from_profiler(cls, prof) -> Timeline:
        from torch._C._profiler import _EventType

        marks, mems = [], []  # (t_ns, dfs order, ...)
        order = 0
        stack = [(ev, False) for ev in reversed(prof.profiler.kineto_results.experimental_event_tree())]
        while stack:
            ev, scratch = stack.pop()
            order += 1
            if ev.tag == _EventType.TorchOp and ev.name.startswith("mark:"):
                marks.append((ev.start_time_ns, order, ev.name[5:]))
            elif ev.tag == _EventType.Allocation:
                f = ev.extra_fields
                if f.device.type == "cpu" and f.alloc_size != 0:
                    mems.append((ev.start_time_ns, order, f.alloc_size, f.ptr, ev, scratch))
            scratch = scratch or (ev.tag == _EventType.TorchOp and ev.name.startswith(SCRATCH))
            stack.extend((c, scratch) for c in reversed(ev.children))
        marks.sort()
        mems.sort(key=lambda m: (m[0], m[1]))
        # Allocations inside a SCRATCH range (the CPU-only fp32 matmul workaround below) and their frees are dropped.
        scratch_ptrs: set[int] = set()
        kept = []
        for m in mems:
            if m[5] and m[2] > 0:
                scratch_ptrs.add(m[3])
            elif m[2] < 0 and m[3] in scratch_ptrs:
                scratch_ptrs.discard(m[3])
            else:
                kept.append(m[:5])
        mems = kept

        tl = cls()
        tl.n_events = len(mems)
        phase, j, now = "(before first mark)", 0, 0
        tl.phase_order.append(phase)
        tl.phases[phase] = [0, 0, -1, 0]
        open_by_ptr: dict[int, Alloc] = {}
        for i, (t, _, size, ptr, ev) in enumerate(mems):
            while j < len(marks) and marks[j][0] <= t:  # phases entered before this event (maybe several)
                phase = marks[j][2]
                j += 1
                if phase not in tl.phases:
                    tl.phase_order.append(phase)
                    tl.phases[phase] = [now, now, -1, i]
            now += size
            tl.totals.append(now)
            if size > 0:
                b = Alloc(size, phase, _chain(ev), i)
                tl.blocks.append(b)
                open_by_ptr[ptr] = b
            else:
                b = open_by_ptr.pop(ptr, None)
                if b is not None:
                    b.i_free = i
            st = tl.phases[phase]
            if now > st[1] or st[2] < 0:
                st[1], st[2] = max(now, st[1]), i
            if now > tl.peak:
                tl.peak, tl.i_peak, tl.phase_of_peak = now, i, phase
        for _, _, name in marks[j:]:  # marks after the last memory event
            if name not in tl.phases:
                tl.phase_order.append(name)
                tl.phases[name] = [now, now, -1, len(mems)]
        tl.final = now
        return tl

    def alive_at(self, i: int) -> list:
        return [b for b in self.blocks if b.i_alloc <= i and (b.i_free is None or b.i_free > i)]


def _chain(ev) -> str:
    """The ops enclosing an allocation, outermost first, without our marks; autograd nodes shortened."""
    names = []
    p = ev.parent
    while p is not None:
        n = p.name
        n = n.replace("autograd::engine::evaluate_function: ", "bwd:")
        if not n.startswith("mark:") and n != "PythonDispatchMode" and not (names and names[-1] == n):
            names.append(n)
        p = p.parent
    names.reverse()
    if len(names) > 4:
        names = names[:2] + ["..."] + names[-2:]
    return " > ".join(names) or "(no op: freed/allocated outside an op)"


class FastCpuMatmul(TorchDispatchMode):
    """A CPU-only speed workaround that changes nothing the tracker counts.

    On a CPU without AVX512-BF16, torch's bf16 ``mm`` whose right operand is row-major (every backward
    ``grad_output @ W``, bitsandbytes' included) runs a scalar loop: 47 s for 128 x 11008 x 4096 on one core, so a
    step would take hours. Large bf16 ``aten::mm`` calls that reach this mode (not those inside bitsandbytes' own
    ``gemm_4bit`` op, which the mode does not see) are therefore computed in fp32 inside a SCRATCH range and copied
    into a bf16 output allocated outside it: the output (the only tensor the real kernel allocates, contiguous
    M x N bf16, as here) is counted, the fp32 temporaries are not. ``--exact-mm`` turns it off; on a reduced model
    (widths 256/688, vocabulary 2000, 2 layers, all three modes) both gave the same peak, phase of the peak, tensors
    alive at it and per-phase figures to the byte (the optimizer phase's maximum differed by 8 bytes).
    """

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.mm.default and not kwargs:
            a, b = args
            if (a.dtype == b.dtype == torch.bfloat16 and a.device.type == "cpu"
                    and a.shape[0] * a.shape[1] * b.shape[1] >= 1 << 20):
                out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype)
                with record_function(SCRATCH + "fp32 mm"), torch.no_grad():
                    out.copy_(torch.mm(a.float(), b.float()))
                self.calls += 1
                return out
        return func(*args, **kwargs)


def profiled(fn, fast_mm: bool = False):
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=False) as prof:
        if fast_mm:
            with FastCpuMatmul() as mode:
                fn()
            print(f"[fp32 scratch matmuls: {mode.calls}]", file=sys.stderr, flush=True)
        else:
            fn()
    return Timeline.from_profiler(prof)


# --------------------------------------------------------------------------------------------------------------------
# bitsandbytes layers: quantised as Lightning 71aed751 does (from the fp16 cast of the weight), and the 0.41.1 matmul
# lifetimes as our own autograd function.
# --------------------------------------------------------------------------------------------------------------------


def quantised_linear(weight: torch.Tensor, emulate_0411: bool) -> nn.Module:
    out_f, in_f = weight.shape
    cls = Linear4bit0411 if emulate_0411 else bnb.nn.Linear4bit
    lin = cls(in_f, out_f, bias=False, compute_dtype=DTYPE, compress_statistics=True, quant_type="nf4", device="meta")
    w16 = weight.contiguous().to(dtype=torch.half)  # Lightning's _quantize_weight: .to(device="cuda", dtype=torch.half)
    packed, state = bnbF.quantize_4bit(w16, blocksize=64, compress_statistics=True, quant_type="nf4")
    del w16
    lin.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=64,
                                   compress_statistics=True, quant_type="nf4", bnb_quantized=True)
    return lin


class _MatMul4bit0411(torch.autograd.Function):
    """bitsandbytes 0.41.1's MatMul4Bit lifetimes (our code): the weight dequantised to the quant state's dtype (fp16)
    and cast to the input's dtype in forward and again in backward; the input kept as a ctx attribute (not
    save_for_backward) when it needs grad, so it outlives the node's backward until the graph is freed."""

    @staticmethod
    def forward(ctx, A, packed, state):
        out = F.linear(A, bnbF.dequantize_4bit(packed, state).to(A.dtype))
        ctx.state = state
        ctx.tensors = (A, packed) if ctx.needs_input_grad[0] else (None, None)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        _, packed = ctx.tensors
        grad_A = torch.matmul(grad_output, bnbF.dequantize_4bit(packed, ctx.state).to(grad_output.dtype))
        return grad_A, None, None


if bnb is not None:

    class Linear4bit0411(bnb.nn.Linear4bit):
        def forward(self, x):
            return _MatMul4bit0411.apply(x.to(self.compute_dtype), self.weight, self.weight.quant_state)

else:
    Linear4bit0411 = None


# --------------------------------------------------------------------------------------------------------------------
# The model (Lit-GPT 8641822's LoRA GPT for Llama 2, as read; our own code).
# --------------------------------------------------------------------------------------------------------------------


def frozen_weight(out_f: int, in_f: int) -> torch.Tensor:
    return torch.empty(out_f, in_f, dtype=DTYPE).normal_(0.0, 0.02)


def make_linear(in_f: int, out_f: int, mode: str) -> nn.Module:
    w = frozen_weight(out_f, in_f)
    if mode == "plain":
        lin = nn.Linear(in_f, out_f, bias=False, device="meta", dtype=DTYPE)
        lin.weight = nn.Parameter(w, requires_grad=False)
        return lin
    return quantised_linear(w, emulate_0411=(mode == "0411"))


class RMSNorm(nn.Module):  # lit_gpt/rmsnorm.py at 8641822: in the input's dtype, weight frozen by LoRA
    def __init__(self, size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=DTYPE), requires_grad=False)

    def forward(self, x):
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(norm_x + NORM_EPS))


class LoRAQKV(nn.Module):
    """The fused q/k/v projection with LoRA on q and v (LoRAQKVLinear, n_head == n_query_groups)."""

    def __init__(self, C: int, mode: str):
        super().__init__()
        self.linear = make_linear(C, 3 * C, mode)
        self.C = C
        self.lora_A = nn.Parameter(torch.empty(2 * LORA_R, C, dtype=DTYPE))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(2 * C, LORA_R, dtype=DTYPE))
        self.dropout = nn.Dropout(LORA_DROPOUT)
        self.scaling = LORA_ALPHA / LORA_R
        self.lora_ind = list(range(0, C)) + list(range(2 * C, 3 * C))  # q and v columns of the fused output

    def forward(self, x):
        base = self.linear(x)
        a = F.linear(self.dropout(x), self.lora_A)  # (B, T, 2r)
        b = F.conv1d(a.transpose(-2, -1), self.lora_B.unsqueeze(-1), groups=2).transpose(-2, -1)  # (B, T, 2C)
        # zero_pad: scatter the q and v updates into a zero (B, T, 3C) tensor (via a (T, B, .) transpose as the source)
        bt = b.transpose(0, 1)
        padded = bt.new_zeros((*bt.shape[:-1], 3 * self.C)).view(-1, 3 * self.C)
        padded = padded.index_copy(1, torch.tensor(self.lora_ind), bt.reshape(-1, 2 * self.C))
        padded = padded.view((*bt.shape[:-1], 3 * self.C)).transpose(0, 1)
        return base + padded * self.scaling


def rope_cache(T: int, hs: int):
    theta = 1.0 / (10000 ** (torch.arange(0, hs, 2) / hs))
    idx_theta = torch.outer(torch.arange(T) / 1, theta).repeat(1, 2)
    return torch.cos(idx_theta).half(), torch.sin(idx_theta).half()  # fp16 under bf16-true, as in the source


def apply_rope(x, cos, sin):
    hs = x.size(-1)
    rotated = torch.cat((-x[..., hs // 2:], x[..., : hs // 2]), dim=-1)
    return ((x * cos) + (rotated * sin)).type_as(x)  # bf16 * fp16 -> fp32 temporaries


class Attention(nn.Module):
    def __init__(self, C: int, n_head: int, mode: str):
        super().__init__()
        self.attn = LoRAQKV(C, mode)
        self.proj = make_linear(C, C, mode)  # LoRALinear with r=0 (lora_projection False)
        self.n_head, self.hs = n_head, C // n_head

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        qkv = self.attn(x).view(B, T, self.n_head, 3, self.hs).permute(0, 2, 3, 1, 4)
        q, k, v = qkv.split((1, 1, 1), dim=2)
        q, k, v = (t.reshape(B, -1, T, self.hs) for t in (q, k, v))
        q = torch.cat((apply_rope(q, cos, sin), q[..., self.hs:]), dim=-1)  # rope_n_elem == head_size
        k = torch.cat((apply_rope(k, cos, sin), k[..., self.hs:]), dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=1.0 / math.sqrt(self.hs), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):  # LLaMAMLP
    def __init__(self, C: int, ffn: int, mode: str):
        super().__init__()
        self.fc_1, self.fc_2 = make_linear(C, ffn, mode), make_linear(C, ffn, mode)
        self.proj = make_linear(ffn, C, mode)

    def forward(self, x):
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class Block(nn.Module):
    def __init__(self, C: int, n_head: int, ffn: int, mode: str):
        super().__init__()
        self.norm_1, self.attn = RMSNorm(C), Attention(C, n_head, mode)
        self.norm_2, self.mlp = RMSNorm(C), MLP(C, ffn, mode)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class GPT(nn.Module):
    def __init__(self, size: str, layers: int, mode: str):
        super().__init__()
        C, n_head, ffn = SIZES[size]
        self.C = C
        self.wte = nn.Embedding(VOCAB, C, dtype=DTYPE)
        self.wte.weight.requires_grad_(False)
        nn.init.normal_(self.wte.weight, 0.0, 0.02)
        self.h = nn.ModuleList(Block(C, n_head, ffn, mode) for _ in range(layers))
        self.ln_f = RMSNorm(C)
        self.lm_head = make_linear(C, VOCAB, mode)  # LoRALinear r=0 (lora_head False): a quantised Linear under bnb
        cos, sin = rope_cache(SEQ, C // n_head)  # model.max_seq_length = longest_seq_length in train()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x, self.cos, self.sin)
        x = self.ln_f(x)
        return [self.lm_head(x_i) for x_i in x.split(HEAD_CHUNK, dim=1)]


def chunked_cross_entropy(logits: list, targets: torch.Tensor) -> torch.Tensor:
    """lit_gpt/utils.py chunked_cross_entropy, list branch, chunk_size 128: one CE per head chunk, then the mean."""
    logit_chunks = [c.reshape(-1, c.size(-1)) for c in logits]
    target_chunks = [t.reshape(-1) for t in targets.split(logits[0].size(1), dim=1)]
    losses = []
    for k, (lc, tc) in enumerate(zip(logit_chunks, target_chunks)):
        mark(f"loss chunk {k}")
        losses.append(F.cross_entropy(lc, tc, ignore_index=-1, reduction="none"))
    mark("loss mean")
    return torch.cat(losses).mean()


def add_marks(model: GPT) -> None:
    """Forward pre-hooks and full backward pre-hooks that name the phases. A full backward pre-hook fires when the
    gradient of the module's output is ready, right before the module's own backward nodes run."""
    n_chunks = -(-SEQ // HEAD_CHUNK)
    head_calls = {"fwd": 0, "bwd": 0}

    def fwd(name):
        return lambda m, args: mark("forward " + name)

    def bwd(name):
        return lambda m, grad_output: mark("backward " + name)

    model.wte.register_forward_pre_hook(fwd("embedding"))
    for i, b in enumerate(model.h):
        b.norm_1.register_forward_pre_hook(fwd(f"block {i} attn"))
        b.norm_2.register_forward_pre_hook(fwd(f"block {i} mlp"))
        b.mlp.register_full_backward_pre_hook(bwd(f"block {i} mlp"))
        b.norm_2.register_full_backward_pre_hook(bwd(f"block {i} norm_2"))
        b.attn.register_full_backward_pre_hook(bwd(f"block {i} attn"))
        b.norm_1.register_full_backward_pre_hook(bwd(f"block {i} norm_1"))  # never fires in block 0 (no grad)
    model.ln_f.register_forward_pre_hook(fwd("ln_f"))
    model.ln_f.register_full_backward_pre_hook(bwd("ln_f"))

    def head_fwd(m, args):
        mark(f"forward head chunk {head_calls['fwd'] % n_chunks}")
        head_calls["fwd"] += 1

    def head_bwd(m, grad_output):
        # autograd runs ready nodes by decreasing sequence number: the last chunk's head first (checked in the
        # report by the rows of the first gradient: the last chunk has SEQ % 128 rows, the others 128)
        mark(f"backward head chunk {n_chunks - 1 - head_calls['bwd'] % n_chunks}")
        HEAD_BWD_ROWS.append(grad_output[0].shape[1])
        head_calls["bwd"] += 1

    model.lm_head.register_forward_pre_hook(head_fwd)
    model.lm_head.register_full_backward_pre_hook(head_bwd)


# --------------------------------------------------------------------------------------------------------------------
# Self-test of the tracker (known tensors), and what the installed bitsandbytes does in one training matmul.
# --------------------------------------------------------------------------------------------------------------------


def self_test(mode: str) -> list[str]:
    lines = []

    def trivial():
        mark("t:a")
        a = torch.empty(1_000_000, dtype=torch.uint8)
        b = torch.empty(3_000_000, dtype=torch.uint8)
        del a
        mark("t:b")
        c = torch.empty(2_000_000, dtype=torch.uint8)
        del b, c
        mark("t:end")

    tl = profiled(trivial)
    alive = sorted((b.size for b in tl.alive_at(tl.i_peak)), reverse=True)
    ok = (tl.peak == 5_000_000 and tl.phase_of_peak == "t:b" and alive == [3_000_000, 2_000_000]
          and tl.phases["t:a"][1] == 4_000_000 and tl.phases["t:b"][0] == 3_000_000 and tl.final == 0)
    if not ok:
        sys.exit(f"tracker self-test failed: peak {tl.peak} in {tl.phase_of_peak!r}, alive {alive}, phases {tl.phases}")
    lines.append("tracker self-test: 1 MB + 3 MB, free 1 MB, + 2 MB: peak 5,000,000 B in 't:b', alive [3 MB, 2 MB]: ok")

    # A ctx attribute outlives its node's backward (what 0.41.1's ctx.tensors = (A, B) does).
    class Keep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            ctx.kept = a  # a plain attribute, as 0.41.1's ctx.tensors
            return a.sum()

        @staticmethod
        def backward(ctx, g):
            return g * torch.ones_like(ctx.kept)

    def ctx_lifetime():
        x = torch.ones(1000, requires_grad=True)
        mark("t:forward")
        h = x * 3  # 4,000 B, kept only by the Function
        y = Keep.apply(h)
        del h
        mark("t:backward")
        y.backward()
        mark("t:backward done, then del y (frees the graph)")
        del y
        mark("t:end")

    tl = profiled(ctx_lifetime)
    kept = [b for b in tl.blocks if b.size == 4000 and b.phase == "t:forward"]
    where = _phase_of(tl, kept[0].i_free) if len(kept) == 1 else f"? ({len(kept)} candidates)"
    lines.append(f"ctx-attribute lifetime: a tensor kept as a ctx attribute is freed in phase '{where}'")

    if mode in ("bnb", "0411"):
        lin = make_linear(512, 256, mode)
        x = torch.randn(1, 64, 512, dtype=DTYPE, requires_grad=True)

        def one_matmul():
            mark("b:forward")
            y = lin(x)
            mark("b:backward")
            y.float().sum().backward()
            mark("b:end")

        tl = profiled(one_matmul)
        w = 256 * 512 * 2
        per = {p: [b.chain for b in tl.blocks if b.size == w and b.phase == p] for p in ("b:forward", "b:backward")}
        for p, chains in per.items():
            lines.append(f"one 4-bit training matmul ({'0.41.1 emulation' if mode == '0411' else 'installed ' + bnb.__version__}),"
                         f" {p[2:]}: {len(chains)} full-weight 2-byte copies: " + " | ".join(chains))
    return lines


def _phase_of(tl: Timeline, i: int | None) -> str:
    """The phase in which the i-th memory event happened."""
    if i is None:
        return "(never freed)"
    best = tl.phase_order[0]
    for name in tl.phase_order:  # in time order
        if tl.phases[name][3] <= i:
            best = name
    return best


# --------------------------------------------------------------------------------------------------------------------
# The step and the report.
# --------------------------------------------------------------------------------------------------------------------


def storage_bytes(model: nn.Module) -> int:
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            n += s.nbytes()
    for m in model.modules():  # quant states (absmax etc.) of the 4-bit layers
        st = getattr(getattr(m, "weight", None), "quant_state", None)
        if st is not None:
            for t in (st.absmax, st.code, getattr(st, "offset", None), getattr(getattr(st, "state2", None), "absmax", None)):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    n += t.untyped_storage().nbytes()
    return n


def run(args) -> None:
    mode = "plain" if args.plain else ("0411" if args.emulate_0411 else "bnb")
    if mode != "plain" and bnb is None:
        sys.exit("bitsandbytes is not installed (it is not a tokenmill dependency): pip install bitsandbytes, "
                 "or run with --plain for the bf16 control")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    C, n_head, ffn = SIZES[args.size]
    per_block = (4 * C * C + 3 * C * ffn) * (2 if mode == "plain" else 0.6)
    est = (per_block * args.layers + VOCAB * C * (4 if mode == "plain" else 2.6)) / 2**30 + 2.5
    if est > args.max_gib:
        sys.exit(f"estimated {est:.1f} GiB of RAM > --max-gib {args.max_gib}: use fewer --layers")

    lines = self_test(mode)
    t0 = time.time()
    model = GPT(args.size, args.layers, mode)
    model.train()
    add_marks(model)
    lora = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(lora, lr=3e-4, weight_decay=0.01)
    idx = torch.randint(0, VOCAB, (1, SEQ))
    targets = torch.randint(0, VOCAB, (1, SEQ))
    model_bytes = storage_bytes(model)
    print(f"[built in {time.time() - t0:.0f} s]", file=sys.stderr, flush=True)

    def steps():
        logits = loss = None  # Lit-GPT's loop: both stay bound until the next iteration rebinds them
        for s in range(args.steps):
            PREFIX[0] = f"s{s + 1} " if args.steps > 1 else ""
            t = time.time()
            logits = model(idx)
            logits[-1] = logits[-1][..., :-1, :]
            loss = chunked_cross_entropy(logits, targets[..., 1:])
            mark("backward start (CE chunks)")
            loss.backward()
            mark("optimizer step")
            opt.step()
            opt.zero_grad()  # set_to_none
            mark("after step (logits, loss still bound)")
            print(f"[step {s + 1}: {time.time() - t:.0f} s]", file=sys.stderr, flush=True)
        PREFIX[0] = ""
        del logits, loss
        mark("after the loop (graph freed)")

    tl = profiled(steps, fast_mm=not args.exact_mm)
    report(tl, args, mode, model_bytes, C, lines)


def report(tl: Timeline, args, mode: str, model_bytes: int, C: int, lines: list) -> None:
    def m(x):
        return f"{x / MiB:,.1f}"

    label = {"plain": "plain bf16 nn.Linear (frozen), control",
             "bnb": f"bitsandbytes {bnb.__version__ if bnb else '?'} Linear4bit NF4-DQ (installed CPU path)",
             "0411": "bitsandbytes NF4-DQ with 0.41.1's MatMul4Bit lifetimes (emulated)"}[mode]
    print(f"== bnb_peak: Llama 2 {args.size} widths, {args.layers} layers, 1 x {SEQ}, {label}, steps {args.steps}")
    for ln in lines:
        print("  " + ln)
    print(f"  model storages (params, buffers, quant states) before the step: {m(model_bytes)} MiB; "
          f"{tl.n_events} [memory] events; all figures below are MiB above that")
    alive = sorted(tl.alive_at(tl.i_peak), key=lambda b: -b.size)
    print(f"  PEAK: {m(tl.peak)} MiB in phase '{tl.phase_of_peak}'  (process max RSS "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB)")
    pre = "s1 " if args.steps > 1 else ""
    bs = tl.phases.get(pre + "backward start (CE chunks)")
    first_head = next((p for p in tl.phase_order if p.startswith(pre + "backward head chunk")), None)
    if bs:
        print(f"  at backward start: {m(bs[0])}; at the first head backward ('{first_head}'): "
              f"{m(tl.phases[first_head][0]) if first_head else 'n/a'}")
    head_w = VOCAB * C * 2
    dq = [b for b in alive if b.size == head_w]
    if mode == "plain":
        print(f"  dequantised head weight ({VOCAB} x {C} x 2 B = {m(head_w)} MiB) alive at peak: n/a (plain: none made); "
              f"tensors of that size alive: {len(dq)}")
    else:
        print(f"  dequantised head weight ({VOCAB} x {C} x 2 B = {m(head_w)} MiB) alive at peak: "
              f"{'YES, ' + str(len(dq)) + ' copy(ies): ' + ' | '.join(b.chain for b in dq) if dq else 'no'}")
    by_phase: dict[str, int] = {}
    for b in alive:
        key = "backward/optimizer" if bare(b.phase).startswith(("backward", "optimizer")) else "forward/loss"
        key = "the peak's own phase" if b.phase == tl.phase_of_peak else key
        key = ("previous steps, " if args.steps > 1 and not b.phase.startswith(tl.phase_of_peak.split()[0]) else "") + key
        by_phase[key] = by_phase.get(key, 0) + b.size
    print("  alive at peak, by the phase that made it: " + "; ".join(f"{k} {m(v)}" for k, v in by_phase.items()))
    print(f"  largest tensors alive at peak (of {len(alive)}):")
    for b in alive[: args.top]:
        print(f"    {m(b.size):>8} MiB  made in '{b.phase}'  by {b.chain}")
    blocks_fwd = [tl.phases.get(f"{pre}forward block {i} attn", [None])[0] for i in range(args.layers)]
    after = tl.phases.get(f"{pre}forward ln_f", [None])[0]
    if args.layers >= 2 and None not in blocks_fwd and after is not None:
        print(f"  kept per block (forward of block {args.layers - 1}: ln_f start - block start): "
              f"{m(after - blocks_fwd[-1])} MiB")
    print("  per phase: MiB at start / max inside / max below the peak  (head and loss chunks grouped: max over them)")
    groups: list[tuple[str, list[str]]] = []
    for p in tl.phase_order:
        g = p
        for word in ("head chunk", "loss chunk"):
            if word in p:
                g = p.split(word)[0] + word + "s"
        if groups and groups[-1][0] == g:
            groups[-1][1].append(p)
        else:
            groups.append((g, [p]))
    best_other = None
    for g, ps in groups:
        start = tl.phases[ps[0]][0]
        mx_p = max(ps, key=lambda p: tl.phases[p][1])
        mx = tl.phases[mx_p][1]
        which = f" (max in {mx_p.split()[-1]})" if len(ps) > 1 else ""
        star = "  <== PEAK" if tl.phase_of_peak in ps else ""
        print(f"    {g:<52} {m(start):>9} {m(mx):>9} {m(tl.peak - mx):>9}{which}{star}")
        if tl.phase_of_peak not in ps and (best_other is None or mx > best_other[1]):
            best_other = (g, mx)
    if best_other:
        print(f"  best other phase group: '{best_other[0]}' at {m(best_other[1])}, "
              f"{m(tl.peak - best_other[1])} MiB below the peak")
    single = max((p for p in tl.phase_order if p != tl.phase_of_peak), key=lambda p: tl.phases[p][1])
    print(f"  best other single phase: '{single}' at {m(tl.phases[single][1])}, "
          f"{m(tl.peak - tl.phases[single][1])} MiB below the peak")
    if HEAD_BWD_ROWS:
        print(f"  head backward order check: rows of the first head gradient {HEAD_BWD_ROWS[0]} "
              f"(chunk {-(-SEQ // HEAD_CHUNK) - 1} has {SEQ % HEAD_CHUNK or HEAD_CHUNK}), then {sorted(set(HEAD_BWD_ROWS[1:]))}")


def main() -> None:
    # block 0's attention has no input that needs grad; its full backward pre-hook still fires, with a warning
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--plain", action="store_true", help="frozen bf16 nn.Linear instead of bitsandbytes (control)")
    ap.add_argument("--emulate-0411", action="store_true", help="bitsandbytes 0.41.1's MatMul4Bit lifetimes")
    ap.add_argument("--steps", type=int, default=1, help="steps in one window, Lit-GPT's variable lifetimes between")
    ap.add_argument("--top", type=int, default=8, help="largest alive tensors listed")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--exact-mm", action="store_true", help="no fp32 scratch matmuls (hours per step on AVX2)")
    ap.add_argument("--max-gib", type=float, default=12.0, help="refuse to build a model estimated above this")
    args = ap.parse_args()
    if args.plain and args.emulate_0411:
        ap.error("--plain and --emulate-0411 exclude each other")
    run(args)


if __name__ == "__main__":
    main()
