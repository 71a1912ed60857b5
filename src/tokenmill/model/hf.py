"""Convert between tokenmill's :class:`~tokenmill.model.GPT` and Hugging Face model folders: the one
door for every family. GPT-2 (``GPT2LMHeadModel``) is converted here, the Llama family (Llama, Qwen2,
Qwen3, Mistral) in :mod:`tokenmill.model.hf_llama`. :func:`hf_architecture` picks the family of a
config.json (``architectures``, else ``model_type``), :func:`export_architecture` the class of a
tokenmill model; :func:`read_hf_config`, :func:`hf_model_fields`, :func:`load_hf`, :func:`save_hf` and
:func:`is_hf_folder` dispatch on them (``train.init_from``, ``tokenmill export``).

A folder is what ``save_pretrained`` writes: ``config.json`` and ``model.safetensors`` (or
``pytorch_model.bin``, read with ``weights_only=True``; either sharded with an ``*.index.json``).
Nothing is downloaded and ``transformers`` is never needed (only ``safetensors``). GPT-2:
:func:`from_hf_state_dict` / :func:`load_hf_gpt2` (config + weights -> ModelConfig + state dict for
``GPT(cfg, cfg.vocab_size)``) and :func:`to_hf_state_dict` / :func:`save_hf_gpt2` (back). The two
compute the same function: GPT-2's ``Conv1D`` stores ``(in, out)`` matrices (the transpose of
``nn.Linear``'s), its ``c_attn`` is the fused ``[q; k; v]`` projection, its LayerNorms use eps 1e-5, its
``gelu_new`` is the tanh GELU tokenmill computes. What GPT-2 cannot express is refused with the reason
(:class:`~tokenmill.errors.CheckpointError`): no biases, q/k/v biases that differ from the others, a
different activation, norm, eps, MLP width, head layout or attention scaling.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tokenmill import atomic
from tokenmill.config import ModelConfig, shape_fields
from tokenmill.errors import CheckpointError
from tokenmill.filecheck import get, read_json
from tokenmill.model import hf_families, hf_llama
from tokenmill.model.gpt import GPT, adapt_state_dict
from tokenmill.paths import inside

__all__ = ["CONFIG_NAME", "SAFETENSORS_NAME", "check_exportable", "export_architecture", "from_hf_state_dict",
           "hf_architecture", "hf_config", "hf_model_fields", "is_hf_folder", "is_hf_gpt2_folder", "load_hf",
           "load_hf_gpt2", "read_hf_config", "save_hf", "save_hf_gpt2", "to_hf_state_dict"]

GPT2 = "GPT2LMHeadModel"
CONFIG_NAME = "config.json"
SAFETENSORS_NAME = "model.safetensors"
BIN_NAME = "pytorch_model.bin"
LN_EPS = 1e-5  # nn.LayerNorm's default, and tokenmill.model.layers.LayerNorm's
# model.norm forms that are LayerNorm with eps LN_EPS (native kernel, hand-written, Triton kernel).
NORM_FORMS = ("native", "manual", "triton")
# Hugging Face activation names that are the tanh-approximation GELU tokenmill computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh")
# Buffers that old GPT-2 checkpoints store (causal mask and its fill value): not weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")
_HF_INSTALL = "pip install 'tokenmill[hf]' (or: pip install safetensors)"


# ----------------------------------------------------------------------------------------------
# Checks


def check_exportable(cfg: ModelConfig) -> None:
    """Raise :class:`CheckpointError` with the reason when a model of ``cfg`` has no exact GPT-2 form.

    GPT2LMHeadModel has learned positions, a bias in every projection and LayerNorm, eps 1e-5
    LayerNorms, a tanh-GELU MLP of width 4 * n_embd, as many k/v heads as query heads of width
    n_embd / n_head, and 1/sqrt(head_dim) attention scaling. Tokenmill's switches that only change how
    the same math runs (attention kernel, mask form, fused or separate q/k/v, native/manual/triton
    LayerNorm, native/manual GELU, vocabulary padding, loss form) all export.
    """
    family = {"pos_emb": "learned", "norm_type": "layernorm", "mlp": "gelu", "qk_norm": False}
    for name, want in family.items():
        if getattr(cfg, name) != want:
            raise CheckpointError(f"this model has model.{name}={getattr(cfg, name)!r}; GPT-2 has {name}={want!r}, so "
                                  "it cannot be exported as GPT-2.")
    if not cfg.bias:
        raise CheckpointError(
            "this model has model.bias=false (no biases in its projections and LayerNorms); a Hugging Face "
            "GPT2LMHeadModel always has them, so it cannot be exported as GPT-2."
        )
    if not cfg.qkv_bias:
        raise CheckpointError(
            "this model has model.qkv_bias=false but biases elsewhere; GPT-2's fused c_attn always has "
            "a q/k/v bias, so it cannot be exported as GPT-2."
        )
    if cfg.norm not in NORM_FORMS or not math.isclose(cfg.norm_eps, LN_EPS, rel_tol=1e-6):
        raise CheckpointError(f"model.norm={cfg.norm!r}, model.norm_eps={cfg.norm_eps} have no GPT-2 form (GPT-2 uses "
                              f"LayerNorm, eps {LN_EPS}).")
    if cfg.gelu not in ("native", "manual"):
        raise CheckpointError(f"model.gelu={cfg.gelu!r} has no GPT-2 form (GPT-2 uses the tanh GELU 'gelu_new').")
    if cfg.n_embd % cfg.n_head or cfg.head_width * cfg.n_head != cfg.n_embd or cfg.kv_heads != cfg.n_head:
        raise CheckpointError(f"GPT-2 has n_head heads of width n_embd / n_head for q, k and v; this model has "
                              f"model.n_embd={cfg.n_embd}, n_head={cfg.n_head}, head_dim={cfg.head_dim}, "
                              f"n_kv_head={cfg.n_kv_head}.")
    if cfg.mlp_width != 4 * cfg.n_embd:
        raise CheckpointError(f"model.intermediate_size={cfg.intermediate_size}: GPT-2's MLP width is 4 * n_embd.")


def _check_hf_config(c: Mapping[str, Any], where: str) -> None:
    """Refuse GPT-2 configs whose model tokenmill does not compute exactly."""
    mt = c.get("model_type")
    if mt != "gpt2":
        raise CheckpointError(f"{where}: model_type is {mt!r}; only Hugging Face GPT-2 folders (model_type 'gpt2', "
                              "GPT2LMHeadModel) are read here (tokenmill.model.hf.load_hf reads every family).")
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        get(c, key, int, where, err=CheckpointError, lo=1)
    if c["n_embd"] % c["n_head"]:
        raise CheckpointError(f"{where}: n_embd ({c['n_embd']}) is not divisible by n_head ({c['n_head']}).")
    act = get(c, "activation_function", str, where, err=CheckpointError, default="gelu_new")
    if act not in TANH_GELUS:
        raise CheckpointError(f"{where}: activation_function {act!r} is not the tanh-approximation GELU "
                              f"({', '.join(TANH_GELUS)}) that tokenmill's MLP computes; it cannot be loaded exactly.")
    inner = get(c, "n_inner", int, where, err=CheckpointError, default=None)
    if inner is not None and inner != 4 * c["n_embd"]:
        raise CheckpointError(f"{where}: n_inner is {inner}, but tokenmill's MLP width is 4 * n_embd = {4 * c['n_embd']}.")
    eps = get(c, "layer_norm_epsilon", float, where, err=CheckpointError, default=LN_EPS)
    if not math.isclose(eps, LN_EPS, rel_tol=1e-6):
        raise CheckpointError(f"{where}: layer_norm_epsilon is {eps}, but tokenmill's GPT-2 LayerNorms use {LN_EPS}; "
                              "the logits would differ.")
    flag = {k: get(c, k, bool, where, err=CheckpointError, default=d) for k, d in (("scale_attn_weights", True), (
        "scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False), ("tie_word_embeddings", True))}
    if not flag["scale_attn_weights"] or flag["scale_attn_by_inverse_layer_idx"]:
        raise CheckpointError(f"{where}: attention scaling differs from 1/sqrt(head_dim) (scale_attn_weights / "
                              "scale_attn_by_inverse_layer_idx); tokenmill's attention cannot compute it.")
    if flag["add_cross_attention"]:
        raise CheckpointError(f"{where}: a GPT-2 with cross-attention (an encoder-decoder part) is not a decoder-only GPT.")


# ----------------------------------------------------------------------------------------------
# Configs


def hf_config(cfg: ModelConfig, vocab_size: int, eot_id: int | None = None,
              dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The ``config.json`` dict of a GPT2LMHeadModel equal to a tokenmill model of ``cfg``.

    ``vocab_size``: the true vocabulary (padding rows are not exported). ``eot_id``: the tokenizer's
    end-of-text id, written as bos/eos token id (GPT-2 style); None writes none.
    """
    check_exportable(cfg)
    dt = str(dtype).removeprefix("torch.")
    return {
        "architectures": [GPT2], "model_type": "gpt2", "vocab_size": vocab_size, "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": LN_EPS, "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, "initializer_range": cfg.init_std,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(cfg.tie_embeddings), "bos_token_id": eot_id, "eos_token_id": eot_id,
        "use_cache": True, "dtype": dt, "torch_dtype": dt,  # transformers 5 and 4
    }


def hf_model_fields(hf_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenmill ``model.*`` fields a Hugging Face config.json fixes (the model's shape), keyed by
    field name: every architecture field (``shape_fields()``) and ``block_size`` (its longest context).

    A fine-tuning run takes these from the source; a user override that differs is a conflict."""
    arch = hf_architecture(hf_cfg, CONFIG_NAME)
    if arch != GPT2:
        return hf_families.model_fields(hf_families.check_config(hf_cfg, arch, CONFIG_NAME))
    default = ModelConfig()  # its defaults are GPT-2's family: learned positions, LayerNorm 1e-5, GELU
    fields = {name: getattr(default, name) for name in shape_fields()}
    fields.update(vocab_size=int(hf_cfg["vocab_size"]), block_size=int(hf_cfg["n_positions"]),
                  n_layer=int(hf_cfg["n_layer"]), n_head=int(hf_cfg["n_head"]), n_embd=int(hf_cfg["n_embd"]),
                  bias=True, qkv_bias=True, tie_embeddings=get(hf_cfg, "tie_word_embeddings", bool, CONFIG_NAME,
                                                                     err=CheckpointError, default=True))
    return fields


# ----------------------------------------------------------------------------------------------
# State dicts


def to_hf_state_dict(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig,
                     vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """A tokenmill GPT state dict -> the state dict of the equal GPT2LMHeadModel.

    Names get the ``transformer.`` prefix, ``blocks`` become ``h``; projection matrices are
    transposed to GPT-2's Conv1D layout; separate q/k/v are fused into ``c_attn``; the embedding and
    an untied head are cut to the true ``vocab_size`` (default ``cfg.vocab_size``); a tied head is
    not stored (GPT-2 ties ``lm_head`` to ``wte`` itself). Tensors are contiguous copies.
    Raises :class:`CheckpointError` for forms GPT-2 cannot express and for missing or extra weights.
    """
    check_exportable(cfg)
    V = vocab_size if vocab_size is not None else cfg.vocab_size
    if V is None:
        raise CheckpointError("the true vocabulary size is unknown (model.vocab_size is unset); pass vocab_size.")
    with torch.device("meta"):
        target = GPT(dataclasses.replace(cfg, fused_qkv=True, vocab_pad_multiple=1), V)
    try:  # fused q/k/v, padding rows cut off (they never reach the logits)
        sd = adapt_state_dict(hf_llama.strip_wrappers(state_dict), target)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"the state dict is not a whole GPT of this config: {e}.") from None
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise CheckpointError(f"the tokenmill state dict lacks '{key}'; it is not a whole GPT of this config.")
        used.add(key)
        return sd[key]

    out = {"transformer.wte.weight": take("wte.weight"), "transformer.wpe.weight": take("wpe.weight"),
           "transformer.ln_f.weight": take("ln_f.weight"), "transformer.ln_f.bias": take("ln_f.bias")}
    C = cfg.n_embd
    for i in range(cfg.n_layer):
        s, d = f"blocks.{i}.", f"transformer.h.{i}."
        for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_attn.bias"):
            out[d + name] = take(s + name)
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            out[f"{d}{name}.weight"] = take(f"{s}{name}.weight").t()  # Conv1D: (in, out)
            out[f"{d}{name}.bias"] = take(f"{s}{name}.bias")
        if tuple(out[f"{d}attn.c_attn.weight"].shape) != (C, 3 * C):
            raise CheckpointError(f"'{s}attn' q/k/v weight has shape {tuple(sd[s + 'attn.c_attn.weight'].shape)}, "
                                  f"expected {(3 * C, C)}.")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    elif "lm_head.weight" in sd:
        used.add("lm_head.weight")
        if not torch.equal(sd["lm_head.weight"], sd["wte.weight"]):
            raise CheckpointError("model.tie_embeddings is true but lm_head.weight differs from wte.weight in this state "
                                  "dict; the config does not describe these weights.")
    extra = sorted(k for k in sd if k not in used)
    if extra:
        raise CheckpointError(f"the state dict holds weights GPT-2 has no place for: {', '.join(extra[:5])}"
                              f"{' ...' if len(extra) > 5 else ''}; it cannot be exported as GPT-2.")
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def _gpt2_config(hf_cfg: Mapping[str, Any], base: ModelConfig | None, block_size: int | None,
                 where: str) -> ModelConfig:
    """``base`` with the shape of a GPT-2 ``config.json`` (checked), at ``block_size`` when given (no longer
    than its ``n_positions``)."""
    _check_hf_config(hf_cfg, where)
    fields = hf_model_fields(hf_cfg)
    if block_size is not None:
        if block_size > fields["block_size"]:
            raise CheckpointError(
                f"{where}: model.block_size {block_size} exceeds the model's n_positions {fields['block_size']} "
                "(no position embeddings beyond it). Fix: use a block_size <= n_positions."
            )
        fields["block_size"] = block_size
    return dataclasses.replace(base if base is not None else ModelConfig(), **fields)


def from_hf_state_dict(hf_sd: Mapping[str, torch.Tensor], hf_cfg: Mapping[str, Any],
                       base: ModelConfig | None = None, block_size: int | None = None,
                       where: str = "the GPT-2 weights") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A GPT-2 config dict + state dict -> ``(ModelConfig, tokenmill state dict)``.

    ``base`` supplies the fields that do not change the function (attention kernel, fused or separate
    q/k/v, norm/GELU form, vocabulary padding, dropout, loss form...); the shape fields of
    :func:`hf_model_fields` come from the GPT-2 config. ``block_size`` smaller than ``n_positions``
    keeps only the first position embeddings (a shorter context); larger is an error. The state dict
    matches ``GPT(cfg, cfg.vocab_size)`` exactly (fused or separate q/k/v per ``base.fused_qkv``,
    zero padding rows per ``base.vocab_pad_multiple``). Accepts names with or without the
    ``transformer.`` prefix; the causal-mask buffers of old checkpoints are ignored.
    """
    cfg = _gpt2_config(hf_cfg, base, block_size, where)
    V, C, L = cfg.vocab_size, cfg.n_embd, cfg.n_layer
    sd = {k.removeprefix("transformer."): v for k, v in hf_sd.items() if not k.endswith(_IGNORED_SUFFIXES)}
    used: set[str] = set()

    def take(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in sd:
            raise CheckpointError(f"{where}: '{key}' is missing; the folder is not a complete GPT-2 of its config.json.")
        if tuple(sd[key].shape) != shape:
            raise CheckpointError(f"{where}: '{key}' has shape {tuple(sd[key].shape)}, but config.json implies "
                                  f"{shape}; weights and config do not match.")
        used.add(key)
        return sd[key]

    out = {"wte.weight": take("wte.weight", (V, C)),
           "wpe.weight": take("wpe.weight", (hf_cfg["n_positions"], C))[: cfg.block_size].clone()}
    for i in range(L):
        s, d = f"h.{i}.", f"blocks.{i}."
        for name in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias"):
            out[d + name] = take(s + name, (C,))
        out[f"{d}attn.c_attn.weight"] = take(f"{s}attn.c_attn.weight", (C, 3 * C)).t()  # Conv1D: (in, out)
        out[f"{d}attn.c_attn.bias"] = take(f"{s}attn.c_attn.bias", (3 * C,))
        for name, shape in (("attn.c_proj", (C, C)), ("mlp.c_fc", (C, 4 * C)), ("mlp.c_proj", (4 * C, C))):
            out[f"{d}{name}.weight"] = take(f"{s}{name}.weight", shape).t()
            out[f"{d}{name}.bias"] = take(f"{s}{name}.bias", (shape[1],))
    out["ln_f.weight"], out["ln_f.bias"] = take("ln_f.weight", (C,)), take("ln_f.bias", (C,))
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # a tied head is wte; a stored copy (older savers) is ignored
    elif "lm_head.weight" not in sd:
        raise CheckpointError(f"{where}: tie_word_embeddings is false but 'lm_head.weight' is missing; the untied "
                              "head's weights are not in the folder.")
    else:
        out["lm_head.weight"] = take("lm_head.weight", (V, C))
    extra = sorted(k for k in sd if k not in used)
    if extra:
        raise CheckpointError(f"{where}: weights a GPT-2 of this config does not have: {', '.join(extra[:5])}"
                              f"{' ...' if len(extra) > 5 else ''}. Is it a GPT2LMHeadModel folder?")
    with torch.device("meta"):
        target = GPT(cfg, V)
    out = adapt_state_dict(out, target)  # fused or separate q/k/v, vocabulary padding
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["wte.weight"]
    return cfg, {k: v.contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Folders


def hf_architecture(c: Mapping[str, Any], where: str) -> str:
    """The class a config.json describes, if tokenmill converts it: 'GPT2LMHeadModel' (model_type 'gpt2')
    or a Llama-family class (``architectures``, else ``model_type``). :class:`CheckpointError` naming
    the value otherwise."""
    archs = get(c, "architectures", list, where, err=CheckpointError, default=None)
    mt = get(c, "model_type", str, where, err=CheckpointError, default=None)
    if mt == "gpt2":
        return GPT2
    known = ", ".join([GPT2, *hf_llama.ARCHITECTURES])
    if archs is None:
        by_type = {t: a for a, t in hf_llama.ARCHITECTURES.items()}
        if mt in by_type:
            return by_type[mt]
        raise CheckpointError(f"{where}: model_type is {mt!r} and no architectures are given; tokenmill converts "
                              f"{known} (model_type 'gpt2', {', '.join(repr(t) for t in by_type)}).")
    if len(archs) != 1 or not isinstance(archs[0], str) or archs[0] not in hf_llama.ARCHITECTURES:
        raise CheckpointError(f"{where}: architectures is {archs!r}; tokenmill converts one of {known}.")
    want = hf_llama.ARCHITECTURES[archs[0]]
    if mt is not None and mt != want:
        raise CheckpointError(f"{where}: model_type is {mt!r} but architectures names {archs[0]} (model_type {want!r}).")
    return archs[0]


def _read_config(folder: str | Path) -> dict[str, Any]:
    p = Path(folder) / CONFIG_NAME
    if not p.is_file():
        raise CheckpointError(
            f"'{p}' is missing: '{folder}' is not a Hugging Face model folder (config.json + model.safetensors "
            "or pytorch_model.bin)."
        )
    return read_json(p, "", CheckpointError)


def is_hf_folder(path: str | Path, architecture: str | None = None) -> bool:
    """True when ``path`` is a folder with a ``config.json`` of a class tokenmill converts (of
    ``architecture`` when given); no weights are read and the config is not checked further."""
    try:
        arch = hf_architecture(_read_config(path), CONFIG_NAME)
    except CheckpointError:
        return False
    return architecture is None or arch == architecture


def is_hf_gpt2_folder(path: str | Path) -> bool:
    """True when ``path`` is a folder with a ``config.json`` of model_type 'gpt2'."""
    return is_hf_folder(path, GPT2)


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face model folder, checked for its family (CheckpointError
    naming the field tokenmill cannot compute exactly)."""
    c = _read_config(folder)
    where = str(Path(folder) / CONFIG_NAME)
    arch = hf_architecture(c, where)
    if arch == GPT2:
        _check_hf_config(c, where)
    else:
        hf_families.check_config(c, arch, where)
    return c


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise CheckpointError(f"reading '{path}' needs the safetensors package. Fix: {_HF_INSTALL}.") from None
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # safetensors raises its own error types for damaged headers
        raise CheckpointError(f"'{path}' cannot be read as safetensors ({type(e).__name__}: {e}).") from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle.UnpicklingError for refused objects, RuntimeError for damage
        raise CheckpointError(
            f"'{path}' cannot be loaded with torch.load(weights_only=True) ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}); only plain tensor state dicts are read, never arbitrary "
            "pickled objects. Fix: convert it to model.safetensors."
        ) from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"'{path}' does not hold a state dict (a dict of tensors).")
    return sd


def read_hf_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face model folder: ``model.safetensors``, else ``pytorch_model.bin``
    (``weights_only=True``), or the shards an ``*.index.json`` of either lists."""
    folder = Path(folder)
    for name, loader in ((SAFETENSORS_NAME, _load_safetensors), (BIN_NAME, _load_bin)):
        if (folder / name).is_file():
            return loader(folder / name)
        index = folder / f"{name}.index.json"
        if index.is_file():
            weight_map = get(read_json(index, "shard index", CheckpointError), "weight_map", dict, f"'{index}'",
                             err=CheckpointError)
            files = {inside(folder, f, f"'{index}': weight_map['{k}']", CheckpointError) for k, f in weight_map.items()}
            sd: dict[str, torch.Tensor] = {}
            for shard in sorted(files):
                if not shard.is_file():
                    raise CheckpointError(f"'{index}' lists the shard '{shard.name}', which is missing in '{folder}'.")
                sd.update(loader(shard))
            return sd
    raise CheckpointError(
        f"'{folder}' has a config.json but no weights: expected {SAFETENSORS_NAME} or {BIN_NAME} "
        "(or a sharded *.index.json)."
    )


def load_hf(folder: str | Path, base: ModelConfig | None = None,
            block_size: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face model folder of any class tokenmill converts: ``(ModelConfig, state dict)``
    for ``GPT(cfg, cfg.vocab_size)``. ``base``: the fields that do not change the function (attention
    kernel, fused q/k/v, padding, ...); ``block_size``: a context up to the model's (default: its own).
    Raises :class:`CheckpointError` naming the file and the problem (missing weights, shapes that
    contradict config.json, a model tokenmill cannot compute exactly)."""
    c = read_hf_config(folder)
    arch = hf_architecture(c, str(folder))
    if arch == GPT2:
        return from_hf_state_dict(read_hf_weights(folder), c, base, block_size, where=str(folder))
    return hf_families.from_hf_state_dict(read_hf_weights(folder), c, arch, base, block_size, where=str(folder))


def load_hf_gpt2(folder: str | Path, base: ModelConfig | None = None,
                 block_size: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """:func:`load_hf` for a GPT-2 folder only (another model_type is an error)."""
    c = _read_config(folder)
    _check_hf_config(c, str(Path(folder) / CONFIG_NAME))
    return from_hf_state_dict(read_hf_weights(folder), c, base, block_size, where=str(folder))


def export_architecture(cfg: ModelConfig, like: Mapping[str, Any] | None = None) -> str:
    """The Hugging Face class a tokenmill model of ``cfg`` is exported as: GPT-2 for learned positions,
    else a Llama-family class (the class of the config.json ``like``, e.g. the source of a fine-tuning
    run, when it holds the model exactly; see :func:`tokenmill.model.hf_families.export_architecture`).
    :class:`CheckpointError` with the reason when no class holds it exactly."""
    if cfg.pos_emb == "learned":
        check_exportable(cfg)
        return GPT2
    try:
        prefer = hf_architecture(like, CONFIG_NAME) if like else None
    except CheckpointError:
        prefer = None
    return hf_families.export_architecture(cfg, prefer)


def save_hf(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
            vocab_size: int | None = None, eot_id: int | None = None,
            like: Mapping[str, Any] | None = None) -> Path:
    """Write a Hugging Face folder (``config.json`` + ``model.safetensors``) of the class
    :func:`export_architecture` picks, equal to a tokenmill model; ``from_pretrained(out_dir)`` loads it.

    ``state_dict``: the GPT's (single-process, unsharded; on any device, any float dtype: written as
    stored). ``vocab_size``: the true vocabulary (default ``cfg.vocab_size``). ``eot_id``: the
    tokenizer's end-of-text id, written as bos/eos id (for a Llama-family class: the bos/eos/pad ids
    of ``like`` when given). Files are written under temporary names and renamed into place,
    config.json last. Tokenizer files are separate: :func:`tokenmill.data.tokenizers.write_hf_tokenizer`.
    """
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(f"writing a Hugging Face folder needs the safetensors package. Fix: {_HF_INSTALL}.") from None
    arch = export_architecture(cfg, like)
    if arch == GPT2:
        hf_sd = to_hf_state_dict(state_dict, cfg, vocab_size)
    else:
        hf_sd = hf_families.to_hf_state_dict(state_dict, cfg, arch, vocab_size)
    V = vocab_size if vocab_size is not None else cfg.vocab_size
    dtypes = {t.dtype for t in hf_sd.values()}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise CheckpointError(f"the weights mix dtypes {sorted(map(str, dtypes))}; cast the model to one float dtype first.")
    dtype = next(iter(dtypes))
    config = (hf_config(cfg, V, eot_id, dtype) if arch == GPT2 else hf_families.hf_config(cfg, arch, V, dtype, eot_id, like))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).unlink(missing_ok=True)  # incomplete until config.json lands again
    with atomic.replacing(out / SAFETENSORS_NAME) as tmp:
        save_file({k: v.cpu() for k, v in hf_sd.items()}, str(tmp), metadata={"format": "pt"})
    atomic.write_json(out / CONFIG_NAME, config)
    return out


def save_hf_gpt2(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                 vocab_size: int | None = None, eot_id: int | None = None) -> Path:
    """:func:`save_hf` for a model with a GPT-2 form (:func:`check_exportable` says why not)."""
    check_exportable(cfg)
    return save_hf(state_dict, cfg, out_dir, vocab_size, eot_id)
