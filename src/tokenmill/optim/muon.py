"""Muon for the hidden weight matrices, AdamW for everything else: ``optim.name = 'muon'``.

Muon (Keller Jordan, 2024, "Muon: An optimizer for hidden layers in neural networks") updates a 2-D
weight ``W`` (rows x cols) from its gradient ``G`` as:

1. momentum ``B <- mu * B + (1 - mu) * G`` (one buffer per matrix: half of AdamW's state);
2. Nesterov: ``U = (1 - mu) * G + mu * B``;
3. orthogonalise ``U`` by five steps of the quintic Newton-Schulz iteration ``X <- a X + (b A + c A^2) X``,
   ``A = X X^T``, ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, in bf16, started from ``U / ||U||_F``
   (on the transpose when rows > cols, so that ``A`` is the smaller Gram matrix): ``O ~ U V^T`` of the
   SVD ``U = U S V^T``, with the singular values pushed to about 1;
4. ``W <- W * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * O``.

This is the rule of ``torch.optim.Muon`` (PyTorch >= 2.9), which the tests check this against step for
step. tokenmill keeps its own loop for what that class does not do: a fused q/k/v matrix is three
matrices (each part orthogonalised on its own, as with separate projections: the model says where the
rows split, :meth:`tokenmill.model.GPT.hidden_matrices`), and a sharded matrix (FSDP2 or tensor
parallel: a DTensor) is gathered whole for the orthogonalisation, which needs the full matrix, and each
rank keeps its own shard of the result (every rank computes the same full update: simple, correct, and
redundant work on big models).

A mixture of experts (``model/moe.py``): the router's weight (and a shared-expert gate) scores tokens, an
output-like gate rather than a hidden layer, so it goes to AdamW with the embeddings and the head; the routed
experts' stacked weights (``gate_up`` (E, 2I, C), ``down`` (E, C, I), and LoRA's per-expert adapters (E, r,
in), (E, out, r)) are E hidden matrices each: every expert's matrix is orthogonalised on its own (a batched
Newton-Schulz over the leading expert dimension, never the stack flattened into one matrix), and ``gate_up``
as two matrices per expert, its gate rows and its up rows (as a dense SwiGLU's separate gate and up).

:class:`MuonWithAdamW` is the one optimizer the trainer drives: AdamW groups first (so the logged
learning rate is ``optim.lr``), Muon groups after; its ``state_dict`` is an ordinary optimizer state dict
over both (parameter indices in that order), which single-file and DCP checkpoints store as usual.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tokenmill.config import OptimConfig
from tokenmill.errors import ConfigError
from tokenmill.optim.adamw import adamw, param_groups
from tokenmill.parallel import unwrap

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
EPS = 1e-7


def newton_schulz(g: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16,
                  eps: float = EPS) -> torch.Tensor:
    """The quintic Newton-Schulz orthogonalisation of the 2-D ``g`` (or of each matrix of a 3-D stack, on its
    own), computed (and returned) in ``dtype``: bf16 as the reference implementation (the tests run it in
    float64 against an exact reference)."""
    a, b, c = NS_COEFFICIENTS
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=eps)
        mm = torch.addmm
    else:
        x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        mm = torch.baddbmm
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def orthogonal_parts(u: torch.Tensor, splits: list[int] | None, steps: int = NS_STEPS,
                     dtype: torch.dtype = torch.bfloat16) -> list[tuple[slice, torch.Tensor, float]]:
    """``(rows, O, scale)`` for each part of ``u`` along the rows (``splits``: row counts of a fused matrix;
    None = one matrix): its orthogonalisation ``O`` and the factor ``sqrt(max(1, rows / cols))``. A 3-D ``u``
    is a stack of matrices (the experts): rows are its last-but-one dimension, each matrix its own."""
    out, start = [], 0
    for part in u.split(splits, dim=-2) if splits else (u,):
        rows = slice(start, start + part.size(-2))
        start = rows.stop
        out.append((rows, newton_schulz(part, steps, dtype), math.sqrt(max(1.0, part.size(-2) / part.size(-1)))))
    return out


def _is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters and 3-D stacks of them (see the module docstring). ``splits``: parameter -> row split of a fused
    matrix (structure, not state: rebuilt from the model, never saved). ``ns_dtype``: the precision of the
    orthogonalisation (bf16, as the reference; the tests use float64)."""

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, weight_decay: float = 0.0,
                 nesterov: bool = True, ns_steps: int = NS_STEPS,
                 splits: dict[torch.Tensor, list[int] | None] | None = None, ns_dtype: torch.dtype = torch.bfloat16):
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "nesterov": nesterov,
                    "ns_steps": ns_steps}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim not in (2, 3):
                    raise ConfigError(f"Muon takes 2-D matrices (or 3-D stacks of them) only, got a parameter of "
                                      f"shape {tuple(p.shape)}.")
        self.splits = splits or {}
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                u = p.grad.lerp(buf, mu) if group["nesterov"] else buf
                p.mul_(1 - lr * wd)
                splits, steps = self.splits.get(p), group["ns_steps"]
                if _is_dtensor(u):
                    p.add_(self._sharded_update(u, splits, steps, self.ns_dtype, p.dtype), alpha=-lr)
                    continue
                for rows, o, scale in orthogonal_parts(u, splits, steps, self.ns_dtype):
                    p[..., rows, :].add_(o, alpha=-lr * scale)  # in fp32 from the bf16 O, as torch.optim.Muon
        return loss

    @staticmethod
    def _sharded_update(u, splits: list[int] | None, steps: int, dtype: torch.dtype, out: torch.dtype):
        """The scaled update of a sharded matrix (a DTensor), sharded as ``u``: gathered whole first."""
        from torch.distributed.tensor import DTensor, Replicate

        parts = orthogonal_parts(u.full_tensor(), splits, steps, dtype)  # the orthogonalisation needs every row
        full = torch.cat([o.to(out) * scale for _, o, scale in parts], dim=-2)
        mesh = u.device_mesh
        whole = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return whole.redistribute(mesh, u.placements)  # Replicate -> shard: a local slice, no communication


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over two: ``adamw`` (embeddings, head, norm gains, biases) and ``muon`` (the hidden
    matrices); either may be None when it has no parameter (a pipeline stage of blocks only and LoRA
    adapters, say). ``param_groups`` are the parts' own group dicts (AdamW's first), so the lr schedule
    drives both; ``state`` is a read-only view over both states."""

    def __init__(self, adamw: torch.optim.Optimizer | None, muon: Muon | None):
        self.adamw, self.muon = adamw, muon
        params = [p for o in self.parts for g in o.param_groups for p in g["params"]]
        if not params:
            raise ConfigError("optim.name='muon': this model has no trainable parameter.")
        super().__init__(params, {})
        self._link()

    @property
    def parts(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self.adamw, self.muon) if o is not None]

    def _link(self) -> None:
        self.param_groups = [g for o in self.parts for g in o.param_groups]
        self.state = _States(*(o.state for o in self.parts))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for o in self.parts:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """An ordinary optimizer state dict: parameter indices over AdamW's groups, then Muon's."""
        state, groups, n = {}, [], 0
        for o in self.parts:
            sd = o.state_dict()
            state.update({i + n: s for i, s in sd["state"].items()})
            groups += [{**g, "params": [i + n for i in g["params"]]} for g in sd["param_groups"]]
            n += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups, state = state_dict["param_groups"], state_dict["state"]
        kinds = [_is_muon_group(g) for g in groups]
        want = [o is self.muon for o in self.parts for _ in o.param_groups]
        if kinds != want:
            raise ConfigError("this optimizer state was not saved by optim.name='muon' with the same parameter "
                              "groups; resume with the optimizer that saved it (--optim.name).")
        first = 0
        for o in self.parts:
            mine = groups[first:first + len(o.param_groups)]
            first += len(mine)
            ids = [i for g in mine for i in g["params"]]  # indices, or names (DCP): torch maps them in order
            o.load_state_dict({"state": {i: state[i] for i in ids if i in state}, "param_groups": mine})
        self._link()  # loading made new group dicts and states


def _is_muon_group(group: dict) -> bool:
    return "momentum" in group and "betas" not in group


def build_muon(model: nn.Module, cfg: OptimConfig) -> MuonWithAdamW:
    """Muon over the model's hidden matrices (the model lists them: ``GPT.hidden_matrices``), AdamW with
    tokenmill's groups (``optim.decay_groups``, ``optim.impl``) over every other trainable parameter."""
    gpt = unwrap(model)
    if not hasattr(gpt, "hidden_matrices"):
        raise ConfigError("optim.name='muon' needs a tokenmill GPT (it asks the model for its hidden matrices).")
    gates, stacks = _moe_parameters(gpt)
    hidden = [(p, rows) for p, rows in gpt.hidden_matrices() if p.requires_grad and id(p) not in gates]
    hidden += [(p, rows) for p, rows in stacks if p.requires_grad]
    ids = {id(p) for p, _ in hidden}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in param_groups(model, cfg)]
    rest = [g for g in rest if g["params"]]
    muon = Muon([p for p, _ in hidden], lr=cfg.muon_lr, momentum=cfg.muon_momentum,
                weight_decay=cfg.muon_weight_decay, splits={p: rows for p, rows in hidden if rows}) if hidden else None
    return MuonWithAdamW(adamw(rest, cfg) if rest else None, muon)


def _moe_parameters(gpt: nn.Module) -> tuple[set[int], list[tuple[nn.Parameter, list[int] | None]]]:
    """The mixtures of experts' gates (ids of the router and shared-expert gate weights: AdamW's) and their
    expert stacks (3-D: Muon's, per expert; ``gate_up`` split into its gate and up rows)."""
    from tokenmill.model.moe import MoE

    gates: set[int] = set()
    stacks: list[tuple[nn.Parameter, list[int] | None]] = []
    for m in gpt.modules():
        if not isinstance(m, MoE):
            continue
        gates |= {id(g.weight) for g in (m.router, m.shared_gate) if g is not None}
        width = m.experts.down.size(-1)
        for name, p in m.experts.named_parameters():
            if p.ndim == 3:
                stacks.append((p, [width, width] if name == "gate_up" else None))
    return gates, stacks


class _States(Mapping):
    """The per-parameter states of several optimizers, read as one (a lookup never inserts, unlike a
    ``defaultdict``, so a foreign parameter never lands in an optimizer's own state)."""

    def __init__(self, *maps: Mapping):
        self.maps = maps

    def __getitem__(self, key):
        for m in self.maps:
            if key in m:
                return m[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator:
        return (k for m in self.maps for k in m)

    def __len__(self) -> int:
        return sum(len(m) for m in self.maps)
