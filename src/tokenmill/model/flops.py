"""Model FLOPs per token and GPU peak throughput, for model FLOPs utilisation (MFU).

MFU = tokens/s * flops_per_token / peak_flops. The FLOPs count the model's math (forward + backward,
no recomputation), so activation checkpointing does not raise MFU. Peaks are datasheet DENSE figures
(the "with sparsity" figures are twice these), per GPU.

The one FLOPs convention of tokenmill (every MFU it reports uses it)::

    flops_per_token = 6 * N + 12 * L * H * Q * T

N (:func:`flop_params`) = the parameters that take part in matmuls: every parameter of the blocks and
the final LayerNorm, plus the output head's matrix over the true vocabulary, counted ONCE. The token
and position embeddings are lookups (no matmul) and do not count. So a model with an untied head
counts exactly the FLOPs of the same shape with a tied head (the head's matmul is done once either
way), and vocabulary padding adds nothing (the padded columns are not model math, like recomputation).
Biases and LayerNorm weights (under 0.2% of N for GPT-2) are counted with the matmul weights, as in
nanoGPT and the PaLM paper's MFU. GPT-2 124M at T=1024: 855.2 MFLOP/token, tied or untied.

A mixture of experts (``model.moe_experts``) counts its ACTIVE parameters: each token runs through its
``model.moe_top_k`` routed experts (and the router and shared experts), so the other experts' weights are
left out of N; MFU then measures the math each token does, not the weights the model holds
(Qwen3-30B-A3B: N = 3.04B of its 30.5B parameters).
"""

from __future__ import annotations

import re

from tokenmill.config import ModelConfig

__all__ = ["flops_per_token", "flop_params", "PEAK_FLOPS", "peak_flops", "math_mode"]


def flop_params(cfg: ModelConfig, vocab_size: int) -> int:
    """N of :func:`flops_per_token` for a GPT of shape ``cfg`` over a ``vocab_size`` vocabulary.

    Every parameter except the token and position embeddings (lookups, no matmul), plus the head's
    ``vocab_size x n_embd`` matrix once, tied or not; padding rows (``model.vocab_pad_multiple``) are
    not counted. From the model's own parameter count (:func:`tokenmill.model.build.param_counts`), so it
    follows the model's layout (biases, norms, grouped k/v, SwiGLU's three matrices). With experts: the
    active parameters only (the routed experts a token skips are left out).
    """
    from tokenmill.model.build import param_counts  # build.py does not import this module: no cycle

    c = param_counts(cfg, vocab_size)
    return c.total - c.inactive - c.token_embedding - c.position_embedding - c.untied_head + vocab_size * cfg.n_embd


def flops_per_token(cfg: ModelConfig, n_flop_params: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): ``6*N + 12*L*H*Q*T``.

    ``n_flop_params`` = N, the matmul parameters: :func:`flop_params` (NOT ``GPT.num_params``, which
    counts the token embedding and, untied, the head again). 2 FLOPs per multiply-add forward, twice
    that backward. The second term is the attention scores and their weighted sum (q@k^T and att@v),
    L layers, H heads, head dim Q, length T, counted over the full T x T matrix as in the PaLM paper's
    MFU. GPT-2 124M, T=1024: 855.2 MFLOP, tied or untied (see the module docstring).
    """
    L, H, Q = cfg.n_layer, cfg.n_head, cfg.head_width  # query heads (grouped k/v heads do no extra work)
    return 6.0 * n_flop_params + 12.0 * L * H * Q * seq_len


# Datasheet dense peaks in FLOP/s. 'bf16'/'fp16': tensor cores with fp32 accumulation; 'tf32': TF32
# tensor cores; 'fp32': the non-tensor FP32 rate. None: no such mode, or no figure we are sure of.
# Keys are matched against the words of the name torch reports (torch.cuda.get_device_name(), split at
# spaces and hyphens, case-insensitive): a row matches when all its words occur ("NVIDIA H100 80GB
# HBM3", "A100-SXM4-40GB"); the first matching row wins, so specific rows go first.
_UNKNOWN: dict[str, float | None] = {"bf16": None, "fp16": None, "tf32": None, "fp32": None}
# H100 SXM, H200 (SXM) and GH200: the same GH100 compute at the same clocks.
_HOPPER_SXM: dict[str, float | None] = {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}
PEAK_FLOPS: dict[tuple[str, ...], dict[str, float | None]] = {
    ("GH200",): _HOPPER_SXM,
    ("H200", "NVL"): _UNKNOWN,  # NVL parts run lower clocks than SXM
    ("H200",): _HOPPER_SXM,
    ("H100", "NVL"): _UNKNOWN,
    ("H100", "PCIE"): {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12},
    ("H100", "SXM5"): _HOPPER_SXM,
    ("H100", "SXM"): _HOPPER_SXM,
    ("H100", "HBM3"): _HOPPER_SXM,  # the SXM part reports "NVIDIA H100 80GB HBM3"
    ("A100",): {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    ("L40S",): {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12},
    ("L4",): {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12},
    ("RTX", "4090"): {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12},
    ("V100", "SXM2"): {"bf16": None, "fp16": 125e12, "tf32": None, "fp32": 15.7e12},
    ("V100", "PCIE"): {"bf16": None, "fp16": 112e12, "tf32": None, "fp32": 14e12},
}
# Not listed (None, no MFU): A10G (no public NVIDIA datasheet figure), A10, L40, H800, V100S, MIG slices.

_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of ``device_name`` (e.g. ``torch.cuda.get_device_name()``) for ``precision``
    (one of 'fp32', 'tf32', 'bf16', 'fp16'; see :func:`math_mode`), or None when unknown: a CPU, an
    unlisted GPU, a MIG slice, or a mode the GPU lacks. None means "report no MFU", never a guess."""
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS} (see math_mode), got {precision!r}")
    words = set(re.split(r"[\s\-_/]+", device_name.upper()))
    if "MIG" in words:  # a slice of the GPU: the full-GPU peak would be wrong
        return None
    for keys, peaks in PEAK_FLOPS.items():
        if all(k in words for k in keys):
            return peaks[precision]
    return None


def math_mode(precision: str, tf32: bool) -> str:
    """The matmul arithmetic of a run: ``train.precision`` and ``train.tf32`` -> the
    :data:`PEAK_FLOPS` column ('fp32', 'tf32', 'bf16' or 'fp16')."""
    modes = {
        "fp32": "tf32" if tf32 else "fp32",
        "bf16-autocast": "bf16",
        "bf16": "bf16",
        "fp16-autocast": "fp16",
    }
    if precision not in modes:
        raise ValueError(f"train.precision must be one of {list(modes)}, got {precision!r}")
    return modes[precision]
