"""Convert between tokenmill's :class:`~tokenmill.model.GPT` and a Hugging Face GPT-2 folder.

A Hugging Face GPT-2 folder is what ``GPT2LMHeadModel.save_pretrained`` writes: ``config.json`` and
the weights as ``model.safetensors`` (or ``pytorch_model.bin``, or either sharded with an
``*.index.json``). Both directions are pure functions of tensors and configs; nothing is downloaded
and ``transformers`` itself is never needed (only ``safetensors`` to read or write safetensors files):

* :func:`from_hf_state_dict` / :func:`load_hf_gpt2`: a GPT-2 config + weights -> a
  :class:`~tokenmill.config.ModelConfig` and a state dict that ``GPT(cfg, cfg.vocab_size)`` loads.
* :func:`to_hf_state_dict` / :func:`save_hf_gpt2`: a tokenmill state dict + ModelConfig -> a GPT-2
  config dict + weights / a folder that ``transformers.GPT2LMHeadModel.from_pretrained`` loads.

The two models compute the same function: GPT-2's ``Conv1D`` stores ``(in, out)`` matrices (the
transpose of ``nn.Linear``'s), its ``c_attn`` is the fused ``[q; k; v]`` projection, its LayerNorms use
eps 1e-5 (as every ``model.norm`` form of tokenmill: native, manual, triton), and its ``gelu_new`` is the tanh
approximation tokenmill's native and manual GELU compute. What GPT-2 cannot express is refused with
the reason (:class:`~tokenmill.errors.CheckpointError`): no biases, q/k/v biases that differ from the
others, a different activation, LayerNorm eps, MLP width or attention scaling.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import CheckpointError

__all__ = [
    "CONFIG_NAME",
    "SAFETENSORS_NAME",
    "check_exportable",
    "from_hf_state_dict",
    "hf_config",
    "hf_model_fields",
    "is_hf_gpt2_folder",
    "load_hf_gpt2",
    "read_hf_config",
    "save_hf_gpt2",
    "to_hf_state_dict",
]

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

    GPT2LMHeadModel has a bias in every projection and LayerNorm, eps 1e-5 LayerNorms, a
    tanh-GELU MLP of width 4 * n_embd and 1/sqrt(head_dim) attention scaling. Tokenmill's switches
    that only change how the same math runs (attention kernel, mask form, fused or separate q/k/v,
    native/manual/triton LayerNorm, native/manual GELU, vocabulary padding, loss form) all export.
    """
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
    if cfg.norm not in NORM_FORMS:
        raise CheckpointError(f"model.norm={cfg.norm!r} has no GPT-2 form (GPT-2 uses LayerNorm, eps {LN_EPS}).")
    if cfg.gelu not in ("native", "manual"):
        raise CheckpointError(f"model.gelu={cfg.gelu!r} has no GPT-2 form (GPT-2 uses the tanh GELU 'gelu_new').")
    if cfg.n_embd % cfg.n_head:
        raise CheckpointError(f"model.n_embd ({cfg.n_embd}) is not divisible by model.n_head ({cfg.n_head}).")


def _check_hf_config(c: Mapping[str, Any], where: str) -> None:
    """Refuse GPT-2 configs whose model tokenmill does not compute exactly."""
    mt = c.get("model_type")
    if mt != "gpt2":
        raise CheckpointError(
            f"{where}: model_type is {mt!r}; only Hugging Face GPT-2 folders (model_type 'gpt2', "
            "GPT2LMHeadModel) can be loaded."
        )
    for key in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
        v = c.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise CheckpointError(f"{where}: '{key}' must be a positive integer, got {v!r}.")
    if c["n_embd"] % c["n_head"]:
        raise CheckpointError(f"{where}: n_embd ({c['n_embd']}) is not divisible by n_head ({c['n_head']}).")
    act = c.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        raise CheckpointError(
            f"{where}: activation_function {act!r} is not the tanh-approximation GELU ({', '.join(TANH_GELUS)}) "
            "that tokenmill's MLP computes; this model cannot be loaded exactly."
        )
    inner = c.get("n_inner")
    if inner is not None and inner != 4 * c["n_embd"]:
        raise CheckpointError(
            f"{where}: n_inner is {inner}, but tokenmill's MLP width is 4 * n_embd = {4 * c['n_embd']}."
        )
    eps = c.get("layer_norm_epsilon", LN_EPS)
    if not math.isclose(float(eps), LN_EPS, rel_tol=1e-6):
        raise CheckpointError(
            f"{where}: layer_norm_epsilon is {eps}, but tokenmill's LayerNorms use {LN_EPS}; the logits "
            "would differ."
        )
    if not c.get("scale_attn_weights", True) or c.get("scale_attn_by_inverse_layer_idx", False):
        raise CheckpointError(
            f"{where}: attention scaling differs from 1/sqrt(head_dim) (scale_attn_weights / "
            "scale_attn_by_inverse_layer_idx); tokenmill's attention cannot compute it."
        )
    if c.get("add_cross_attention", False):
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
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": LN_EPS,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": cfg.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": bool(cfg.tie_embeddings),
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "use_cache": True,
        "dtype": dt,  # transformers >= 5
        "torch_dtype": dt,  # transformers 4.x
    }


def hf_model_fields(hf_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The tokenmill ``model.*`` fields a GPT-2 config fixes (the model's shape), keyed by field name:
    vocab_size, block_size, n_layer, n_head, n_embd, bias, qkv_bias, tie_embeddings.

    A fine-tuning run takes these from the source; a user override that differs is a conflict."""
    return {
        "vocab_size": int(hf_cfg["vocab_size"]),
        "block_size": int(hf_cfg["n_positions"]),
        "n_layer": int(hf_cfg["n_layer"]),
        "n_head": int(hf_cfg["n_head"]),
        "n_embd": int(hf_cfg["n_embd"]),
        "bias": True,
        "qkv_bias": True,
        "tie_embeddings": bool(hf_cfg.get("tie_word_embeddings", True)),
    }


# ----------------------------------------------------------------------------------------------
# State dicts


def _strip_wrappers(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the prefixes torch.compile (``_orig_mod.``) and DDP (``module.``) add to names."""
    out = {}
    for k, v in sd.items():
        while k.startswith(("_orig_mod.", "module.")):
            k = k.split(".", 1)[1]
        out[k.replace("._orig_mod.", ".").replace("._checkpoint_wrapped_module.", ".")] = v
    return out


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
    sd = _strip_wrappers(state_dict)
    V = vocab_size if vocab_size is not None else cfg.vocab_size
    if V is None:
        raise CheckpointError("the true vocabulary size is unknown (model.vocab_size is unset); pass vocab_size.")
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in sd:
            raise CheckpointError(f"the tokenmill state dict lacks '{key}'; it is not a whole GPT of this config.")
        used.add(key)
        return sd[key]

    def rows(key: str) -> torch.Tensor:
        w = take(key)
        if w.size(0) < V:
            raise CheckpointError(f"'{key}' has {w.size(0)} rows, fewer than the vocabulary ({V}).")
        return w[:V]  # padding rows never reach the logits

    out["transformer.wte.weight"] = rows("wte.weight")
    out["transformer.wpe.weight"] = take("wpe.weight")
    C = cfg.n_embd
    for i in range(cfg.n_layer):
        s, d = f"blocks.{i}.", f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{d}{ln}.weight"] = take(f"{s}{ln}.weight")
            out[f"{d}{ln}.bias"] = take(f"{s}{ln}.bias")
        if f"{s}attn.c_attn.weight" in sd:
            w, b = take(f"{s}attn.c_attn.weight"), take(f"{s}attn.c_attn.bias")
        else:
            w = torch.cat([take(f"{s}attn.{n}_proj.weight") for n in "qkv"])
            b = torch.cat([take(f"{s}attn.{n}_proj.bias") for n in "qkv"])
        if tuple(w.shape) != (3 * C, C):
            raise CheckpointError(f"'{s}attn' q/k/v weight has shape {tuple(w.shape)}, expected {(3 * C, C)}.")
        out[f"{d}attn.c_attn.weight"], out[f"{d}attn.c_attn.bias"] = w.t(), b
        for name in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            out[f"{d}{name}.weight"] = take(f"{s}{name}.weight").t()
            out[f"{d}{name}.bias"] = take(f"{s}{name}.bias")
    out["transformer.ln_f.weight"] = take("ln_f.weight")
    out["transformer.ln_f.bias"] = take("ln_f.bias")
    if cfg.tie_embeddings:
        if "lm_head.weight" in sd:
            used.add("lm_head.weight")
            if not torch.equal(sd["lm_head.weight"][:V], sd["wte.weight"][:V]):
                raise CheckpointError(
                    "model.tie_embeddings is true but lm_head.weight differs from wte.weight in this state dict; "
                    "the config does not describe these weights."
                )
    else:
        out["lm_head.weight"] = rows("lm_head.weight")
    extra = sorted(k for k in sd if k not in used)
    if extra:
        raise CheckpointError(
            f"the state dict holds weights GPT-2 has no place for: {', '.join(extra[:5])}"
            f"{' ...' if len(extra) > 5 else ''}; it cannot be exported as GPT-2."
        )
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


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
    _check_hf_config(hf_cfg, where)
    fields = hf_model_fields(hf_cfg)
    if block_size is not None:
        if block_size > fields["block_size"]:
            raise CheckpointError(
                f"{where}: model.block_size {block_size} exceeds the model's n_positions {fields['block_size']} "
                "(no position embeddings beyond it). Fix: use a block_size <= n_positions."
            )
        fields["block_size"] = block_size
    cfg = dataclasses.replace(base if base is not None else ModelConfig(), **fields)
    V, C, L = fields["vocab_size"], fields["n_embd"], fields["n_layer"]
    m = cfg.vocab_pad_multiple
    Vp = (V + m - 1) // m * m

    sd: dict[str, torch.Tensor] = {}
    for k, v in hf_sd.items():
        if k.endswith(_IGNORED_SUFFIXES):
            continue
        sd[k.removeprefix("transformer.")] = v
    used: set[str] = set()

    def take(key: str, shape: tuple[int, ...]) -> torch.Tensor:
        if key not in sd:
            raise CheckpointError(f"{where}: '{key}' is missing; the folder is not a complete GPT-2 of its config.json.")
        t = sd[key]
        if tuple(t.shape) != shape:
            raise CheckpointError(
                f"{where}: '{key}' has shape {tuple(t.shape)}, but config.json implies {shape}; weights and "
                "config do not match."
            )
        used.add(key)
        return t

    def padded(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([w, w.new_zeros(Vp - V, C)]) if Vp > V else w.clone()

    out: dict[str, torch.Tensor] = {}
    out["wte.weight"] = padded(take("wte.weight", (V, C)))
    out["wpe.weight"] = take("wpe.weight", (hf_cfg["n_positions"], C))[: cfg.block_size].clone()
    for i in range(L):
        s, d = f"h.{i}.", f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            out[f"{d}{ln}.weight"] = take(f"{s}{ln}.weight", (C,))
            out[f"{d}{ln}.bias"] = take(f"{s}{ln}.bias", (C,))
        w = take(f"{s}attn.c_attn.weight", (C, 3 * C)).t()
        b = take(f"{s}attn.c_attn.bias", (3 * C,))
        if cfg.fused_qkv:
            out[f"{d}attn.c_attn.weight"], out[f"{d}attn.c_attn.bias"] = w, b
        else:
            for n, wp, bp in zip("qkv", w.chunk(3, dim=0), b.chunk(3, dim=0)):
                out[f"{d}attn.{n}_proj.weight"], out[f"{d}attn.{n}_proj.bias"] = wp, bp
        for name, shape in (("attn.c_proj", (C, C)), ("mlp.c_fc", (C, 4 * C)), ("mlp.c_proj", (4 * C, C))):
            out[f"{d}{name}.weight"] = take(f"{s}{name}.weight", shape).t()
            out[f"{d}{name}.bias"] = take(f"{s}{name}.bias", (shape[1],))
    out["ln_f.weight"] = take("ln_f.weight", (C,))
    out["ln_f.bias"] = take("ln_f.bias", (C,))
    if cfg.tie_embeddings:
        used.add("lm_head.weight")  # a tied head is wte; a stored copy (older savers) is ignored
        out["lm_head.weight"] = out["wte.weight"]
    else:
        if "lm_head.weight" not in sd:
            raise CheckpointError(
                f"{where}: tie_word_embeddings is false but 'lm_head.weight' is missing; the untied head's "
                "weights are not in the folder."
            )
        out["lm_head.weight"] = padded(take("lm_head.weight", (V, C)))
    extra = sorted(k for k in sd if k not in used)
    if extra:
        raise CheckpointError(
            f"{where}: weights a GPT-2 of this config does not have: {', '.join(extra[:5])}"
            f"{' ...' if len(extra) > 5 else ''}. Is it a GPT2LMHeadModel folder?"
        )
    return cfg, {k: v.contiguous() for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# Folders


def is_hf_gpt2_folder(path: str | Path) -> bool:
    """True when ``path`` is a folder with a ``config.json`` of model_type 'gpt2'."""
    p = Path(path) / CONFIG_NAME
    if not p.is_file():
        return False
    try:
        return json.loads(p.read_text(encoding="utf-8")).get("model_type") == "gpt2"
    except (OSError, ValueError, AttributeError):
        return False


def read_hf_config(folder: str | Path) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face GPT-2 folder, checked (CheckpointError otherwise)."""
    p = Path(folder) / CONFIG_NAME
    if not p.is_file():
        raise CheckpointError(
            f"'{p}' is missing: '{folder}' is not a Hugging Face model folder (config.json + model.safetensors "
            "or pytorch_model.bin)."
        )
    try:
        c = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"'{p}' cannot be read as JSON ({e}).") from None
    if not isinstance(c, dict):
        raise CheckpointError(f"'{p}' is not a JSON object.")
    _check_hf_config(c, str(p))
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
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, AttributeError) as e:
                raise CheckpointError(f"'{index}' is not a valid shard index ({e}).") from None
            sd: dict[str, torch.Tensor] = {}
            for shard in shards:
                if not (folder / shard).is_file():
                    raise CheckpointError(f"'{index}' lists the shard '{shard}', which is missing in '{folder}'.")
                sd.update(loader(folder / shard))
            return sd
    raise CheckpointError(
        f"'{folder}' has a config.json but no weights: expected {SAFETENSORS_NAME} or {BIN_NAME} "
        "(or a sharded *.index.json)."
    )


def load_hf_gpt2(folder: str | Path, base: ModelConfig | None = None,
                 block_size: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face GPT-2 folder: ``(ModelConfig, state dict)`` for ``GPT(cfg, cfg.vocab_size)``.

    See :func:`from_hf_state_dict` for ``base`` and ``block_size``. Raises :class:`CheckpointError`
    naming the file and the problem (missing weights, shapes that contradict config.json, a model
    tokenmill cannot compute exactly).
    """
    hf_cfg = read_hf_config(folder)
    return from_hf_state_dict(read_hf_weights(folder), hf_cfg, base, block_size, where=str(folder))


def save_hf_gpt2(state_dict: Mapping[str, torch.Tensor], cfg: ModelConfig, out_dir: str | Path,
                 vocab_size: int | None = None, eot_id: int | None = None) -> Path:
    """Write a Hugging Face GPT-2 folder (``config.json`` + ``model.safetensors``) equal to a tokenmill
    model, and return its path. ``transformers.GPT2LMHeadModel.from_pretrained(out_dir)`` loads it.

    ``state_dict``: the GPT's (single-process, unsharded; on any device, any float dtype: written as
    stored). ``vocab_size``: the true vocabulary (default ``cfg.vocab_size``). ``eot_id``: the
    tokenizer's end-of-text id, written as bos/eos id. Files are written under temporary names and
    renamed into place, config.json last. Tokenizer files are separate:
    :func:`tokenmill.data.tokenizers.write_hf_tokenizer`.
    """
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise CheckpointError(f"writing a Hugging Face folder needs the safetensors package. Fix: {_HF_INSTALL}.") from None
    hf_sd = to_hf_state_dict(state_dict, cfg, vocab_size)
    V = hf_sd["transformer.wte.weight"].size(0)
    dtypes = {t.dtype for t in hf_sd.values()}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise CheckpointError(f"the weights mix dtypes {sorted(map(str, dtypes))}; cast the model to one float dtype first.")
    config = hf_config(cfg, V, eot_id, next(iter(dtypes)))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).unlink(missing_ok=True)  # incomplete until config.json lands again
    tmp = out / f".{SAFETENSORS_NAME}.tmp-{os.getpid()}"
    try:
        save_file({k: v.cpu() for k, v in hf_sd.items()}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / SAFETENSORS_NAME)
    finally:
        tmp.unlink(missing_ok=True)
    tmp = out / f".{CONFIG_NAME}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, out / CONFIG_NAME)
    return out
