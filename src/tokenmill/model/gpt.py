"""The GPT model: token + position embeddings, a stack of pre-norm blocks, final LayerNorm, head.

Every field of :class:`~tokenmill.config.ModelConfig` is honoured; see ``layers.py`` for the blocks.

Initialisation (GPT-2): Linear and Embedding weights ~ N(0, init_std), biases 0, LayerNorm weight 1
and bias 0, the residual projections (``attn.c_proj``, ``mlp.c_proj``) ~ N(0, init_std / sqrt(2 *
n_layer)). The random draws are a pure function of the torch seed and the config, made in a fixed
order that does not depend on the switches that keep the math: manual/native norm and GELU,
manual/sdpa attention, mask form, fused/separate q/k/v (the fused matrix draws its q, k, v parts one
after the other, as three Linears would), bias on/off and vocabulary padding (padding rows are
zero and take no draws). So two models built after the same ``torch.manual_seed`` hold the same
values in their shared parameters (build on the same device: CPU and CUDA generators differ).

Vocabulary padding: the embedding and head matrices have ``padded_vocab`` rows; the head is computed
on the padded matrix and the logits are the view ``[..., :vocab_size]``, so a padded column is
never predicted and never touches the loss, and its head row gets no gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from tokenmill.config import ModelConfig
from tokenmill.model.layers import Block, LayerNorm, causal_mask, make_norm

__all__ = ["GPT", "Block", "adapt_state_dict"]


class GPT(nn.Module):
    """A GPT-2 style decoder-only transformer.

    Args:
        cfg: the model section of the run config.
        vocab_size: the true vocabulary (``cfg.vocab_size`` or the data's); the embedding and head
            matrices are padded up to ``padded_vocab``, a multiple of ``cfg.vocab_pad_multiple``.

    Built on the current default device (``with torch.device(...)`` or ``torch.set_default_device``);
    on ``meta`` nothing is allocated (parameter counts of big models).
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"model.n_embd ({cfg.n_embd}) must be divisible by model.n_head ({cfg.n_head})")
        self.cfg = cfg
        self.vocab_size = vocab_size
        m = cfg.vocab_pad_multiple
        self.padded_vocab = (vocab_size + m - 1) // m * m  # ceil(vocab_size / m) * m

        # Build without drawing random numbers (on meta), then allocate on the default device and
        # initialise once, in init_weights: so the draws do not depend on how modules are built.
        device = torch.empty(0).device
        with torch.device("meta"):
            self.wte = nn.Embedding(self.padded_vocab, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = make_norm(cfg)
            self.lm_head = nn.Linear(cfg.n_embd, self.padded_vocab, bias=False)
        self.to_empty(device=device)
        self.init_weights()
        self.hidden_output = False  # True on the last pipeline stage (see forward)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter and buffer (GPT-2 scheme, see the module docstring) and tie
        the head to the token embedding when ``cfg.tie_embeddings``.

        Call it after ``to_empty()`` when the model was moved off the meta device: ``to_empty`` leaves
        the values (and the causal-mask buffer) uninitialised and unties tied parameters.
        """
        std = self.cfg.init_std
        proj_std = std / math.sqrt(2 * self.cfg.n_layer)
        tied = self.cfg.tie_embeddings
        if tied:
            self.lm_head.weight = self.wte.weight
        for name, m in self.named_modules():
            if m is self.wte or (m is self.lm_head and not tied):
                _normal_rows(m.weight, self.vocab_size, std)  # padding rows: zero
            elif m is self.lm_head:
                pass  # tied: it is wte.weight, initialised above
            elif isinstance(m, nn.Embedding):
                m.weight.normal_(0.0, std)
            elif isinstance(m, nn.Linear):
                s = proj_std if name.endswith("c_proj") else std
                if name.endswith("c_attn"):  # fused [q; k; v]: draw the parts in turn, as 3 Linears do
                    for part in m.weight.chunk(3, dim=0):
                        part.normal_(0.0, s)
                else:
                    m.weight.normal_(0.0, s)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, (nn.LayerNorm, LayerNorm)):
                m.weight.fill_(1.0)
                if m.bias is not None:
                    m.bias.zero_()
            if getattr(m, "use_mask_buffer", False):
                m.mask.copy_(causal_mask(m.mask.size(0), m.mask.device))

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) token ids, T <= block_size.

        Returns ``(logits, loss)``: logits (B, T, vocab_size) in the compute dtype; loss = mean
        cross-entropy over all B*T positions, computed on fp32 logits (None without targets).
        With ``model.loss_impl='chunked'`` and targets, the head and loss run chunk by chunk
        (:mod:`tokenmill.model.loss`) and the logits are not returned: ``(None, loss)``.

        A pipeline stage (:mod:`tokenmill.parallel.pipeline`) is a GPT with the parts of other stages
        removed: without ``wte`` it takes the previous stage's hidden states (B, T, C) instead of token
        ids; without ``ln_f`` it returns its hidden states; the last stage (``hidden_output``) returns
        the normalised hidden states, to which the schedule's loss function applies :meth:`head_loss`.
        """
        B, T = idx.shape[:2]
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds model.block_size {self.cfg.block_size}")
        if self.wte is not None:
            x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        else:  # a later pipeline stage: idx holds the previous stage's hidden states
            x = idx
        for block in self.blocks:
            x = block(x)
        if self.ln_f is None:  # a pipeline stage before the last
            return x
        x = self.ln_f(x)
        if self.hidden_output:  # the last pipeline stage
            return x
        return self.head_loss(x, targets)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The head (and the loss when ``targets`` is given) on the final normalised hidden states."""
        B, T = x.shape[:2]
        if targets is not None and self.cfg.loss_impl == "chunked":
            from tokenmill.model.loss import chunked_cross_entropy

            loss = chunked_cross_entropy(x.reshape(B * T, -1), self.lm_head.weight, targets.reshape(B * T),
                                         self.vocab_size, self.cfg.loss_chunk_size)
            return None, loss
        logits = self.lm_head(x)
        if self.padded_vocab != self.vocab_size:
            logits = logits[..., : self.vocab_size]  # padded columns are never predicted
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(B * T, self.vocab_size), targets.reshape(B * T))
        return logits, loss

    def present_blocks(self) -> list[tuple[int, nn.Module]]:
        """``(index, block)`` of the blocks this model holds (a pipeline stage replaces the blocks of
        other stages by ``nn.Identity``, keeping the indices and so the parameter names)."""
        return [(i, b) for i, b in enumerate(self.blocks) if not isinstance(b, nn.Identity)]

    @torch.no_grad()
    def generate(
        self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled ids to ``idx`` (B, T) and return (B, T + max_new_tokens).

        The context is cropped to the last ``block_size`` tokens. ``temperature`` <= 0 means greedy
        (argmax); ``top_k`` keeps only the k most likely ids. The train/eval mode is left as it is:
        call ``model.eval()`` first for sampling without dropout.
        """
        for _ in range(max_new_tokens):
            ctx = idx if idx.size(1) <= self.cfg.block_size else idx[:, -self.cfg.block_size :]
            logits, _ = self(ctx)
            logits = logits[:, -1, :].float()
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat((idx, nxt), dim=1)
        return idx

    def num_params(self, exclude_embeddings: bool = False, exclude_position: bool = False) -> int:
        """Number of unique parameters (a tied head/embedding matrix counts once; padding rows count).

        ``exclude_position``: without the position embeddings (nanoGPT's "non-embedding" count; the N
        of :func:`tokenmill.model.flops.flops_per_token`). ``exclude_embeddings``: without the
        position AND token embeddings (Kaplan et al.). When tied, the shared matrix is the token
        embedding and is excluded too; an untied head is an ordinary projection and stays counted.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_position or exclude_embeddings:
            n -= self.wpe.weight.numel()
        if exclude_embeddings:
            n -= self.wte.weight.numel()
        return n


def _normal_rows(w: torch.Tensor, rows: int, std: float) -> None:
    """The first ``rows`` rows ~ N(0, std) (the same draws as a ``rows``-row matrix); the rest 0."""
    w[:rows].normal_(0.0, std)
    w[rows:].zero_()


def adapt_state_dict(state_dict: Mapping[str, torch.Tensor], model: GPT) -> dict[str, torch.Tensor]:
    """Rewrite a GPT state dict (or a dict of gradients keyed the same way) into ``model``'s layout.

    Converts fused ``attn.c_attn`` <-> separate ``attn.q_proj/k_proj/v_proj`` (weights and biases)
    and the vocabulary padding of ``wte.weight`` / ``lm_head.weight`` (keeps the first
    ``model.vocab_size`` rows, zero-fills padding rows). Everything else passes through unchanged.
    Usage: ``model.load_state_dict(adapt_state_dict(other.state_dict(), model))``.
    """
    sd = dict(state_dict)
    fused = model.cfg.fused_qkv
    for key in list(sd):
        for kind in ("weight", "bias"):
            if not fused and key.endswith(f"attn.c_attn.{kind}"):
                base = key[: -len(f"c_attn.{kind}")]
                for n, part in zip("qkv", sd.pop(key).chunk(3, dim=0)):
                    sd[f"{base}{n}_proj.{kind}"] = part
            elif fused and key.endswith(f"attn.q_proj.{kind}"):
                base = key[: -len(f"q_proj.{kind}")]
                sd[f"{base}c_attn.{kind}"] = torch.cat([sd.pop(f"{base}{n}_proj.{kind}") for n in "qkv"])
    V, Vp = model.vocab_size, model.padded_vocab
    for key in ("wte.weight", "lm_head.weight"):
        if key in sd:
            w = sd[key]
            if w.size(0) < V:
                raise ValueError(f"{key} has {w.size(0)} rows, fewer than the vocabulary ({V})")
            sd[key] = torch.cat([w[:V], w.new_zeros(Vp - V, w.size(1))])
    return sd
