"""Config resolution: coercing and checking values (types and the declared ranges, in one place:
:func:`validate`), flattening TOML sections, presets, layering sources, and writing TOML."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import sys
import typing
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from tokenmill import atomic
from tokenmill.config.inert import warn_inert
from tokenmill.config.lora import LORA_ROLES, check_expert_targets, check_nf4_shards
from tokenmill.config.model import check_moe
from tokenmill.config.schema import Config, describe_range, field_ranges, field_specs, sections
from tokenmill.config.size import check_size
from tokenmill.config.suggest import suggest
from tokenmill.config.toml_out import dumps as toml_dumps
from tokenmill.errors import ConfigError, PathError
from tokenmill.filecheck import Number, check_number, read_toml
from tokenmill.paths import expand_path


def _closest(name: str, options: list[str]) -> str:
    """`` Did you mean 'x'?`` for a mistyped value or section name (config keys: :func:`suggest_key`)."""
    m = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" Did you mean '{m[0]}'?" if m else ""


def _coerce(key: str, tp: Any, value: Any, from_string: bool) -> Any:
    """Convert/validate one value for a field annotated ``tp``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union and type(None) in args:
        if value is None or (from_string and str(value).lower() in ("none", "null", "")):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _coerce(key, inner, value, from_string)
    if origin is Literal:
        choices = list(args)
        if value in choices:
            return value
        if from_string or isinstance(value, str):
            for c in choices:
                if str(c) == str(value):
                    return c
        hint = _closest(str(value), [str(c) for c in choices])
        raise ConfigError(f"{key}: {value!r} is not one of {choices}.{hint}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str):
            v = value.lower()
            if v in ("1", "true", "yes", "on"):
                return True
            if v in ("0", "false", "no", "off"):
                return False
        raise ConfigError(f"{key}: expected true or false, got {value!r}.")
    if tp in (int, float):
        return _coerce_number(key, tp, value)
    if tp is str:
        if isinstance(value, str):
            if key not in _path_kinds():  # text, recorded in the UTF-8 config.toml (paths: expand_path checks)
                _check_utf8(key, value)
            return value
        if from_string:
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}.")
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover


def _coerce_number(key: str, tp: type, value: Any) -> Any:
    """An int or float field's value: a number, or text of one (flags); a TOML float keeps its literal, so an
    infinite or underflowing one is refused naming the field (:func:`tokenmill.filecheck.check_number`)."""
    if isinstance(value, Number):  # a TOML float: infinite or underflowed to 0.0
        check_number(value.text, value, key, ConfigError)
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected an integer, got {value!r}.")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{key}: expected a number, got {value!r}.")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
            if number is not None:
                return check_number(value, number, key, ConfigError)
        raise ConfigError(f"{key}: expected a number, got {value!r}.")


def _check_utf8(key: str, value: str) -> None:
    """A text value that is not UTF-8 (a lone surrogate from non-UTF-8 bytes on the command line) is refused:
    config.toml, the logs and the terminal hold UTF-8 text."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        shown = value.encode("utf-8", "surrogateescape" if _escapable(value) else "backslashreplace")
        raise ConfigError(f"{key}: {shown!r} is not valid UTF-8 text; pass it in UTF-8.") from None


def _escapable(value: str) -> bool:
    try:
        value.encode("utf-8", "surrogateescape")
        return True
    except UnicodeEncodeError:
        return False


def apply_overrides(cfg: Config, overrides: dict[str, Any], from_string: bool = False, origin: str = "") -> Config:
    """Apply flat ``{'section.field': value}`` overrides in place (validated) and return ``cfg``."""
    specs = field_specs()
    where = f" (in {origin})" if origin else ""
    for key, value in overrides.items():
        if key not in specs:
            raise ConfigError(f"unknown config key '{key}'{where}.{suggest(key, list(specs))}")
        tp = specs[key][0]
        section, name = key.split(".", 1)
        value = _coerce(key, tp, value, from_string)
        if isinstance(value, str) and _path_kinds().get(key):
            value = _expand(key, value, _path_kinds()[key], where)
        setattr(getattr(cfg, section), name, value)
    return cfg


@functools.cache
def _path_kinds() -> dict[str, str]:
    """'section.field' -> 'one' / 'list' for the fields declared ``F(..., path=...)``."""
    return {f"{sname}.{f.name}": f.metadata["path"] for sname, scls in sections().items()
            for f in dataclasses.fields(scls) if f.metadata.get("path")}


def _expand(key: str, value: str, kind: str, where: str) -> str:
    """A path field's value with ``~`` and ``$VAR`` expanded (each entry of a 'list' field)."""
    try:
        if kind == "list":
            return ",".join(expand_path(part.strip(), key) if part.strip() else part for part in value.split(","))
        return expand_path(value, key)
    except PathError as e:
        raise ConfigError(f"{e}{where}") from None


def flatten(tree: dict[str, Any], origin: str = "") -> dict[str, Any]:
    """``{'train': {'max_steps': 3}}`` -> ``{'train.max_steps': 3}``; errors name bad sections."""
    flat = {}
    names = list(sections())
    for sname, body in tree.items():
        if not isinstance(body, dict):
            raise ConfigError(
                f"top-level key '{sname}' in {origin or 'config'} must be a [section] table; "
                f"sections are {names}.{_closest(sname, names)}"
            )
        if sname not in names:
            raise ConfigError(f"unknown config section '[{sname}]' in {origin or 'config'}.{_closest(sname, names)}")
        for k, v in body.items():
            flat[f"{sname}.{k}"] = v
    return flat


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file '{p}' is a folder; give the path of a .toml file.")
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist.")
    return read_toml(p, "config file", ConfigError)  # floats keep their literal: _coerce checks it


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("tokenmill.presets").iterdir() if p.name.endswith(".toml"))


def load_preset(name: str) -> dict[str, Any]:
    names = preset_names()
    if name not in names:
        raise ConfigError(f"unknown preset '{name}'; presets are {names}.{_closest(name, names)}")
    with resources.files("tokenmill.presets").joinpath(f"{name}.toml").open("rb") as f:
        return tomllib.load(f)


def check_ranges(cfg: Config) -> None:
    """Every numeric field against the range declared where it is defined (one place for all of them);
    floats must also be finite."""
    bounds = field_ranges()
    for key, (_tp, _default, _doc) in field_specs().items():
        section, name = key.split(".", 1)
        v = getattr(getattr(cfg, section), name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{key} must be a finite number, got {v}.")
        if isinstance(v, int) and not -(2**63) <= v < 2**63:  # torch, numpy and the data stream use int64
            raise ConfigError(f"{key} must fit in a signed 64-bit integer, got {v}.")
        r = bounds[key]
        ok = all((("ge" not in r) or v >= r["ge"], ("gt" not in r) or v > r["gt"],
                  ("le" not in r) or v <= r["le"], ("lt" not in r) or v < r["lt"]))
        if not ok:
            raise ConfigError(f"{key} must be {describe_range(r)}, got {v}.")


def validate(cfg: Config) -> Config:
    """Declared ranges (:func:`check_ranges`), then cross-field checks that single fields cannot express."""
    check_ranges(cfg)
    m = cfg.model
    if m.n_embd % m.n_head and m.head_dim is None:
        raise ConfigError(
            f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head}) (or set model.head_dim); "
            f"try model.n_head={_divisor_near(m.n_embd, m.n_head)}."
        )
    _validate_architecture(m)
    check_size(m, cfg.train.batch_size)  # absurd shapes stop here, before any command builds or sizes a model
    if cfg.data.source == "synthetic" and m.vocab_size is None:
        raise ConfigError("data.source='synthetic' needs model.vocab_size (e.g. --model.vocab_size 50257).")
    _validate_memory_and_parallel(cfg)
    _validate_lora(cfg)
    return cfg


def check_lora_targets(cfg: Config) -> None:
    """``lora.targets`` names only projections the model has: no 'gate' in a GELU MLP, no 'experts' in a dense
    model, no MLP role in a model whose every layer is sparse without shared experts; QLoRA not on experts;
    QLoRA under FSDP only where every NF4 weight splits evenly over the shards."""
    names = [t.strip() for t in cfg.lora.targets.split(",")]
    check_expert_targets(cfg.lora, cfg.model)  # config/lora.py: the roles of a mixture of experts
    if cfg.lora.rank and cfg.lora.quantize_base == "nf4":
        check_nf4_shards(cfg.model, cfg.parallel.dp_shard)
    if "gate" in names and cfg.model.mlp != "swiglu":
        raise ConfigError("lora.targets names 'gate', but a GELU MLP (model.mlp='gelu') has no gate projection; "
                          "its projections are up (c_fc) and down (c_proj).")


def _validate_lora(cfg: Config) -> None:
    """``lora.targets`` names known projections the model has; LoRA does not compose with TP or PP."""
    lo = cfg.lora
    names = [t.strip() for t in lo.targets.split(",") if t.strip()]
    bad = [n for n in names if n not in (*LORA_ROLES, "all")]
    if bad or not names:
        raise ConfigError(f"lora.targets: {bad[0] if bad else lo.targets!r} is not a projection; name some of "
                          f"{', '.join(LORA_ROLES)} (comma-separated), or 'all'.{_closest(bad[0], list(LORA_ROLES)) if bad else ''}")
    if not cfg.train.init_from:  # else the source decides model.mlp: checked once its shape is adopted
        check_lora_targets(cfg)
    if lo.rank and (cfg.parallel.tp > 1 or cfg.parallel.pp > 1):
        raise ConfigError("lora.rank > 0 works with one process, DDP and FSDP (parallel.dp_replicate / dp_shard), "
                          "not with parallel.tp or parallel.pp: the adapters are not split by heads or stages. "
                          "Shard with --parallel.dp_shard instead (the frozen base has no optimizer state to shard).")
    if lo.quantize_base != "none" and not lo.rank:
        raise ConfigError(f"lora.quantize_base={lo.quantize_base!r} quantises the frozen base under LoRA adapters: it "
                          "needs --lora.rank > 0 (e.g. --lora.rank 16).")
    if lo.rank and getattr(cfg.train, "fp8", "off") != "off":
        raise ConfigError("lora.rank > 0 does not combine with train.fp8: the FP8 conversion would replace the adapted "
                          "projections (and their adapters) by float8 Linears. Use one of them (--train.fp8 off).")


def _validate_architecture(m) -> None:
    """Family switches that only make sense together."""
    if m.n_head % m.kv_heads:
        raise ConfigError(f"model.n_kv_head ({m.n_kv_head}) must divide model.n_head ({m.n_head}) "
                          f"(grouped-query attention: each k/v head serves n_head / n_kv_head query heads).")
    if m.pos_emb == "rope" and m.head_width % 2:
        raise ConfigError(f"model.pos_emb='rope' rotates pairs of features: the head width ({m.head_width}) must be even.")
    if m.norm == "triton" and m.norm_type != "layernorm":
        raise ConfigError("model.norm='triton' is a LayerNorm kernel; with model.norm_type='rmsnorm' use "
                          "--model.norm native (or manual).")
    if m.rope_scaling != "none" and m.pos_emb != "rope":
        raise ConfigError(f"model.rope_scaling={m.rope_scaling!r} scales rotary embeddings: it needs "
                          "--model.pos_emb rope.")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor ({m.rope_high_freq_factor}) must be greater than "
                          f"model.rope_low_freq_factor ({m.rope_low_freq_factor}).")
    check_moe(m)  # mixture of experts: top-k, layer list


def _validate_memory_and_parallel(cfg: Config) -> None:
    mem, p = cfg.memory, cfg.parallel
    if mem.optimizer_in_backward:
        if cfg.train.grad_accum_steps != 1:
            raise ConfigError(
                "memory.optimizer_in_backward steps each parameter as soon as its gradient is ready, so it cannot "
                f"accumulate gradients: set train.grad_accum_steps=1 (now {cfg.train.grad_accum_steps})."
            )
        if cfg.optim.grad_clip > 0:
            raise ConfigError(
                "memory.optimizer_in_backward cannot clip the global gradient norm (the norm needs every "
                "gradient before the first update): set --optim.grad_clip 0."
            )
        if cfg.train.precision == "fp16-autocast":
            raise ConfigError("memory.optimizer_in_backward does not work with fp16 GradScaler; use bf16-autocast.")
    if mem.optimizer_offload and cfg.train.precision == "fp16-autocast":
        raise ConfigError("memory.optimizer_offload does not work with the fp16 GradScaler; use bf16-autocast.")
    if mem.offload_gradients and not mem.optimizer_offload:
        raise ConfigError("memory.offload_gradients moves gradients to the CPU optimizer of memory.optimizer_offload: "
                          "add --memory.optimizer_offload true.")
    chosen = [k for k in ("optimizer_in_backward", "optimizer_offload", "optimizer_8bit") if getattr(mem, k)]
    if len(chosen) > 1:
        raise ConfigError(f"choose one of memory.{', memory.'.join(chosen)}.")
    for k in ("dp_replicate", "dp_shard"):
        v = getattr(p, k)
        if v == 0 or v < -1:
            raise ConfigError(f"parallel.{k} must be >= 1 or -1 (the rest), got {v}.")
    if p.dp_replicate == -1 and p.dp_shard == -1:
        raise ConfigError("only one of parallel.dp_replicate and parallel.dp_shard may be -1.")
    if p.zero1 and p.dp_shard != 1:
        raise ConfigError("parallel.zero1 shards optimizer state over DDP; with dp_shard > 1 FSDP already does.")
    _validate_model_parallel(cfg)
    _validate_expert_parallel(cfg)


def _validate_expert_parallel(cfg: Config) -> None:
    """``parallel.ep``: experts to split, evenly, over data-parallel ranks (the world size is checked at launch);
    and the grouped experts under compile, whose traced shape kernel takes bf16 only."""
    m, p = cfg.model, cfg.parallel
    if (m.moe_experts and m.moe_impl == "grouped" and cfg.compile.enabled
            and cfg.train.precision not in ("bf16", "bf16-autocast", "auto")):  # 'auto': the device decides (moe.py)
        raise ConfigError(f"model.moe_impl='grouped' under compile.enabled needs bf16 products (torch's grouped "
                          f"matrix product traces in bf16 only), but train.precision is {cfg.train.precision!r}: "
                          "use --train.precision bf16-autocast, or --model.moe_impl auto (the per-expert loop where "
                          "the grouped product cannot run).")
    if p.ep > 1 and not m.moe_experts:
        raise ConfigError(f"parallel.ep={p.ep} splits a mixture of experts over ranks, but this model has none "
                          "(model.moe_experts = 0): leave parallel.ep at 1.")
    if p.ep == 1:
        return
    if m.moe_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.moe_experts ({m.moe_experts}): each rank keeps "
                          "an equal share of the experts.")
    if p.dp_replicate * p.dp_shard > 0 and p.dp_replicate * p.dp_shard % p.ep:  # -1 (the rest): at launch
        raise ConfigError(f"parallel.ep={p.ep} must divide the data-parallel world size (parallel.dp_replicate x "
                          f"dp_shard = {p.dp_replicate * p.dp_shard}).")
    if p.tp > 1 or p.pp > 1 or p.zero1:
        raise ConfigError(f"parallel.ep={p.ep} splits the experts over data-parallel ranks; it does not combine "
                          "with parallel.tp, parallel.pp or parallel.zero1 yet.")
    if cfg.lora.rank and {"all", "experts"} & {t.strip() for t in cfg.lora.targets.split(",")}:
        raise ConfigError(f"parallel.ep={p.ep} does not split LoRA adapters on the experts: leave 'experts' out "
                          "of lora.targets (e.g. --lora.targets q,k,v,o) or use parallel.ep 1.")


def _validate_model_parallel(cfg: Config) -> None:
    """Tensor and pipeline parallelism: shapes that split evenly, and switches that compose."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.tp > 1 and m.qk_norm and m.qk_norm_width == "all":
        raise ConfigError("model.qk_norm_width='all' normalises q and k over all heads together, which "
                          "parallel.tp (heads split over ranks) cannot compute; use parallel.dp_shard instead.")
    if m.moe_experts and p.pp > 1:
        raise ConfigError("model.moe_experts > 0 does not combine with parallel.pp: the load-balancing loss pools "
                          "every layer's routing, so each stage's router gradient needs the other stages' routing, "
                          "which the pipeline schedule does not pass; use parallel.dp_shard, tp or ep.")
    if p.tp > 1:
        if m.fused_qkv:
            raise ConfigError(
                "parallel.tp > 1 splits q, k and v by heads, which the fused [q; k; v] matrix cannot do "
                "evenly: add --model.fused_qkv false (same math, three matrices)."
            )
        if m.n_head % p.tp or m.kv_heads % p.tp:
            raise ConfigError(f"model.n_head ({m.n_head}) and the key/value heads ({m.kv_heads}) must be "
                              f"divisible by parallel.tp ({p.tp}): each rank keeps whole heads.")
    if p.tp > 1 or p.pp > 1:
        if p.zero1:
            raise ConfigError("parallel.zero1 works with DDP only; with parallel.tp/pp shard with parallel.dp_shard.")
        if cfg.memory.optimizer_8bit:
            raise ConfigError("memory.optimizer_8bit is not supported with parallel.tp/pp.")
    if p.pp > 1:
        if m.tie_embeddings:
            raise ConfigError(
                "parallel.pp > 1 puts the token embedding on the first stage and the head on the last, so they "
                "cannot share one matrix: add --model.tie_embeddings false."
            )
        if m.n_layer < p.pp:
            raise ConfigError(f"model.n_layer ({m.n_layer}) must be >= parallel.pp ({p.pp}): one block per stage.")
        n_mb = p.pp_microbatches or p.pp
        if t.batch_size % n_mb:
            raise ConfigError(
                f"train.batch_size ({t.batch_size}) must be divisible by the pipeline micro-batches ({n_mb}, "
                "parallel.pp_microbatches or the pp degree)."
            )
        if p.pp_schedule == "1f1b" and n_mb < p.pp:
            raise ConfigError(
                f"the 1F1B schedule needs at least as many micro-batches as stages: parallel.pp_microbatches "
                f"({n_mb}) < parallel.pp ({p.pp})."
            )
        if t.precision == "fp16-autocast":
            raise ConfigError("parallel.pp > 1 does not support the fp16 GradScaler; use --train.precision bf16-autocast.")


def _divisor_near(n: int, k: int) -> int:
    divs = [d for d in range(1, n + 1) if n % d == 0]
    return min(divs, key=lambda d: abs(d - k))


def resolve(
    preset: Optional[str] = None,
    config_files: Optional[list[str]] = None,
    overrides: Optional[dict[str, Any]] = None,
    overrides_from_string: bool = True,
) -> Config:
    """defaults < preset < config files (in order) < overrides."""
    cfg = Config()
    if preset is not None:  # an empty name (an unset shell variable) is an unknown preset, not none
        apply_overrides(cfg, flatten(load_preset(preset), f"preset '{preset}'"), origin=f"preset '{preset}'")
    base = copy.deepcopy(cfg)  # what the user did not choose here: defaults, the preset, a run's recorded config
    for path in config_files or []:
        flat = flatten(load_toml(path), str(path))
        apply_overrides(cfg, flat, origin=str(path))
        if _recorded(path):
            apply_overrides(base, flat, origin=str(path))
    if overrides:
        apply_overrides(cfg, overrides, from_string=overrides_from_string, origin="command line")
    warn_inert(validate(cfg), base)  # switches that do nothing under the rest: said once, naming what they need
    return cfg


def _recorded(path: str | Path) -> bool:
    """Whether ``path`` is a config.toml that tokenmill wrote (:func:`save`), not one a user wrote."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().startswith(RECORDED_HEADER)
    except (OSError, UnicodeDecodeError):
        return False


RECORDED_HEADER = "# tokenmill resolved config"  # the first line of every config.toml tokenmill writes


def to_toml(cfg: Config) -> str:
    """Serialise to TOML. None values are omitted (TOML has no null); every Optional field defaults
    to None, so reading the file back gives the same config."""
    tree = {}
    for sname, body in cfg.to_dict().items():
        tree[sname] = {k: v for k, v in body.items() if v is not None}
    return toml_dumps(tree)


def save(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` as TOML to ``path`` atomically (a temporary sibling renamed into place), so a crash or a
    full disk never leaves a half-written config.toml in a run directory."""
    atomic.write_text(path, RECORDED_HEADER + ": feed back with --config to reproduce this run\n" + to_toml(cfg))


def from_dict(tree: dict[str, Any]) -> Config:
    return validate(apply_overrides(Config(), flatten(tree)))


def reference_markdown() -> str:
    """The config reference as Markdown tables, one per section (used by README and `tokenmill config`)."""
    out = []
    specs, ranges = field_specs(), field_ranges()
    for sname, scls in sections().items():
        out.append(f"### `[{sname}]` — {scls.__doc__.strip()}\n\n| field | default | valid | meaning |\n|---|---|---|---|")
        for key, (_tp, default, doc) in specs.items():
            if key.startswith(sname + "."):
                valid = describe_range(ranges[key]) or _choices(_tp)
                out.append(f"| `{key}` | `{default!r}` | {valid} | {doc.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def _choices(tp: Any) -> str:
    """The choices of a Literal field (``'a' / 'b'``), 'true / false' for a bool, else empty."""
    if tp is bool:
        return "true / false"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is Literal:
        return " / ".join(f"`{a}`" for a in args)
    if args and typing.get_origin(args[0]) is Literal:
        return _choices(args[0])
    return ""
