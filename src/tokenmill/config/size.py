"""The one size check: a model shape that no machine could hold, or that would make a command loop or
allocate for minutes, stops before any module is built, with the numbers.

:func:`check_size` counts the parameters from the shape fields alone (arithmetic, no module on any
device: :func:`param_count` equals ``model/build.py count_params``, a test keeps them equal) and the
largest tensors a training step makes, and refuses:

- more than :data:`MAX_LAYERS` blocks (loops over the depth: building, tracing, checkpoint wrappers);
- more than :data:`MAX_PARAMS` parameters (weights alone beyond any cluster's memory);
- more than :data:`MAX_VOCAB` ids (token files store ids in 32 bits);
- more than :data:`MAX_TOKENS` tokens in one micro-batch (``train.batch_size x model.block_size``);
- one tensor (an embedding, a matrix, the logits, an activation, the attention scores, the mask or RoPE
  tables) larger than :data:`MAX_TENSOR_BYTES`, more than any one device or host holds.

``config.validate`` calls it for every resolved config (flags, ``--config`` files, a checkpoint's or a
run's recorded config, a Hugging Face source's adopted shape), with the vocabulary when the config
names it; commands that learn the vocabulary later (from the data) call it again with it.
"""

from __future__ import annotations

from typing import Optional

from tokenmill.config.matrices import block_matrices
from tokenmill.config.model import ModelConfig
from tokenmill.errors import ConfigError

__all__ = ["MAX_LAYERS", "MAX_PARAMS", "MAX_TENSOR_BYTES", "MAX_TOKENS", "MAX_VOCAB", "check_size", "param_count"]

MAX_LAYERS = 10_000  # ten times the deepest published transformers (about 1,000 blocks)
MAX_PARAMS = 10**14  # 100 trillion: 200 TB of bf16 weights before any gradient or optimizer state
MAX_VOCAB = 2**32  # token files hold uint32 ids
MAX_TOKENS = 2**31  # one micro-batch: its int64 ids alone are 16 GiB
MAX_TENSOR_BYTES = 2**44  # 16 TiB in one tensor: more than any accelerator or host memory


def _norm(m: ModelConfig, width: int) -> int:
    return width * (2 if m.norm_type == "layernorm" and m.bias else 1)


def padded_vocab(m: ModelConfig, vocab_size: int) -> int:
    """The embedding's rows: ``vocab_size`` rounded up to ``model.vocab_pad_multiple``."""
    k = m.vocab_pad_multiple
    return -(-vocab_size // k) * k


def block_params(m: ModelConfig, sparse: bool = False) -> int:
    """Parameters of one block (a sparse layer's with ``sparse``): its matrices (``config/matrices.py``) and
    its norms (the layout of ``model/layers.py Block``)."""
    hd, q, kv = m.head_width, m.n_head * m.head_width, m.kv_heads * m.head_width
    norms = 2 * _norm(m, m.n_embd)
    norms += (2 * _norm(m, hd) if m.qk_norm_width == "head" else _norm(m, q) + _norm(m, kv)) if m.qk_norm else 0
    return norms + sum(x.params for x in block_matrices(m, sparse))


def moe_extra_params(m: ModelConfig) -> int:
    """Parameters a sparse layer's mixture of experts (model/moe.py) adds over the dense MLP it replaces."""
    return block_params(m, sparse=True) - block_params(m)


def param_count(m: ModelConfig, vocab_size: int) -> int:
    """Parameters of the whole model (a tied head counts once; padded rows included)."""
    emb = padded_vocab(m, vocab_size) * m.n_embd
    wpe = m.block_size * m.n_embd if m.pos_emb == "learned" else 0
    moe = len(m.sparse_layers()) * moe_extra_params(m) if m.moe_experts else 0
    return emb * (1 if m.tie_embeddings else 2) + wpe + m.n_layer * block_params(m) + moe + _norm(m, m.n_embd)


def largest_tensors(m: ModelConfig, vocab_size: int, batch_size: int) -> dict[str, int]:
    """Bytes (fp32) of the largest tensors a training step of this shape makes, by name."""
    B, T, C, Vp = batch_size, m.block_size, m.n_embd, padded_vocab(m, vocab_size)
    out = {"the token embedding": Vp * C * 4, "one MLP matrix": C * m.mlp_width * 4,
           "one activation (batch_size x block_size x n_embd)": B * T * C * 4}
    if m.moe_experts:  # model/moe.py: the experts' stacked gate and up matrices are one tensor
        out["the experts' gate/up weights (moe_experts x 2 x expert width x n_embd)"] = m.moe_experts * 2 * m.expert_width * C * 4
    if m.loss_impl == "full":
        out["the logits (batch_size x block_size x vocabulary)"] = B * T * Vp * 4
    if m.attention == "manual":
        out["the attention scores (batch_size x n_head x block_size^2)"] = B * m.n_head * T * T * 4
        if m.causal_mask == "buffer":
            out["the causal mask buffer (block_size^2)"] = T * T
    if m.pos_emb == "rope":
        out["the RoPE tables (block_size x head width)"] = T * m.head_width * 4
    return out


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if n < 1024 or unit == "EiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} EiB"  # pragma: no cover


def _shape(m: ModelConfig, vocab: int, known: bool) -> str:
    words = f"vocabulary {vocab:,}" if known else "vocabulary not known yet, counted as 1"
    return (f"n_layer {m.n_layer:,}, n_embd {m.n_embd:,}, n_head {m.n_head:,}, MLP width {m.mlp_width:,}, "
            f"{words}, block_size {m.block_size:,}")


def check_size(m: ModelConfig, batch_size: int, vocab_size: Optional[int] = None, where: str = "") -> None:
    """Refuse an absurd shape (see the module doc) with its numbers and the fields to change, in
    microseconds and before anything is built. ``vocab_size``: the model's vocabulary (default
    ``model.vocab_size``, else 1: a lower bound); ``where``: what the shape came from, for the message."""
    vocab = vocab_size or m.vocab_size or 1
    known = bool(vocab_size or m.vocab_size)
    src = f" (from {where})" if where else ""
    if m.n_layer > MAX_LAYERS:
        raise ConfigError(f"model.n_layer {m.n_layer:,}{src} is absurd: at most {MAX_LAYERS:,} blocks "
                          "(the deepest published transformers have about 1,000); use a smaller --model.n_layer.")
    if vocab > MAX_VOCAB:
        raise ConfigError(f"the vocabulary of {vocab:,} ids{src} is absurd: token files hold at most "
                          f"{MAX_VOCAB:,} ids (32 bits); use a smaller --model.vocab_size or tokenizer.")
    n = param_count(m, vocab)
    if n > MAX_PARAMS:
        raise ConfigError(f"the model asked for{src} ({_shape(m, vocab, known)}) is absurd: {n:,} parameters, more than "
                          f"{MAX_PARAMS:,} (its bf16 weights alone: {_fmt(2 * n)}); use smaller --model.n_layer, "
                          "--model.n_embd, --model.intermediate_size or vocabulary.")
    tokens = batch_size * m.block_size
    if tokens > MAX_TOKENS:
        raise ConfigError(f"train.batch_size {batch_size:,} x model.block_size {m.block_size:,} = {tokens:,} tokens "
                          f"in one micro-batch{src} is absurd (at most {MAX_TOKENS:,}); lower --train.batch_size "
                          "or --model.block_size (--train.grad_accum_steps keeps the tokens per step).")
    name, nbytes = max(largest_tensors(m, vocab, batch_size).items(), key=lambda kv: kv[1])
    if nbytes > MAX_TENSOR_BYTES:
        raise ConfigError(f"{name} alone would take {_fmt(nbytes)}{src} ({_shape(m, vocab, known)}, batch_size "
                          f"{batch_size:,}), an absurd size: more than any device or host holds ({_fmt(MAX_TENSOR_BYTES)}); "
                          "make that shape smaller.")
