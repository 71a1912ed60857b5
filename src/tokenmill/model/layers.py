"""The pieces of a decoder block: norms (LayerNorm, RMSNorm), GELU, rotary embeddings, causal
self-attention (multi-head, grouped-query, with an optional KV cache), the MLPs (GELU, SwiGLU) and the
block itself. Which pieces a block gets is the model family (GPT-2: learned positions, LayerNorm,
GELU; Llama/Qwen/SmolLM: RoPE, RMSNorm, SwiGLU, grouped-query attention), chosen by ModelConfig fields.

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


class RMSNorm(nn.Module):
    """Hand-written RMSNorm (``model.norm_type='rmsnorm'``, ``model.norm='manual'``): ``x / sqrt(mean(x^2) +
    eps) * weight``, the same parameter name (``weight``) as ``nn.RMSNorm``. As the Llama/Qwen reference
    code: the statistics in fp32, the result cast back to the input dtype before the weight is applied.
    With ``fp32_islands=False`` every op runs in the input dtype."""

    def __init__(self, ndim: int, eps: float = 1e-6, fp32_islands: bool = True):
        super().__init__()
        self.eps = eps
        self.fp32_islands = fp32_islands
        self.weight = nn.Parameter(torch.ones(ndim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x, self.fp32_islands)
        y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


NORMS = (nn.LayerNorm, LayerNorm, TritonLayerNorm, nn.RMSNorm, RMSNorm)  # the module types make_norm returns


def make_norm(cfg: ModelConfig, width: int | None = None) -> nn.Module:
    """The norm of ``cfg.norm_type`` in the form ``cfg.norm`` (native kernel, hand-written, Triton) over
    ``width`` features (default ``n_embd``); a LayerNorm's bias per ``cfg.bias``, eps ``cfg.norm_eps``."""
    C, eps = width or cfg.n_embd, cfg.norm_eps
    if cfg.norm_type == "rmsnorm":
        if cfg.norm == "native":
            return nn.RMSNorm(C, eps=eps)
        if cfg.norm == "triton":
            raise ConfigError("model.norm='triton' is a LayerNorm kernel; with model.norm_type='rmsnorm' use "
                              "--model.norm native (or manual).")
        return RMSNorm(C, eps=eps, fp32_islands=cfg.fp32_islands)
    if cfg.norm == "native":
        return nn.LayerNorm(C, eps=eps, bias=cfg.bias)
    if cfg.norm == "triton":
        return TritonLayerNorm(C, bias=cfg.bias, eps=eps)
    return LayerNorm(C, bias=cfg.bias, eps=eps, fp32_islands=cfg.fp32_islands)


def make_gelu(cfg: ModelConfig) -> nn.Module:
    """The tanh-GELU chosen by ``cfg.gelu``."""
    return nn.GELU(approximate="tanh") if cfg.gelu == "native" else GELU()


# ----------------------------------------------------------------------------------------------
# Rotary position embeddings


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The rotary frequencies (head_width / 2,) in fp32: ``rope_theta ** (-2i / head_width)``, scaled as
    ``model.rope_scaling`` says ('llama3': long wavelengths divided by ``rope_factor``, short ones kept,
    a smooth blend between, as Llama 3.1 defines it)."""
    d = cfg.head_width
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if cfg.rope_scaling == "llama3":
        old, lo, hi, f = cfg.rope_original_context, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / f, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / f + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(medium, blended, scaled)
    return inv


def rope_tables(cfg: ModelConfig, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each (block_size, head_width) fp32: the angle of position p and frequency i, the
    frequencies repeated for the two halves of a head (the rotate-half layout of the Llama/Qwen weights)."""
    inv = rope_inv_freq(cfg).to(device)
    angles = torch.outer(torch.arange(cfg.block_size, device=device, dtype=torch.float32), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, heads, T, head_width) by the angles ``cos``/``sin`` (T, head_width) of its
    positions: ``x * cos + rotate_half(x) * sin``, in ``x``'s dtype (the tables are cast to it)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------
# Attention


def causal_mask(T: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(T, T) bool mask, True strictly above the diagonal: position i may not attend to j > i."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(diagonal=1)


def document_positions(idx: torch.Tensor, eot_id: int) -> torch.Tensor:
    """(B, T) long: each token's position inside its document (``data.document_mask``), documents ending
    with ``eot_id`` (prepare writes it after every document, so an end-of-text token is the last token of
    the document it ends, and the token after it is position 0). A window's first token is position 0
    (a document cut by the window's start counts from there)."""
    t = torch.arange(idx.size(1), device=idx.device)
    first = torch.ones_like(idx, dtype=torch.bool)
    first[:, 1:] = idx[:, :-1] == eot_id
    return t - torch.where(first, t, 0).cummax(dim=1).values


def flagged_document_positions(idx: torch.Tensor, flag: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, pos)`` of input ids whose sequences' first tokens carry the bit ``flag`` (``data.chat_packing='pack'``:
    conversations packed into a window, the boundaries from the chat folder's start bits, not an end-of-text id):
    the ids without the bit, and each token's position inside its sequence (a window's first token is 0)."""
    t = torch.arange(idx.size(1), device=idx.device)
    first = (idx & flag) != 0
    first[:, 0] = True
    return idx & (flag - 1), t - torch.where(first, t, 0).cummax(dim=1).values


def document_mask(pos: torch.Tensor, attention: str, dtype: torch.dtype) -> torch.Tensor:
    """The mask of ``data.document_mask`` from :func:`document_positions` ``pos`` (B, T): query i may look
    at key j when j <= i and j is in i's document (j >= i - pos[i]), i.e. causal AND same document.
    Built once per forward and shared by every layer, (B, 1, T, T): for manual attention a bool mask,
    True where i may NOT look (as :func:`causal_mask`); for SDPA an additive mask of ``dtype`` (the
    attention's dtype), 0 where i may look and -inf elsewhere, which SDPA keeps for backward as it is
    (a bool mask would be converted to a new float copy in every layer, each kept for backward)."""
    T = pos.size(1)
    t = torch.arange(T, device=pos.device)
    blocked = (t[None, None, :] > t[None, :, None]) | (t[None, None, :] < (t - pos)[:, :, None])
    blocked = blocked.unsqueeze(1)
    if attention == "manual":
        return blocked
    return torch.zeros(blocked.shape, dtype=dtype, device=pos.device).masked_fill_(blocked, float("-inf"))


def document_block_mask(pos: torch.Tensor):
    """``model.document_attention='flex'``: the :func:`document_mask` of ``pos`` (B, T) as FlexAttention's
    ``BlockMask``, the same rule (key j visible to query i when ``i - pos[i] <= j <= i``), shared by every
    head and layer. It holds block indices only (B x (T/128)^2), no T x T mask: FlexAttention computes the
    128 x 128 tiles that hold a visible pair and skips the rest (the other documents' and the future's)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = pos.shape
    start = torch.arange(T, device=pos.device) - pos  # (B, T): the index of each token's document start

    def causal_same_document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= start[b, q_idx])

    return create_block_mask(causal_same_document, B, None, T, T, device=pos.device)


_FLEX_COMPILED: dict[str, object] = {}


def _flex_attention(cuda: bool):
    """FlexAttention compiled once per process on CUDA (eager it runs an unfused reference that materialises
    the scores); as it is on the CPU and inside a compiled graph (``compile.enabled`` traces it there)."""
    from torch.nn.attention.flex_attention import flex_attention

    if not cuda or torch.compiler.is_compiling():
        return flex_attention
    if "cuda" not in _FLEX_COMPILED:
        _FLEX_COMPILED["cuda"] = torch.compile(flex_attention)
    return _FLEX_COMPILED["cuda"]


def _sdpa_backends() -> dict[str, object]:
    """``model.sdpa_backend`` name -> ``SDPBackend`` member (those this torch build has)."""
    from torch.nn.attention import SDPBackend

    names = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
             "math": "MATH"}
    return {k: getattr(SDPBackend, v) for k, v in names.items() if hasattr(SDPBackend, v)}


class KVCache:
    """Keys and values (B, kv heads, capacity, head_width) of every layer for the positions seen so far,
    for generation: the attention forward stores the new positions' keys and values and attends to all
    of them (:meth:`update`); the model advances :attr:`pos` once all layers ran."""

    def __init__(self, n_layer: int, capacity: int):
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.capacity = capacity
        self.pos = 0  # positions filled

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        P, T = self.pos, k.size(2)
        if self.k[layer] is None:
            shape = (k.size(0), k.size(1), self.capacity, k.size(3))
            self.k[layer], self.v[layer] = k.new_empty(shape), v.new_empty(shape)
        self.k[layer][:, :, P : P + T] = k
        self.v[layer][:, :, P : P + T] = v
        return self.k[layer][:, :, : P + T], self.v[layer][:, :, : P + T]


class CausalSelfAttention(nn.Module):
    """Causal self-attention: multi-head, or grouped-query when ``model.n_kv_head`` < ``n_head`` (each
    key/value head serves ``n_head / n_kv_head`` query heads), with learned positions outside it or
    rotary embeddings applied to q and k here, and an optional RMSNorm over each head of q and k
    (``model.qk_norm``, Qwen3).

    ``model.attention='manual'``: ``softmax(q @ k^T / sqrt(d) + causal mask) @ v`` with dropout on the
    attention weights (grouped keys and values repeated per query head). The softmax runs in fp32 (cast
    back to the input dtype), as the fused kernels do internally, unless ``model.fp32_islands`` is False.
    The mask is a registered (block_size x block_size) buffer (``causal_mask='buffer'``) or built for the
    current length each call (``'on_the_fly'``).

    ``model.attention='sdpa'``: ``F.scaled_dot_product_attention`` (``enable_gqa`` for grouped heads);
    ``sdpa_backend`` other than 'auto' forces one kernel and fails with a clear message where it cannot.

    ``forward(x, rope, cache, doc_mask)``: ``rope`` = the model's (cos, sin) tables (None: learned
    positions), or with ``data.document_positions`` the angles of each token (B, 1, T, head_width);
    ``cache`` (:class:`KVCache`, generation) = keys and values of earlier positions: ``x`` then holds the
    new positions ``cache.pos ...`` only; ``doc_mask`` (``data.document_mask``, :func:`document_mask`)
    replaces the causal mask: causal AND within one document (SDPA then cannot use the flash kernel), or,
    a ``BlockMask`` (``model.document_attention='flex'``, :func:`document_block_mask`), sends the attention
    to FlexAttention (no dropout on the attention weights: the model refuses or avoids it).
    """

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        C, hd = cfg.n_embd, cfg.head_width
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, hd
        self.layer_idx = layer_idx
        self.dropout = cfg.dropout
        self.attention = cfg.attention
        self.sdpa_backend = cfg.sdpa_backend
        self.fused_qkv = cfg.fused_qkv
        self.fp32_islands = cfg.fp32_islands
        q_out, kv_out = cfg.n_head * hd, cfg.kv_heads * hd
        if cfg.fused_qkv:
            self.c_attn = nn.Linear(C, q_out + 2 * kv_out, bias=cfg.qkv_bias)  # rows: [q; k; v]
        else:
            self.q_proj = nn.Linear(C, q_out, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(C, kv_out, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(C, kv_out, bias=cfg.qkv_bias)
        if cfg.qk_norm:  # model.qk_norm_width: per head (Qwen3) or over all heads together (OLMoE)
            self.q_norm = make_norm(cfg, hd if cfg.qk_norm_width == "head" else q_out)
            self.k_norm = make_norm(cfg, hd if cfg.qk_norm_width == "head" else kv_out)
        self.qk_norm = cfg.qk_norm and cfg.qk_norm_width
        self.c_proj = nn.Linear(q_out, C, bias=cfg.bias)  # residual projection (scaled init)
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

    def split_sizes(self) -> list[int]:
        """Rows of the fused ``c_attn`` matrix: q, k, v."""
        return [self.n_head * self.head_dim, self.n_kv_head * self.head_dim, self.n_kv_head * self.head_dim]

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: KVCache | None = None, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        if self.fused_qkv:
            q, k, v = self.c_attn(x).split(self.split_sizes(), dim=2)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # (B, T, heads * head_dim) -> (B, T, heads, head_dim). Under tensor parallelism the projections
        # hold this rank's heads only, hence -1 (see Block.tp_plan).
        q, k, v = (t.view(B, T, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm == "all":
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        elif self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        P = cache.pos if cache is not None else 0
        if rope is not None:  # the tables of every position, or each token's angles (B, 1, T, hd)
            cos, sin = rope if rope[0].dim() == 4 else (rope[0][P : P + T], rope[1][P : P + T])
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask = None  # None: causal from position 0; else True where a new query may not look
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
            if P > 0:
                mask = causal_mask(P + T, q.device)[P:] if T > 1 else torch.zeros(1, P + 1, dtype=torch.bool,
                                                                                   device=q.device)
        if doc_mask is not None:  # data.document_mask (training forwards, no cache): causal and same document
            mask = doc_mask
        if mask is not None and not isinstance(mask, torch.Tensor):  # a BlockMask: model.document_attention
            y = _flex_attention(q.is_cuda)(q, k, v, block_mask=mask, enable_gqa=q.size(1) != k.size(1))
        elif self.attention == "manual":
            y = self._manual(q, k, v, mask)
        else:
            y = self._sdpa(q, k, v, mask)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))

    def _manual(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        groups = q.size(1) // k.size(1)
        if groups > 1:  # grouped-query: each key/value head serves `groups` query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if mask is None:
            mask = self.mask[:T, :T] if self.use_mask_buffer else causal_mask(T, q.device)
        att = att.masked_fill(mask, float("-inf"))
        att = F.softmax(upcast(att, self.fp32_islands), dim=-1).to(q.dtype)
        att = self.attn_dropout(att)
        return att @ v

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``mask``: None (causal), a bool mask True where a query may not look, or an additive float
        mask (:func:`document_mask`), passed as it is. With an additive mask and grouped key/value heads
        on CUDA, the keys and values are repeated per query head here: the memory-efficient kernel, the
        one that takes a mask, has no grouped form, and ``enable_gqa`` would send PyTorch to the math path
        (the whole (B, heads, T, T) attention matrix kept for backward)."""
        p = self.dropout if self.training else 0.0
        if mask is not None and mask.dtype != torch.bool:
            attn_mask = mask if mask.dtype == q.dtype else mask.to(q.dtype)
            if q.is_cuda and q.size(1) != k.size(1):
                groups = q.size(1) // k.size(1)
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        else:
            attn_mask = None if mask is None else ~mask
        kw = {"dropout_p": p, "is_causal": mask is None, "attn_mask": attn_mask}
        if q.size(1) != k.size(1):
            kw["enable_gqa"] = True
        if self.sdpa_backend == "auto":
            return F.scaled_dot_product_attention(q, k, v, **kw)
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self._backend):
            try:
                return F.scaled_dot_product_attention(q, k, v, **kw)
            except RuntimeError as e:
                raise ConfigError(
                    f"model.sdpa_backend={self.sdpa_backend!r} cannot run here (device {q.device.type}, "
                    f"dtype {q.dtype}, head_dim {q.size(-1)}, dropout {p}); try --model.sdpa_backend auto. "
                    f"PyTorch said: {str(e).splitlines()[0]}"
                ) from None


# ----------------------------------------------------------------------------------------------
# MLP and block


class MLP(nn.Module):
    """GPT-2's feed-forward (``model.mlp='gelu'``): Linear(C, I) -> tanh-GELU -> Linear(I, C) -> dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=cfg.bias)
        self.gelu = make_gelu(cfg)
        self.c_proj = nn.Linear(cfg.mlp_width, cfg.n_embd, bias=cfg.bias)  # residual projection
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class SwiGLU(nn.Module):
    """The gated feed-forward of Llama, Qwen and SmolLM (``model.mlp='swiglu'``):
    ``c_proj(silu(c_gate(x)) * c_fc(x))`` -> dropout; ``c_gate``/``c_fc``/``c_proj`` are Hugging Face's
    ``gate_proj``/``up_proj``/``down_proj``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_gate = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=cfg.bias)
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.mlp_width, cfg.n_embd, bias=cfg.bias)  # residual projection
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.silu(self.c_gate(x)) * self.c_fc(x)))


class Block(nn.Module):
    """One pre-norm transformer block, self-contained: ``forward(x, rope=None, cache=None, doc_mask=None) ->
    x`` of the same shape, so it can be wrapped for activation checkpointing, compiled or sharded on its own."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = make_norm(cfg)
        self.mlp = SwiGLU(cfg) if cfg.mlp == "swiglu" else MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: KVCache | None = None, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, cache, doc_mask)
        x = x + self.mlp(self.ln_2(x))
        return x

    def projections(self) -> dict[str, tuple[str, int, int]]:
        """The block's projections by role (``lora.targets`` names them), role -> (module path in the block,
        first output row, rows): 'q', 'k', 'v' (three Linears, or row ranges of the fused ``attn.c_attn``),
        'o' (``attn.c_proj``), 'gate' (SwiGLU only), 'up' (``mlp.c_fc``), 'down' (``mlp.c_proj``)."""
        attn, mlp = self.attn, self.mlp
        q, kv = attn.n_head * attn.head_dim, attn.n_kv_head * attn.head_dim
        if attn.fused_qkv:
            out = {"q": ("attn.c_attn", 0, q), "k": ("attn.c_attn", q, kv), "v": ("attn.c_attn", q + kv, kv)}
        else:
            out = {"q": ("attn.q_proj", 0, q), "k": ("attn.k_proj", 0, kv), "v": ("attn.v_proj", 0, kv)}
        out["o"] = ("attn.c_proj", 0, attn.c_proj.out_features)
        if hasattr(mlp, "c_gate"):
            out["gate"] = ("mlp.c_gate", 0, mlp.c_gate.out_features)
        if hasattr(mlp, "c_fc"):  # a mixture of experts (model/moe.py) has no dense MLP projections
            out["up"] = ("mlp.c_fc", 0, mlp.c_fc.out_features)
            out["down"] = ("mlp.c_proj", 0, mlp.c_proj.out_features)
        return out

    def tp_plan(self) -> dict[str, str]:
        """The block's tensor-parallel plan, module path -> 'colwise' | 'rowwise' (Megatron style): the
        projections into heads and into the MLP's hidden units split by output features, so each rank
        computes whole heads and a slice of the hidden units; the two projections back to the residual
        stream split by input features (one all-reduce each). Norms stay replicated; the q/k norm weights
        ('per_head') are whole on every rank, which normalises only its own heads, so their gradients are
        summed over the tensor-parallel ranks."""
        plan = {f"attn.{n}": "colwise" for n in ("q_proj", "k_proj", "v_proj")}
        plan["attn.c_proj"] = "rowwise"
        plan.update({f"mlp.{n}": "colwise" for n in ("c_gate", "c_fc") if hasattr(self.mlp, n)})
        plan["mlp.c_proj"] = "rowwise"
        plan.update({f"attn.{n}": "per_head" for n in ("q_norm", "k_norm") if hasattr(self.attn, n)})
        return plan
