"""LoRA (``lora.*``): low-rank adapters on chosen projections of every block, every other weight frozen.

A projection ``W`` (out x in) with an adapter computes ``W x + b + (alpha / r) B A dropout(x)``: ``A`` (r x in)
starts Kaiming-uniform (as ``nn.Linear`` draws its weight), ``B`` (out x r) starts at zero, so a model with
fresh adapters computes exactly what its base computes. Only ``A`` and ``B`` train: the base weights
(embeddings, norms, head, biases, every ``W``) get ``requires_grad = False``, hence no gradients and no
optimizer state (the optimizer is built from the parameters that require gradients, ``optim/adamw.py``).

The block names its projections by role (:meth:`tokenmill.model.layers.Block.projections`): q, k, v, o,
gate, up, down. With the fused q/k/v matrix, q, k and v are row ranges of one Linear and each role gets its
own adapter there too, so the adapters (and their random draws) are the same for fused and separate
q/k/v. The adapted module keeps the base's parameter names (``weight``, ``bias``) and adds
``lora_A.<role>``/``lora_B.<role>``, so a checkpoint's base weights keep their names.

:func:`merge_lora` folds the adapters into the base weights (``W + (alpha / r) B A``, computed in fp32),
giving a plain model: what ``sample``, ``eval`` and ``export`` load.

QLoRA (``lora.quantize_base = 'nf4'``): the frozen ``W`` of every block projection (q, k, v, o, gate, up, down,
adapted or not, as QLoRA, PEFT with bitsandbytes and torchtune quantise every Linear of the blocks; the embeddings,
norms and head stay in their dtype; a projection without an adapter becomes a :class:`LoRALinear` with no
roles) and the routed experts' stacks where they are adapted is stored as torchao's
NF4 tensor (4-bit NormalFloat codes, one absmax scale per block of :data:`NF4_BLOCK` weights, the scales
themselves quantised to int8 in groups of up to :data:`NF4_SCALE_GROUP`), dequantised to the input's dtype in
the forward and again in the backward (only the 4-bit form is kept between them; ``model/nf4.py``). It keeps its
dtype through the precision cast (the cast would dequantise it). A state dict
holds it exactly, in plain tensors that need no torchao to read: ``weight`` (the codes, one uint8 per weight,
so the weight keeps its shape) and ``weight_nf4_scales``, ``weight_nf4_factors``, ``weight_nf4_mean``; a
resumed run gets the very same NF4 base. A floating-point ``weight`` loaded into it is quantised. Merging
adds the adapters to the dequantised base.

Routed experts (role ``experts``, :class:`LoRAExperts`): each expert ``e`` of a stacked weight (``gate_up``
(E, 2I, C), ``down`` (E, C, I)) gets its own pair, ``A_e`` (r x in) and ``B_e`` (out x r), held stacked as
``lora_A.<weight>`` (E, r, in) and ``lora_B.<weight>`` (E, out, r) (PEFT's per-expert layout for a 3-D
parameter). They are applied inside the experts' product (:meth:`tokenmill.model.moe.Experts.product`):
``x W_e^T + (alpha / r) (dropout(x) A_e^T) B_e^T`` for expert e's tokens, as two more grouped matmuls (or
per-expert matmuls in the loop); merging gives ``W_e + (alpha / r) B_e A_e`` per expert. In a sparse layer the
roles gate, up and down name the shared experts' projections (where the model has them). QLoRA on the
experts: each stack is one NF4 tensor of its (E x out, in) rows (saved as codes in the stack's shape, plus
``<name>_nf4_scales`` etc.), dequantised whole in each product's forward and again in its backward. A role a block
lacks is skipped there (a dense layer has no experts, a sparse one no dense MLP); a role no block has is
refused.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import LoraConfig, lora_roles
from tokenmill.errors import ConfigError
from tokenmill.model.moe import Experts
from tokenmill.model.nf4 import (
    NF4_BLOCK,
    NF4_SCALE_GROUP,
    NF4Base,
    is_nf4,
    nf4_bytes,
    nf4_dequantize,
    nf4_groups,
    nf4_linear,
    nf4_product,
    to_nf4,
    torchao_quietly,
)

__all__ = ["NF4_BLOCK", "NF4_SCALE_GROUP", "LoRAExperts", "LoRALinear", "apply_lora", "merge_lora", "nf4_bytes", "nf4_params",
           "nf4_groups", "nf4_weights", "to_nf4", "torchao_quietly"]


class LoRALinear(NF4Base, nn.Linear):
    """A Linear (the frozen base's own ``weight`` and ``bias``) with adapters on row ranges of its output.

    ``parts``: role -> (first output row, rows); the rows of a role get ``(alpha / rank) B_role A_role
    dropout(x)`` added. The adapters start uninitialised: :func:`apply_lora` draws them (:meth:`reset_adapter`)
    or a checkpoint loads them."""

    def __init__(self, base: nn.Linear, parts: dict[str, tuple[int, int]], rank: int, alpha: float,
                 dropout: float = 0.0, quantize: str = "none"):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
        self.quantize = quantize  # 'nf4': the base is (on meta: stands for) an NF4 weight
        if quantize == "nf4" and not base.weight.is_meta:  # on meta (estimator, counts): left as it is
            self.weight = nn.Parameter(to_nf4(base.weight), requires_grad=False)
        self.register_parameter("bias", base.bias)
        self.rank, self.scale = rank, alpha / rank
        w = base.weight
        self.lora_A = nn.ParameterDict({r: nn.Parameter(torch.empty(rank, self.in_features, dtype=w.dtype,
                                                                    device=w.device)) for r in parts})
        self.lora_B = nn.ParameterDict({r: nn.Parameter(torch.empty(n, rank, dtype=w.dtype, device=w.device))
                                        for r, (_, n) in parts.items()})
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        # the output split into consecutive segments, each adapted by one role or by none
        self.segments: list[tuple[int, str | None]] = []
        pos = 0
        for role, (start, n) in sorted(parts.items(), key=lambda kv: kv[1][0]):
            if start > pos:
                self.segments.append((start - pos, None))
            self.segments.append((n, role))
            pos = start + n
        if pos < self.out_features:
            self.segments.append((self.out_features - pos, None))

    @torch.no_grad()
    def reset_adapter(self, role: str) -> None:
        """``A`` ~ Kaiming-uniform (``nn.Linear``'s draw, a = sqrt(5)), ``B`` = 0."""
        nn.init.kaiming_uniform_(self.lora_A[role], a=math.sqrt(5))
        self.lora_B[role].zero_()

    def delta(self, h: torch.Tensor, role: str) -> torch.Tensor:
        return F.linear(F.linear(h, self.lora_A[role]), self.lora_B[role]) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nf4 = self.quantize == "nf4" and not self.weight.is_meta  # on meta (the estimator): a plain weight
        y = (nf4_linear if nf4 else F.linear)(x, self.weight, self.bias)
        if not self.lora_A:  # QLoRA's base of a projection without an adapter
            return y
        h = self.lora_dropout(x)
        if len(self.segments) == 1:
            return y + self.delta(h, self.segments[0][1])
        outs = list(y.split([n for n, _ in self.segments], dim=-1))
        for i, (_, role) in enumerate(self.segments):
            if role is not None:
                outs[i] = outs[i] + self.delta(h, role)
        return torch.cat(outs, dim=-1)

    def base_weight(self) -> torch.Tensor:
        """``W`` as the forward uses it: dequantised (in its own dtype) when it is stored as NF4."""
        w = self.weight.detach()
        return nf4_dequantize(w) if is_nf4(w) else w

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """``W + (alpha / r) B A`` on the adapted rows, computed in fp32, in ``W``'s dtype (NF4: the
        dequantised ``W``)."""
        w = self.base_weight().float().clone()
        start = 0
        for n, role in self.segments:
            if role is not None:
                w[start:start + n] += self.scale * (self.lora_B[role].float() @ self.lora_A[role].float())
            start += n
        return w.to(self.weight.dtype)

    def extra_repr(self) -> str:
        roles = ", ".join(r for _, r in self.segments if r is not None)
        nf4 = ", base nf4" if is_nf4(self.weight) else ""
        return f"{super().extra_repr()}, lora rank={self.rank}, scale={self.scale:g}, roles=[{roles}]{nf4}"


def _expert_mm(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor | None, e: int) -> torch.Tensor:
    return F.linear(xs, w[e]) if offs is None else torch._grouped_mm(xs, w.transpose(-2, -1), offs=offs)


class _NF4ExpertProduct(torch.autograd.Function):
    """``xs`` through a stacked NF4 expert weight (held 2-D, ``shape`` its stack), dequantised to the input's
    dtype in the forward and again in the backward: only the 4-bit form is kept between them, as torchao's
    NF4 linear does for a Linear. The weight is frozen: no gradient for it."""

    @staticmethod
    def forward(ctx, xs, w, shape, offs, e):
        ctx.w, ctx.shape, ctx.e, ctx.grouped = w, shape, e, offs is not None
        ctx.save_for_backward(*(() if offs is None else (offs,)))
        return _expert_mm(xs, nf4_dequantize(w, xs.dtype).view(shape), offs, e)

    @staticmethod
    def backward(ctx, gy):
        w = nf4_dequantize(ctx.w, gy.dtype).view(ctx.shape)
        gx = torch._grouped_mm(gy, w, offs=ctx.saved_tensors[0]) if ctx.grouped else gy @ w[ctx.e]
        return gx, None, None, None, None


class LoRAExperts(NF4Base, Experts):
    """Routed experts (the frozen base's own stacked ``gate_up`` and ``down``) with a low-rank adapter pair per
    expert on each (see the module doc). The adapters start uninitialised: :meth:`reset_adapter` draws them
    or a checkpoint loads them. QLoRA (``quantize='nf4'``): each stack is held as one NF4 tensor of its
    (E x out, in) rows, dequantised whole for each product (the loop: for each expert's product)."""

    NAMES = ("gate_up", "down")

    def __init__(self, base: Experts, rank: int, alpha: float, dropout: float = 0.0, quantize: str = "none"):
        nn.Module.__init__(self)
        self.__dict__.update({k: v for k, v in base.__dict__.items() if not k.startswith("_")})
        for k in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            setattr(self, k, type(getattr(base, k))(getattr(base, k)))
        self.rank, self.scale, self.quantize = rank, alpha / rank, quantize
        shapes = {n: getattr(self, n).shape for n in self.NAMES}  # (E, out, in)
        self.stacks = {n: tuple(v) for n, v in shapes.items()}
        if quantize == "nf4" and not self.gate_up.is_meta:  # on meta (estimator, counts): left as it is
            for n in self.NAMES:
                w = getattr(self, n)
                setattr(self, n, nn.Parameter(to_nf4(w.reshape(-1, w.size(-1))), requires_grad=False))
        w = self.gate_up
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(E, rank, i, dtype=w.dtype, device=w.device))
                                        for n, (E, _, i) in shapes.items()})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.empty(E, o, rank, dtype=w.dtype, device=w.device))
                                        for n, (E, o, _) in shapes.items()})
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    @torch.no_grad()
    def reset_adapter(self, role: str = "experts") -> None:
        """Each expert's ``A_e`` ~ Kaiming-uniform (``nn.Linear``'s draw on an (r x in) matrix), ``B_e`` = 0."""
        for n in self.NAMES:
            for a in self.lora_A[n]:
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            self.lora_B[n].zero_()

    def product(self, name: str, xs: torch.Tensor, offs: torch.Tensor | None = None, e: int = 0) -> torch.Tensor:
        """The base product plus ``(alpha / r) (dropout(xs) A_e^T) B_e^T`` for each expert's rows."""
        w = getattr(self, name)
        if self.quantize == "nf4" and not w.is_meta:  # an NF4 stack (the flag: torch.compile cannot ask the tensor)
            y = nf4_product(_NF4ExpertProduct.apply, xs, w, self.stacks[name], offs, e)
        else:
            y = super().product(name, xs, offs, e)
        a, b, h = self.lora_A[name], self.lora_B[name], self.lora_dropout(xs)
        if offs is None:
            return y + F.linear(F.linear(h, a[e]), b[e]) * self.scale
        mid = torch._grouped_mm(h, a.to(h.dtype).transpose(-2, -1), offs=offs)
        return y + torch._grouped_mm(mid, b.to(h.dtype).transpose(-2, -1), offs=offs) * self.scale

    @torch.no_grad()
    def merged_weight(self, name: str) -> torch.Tensor:
        """``W_e + (alpha / r) B_e A_e`` for every expert, computed in fp32, in ``W``'s dtype."""
        w = getattr(self, name).detach()
        base = nf4_dequantize(w).view(self.stacks[name]) if is_nf4(w) else w
        delta = torch.bmm(self.lora_B[name].float(), self.lora_A[name].float())
        return (base.float() + self.scale * delta).to(w.dtype)

    def _nf4_shape(self, name: str) -> tuple[int, ...]:
        return self.stacks[name]  # the codes saved in the stack's shape

    def merged(self) -> Experts:
        """A plain :class:`Experts` holding the merged weights (the same attributes, no adapters)."""
        plain = Experts.__new__(Experts)
        plain.__dict__.update(self.__dict__)
        plain._parameters = {n: nn.Parameter(self.merged_weight(n)) for n in self.NAMES}
        plain._modules = {k: v for k, v in self._modules.items() if k not in ("lora_A", "lora_B", "lora_dropout")}
        for k in ("rank", "scale", "stacks", "quantize"):
            plain.__dict__.pop(k, None)
        return plain

    def extra_repr(self) -> str:
        E, out, i = self.stacks["gate_up"]
        nf4 = ", base nf4" if self._nf4_names() else ""
        return f"experts={E}, gate_up=({out}, {i}), lora rank={self.rank} per expert, scale={self.scale:g}{nf4}"


def _projections(block: nn.Module) -> dict[str, tuple[str, int, int]]:
    """The block's adaptable projections by role: :meth:`Block.projections`, and in a sparse layer 'experts'
    (the routed experts) and gate, up, down for its shared experts' projections (where it has them)."""
    proj = dict(block.projections())
    mlp = block.mlp
    if isinstance(getattr(mlp, "experts", None), Experts):
        proj["experts"] = ("mlp.experts", 0, 0)
        if getattr(mlp, "shared", None) is not None:
            for role, name in (("gate", "c_gate"), ("up", "c_fc"), ("down", "c_proj")):
                proj[role] = (f"mlp.shared.{name}", 0, getattr(mlp.shared, name).out_features)
    return proj


def apply_lora(model: nn.Module, cfg: LoraConfig, init: bool = True) -> nn.Module:
    """``lora.rank > 0``: freeze every parameter of ``model`` (a GPT, before any wrapper), then give the
    projections ``lora.targets`` names in every block that has them an adapter (see the module doc). ``init``:
    draw the adapters (in block order, then role order: the same draws for fused and separate q/k/v); False
    leaves them to be loaded. Returns ``model``."""
    if cfg.rank == 0:
        return model
    roles = lora_roles(cfg.targets, model.cfg.mlp, experts=bool(model.cfg.moe_experts))
    blocks = [(block, _projections(block)) for _, block in model.present_blocks()]
    have = {r for _, proj in blocks for r in proj}
    missing = [r for r in roles if r not in have]
    if missing and blocks and "all" not in (t.strip() for t in cfg.targets.split(",")):  # 'all': what there is
        raise ConfigError(f"lora.targets names {', '.join(missing)}, which this model's blocks do not have "
                          f"(they have {', '.join(sorted(have))}).")
    for p in model.parameters():
        p.requires_grad_(False)
    for block, proj in blocks:
        adapted = _adapt_block(block, proj, [r for r in roles if r in proj], cfg)
        if init:
            for role in (r for r in roles if r in proj):
                module = adapted[proj[role][0]]
                if not _on_meta(module):  # on meta: nothing to draw
                    module.reset_adapter(role)
    return model


def nf4_params(module: nn.Module) -> list[torch.Tensor]:
    """Every weight ``module`` holds as NF4 (QLoRA): each quantised projection's weight and each quantised
    experts' stack, in module order. On ``meta`` (the estimator) the weights that would be quantised."""
    out = []
    for m in module.modules():
        if isinstance(m, LoRALinear) and m.quantize == "nf4":
            out.append(m.weight)
        elif isinstance(m, LoRAExperts) and m.quantize == "nf4":
            out += [getattr(m, n) for n in m.NAMES]
    return out


def nf4_weights(module: nn.Module, weights: list[torch.Tensor] | None = None) -> list[tuple[int, int]]:
    """(elements, bytes per element of the dtype it dequantises to) of every weight ``module`` holds as NF4
    (:func:`nf4_params`, or ``weights`` when the caller has them already), in module order; on ``meta`` at the
    dtype they would dequantise to."""
    return [(w.numel(), w.dtype.itemsize) for w in (nf4_params(module) if weights is None else weights)]


def _on_meta(module: nn.Module) -> bool:
    return next(iter(module.parameters())).is_meta


def _adapt_block(block: nn.Module, proj: dict[str, tuple[str, int, int]], roles: list[str],
                 cfg: LoraConfig) -> dict[str, nn.Module]:
    """Replace the modules of ``block`` holding ``roles`` by their adapted forms; returns path -> module."""
    by_module: dict[str, dict[str, tuple[int, int]]] = {}
    for role in roles:
        path, start, rows = proj[role]
        by_module.setdefault(path, {})[role] = (start, rows)
    if cfg.quantize_base != "none":  # QLoRA: every projection's base quantised, adapted or not (module doc)
        for role, (path, _, _) in proj.items():
            if role != "experts":
                by_module.setdefault(path, {})
    adapted: dict[str, nn.Module] = {}
    for path, parts in by_module.items():
        parent, _, name = path.rpartition(".")
        holder = block.get_submodule(parent)
        base = getattr(holder, name)
        if isinstance(base, Experts):
            adapted[path] = LoRAExperts(base, cfg.rank, cfg.alpha, cfg.dropout, cfg.quantize_base)
        else:
            adapted[path] = LoRALinear(base, parts, cfg.rank, cfg.alpha, cfg.dropout, cfg.quantize_base)
        setattr(holder, name, adapted[path])
    return adapted


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` of ``model`` by a plain ``nn.Linear`` holding its merged weight
    (``W + (alpha / r) B A``) and bias, and every :class:`LoRAExperts` by plain :class:`Experts` (``W_e +
    (alpha / r) B_e A_e`` per expert); every parameter requires gradients again, as in a model built
    without LoRA. Returns ``model`` (changed in place)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRAExperts):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, module.merged())
            continue
        if not isinstance(module, LoRALinear):
            continue
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                          device="meta", dtype=module.weight.dtype)
        plain.weight = nn.Parameter(module.merged_weight())
        if module.bias is not None:
            plain.bias = nn.Parameter(module.bias.detach().clone())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, plain)
    for p in model.parameters():
        p.requires_grad_(True)
    return model
