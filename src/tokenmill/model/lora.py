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

QLoRA (``lora.quantize_base = 'nf4'``): the frozen ``W`` of every adapted projection is stored as torchao's
NF4 tensor (4-bit NormalFloat codes, one absmax scale per block of :data:`NF4_BLOCK` weights, the scales
themselves quantised to int8 in groups of up to :data:`NF4_SCALE_GROUP`), and torchao's NF4 linear
dequantises it to the input's dtype in the forward and again in the backward (only the 4-bit form is kept
between them). It keeps its dtype through the precision cast (the cast would dequantise it). A state dict
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

import contextlib
import logging
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import LoraConfig, lora_roles
from tokenmill.errors import ConfigError
from tokenmill.model.moe import Experts

__all__ = ["NF4_BLOCK", "NF4_SCALE_GROUP", "LoRAExperts", "LoRALinear", "apply_lora", "merge_lora", "nf4_bytes",
           "to_nf4"]

NF4_BLOCK = 64  # weights per absmax scale (QLoRA's block, torchao's default)
NF4_SCALE_GROUP = 256  # scales per double-quantisation group, at most (torchao's default)
_NF4_KEYS = ("_nf4_scales", "_nf4_factors", "_nf4_mean")  # after a weight's name; the name alone: the codes


@contextlib.contextmanager
def torchao_quietly():
    """Import torchao (and its modules) without the start-up lines a user cannot act on: "Failed to load
    ....so" for the optional CUDA kernels this build of torchao has for another Python or GPU (the paths
    tokenmill uses do not need them; torchao logs them at WARNING) and torch's deprecation note about the
    enums torchao registers. Logger levels and warnings filters for the duration only; errors still raise,
    and every other warning still shows. torchao is imported through this one helper."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            for category in (DeprecationWarning, FutureWarning):
                warnings.filterwarnings("ignore", category=category)
            import torchao  # noqa: F401  (its import is where the noise comes from)

            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _torchao_to_nf4():
    """torchao's ``to_nf4`` (its current home, then the older ``torchao.dtypes``), or a one-line error."""
    try:
        with torchao_quietly():
            from torchao.quantization import to_nf4 as convert
    except ImportError as e:
        first = e
        try:
            with torchao_quietly():
                from torchao.dtypes.nf4tensor import to_nf4 as convert
        except ImportError:
            raise ConfigError(f"lora.quantize_base='nf4' needs torchao's NF4 tensor, which could not be imported "
                              f"({first}): `pip install torchao`, or use --lora.quantize_base none (plain LoRA).") \
                from None
    return convert


def nf4_groups(numel: int) -> tuple[int, int]:
    """(blocks of :data:`NF4_BLOCK` weights, scales per double-quantisation group) of a weight of ``numel``
    elements: the group is the largest divisor of the block count up to :data:`NF4_SCALE_GROUP` that is a
    power of two (torchao needs the groups to tile the scales)."""
    return numel // NF4_BLOCK, math.gcd(numel // NF4_BLOCK, NF4_SCALE_GROUP)


def nf4_bytes(numel: int) -> int:
    """Bytes of an NF4 weight of ``numel`` elements as stored: half a byte per weight, an int8 scale per
    block, an fp32 factor per scale group (plus the mean and the 16-entry code table, in fp32)."""
    blocks, group = nf4_groups(numel)
    return numel // 2 + blocks + 4 * (blocks // group) + 4 + 16 * 4


def to_nf4(w: torch.Tensor) -> torch.Tensor:
    """``w`` (a frozen 2-D weight) as torchao's NF4 tensor, in ``w``'s dtype; its size must be a multiple of
    :data:`NF4_BLOCK`."""
    if w.numel() % NF4_BLOCK:
        raise ConfigError(f"lora.quantize_base='nf4' quantises blocks of {NF4_BLOCK} weights, but a {tuple(w.shape)} "
                          f"projection has {w.numel()} (not a multiple of {NF4_BLOCK}); use --lora.quantize_base none "
                          "or leave that projection out of lora.targets.")
    return _torchao_to_nf4()(w.detach().contiguous(), NF4_BLOCK, nf4_groups(w.numel())[1])


def _nf4_codes(w: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of an NF4 tensor, one uint8 per weight, in ``w``'s shape (torchao packs two
    consecutive codes per byte, the first in the high half)."""
    q = w.quantized_data
    return torch.stack([q >> 4, q & 15], dim=-1).reshape(w.shape)


def _is_nf4(t: torch.Tensor) -> bool:
    return hasattr(t, "quantized_data") and hasattr(t, "get_original_weight")


class _NF4Base(nn.Module):
    """A module whose frozen base weights may be NF4 tensors (QLoRA): casts keep them (a cast would dequantise
    them) and move them to the adapters' device; state dicts hold them exactly in plain tensors (see the module
    doc: ``<name>`` the codes, in :meth:`_nf4_shape`, and ``<name>_nf4_scales`` / ``_factors`` / ``_mean``)."""

    def _nf4_names(self) -> list[str]:
        return [n for n, p in self._parameters.items() if p is not None and _is_nf4(p)]

    def _nf4_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._parameters[name].shape)

    def _hide(self) -> tuple[list[str], dict[str, nn.Parameter]]:
        """Take the NF4 weights out of ``_parameters`` (put back by :meth:`_restore`, in their order)."""
        names = self._nf4_names()
        return list(self._parameters), {n: self._parameters.pop(n) for n in names}

    def _restore(self, order: list[str], hidden: dict[str, nn.Parameter]) -> None:
        rest = dict(self._parameters)
        self._parameters.clear()
        self._parameters.update({k: hidden[k] if k in hidden else rest[k] for k in order})

    def _apply(self, fn, recurse=True):
        if not self._nf4_names():
            return super()._apply(fn, recurse)
        order, hidden = self._hide()
        try:
            super()._apply(fn, recurse)
        finally:
            device = next(iter(self.lora_A.values())).device
            self._restore(order, {n: w if w.device == device else nn.Parameter(w.to(device), requires_grad=False)
                                  for n, w in hidden.items()})
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for n in self._nf4_names():  # plain tensors, exact: see the module doc
            w = self._parameters[n]
            destination[prefix + n] = _nf4_codes(w).reshape(self._nf4_shape(n))
            for key, t in zip(_NF4_KEYS, (w.quantized_scalers, w.quantization_factor, w.scaler_mean)):
                destination[prefix + n + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = self._nf4_names()
        if not names:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        saved = {n: {k: state_dict.pop(prefix + n + k) for k in ("", *_NF4_KEYS) if prefix + n + k in state_dict}
                 for n in names}
        order, hidden = self._hide()
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        finally:
            self._restore(order, hidden)
        for n in names:
            self._load_nf4(prefix + n, hidden[n], self._nf4_shape(n), saved[n], missing_keys, error_msgs)

    @torch.no_grad()
    def _load_nf4(self, key, w, shape, saved, missing_keys, error_msgs) -> None:
        """Into the NF4 weight ``w``: the saved codes and scales exactly, or a floating-point weight quantised."""
        if "" not in saved:
            missing_keys.append(key)
            return
        got = saved[""]
        if tuple(got.shape) != shape:
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(got.shape)}, the model "
                              f"has {shape}.")
            return
        if got.is_floating_point():  # a full-precision base: quantised here
            w.copy_(to_nf4(got.to(w.device, w.dtype).reshape(w.shape)))
            return
        missing = [key + k for k in _NF4_KEYS if k not in saved]
        if missing:
            missing_keys.extend(missing)
            return
        codes = got.reshape(-1).to(w.device, torch.uint8)
        parts = ((w.quantized_data, (codes[0::2] << 4) | codes[1::2]), (w.quantized_scalers, saved[_NF4_KEYS[0]]),
                 (w.quantization_factor, saved[_NF4_KEYS[1]]), (w.scaler_mean, saved[_NF4_KEYS[2]]))
        bad = [key + k for k, (mine, theirs) in zip(("", *_NF4_KEYS), parts) if mine.shape != theirs.shape]
        if bad:
            error_msgs.append(f"size mismatch for {', '.join(bad)} (NF4 codes and scales of another shape).")
            return
        for mine, theirs in parts:
            mine.copy_(theirs)


class LoRALinear(_NF4Base, nn.Linear):
    """A Linear (the frozen base's own ``weight`` and ``bias``) with adapters on row ranges of its output.

    ``parts``: role -> (first output row, rows); the rows of a role get ``(alpha / rank) B_role A_role
    dropout(x)`` added. The adapters start uninitialised: :func:`apply_lora` draws them (:meth:`reset_adapter`)
    or a checkpoint loads them."""

    def __init__(self, base: nn.Linear, parts: dict[str, tuple[int, int]], rank: int, alpha: float,
                 dropout: float = 0.0, quantize: str = "none"):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.register_parameter("weight", base.weight)
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
        y = F.linear(x, self.weight, self.bias)
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
        return w.get_original_weight() if _is_nf4(w) else w

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
        nf4 = ", base nf4" if _is_nf4(self.weight) else ""
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
        return _expert_mm(xs, w.get_original_weight().view(shape).to(xs.dtype), offs, e)

    @staticmethod
    def backward(ctx, gy):
        w = ctx.w.get_original_weight().view(ctx.shape).to(gy.dtype)
        gx = torch._grouped_mm(gy, w, offs=ctx.saved_tensors[0]) if ctx.grouped else gy @ w[ctx.e]
        return gx, None, None, None, None


class LoRAExperts(_NF4Base, Experts):
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
        self.rank, self.scale = rank, alpha / rank
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
        if _is_nf4(w):
            y = _NF4ExpertProduct.apply(xs, w, self.stacks[name], offs, e)
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
        base = w.get_original_weight().view(self.stacks[name]) if _is_nf4(w) else w
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
        for k in ("rank", "scale", "stacks"):
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


def _on_meta(module: nn.Module) -> bool:
    return next(iter(module.parameters())).is_meta


def _adapt_block(block: nn.Module, proj: dict[str, tuple[str, int, int]], roles: list[str],
                 cfg: LoraConfig) -> dict[str, nn.Module]:
    """Replace the modules of ``block`` holding ``roles`` by their adapted forms; returns path -> module."""
    by_module: dict[str, dict[str, tuple[int, int]]] = {}
    for role in roles:
        path, start, rows = proj[role]
        by_module.setdefault(path, {})[role] = (start, rows)
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
