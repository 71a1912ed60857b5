"""NF4 storage of frozen weights (QLoRA, ``lora.quantize_base = 'nf4'``): torchao's NF4 tensor (4-bit NormalFloat
codes, one absmax scale per block of :data:`NF4_BLOCK` weights, the scales quantised to int8 in groups of up to
:data:`NF4_SCALE_GROUP`), its size (:func:`nf4_bytes`, the estimator's term), the module base that keeps NF4
weights through casts and holds them exactly in plain-tensor state dicts (:class:`NF4Base`), and the product
with an NF4 weight (:func:`nf4_linear`). Used by :mod:`tokenmill.model.lora`; torchao is imported here only.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from tokenmill.config.lora import NF4_BLOCK, NF4_SCALE_GROUP, nf4_groups
from tokenmill.errors import ConfigError
from tokenmill.model.recompute import quiet_context_fn_note, recompute_all_but_products

__all__ = ["NF4_BLOCK", "NF4_SCALE_GROUP", "NF4Base", "is_nf4", "nf4_bytes", "nf4_dequantize", "nf4_groups",
           "nf4_linear", "nf4_parts", "nf4_product", "to_nf4", "torchao_quietly"]

quiet_context_fn_note()  # nf4_product's checkpoint under torch.compile

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


def nf4_parts(numel: int) -> tuple[int, ...]:
    """Bytes of each tensor an NF4 weight of ``numel`` elements is stored in (torchao's NF4 tensor holds them
    apart): the codes (half a byte a weight), an int8 scale per block, an fp32 factor per scale group, the
    mean and the 16-entry code table (fp32)."""
    blocks, group = nf4_groups(numel)
    return numel // 2, blocks, 4 * (blocks // group), 4, 16 * 4


def nf4_bytes(numel: int) -> int:
    """Bytes of an NF4 weight of ``numel`` elements as stored (:func:`nf4_parts`, together)."""
    return sum(nf4_parts(numel))


def to_nf4(w: torch.Tensor) -> torch.Tensor:
    """``w`` (a frozen 2-D weight) as torchao's NF4 tensor, in ``w``'s dtype; its size must be a multiple of
    :data:`NF4_BLOCK`."""
    if w.numel() % NF4_BLOCK:
        raise ConfigError(f"lora.quantize_base='nf4' quantises blocks of {NF4_BLOCK} weights, but a {tuple(w.shape)} "
                          f"projection has {w.numel()} (not a multiple of {NF4_BLOCK}); use --lora.quantize_base none "
                          "(plain LoRA over the unquantised base).")
    return _torchao_to_nf4()(w.detach().contiguous(), NF4_BLOCK, nf4_groups(w.numel())[1])


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP's sharded parameter) itself, not a view (what the load copies into), or
    ``t``."""
    return getattr(t, "_local_tensor", t)


def _sharded_entries(w: torch.Tensor, like) -> dict[str, torch.Tensor]:
    """The state-dict entries of the NF4 shard ``w`` of the sharded parameter ``like`` (a DTensor split by rows):
    codes, scales and factors as DTensors of ``like``'s mesh and placements (each rank's rows), the mean (one
    value for the whole weight, the same on every rank) as it is."""
    from torch.distributed.tensor import DTensor

    rows = like.shape[0] // w.shape[0]  # the shards
    parts = {"": _nf4_codes(w).detach(), _NF4_KEYS[0]: w.quantized_scalers.detach(),
             _NF4_KEYS[1]: w.quantization_factor.detach()}
    out = {k: DTensor.from_local(t, like.device_mesh, like.placements, run_check=False,
                                 shape=(t.shape[0] * rows, *t.shape[1:]), stride=t.stride())
           for k, t in parts.items()}
    return out | {_NF4_KEYS[2]: w.scaler_mean.detach()}


def _nf4_codes(w: torch.Tensor) -> torch.Tensor:
    """The 4-bit codes of an NF4 tensor, one uint8 per weight, in ``w``'s shape (torchao packs two
    consecutive codes per byte, the first in the high half)."""
    q = w.quantized_data
    return torch.stack([q >> 4, q & 15], dim=-1).reshape(w.shape)


def is_nf4(t: torch.Tensor) -> bool:
    """``t`` is torchao's NF4 tensor."""
    return hasattr(t, "quantized_data") and hasattr(t, "get_original_weight")


class NF4Base(nn.Module):
    """A module whose frozen base weights may be NF4 tensors (QLoRA): casts keep them (a cast would dequantise
    them) and move them to the adapters' device; state dicts hold them exactly in plain tensors (see the module
    doc: ``<name>`` the codes, in :meth:`_nf4_shape`, and ``<name>_nf4_scales`` / ``_factors`` / ``_mean``)."""

    def _nf4_names(self) -> list[str]:
        return [n for n, p in self._parameters.items() if p is not None and is_nf4(p)]

    def _nf4_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._parameters[name].shape)

    def _hide(self, names: list[str] | None = None) -> tuple[list[str], dict[str, nn.Parameter]]:
        """Take the NF4 weights (or ``names``) out of ``_parameters`` (put back by :meth:`_restore`, in their
        order)."""
        names = self._nf4_names() if names is None else names
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
        finally:  # where ``fn`` moves a floating-point tensor (a frozen projection may have no adapter to ask)
            w0 = next(iter(hidden.values()))
            device = fn(torch.empty(0, device=w0.device)).device
            self._restore(order, {n: w if w.device == device else nn.Parameter(w.to(device), requires_grad=False)
                                  for n, w in hidden.items()})
        return self

    def __getattr__(self, name: str):
        """``<weight>_nf4_scales`` / ``_factors`` / ``_mean``: the state-dict entries of an NF4 weight's scales
        (its local shard's under FSDP), as attributes: torch's distributed state dict (FSDP checkpoints) looks
        every key up on its module. Every parameter access of the module comes here (``nn.Module`` keeps them
        in ``_parameters``): one substring test for those."""
        if "_nf4_" not in name:
            return super().__getattr__(name)
        for key, attr in zip(_NF4_KEYS, ("quantized_scalers", "quantization_factor", "scaler_mean")):
            w = self.__dict__["_parameters"].get(name[: -len(key)]) if name.endswith(key) else None
            if w is not None and is_nf4(_local(w)):
                return getattr(_local(w), attr)
        return super().__getattr__(name)

    def _sharded_nf4_names(self) -> list[str]:
        """The NF4 weights FSDP has sharded: DTensors whose local shard is an NF4 tensor (``fully_shard`` splits
        codes, scales and factors by rows: torchao's ``fsdp_pre_all_gather`` gathers them back in 4 bits)."""
        return [n for n, p in self._parameters.items() if p is not None and is_nf4(_local(p)) and p is not _local(p)]

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        sharded = self._sharded_nf4_names()
        if sharded:  # FSDP: the same keys, as DTensors of the same layout (DCP saves each rank's rows)
            order, hidden = self._hide(sharded)
            try:
                self._save_to_state_dict(destination, prefix, keep_vars)
            finally:
                self._restore(order, hidden)
            for n, p in hidden.items():
                destination.update({prefix + n + k: v for k, v in _sharded_entries(_local(p), p).items()})
            return
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for n in self._nf4_names():  # plain tensors, exact: see the module doc
            w = self._parameters[n]
            destination[prefix + n] = _nf4_codes(w).reshape(self._nf4_shape(n))
            for key, t in zip(_NF4_KEYS, (w.quantized_scalers, w.quantization_factor, w.scaler_mean)):
                destination[prefix + n + key] = t if keep_vars else t.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = self._nf4_names() + self._sharded_nf4_names()
        if not names:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        saved = {n: {k: state_dict.pop(prefix + n + k) for k in ("", *_NF4_KEYS) if prefix + n + k in state_dict}
                 for n in names}
        order, hidden = self._hide(names)
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
        if w is not _local(w):  # sharded by FSDP: the saved parts are DTensors of the same layout (DCP's read)
            w, shape, saved = _local(w), tuple(_local(w).shape), {k: _local(t) for k, t in saved.items()}
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


def nf4_dequantize(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The NF4 tensor ``w`` as a plain tensor of ``dtype`` (default: ``w``'s), bit for bit torchao's
    ``get_original_weight`` (the same table values times the same block scales, in ``w``'s dtype) in three
    large kernels instead of torchao's eleven: each byte's two codes looked up at once in a 256-entry table of
    code pairs (its int32 index: one widening pass), then one multiply by the block scales. torchao widens
    each half-byte to an int64 index and looks up, scales and interleaves the halves apart; this moves about
    12.5 bytes a bf16 weight where torchao's moves 33 (``estimate/roofline.py`` nf4_dequant_costs)."""
    table = w.nf4  # the 16 NF4 values, in w's dtype
    pairs = torch.stack([table.repeat_interleave(16), table.repeat(16)], dim=-1)  # byte b -> (hi, lo) values
    scales = w.dequantize_scalers(w.quantized_scalers, w.quantization_factor, w.scaler_block_size)
    # at most the int32 codes (2 bytes a weight) beside the looked-up values: scaled in place, no third copy
    out = pairs.index_select(0, w.quantized_data.to(torch.int32)).view(-1, w.block_size)
    return out.mul_(scales.unsqueeze(-1)).view(w.shape).to(dtype or w.dtype)


class _NF4Linear(torch.autograd.Function):
    """``x W^T + b`` with ``W`` (NF4, frozen) dequantised by :func:`nf4_dequantize` to ``x``'s dtype in the
    forward and again in the backward: only the 4-bit weight is kept between them (torchao's ``LinearNF4``,
    with the faster dequantisation)."""

    @staticmethod
    def forward(ctx, x, w, bias):
        ctx.save_for_backward(w)
        ctx.bias_grad = bias is not None and bias.requires_grad
        return F.linear(x, nf4_dequantize(w, x.dtype), bias)

    @staticmethod
    def backward(ctx, gy):
        (w,) = ctx.saved_tensors
        gx = gy @ nf4_dequantize(w, gy.dtype)
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.bias_grad else None
        return gx, None, gb


def nf4_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` with ``W`` an NF4 tensor, dequantised to ``x``'s dtype for the product: eagerly by
    :class:`_NF4Linear`; compiled, through torchao's linear, whose dequantisation Inductor fuses into one
    kernel (see :func:`nf4_product`); so too under the estimator's graph capture, whose functional wrapper of
    the weight dispatches to torchao's NF4 tensor without showing its codes."""
    if torch.compiler.is_compiling() or not is_nf4(w):
        return nf4_product(F.linear, x, w, bias)
    return _NF4Linear.apply(x, w, bias)


def nf4_product(fn, *args):
    """``fn(*args)``, a product with an NF4 weight among ``args``. Eager, torchao's NF4 linear (and the experts'
    product in ``model/lora.py``) keep only the 4-bit weight for the backward and dequantise it again there.
    Under torch.compile AOTAutograd's partitioner would instead keep the forward's dequantised copy for the
    backward's product (its rule against recomputing an input a backward matmul reads): every projection's
    full-width weight held from forward to backward, QLoRA's saving gone. So a compiled product runs inside a
    non-reentrant checkpoint whose policy tags the dequantisation for recomputation (the product's output may
    be saved, as without it): the backward dequantises again, and the full-width weight is never kept."""
    if torch.compiler.is_compiling():
        return checkpoint(fn, *args, use_reentrant=False, context_fn=_recompute_all)
    return fn(*args)


def _recompute_all():
    return create_selective_checkpoint_contexts(recompute_all_but_products)
