"""Model FLOPs per token and GPU peak throughput, for model FLOPs utilisation (MFU).

MFU = tokens/s * flops_per_token / peak_flops. The FLOPs count the model's math (forward + backward,
no recomputation), so activation checkpointing does not raise MFU. Peaks are datasheet DENSE figures
(the "with sparsity" figures are twice these), per GPU: the one GPU table, :mod:`tokenmill.model.gpus`.

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

from tokenmill.config import ModelConfig
from tokenmill.model.gpus import GPU_TABLE, gpu_facts

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


# The MFU peaks by name words: a view of the one GPU table (model/gpus.py), read at import; peak_flops reads the
# table itself at every call.
PEAK_FLOPS: dict[tuple[str, ...], dict[str, float | None]] = {row.words: row.peaks for row in GPU_TABLE}

_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def peak_flops(device_name: str, precision: str) -> float | None:
    """Dense peak FLOP/s of ``device_name`` (e.g. ``torch.cuda.get_device_name()``) for ``precision``
    (one of 'fp32', 'tf32', 'bf16', 'fp16'; see :func:`math_mode`), or None when unknown: a CPU, an
    unlisted GPU, a MIG slice, or a mode the GPU lacks. None means "report no MFU", never a guess."""
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {_PRECISIONS} (see math_mode), got {precision!r}")
    row = gpu_facts(device_name)  # the one GPU table (model/gpus.py): FP8 and the estimator read the same row
    return row.peaks[precision] if row is not None else None


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
