"""``estimate(cfg, gpu, nproc)``: per-rank peak memory with its breakdown, and a step time.

The memory comes from the model's own code traced on the ``meta`` device (:mod:`.trace`), strung into
training steps per rank (:mod:`.timeline`) and replayed through a model of the CUDA caching allocator
(:mod:`.allocator`); the time from a roofline over the same trace (:mod:`.roofline`).
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.config.size import check_size
from tokenmill.errors import ConfigError, ParallelError
from tokenmill.estimate.gpus import GPU, gpu_spec
from tokenmill.estimate.moe import apply_moe
from tokenmill.estimate.sft import add_learned_rate
from tokenmill.estimate.step import PipelineStep, Plan, Step, rank_params
from tokenmill.estimate.techniques import nf4_base_bytes
from tokenmill.estimate.timeline import CATEGORIES, Layout, Memory
from tokenmill.estimate.trace import Pieces, trace_pieces

MB = 1024 * 1024


@dataclass
class Estimate:
    """A prediction for one rank (the rank with the most memory)."""

    gpu: str
    nproc: int
    layout: str
    peak_alloc_mb: float
    peak_reserved_mb: float
    allocator_slack_mb: float  # reserved - allocated at their peaks: cached, fragmented blocks
    breakdown_mb: dict[str, float]  # at the allocated peak; sums to peak_alloc_mb
    activations_per_block_mb: dict[str, float]
    host_mb: float
    step_ms: float
    tokens_per_sec: float
    mfu: Optional[float]
    time_breakdown_ms: dict[str, float]
    params: int
    capacity_mb: Optional[float]
    fits: Optional[bool]
    at_peak: str = ""
    notes: list[str] = field(default_factory=list)
    precision: str = ""  # train.precision (+ ' + tf32') as estimated: what 'auto' became on this GPU
    # the expected relative error (estimate/uncertainty.py): the mean absolute error against published
    # measurements in this regime, and the ranges it gives
    uncertainty: dict[str, Any] = field(default_factory=dict)
    memory_range_mb: tuple = ()  # peak reserved (allocated on a CPU) +- the memory error
    tokens_per_sec_range: tuple = ()
    chat: Optional[dict[str, Any]] = None  # a chat fine-tune: padding and learned shares, learned tokens/s (sft.py)
    moe: Optional[dict[str, Any]] = None  # a mixture of experts: its parts, expert parallelism (moe.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def short(self) -> dict[str, float]:
        """The four figures a ladder rung records."""
        return {"peak_alloc_mb": round(self.peak_alloc_mb, 1), "peak_reserved_mb": round(self.peak_reserved_mb, 1),
                "step_ms": round(self.step_ms, 2), "tokens_per_sec": round(self.tokens_per_sec, 1)}


def vocab_size_of(cfg: C.Config) -> int:
    """The vocabulary the model will get: model.vocab_size, else the prepared data's, else the
    tokenizer's (without preparing anything)."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    d = cfg.data
    path, key = d.path, "data.path"
    if d.mixture:  # its folders share one tokenizer: the first one's vocabulary
        from tokenmill.data.mixture import parse_mixture

        path, key = parse_mixture(d.mixture)[0].path, "data.mixture's first folder"
    if path:
        meta = Path(path) / "meta.json"
        if meta.is_file():
            from tokenmill.data.meta import read_meta

            vocab = read_meta(path)["vocab_size"]  # checked: a damaged meta.json is one line naming it
            check_size(cfg.model, cfg.train.batch_size, vocab, where=str(meta))  # the data's vocabulary too
            return vocab
        raise ConfigError(f"{key} '{path}' has no meta.json; prepare it first or set model.vocab_size.")
    return {"bytes": 256, "gpt2": 50257}.get(d.tokenizer, d.bpe_vocab_size)


def resolve_layout(cfg: C.Config, nproc: int) -> Layout:
    """The degrees of ``cfg.parallel`` for ``nproc`` processes (-1 = the rest), as the trainer resolves them."""
    from tokenmill.parallel.world import resolve_degrees

    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}.")
    rep, shard = resolve_degrees(cfg.parallel, nproc)
    if cfg.lora.rank and cfg.lora.quantize_base == "nf4":  # parallel.dp_shard -1 resolved: every NF4 weight splits
        C.check_nf4_shards(cfg.model, shard)
    return Layout(nproc, rep, shard, cfg.parallel.tp, cfg.parallel.pp)


def _check(cfg: C.Config, lay: Layout) -> None:
    """The layout checks the trainer makes once processes exist (tokenmill.parallel), made here up front."""
    if lay.dp_replicate > 1 and lay.dp_shard == 1 and (lay.tp > 1 or lay.pp > 1):
        raise ParallelError(
            f"data parallelism over {lay.dp_replicate} replicas with parallel.tp/pp runs through FSDP: set "
            f"--parallel.dp_shard {lay.dp_replicate} --parallel.dp_replicate 1 (or HSDP with both > 1).")
    if lay.nproc > 1 and (cfg.memory.optimizer_in_backward or cfg.memory.optimizer_offload):
        raise ConfigError("memory.optimizer_in_backward / memory.optimizer_offload are single-process switches; "
                          "for several GPUs shard instead (parallel.dp_shard, parallel.fsdp_cpu_offload, parallel.zero1).")
    if lay.nproc == 1 and (cfg.parallel.zero1 or cfg.parallel.fsdp_cpu_offload):
        raise ConfigError("parallel.zero1 / parallel.fsdp_cpu_offload need several processes: give --nproc N.")


def estimate(cfg: C.Config, gpu: str | GPU = "h100-sxm", nproc: int = 1) -> Estimate:
    """Predict one training step of ``cfg`` on ``nproc`` processes of ``gpu`` (a key or name from
    :data:`tokenmill.estimate.gpus.GPUS`, 'cpu', or a :class:`GPU`). Runs on the CPU in about a second."""
    from tokenmill.estimate.roofline import step_time

    spec = gpu if isinstance(gpu, GPU) else gpu_spec(gpu)
    cfg = C.concrete(cfg, "cpu" if spec.key == "cpu" else "cuda", bool(spec.peak("bf16")))  # 'auto' as trained
    lay = resolve_layout(cfg, nproc)
    _check(cfg, lay)
    vocab = vocab_size_of(cfg)
    cuda = spec.key != "cpu"
    memories, pieces_by_stage = [], []
    balance = _balance(cfg, spec) if cuda else None
    for stage in range(lay.pp):
        plan, pieces = _plan(cfg, lay, vocab, cuda, stage, balance)
        plan.workspace = spec.cublas_workspace
        mem = _replay(plan, pieces, spec)
        memories.append(mem)
        pieces_by_stage.append((plan, pieces))
    worst = max(range(lay.pp), key=lambda s: memories[s].peak_reserved)
    mem = memories[worst]
    plan, pieces = pieces_by_stage[worst]
    n_params, n_flop = param_counts(cfg, vocab)
    timing = step_time(cfg, lay, spec, pieces_by_stage, n_flop)
    tokens = cfg.train.batch_size * cfg.train.grad_accum_steps * lay.dp * cfg.model.block_size
    notes = _notes(cfg, lay, spec)
    cap = spec.memory_mb if cuda else None
    est = Estimate(
        gpu=spec.name, nproc=nproc, layout=lay.describe(),
        peak_alloc_mb=mem.peak_alloc / MB, peak_reserved_mb=mem.peak_reserved / MB,
        allocator_slack_mb=(mem.peak_reserved - mem.peak_alloc) / MB,
        breakdown_mb={k: v / MB for k, v in mem.breakdown.items()},
        activations_per_block_mb={k: v / MB for k, v in _per_block(pieces).items()},
        host_mb=mem.host / MB,
        step_ms=timing["step_ms"], tokens_per_sec=tokens / (timing["step_ms"] / 1000.0),
        mfu=timing.get("mfu"), time_breakdown_ms={k: v for k, v in timing.items() if k.endswith("_ms") and k != "step_ms"},
        params=n_params, capacity_mb=cap, fits=(mem.peak_reserved / MB <= cap) if cap else None,
        at_peak=mem.at_peak, notes=notes,
        precision=cfg.train.precision + (" + tf32" if cfg.train.tf32 else ""),
    )
    _nf4_base(est, cfg, vocab, pieces)
    apply_moe(est, cfg, lay, spec, plan, pieces, mem)  # experts sharded by parallel.ep, grouped matmuls, all-to-all
    add_learned_rate(est, cfg)
    if cuda:
        _ranges(est, cfg, nproc)
    return est


def _nf4_base(est: Estimate, cfg: C.Config, vocab: int, pieces: Pieces) -> None:
    """QLoRA (``lora.quantize_base = 'nf4'``): the step's timeline holds every block projection's weight as stored
    (NF4: half a byte a weight and its scales; :class:`.timeline.Param`, sharded and gathered so under FSDP);
    each is dequantised one at a time in the forward and backward. An eager trace in pure precision holds each
    dequantisation where its product runs (``device._NF4Product``); otherwise (compiled, autocast, the routed
    experts' stacks) the largest weight's copy beside its codes is added here to the peak
    (``model/lora.py nf4_weights``)."""
    if not (cfg.lora.rank and cfg.lora.quantize_base == "nf4"):
        return
    if all(t.nf4_traced for t in pieces.blocks.values() if t.nf4_sizes):
        return
    transient = nf4_base_bytes(cfg, vocab, cfg.lora.rank)[2] / MB
    est.peak_alloc_mb += transient
    est.peak_reserved_mb += transient
    est.breakdown_mb["temporaries"] = est.breakdown_mb.get("temporaries", 0.0) + transient
    if est.capacity_mb:
        est.fits = est.peak_reserved_mb <= est.capacity_mb


def _ranges(est: Estimate, cfg: C.Config, nproc: int) -> None:
    from tokenmill.estimate.uncertainty import error_for

    u = error_for(cfg, nproc)
    est.uncertainty = u
    est.memory_range_mb = (est.peak_reserved_mb * (1 - u["memory"]), est.peak_reserved_mb * (1 + u["memory"]))
    est.tokens_per_sec_range = (est.tokens_per_sec / (1 + u["speed"]), est.tokens_per_sec / max(1 - u["speed"], 0.05))


def _balance(cfg: C.Config, spec: GPU) -> Optional[float]:
    """The GPU's FLOP/byte balance as Inductor's ``pad_mm`` computes it (1000 x TFLOPS of the matmuls' math
    mode / memory GB/s)."""
    from tokenmill.model.flops import math_mode

    peak = spec.peak(math_mode(cfg.train.precision, cfg.train.tf32))
    return 1000.0 * peak / 1e12 / spec.hbm_gbs if peak and spec.hbm_gbs else None


def _plan(cfg: C.Config, lay: Layout, vocab: int, cuda: bool, stage: int,
          balance: Optional[float] = None) -> tuple[Plan, Pieces]:
    from tokenmill.parallel.pipeline import stage_layers

    batch = cfg.train.batch_size
    if lay.pp > 1:
        batch = batch // (cfg.parallel.pp_microbatches or lay.pp)
    pieces = trace_pieces(cfg, vocab, "cuda" if cuda else "cpu", batch=batch, tp=lay.tp, pipelined=lay.pp > 1,
                          pad_balance=balance)
    blocks = list(stage_layers(cfg.model.n_layer, lay.pp)[stage]) if lay.pp > 1 else list(range(cfg.model.n_layer))
    has_embed, has_head = stage == 0, stage == lay.pp - 1
    params = rank_params(pieces, blocks, has_embed, has_head)
    return Plan(cfg, lay, cuda, params, blocks, has_embed, has_head), pieces


def _replay(plan: Plan, pieces: Pieces, spec: GPU) -> Memory:
    """The step's memory on ``spec``. Memoised for the process (bounded; ``MEMO`` False: off): the timeline by
    all the step reads (the traced pieces, the concrete config, the layout, the stage, the cuBLAS workspace), so
    the GPUs of ``--finetune``'s table share it; its replay by the GPU's capacity too (a repeated estimate)."""
    key = (id(pieces), json.dumps(plan.cfg.to_dict(), sort_keys=True, default=str), repr(plan.layout), plan.cuda,
           tuple(plan.stage_blocks), plan.has_embed, plan.has_head, plan.workspace)
    cap = int(spec.memory_mb * MB) if plan.cuda else None
    kept = _MEMORIES.get((key, cap)) if MEMO else None
    mem = kept[1] if kept else None
    if mem is None:
        made = _STEPS.get(key) if MEMO else None
        if made is None:
            step = PipelineStep(pieces, plan) if plan.layout.pp > 1 else Step(pieces, plan)
            made = (pieces, step.run(), step.host)  # the pieces held: their id is not reused while memoised
            _remember(_STEPS, key, made, 4)
        mem = made[1].replay(plan.cuda, plan.cfg.memory, cap)
        mem.host = made[2]
        _remember(_MEMORIES, (key, cap), (pieces, mem), 64)  # the pieces held here too: keyed by their id
    return copy.deepcopy(mem)


MEMO = True  # False: every estimate steps and replays
_STEPS: OrderedDict = OrderedDict()
_MEMORIES: OrderedDict = OrderedDict()


def _remember(memo: OrderedDict, key: tuple, value: Any, size: int) -> None:
    if MEMO:
        memo[key] = value
        while len(memo) > size:
            memo.popitem(last=False)


def _per_block(pieces: Pieces) -> dict[str, int]:
    """Bytes each kind of block keeps for its backward (alive at the end of its forward, output aside)."""
    from tokenmill.estimate.timeline import _saved

    out = {}
    for kind, tr in pieces.blocks.items():
        rnd = tr.rounds[0]
        out[kind] = sum(tr.sizes[s] for s in _saved(rnd.fwd, {rnd.y, rnd.x}) if s not in tr.harness)
    return out


def param_counts(cfg: C.Config, vocab: int) -> tuple[int, int]:
    """(parameters, matmul parameters N of the FLOPs convention) of ``cfg``'s model: the trainer's own
    counts (:func:`tokenmill.model.build.count_params`, :func:`tokenmill.model.flops.flop_params`)."""
    from tokenmill.model.build import count_params
    from tokenmill.model.flops import flop_params

    return count_params(cfg.model, vocab), flop_params(cfg.model, vocab)


def _notes(cfg: C.Config, lay: Layout, spec: GPU) -> list[str]:
    notes = []
    if cfg.compile.enabled:
        notes.append("torch.compile: the compiled pieces are traced as torch.compile traces them (AOTAutograd's "
                     "partitioner, Inductor's fusion and padding); see docs/estimate.md")
    if cfg.memory.optimizer_8bit:
        notes.append("8-bit AdamW (torchao): moments of 1 byte plus one fp32 scale per 256 values")
    if cfg.lora.rank:
        from tokenmill.model.build import trainable_params

        n = trainable_params(cfg.model, vocab_size_of(cfg), cfg.lora)
        notes.append(f"LoRA rank {cfg.lora.rank}: {n:,} trainable parameters (the adapters); the base is frozen: no "
                     "gradients, optimizer state or weight-gradient matmuls for it")
    if cfg.lora.rank and cfg.lora.quantize_base == "nf4":
        notes.append("QLoRA (lora.quantize_base nf4): every block projection's weight is counted as NF4 (half a byte a weight "
                     "and its scales) plus one dequantised copy at a time; `--finetune` compares with LoRA and a full fine-tune")
    if spec.key == "cpu":
        notes.append("cpu: no caching allocator (reserved = allocated); no CPU throughput figures, the time is a rough guide")
    return notes


def categories() -> tuple[str, ...]:
    return CATEGORIES
