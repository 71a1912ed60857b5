"""The pieces of a GPT block: LayerNorm, GELU, causal self-attention, MLP and the block itself.

Every switch in :class:`~tokenmill.config.ModelConfig` that changes *how* something is computed (not
*what*) picks one of its forms here (the Triton LayerNorm lives in ``model/kernels``). The forms of a
switch have the same parameters under the same names, so their state dicts are interchangeable
(fused vs separate q/k/v is the one exception: see :func:`tokenmill.model.gpt.adapt_state_dict`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tokenmill.config import ModelConfig
from tokenmill.errors import ConfigError
from tokenmill.model.kernels.layernorm import TritonLayerNorm


def upcast(x: torch.Tensor, fp32_islands: bool) -> torch.Tensor:
    """The one place ``model.fp32_islands`` is applied: ``x`` in fp32 for a numerically sensitive op
    (hand-written LayerNorm, manual softmax, cross-entropy) when islands are on, else ``x`` unchanged
    (the op then runs in the model's dtype, as a pure-bf16 model without islands does)."""
    return x.float() if fp32_islands else x


# ----------------------------------------------------------------------------------------------
# Normalisation and activation


class LayerNorm(nn.Module):
    """Hand-written LayerNorm (``model.norm='manual'``): the same math and parameter names
    (``weight``, ``bias``) as ``nn.LayerNorm``, spelled out as separate element-wise ops.

    Statistics and the affine map are computed in fp32 and the result cast back to the input dtype,
    like the native kernel does internally, so pure-bf16 runs keep the same accuracy. With
    ``fp32_islands=False`` (``model.fp32_islands``) every op runs in the input dtype instead.
    """

    def __init__(self, ndim: int, bias: bool = True, eps: float = 1e-5, fp32_islands: bool = True):
        super().__init__()
        self.eps = eps
        self.fp32_islands = fp32_islands
        self.weight = nn.Parameter(torch.ones(ndim))
        if bias:
            self.bias = nn.Parameter(torch.zeros(ndim))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.fp32_islands
        xf = upcast(x, up)
        mean = xf.mean(dim=-1, keepdim=True)
        var = (xf - mean).pow(2).mean(dim=-1, keepdim=True)  # biased variance, as nn.LayerNorm
        y = (xf - mean) * torch.rsqrt(var + self.eps) * upcast(self.weight, up)
        if self.bias is not None:
            y = y + upcast(self.bias, up)
        return y.to(x.dtype)


class GELU(nn.Module):
    """Hand-written tanh-approximation GELU (``model.gelu='manual'``), computed in the input dtype:
    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


NORMS = (nn.LayerNorm, LayerNorm, TritonLayerNorm)  # the module types make_norm can return


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The LayerNorm chosen by ``cfg.norm`` (bias per ``cfg.bias``)."""
    if cfg.norm == "native":
        return nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
    if cfg.norm == "triton":
        return TritonLayerNorm(cfg.n_embd, bias=cfg.bias)
    return LayerNorm(cfg.n_embd, bias=cfg.bias, fp32_islands=cfg.fp32_islands)


def make_gelu(cfg: ModelConfig) -> nn.Module:
    """The tanh-GELU chosen by ``cfg.gelu``."""
    return nn.GELU(approximate="tanh") if cfg.gelu == "native" else GELU()


# ----------------------------------------------------------------------------------------------
# Attention


def causal_mask(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T, T) bool mask, True strictly above the diagonal: position i may not attend to j > i."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(diagonal=1)


def _sdpa_backends() -> dict[str, object]:
    """``model.sdpa_backend`` name -> ``SDPBackend`` member (those this torch build has)."""
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
             "math": "MATH"}
    return {k: getattr(SDPBackend, v) for k, v in names.items() if hasattr(SDPBackend, v)}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention.

    ``model.attention='manual'``: ``softmax(q @ k^T / sqrt(d) + causal mask) @ v`` with dropout on the
    attention weights. The softmax runs in fp32 (cast back to the input dtype), as the fused kernels
    do internally, unless ``model.fp32_islands`` is False (then in the input dtype). The mask is a registered (block_size x block_size) buffer (``causal_mask='buffer'``)
    or built for the current length each call (``'on_the_fly'``).

    ``model.attention='sdpa'``: ``F.scaled_dot_product_attention(is_causal=True)``; ``sdpa_backend``
    other than 'auto' forces one kernel and fails with a clear message where it cannot run.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C = cfg.n_embd
        self.n_head = cfg.n_head
        self.head_dim = C // cfg.n_head
        self.n_embd = C
        self.dropout = cfg.dropout
        self.attention = cfg.attention
        self.sdpa_backend = cfg.sdpa_backend
        self.fused_qkv = cfg.fused_qkv
        self.fp32_islands = cfg.fp32_islands
        if cfg.fused_qkv:
            self.c_attn = nn.Linear(C, 3 * C, bias=cfg.qkv_bias)  # rows: [q; k; v]
        else:
            self.q_proj = nn.Linear(C, C, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(C, C, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(C, C, bias=cfg.qkv_bias)
        self.c_proj = nn.Linear(C, C, bias=cfg.bias)  # residual projection (scaled init)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.use_mask_buffer = cfg.attention == "manual" and cfg.causal_mask == "buffer"
        if self.use_mask_buffer:
            self.register_buffer("mask", causal_mask(cfg.block_size), persistent=False)
        if cfg.attention == "sdpa" and cfg.sdpa_backend != "auto":
            backends = _sdpa_backends()
            if cfg.sdpa_backend not in backends:
                raise ConfigError(
                    f"model.sdpa_backend={cfg.sdpa_backend!r} is not available in torch {torch.__version__}; "
                    "try --model.sdpa_backend auto"
                )
            self._backend = backends[cfg.sdpa_backend]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        if self.fused_qkv:
            q, k, v = self.c_attn(x).chunk(3, dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # (B, T, heads * head_dim) -> (B, heads, T, head_dim). Under tensor parallelism the projections
        # hold this rank's heads only, hence -1 (see parallel/tensor_parallel.py).
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.attention == "manual":
            y = self._manual(q, k, v)
        else:
            y = self._sdpa(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))

    def _manual(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if self.use_mask_buffer:
            mask = self.mask[:T, :T]
        else:
            mask = causal_mask(T, q.device)
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(upcast(att, self.fp32_islands), dim=-1).to(q.dtype)
        att = self.attn_dropout(att)
        return att @ v

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        if self.sdpa_backend == "auto":
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self._backend):
            try:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
            except RuntimeError as e:
                raise ConfigError(
                    f"model.sdpa_backend={self.sdpa_backend!r} cannot run here (device {q.device.type}, "
                    f"dtype {q.dtype}, head_dim {q.size(-1)}, dropout {p}); try --model.sdpa_backend auto. "
                    f"PyTorch said: {str(e).splitlines()[0]}"
                ) from None


# ----------------------------------------------------------------------------------------------
# MLP and block


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> tanh-GELU -> Linear(4C, C) -> dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = make_gelu(cfg)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)  # residual projection
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block, self-contained: ``forward(x) -> x`` of the same shape, so it
    can be wrapped for activation checkpointing, compiled or sharded on its own."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x
