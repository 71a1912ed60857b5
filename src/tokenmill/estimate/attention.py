"""How fast a fused attention kernel runs: FlashAttention-2's published throughput by sequence length and head
size, times the share of the SMs its grid keeps busy.

PyTorch's ``scaled_dot_product_attention`` runs FlashAttention-2's kernels on A100 and H100 (its flash backend,
picked first for bf16/fp16 inputs), eager and under torch.compile (Inductor calls it as it is). Their
throughput is published: the FlashAttention-2 release's forward + backward benchmark
(:data:`SOURCE_A100`, :data:`SOURCE_H100`: bar charts read by eye, to the integer they print), run by
``benchmarks/benchmark_flash_attention.py`` of :data:`BENCH_COMMIT`: batch x sequence = 16,384 tokens, hidden
2,048 (32 heads of 64 or 16 of 128), fp16, with the causal mask, TFLOP/s of forward + backward where the
forward counts ``4 B T^2 H D / 2`` FLOPs (causal) and the backward 2.5 times that. The estimator's recorder
counts attention's FLOPs the same way (:func:`tokenmill.estimate.recorder._attention_flops`), so one share of
the peak prices both passes: ``share = TFLOP/s / the benchmark GPU's dense fp16 peak``.

Between the measured sequence lengths the share is interpolated in log2(T), between head sizes 64 and 128
linearly in the head size; outside, it is held at the nearest measurement (below 512 tokens, an upper end: the
measured curve still falls there). GPUs other than A100 and H100 take the share of the nearest architecture
(compute capability 8.x: the A100's, 9.x and newer: the H100's; assumed, not measured).

The benchmark's grids fill every SM; a small batch does not: the forward runs one thread block per 128 query
rows of each (batch, head) (FlashAttention-2's ``flash_fwd_launch_template.h``: ``kBlockM = 128`` for head sizes
64 and 128), in waves over the SMs, so :func:`grid_fill` scales the share by the SMs the last wave leaves idle,
as :func:`tokenmill.estimate.roofline.quantization` does for matrix products.

FlexAttention (``data.document_mask`` or packed chat windows with ``model.document_attention`` flex) computes only
the 128 x 128 tiles of the causal triangle that hold a query and a key of one document (``create_block_mask``'s
block size; :func:`flex_tile_share` counts them from the windows' documents), at its published speed relative to
FlashAttention-2 (:data:`FLEX_VS_FA2`).

A published measurement whose software ran FlashAttention 1 (PyTorch 2.0 / 2.1's SDPA, flash-attn 1.x) is
estimated inside :func:`flash_generation` (1): the same figures' FlashAttention bars (:data:`FA1_CAUSAL_TFLOPS`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator

BENCH_COMMIT = "60499abcfda1fabd48e1b97341f4f888c66991a3"
_ASSETS = "https://github.com/Dao-AILab/flash-attention/blob/4f285b354796fb17df8636485b9a04df3ebbb7dc/assets/"
SOURCE_A100 = _ASSETS + "flash2_a100_fwd_bwd_benchmark.png"  # "A100 80GB SXM4", panels (c) and (d)
SOURCE_H100 = _ASSETS + "flash2_h100_fwd_bwd_benchmark.png"  # "H100 80GB SXM5", panels (c) and (d)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
# forward + backward TFLOP/s with the causal mask, by (architecture, head size), at SEQLENS
FA2_CAUSAL_TFLOPS: dict[tuple[str, int], tuple[int, ...]] = {
    ("a100", 64): (88, 119, 140, 156, 165, 171),
    ("a100", 128): (99, 133, 155, 173, 182, 189),
    ("h100", 64): (141, 192, 232, 257, 273, 284),
    ("h100", 128): (163, 221, 265, 294, 308, 328),
}
# the same figures' "FlashAttention" bars: FlashAttention 1, the kernel of PyTorch 2.0 and 2.1's SDPA flash backend
# (2.2 moved it to FlashAttention-2) and of the flash-attn 1.x package; tokenmill never runs it (its torch is newer),
# a published measurement may have: :func:`flash_generation`. Causal, forward + backward, at SEQLENS.
FA1_CAUSAL_TFLOPS: dict[tuple[str, int], tuple[int, ...]] = {
    ("a100", 64): (58, 70, 77, 87, 92, 97),
    ("a100", 128): (55, 62, 69, 76, 80, 83),
    ("h100", 64): (104, 123, 136, 138, 149, 156),
    ("h100", 128): (98, 109, 108, 126, 135, 137),
}
_FLASH_TABLES = {1: FA1_CAUSAL_TFLOPS, 2: FA2_CAUSAL_TFLOPS}
_GENERATION: contextvars.ContextVar[int] = contextvars.ContextVar("flash_generation", default=2)
# the same figures' "Pytorch" bars: the benchmark's standard attention (a baddbmm of the scores, the causal mask
# added, softmax, a bmm with the values; forward + backward, FLOPs counted as above), at SEQLENS[:5] (16k: out of
# memory), by (architecture, causal, head size): what MEMORY_EFFICIENCY is read from (estimate/bandwidth.py)
PYTORCH_TFLOPS: dict[tuple[str, bool, int], tuple[int, ...]] = {
    ("a100", True, 64): (15, 16, 17, 18, 18), ("a100", True, 128): (23, 28, 32, 32, 34),
    ("a100", False, 64): (36, 40, 43, 45, 46), ("a100", False, 128): (53, 67, 76, 79, 86),
    ("h100", True, 64): (26, 29, 31, 32, 32), ("h100", True, 128): (40, 50, 57, 61, 63),
    ("h100", False, 64): (62, 72, 81, 86, 87), ("h100", False, 128): (93, 120, 145, 160, 167),
}
BENCH_GPUS = {"a100": "a100-80gb", "h100": "h100-sxm"}  # the benchmark GPUs' keys in tokenmill's GPU table
BENCH_PEAK_TFLOPS = {"a100": 312.0, "h100": 989.4}  # dense fp16 tensor-core peaks of the benchmark GPUs
BLOCK_M = 128  # query rows per thread block of the forward kernel


def arch(cc: tuple) -> str:
    """The benchmark architecture whose figures stand for a GPU of compute capability ``cc`` (module doc)."""
    return "h100" if tuple(cc) >= (9, 0) else "a100"


def _along_seq(row: tuple[int, ...], seq: int) -> float:
    x = math.log2(min(max(seq, SEQLENS[0]), SEQLENS[-1]))
    xs = [math.log2(s) for s in SEQLENS]
    i = min(max(sum(v <= x for v in xs) - 1, 0), len(xs) - 2)
    w = (x - xs[i]) / (xs[i + 1] - xs[i])
    return row[i] + w * (row[i + 1] - row[i])


@contextlib.contextmanager
def flash_generation(version: int) -> Iterator[None]:
    """Within the block, fused attention runs at FlashAttention ``version``'s published throughput (1 or 2; 2
    outside any block, what tokenmill's SDPA runs): for a published measurement whose software ran FlashAttention
    1 (``flash_attention = 1`` in a validation case, :func:`tokenmill.estimate.validation.run_case`)."""
    if version not in _FLASH_TABLES:
        raise ValueError(f"FlashAttention version must be one of {sorted(_FLASH_TABLES)}, got {version!r}")
    token = _GENERATION.set(version)
    try:
        yield
    finally:
        _GENERATION.reset(token)


def fa2_share(cc: tuple, seq: int, head_dim: int) -> float:
    """Share of the dense bf16/fp16 peak FlashAttention-2's causal forward + backward reaches at sequence length
    ``seq`` and head size ``head_dim`` on a GPU of compute capability ``cc``, its grid full (module doc); inside
    :func:`flash_generation` (1), FlashAttention 1's."""
    a = arch(cc)
    table = _FLASH_TABLES[_GENERATION.get()]
    lo, hi = (_along_seq(table[(a, d)], seq) for d in (64, 128))
    w = (min(max(head_dim, 64), 128) - 64) / 64
    return (lo + w * (hi - lo)) / BENCH_PEAK_TFLOPS[a]


def grid_fill(batch_heads: int, seq: int, sm: int) -> float:
    """Share of the SMs the kernel's grid keeps busy: ``batch_heads x ceil(seq / BLOCK_M)`` thread blocks in waves
    of one block per SM (the last wave's idle SMs)."""
    if not sm:
        return 1.0
    blocks = batch_heads * -(-seq // BLOCK_M)
    waves = -(-blocks // sm)
    return blocks / (waves * sm)


def attention_efficiency(shape: tuple, cc: tuple, sm: int) -> float:
    """Share of the peak a fused causal attention of ``shape`` = (batch x heads, sequence, head size) runs at."""
    batch_heads, seq, head_dim = shape
    return fa2_share(cc, seq, head_dim) * grid_fill(batch_heads, seq, sm)


# FlexAttention's speed over FlashAttention-2's, (forward, backward), by architecture: "90% of FlashAttention2's
# performance in forward passes and 85% in backward passes" on A100s; on H100s "~25% faster than FlashAttention2"
# forward and "~3% faster" backward (D. Guessous, "FlexAttention: The Flexibility of PyTorch With the Performance
# of FlashAttention", NVIDIA GTC 2025 session abstract; the A100 figures also in pytorch.org/blog/flexattention)
FLEX_VS_FA2 = {"a100": (0.90, 0.85), "h100": (1.25, 1.03)}
FLEX_BLOCK = 128  # torch.nn.attention.flex_attention.create_block_mask's default BLOCK_SIZE


def flex_tile_share(windows: list[list[int]], seq: int) -> float:
    """Share of the causal triangle's ``FLEX_BLOCK``-tiles (query tile >= key tile) that FlexAttention computes
    when each window is cut into documents of the given lengths (summing to at most ``seq``; the rest of a window
    is one more document, as packed padding is): a tile is computed when one document holds a query of its row
    and a key of its column. The mean over ``windows``."""
    import numpy as np

    n = -(-seq // FLEX_BLOCK)
    causal = n * (n + 1) // 2
    if not windows:
        return 1.0
    total = 0
    for lengths in windows:
        tiles = np.zeros((n, n), dtype=bool)
        start = 0
        for length in list(lengths) + ([seq - sum(lengths)] if sum(lengths) < seq else []):
            if length <= 0:
                continue
            a, b = start // FLEX_BLOCK, (start + length - 1) // FLEX_BLOCK
            tiles[a : b + 1, a : b + 1] = True
            start += length
        total += int(np.tril(tiles).sum())
    return total / (causal * len(windows))
