"""Typed run configuration.

A run is fully described by one :class:`Config`: a dataclass per section, a docstring (``doc``
metadata) on every field. Resolution order, later wins::

    defaults < preset (TOML shipped in tokenmill/presets) < --config FILE.toml < --section.field VALUE

Unknown keys and bad values raise :class:`ConfigError` naming the key and the closest valid one.
The resolved config is written as ``config.toml`` into the run directory and can be fed back
with ``--config`` to reproduce the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import tomli_w

from tokenmill.errors import ConfigError


def F(default: Any, doc: str, **kw: Any) -> Any:
    """A config field with its documentation."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)


@dataclass
class ModelConfig:
    """The GPT model. Baseline and optimised forms differ only by these fields."""

    vocab_size: Optional[int] = F(
        None, "Vocabulary size. None: taken from the data's metadata. Must be >= the data's vocabulary."
    )
    vocab_pad_multiple: int = F(
        1,
        "Pad the embedding/output vocabulary up to a multiple of this (64 for tensor cores; 1 = no padding). "
        "The head is computed on the padded matrix and the padded columns are sliced off the logits, so "
        "they are never predicted and do not change the loss.",
    )
    block_size: int = F(1024, "Context length in tokens (sequence length of every training window).")
    n_layer: int = F(12, "Number of transformer blocks.")
    n_head: int = F(12, "Number of attention heads.")
    n_embd: int = F(768, "Embedding (model) width; must be divisible by n_head.")
    dropout: float = F(0.0, "Dropout probability on embeddings, attention weights and residual branches.")
    bias: bool = F(True, "Bias in Linear layers (other than q/k/v) and LayerNorms.")
    qkv_bias: bool = F(True, "Bias in the query/key/value projections.")
    tie_embeddings: bool = F(True, "Share the token-embedding matrix with the output head (GPT-2 style).")
    attention: Literal["manual", "sdpa"] = F(
        "sdpa",
        "Attention kernel: 'manual' = explicit q@k^T, causal mask, softmax, @v; 'sdpa' = "
        "torch.nn.functional.scaled_dot_product_attention (flash / memory-efficient / cuDNN kernels).",
    )
    sdpa_backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = F(
        "auto", "Force one SDPA backend (attention='sdpa' only); 'auto' lets PyTorch pick."
    )
    causal_mask: Literal["buffer", "on_the_fly"] = F(
        "on_the_fly",
        "Manual attention only: 'buffer' keeps a (block_size x block_size) triu mask as a registered "
        "buffer; 'on_the_fly' builds it for the current length each forward.",
    )
    fused_qkv: bool = F(True, "One fused Linear for q, k, v instead of three separate ones.")
    norm: Literal["native", "manual"] = F(
        "native", "LayerNorm: 'native' = nn.LayerNorm (fused kernel); 'manual' = hand-written mean/var module."
    )
    gelu: Literal["native", "manual"] = F(
        "native", "tanh-GELU: 'native' = nn.GELU(approximate='tanh'); 'manual' = hand-written formula."
    )
    init_std: float = F(
        0.02, "GPT-2 initialisation: std of Linear/Embedding weights; residual projections get std/sqrt(2*n_layer)."
    )
    loss_impl: Literal["full", "chunked"] = F(
        "full",
        "'full' = head over all tokens, then cross-entropy on the (B*T, vocab) logits; 'chunked' = head + "
        "cross-entropy over model.loss_chunk_size tokens at a time, gradients computed chunk by chunk, so "
        "the full logits are never materialised (training returns no logits). Same loss and gradients.",
    )
    loss_chunk_size: int = F(1024, "Tokens per chunk for model.loss_impl='chunked'.")


@dataclass
class DataConfig:
    """Where tokens come from and how they reach the device."""

    source: Literal["tokens", "synthetic"] = F(
        "tokens",
        "'tokens' = a prepared token folder (data.path, or the embedded corpus when path is unset); "
        "'synthetic' = uniformly random token ids (pure throughput runs; vocab from model.vocab_size).",
    )
    path: Optional[str] = F(
        None,
        "A folder written by `tokenmill prepare` (meta.json + train.bin + val.bin). None: the embedded "
        "corpus (this Python's standard-library sources), prepared on first use and cached.",
    )
    tokenizer: Literal["gpt2", "bytes", "bpe"] = F(
        "bpe",
        "Tokenizer used when the embedded corpus is prepared on first use: 'gpt2' (tiktoken), 'bytes' "
        "(256 ids), 'bpe' (byte-level BPE trained on the corpus with HF tokenizers).",
    )
    bpe_vocab_size: int = F(4096, "Vocabulary size of the 'bpe' tokenizer trained for the embedded corpus.")
    cache_dir: Optional[str] = F(
        None, "Where the embedded corpus is prepared and cached. None: $TOKENMILL_CACHE or ~/.cache/tokenmill."
    )
    sampling: Literal["random", "sequential"] = F(
        "random",
        "'random' = windows at random offsets; 'sequential' = non-overlapping windows in file order, "
        "wrapping around. Both are a pure function of (seed, global sample index).",
    )
    validate: Literal["full", "quick"] = F(
        "full",
        "'full' scans every token id against the vocabulary before training; 'quick' checks only "
        "metadata, dtype and file sizes.",
    )
    num_workers: int = F(0, "DataLoader worker processes (0 = load in the training process).")
    pin_memory: bool = F(False, "Page-locked host batches (faster, asynchronous host-to-device copies).")
    non_blocking: bool = F(False, "Host-to-device copies with non_blocking=True (overlap with compute when pinned).")
    persistent_workers: bool = F(True, "Keep DataLoader workers alive between epochs/evals (num_workers > 0).")
    prefetch_factor: int = F(2, "Batches prefetched per worker (num_workers > 0).")
    cpu_work_ms: float = F(
        0.0,
        "Synthetic CPU workload per sample, in milliseconds (holds the GIL, like text augmentation). "
        "Reproduces the book's data-bound case; the tokens are unchanged.",
    )


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = F(1000, "Optimizer steps to train.")
    batch_size: int = F(8, "Per-device micro-batch size (sequences).")
    grad_accum_steps: int = F(
        1, "Micro-batches accumulated per optimizer step; the update equals one batch k times larger."
    )
    seed: int = F(1337, "Seed for initialisation, dropout and the global data stream.")
    device: Literal["auto", "cpu", "cuda", "mps"] = F("auto", "Device; 'auto' = cuda, else mps, else cpu.")
    precision: Literal["fp32", "bf16-autocast", "bf16", "fp16-autocast"] = F(
        "fp32",
        "'fp32'; 'bf16-autocast' = bf16 compute with fp32 weights; 'bf16' = whole model and optimizer "
        "state cast to bf16 (pure bf16, no autocast); 'fp16-autocast' = fp16 autocast with GradScaler.",
    )
    tf32: bool = F(False, "Allow TF32 tensor-core matmuls for fp32 math (set_float32_matmul_precision('high')).")
    eval_every_steps: int = F(0, "Evaluate the validation loss every N steps (0 = only at the end).")
    eval_batches: int = F(10, "Validation micro-batches per evaluation (0 = no evaluation).")
    sample_at_end: bool = F(False, "Print a text sample at the end of training.")
    sample_tokens: int = F(200, "Tokens generated for the end-of-training sample.")
    sample_prompt: str = F("\n", "Prompt for the end-of-training sample.")


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = F(6e-4, "Peak learning rate.")
    min_lr: float = F(6e-5, "Final learning rate of the cosine schedule.")
    schedule: Literal["cosine", "constant"] = F("cosine", "'cosine' = linear warm-up then cosine decay to min_lr; 'constant'.")
    warmup_steps: int = F(100, "Linear warm-up steps (0 = none).")
    weight_decay: float = F(0.1, "AdamW weight decay.")
    decay_groups: bool = F(
        True, "GPT-2 style groups: weight decay on matrices (>= 2-D, embeddings included) only, never on "
        "biases or norm weights; False = decay every parameter."
    )
    beta1: float = F(0.9, "AdamW beta1.")
    beta2: float = F(0.95, "AdamW beta2.")
    eps: float = F(1e-8, "AdamW epsilon.")
    grad_clip: float = F(1.0, "Clip the global gradient norm to this (0 = no clipping).")
    impl: Literal["for-loop", "foreach", "fused"] = F(
        "foreach",
        "AdamW implementation: 'for-loop' (one parameter at a time, least temporary memory), 'foreach' "
        "(multi-tensor), 'fused' (single fused kernel; CUDA and CPU in recent PyTorch).",
    )


@dataclass
class CompileConfig:
    """torch.compile."""

    enabled: bool = F(False, "Compile the model with torch.compile.")
    scope: Literal["model", "block"] = F("model", "'model' = one compiled graph; 'block' = compile each block.")
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = F(
        "default", "torch.compile mode ('reduce-overhead' uses CUDA graphs)."
    )
    fullgraph: bool = F(False, "Require a single graph (error on graph breaks).")
    dynamic: bool = F(False, "Compile for dynamic shapes (False = specialise on the fixed training shapes).")


@dataclass
class MemoryConfig:
    """Memory-saving switches."""

    activation_checkpointing: int = F(
        0, "Recompute activations in backward for every n-th block (0 = off, 1 = every block)."
    )
    optimizer_in_backward: bool = F(
        False,
        "Step the optimizer inside backward, one parameter at a time as soon as its gradient is ready "
        "(register_post_accumulate_grad_hook), so the full set of gradients never exists at once. Needs "
        "train.grad_accum_steps=1, optim.grad_clip=0, no fp16 GradScaler and a single process.",
    )
    optimizer_offload: bool = F(
        False,
        "Keep fp32 master weights and AdamW state in (pinned) CPU memory and run the optimizer step on the "
        "CPU; gradients are copied down and updated weights copied back each step (ZeRO-Offload style, "
        "single process). On a CPU run it changes nothing but adds copies.",
    )
    offload_gradients: bool = F(
        False,
        "With memory.optimizer_offload: move each gradient to its CPU buffer inside backward, as soon as "
        "it is complete (post-accumulate-grad hook), and free it on the device, so the full set of "
        "gradients never exists there; accumulation sums on the CPU and clipping runs on the CPU.",
    )
    optimizer_8bit: bool = F(
        False,
        "8-bit AdamW state (torchao.optim.AdamW8bit; needs `pip install torchao`). Approximate: "
        "block-wise quantised moments.",
    )
    expandable_segments: bool = F(
        False,
        "CUDA caching allocator with expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, "
        "set before CUDA initialises): less fragmentation, lower reserved memory.",
    )


@dataclass
class ParallelConfig:
    """Multi-process training (launch with torchrun). The degrees multiply to the world size."""

    dp_replicate: int = F(
        -1,
        "Data-parallel replicas: DDP, or the replicate dimension of HSDP when dp_shard > 1. "
        "-1 = the rest of the world size.",
    )
    dp_shard: int = F(1, "FSDP2 (fully_shard) sharding degree; 1 = no sharding. -1 = the rest of the world size.")
    tp: int = F(
        1,
        "Tensor-parallel degree: each block's q/k/v and MLP-up projections are split by columns, the output "
        "projections by rows (DTensor parallelize_module); needs model.fused_qkv=false and n_head divisible by tp.",
    )
    pp: int = F(
        1,
        "Pipeline-parallel degree: the blocks are cut into pp consecutive stages, one per rank group "
        "(torch.distributed.pipelining); needs model.tie_embeddings=false.",
    )
    pp_schedule: Literal["gpipe", "1f1b"] = F(
        "1f1b",
        "Pipeline schedule: 'gpipe' = all forwards, then all backwards; '1f1b' = alternate one forward and one "
        "backward (fewer micro-batches' activations alive at once).",
    )
    pp_microbatches: int = F(
        0, "Pipeline micro-batches per train.batch_size batch (must divide it); 0 = the pp degree."
    )
    backend: Literal["auto", "nccl", "gloo"] = F("auto", "Process-group backend; 'auto' = nccl on CUDA, gloo on CPU.")
    ddp_bucket_mb: float = F(25.0, "DDP gradient bucket size in MB (bucket_cap_mb).")
    ddp_grad_as_bucket_view: bool = F(
        False, "DDP gradient_as_bucket_view: gradients are views into the all-reduce buckets (saves one copy)."
    )
    zero1: bool = F(
        False,
        "ZeRO-1: shard the optimizer state over data-parallel ranks (ZeroRedundancyOptimizer over DDP); "
        "not with dp_shard > 1 (FSDP already shards it).",
    )
    fsdp_reshard_after_forward: bool = F(
        True,
        "FSDP: free the gathered parameters after forward and gather again in backward (ZeRO-3); "
        "False keeps them until backward (ZeRO-2-like: more memory, one all-gather less).",
    )
    fsdp_mixed_precision: Literal["none", "bf16"] = F(
        "none", "FSDP mixed precision: 'bf16' = bf16 parameters for compute, fp32 gradient reduction."
    )
    fsdp_cpu_offload: bool = F(
        False, "FSDP: keep sharded parameters, gradients and optimizer step on the CPU (CPUOffloadPolicy)."
    )


@dataclass
class CheckpointConfig:
    """Checkpoints (atomic: temp file + rename)."""

    every_steps: int = F(0, "Save a checkpoint every N steps (0 = only at the end).")
    keep_last: int = F(2, "Keep the newest K checkpoints; older ones are deleted.")
    save_final: bool = F(True, "Save a checkpoint when training ends.")


@dataclass
class LogConfig:
    """Logging and metrics."""

    every_steps: int = F(10, "Log metrics every N steps (device synchronisation happens only here).")
    timing_warmup_steps: int = F(
        3, "Steps excluded from steady-state tokens/s (warm-up, compilation, allocator growth)."
    )
    progress: Literal["auto", "bar", "plain"] = F(
        "auto", "'bar' = tqdm progress bar with ETA; 'plain' = log lines; 'auto' = bar on a terminal."
    )
    tensorboard: bool = F(True, "Write TensorBoard scalars to RUN_DIR/tensorboard when tensorboard is installed.")


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in dataclasses.fields(self)}


# ----------------------------------------------------------------------------------------------
# Introspection, parsing, merging


def sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def field_specs() -> dict[str, tuple[type, Any, str]]:
    """'section.field' -> (type annotation, default, doc) for every config field."""
    out = {}
    for sname, scls in sections().items():
        hints = typing.get_type_hints(scls)
        for f in dataclasses.fields(scls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[f"{sname}.{f.name}"] = (hints[f.name], default, f.metadata.get("doc", ""))
    return out


def _closest(name: str, options: list[str]) -> str:
    m = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    if not m:
        # compare the last component too: 'train.batchsize' -> 'train.batch_size'
        tail = {o.split(".")[-1]: o for o in options}
        m2 = difflib.get_close_matches(name.split(".")[-1], list(tail), n=1, cutoff=0.5)
        m = [tail[m2[0]]] if m2 else []
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
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key}: expected a number, got {value!r}.")
    if tp is str:
        if isinstance(value, str):
            return value
        if from_string:
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}.")
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # pragma: no cover


def apply_overrides(cfg: Config, overrides: dict[str, Any], from_string: bool = False, origin: str = "") -> Config:
    """Apply flat ``{'section.field': value}`` overrides in place (validated) and return ``cfg``."""
    specs = field_specs()
    where = f" (in {origin})" if origin else ""
    for key, value in overrides.items():
        if key not in specs:
            raise ConfigError(f"unknown config key '{key}'{where}.{_closest(key, list(specs))}")
        tp = specs[key][0]
        section, name = key.split(".", 1)
        setattr(getattr(cfg, section), name, _coerce(key, tp, value, from_string))
    return cfg


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
    if not p.is_file():
        raise ConfigError(f"config file '{p}' does not exist.")
    try:
        with open(p, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file '{p}' is not valid TOML: {e}") from None


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("tokenmill.presets").iterdir() if p.name.endswith(".toml"))


def load_preset(name: str) -> dict[str, Any]:
    names = preset_names()
    if name not in names:
        raise ConfigError(f"unknown preset '{name}'; presets are {names}.{_closest(name, names)}")
    with resources.files("tokenmill.presets").joinpath(f"{name}.toml").open("rb") as f:
        return tomllib.load(f)


def validate(cfg: Config) -> Config:
    """Cross-field checks that single-field typing cannot express."""
    m, t = cfg.model, cfg.train
    positive = {
        "model.block_size": m.block_size,
        "model.n_layer": m.n_layer,
        "model.n_head": m.n_head,
        "model.n_embd": m.n_embd,
        "model.vocab_pad_multiple": m.vocab_pad_multiple,
        "train.batch_size": t.batch_size,
        "train.grad_accum_steps": t.grad_accum_steps,
        "log.every_steps": cfg.log.every_steps,
        "checkpoint.keep_last": cfg.checkpoint.keep_last,
    }
    for k, v in positive.items():
        if v < 1:
            raise ConfigError(f"{k} must be >= 1, got {v}.")
    if t.max_steps < 0:
        raise ConfigError(f"train.max_steps must be >= 0, got {t.max_steps}.")
    if m.n_embd % m.n_head:
        raise ConfigError(
            f"model.n_embd ({m.n_embd}) must be divisible by model.n_head ({m.n_head}); "
            f"try model.n_head={_divisor_near(m.n_embd, m.n_head)}."
        )
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {m.dropout}.")
    if m.vocab_size is not None and m.vocab_size < 1:
        raise ConfigError(f"model.vocab_size must be >= 1 or unset, got {m.vocab_size}.")
    if cfg.data.source == "synthetic" and m.vocab_size is None:
        raise ConfigError("data.source='synthetic' needs model.vocab_size (e.g. --model.vocab_size 50257).")
    if cfg.memory.activation_checkpointing < 0:
        raise ConfigError("memory.activation_checkpointing must be >= 0 (0 = off, n = every n-th block).")
    _validate_memory_and_parallel(cfg)
    if cfg.data.cpu_work_ms < 0 or cfg.data.num_workers < 0:
        raise ConfigError("data.cpu_work_ms and data.num_workers must be >= 0.")
    return cfg


def _validate_memory_and_parallel(cfg: Config) -> None:
    mem, p = cfg.memory, cfg.parallel
    if cfg.model.loss_chunk_size < 1:
        raise ConfigError(f"model.loss_chunk_size must be >= 1, got {cfg.model.loss_chunk_size}.")
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
    if p.ddp_bucket_mb <= 0:
        raise ConfigError(f"parallel.ddp_bucket_mb must be > 0, got {p.ddp_bucket_mb}.")
    _validate_model_parallel(cfg)


def _validate_model_parallel(cfg: Config) -> None:
    """Tensor and pipeline parallelism: shapes that split evenly, and switches that compose."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.tp < 1 or p.pp < 1 or p.pp_microbatches < 0:
        raise ConfigError("parallel.tp and parallel.pp must be >= 1, parallel.pp_microbatches >= 0.")
    if p.tp > 1:
        if m.fused_qkv:
            raise ConfigError(
                "parallel.tp > 1 splits q, k and v by heads, which the fused [q; k; v] matrix cannot do "
                "evenly: add --model.fused_qkv false (same math, three matrices)."
            )
        if m.n_head % p.tp:
            raise ConfigError(f"model.n_head ({m.n_head}) must be divisible by parallel.tp ({p.tp}).")
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
    if preset:
        apply_overrides(cfg, flatten(load_preset(preset), f"preset '{preset}'"), origin=f"preset '{preset}'")
    for path in config_files or []:
        apply_overrides(cfg, flatten(load_toml(path), str(path)), origin=str(path))
    if overrides:
        apply_overrides(cfg, overrides, from_string=overrides_from_string, origin="command line")
    return validate(cfg)


def to_toml(cfg: Config) -> str:
    """Serialise to TOML. None values are omitted (TOML has no null); every Optional field defaults
    to None, so reading the file back gives the same config."""
    tree = {}
    for sname, body in cfg.to_dict().items():
        tree[sname] = {k: v for k, v in body.items() if v is not None}
    return tomli_w.dumps(tree)


def save(cfg: Config, path: str | Path) -> None:
    Path(path).write_text("# tokenmill resolved config: feed back with --config to reproduce this run\n" + to_toml(cfg))


def from_dict(tree: dict[str, Any]) -> Config:
    return validate(apply_overrides(Config(), flatten(tree)))


def reference_markdown() -> str:
    """The config reference as Markdown tables, one per section (used by README and `tokenmill config`)."""
    out = []
    specs = field_specs()
    for sname, scls in sections().items():
        out.append(f"### `[{sname}]` — {scls.__doc__.strip()}\n\n| field | default | meaning |\n|---|---|---|")
        for key, (_tp, default, doc) in specs.items():
            if key.startswith(sname + "."):
                out.append(f"| `{key}` | `{default!r}` | {doc.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)
