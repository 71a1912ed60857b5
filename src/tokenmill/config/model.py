"""The model section of the config: the architecture (the family) and how each part runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from tokenmill.config.field import F
from tokenmill.errors import ConfigError


@dataclass
class ModelConfig:
    """The GPT model. Baseline and optimised forms differ only by these fields."""

    vocab_size: Optional[int] = F(
        None, "Vocabulary size. None: taken from the data's metadata. Must be >= the data's vocabulary.",
        ge=1, shape="arch",
    )
    vocab_pad_multiple: int = F(
        1,
        "Pad the embedding/output vocabulary up to a multiple of this (64 for tensor cores; 1 = no padding). "
        "The head is computed on the padded matrix and the padded columns are sliced off the logits, so "
        "they are never predicted and do not change the loss.",
        ge=1, shape="layout",
    )
    block_size: int = F(1024, "Context length in tokens (sequence length of every training window).", ge=1, shape="layout")
    n_layer: int = F(12, "Number of transformer blocks.", ge=1, shape="arch")
    n_head: int = F(12, "Number of attention (query) heads.", ge=1, shape="arch")
    n_embd: int = F(
        768, "Embedding (model) width; must be divisible by n_head unless model.head_dim is set.", ge=1, shape="arch")
    dropout: float = F(0.0, "Dropout probability on embeddings, attention weights and residual branches.", ge=0, lt=1)
    bias: bool = F(True, "Bias in Linear layers (other than q/k/v) and LayerNorms.", shape="arch")
    qkv_bias: bool = F(True, "Bias in the query/key/value projections (Qwen2: true with bias false).", shape="arch")
    tie_embeddings: bool = F(
        True, "Share the token-embedding matrix with the output head (GPT-2, Llama 3.2, Qwen 0.5-4B, SmolLM).",
        shape="arch")
    attention: Literal["manual", "sdpa"] = F(
        "sdpa",
        "Attention kernel: 'manual' = explicit q@k^T, causal mask, softmax, @v; 'sdpa' = "
        "torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient / cuDNN kernels).",
    )
    sdpa_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = F(
        "auto", "Force one SDPA backend (attention='sdpa' only); 'auto' lets PyTorch pick."
    )
    document_attention: Literal["auto", "flex", "explicit"] = F(
        "auto",
        "How SDPA attention keeps documents apart (data.document_mask): 'flex' = FlexAttention with a block "
        "mask built once per forward from the document boundaries (causal AND same document; tiles of other "
        "documents skipped, no T x T mask, grouped k/v heads native; compiled on CUDA); 'explicit' = SDPA with "
        "the (batch, 1, T, T) additive mask (the reference path, no flash kernel); 'auto' = 'flex' on CUDA, "
        "'explicit' on the CPU and MPS (FlexAttention has no backward there) and while training with "
        "model.dropout > 0 (FlexAttention has no attention dropout). 'flex' is refused for training on the CPU "
        "and with model.dropout > 0. model.attention='manual' always uses the explicit mask.",
    )
    causal_mask: Literal["buffer", "on_the_fly"] = F(
        "on_the_fly",
        "Manual attention only: 'buffer' keeps a (block_size x block_size) triu mask as a registered "
        "buffer; 'on_the_fly' builds it for the current length each forward.",
    )
    fused_qkv: bool = F(
        True, "One fused Linear for q, k, v instead of three separate ones.", shape="layout")
    norm: Literal["native", "manual", "triton"] = F(
        "native",
        "LayerNorm: 'native' = nn.LayerNorm (fused kernel); 'manual' = hand-written mean/var module; "
        "'triton' = tokenmill's fused Triton forward and backward kernels (model/kernels; needs the triton "
        "package and a CUDA GPU). All three: same parameters, same math.",
    )
    gelu: Literal["native", "manual"] = F(
        "native", "tanh-GELU: 'native' = nn.GELU(approximate='tanh'); 'manual' = hand-written formula."
    )
    init_std: float = F(
        0.02, "GPT-2 initialisation: std of Linear/Embedding weights; residual projections get std/sqrt(2*n_layer).",
        gt=0,
    )
    loss_impl: Literal["full", "chunked"] = F(
        "full",
        "'full' = head over all tokens, then cross-entropy on the (B*T, vocab) logits; 'chunked' = head + "
        "cross-entropy over model.loss_chunk_size tokens at a time, gradients computed chunk by chunk, so "
        "the full logits are never materialised (training returns no logits). Same loss and gradients.",
    )
    loss_chunk_size: int = F(1024, "Tokens per chunk for model.loss_impl='chunked'.", ge=1)
    return_logits: bool = F(
        True,
        "With targets (training, evaluation), return the logits beside the loss. False: the forward returns "
        "(None, loss). With the loss compiled (compile.enabled without compile.loss_outside, either scope) the "
        "logits are then no output of the compiled graph: backward needs no zero gradient for them and the "
        "graph keeps one (batch x seq x vocab) buffer fewer (several GiB at batch 64 for GPT-2). Nothing to save "
        "eagerly or with the loss outside the graph (the trainer drops the logits at once) nor with the "
        "chunked loss (no logits). Same loss and gradients.",
    )
    fp32_islands: bool = F(
        True,
        "Compute the numerically sensitive ops in fp32 when the model runs in bf16/fp16 weights: the "
        "hand-written LayerNorm (model.norm='manual'), the manual attention's softmax and the "
        "cross-entropy (on fp32 logits). False = everything in the model's dtype, as the LLM-training-speed "
        "README's pure-bf16 rungs run (less memory and traffic, less accurate loss). No effect in fp32 or "
        "under autocast, nor on the native/triton LayerNorm and SDPA kernels (fp32 statistics inside) or "
        "the chunked loss (fp32 chunks).",
    )
    # --- architecture (the family): GPT-2 = the defaults; Llama/Qwen/SmolLM = rope + rmsnorm + swiglu
    pos_emb: Literal["learned", "rope"] = F(
        "learned",
        "Positions: 'learned' = a block_size x n_embd position embedding added to the tokens (GPT-2); 'rope' "
        "= rotary embeddings applied to q and k in every attention (Llama, Qwen, SmolLM; no position "
        "parameters).",
        shape="arch",
    )
    rope_theta: float = F(10000.0, "RoPE base frequency (model.pos_emb='rope'; Llama 3: 500000).", gt=0, shape="arch")
    rope_scaling: Literal["none", "llama3"] = F(
        "none",
        "RoPE frequency scaling: 'none'; 'llama3' = the frequency-dependent scaling Llama 3.1/3.2 declare in "
        "their config.json rope_scaling (rope_type 'llama3', with model.rope_factor, rope_low_freq_factor, "
        "rope_high_freq_factor and rope_original_context).",
        shape="arch",
    )
    rope_factor: float = F(8.0, "model.rope_scaling='llama3': the scaling factor.", ge=1, shape="arch")
    rope_low_freq_factor: float = F(1.0, "model.rope_scaling='llama3': low_freq_factor.", gt=0, shape="arch")
    rope_high_freq_factor: float = F(4.0, "model.rope_scaling='llama3': high_freq_factor.", gt=0, shape="arch")
    rope_original_context: int = F(
        8192, "model.rope_scaling='llama3': original_max_position_embeddings.", ge=1, shape="arch")
    norm_type: Literal["layernorm", "rmsnorm"] = F(
        "layernorm",
        "Normalisation: 'layernorm' (mean and variance, weight and bias per model.bias; GPT-2) or 'rmsnorm' "
        "(root mean square, weight only; Llama, Qwen). model.norm picks how it runs (native / manual).",
        shape="arch",
    )
    norm_eps: float = F(1e-5, "Epsilon of every norm (GPT-2 1e-5; Llama 3 and Qwen 1e-5 or 1e-6).", gt=0, shape="arch")
    mlp: Literal["gelu", "swiglu"] = F(
        "gelu",
        "Feed-forward: 'gelu' = Linear(C, I) -> tanh-GELU -> Linear(I, C) (GPT-2); 'swiglu' = "
        "Linear(I, C)(silu(gate(x)) * up(x)) (Llama, Qwen, SmolLM).",
        shape="arch",
    )
    intermediate_size: Optional[int] = F(
        None, "Hidden width I of the MLP. None: 4 * n_embd.", ge=1, shape="arch")
    n_kv_head: Optional[int] = F(
        None,
        "Key/value heads: None = n_head (multi-head attention); fewer = grouped-query attention (each k/v "
        "head serves n_head / n_kv_head query heads; 1 = multi-query). Must divide n_head.",
        ge=1, shape="arch",
    )
    head_dim: Optional[int] = F(
        None, "Width of one attention head. None: n_embd / n_head (Qwen3 declares its own, e.g. 128).",
        ge=1, shape="arch",
    )
    qk_norm: bool = F(
        False, "RMSNorm over each head of q and k before RoPE (Qwen3), with its own weight of head_dim.",
        shape="arch",
    )
    # --- mixture of experts (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, DeepSeek-style shared experts): model/moe.py
    moe_experts: int = F(
        0,
        "Routed experts in each sparse layer (0 = a dense model: every layer's MLP is model.mlp). A sparse "
        "layer's MLP is a router (Linear(C, experts), no bias) and that many SwiGLU experts without biases; "
        "each token goes through its model.moe_top_k experts, weighted by its router scores. Dropless: every "
        "token reaches all its experts (no capacity factor, nothing is dropped).",
        ge=0, shape="arch",
    )
    moe_top_k: int = F(
        2, "Experts each token is routed to (num_experts_per_tok: Mixtral 2, Qwen3-MoE and OLMoE 8); at most "
        "model.moe_experts.", ge=1, shape="arch")
    moe_intermediate_size: Optional[int] = F(
        None, "Hidden width of one routed expert. None: model.intermediate_size (Mixtral); Qwen3-MoE and OLMoE "
        "declare their own (moe_intermediate_size).", ge=1, shape="arch")
    moe_shared_experts: int = F(
        0, "Shared experts every token goes through besides its routed ones, run as one SwiGLU MLP of "
        "model.moe_shared_experts x model.moe_shared_intermediate_size hidden units (Qwen2-MoE 1, DeepSeek 1-2; "
        "0 = none).", ge=0, shape="arch")
    moe_shared_intermediate_size: Optional[int] = F(
        None, "Hidden width of one shared expert. None: the routed experts' width.", ge=1, shape="arch")
    moe_shared_gate: bool = F(
        False, "Scale the shared experts' output per token by sigmoid(Linear(C, 1)(x)) (Qwen2-MoE's "
        "shared_expert_gate); false: added as it is (DeepSeek).", shape="arch")
    moe_every: int = F(
        1, "Which layers are sparse: layer i (from 0) when (i + 1) % moe_every == 0 (Qwen's decoder_sparse_step; "
        "1 = every layer) and i is not in model.moe_dense_layers; the others keep the dense model.mlp of "
        "model.intermediate_size.", ge=1, shape="arch")
    moe_dense_layers: str = F(
        "", "Comma-separated layer indices (from 0) that stay dense whatever model.moe_every says (Qwen's "
        "mlp_only_layers; DeepSeek's first dense layers: '0,1,2'). Empty: none.", shape="arch")
    moe_router: Literal["softmax-topk", "softmax-topk-renorm", "topk-softmax"] = F(
        "softmax-topk-renorm",
        "How router logits become expert weights: 'softmax-topk' = softmax over all experts, the k largest "
        "probabilities as they are (Qwen3-MoE/Qwen2-MoE with norm_topk_prob false, OLMoE); "
        "'softmax-topk-renorm' = the same k probabilities divided by their sum (Mixtral, Qwen3-MoE with "
        "norm_topk_prob true); 'topk-softmax' = the k largest logits, then a softmax over them only (Mistral's "
        "reference code: the same weights as 'softmax-topk-renorm' up to rounding).",
        shape="arch",
    )
    moe_aux_loss_coef: float = F(
        0.01,
        "Load-balancing loss coefficient (Switch Transformer / Mixtral, computed as transformers' "
        "load_balancing_loss_func over all sparse layers together: experts x sum over experts of (share of "
        "routed slots) x (mean router probability)). The model adds coef x this loss to the training loss "
        "(training mode with targets; validation losses stay pure cross-entropy). 0 = off. Mixtral and "
        "Qwen3-MoE declare 0.001 (router_aux_loss_coef), OLMoE 0.01.",
        ge=0,
    )
    moe_z_loss_coef: float = F(
        0.0,
        "Router z-loss coefficient (ST-MoE): coef x the mean over sparse layers and tokens of "
        "logsumexp(router logits)^2 is added to the training loss, keeping router logits small. 0 = off "
        "(OLMoE trained with 0.001).",
        ge=0,
    )
    moe_bias_update_rate: float = F(
        0.0,
        "DeepSeek-V3's auxiliary-loss-free load balancing: each sparse layer keeps a per-expert bias (a buffer, "
        "saved in checkpoints, never trained by the optimizer) added to the routing scores only to choose each "
        "token's experts (the weights stay the unbiased scores; the scores are the router probabilities, or the "
        "logits under 'topk-softmax'); after every optimizer step each expert's bias moves by rate x "
        "sign(mean load - its load) over the step's routed slots of all data-parallel ranks. 0 = off; "
        "DeepSeek-V3 used 0.001 (usually with model.moe_aux_loss_coef 0 or tiny). Export to a Hugging Face "
        "class without such a bias is refused once the bias is non-zero. Under train.precision 'bf16' the bias is "
        "bf16 like every buffer (a step of 0.001 is lost once the bias reaches 0.5).",
        ge=0,
    )
    moe_impl: Literal["auto", "grouped", "loop"] = F(
        "auto",
        "How the routed experts run: 'grouped' = tokens sorted by expert and all experts as one grouped "
        "matrix product per projection (torch._grouped_mm: no Python loop, no host sync, compile-friendly; "
        "CUDA needs sm90+ and bf16 there); 'loop' = one matmul per expert that has tokens (the reference; "
        "syncs with the host); 'auto' = 'grouped' where torch._grouped_mm runs for the device and dtype, "
        "else 'loop'.",
    )
    qk_norm_width: Literal["head", "all"] = F(
        "head",
        "With model.qk_norm: 'head' = one RMSNorm over each head of q and of k, weights of head_dim (Qwen3); "
        "'all' = one RMSNorm over all of q's features (n_head x head_dim) and one over all of k's, before they "
        "are split into heads (OLMoE, OLMo 2). Not with parallel.tp.",
        shape="arch",
    )
    loss_over_padded_vocab: bool = F(
        False,
        "With vocabulary padding: compute the cross-entropy over all padded_vocab columns, as the "
        "LLM-training-speed README's vocab-padding rung does (its padded columns then join the softmax "
        "and are trained towards -inf). False (correct): the padded columns are sliced off first and "
        "never touch the loss.",
    )

    # derived sizes: the one place the None defaults are read
    @property
    def head_width(self) -> int:
        """Width of one attention head: model.head_dim, else n_embd / n_head."""
        return self.head_dim or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: model.n_kv_head, else n_head."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        """Hidden width of the MLP: model.intermediate_size, else 4 * n_embd."""
        return self.intermediate_size or 4 * self.n_embd

    @property
    def expert_width(self) -> int:
        """Hidden width of one routed expert: model.moe_intermediate_size, else the MLP width."""
        return self.moe_intermediate_size or self.mlp_width

    @property
    def shared_width(self) -> int:
        """Hidden width of the shared experts together (0 without shared experts)."""
        return self.moe_shared_experts * (self.moe_shared_intermediate_size or self.expert_width)

    def sparse_layers(self) -> list[int]:
        """The layers whose MLP is the mixture of experts (none when model.moe_experts is 0)."""
        if not self.moe_experts:
            return []
        dense = set(_layer_list(self.moe_dense_layers, None))  # checked against n_layer by check_moe
        return [i for i in range(self.n_layer) if (i + 1) % self.moe_every == 0 and i not in dense]


def _layer_list(text: str, n_layer: int | None) -> list[int]:
    """The layer indices of model.moe_dense_layers, each checked (an integer, listed once, and with ``n_layer``
    in 0 .. n_layer - 1; without it, a model cut to fewer layers, e.g. one block counted on meta, ignores the
    indices beyond its depth)."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            i = int(part)
        except ValueError:
            raise ConfigError(f"model.moe_dense_layers: {part!r} is not a layer index (comma-separated integers, "
                              f"e.g. '0,1').") from None
        if i < 0 or i in out or (n_layer is not None and i >= n_layer):
            why = "listed twice" if i in out else f"outside 0 .. {(n_layer or 1) - 1} (model.n_layer is {n_layer})"
            raise ConfigError(f"model.moe_dense_layers: layer {i} is {why}.")
        out.append(i)
    return out


def check_moe(m: ModelConfig) -> None:
    """The mixture-of-experts fields that only make sense together (one line naming the field)."""
    if not m.moe_experts:
        return
    _layer_list(m.moe_dense_layers, m.n_layer)
    if m.moe_top_k > m.moe_experts:
        raise ConfigError(f"model.moe_top_k ({m.moe_top_k}) must be at most model.moe_experts ({m.moe_experts}): "
                          "a token cannot go to more experts than there are.")
    if m.mlp != "swiglu":
        raise ConfigError(f"model.moe_experts > 0 needs --model.mlp swiglu: the experts are SwiGLU MLPs "
                          f"(model.mlp={m.mlp!r} would leave the dense layers a different MLP).")
    if not m.sparse_layers():
        raise ConfigError(f"model.moe_every ({m.moe_every}) and model.moe_dense_layers ({m.moe_dense_layers!r}) "
                          f"leave no sparse layer among the {m.n_layer}: set --model.moe_experts 0 for a dense model.")
