"""Convert between tokenmill's :class:`~tokenmill.model.GPT` and the Hugging Face Llama family:
``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM`` and ``MistralForCausalLM``.

Pure functions of configs and tensors; :mod:`tokenmill.model.hf` reads and writes the folders and
picks the family (GPT-2 or this one) by the config's ``architectures`` / ``model_type``.

The four classes are one decoder, which tokenmill computes with ``model.pos_emb='rope'`` (the
rotate-half layout), ``norm_type='rmsnorm'``, ``mlp='swiglu'``, grouped-query attention
(``n_kv_head``), an explicit ``head_dim``; they differ in their biases and q/k norms:

==================  =====================================  ======================================
class               config.json                            tokenmill
==================  =====================================  ======================================
Llama               attention_bias, mlp_bias (both or       qkv_bias = bias = attention_bias
                    neither)
Qwen2               q/k/v biases, none elsewhere            qkv_bias=true, bias=false
Qwen3               q_norm, k_norm; attention_bias false    qk_norm=true, no biases
Mistral             no biases; sliding_window null or       no biases; block_size <= the window
                    >= the context
==================  =====================================  ======================================

Weights: ``model.embed_tokens`` = ``wte``, ``model.layers.N.{input_layernorm, post_attention_layernorm}``
= ``blocks.N.{ln_1, ln_2}``, ``self_attn.{q,k,v}_proj`` = ``attn.{q,k,v}_proj`` (or the fused
``attn.c_attn``), ``self_attn.o_proj`` = ``attn.c_proj``, ``self_attn.{q,k}_norm`` = ``attn.{q,k}_norm``,
``mlp.{gate,up,down}_proj`` = ``mlp.{c_gate,c_fc,c_proj}``, ``model.norm`` = ``ln_f``, ``lm_head`` =
``lm_head`` (absent when tied). ``max_position_embeddings`` is the largest ``block_size``.

Keys a config.json leaves out take transformers' defaults for its class. What tokenmill cannot compute
exactly stops with a :class:`~tokenmill.errors.CheckpointError` naming the field and its value: another
``rope_scaling`` type, a sliding window shorter than the context, mixture-of-experts or quantization
fields, ``hidden_act`` other than silu, ``attention_dropout``, biases tokenmill's two switches cannot
express, a null where a number is needed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Optional

import torch

from tokenmill.config import ModelConfig, shape_fields
from tokenmill.errors import CheckpointError
from tokenmill.filecheck import get
from tokenmill.model.gpt import GPT, adapt_state_dict

__all__ = ["ARCHITECTURES", "Spec", "check_config", "check_context", "export_architecture", "from_hf_state_dict",
           "hf_config", "model_fields", "spec_of_model", "strip_wrappers", "to_hf_state_dict"]

DENSE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "MistralForCausalLM": "mistral"}  # class -> model_type
MOE = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen2MoeForCausalLM": "qwen2_moe",
       "OlmoeForCausalLM": "olmoe"}
ARCHITECTURES = {**DENSE, **MOE}  # MOE: mixtures of experts, converted by model/hf_moe.py (model/hf_families.py picks)

# transformers' defaults (4.4x and 5.x agree) for the keys a config.json may leave out
_COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_dropout": 0.0,
           "rope_theta": 10000.0, "num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096,
           "head_dim": None, "attention_bias": False, "mlp_bias": False}
_QWEN = {"vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32, "max_position_embeddings": 32768,
         "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28}
_DEFAULTS = {
    "llama": {**_COMMON, "vocab_size": 32000, "intermediate_size": 11008, "num_key_value_heads": None,
              "max_position_embeddings": 2048},
    "qwen2": {**_COMMON, **_QWEN},
    "qwen3": {**_COMMON, **_QWEN, "head_dim": 128},
    "mistral": {**_COMMON, "vocab_size": 32000, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
}
# (bias, qkv_bias, qk_norm) each class can hold
_FORMS = {"LlamaForCausalLM": ((False, False, False), (True, True, False)), "MistralForCausalLM": ((False, False, False),),
          "Qwen2ForCausalLM": ((False, True, False),), "Qwen3ForCausalLM": ((False, False, True),)}
_UNSUPPORTED_KEYS = re.compile(r"expert|moe|router|quantization|softcap|mrope")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class Spec:
    """A Llama-family model, every number resolved: what both directions map."""

    architecture: str
    vocab_size: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    theta: float
    llama3: Optional[tuple[float, float, float, int]]  # factor, low, high, original context
    tie: bool
    bias: bool  # o_proj and the MLP
    qkv_bias: bool
    qk_norm: bool
    max_positions: int
    window: Optional[int] = None  # a sliding window in use (None: full attention)

    @property
    def context(self) -> int:
        """The longest context tokenmill computes exactly: max_position_embeddings, or the window."""
        return min(self.max_positions, self.window) if self.window else self.max_positions


# ----------------------------------------------------------------------------------------------
# config.json -> Spec


def _get(c: Mapping[str, Any], d: Mapping[str, Any], key: str, where: str, kind: type = int,
         nullable: bool = False) -> Any:
    """``c[key]`` (``d[key]`` when absent), checked: a positive int / float, or None when ``nullable``."""
    v = c.get(key, d.get(key))
    if v is None:
        if nullable:
            return None
        raise CheckpointError(f"{where}: '{key}' is null; tokenmill needs a number there.")
    return get({key: v}, key, kind, where, err=CheckpointError, **({"lo": 1} if kind is int else {"gt": 0}))


def _flag(c: Mapping[str, Any], d: Mapping[str, Any], key: str, where: str) -> bool:
    """``c[key]`` (``d[key]`` when absent or null) as a JSON boolean: the string "false" is refused."""
    return bool(get(c, key, bool, where, err=CheckpointError, default=d[key], nullable=True) or False)


def _rope(c: Mapping[str, Any], d: Mapping[str, Any], max_pos: int, where: str):
    """``(rope_theta, llama3 parameters or None)`` from ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` + ``rope_theta`` (transformers 4)."""
    key = "rope_scaling" if c.get("rope_scaling") is not None else "rope_parameters"  # as transformers 4 and 5
    rp = c.get(key) or {}
    if not isinstance(rp, dict) or any(isinstance(v, dict) for v in rp.values()):
        raise CheckpointError(f"{where}: '{key}' is {rp!r}; tokenmill computes one rotary embedding for every "
                              "layer (a dict with rope_type and rope_theta).")
    theta = _get({**c, **rp}, d, "rope_theta", where, float)
    kind = rp.get("rope_type", rp.get("type", "default"))
    prf = rp.get("partial_rotary_factor", c.get("partial_rotary_factor"))
    if prf not in (None, 1, 1.0):
        raise CheckpointError(f"{where}: partial_rotary_factor is {prf!r}; tokenmill rotates whole heads only.")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise CheckpointError(f"{where}: '{key}' has rope_type {kind!r}; tokenmill computes 'default' and 'llama3' "
                              "rotary embeddings only (model.rope_scaling).")
    rp = {"original_max_position_embeddings": max_pos, **rp}
    if c.get("original_max_position_embeddings") is not None:  # outside the dict, it wins (as in transformers)
        rp["original_max_position_embeddings"] = c["original_max_position_embeddings"]
    for k in _LLAMA3_KEYS:
        if k not in rp:
            raise CheckpointError(f"{where}: '{key}' of rope_type 'llama3' lacks '{k}'.")
    f, lo, hi = (_get(rp, {}, k, f"{where}: {key}", float) for k in _LLAMA3_KEYS[:3])
    if hi <= lo:
        raise CheckpointError(f"{where}: {key} high_freq_factor ({hi}) must exceed low_freq_factor ({lo}).")
    return theta, (f, lo, hi, _get(rp, {}, _LLAMA3_KEYS[3], f"{where}: {key}"))


def _window(c: Mapping[str, Any], d: Mapping[str, Any], mt: str, layers: int, where: str) -> Optional[int]:
    """The sliding window a config uses (None: full attention in every layer)."""
    if mt == "llama":
        return None
    if mt in ("qwen2", "qwen3") and not _flag(c, d, "use_sliding_window", where):
        return None
    w = _get(c, d, "sliding_window", where, nullable=True)
    if w is None or mt == "mistral":
        return w
    types = c.get("layer_types")
    if isinstance(types, list):
        sliding = any(t == "sliding_attention" for t in types)
    else:
        sliding = layers > (_get(c, d, "max_window_layers", where, nullable=True) or 0)
    return w if sliding else None


def _biases(c: Mapping[str, Any], d: Mapping[str, Any], mt: str, where: str) -> tuple[bool, bool]:
    """``(bias, qkv_bias)``: tokenmill's two bias switches for the class's biases."""
    if mt == "qwen2":
        return False, True
    if mt == "mistral":
        return False, False
    ab, mb = _flag(c, d, "attention_bias", where), _flag(c, d, "mlp_bias", where)
    if mt == "qwen3" and ab:
        raise CheckpointError(f"{where}: attention_bias is true: Qwen3 then has a bias in o_proj but none in the MLP, "
                              "which tokenmill cannot express (model.bias covers both).")
    if mt == "llama" and ab != mb:
        raise CheckpointError(f"{where}: attention_bias is {str(ab).lower()} but mlp_bias is {str(mb).lower()}; "
                              "tokenmill's model.bias covers o_proj and the MLP together, so both must be equal.")
    return ab, ab


def check_config(c: Mapping[str, Any], architecture: str, where: str) -> Spec:
    """The :class:`Spec` of a config.json of ``architecture`` (a key of :data:`ARCHITECTURES`), or a
    :class:`CheckpointError` naming the field tokenmill cannot compute exactly."""
    mt = ARCHITECTURES[architecture]
    d = _DEFAULTS[mt]
    for k, v in c.items():
        if _UNSUPPORTED_KEYS.search(k) and v not in (None, False, 0, [], {}):
            raise CheckpointError(f"{where}: '{k}' is {v!r}: a mixture-of-experts, quantized or capped model is not "
                                  f"the dense {architecture} tokenmill computes.")
    act = c.get("hidden_act", d["hidden_act"])
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{where}: hidden_act is {act!r}; tokenmill's SwiGLU MLP computes silu.")
    drop = c.get("attention_dropout", d["attention_dropout"])
    if drop not in (None, 0, 0.0):
        raise CheckpointError(f"{where}: attention_dropout is {drop!r}; tokenmill's dropout (model.dropout) also "
                              "drops embeddings and residuals, so it cannot train this model as it was; set it to 0.")
    C, H = _get(c, d, "hidden_size", where), _get(c, d, "num_attention_heads", where)
    kv = _get(c, d, "num_key_value_heads", where, nullable=True) or H
    hd = _get(c, d, "head_dim", where, nullable=mt != "qwen3")
    if hd is None:
        if C % H:
            raise CheckpointError(f"{where}: hidden_size ({C}) is not divisible by num_attention_heads ({H}) "
                                  "and head_dim is not set.")
        hd = C // H
    if H % kv or hd % 2:
        raise CheckpointError(f"{where}: num_key_value_heads ({kv}) must divide num_attention_heads ({H}) and "
                              f"head_dim ({hd}) must be even.")
    L, max_pos = _get(c, d, "num_hidden_layers", where), _get(c, d, "max_position_embeddings", where)
    theta, llama3 = _rope(c, d, max_pos, where)
    bias, qkv_bias = _biases(c, d, mt, where)
    tie = _flag(c, d, "tie_word_embeddings", where)
    return Spec(architecture, _get(c, d, "vocab_size", where), C, _get(c, d, "intermediate_size", where), L, H,
                kv, hd, _get(c, d, "rms_norm_eps", where, float), theta, llama3, bool(tie), bias, qkv_bias,
                mt == "qwen3", max_pos, _window(c, d, mt, L, where))


def model_fields(s: Spec) -> dict[str, Any]:
    """The tokenmill ``model.*`` fields ``s`` fixes: every architecture field (``shape_fields()``) and
    ``block_size`` (its longest context). A fine-tuning run takes these from the source."""
    default = ModelConfig()
    f = {name: getattr(default, name) for name in shape_fields()}
    f.update(vocab_size=s.vocab_size, block_size=s.context, n_layer=s.layers, n_head=s.heads, n_embd=s.hidden,
             n_kv_head=s.kv_heads, head_dim=s.head_dim, intermediate_size=s.intermediate, pos_emb="rope",
             rope_theta=s.theta, rope_scaling="none", norm_type="rmsnorm", norm_eps=s.eps, mlp="swiglu", bias=s.bias,
             qkv_bias=s.qkv_bias, qk_norm=s.qk_norm, tie_embeddings=s.tie)
    if s.llama3:
        f.update(rope_scaling="llama3", rope_factor=s.llama3[0], rope_low_freq_factor=s.llama3[1],
                 rope_high_freq_factor=s.llama3[2], rope_original_context=s.llama3[3])
    return f


def check_context(s: Spec, block_size: int, where: str) -> None:
    """A :class:`CheckpointError` when ``block_size`` is longer than ``s`` computes exactly."""
    if block_size > s.max_positions:
        raise CheckpointError(f"{where}: model.block_size {block_size} exceeds the model's max_position_embeddings "
                              f"{s.max_positions}. Fix: use a block_size <= {s.max_positions}.")
    if s.window and block_size > s.window:
        raise CheckpointError(
            f"{where}: sliding_window is {s.window}: {s.architecture} attends only to the last {s.window} positions, "
            f"tokenmill's attention to all of them, so model.block_size {block_size} would change the model. Fix: "
            f"use a block_size <= {s.window}.")


# ----------------------------------------------------------------------------------------------
# State dicts


def strip_wrappers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the prefixes torch.compile (``_orig_mod.``), DDP (``module.``) and activation checkpointing add
    to names (for every family: :mod:`tokenmill.model.hf` uses it too)."""
    out = {}
    for k, v in sd.items():
        while k.startswith(("_orig_mod.", "module.")):
            k = k.split(".", 1)[1]
        out[k.replace("._orig_mod.", ".").replace("._checkpoint_wrapped_module.", ".")] = v
    return out


def _layer_map(s: Spec) -> list[tuple[str, str, tuple[int, ...]]]:
    """(Hugging Face name under ``layers.N.``, tokenmill name under ``blocks.N.`` with separate q/k/v,
    shape) of every tensor of one layer."""
    C, hid, q, kv = s.hidden, s.intermediate, s.heads * s.head_dim, s.kv_heads * s.head_dim
    rows = [("input_layernorm", "ln_1", (C,)), ("post_attention_layernorm", "ln_2", (C,)),
            ("self_attn.q_proj", "attn.q_proj", (q, C)), ("self_attn.k_proj", "attn.k_proj", (kv, C)),
            ("self_attn.v_proj", "attn.v_proj", (kv, C)), ("self_attn.o_proj", "attn.c_proj", (C, q)),
            ("mlp.gate_proj", "mlp.c_gate", (hid, C)), ("mlp.up_proj", "mlp.c_fc", (hid, C)),
            ("mlp.down_proj", "mlp.c_proj", (C, hid))]
    out = [(f"{h}.weight", f"{t}.weight", shape) for h, t, shape in rows]
    if s.qk_norm:
        out += [("self_attn.q_norm.weight", "attn.q_norm.weight", (s.head_dim,)),
                ("self_attn.k_norm.weight", "attn.k_norm.weight", (s.head_dim,))]
    biased = [r for r in rows[2:5] if s.qkv_bias] + [r for r in rows[5:] if s.bias]
    return out + [(f"{h}.bias", f"{t}.bias", shape[:1]) for h, t, shape in biased]


def _taker(sd: Mapping[str, torch.Tensor], used: set[str], missing: str, shapes: str):
    def take(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in sd:
            raise CheckpointError(missing.format(key=key))
        t = sd[key]
        if tuple(t.shape) != shape:
            raise CheckpointError(shapes.format(key=key, shape=tuple(t.shape), expected=shape))
        used.add(key)
        return t

    return take


def _check_used(sd: Mapping[str, torch.Tensor], used: set[str], message: str) -> None:
    extra = sorted(k for k in sd if k not in used)
    if extra:
        raise CheckpointError(message.format(extra=", ".join(extra[:5]) + (" ..." if len(extra) > 5 else "")))


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], hf_cfg: Mapping[str, Any], architecture: str,
                       base: ModelConfig | None = None, block_size: int | None = None,
                       where: str = "the weights") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A config.json dict + state dict of ``architecture`` -> ``(ModelConfig, tokenmill state dict)``.

    ``base`` supplies the fields that do not change the function (attention kernel, fused or separate
    q/k/v, norm form, vocabulary padding, dropout, loss form...); :func:`model_fields` come from the
    config. ``block_size`` (default: the longest exact context) may be shorter. The state dict matches
    ``GPT(cfg, cfg.vocab_size)`` exactly. Names with or without the ``model.`` prefix; stored rotary
    ``inv_freq`` buffers are ignored; a tied folder's stored ``lm_head`` copy is ignored.
    """
    s = check_config(hf_cfg, architecture, where)
    fields = model_fields(s)
    if block_size is not None:
        check_context(s, block_size, where)
        fields["block_size"] = block_size
    cfg = dataclasses.replace(base if base is not None else ModelConfig(), **fields)
    sd = {k.removeprefix("model."): v for k, v in hf_sd.items() if not k.endswith("rotary_emb.inv_freq")}
    used: set[str] = set()
    take = _taker(sd, used, f"{where}: '{{key}}' is missing; the folder is not a complete {architecture} of its "
                  "config.json.", f"{where}: '{{key}}' has shape {{shape}}, but config.json implies {{expected}}; "
                  "weights and config do not match.")
    V, C = s.vocab_size, s.hidden
    out = {"wte.weight": take("embed_tokens.weight", (V, C)), "ln_f.weight": take("norm.weight", (C,))}
    for i in range(s.layers):
        for h, t, shape in _layer_map(s):
            out[f"blocks.{i}.{t}"] = take(f"layers.{i}.{h}", shape)
    if s.tie:
        used.add("lm_head.weight")
    elif "lm_head.weight" not in sd:
        raise CheckpointError(f"{where}: tie_word_embeddings is false but 'lm_head.weight' is missing; the untied "
                              "head's weights are not in the folder.")
    else:
        out["lm_head.weight"] = take("lm_head.weight", (V, C))
    _check_used(sd, used, f"{where}: weights a {architecture} of this config does not have: {{extra}}.")
    with torch.device("meta"):
        target = GPT(cfg, V)
    out = adapt_state_dict(out, target)  # fused or separate q/k/v, vocabulary padding
    if s.tie:
        out["lm_head.weight"] = out["wte.weight"]
    return cfg, {k: v.contiguous() for k, v in out.items()}


def spec_of_model(cfg: ModelConfig, architecture: str, vocab_size: int) -> Spec:
    """The :class:`Spec` of a tokenmill model of ``cfg`` written as ``architecture``."""
    llama3 = None
    if cfg.rope_scaling == "llama3":
        llama3 = (cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_context)
    return Spec(architecture, vocab_size, cfg.n_embd, cfg.mlp_width, cfg.n_layer, cfg.n_head, cfg.kv_heads,
                cfg.head_width, cfg.norm_eps, cfg.rope_theta, llama3, cfg.tie_embeddings, cfg.bias, cfg.qkv_bias,
                cfg.qk_norm, cfg.block_size)


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, architecture: str,
                     vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A tokenmill GPT state dict (compile/DDP name prefixes allowed) -> the state dict of the equal
    ``architecture``: q/k/v separate, embedding and untied head cut to the true ``vocab_size``
    (default ``cfg.vocab_size``), a tied head not stored. Tensors are contiguous copies."""
    why = _inexpressible(cfg, architecture)
    if why:
        raise CheckpointError(why)
    V = vocab_size if vocab_size is not None else cfg.vocab_size
    if V is None:
        raise CheckpointError("the true vocabulary size is unknown (model.vocab_size is unset); pass vocab_size.")
    s = spec_of_model(cfg, architecture, V)
    with torch.device("meta"):
        target = GPT(dataclasses.replace(cfg, fused_qkv=False, vocab_pad_multiple=1), V)
    try:
        sd = adapt_state_dict(strip_wrappers(state_dict), target)  # separate q/k/v, the true vocabulary
    except ValueError as e:
        raise CheckpointError(f"the state dict does not fit the vocabulary: {e}.") from None
    used: set[str] = set()
    take = _taker(sd, used, "the tokenmill state dict lacks '{key}'; it is not a whole GPT of this config.",
                  "'{key}' has shape {shape}, but the config implies {expected}.")
    out = {"model.embed_tokens.weight": take("wte.weight", (V, s.hidden)), "model.norm.weight": take("ln_f.weight", (s.hidden,))}
    for i in range(s.layers):
        for h, t, shape in _layer_map(s):
            out[f"model.layers.{i}.{h}"] = take(f"blocks.{i}.{t}", shape)
    if not s.tie:
        out["lm_head.weight"] = take("lm_head.weight", (V, s.hidden))
    elif "lm_head.weight" in sd:
        used.add("lm_head.weight")
        if not torch.equal(sd["lm_head.weight"], sd["wte.weight"]):
            raise CheckpointError("model.tie_embeddings is true but lm_head.weight differs from wte.weight in this state "
                                  "dict; the config does not describe these weights.")
    _check_used(sd, used, f"the state dict holds weights {architecture} has no place for: {{extra}}.")
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Export: the class and its config.json


def _inexpressible(cfg: ModelConfig, architecture: str) -> Optional[str]:
    """Why ``architecture`` cannot hold a tokenmill model of ``cfg`` exactly (None: it can)."""
    if (cfg.pos_emb, cfg.norm_type, cfg.mlp) != ("rope", "rmsnorm", "swiglu"):
        return (f"{architecture} has rotary positions, RMSNorm and a SwiGLU MLP; this model has model.pos_emb="
                f"{cfg.pos_emb!r}, model.norm_type={cfg.norm_type!r}, model.mlp={cfg.mlp!r}.")
    if cfg.qk_norm and cfg.qk_norm_width != "head":
        return f"{architecture} normalises q and k per head; this model has model.qk_norm_width={cfg.qk_norm_width!r}."
    have = (cfg.bias, cfg.qkv_bias, cfg.qk_norm)
    if have not in _FORMS[architecture]:
        can = " or ".join(f"(bias={b}, qkv_bias={q}, qk_norm={n})".lower() for b, q, n in _FORMS[architecture])
        now = f"model.bias={cfg.bias}, model.qkv_bias={cfg.qkv_bias}, model.qk_norm={cfg.qk_norm}".lower()
        return f"{architecture} holds {can}; this model has {now}, so it cannot be exported as it."
    if architecture == "LlamaForCausalLM" and cfg.n_embd % cfg.n_head:
        return (f"transformers' LlamaConfig needs hidden_size divisible by num_attention_heads; this model has "
                f"model.n_embd={cfg.n_embd}, model.n_head={cfg.n_head}.")
    return None


def export_architecture(cfg: ModelConfig, prefer: Optional[str] = None) -> str:
    """The class a rotary tokenmill model is written as: ``prefer`` (the class a fine-tuning run started
    from) when it holds the model exactly; else Qwen3 for q/k norms, Qwen2 for q/k/v biases only,
    Llama (Mistral when Llama's config cannot hold the head layout). :class:`CheckpointError` with
    the reason when none of them can."""
    if prefer in DENSE and _inexpressible(cfg, prefer) is None:
        return prefer
    for arch in DENSE:  # Llama before Mistral: they hold the same models but one head layout
        if _inexpressible(cfg, arch) is None:
            return arch
    closest = ("Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM" if cfg.qkv_bias and not cfg.bias
               else "LlamaForCausalLM")
    raise CheckpointError(f"this model has no exact Hugging Face form: {_inexpressible(cfg, closest)}")


def hf_config(cfg: ModelConfig, architecture: str, vocab_size: int, dtype: torch.dtype = torch.float32,
              eot_id: Optional[int] = None, like: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The ``config.json`` dict of the ``architecture`` equal to a tokenmill model of ``cfg``: readable by
    transformers 4 (``rope_theta``, ``rope_scaling``) and 5 (``rope_parameters``). Its bos/eos/pad
    token ids are those of ``like`` (the config.json of a fine-tuning run's source, whose tokenizer
    the run has), else ``eot_id`` as bos and eos."""
    s = spec_of_model(cfg, architecture, vocab_size)
    token_ids = {"bos_token_id": eot_id, "eos_token_id": eot_id}
    token_ids.update({k: like[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in (like or {})})
    mt = ARCHITECTURES[architecture]
    scaling = None
    if s.llama3:
        scaling = {"rope_type": "llama3", **dict(zip(_LLAMA3_KEYS, s.llama3))}
    dt = str(dtype).removeprefix("torch.")
    out: dict[str, Any] = {
        "architectures": [architecture], "model_type": mt, "vocab_size": vocab_size, "hidden_size": s.hidden,
        "intermediate_size": s.intermediate, "num_hidden_layers": s.layers, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "hidden_act": "silu",
        "max_position_embeddings": s.max_positions, "rms_norm_eps": s.eps, "rope_theta": s.theta,
        "rope_scaling": scaling, "rope_parameters": {"rope_type": "default", **(scaling or {}), "rope_theta": s.theta},
        "tie_word_embeddings": s.tie, "attention_dropout": 0.0, "initializer_range": cfg.init_std, "use_cache": True,
        "bos_token_id": None, "eos_token_id": None, **token_ids, "dtype": dt, "torch_dtype": dt,
    }
    if mt in ("llama", "qwen3"):
        out["attention_bias"] = s.bias  # Llama: q/k/v/o with the MLP's (model.bias = model.qkv_bias); Qwen3: none
    if mt == "llama":
        out["mlp_bias"] = s.bias
    if mt in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=s.layers,
                   layer_types=["full_attention"] * s.layers)
    if mt == "mistral":
        out["sliding_window"] = None
    return out
