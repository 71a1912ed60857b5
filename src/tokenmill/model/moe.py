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

Router losses (the model owns them: :func:`router_loss`, added by ``GPT.forward`` to the training loss):
the load-balancing loss ``model.moe_aux_loss_coef`` x E x sum_e f_e P_e, f_e the share of routed slots and
P_e the mean router probability of expert e, pooled over all sparse layers as transformers'
``load_balancing_loss_func`` pools them; the z-loss ``model.moe_z_loss_coef`` x mean over layers and tokens of
logsumexp(router logits)^2 (ST-MoE). Each MoE keeps its last forward's routing statistics (``stats``);
:func:`router_stats` turns them into the logged numbers (per-layer expert load max / mean, the losses).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from tokenmill.config import ModelConfig
from tokenmill.model.layers import SwiGLU

__all__ = ["MoE", "Experts", "grouped_mm_runs", "router_loss", "router_stats"]

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


def _align(xs: torch.Tensor) -> int:
    """Rows each expert's group is padded to a multiple of: :data:`GROUP_ALIGN` on CUDA, 1 (none) elsewhere."""
    return GROUP_ALIGN if xs.is_cuda else 1


class Experts(nn.Module):
    """E SwiGLU experts without biases: ``gate_up`` (E, 2I, C) and ``down`` (E, C, I)."""

    def __init__(self, n_experts: int, width: int, n_embd: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * width, n_embd))
        self.down = nn.Parameter(torch.empty(n_experts, n_embd, width))

    @torch.no_grad()
    def init_weights(self, std: float, proj_std: float) -> None:
        """GPT-2's scheme: ``gate_up`` ~ N(0, std); ``down`` (a residual projection) ~ N(0, proj_std)."""
        self.gate_up.normal_(0.0, std)
        self.down.normal_(0.0, proj_std)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, impl: str) -> torch.Tensor:
        """x (N, C); weights, idx (N, k): each token's experts and their weights. Returns (N, C)."""
        E, k = self.gate_up.size(0), idx.size(1)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens in order within a group
        tok = order // k
        counts = torch.zeros(E, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        xs = x[tok]
        if x.is_meta:  # the estimator's trace (shapes, no values): the grouped products' shapes, via expert 0
            gate, up = F.linear(xs, self.gate_up[0]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[0])
        else:
            dev = x.device.type  # the products' dtype: autocast's when it is on (weights cast per forward)
            dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
            if impl == "auto":
                impl = "grouped" if grouped_mm_runs(str(x.device), dt) else "loop"
            y = self._grouped(xs.to(dt), counts, flat[order]) if impl == "grouped" else self._loop(xs, counts)
        y = (y * weights.reshape(-1)[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tok, y)

    def _loop(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One matmul pair per expert with tokens (the reference; reads the group sizes on the host)."""
        out = []
        for e, part in enumerate(xs.split(counts.tolist())):
            if part.size(0):
                gate, up = F.linear(part, self.gate_up[e]).chunk(2, dim=-1)
                part = F.linear(F.silu(gate) * up, self.down[e])
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
        w1, w2 = self.gate_up.to(xs.dtype), self.down.to(xs.dtype)  # autocast: cast as a Linear's weight is
        gate, up = torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)
        return y if dest is None else y[dest]


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

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Router logits (N, E) -> (probabilities (N, E) fp32, weights (N, k) fp32, experts (N, k))."""
        probs = F.softmax(logits.float(), dim=-1)
        if self.kind == "topk-softmax":
            top, idx = torch.topk(logits, self.top_k, dim=-1)
            return probs, F.softmax(top.float(), dim=-1), idx
        weights, idx = torch.topk(probs, self.top_k, dim=-1)
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
    Empty for a dense model. One host sync."""
    layers = [(i, m.stats) for i, m in _numbered(model) if m.stats is not None]
    if not layers:
        return {}
    stats = [s for _, s in layers]
    with torch.no_grad():
        aux, z = _pooled([{k: v.detach() for k, v in s.items()} for s in stats])
        loads = torch.stack([s["counts"].max() / s["counts"].mean().clamp_min(1e-9) for s in stats])
        vals = torch.cat([loads.float(), torch.stack([aux, z]).float().to(loads.device)]).tolist()
    n = len(stats)
    out = {f"moe_load_{i}": round(v, 4) for (i, _), v in zip(layers, vals[:n])}
    return out | {"moe_load_max": max(out.values()), "moe_aux_loss": vals[n], "moe_z_loss": vals[n + 1]}


def _numbered(model: nn.Module) -> list[tuple[int, MoE]]:
    """``(layer index, MoE)`` of every mixture of experts in ``model`` (the index read from its name)."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            parts = name.split(".")
            out.append((int(parts[parts.index("blocks") + 1]) if "blocks" in parts else len(out), m))
    return out
