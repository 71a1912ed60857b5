"""The config's sections: one dataclass per section, one field per switch, each with its doc and, for
numbers, its valid range. Only definitions and introspection live here; resolution is in ``resolve``."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from tokenmill.config.data import DataConfig
from tokenmill.config.evaluation import EvalConfig
from tokenmill.config.field import F
from tokenmill.config.lora import LoraConfig
from tokenmill.config.model import ModelConfig


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = F(1000, "Optimizer steps to train.", ge=0)
    batch_size: int = F(8, "Per-device micro-batch size (sequences).", ge=1)
    grad_accum_steps: int = F(
        1, "Micro-batches accumulated per optimizer step; the update equals one batch k times larger.",
        ge=1,
    )
    seed: int = F(1337, "Seed for initialisation, dropout and the global data stream.", ge=0)
    device: Literal["auto", "cpu", "cuda", "mps"] = F("auto", "Device; 'auto' = cuda, else mps, else cpu.")
    precision: Literal["auto", "fp32", "bf16-autocast", "bf16", "fp16-autocast"] = F(
        "auto",
        "'auto' = bf16-autocast on a CUDA GPU with bf16 (as nanoGPT and torchtitan default to), else fp32; "
        "'fp32'; 'bf16-autocast' = bf16 compute with fp32 weights; 'bf16' = whole model and optimizer "
        "state cast to bf16 (pure bf16, no autocast); 'fp16-autocast' = fp16 autocast with GradScaler. The run's "
        "config.toml records what 'auto' became.",
    )
    tf32: Optional[bool] = F(
        None,
        "Allow TF32 tensor-core matmuls for fp32 math (set_float32_matmul_precision('high')). None (auto): on "
        "on CUDA, off elsewhere; the seed ladders set it explicitly.",
    )
    fp8: Literal["off", "tensorwise", "rowwise"] = F(
        "off",
        "FP8 matmuls for the blocks' linear layers (torchao float8 training, `pip install torchao`; CUDA GPUs "
        "with FP8 tensor cores: H100/H200, L4, RTX 4090 and newer): inputs, weights and output gradients are "
        "cast to float8 with dynamic scales, one per tensor ('tensorwise', the fastest) or one per row "
        "('rowwise', more accurate); weights stay in their precision. Approximate (a few tenths of a percent "
        "per matmul). Embeddings, the head and layers whose sizes are not multiples of 16 stay as they are. On a "
        "mixture of experts the router (and a shared-expert gate) and the routed experts stay in high precision "
        "(the shared experts' linears are converted).",
    )
    fp8_all_gather: bool = F(
        False,
        "With train.fp8 = 'tensorwise' and FSDP2 (parallel.dp_shard > 1): all-gather the sharded weights in "
        "float8 (half the bytes of bf16), the scale computed once for all shards.",
    )
    eval_every_steps: int = F(0, "Evaluate the validation loss every N steps (0 = only at the end).", ge=0)
    eval_inference_mode: bool = F(
        True,
        "Evaluate under torch.inference_mode (no autograd bookkeeping, no version counters); False = "
        "torch.no_grad, as the seeds do.",
    )
    eval_batches: int = F(10, "Validation micro-batches per evaluation (0 = no evaluation).", ge=0)
    sample_at_end: bool = F(False, "Print a text sample at the end of training.")
    sample_tokens: int = F(200, "Tokens generated for the end-of-training sample.", ge=0)
    sample_prompt: str = F("\n", "Prompt for the end-of-training sample.")
    init_from: Optional[str] = F(
        None,
        "Fine-tuning: start from the weights of a tokenmill run directory (its newest good checkpoint), one of "
        "its checkpoints, or a local Hugging Face folder of GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM, "
        "Qwen3ForCausalLM, MistralForCausalLM, or the mixtures of experts MixtralForCausalLM, Qwen3MoeForCausalLM, "
        "Qwen2MoeForCausalLM and OlmoeForCausalLM (config.json + model.safetensors, its shards with their index, or "
        "pytorch_model.bin). The model's architecture (every shape field: vocab_size, n_layer, n_head, n_embd, "
        "n_kv_head, head_dim, rope, norm, mlp, biases, qk_norm, tie_embeddings, the experts; block_size up to the source's "
        "context) comes from the source; the optimizer, lr schedule and step start fresh at 0. The data must use "
        "the source's tokenizer (`tokenmill prepare --tokenizer-from`). Not read once the run directory has "
        "checkpoints (--resume continues from them).",
        path="one",
    )


@dataclass
class OptimConfig:
    """The optimizer (AdamW, or Muon for the hidden matrices) and the learning-rate schedule."""

    name: Literal["adamw", "muon"] = F(
        "adamw",
        "'adamw' = AdamW for every parameter; 'muon' = Muon (momentum, then the update orthogonalised by a "
        "quintic Newton-Schulz iteration) for the blocks' 2-D weight matrices, with AdamW (optim.lr, betas, "
        "weight_decay) for embeddings, head, norm gains and biases. One momentum buffer per hidden matrix "
        "instead of AdamW's two moments. Single process, DDP, FSDP2 and TP (the full matrix is gathered for the "
        "orthogonalisation); not with parallel.zero1 or the memory.optimizer_* switches.",
    )
    muon_lr: float = F(
        0.02,
        "Muon's peak learning rate for the hidden matrices (follows the same schedule as optim.lr, scaled "
        "by muon_lr / lr); each update is also scaled by sqrt(max(1, rows / cols)).",
        ge=0,
    )
    muon_momentum: float = F(0.95, "Muon's momentum (Nesterov).", ge=0, lt=1)
    muon_weight_decay: float = F(
        0.0, "Muon's decoupled weight decay on the hidden matrices (w -= lr * muon_weight_decay * w).", ge=0
    )
    lr: float = F(6e-4, "Peak learning rate.", ge=0)
    min_lr: float = F(6e-5, "Final learning rate of the cosine schedule.", ge=0)
    schedule: Literal["cosine", "constant"] = F("cosine", "'cosine' = linear warm-up then cosine decay to min_lr; 'constant'.")
    decay_steps: Optional[int] = F(
        None,
        "Step at which the cosine reaches min_lr (then stays there). None: train.max_steps, so raising "
        "max_steps on resume re-stretches the decay (the learning rate goes back up); to keep the old decay and "
        "go on at min_lr, set it to the old max_steps (the resume message says so).",
        ge=1,
    )
    warmup_steps: int = F(100, "Linear warm-up steps (0 = none).", ge=0)
    weight_decay: float = F(0.1, "AdamW weight decay.", ge=0)
    decay_groups: bool = F(
        True, "GPT-2 style groups: weight decay on matrices (>= 2-D, embeddings included) only, never on "
        "biases or norm weights; False = decay every parameter."
    )
    beta1: float = F(0.9, "AdamW beta1.", ge=0, lt=1)
    beta2: float = F(0.95, "AdamW beta2.", ge=0, lt=1)
    eps: float = F(1e-8, "AdamW epsilon.", gt=0)
    grad_clip: float = F(1.0, "Clip the global gradient norm to this (0 = no clipping).", ge=0)
    zero_grad: Literal["after_step", "after_forward"] = F(
        "after_step",
        "When gradients are freed: 'after_step' = right after the optimizer step, so the forward runs without "
        "them; 'after_forward' = after the next step's first forward, as minGPT's trainer (the book's "
        "baseline) does, so the last step's gradients stay alive during the forward. Same math.",
    )
    impl: Literal["for-loop", "foreach", "fused"] = F(
        "foreach",
        "AdamW implementation: 'for-loop' (one parameter at a time, least temporary memory), 'foreach' "
        "(multi-tensor), 'fused' (single fused kernel; CUDA and CPU in recent PyTorch).",
    )


@dataclass
class CompileConfig:
    """torch.compile."""

    enabled: bool = F(False, "Compile the model with torch.compile.")
    scope: Literal["model", "block"] = F(
        "model",
        "'model' = one compiled graph of the whole model (embeddings, blocks, final norm, head and loss); 'block' "
        "= each block compiled on its own, plus the head and the loss as one more graph (as torchtitan's and "
        "torchtune's per-block compile also compile the loss) when model.loss_impl='full' and parallel.pp=1; "
        "the embeddings and the final norm run eagerly.",
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = F(
        "default", "torch.compile mode ('reduce-overhead' uses CUDA graphs)."
    )
    fullgraph: bool = F(False, "Require a single graph (error on graph breaks).")
    dynamic: bool = F(False, "Compile for dynamic shapes (False = specialise on the fixed training shapes).")
    loss_outside: bool = F(
        False,
        "Run the head and the cross-entropy eagerly, outside every compiled graph. With compile.scope='model': "
        "compile the model up to its final norm only, as the LLM-training-speed seed's compile rung does "
        "(torch.compile(model), loss outside the graph); with 'block': compile only the blocks (as torchtitan "
        "did before it compiled its loss, in April 2025). False: the head and the loss are compiled, inside "
        "the whole model's graph or (scope 'block') as a graph of their own, when model.loss_impl='full' and "
        "parallel.pp=1 (a chunked loss or a pipeline's loss stays eager either way).",
    )


@dataclass
class MemoryConfig:
    """Memory-saving switches."""

    activation_checkpointing: int = F(
        0, "Recompute activations in backward for every n-th block (0 = off, 1 = every block).",
        ge=0,
    )
    activation_checkpointing_policy: Literal["full", "save-matmuls"] = F(
        "full",
        "What a block checkpointed by memory.activation_checkpointing keeps for backward: 'full' = only its "
        "input, backward recomputes its whole forward; 'save-matmuls' = selective (op-level) checkpointing "
        "(torch.utils.checkpoint.create_selective_checkpoint_contexts): the outputs of its matrix products (a "
        "mixture of experts' grouped expert products too) and fused attention are kept too, so backward recomputes only the cheap element-wise ops (norms, GELU/SiLU, "
        "RoPE, dropout, residual adds): memory between 'full' and no checkpointing, most of the recompute time "
        "saved. The same gradients, bit for bit.",
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
    max_split_size_mb: int = F(
        0,
        "CUDA caching allocator: blocks larger than this (MB) are never split (PYTORCH_CUDA_ALLOC_CONF "
        "max_split_size_mb): less fragmentation for large, varying allocations; 0 = not set.",
        ge=0,
    )
    gc_threshold: float = F(
        0.0,
        "CUDA caching allocator: reclaim unused cached blocks once this fraction of the GPU memory is in use "
        "(PYTORCH_CUDA_ALLOC_CONF garbage_collection_threshold), instead of freeing all on an allocation "
        "failure; 0 = not set.",
        ge=0, lt=1,
    )
    offload_activations: bool = F(
        False,
        "Move the activations saved for backward (not the weights) to pinned CPU memory during the forward "
        "and back in backward, the copies on a side stream beside the compute (tokenmill.model.offload): less "
        "device memory; the step waits only where the host link is slower than the compute. Off on a CPU run.",
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
        ge=-1,
    )
    dp_shard: int = F(1, "FSDP2 (fully_shard) sharding degree; 1 = no sharding. -1 = the rest of the world size. "
                      "Each block is a unit, and untied embeddings and the final norm with the head are units of their "
                      "own (gathered only around their forward and backward, as torchtitan does); tied ones stay with "
                      "the root.", ge=-1)
    tp: int = F(
        1,
        "Tensor-parallel degree: each block's q/k/v and MLP-up projections are split by columns, the output "
        "projections by rows (DTensor parallelize_module); needs model.fused_qkv=false and n_head divisible by tp.",
        ge=1,
    )
    pp: int = F(
        1,
        "Pipeline-parallel degree: the blocks are cut into pp consecutive stages, one per rank group "
        "(torch.distributed.pipelining); needs model.tie_embeddings=false.",
        ge=1,
    )
    pp_schedule: Literal["gpipe", "1f1b"] = F(
        "1f1b",
        "Pipeline schedule: 'gpipe' = all forwards, then all backwards; '1f1b' = alternate one forward and one "
        "backward (fewer micro-batches' activations alive at once).",
    )
    pp_microbatches: int = F(
        0, "Pipeline micro-batches per train.batch_size batch (must divide it); 0 = the pp degree.",
        ge=0,
    )
    ep: int = F(
        1,
        "Expert-parallel degree for mixture-of-experts models: each MoE layer's routed experts are split over ep "
        "ranks of the data-parallel group and every token is sent to its experts' rank and back by all-to-all; "
        "must divide model.moe_experts and the data-parallel world size. 1 = every rank holds every expert.",
        ge=1,
    )
    backend: Literal["auto", "nccl", "gloo"] = F("auto", "Process-group backend; 'auto' = nccl on CUDA, gloo on CPU.")
    ddp_bucket_mb: float = F(25.0, "DDP gradient bucket size in MB (bucket_cap_mb).", gt=0)
    ddp_grad_as_bucket_view: bool = F(
        False, "DDP gradient_as_bucket_view: gradients are views into the all-reduce buckets (saves one copy)."
    )
    sync_every_microbatch: bool = F(
        False,
        "With gradient accumulation: reduce (DDP all-reduce / FSDP reduce-scatter) the gradients after every "
        "micro-batch, as the book's FSDP example does; False = only after the last one (DDP no_sync, FSDP "
        "without gradient sync: less communication, but FSDP keeps unsharded gradients between micro-batches).",
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

    every_steps: int = F(0, "Save a checkpoint every N steps (0 = only at the end).", ge=0)
    keep_last: int = F(2, "Keep the newest K checkpoints; older ones are deleted.", ge=1)
    save_final: bool = F(True, "Save a checkpoint when training ends.")
    async_save: bool = F(
        False,
        "Save in the background: the state is copied to (pinned) host memory at the save step and a writer "
        "thread writes it (same atomic write; DCP folders by dcp.async_save) while training goes on. At most one "
        "save in flight (the next save waits for it); the final save is synchronous; a failed background write "
        "is reported, with its path, at the next save. Costs one host copy of model and optimizer state.",
    )


@dataclass
class LogConfig:
    """Logging and metrics."""

    every_steps: int = F(10, "Log metrics every N steps (device synchronisation happens only here).", ge=1)
    timing_warmup_steps: int = F(
        3, "Steps excluded from steady-state tokens/s (warm-up, compilation, allocator growth).",
        ge=0,
    )
    progress: Literal["auto", "bar", "plain"] = F(
        "auto", "'bar' = tqdm progress bar with ETA; 'plain' = log lines; 'auto' = bar on a terminal."
    )
    tensorboard: bool = F(
        True,
        "Write TensorBoard scalars to RUN_DIR/tensorboard when tensorboard is installed (tags by section: "
        "train/loss, perf/tokens_per_sec, memory/peak_alloc_mb, eval/val_loss).",
    )
    wandb: bool = F(
        False,
        "Also log to Weights & Biases (pip install 'tokenmill[wandb]'), with the TensorBoard tags and the run "
        "config; files under RUN_DIR/wandb. log.wandb_mode='offline' (or WANDB_MODE=offline) needs no network "
        "(upload later with `wandb sync`).",
    )
    wandb_project: str = F("tokenmill", "Weights & Biases project (log.wandb).")
    wandb_name: Optional[str] = F(None, "Weights & Biases run name (log.wandb). None: the run directory's name.")
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = F(
        "auto", "Weights & Biases mode (log.wandb): 'auto' = $WANDB_MODE when set, else online."
    )


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {s.name: dataclasses.asdict(getattr(self, s.name)) for s in dataclasses.fields(self)}


# ----------------------------------------------------------------------------------------------
# Introspection


def concrete(cfg: Config, device_type: str, bf16: bool = True) -> Config:
    """``cfg`` with its automatic choices made for a ``device_type`` ('cuda', 'cpu', 'mps') that has
    (``bf16``) or lacks bf16 tensor cores: ``train.precision='auto'`` and ``train.tf32=None``. The one
    place they are decided; the trainer and the estimator call it before reading either field."""
    t = cfg.train
    if t.precision != "auto" and t.tf32 is not None:
        return cfg
    cuda = device_type == "cuda"
    train = dataclasses.replace(
        t, precision=("bf16-autocast" if cuda and bf16 else "fp32") if t.precision == "auto" else t.precision,
        tf32=cuda if t.tf32 is None else t.tf32)
    return dataclasses.replace(cfg, train=train)


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in config order."""
    return dict(_sections())


@functools.lru_cache(maxsize=1)
def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def field_specs() -> dict[str, tuple[type, Any, str]]:
    """'section.field' -> (type annotation, default, doc) for every config field (a fresh dict; the
    annotations are resolved once per process: resolving them was most of building the CLI parser)."""
    return dict(_field_specs())


@functools.lru_cache(maxsize=1)
def _field_specs() -> dict[str, tuple[type, Any, str]]:
    out = {}
    for sname, scls in _sections().items():
        hints = typing.get_type_hints(scls)
        for f in dataclasses.fields(scls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out[f"{sname}.{f.name}"] = (hints[f.name], default, f.metadata.get("doc", ""))
    return out


def field_ranges() -> dict[str, dict[str, float]]:
    """'section.field' -> its declared valid range (``{'ge': 1}``; empty when unbounded)."""
    out = {}
    for sname, scls in sections().items():
        for f in dataclasses.fields(scls):
            out[f"{sname}.{f.name}"] = dict(f.metadata.get("range", {}))
    return out


def shape_fields(layout: bool = False) -> tuple[str, ...]:
    """The model fields that fix its architecture (``shape='arch'``), plus with ``layout`` those that fix
    its state-dict layout (``shape='layout'``): what a fine-tuning source decides, and what a checkpoint
    must match to resume."""
    kinds = ("arch", "layout") if layout else ("arch",)
    return tuple(f.name for f in dataclasses.fields(ModelConfig) if f.metadata.get("shape") in kinds)


_SYMBOL = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def describe_range(bounds: dict[str, float]) -> str:
    """``{'ge': 0, 'lt': 1}`` -> '>= 0 and < 1'."""
    return " and ".join(f"{_SYMBOL[k]} {v:g}" for k, v in bounds.items())
