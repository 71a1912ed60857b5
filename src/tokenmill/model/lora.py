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

__all__ = ["NF4_BLOCK", "NF4_SCALE_GROUP", "LoRALinear", "apply_lora", "merge_lora", "nf4_bytes", "to_nf4"]

NF4_BLOCK = 64  # weights per absmax scale (QLoRA's block, torchao's default)
NF4_SCALE_GROUP = 256  # scales per double-quantisation group, at most (torchao's default)
_NF4_KEYS = ("weight_nf4_scales", "weight_nf4_factors", "weight_nf4_mean")  # with ``weight``: the codes


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


class LoRALinear(nn.Linear):
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

    def _hide_weight(self) -> nn.Parameter:
        """Take the NF4 ``weight`` out of ``_parameters`` (put back by :meth:`_restore_weight`)."""
        self._order = list(self._parameters)
        return self._parameters.pop("weight")

    def _restore_weight(self, w: nn.Parameter) -> None:
        rest = dict(self._parameters)
        self._parameters.clear()
        self._parameters.update({k: w if k == "weight" else rest[k] for k in self._order})

    def _apply(self, fn, recurse=True):
        """Casts and moves (``model.to``): an NF4 base keeps its dtype (a cast would dequantise it) and
        follows the adapters to their device."""
        if not _is_nf4(self.weight):
            return super()._apply(fn, recurse)
        w = self._hide_weight()
        try:
            super()._apply(fn, recurse)
        finally:
            device = next(iter(self.lora_A.values())).device
            self._restore_weight(w if w.device == device else nn.Parameter(w.to(device), requires_grad=False))
        return self

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        w = self.weight
        if _is_nf4(w):  # plain tensors, exact: see the module doc
            destination[prefix + "weight"] = _nf4_codes(w)
            for key, t in zip(_NF4_KEYS, (w.quantized_scalers, w.quantization_factor, w.scaler_mean)):
                destination[prefix + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if not _is_nf4(self.weight):
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        saved = {k: state_dict.pop(prefix + k) for k in ("weight", *_NF4_KEYS) if prefix + k in state_dict}
        w = self._hide_weight()
        try:
            super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                          unexpected_keys, error_msgs)
        finally:
            self._restore_weight(w)
        if "weight" not in saved:
            missing_keys.append(prefix + "weight")
        elif saved["weight"].shape != w.shape:
            error_msgs.append(f"size mismatch for {prefix}weight: copying a param with shape "
                              f"{tuple(saved['weight'].shape)}, the model has {tuple(w.shape)}.")
        elif saved["weight"].is_floating_point():  # a full-precision base: quantised here
            with torch.no_grad():
                w.copy_(to_nf4(saved["weight"].to(w.device, w.dtype)))
        else:
            self._load_nf4(w, saved, prefix, missing_keys, error_msgs)

    @torch.no_grad()
    def _load_nf4(self, w, saved, prefix, missing_keys, error_msgs) -> None:
        """Copy the codes and scales of a state dict into the NF4 weight ``w``, exactly."""
        missing = [prefix + k for k in _NF4_KEYS if k not in saved]
        if missing:
            missing_keys.extend(missing)
            return
        codes = saved["weight"].reshape(-1).to(w.device, torch.uint8)
        parts = ((w.quantized_data, (codes[0::2] << 4) | codes[1::2]), (w.quantized_scalers, saved[_NF4_KEYS[0]]),
                 (w.quantization_factor, saved[_NF4_KEYS[1]]), (w.scaler_mean, saved[_NF4_KEYS[2]]))
        bad = [f"{prefix}{k}" for k, (mine, theirs) in zip(("weight", *_NF4_KEYS), parts) if mine.shape != theirs.shape]
        if bad:
            error_msgs.append(f"size mismatch for {', '.join(bad)} (NF4 codes and scales of another shape).")
            return
        for mine, theirs in parts:
            mine.copy_(theirs)


def apply_lora(model: nn.Module, cfg: LoraConfig, init: bool = True) -> nn.Module:
    """``lora.rank > 0``: freeze every parameter of ``model`` (a GPT, before any wrapper), then give the
    projections ``lora.targets`` names in every block it holds an adapter (see the module doc). ``init``:
    draw the adapters (in block order, then role order: the same draws for fused and separate q/k/v); False
    leaves them to be loaded. Returns ``model``."""
    if cfg.rank == 0:
        return model
    roles = lora_roles(cfg.targets, model.cfg.mlp)
    for p in model.parameters():
        p.requires_grad_(False)
    for _, block in model.present_blocks():
        proj = block.projections()
        missing = [r for r in roles if r not in proj]
        if missing:
            raise ConfigError(f"lora.targets names {', '.join(missing)}, which this model's blocks do not have "
                              f"(they have {', '.join(proj)}).")
        by_module: dict[str, dict[str, tuple[int, int]]] = {}
        for role in roles:
            path, start, rows = proj[role]
            by_module.setdefault(path, {})[role] = (start, rows)
        adapted = {}
        for path, parts in by_module.items():
            parent, _, name = path.rpartition(".")
            holder = block.get_submodule(parent)
            adapted[path] = LoRALinear(getattr(holder, name), parts, cfg.rank, cfg.alpha, cfg.dropout,
                                       cfg.quantize_base)
            setattr(holder, name, adapted[path])
        if init and not next(iter(adapted.values())).weight.is_meta:  # on meta: nothing to draw
            for role in roles:
                adapted[proj[role][0]].reset_adapter(role)
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` of ``model`` by a plain ``nn.Linear`` holding its merged weight
    (``W + (alpha / r) B A``) and bias; every parameter requires gradients again, as in a model built
    without LoRA. Returns ``model`` (changed in place)."""
    for name, module in list(model.named_modules()):
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
