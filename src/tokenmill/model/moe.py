"""The mixture-of-experts MLP of a sparse layer (``model.moe_experts`` > 0; which layers:
:meth:`tokenmill.config.ModelConfig.sparse_layers`), as Mixtral, Qwen3-MoE, Qwen2-MoE and OLMoE compute it.

A router (``router``: Linear(C, E), no bias) scores every token; the token goes to its ``model.moe_top_k``
experts, weighted as ``model.moe_router`` says; each expert is a SwiGLU MLP without biases, the E of them
held as two stacked weights (``experts.gate_up``: (E, 2I, C), each expert's gate rows then its up rows;
``experts.down``: (E, C, I)); shared experts (``model.moe_shared_experts``) are one more SwiGLU MLP every
token goes through, optionally gated per token (Qwen2-MoE). Routing is dropless: no capacity, every token
reaches all its experts.

How the experts run (``model.moe_impl``): the (token, expert) pairs are sorted by expert, so each expert's
tokens are one contiguous group; 'grouped' runs every expert as one grouped matrix product per projection
(``torch._grouped_mm`` with the groups' end offsets: no Python loop, no host sync, static shapes, so it
compiles; on CUDA each group is padded to 16 rows with zero rows); 'loop' runs one matmul per expert with
tokens (the reference; it reads the group sizes on the host). 'auto' takes 'grouped' where
``torch._grouped_mm`` runs for the device and dtype (probed once), else 'loop'. Both add each token's
expert outputs in expert order, as transformers' sparse blocks do.

Expert parallelism (``parallel.ep``, applied by :mod:`tokenmill.parallel.expert_parallel`): each rank keeps a
shard of the routed experts (:meth:`MoE.shard_experts`) and the sorted rows pass through a ``dispatch`` hook
that sends them to their experts' rank and back; the router and the shared experts stay whole.

Router losses (the model owns them: :func:`router_loss`, added by ``GPT.forward`` to the training loss):
the load-balancing loss ``model.moe_aux_loss_coef`` x E x sum_e f_e P_e, f_e the share of routed slots and
P_e the mean router probability of expert e, pooled over all sparse layers as transformers'
``load_balancing_loss_func`` pools them; the z-loss ``model.moe_z_loss_coef`` x mean over layers and tokens of
logsumexp(router logits)^2 (ST-MoE). DeepSeek-V3's auxiliary-loss-free balancing (``model.moe_bias_update_rate``
> 0): a per-expert bias (the buffer ``router_bias``, in checkpoints, never trained by the optimizer) is added
to the routing scores only to choose each token's experts, the weights stay the unbiased scores'.
:func:`balance_experts`, called once after every optimizer step, moves it by rate x sign(mean load - load).
Each MoE keeps its last forward's routing statistics (``stats``);
:func:`router_stats` turns them into the logged numbers (per-layer expert load max / mean, the losses).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tokenmill.config import ModelConfig
from tokenmill.errors import CheckpointError, ConfigError
from tokenmill.model.layers import SwiGLU

__all__ = ["MoE", "Experts", "balance_experts", "grouped_mm_runs", "router_loss", "router_stats"]

GROUP_ALIGN = 16  # CUDA: rows of each expert's group padded to a multiple of this for the grouped GEMM


@functools.cache
def _probe(device: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros(32, 16, device=device, dtype=dtype)
        b = torch.zeros(2, 16, 16, device=device, dtype=dtype)
        torch._grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def _compiled_runs(device: str, dtype: torch.dtype) -> bool:
    """Marked a constant of the compiled graph (``torch.compiler.assume_constant_result``) when the first
    :class:`MoE` is built, not at import: marking it imports torch._dynamo (seconds), which a dense model's
    commands never need."""
    return _probe(device, dtype) and _probe("meta", dtype)  # compile traces the meta kernel too


def grouped_mm_runs(device: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs here: a tiny product tried once per device and dtype; under
    compile it must run on ``meta`` too (the shape kernel compile traces; torch's accepts bf16 only), and the
    answer is a constant of the graph."""
    if torch.compiler.is_compiling():
        return _compiled_runs(device, dtype)
    return _probe(device, dtype)


def _estimator_trace(x: torch.Tensor) -> bool:
    """Whether ``x`` is a fake tensor outside ``torch.compile``: the estimator's compiled-piece trace
    (:mod:`tokenmill.estimate.compiled`, ``aot_function`` on fake tensors). There, as on ``meta``, the experts
    run as one product of their shapes: the loop reads the group sizes (no values to read) and the grouped
    product's fake kernel takes bf16 only, while the run's products may be fp32; which form the run takes and
    its cost come from the config (:mod:`tokenmill.estimate.moe`). Under ``torch.compile`` it is False."""
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(x)


def _align(xs: torch.Tensor) -> int:
    """Rows each expert's group is padded to a multiple of: :data:`GROUP_ALIGN` on CUDA, 1 (none) elsewhere."""
    return GROUP_ALIGN if xs.is_cuda else 1


class Experts(nn.Module):
    """E SwiGLU experts without biases: ``gate_up`` (E, 2I, C) and ``down`` (E, C, I)."""

    def __init__(self, n_experts: int, width: int, n_embd: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * width, n_embd))
        self.down = nn.Parameter(torch.empty(n_experts, n_embd, width))
        self.n_experts = n_experts  # the routed experts of the layer, here or on other ranks (see shard)
        self.dispatch: Callable | None = None  # expert parallelism: sends rows to their experts' rank (shard)

    @torch.no_grad()
    def shard(self, index: int, parts: int, dispatch: Callable) -> None:
        """Keep experts ``[index * E / parts, (index + 1) * E / parts)`` of the E (expert parallelism,
        :mod:`tokenmill.parallel.expert_parallel`): ``dispatch(xs, counts, run)`` then receives every expert's
        rows (sorted by expert, ``counts`` per expert) and returns their outputs, having run the rows of this
        rank's experts by ``run(rows, counts of the kept experts)``. The caller then makes each weight a DTensor
        sharded over the ranks (its global shape the whole layer's), which :meth:`product` reads locally."""
        n = self.n_experts // parts
        for name, w in list(self.named_parameters(recurse=False)):
            setattr(self, name, nn.Parameter(w[index * n:(index + 1) * n].clone(), requires_grad=w.requires_grad))
        self.dispatch = dispatch

    @torch.no_grad()
    def init_weights(self, std: float, proj_std: float) -> None:
        """GPT-2's scheme: ``gate_up`` ~ N(0, std); ``down`` (a residual projection) ~ N(0, proj_std)."""
        self.gate_up.normal_(0.0, std)
        self.down.normal_(0.0, proj_std)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, impl: str) -> torch.Tensor:
        """x (N, C); weights, idx (N, k): each token's experts and their weights. Returns (N, C)."""
        k = idx.size(1)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens in order within a group
        tok = order // k
        counts = torch.zeros(self.n_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        xs = x[tok]
        if x.is_meta or _estimator_trace(x):  # shapes, no values: the grouped products' shapes, via expert 0
            gate, up = F.linear(xs, self.gate_up[0]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[0])
        else:
            dev = x.device.type  # the products' dtype: autocast's when it is on (weights cast per forward)
            dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
            if impl == "auto":
                impl = "grouped" if grouped_mm_runs(str(x.device), dt) else "loop"
            elif impl == "grouped" and not grouped_mm_runs(str(x.device), dt):
                raise ConfigError(f"model.moe_impl='grouped': torch's grouped matrix product cannot run for "
                                  f"{str(dt).removeprefix('torch.')} products on {x.device.type} here (under compile "
                                  "it traces bf16 only); use --model.moe_impl auto (the per-expert loop where it "
                                  "cannot run) or bf16 products.")
            run = functools.partial(self._run, grouped=impl == "grouped", dtype=dt)
            y = run(xs, counts) if self.dispatch is None else self.dispatch(xs, counts, run)
        y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y)

    def _run(self, xs: torch.Tensor, counts: torch.Tensor, grouped: bool, dtype: torch.dtype) -> torch.Tensor:
        """The rows ``xs`` (sorted by expert, ``counts`` per expert held here) through their experts."""
        if not grouped:
            return self._loop(xs, counts)
        expert = torch.repeat_interleave(torch.arange(counts.numel(), device=xs.device), counts, output_size=xs.size(0))
        return self._grouped(xs.to(dtype), counts, expert)

    def _loop(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One matmul pair per expert with tokens (the reference; reads the group sizes on the host)."""
        out = []
        for e, part in enumerate(xs.split(counts.tolist())):
            if part.size(0):
                gate, up = self.product("gate_up", part, e=e).chunk(2, dim=-1)
                part = self.product("down", F.silu(gate) * up, e=e)
            out.append(part)
        return torch.cat(out)

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Every expert as one grouped matmul per projection over the expert-sorted rows ``xs`` (``expert``:
        each row's expert). On CUDA each group is padded with zero rows to :data:`GROUP_ALIGN`, into a buffer
        of static size (rows + E x (align - 1)) whose tail belongs to the last group (zero rows: zero out)."""
        M, E = xs.size(0), counts.size(0)
        align = _align(xs)
        dest = None
        if align > 1:
            padded = (counts + align - 1) // align * align
            ends = padded.cumsum(0)
            rank = torch.arange(M, device=xs.device) - (counts.cumsum(0) - counts)[expert]
            dest = (ends - padded)[expert] + rank
            xs = xs.new_zeros(M + E * (align - 1), xs.size(1)).index_copy(0, dest, xs)
            ends = torch.cat([ends[:-1], ends.new_full((1,), xs.size(0))])
        else:
            ends = counts.cumsum(0)
        offs = ends.to(torch.int32)
        gate, up = self.product("gate_up", xs, offs).chunk(2, dim=-1)
        y = self.product("down", F.silu(gate) * up, offs)
        return y if dest is None else y[dest]

    def product(self, name: str, xs: torch.Tensor, offs: torch.Tensor | None = None, e: int = 0) -> torch.Tensor:
        """``xs`` through the stacked weight ``name`` ('gate_up' or 'down'): every expert's group at once (the
        grouped matmul; ``offs``: the groups' end offsets), or expert ``e``'s rows alone (the loop). The one
        place the expert weights are applied: LoRA adds its per-expert adapters here (model/lora.py)."""
        w = getattr(self, name)
        w = w if self.dispatch is None else w.to_local()  # expert parallelism: this rank's experts of the DTensor
        if offs is None:
            return F.linear(xs, w[e])
        return torch._grouped_mm(xs, w.to(xs.dtype).transpose(-2, -1), offs=offs)  # autocast: cast as a Linear's


class MoE(nn.Module):
    """The sparse layer's MLP: router, routed experts, optional (gated) shared experts, dropout."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        torch.compiler.assume_constant_result(_compiled_runs)  # see _compiled_runs (idempotent)
        C = cfg.n_embd
        self.top_k, self.kind, self.impl = cfg.moe_top_k, cfg.moe_router, cfg.moe_impl
        self.losses = cfg.moe_aux_loss_coef > 0 or cfg.moe_z_loss_coef > 0
        self.router = nn.Linear(C, cfg.moe_experts, bias=False)
        self.experts = Experts(cfg.moe_experts, cfg.expert_width, C)
        self.shared = self.shared_gate = None
        if cfg.moe_shared_experts:
            self.shared = SwiGLU(dataclasses.replace(cfg, intermediate_size=cfg.shared_width, bias=False, dropout=0.0))
            if cfg.moe_shared_gate:
                self.shared_gate = nn.Linear(C, 1, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)
        self.stats: dict[str, torch.Tensor] | None = None  # the last forward's routing (router_loss, router_stats)
        self.count_reducer: Callable | None = None  # sums the logged slot counts over ranks (expert parallelism)
        self.bias_rate = cfg.moe_bias_update_rate
        self.step_load: torch.Tensor | None = None  # this optimizer step's routed slots per expert (bias_rate > 0)
        if self.bias_rate:  # DeepSeek-V3's per-expert routing bias (balance_experts): state, not a parameter
            self.register_buffer("router_bias", torch.zeros(cfg.moe_experts))

    @torch.no_grad()
    def init_weights(self, std: float, proj_std: float) -> None:
        """The routing bias starts at zero (the router and experts initialise themselves)."""
        if self.bias_rate:
            self.router_bias.zero_()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A source without the routing bias loads with it at zero; one with a non-zero bias needs the bias
        (``model.moe_bias_update_rate`` > 0) or it would route differently: refused; a zero one is dropped."""
        key = prefix + "router_bias"
        if self.bias_rate and key not in state_dict:
            state_dict[key] = torch.zeros(self.router_bias.shape, dtype=self.router_bias.dtype, device=self.router_bias.device)
        elif not self.bias_rate and key in state_dict:
            if bool(state_dict[key].any()):
                raise CheckpointError(f"'{key}' is non-zero: the weights were trained with DeepSeek-V3's routing bias; "
                                      "set --model.moe_bias_update_rate > 0 to route with it.")
            del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def shard_experts(self, index: int, parts: int, dispatch: Callable) -> nn.Module:
        """Expert parallelism: keep routed-expert shard ``index`` of ``parts`` (:meth:`Experts.shard`; the router
        and shared experts stay whole) and return the module holding the kept experts' weights."""
        self.experts.shard(index, parts, dispatch)
        return self.experts

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits (N, E) -> (probabilities (N, E) fp32, weights (N, k) fp32, experts (N, k)). With the
        routing bias, the experts are the top k of (scores + bias) (scores: the logits for 'topk-softmax', else
        the probabilities) and the weights come from the unbiased scores."""
        probs = F.softmax(logits.float(), dim=-1)
        bias = self.router_bias if self.bias_rate else None
        if self.kind == "topk-softmax":
            if bias is None:
                top, idx = torch.topk(logits, self.top_k, dim=-1)
            else:
                idx = torch.topk(logits.float() + bias, self.top_k, dim=-1).indices
                top = logits.gather(1, idx)
            return probs, F.softmax(top.float(), dim=-1), idx
        if bias is None:
            weights, idx = torch.topk(probs, self.top_k, dim=-1)
        else:
            idx = torch.topk(probs + bias, self.top_k, dim=-1).indices
            weights = probs.gather(1, idx)
        if self.kind == "softmax-topk-renorm":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        probs, weights, idx = self.route(logits)
        out = self.experts(x, weights, idx, self.impl)
        if self.shared is not None:
            s = self.shared(x)
            out = out + (torch.sigmoid(self.shared_gate(x)) * s if self.shared_gate is not None else s)
        self._record(logits, probs, idx)
        return self.dropout(out.reshape(shape))

    def _record(self, logits: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor) -> None:
        """Keep this forward's routing statistics: slots per expert (no gradient), the summed router
        probabilities and squared logsumexps (with their gradients while training with router losses)."""
        keep = self.training and self.losses and torch.is_grad_enabled()
        flat = idx.reshape(-1)
        counts = torch.zeros(probs.size(1), device=probs.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        z = torch.logsumexp(logits.float(), dim=-1).square().sum()
        prob_sum = probs.sum(0)
        if self.bias_rate and self.training and not (counts.is_meta or _estimator_trace(counts)):  # balance_experts
            self.step_load = counts if self.step_load is None else self.step_load + counts
        self.stats = {"counts": counts, "prob_sum": prob_sum if keep else prob_sum.detach(),
                      "z_sum": z if keep else z.detach(), "rows": probs.new_tensor(float(probs.size(0)))}


def _moe_stats(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    return [m.stats for m in model.modules() if isinstance(m, MoE) and m.stats is not None]


def _pooled(stats: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, z-loss) over the layers of ``stats``, pooled as transformers pools them."""
    rows = sum(s["rows"] for s in stats)
    f = sum(s["counts"] for s in stats) / rows
    p = sum(s["prob_sum"] for s in stats) / rows
    aux = (f * p).sum() * f.numel()
    z = sum(s["z_sum"] for s in stats) / rows
    return aux, z


def router_loss(model: nn.Module, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor | float:
    """``model.moe_aux_loss_coef`` x the load-balancing loss + ``model.moe_z_loss_coef`` x the z-loss of the
    model's last forward (0.0 without sparse layers or coefficients), for a cross-entropy over ``targets``
    reduced by ``reduction``: 'sum' (a loss mask's summed loss, later divided by the global batch's learned
    tokens) multiplies it by this micro-batch's learned tokens (targets not -100), so it stays a mean."""
    cfg = model.cfg
    stats = _moe_stats(model)
    if not stats or not (cfg.moe_aux_loss_coef or cfg.moe_z_loss_coef):
        return 0.0
    aux, z = _pooled(stats)
    loss = cfg.moe_aux_loss_coef * aux + cfg.moe_z_loss_coef * z
    return loss * (targets != -100).sum() if reduction == "sum" else loss


def router_stats(model: nn.Module) -> dict[str, float]:
    """The logged routing numbers of the last forward: ``moe_load_<i>`` for each sparse layer i (its busiest
    expert's routed slots over the mean: 1 = balanced, E / k = every token to the same k experts),
    ``moe_load_max`` (the worst layer's), ``moe_aux_loss`` and ``moe_z_loss`` (before their coefficients).
    Empty for a dense model. One host sync; under any data parallelism the counts are first summed over the
    ranks (``count_reducer``, else the process group: one all-reduce, every rank calls this), so the numbers
    are the whole batch's, not rank 0's."""
    layers = [(i, m.stats) for i, m in _numbered(model) if m.stats is not None]
    if not layers:
        return {}
    stats = [s for _, s in layers]
    with torch.no_grad():
        aux, z = _pooled([{k: v.detach() for k, v in s.items()} for s in stats])
        counts = torch.stack([s["counts"] for s in stats])
        # Every rank's tokens: the global load. Summing over the whole group (not just the data-parallel one)
        # is exact: the ranks of a TP group see the same tokens, which scales every count alike and leaves
        # max / mean unchanged; MoE refuses parallel.pp, so every rank holds the same layers.
        reducer = next((m.count_reducer for _, m in _numbered(model) if m.count_reducer is not None), _sum_over_ranks)
        counts = reducer(counts)
        loads = counts.amax(1) / counts.mean(1).clamp_min(1e-9)
        vals = torch.cat([loads.float(), torch.stack([aux, z]).float().to(loads.device)]).tolist()
    n = len(stats)
    out = {f"moe_load_{i}": round(v, 4) for (i, _), v in zip(layers, vals[:n])}
    return out | {"moe_load_max": max(out.values()), "moe_aux_loss": vals[n], "moe_z_loss": vals[n + 1]}


@torch.no_grad()
def balance_experts(model: nn.Module) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing, once after each optimizer step (the trainer calls it):
    each MoE with ``model.moe_bias_update_rate`` > 0 moves its ``router_bias`` by rate x sign(mean load - load
    of the expert) over the slots routed since the last call (every micro-batch of the step), summed over the
    data-parallel ranks first (``count_reducer``, else over the process group: every rank calls this), so every
    rank keeps the same bias. No-op for a model without it."""
    layers = [m for m in model.modules() if isinstance(m, MoE) and m.bias_rate and m.step_load is not None]
    if not layers:
        return
    counts = torch.stack([m.step_load for m in layers])
    reducer = next((m.count_reducer for m in layers if m.count_reducer is not None), _sum_over_ranks)
    counts = reducer(counts)
    steps = torch.sign(counts.mean(1, keepdim=True) - counts)
    for m, s in zip(layers, steps):
        m.router_bias.add_(s.to(m.router_bias.dtype), alpha=m.bias_rate)
        m.step_load = None


def _sum_over_ranks(counts: torch.Tensor) -> torch.Tensor:
    """``counts`` summed over the process group's ranks (the counts of one process when there is none)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return counts
    out = counts.clone()
    dist.all_reduce(out)
    return out


def _numbered(model: nn.Module) -> list[tuple[int, MoE]]:
    """``(layer index, MoE)`` of every mixture of experts in ``model`` (the index read from its name)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            parts = name.split(".")
            out.append((int(parts[parts.index("blocks") + 1]) if "blocks" in parts else len(out), m))
    return out
