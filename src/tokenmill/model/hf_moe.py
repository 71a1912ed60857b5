"""Convert between tokenmill's mixture-of-experts :class:`~tokenmill.model.GPT` (``model.moe_experts`` > 0,
:mod:`tokenmill.model.moe`) and the Hugging Face mixture-of-experts classes ``MixtralForCausalLM``,
``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM`` and ``OlmoeForCausalLM``.

Each is a dense class of :mod:`tokenmill.model.hf_llama` (its twin: Mistral, Qwen3, Qwen2, Qwen3) whose sparse
layers' MLP is a router and experts; this module reads and writes the mixture-of-experts part and lets
``hf_llama`` convert the rest (attention, norms, embeddings, the dense layers' MLPs), which dispatches
these classes here (:data:`tokenmill.model.hf_llama.MOE`).

==================  ==========================================  ===========================================
class               config.json                                 tokenmill
==================  ==========================================  ===========================================
Mixtral             num_local_experts, num_experts_per_tok;     moe_experts, moe_top_k, moe_router
                    every layer sparse, experts of              'softmax-topk-renorm'; intermediate_size
                    intermediate_size                           is the experts' width
Qwen3-MoE           num_experts (or num_local_experts),         moe_intermediate_size, moe_router
                    moe_intermediate_size, norm_topk_prob,      'softmax-topk' / '...-renorm', moe_every,
                    decoder_sparse_step, mlp_only_layers        moe_dense_layers; q/k norms (qk_norm)
Qwen2-MoE           as Qwen3-MoE, and shared_expert_            moe_shared_experts 1 of that width,
                    intermediate_size (a sigmoid-gated          moe_shared_gate; q/k/v biases
                    shared expert)
OLMoE               num_experts, num_experts_per_tok,           moe_router 'softmax-topk' (or '-renorm');
                    norm_topk_prob; every layer sparse with     qk_norm with qk_norm_width 'all' (q and k
                    experts of intermediate_size; q_norm and    normalised over all heads together);
                    k_norm over all heads; clip_qkv null        the experts intermediate_size wide
==================  ==========================================  ===========================================

Weights of a sparse layer N (the files transformers writes, and the hub's): Mixtral's
``layers.N.block_sparse_moe.gate`` / Qwen's ``layers.N.mlp.gate`` = ``blocks.N.mlp.router``; expert j's
``w1``/``w3``/``w2`` (Mixtral) or ``gate_proj``/``up_proj``/``down_proj`` (Qwen) = row j of
``blocks.N.mlp.experts.gate_up`` (gate rows, then up rows) and ``experts.down``; transformers 5's stacked
``experts.gate_up_proj`` / ``experts.down_proj`` are read too. Qwen2-MoE's ``shared_expert.{gate,up,down}_proj``
and ``shared_expert_gate`` = ``mlp.shared.{c_gate,c_fc,c_proj}`` and ``mlp.shared_gate``.

Refused, naming the field: router jitter noise, more experts per token than experts, a layer list outside
the model, mixture-of-experts keys of other families (DeepSeek's, OLMoE's full-width q/k norms are not
these classes), and on export a model the class cannot hold exactly (another router, shared experts in
Mixtral or Qwen3-MoE, dense layers in Mixtral).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any, Optional

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import CheckpointError
from tokenmill.filecheck import get
from tokenmill.model import hf_llama
from tokenmill.model.hf_llama import MOE, Spec

__all__ = ["MoeSpec", "check_config", "export_architecture", "from_hf_state_dict", "hf_config", "model_fields",
           "to_hf_state_dict"]

TWIN = {"MixtralForCausalLM": "MistralForCausalLM", "Qwen3MoeForCausalLM": "Qwen3ForCausalLM",
        "Qwen2MoeForCausalLM": "Qwen2ForCausalLM", "OlmoeForCausalLM": "Qwen3ForCausalLM"}
# transformers' defaults (5.x) for the keys a config.json may leave out
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None, "num_local_experts": 8,
                "num_experts_per_tok": 2},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_experts": 128, "num_experts_per_tok": 8,
                  "moe_intermediate_size": 768, "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "qwen2_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
                  "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_experts": 60, "num_experts_per_tok": 4,
                  "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                  "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True},
    "olmoe": {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
              "num_attention_heads": 16, "num_key_value_heads": None, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "num_experts": 64, "num_experts_per_tok": 8,
              "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "clip_qkv": None},
}
_HANDLED = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
            "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
            "output_router_logits", "router_jitter_noise", "qkv_bias", "clip_qkv")
_MOE_KEYS = re.compile(r"expert|moe|router|topk|sparse|dense_replace")
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                 "qwen2_moe": ("gate_proj", "up_proj", "down_proj"), "olmoe": ("gate_proj", "up_proj", "down_proj")}


@dataclasses.dataclass(frozen=True)
class MoeSpec(Spec):
    """A mixture-of-experts model: its twin's :class:`Spec` (``architecture`` = the MoE class) and its experts."""

    experts: int = 0
    top_k: int = 1
    expert_width: int = 0
    router: str = "softmax-topk-renorm"
    every: int = 1
    dense_layers: tuple[int, ...] = ()
    shared_width: int = 0  # Qwen2-MoE's gated shared expert (0: none)

    def sparse(self) -> list[int]:
        return [i for i in range(self.layers) if (i + 1) % self.every == 0 and i not in self.dense_layers]

    def dense(self) -> Spec:
        """The twin's spec (the same model with dense MLPs in every layer)."""
        base = {f.name: getattr(self, f.name) for f in dataclasses.fields(Spec)}
        return Spec(**{**base, "architecture": TWIN[self.architecture]})


# ----------------------------------------------------------------------------------------------
# config.json -> MoeSpec


def _densify(c: Mapping[str, Any], architecture: str, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(the twin's config.json, the mixture-of-experts fields)`` of a config.json of ``architecture``."""
    mt = MOE[architecture]
    full = {**_DEFAULTS[mt], **c}
    for k, v in full.items():
        if _MOE_KEYS.search(k) and k not in _HANDLED and v not in (None, False, 0, [], {}):
            raise CheckpointError(f"{where}: '{k}' is {v!r}: not a field of the {architecture} tokenmill converts.")

    def num(key: str, lo: int = 1) -> int:
        return get(full, key, int, where, err=CheckpointError, lo=lo)

    ekey = "num_local_experts" if "num_local_experts" in c or mt == "mixtral" else "num_experts"
    E, k, L = num(ekey), num("num_experts_per_tok"), num("num_hidden_layers")
    if k > E:
        raise CheckpointError(f"{where}: num_experts_per_tok ({k}) exceeds {ekey} ({E}).")
    if get(full, "router_jitter_noise", float, where, err=CheckpointError, default=0.0, nullable=True):
        raise CheckpointError(f"{where}: router_jitter_noise is {full['router_jitter_noise']!r}; tokenmill's router adds "
                              "no noise to its inputs.")
    moe: dict[str, Any] = {"experts": E, "top_k": k}
    if full.get("clip_qkv") is not None:
        raise CheckpointError(f"{where}: clip_qkv is {full['clip_qkv']!r}; tokenmill does not clip q, k and v.")
    if mt in ("mixtral", "olmoe"):  # experts of intermediate_size; OLMoE: every layer, no renormalising
        norm = mt == "mixtral" or get(full, "norm_topk_prob", bool, where, err=CheckpointError)
        moe.update(expert_width=num("intermediate_size"), router="softmax-topk-renorm" if norm else "softmax-topk")
    else:
        norm = get(full, "norm_topk_prob", bool, where, err=CheckpointError)
        dense = get(full, "mlp_only_layers", list, where, err=CheckpointError)
        if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < L for i in dense) or len(set(dense)) < len(dense):
            raise CheckpointError(f"{where}: mlp_only_layers is {dense!r}; expected distinct layer indices 0 .. {L - 1}.")
        moe.update(expert_width=num("moe_intermediate_size"), router="softmax-topk-renorm" if norm else "softmax-topk",
                   every=num("decoder_sparse_step"), dense_layers=tuple(sorted(dense)))
    if mt == "qwen2_moe":
        moe["shared_width"] = num("shared_expert_intermediate_size")
        if not get(full, "qkv_bias", bool, where, err=CheckpointError):
            raise CheckpointError(f"{where}: qkv_bias is false; tokenmill computes Qwen2-MoE with its q/k/v biases.")
    twin = {key: v for key, v in full.items() if key not in _HANDLED}
    if mt in ("qwen3_moe", "olmoe") and twin.get("head_dim") is None:  # hidden_size / heads, unlike Qwen3's 128
        twin["head_dim"] = num("hidden_size") // num("num_attention_heads")
    twin.update(architectures=[TWIN[architecture]], model_type=hf_llama.ARCHITECTURES[TWIN[architecture]])
    return twin, moe


def check_config(c: Mapping[str, Any], architecture: str, where: str) -> MoeSpec:
    """The :class:`MoeSpec` of a config.json of ``architecture`` (a key of :data:`~tokenmill.model.hf_llama.MOE`),
    or a :class:`CheckpointError` naming the field tokenmill cannot compute exactly."""
    twin, moe = _densify(c, architecture, where)
    s = hf_llama.check_config(twin, TWIN[architecture], where)
    base = {f.name: getattr(s, f.name) for f in dataclasses.fields(Spec)}
    return MoeSpec(**{**base, "architecture": architecture}, **moe)


def _moe_fields(s: MoeSpec) -> dict[str, Any]:
    olmoe = MOE[s.architecture] == "olmoe"  # q and k normalised over all heads together
    return dict(**({"qk_norm_width": "all"} if olmoe else {}), moe_experts=s.experts, moe_top_k=s.top_k, moe_intermediate_size=s.expert_width,
                moe_router=s.router, moe_every=s.every, moe_dense_layers=",".join(map(str, s.dense_layers)),
                moe_shared_experts=1 if s.shared_width else 0, moe_shared_intermediate_size=s.shared_width or None,
                moe_shared_gate=bool(s.shared_width))


def model_fields(s: MoeSpec) -> dict[str, Any]:
    """The tokenmill ``model.*`` fields ``s`` fixes (its twin's and the mixture of experts')."""
    return {**hf_llama.model_fields(s.dense()), **_moe_fields(s)}


# ----------------------------------------------------------------------------------------------
# State dicts


def _names(mt: str, i: int, j: Optional[int] = None) -> str:
    """The Hugging Face prefix of layer ``i``'s mixture of experts (of expert ``j``)."""
    p = f"layers.{i}.{'block_sparse_moe' if mt == 'mixtral' else 'mlp'}."
    return p if j is None else f"{p}experts.{j}."


def _read_layer(take, sd: Mapping[str, torch.Tensor], s: MoeSpec, i: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s mixture of experts in tokenmill's names (under ``blocks.i.mlp.``)."""
    mt, C, E, W = MOE[s.architecture], s.hidden, s.experts, s.expert_width
    p = _names(mt, i)
    out = {"router.weight": take(f"{p}gate.weight", (E, C))}
    if f"{p}experts.gate_up_proj" in sd:  # transformers 5's stacked form
        out["experts.gate_up"] = take(f"{p}experts.gate_up_proj", (E, 2 * W, C))
        out["experts.down"] = take(f"{p}experts.down_proj", (E, C, W))
    else:
        g, u, d = _EXPERT_NAMES[mt]
        out["experts.gate_up"] = torch.stack([torch.cat([take(f"{_names(mt, i, j)}{g}.weight", (W, C)),
                                                         take(f"{_names(mt, i, j)}{u}.weight", (W, C))]) for j in range(E)])
        out["experts.down"] = torch.stack([take(f"{_names(mt, i, j)}{d}.weight", (C, W)) for j in range(E)])
    if s.shared_width:
        S = s.shared_width
        for h, t, shape in (("gate_proj", "c_gate", (S, C)), ("up_proj", "c_fc", (S, C)), ("down_proj", "c_proj", (C, S))):
            out[f"shared.{t}.weight"] = take(f"{p}shared_expert.{h}.weight", shape)
        out["shared_gate.weight"] = take(f"{p}shared_expert_gate.weight", (1, C))
    return out


def _full_qk_norms(take, s: MoeSpec) -> dict[str, torch.Tensor]:
    """OLMoE's q and k norms over all heads together (``N.self_attn.{q,k}_norm.weight``, by layer)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return {f"{i}.self_attn.{n}_norm.weight": take(f"layers.{i}.self_attn.{n}_norm.weight", (w,))
            for i in range(s.layers) for n, w in (("q", q), ("k", kv))}


def _dense_mlp(prefix: str, names: tuple[str, str, str], width: int, C: int) -> dict[str, torch.Tensor]:
    """Stand-ins (on meta) for a dense MLP where a sparse layer has experts: the twin's converter expects one."""
    shapes = ((width, C), (width, C), (C, width))
    return {f"{prefix}{n}.weight": torch.empty(shape, device="meta") for n, shape in zip(names, shapes)}


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], hf_cfg: Mapping[str, Any], architecture: str,
                       base: ModelConfig | None = None, block_size: int | None = None,
                       where: str = "the weights") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """:func:`tokenmill.model.hf_llama.from_hf_state_dict` for a mixture-of-experts class."""
    twin, _ = _densify(hf_cfg, architecture, where)
    s = check_config(hf_cfg, architecture, where)
    sd = {k.removeprefix("model."): v for k, v in hf_sd.items()}
    used: set[str] = set()
    take = hf_llama._taker(sd, used, f"{where}: '{{key}}' is missing; the folder is not a complete {architecture} of "
                           "its config.json.", f"{where}: '{{key}}' has shape {{shape}}, but config.json implies "
                           "{expected}; weights and config do not match.")
    experts = {i: _read_layer(take, sd, s, i) for i in s.sparse()}
    norms = _full_qk_norms(take, s) if MOE[architecture] == "olmoe" else {}
    rest = {k: v for k, v in sd.items() if k not in used}
    for i in experts:
        rest.update(_dense_mlp(f"layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj"), s.intermediate, s.hidden))
    rest.update({f"layers.{k}": torch.empty(s.head_dim, device="meta") for k in norms})  # the twin's per-head shape
    cfg, out = hf_llama.from_hf_state_dict(rest, twin, TWIN[architecture], base, block_size, where)
    out.update({f"blocks.{k.replace('self_attn', 'attn')}": v for k, v in norms.items()})
    for i, layer in experts.items():
        for n in ("c_gate", "c_fc", "c_proj"):
            del out[f"blocks.{i}.mlp.{n}.weight"]
        out.update({f"blocks.{i}.mlp.{k}": v.contiguous() for k, v in layer.items()})
    return dataclasses.replace(cfg, **_moe_fields(s)), out


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, architecture: str,
                     vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """:func:`tokenmill.model.hf_llama.to_hf_state_dict` for a mixture-of-experts class: the experts in the
    per-expert names transformers writes."""
    why = _inexpressible(cfg, architecture)
    if why:
        raise CheckpointError(why)
    mt, C, E = MOE[architecture], cfg.n_embd, cfg.moe_experts
    sd = hf_llama.strip_wrappers(state_dict)
    norms = {}
    if cfg.qk_norm and cfg.qk_norm_width == "all":  # OLMoE: the twin (Qwen3) holds per-head norms: stand-ins
        norms = {k: sd.pop(k) for k in [k for k in sd if k.endswith(("attn.q_norm.weight", "attn.k_norm.weight"))]}
        sd.update({k: torch.empty(cfg.head_width, device="meta") for k in norms})
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for i in cfg.sparse_layers():
        p = f"blocks.{i}.mlp."
        layers[i] = {k[len(p):]: sd.pop(k) for k in [k for k in sd if k.startswith(p)]}
        sd.update(_dense_mlp(p, ("c_gate", "c_fc", "c_proj"), cfg.mlp_width, C))
    out = hf_llama.to_hf_state_dict(sd, _dense_cfg(cfg), TWIN[architecture], vocab_size)
    out.update({"model.layers." + k.removeprefix("blocks.").replace(".attn.", ".self_attn."): v for k, v in norms.items()})
    g, u, d = _EXPERT_NAMES[mt]
    for i, layer in layers.items():
        for n in ("gate_proj", "up_proj", "down_proj"):
            del out[f"model.layers.{i}.mlp.{n}.weight"]
        p = "model." + _names(mt, i)
        bias = layer.pop("router_bias", None)  # model.moe_bias_update_rate: the class routes without one
        if bias is not None and bool(bias.any()):
            raise CheckpointError(f"blocks.{i}.mlp.router_bias (model.moe_bias_update_rate) is non-zero: {architecture} "
                                  "routes without a bias, so the export would choose other experts.")
        try:
            out[f"{p}gate.weight"] = layer.pop("router.weight")
            gate, up = layer.pop("experts.gate_up").chunk(2, dim=1)
            down = layer.pop("experts.down")
            for j in range(E):
                q = "model." + _names(mt, i, j)
                out.update({f"{q}{g}.weight": gate[j], f"{q}{u}.weight": up[j], f"{q}{d}.weight": down[j]})
            for h, t in (("gate_proj", "c_gate"), ("up_proj", "c_fc"), ("down_proj", "c_proj")):
                if cfg.moe_shared_experts:
                    out[f"{p}shared_expert.{h}.weight"] = layer.pop(f"shared.{t}.weight")
            if cfg.moe_shared_experts:
                out[f"{p}shared_expert_gate.weight"] = layer.pop("shared_gate.weight")
        except KeyError as e:
            raise CheckpointError(f"the tokenmill state dict lacks 'blocks.{i}.mlp.{e.args[0]}'; it is not a whole GPT "
                                  "of this config.") from None
        if layer:
            raise CheckpointError(f"the state dict holds weights {architecture} has no place for: "
                                  f"{', '.join(f'blocks.{i}.mlp.{k}' for k in sorted(layer))}.")
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Export: the class and its config.json


def _dense_cfg(cfg: ModelConfig) -> ModelConfig:
    """The twin's model: dense, and per-head q/k norms (OLMoE's full-width ones are converted here)."""
    return dataclasses.replace(cfg, moe_experts=0, qk_norm_width="head")


def _inexpressible(cfg: ModelConfig, architecture: str) -> Optional[str]:
    """Why ``architecture`` cannot hold a mixture-of-experts model of ``cfg`` exactly (None: it can)."""
    why = hf_llama._inexpressible(_dense_cfg(cfg), TWIN[architecture])
    if why:
        return why.replace(TWIN[architecture], architecture)
    mt = MOE[architecture]
    if cfg.qk_norm and (cfg.qk_norm_width == "all") != (mt == "olmoe"):
        return (f"{architecture} normalises q and k {'over all heads' if mt == 'olmoe' else 'per head'}; this model has "
                f"model.qk_norm_width={cfg.qk_norm_width!r}.")
    if mt in ("mixtral", "olmoe"):
        allowed = ("softmax-topk-renorm",) if mt == "mixtral" else ("softmax-topk", "softmax-topk-renorm")
        if cfg.moe_router not in allowed:
            return (f"{architecture} routes with {' or '.join(map(repr, allowed))}; this model has "
                    f"model.moe_router={cfg.moe_router!r}.")
        if len(cfg.sparse_layers()) != cfg.n_layer:
            return f"{architecture} has experts in every layer; this model has dense layers (model.moe_every, moe_dense_layers)."
        if cfg.expert_width != cfg.mlp_width:
            return (f"{architecture}'s experts are intermediate_size wide; this model has model.moe_intermediate_size="
                    f"{cfg.moe_intermediate_size} and model.intermediate_size={cfg.intermediate_size}.")
    elif cfg.moe_router == "topk-softmax":
        return f"{architecture} routes with softmax then top-k; this model has model.moe_router='topk-softmax'."
    shared = bool(cfg.moe_shared_experts)
    if mt == "qwen2_moe" and not (shared and cfg.moe_shared_gate):
        return f"{architecture} has one sigmoid-gated shared expert; this model has model.moe_shared_experts=" \
               f"{cfg.moe_shared_experts}, model.moe_shared_gate={cfg.moe_shared_gate}."
    if mt != "qwen2_moe" and shared:
        return f"{architecture} has no shared experts; this model has model.moe_shared_experts={cfg.moe_shared_experts}."
    return None


def export_architecture(cfg: ModelConfig, prefer: Optional[str] = None) -> str:
    """The class a mixture-of-experts model is written as: ``prefer`` when it holds the model exactly, else
    Qwen3-MoE, Qwen2-MoE, Mixtral, the first that does; :class:`CheckpointError` with the reason otherwise."""
    if prefer in MOE and _inexpressible(cfg, prefer) is None:
        return prefer
    for arch in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM"):
        if _inexpressible(cfg, arch) is None:
            return arch
    closest = ("OlmoeForCausalLM" if cfg.qk_norm and cfg.qk_norm_width == "all" else "Qwen3MoeForCausalLM" if cfg.qk_norm else "Qwen2MoeForCausalLM" if cfg.moe_shared_experts
               else "MixtralForCausalLM")
    raise CheckpointError(f"this model has no exact Hugging Face form: {_inexpressible(cfg, closest)}")


def hf_config(cfg: ModelConfig, architecture: str, vocab_size: int, dtype: torch.dtype = torch.float32,
              eot_id: Optional[int] = None, like: Optional[Mapping[str, Any]] = None) -> dict[str, Any]:
    """The ``config.json`` dict of the mixture-of-experts ``architecture`` equal to a tokenmill model of ``cfg``."""
    out = hf_llama.hf_config(_dense_cfg(cfg), TWIN[architecture], vocab_size, dtype, eot_id, like)
    mt = MOE[architecture]
    out.update(architectures=[architecture], model_type=mt, num_experts_per_tok=cfg.moe_top_k,
               router_aux_loss_coef=cfg.moe_aux_loss_coef, output_router_logits=False)
    if mt == "mixtral":
        out.update(num_local_experts=cfg.moe_experts, router_jitter_noise=0.0)
        return out
    if mt == "olmoe":
        out.update(num_experts=cfg.moe_experts, norm_topk_prob=cfg.moe_router == "softmax-topk-renorm", clip_qkv=None)
        return out
    dense = sorted(set(range(cfg.n_layer)) - set(cfg.sparse_layers()) - {i for i in range(cfg.n_layer)
                                                                          if (i + 1) % cfg.moe_every})
    out.update(num_experts=cfg.moe_experts, moe_intermediate_size=cfg.expert_width, decoder_sparse_step=cfg.moe_every,
               norm_topk_prob=cfg.moe_router == "softmax-topk-renorm", mlp_only_layers=dense)
    if mt == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_width, qkv_bias=True)
    return out
