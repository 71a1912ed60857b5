"""The GPT model: token embeddings (+ learned positions, or rotary embeddings inside attention), a stack
of pre-norm blocks, a final norm, the head. One class for the families tokenmill trains: GPT-2
(learned positions, LayerNorm, GELU, biases) and Llama / Qwen / SmolLM / Mistral (RoPE, RMSNorm,
SwiGLU, grouped-query attention, no biases or q/k/v biases only, q/k norm), chosen by ModelConfig
fields; see ``layers.py`` for the blocks.

The model owns its structure, so the mechanism packages never name its modules: its tensor-parallel
plan (:meth:`GPT.tp_plan`), what a pipeline stage keeps (:meth:`GPT.keep_stage`), the blocks a rank
holds (:meth:`GPT.present_blocks`), its KV cache (generation runs the one attention forward).

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
never predicted and never touches the loss, and its head row gets no gradient
(``model.loss_over_padded_vocab`` reproduces a seed that computes the loss over every padded column).

Precision: ``model.fp32_islands`` (default on) runs the hand-written LayerNorm, the manual softmax and
the cross-entropy in fp32 for bf16/fp16 weights; off, they run in the model's dtype (applied in one
place, :func:`tokenmill.model.layers.upcast`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from tokenmill.config import ModelConfig
from tokenmill.errors import ConfigError, ParallelError, SampleError
from tokenmill.model.layers import (
    NORMS,
    Block,
    KVCache,
    causal_mask,
    document_block_mask,
    document_mask,
    document_positions,
    flagged_document_positions,
    make_norm,
    rope_tables,
    upcast,
)
from tokenmill.model.moe import Experts, MoE, router_loss
from tokenmill.model.sampling import check_sampling, sample_next_token

__all__ = ["GPT", "Block", "KVCache", "adapt_state_dict"]


def edge_units_apart(cfg: ModelConfig) -> bool:
    """Whether FSDP shards the embeddings and the head as units of their own (:meth:`GPT.edge_units`), as
    torchtitan and torchtune do, instead of with the root: then they are unsharded only around their own
    forward and backward, not for the whole step (4 GB less on each rank for Llama 3.1 70B's vocabulary of
    128,256 x 8,192 in bf16). Not when they share one weight (``model.tie_embeddings``: a parameter belongs to
    one unit), where they stay with the root. The estimator reads the same answer (estimate/step.py)."""
    return not cfg.tie_embeddings


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
        if cfg.n_embd % cfg.n_head and cfg.head_dim is None:
            raise ValueError(f"model.n_embd ({cfg.n_embd}) must be divisible by model.n_head ({cfg.n_head})")
        self.cfg = cfg
        self.vocab_size = vocab_size
        m = cfg.vocab_pad_multiple
        self.padded_vocab = (vocab_size + m - 1) // m * m  # ceil(vocab_size / m) * m

        # Build without drawing random numbers (on meta), then allocate on the default device and
        # initialise once, in init_weights: so the draws do not depend on how modules are built.
        device = torch.empty(0).device
        with torch.device("meta"):
            # _weight: no reset_parameters on meta (normal_ there goes through torch._refs and imports
            # torch._dynamo: ~2 s at every process start); init_weights draws the values
            self.wte = nn.Embedding(self.padded_vocab, cfg.n_embd, _weight=torch.empty(self.padded_vocab, cfg.n_embd))
            if cfg.pos_emb == "learned":
                self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, _weight=torch.empty(cfg.block_size, cfg.n_embd))
            else:  # rotary: (cos, sin) tables of every position, not parameters (not in the state dict)
                self.wpe = None
                self.register_buffer("rope_cos", torch.empty(cfg.block_size, cfg.head_width), persistent=False)
                self.register_buffer("rope_sin", torch.empty(cfg.block_size, cfg.head_width), persistent=False)
            self.drop = nn.Dropout(cfg.dropout)
            self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
            for i in cfg.sparse_layers():  # model.moe_experts: a mixture of experts
                self.blocks[i].mlp = MoE(cfg)
            self.ln_f = make_norm(cfg)
            self.lm_head = nn.Linear(cfg.n_embd, self.padded_vocab, bias=False)
        if device.type != "meta":  # on meta the modules already are where they belong
            self.to_empty(device=device)
        self.init_weights()
        self.hidden_output = False  # True on the last pipeline stage (see forward)
        self.doc_eot_id: int | None = None  # data.document_mask: documents end with this id (keep_documents_apart)
        self.doc_positions = False  # data.document_positions: positions restart in every document
        self.doc_start_flag: int | None = None  # data.chat_packing='pack': sequence starts carry this bit in the ids

    def keep_documents_apart(self, eot_id: int, restart_positions: bool = False, start_flag: int | None = None) -> None:
        """``data.document_mask``: from now on a training forward (no KV cache) attends only within a
        document, a document being the tokens up to and including an ``eot_id`` (derived from the input ids
        themselves, so the data, the loader and data parallelism need no change); ``restart_positions``
        (``data.document_positions``): each document's positions start at 0 (learned or rotary), so every
        document is computed as if it were alone at the start of a window. The loss is unchanged: every
        position counts, the end-of-text token predicting the next document's first token from its own
        document only. ``model.document_attention``: the mask's form, see :meth:`document_attention_mask`.
        ``start_flag`` (``data.chat_packing``): documents start at ids carrying this bit instead (eot_id unused)."""
        self.doc_start_flag = start_flag
        if start_flag is None and not 0 <= eot_id < self.vocab_size:
            raise ValueError(f"end-of-text id {eot_id} is outside the vocabulary (0..{self.vocab_size - 1})")
        c = self.cfg
        if c.document_attention == "flex" and c.attention == "sdpa" and c.dropout > 0:
            raise ConfigError(f"model.document_attention='flex' has no dropout on the attention weights, but "
                              f"model.dropout={c.dropout}: set --model.dropout 0 or --model.document_attention auto "
                              "(the explicit mask while training with dropout)")
        self.doc_eot_id, self.doc_positions = int(eot_id), bool(restart_positions)

    def document_attention_mask(self, pos: torch.Tensor, dtype: torch.dtype):
        """The one mask of a forward with ``data.document_mask``, shared by every layer (built once here, the
        attention picks its path by its type): a FlexAttention ``BlockMask`` (:func:`document_block_mask`) for
        ``model.document_attention='flex'``, and for 'auto' on CUDA unless attention dropout is active (training
        with ``model.dropout`` > 0); else the explicit (B, 1, T, T) mask (:func:`document_mask`). Manual attention
        always takes the explicit mask. Forced 'flex' is refused where it cannot train: on the CPU or MPS with
        gradients (FlexAttention has no backward there)."""
        c = self.cfg
        dropout = self.training and c.dropout > 0
        flex = c.attention == "sdpa" and (c.document_attention == "flex" or (c.document_attention == "auto"
                                                                            and pos.is_cuda and not dropout))
        if not flex:
            return document_mask(pos, c.attention, dtype)
        if not pos.is_cuda and torch.is_grad_enabled():
            raise ConfigError(f"model.document_attention='flex' cannot train on {pos.device.type}: FlexAttention has "
                              "no backward there; use --model.document_attention auto (or explicit)")
        return document_block_mask(pos)

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
        if self.wte.weight.is_meta:  # no values to draw (parameter counts, sizing, estimates)
            return
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
                    for part in m.weight.split(_qkv_rows(self.cfg), dim=0):
                        part.normal_(0.0, s)
                else:
                    m.weight.normal_(0.0, s)
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, (Experts, MoE)):  # MoE: its routing bias (model.moe_bias_update_rate)
                m.init_weights(std, proj_std)
            elif isinstance(m, NORMS):
                m.weight.fill_(1.0)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            if getattr(m, "use_mask_buffer", False):
                m.mask.copy_(causal_mask(m.mask.size(0), m.mask.device))
        self.reset_rope()

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Fill the rotary tables (computed in fp32, stored in the buffers' dtype)."""
        if self.cfg.pos_emb == "rope" and not self.rope_cos.is_meta:
            cos, sin = rope_tables(self.cfg, self.rope_cos.device)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) token ids, T <= block_size.

        Returns ``(logits, loss)``: logits (B, T, vocab_size) in the compute dtype; loss = mean
        cross-entropy over all B*T positions, computed on fp32 logits (in the logits' dtype when
        ``model.fp32_islands`` is off; over the padded columns too with ``model.loss_over_padded_vocab``;
        None without targets).
        With ``model.loss_impl='chunked'`` and targets, the head and loss run chunk by chunk
        (:mod:`tokenmill.model.loss`) and the logits are not returned: ``(None, loss)``; so with
        ``model.return_logits`` off and targets.
        Targets of -100 (``data.loss_mask``: tokens not learned) are skipped; ``reduction='sum'`` returns the
        sum over the other positions (0 when there is none), which the trainer divides by the global batch's
        learned-token count; 'mean' is the mean over them.

        A pipeline stage (:mod:`tokenmill.parallel.pipeline`) is a GPT with the parts of other stages
        removed: without ``wte`` it takes the previous stage's hidden states (B, T, C) instead of token
        ids; without ``ln_f`` it returns its hidden states; the last stage (``hidden_output``) returns
        the normalised hidden states, to which the schedule's loss function applies :meth:`head_loss`.
        """
        x = self.trunk(idx)
        if self.ln_f is None or self.hidden_output:  # a pipeline stage: its hidden states
            return x
        logits, loss = self.head_loss(x, targets, reduction)
        if loss is not None and self.training and self.cfg.moe_experts:  # router losses (model/moe.py)
            loss = loss + router_loss(self, targets, reduction)
        return logits, loss

    def trunk(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """Everything before the head: embeddings (or, on a later pipeline stage, the previous stage's
        hidden states), the blocks and the final norm (when this model holds it).

        :meth:`forward` calls ``self.trunk``, so compiling only this part (``model.trunk =
        torch.compile(model.trunk)``) leaves the head and the loss outside the compiled graph, eager,
        as a seed that compiles the model and computes the loss on its output does.
        ``cache`` (generation): ``idx`` holds the positions ``cache.pos ...`` only (see :meth:`generate`).
        """
        T, P = idx.shape[1], (cache.pos if cache is not None else 0)
        if P + T > self.cfg.block_size:
            raise ValueError(f"sequence length {P + T} exceeds model.block_size {self.cfg.block_size}")
        docs = cache is None and self.doc_eot_id is not None and self.wte is not None  # data.document_mask
        flagged = docs and self.doc_start_flag is not None  # data.chat_packing='pack': the ids carry the sequence starts
        idx, pos = flagged_document_positions(idx, self.doc_start_flag) if flagged else (idx, document_positions(idx, self.doc_eot_id) if docs else None)
        if self.wte is not None:
            x = self.wte(idx)
            if self.wpe is not None:
                at = pos if docs and self.doc_positions else torch.arange(P, P + T, device=idx.device)
                x = x + self.wpe(at)
            x = self.drop(x)
        else:  # a later pipeline stage: idx holds the previous stage's hidden states
            x = idx
        rope = (self.rope_cos, self.rope_sin) if self.cfg.pos_emb == "rope" else None
        if docs and self.doc_positions and rope is not None:  # each token's angles, (B, 1, T, head_width)
            rope = (rope[0][pos].unsqueeze(1), rope[1][pos].unsqueeze(1))
        mask = self.document_attention_mask(pos, _attention_dtype(x)) if docs else None
        for _, block in self.present_blocks():
            if cache is not None:
                x = block(x, rope, cache)
            else:
                x = block(x, rope, None, mask) if docs else block(x, rope)
        if cache is not None:
            cache.pos += T
        return self.ln_f(x) if self.ln_f is not None else x

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor | None,
                  reduction: str = "mean") -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The head (and the loss when ``targets`` is given, reduced as :meth:`forward` says) on the final
        normalised hidden states."""
        B, T = x.shape[:2]
        if targets is not None and self.cfg.loss_impl == "chunked":
            from tokenmill.model.loss import chunked_cross_entropy

            loss = chunked_cross_entropy(x.reshape(B * T, -1), self.lm_head.weight, targets.reshape(B * T),
                                         self._loss_vocab(), self.cfg.loss_chunk_size, reduction=reduction)
            return None, loss
        full = self.lm_head(x)
        logits = full[..., : self.vocab_size] if self.padded_vocab != self.vocab_size else full
        loss = None
        if targets is not None:
            scored = full if self._loss_vocab() != self.vocab_size else logits  # padded columns never predicted
            loss = F.cross_entropy(upcast(scored, self.cfg.fp32_islands).reshape(B * T, -1), targets.reshape(B * T),
                                   reduction=reduction)  # ignore_index -100: the targets data.loss_mask drops
            if not self.cfg.return_logits:  # model.return_logits: the loss alone (no compiled-graph output)
                return None, loss
        return logits, loss

    def _loss_vocab(self) -> int:
        """Columns of the head the loss is computed over: the true vocabulary, or with
        ``model.loss_over_padded_vocab`` all ``padded_vocab`` columns (as the seed's padding rung)."""
        return self.padded_vocab if self.cfg.loss_over_padded_vocab else self.vocab_size

    def present_blocks(self) -> list[tuple[int, nn.Module]]:
        """``(index, block)`` of the blocks this model holds (a pipeline stage replaces the blocks of
        other stages by ``nn.Identity``, keeping the indices and so the parameter names)."""
        return [(i, b) for i, b in enumerate(self.blocks) if not isinstance(b, nn.Identity)]

    def edge_units(self) -> list[tuple[list[nn.Module], bool]]:
        """The modules outside the blocks that FSDP shards as units of their own, each with whether it may be
        freed after its forward (see :func:`edge_units_apart`): the embeddings (gathered for their forward,
        again for their backward, the last) and the final norm with the head (gathered at the end of forward,
        kept for their backward, which comes at once, then freed). Only those this model (stage) holds."""
        if not edge_units_apart(self.cfg):
            return []
        units = [([m for m in (self.wte, self.wpe) if m is not None], True),
                 ([m for m in (self.ln_f, self.lm_head) if m is not None], False)]
        return [(mods, free) for mods, free in units if mods]

    def hidden_matrices(self) -> list[tuple[nn.Parameter, list[int] | None]]:
        """The blocks' 2-D weight matrices (attention and MLP projections), the "hidden" matrices that Muon
        orthogonalises, each with the row split of a fused matrix (the fused q/k/v ``c_attn`` is three
        matrices: its q, k and v rows) or None. Embeddings, the head, norm gains and biases are not among
        them. The parameters are the live ones (DTensors after TP or FSDP)."""
        out = []
        for _, block in self.present_blocks():
            for name, p in block.named_parameters():
                if p.ndim == 2:
                    fused = name.endswith("c_attn.weight")
                    out.append((p, _qkv_rows(self.cfg) if fused else None))
        return out

    # --- structure the parallel mechanisms ask the model for

    def keep_stage(self, keep: range, first: bool, last: bool) -> None:
        """Become one pipeline stage (in place): the blocks outside ``keep`` become ``nn.Identity``
        (indices, hence parameter names, stay those of the whole model); only the ``first`` stage keeps
        the embeddings; only the ``last`` keeps the final norm and the head, and returns the normalised
        hidden states (the schedule's loss function applies :meth:`head_loss`); the others return their
        hidden states. Every stage keeps the rotary tables (buffers, not parameters)."""
        for i in range(len(self.blocks)):
            if i not in keep:
                self.blocks[i] = nn.Identity()
        if not first:
            self.wte = self.wpe = None
        if not last:
            self.ln_f = self.lm_head = None
        else:
            self.hidden_output = True

    def tp_plan(self, tp: int) -> dict[str, str]:
        """The tensor-parallel plan of every block (:meth:`~tokenmill.model.layers.Block.tp_plan`: module
        path -> 'colwise' | 'rowwise' | 'per_head'), after checking that this model splits into ``tp`` whole-head
        shares. Embeddings, norms and the head stay replicated."""
        cfg = self.cfg
        if cfg.fused_qkv:
            raise ParallelError("parallel.tp > 1 needs --model.fused_qkv false (q, k, v are split by heads).")
        if cfg.n_head % tp or cfg.kv_heads % tp:
            raise ParallelError(f"model.n_head ({cfg.n_head}) and the key/value heads ({cfg.kv_heads}) must be "
                                f"divisible by parallel.tp ({tp}).")
        blocks = self.present_blocks()
        return blocks[0][1].tp_plan() if blocks else {}

    @torch.inference_mode()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        num_samples: int = 1,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled ids to the prompts ``idx`` (B, T) and return them all,
        (B * num_samples, T + max_new_tokens); the samples of prompt b are rows b*num_samples ... .

        Sampling (:func:`sample_next_token`): ``temperature`` <= 0 is greedy (argmax); else the logits
        are divided by it, ``top_k`` keeps the k most likely ids, ``top_p`` keeps the smallest set of
        most likely ids whose probability reaches p (nucleus), and one id is drawn (``generator``: the
        random stream, default torch's global one).

        ``use_cache``: keep each layer's keys and values (a KV cache), so a step runs the model on the
        new token only: generation is linear in length while the sequence fits in ``block_size``.
        Beyond it the context is cropped to the last ``block_size`` tokens, whose positions all shift
        at every step, so each further step runs the whole window (as without the cache). Both paths
        give the same tokens. Runs under ``torch.inference_mode`` and in eval mode (no dropout); the
        module's train/eval mode is restored afterwards.
        """
        if idx.dim() != 2 or idx.size(1) < 1:
            raise SampleError(f"the prompt must be a (batch, length >= 1) tensor of ids, got shape {tuple(idx.shape)}.")
        if max_new_tokens < 0 or num_samples < 1:
            raise SampleError(f"max_new_tokens must be >= 0 and num_samples >= 1, got {max_new_tokens} and {num_samples}.")
        check_sampling(top_k, top_p)
        if num_samples > 1:
            idx = idx.repeat_interleave(num_samples, dim=0)
        was_training = self.training
        self.eval()
        try:
            bs = self.cfg.block_size
            cache: KVCache | None = None
            for _ in range(max_new_tokens):
                if use_cache and idx.size(1) <= bs:  # positions are stable: only new tokens run
                    if cache is None:
                        cache = KVCache(len(self.blocks), bs)
                    logits = self._last_logits(idx[:, cache.pos:], cache)
                else:
                    logits = self(idx[:, -bs:])[0][:, -1, :]
                nxt = sample_next_token(logits, temperature, top_k, top_p, generator)
                idx = torch.cat((idx, nxt), dim=1)
        finally:
            self.train(was_training)
        return idx

    def _last_logits(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, vocab_size) of the last position, running only the new tokens ``idx`` (B, T) at
        positions ``cache.pos ...`` through the same forward as training, attending to (and extending)
        the cached keys and values."""
        x = self.trunk(idx, cache)
        return self.lm_head(x[:, -1, :])[..., : self.vocab_size]

    def num_params(self, exclude_embeddings: bool = False, exclude_position: bool = False) -> int:
        """Number of unique parameters (a tied head/embedding matrix counts once; padding rows count).

        ``exclude_position``: without the position embeddings (nanoGPT's "non-embedding" count; not the
        N of the FLOPs count, which is :func:`tokenmill.model.flops.flop_params`). ``exclude_embeddings``: without the
        position AND token embeddings (Kaplan et al.). When tied, the shared matrix is the token
        embedding and is excluded too; an untied head is an ordinary projection and stays counted.
        """
        n = sum(p.numel() for p in self.parameters())
        if (exclude_position or exclude_embeddings) and self.wpe is not None:
            n -= self.wpe.weight.numel()
        if exclude_embeddings:
            n -= self.wte.weight.numel()
        return n


def _attention_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention will run in: autocast's on ``x``'s device when autocast is on, else ``x``'s."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def _qkv_rows(cfg: ModelConfig) -> list[int]:
    """Rows of q, k and v in the fused ``c_attn`` matrix (grouped-query: k and v have fewer)."""
    return [cfg.n_head * cfg.head_width, cfg.kv_heads * cfg.head_width, cfg.kv_heads * cfg.head_width]


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
                for n, part in zip("qkv", sd.pop(key).split(_qkv_rows(model.cfg), dim=0)):
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
