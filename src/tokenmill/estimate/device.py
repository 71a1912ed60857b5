"""How a ``meta`` trace behaves like the device it predicts, where the CPU kernels and CUDA's differ in
memory (:class:`DeviceModel`, a ``TorchFunctionMode`` active while a piece is traced):

- dropout keeps a 1-byte mask on CUDA (``native_dropout``); off CUDA PyTorch keeps a scaled copy of
  the input (4 bytes per element in fp32);
- ``scaled_dot_product_attention`` runs a fused kernel on CUDA (flash / memory-efficient / cuDNN) that
  keeps only its output and a (B, H, T) fp32 log-sum-exp (with grouped-query attention only flash,
  for fp16/bf16: in fp32 CUDA falls back to the explicit math); the CPU uses its fused kernel only
  without dropout and otherwise the explicit math, which keeps the T x T attention matrix (asked of the CPU);
- autocast: the ``meta`` device has none, so its policy is applied here: CUDA's op lists
  (ATen/autocast_mode.h) for a GPU, CPU autocast's (read from the CPU on tiny tensors) for a CPU,
  with the cast cache for parameters that autocast keeps for the whole forward;
- ``memory.offload_activations`` (``tokenmill.model.offload``): saved tensors but the parameters leave the device
  during the forward and come back one node at a time in backward (a CPU run does not offload).
"""

from __future__ import annotations

import contextlib
import weakref
from functools import lru_cache
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tokenmill.model.offload import keeps, storages

_ATEN = torch.ops.aten

# CUDA autocast's op lists (ATen/autocast_mode.h) for the functions tokenmill's model calls
_CUDA_LOWER = ("linear", "matmul", "bmm", "mm", "addmm", "baddbmm", "scaled_dot_product_attention")
_CUDA_FP32 = ("layer_norm", "rms_norm", "pow", "rsqrt", "softmax", "log_softmax", "cross_entropy", "nll_loss", "sum",
              "exp", "log", "logsumexp")


def _fn_name(func) -> str:
    name = getattr(func, "__name__", "") or ""
    return {"__matmul__": "matmul", "__rmatmul__": "matmul", "__pow__": "pow"}.get(name, name)


@lru_cache(maxsize=4)
def cpu_autocast_policy(dtype: torch.dtype) -> tuple[frozenset, frozenset]:
    """(lower-precision, fp32) function names of CPU autocast, read from the CPU itself: each function
    runs once on tiny tensors under ``torch.autocast('cpu')``."""
    x32 = torch.ones(2, 4, 4)
    xlo = x32.to(dtype)
    w = torch.ones(4, 4)
    probes = {
        "linear": lambda x: F.linear(x, w.to(x.dtype)),
        "matmul": lambda x: x @ x,
        "bmm": lambda x: torch.bmm(x, x),
        "mm": lambda x: torch.mm(x[0], x[0]),
        "addmm": lambda x: torch.addmm(x[0], x[0], x[0]),
        "baddbmm": lambda x: torch.baddbmm(x, x, x),
        "scaled_dot_product_attention": lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None]),
        "layer_norm": lambda x: F.layer_norm(x, (4,)),
        "rms_norm": lambda x: F.rms_norm(x, (4,)),
        "pow": lambda x: x.pow(3),
        "rsqrt": lambda x: torch.rsqrt(x),
        "softmax": lambda x: F.softmax(x, -1),
        "log_softmax": lambda x: F.log_softmax(x, -1),
        "cross_entropy": lambda x: F.cross_entropy(x[0], torch.zeros(4, dtype=torch.long)),
        "nll_loss": lambda x: F.nll_loss(x[0], torch.zeros(4, dtype=torch.long)),
        "sum": lambda x: x.sum(),
        "exp": lambda x: x.exp(),
        "log": lambda x: x.log(),
        "logsumexp": lambda x: x.logsumexp(-1),
    }
    lower, fp32 = set(), set()
    with torch.autocast("cpu", dtype=dtype):
        for name, fn in probes.items():
            try:
                if fn(x32).dtype == dtype:
                    lower.add(name)
                elif fn(xlo).dtype == torch.float32:
                    fp32.add(name)
            except RuntimeError:
                continue
    return frozenset(lower), frozenset(fp32)


@lru_cache(maxsize=16)
def cpu_sdpa_is_fused(dtype: torch.dtype, dropout_p: float) -> bool:
    """Whether the CPU runs ``scaled_dot_product_attention`` (training, causal) with its fused flash
    kernel for this dtype and dropout (else the explicit math, which keeps the attention matrix):
    asked of the CPU itself, on tiny tensors."""
    seen: list[str] = []

    class _Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    q = torch.zeros(1, 2, 8, 16, dtype=dtype, requires_grad=True)
    with _Ops():
        F.scaled_dot_product_attention(q, q, q, dropout_p=dropout_p, is_causal=True)
    return any("flash" in n for n in seen)


def _cuda_fused(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether CUDA runs a fused attention kernel for these queries and keys: always with as many key/value
    heads as query heads (flash, memory-efficient or cuDNN); with grouped-query attention only flash
    attention takes the grouped keys and values (the memory-efficient kernel does not), which needs fp16 or
    bf16 and heads of at most 256, else PyTorch falls back to the math path (keys and values repeated per
    query head, the T x T attention matrix kept)."""
    if q.size(-3) == k.size(-3):
        return True
    return q.dtype in (torch.float16, torch.bfloat16) and q.size(-1) <= 256


class DeviceModel(TorchFunctionMode):
    """Make a ``meta`` trace behave as ``device`` ('cuda' or 'cpu') where memory differs (module doc).

    ``autocast``: None, torch.bfloat16 or torch.float16 (``train.precision`` \\*-autocast); active only
    inside :meth:`autocast_region`, as the trainer's autocast covers the forward only.
    """

    def __init__(self, device: str, autocast: Optional[torch.dtype] = None, sdpa_backend: str = "auto",
                 dropout: float = 0.0, offload_activations: bool = False):
        super().__init__()
        self.cuda = device == "cuda"
        self.offload = offload_activations and self.cuda  # a CPU run does not offload (train/device.py)
        self.packed: list[int] = []  # bytes of each tensor the offload put in host memory, in order
        # asked of the CPU now, outside any trace (a probe inside would be recorded)
        self._cpu_fused = {} if self.cuda else {
            dt: cpu_sdpa_is_fused(dt, dropout) for dt in (torch.float32, torch.bfloat16, torch.float16)}
        self.autocast = autocast
        self.sdpa_math = sdpa_backend == "math"
        self._active = False
        self._depth = 0
        self._in_backward = False
        self._cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        # FSDP's mixed precision hands the forward its parameters already in the compute dtype (gathered in
        # bf16): autocast's cast of one is then no copy; the gathered tensors, counted by the FSDP replay
        # (estimate/fsdp.py), stand in for them (gather_params)
        self._gathered: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.gathered_ids: set[int] = set()
        self._nf4: dict[int, torch.Tensor] = {}  # QLoRA: the weights the traced piece holds as NF4 (nf4_weights)
        self.nf4_seen: set[int] = set()  # those whose products ran through the NF4 product's memory (_NF4Product)
        if autocast is not None:
            self.lower, self.fp32 = ((frozenset(_CUDA_LOWER), frozenset(_CUDA_FP32)) if self.cuda
                                     else cpu_autocast_policy(autocast))

    @contextlib.contextmanager
    def autocast_region(self):
        """The trainer's ``with autocast(...)`` around the forward (re-entrant)."""
        self._depth += 1
        self._active = self.autocast is not None
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._active = False
                self._cache.clear()  # autocast empties its cast cache when the region ends

    def saved_on_host(self, model: nn.Module):
        """``memory.offload_activations`` (:class:`tokenmill.model.offload.ActivationOffload` around the forward):
        every tensor autograd saves but ``model``'s parameters and buffers (:func:`~tokenmill.model.offload.keeps`,
        the trainer's own choice) is copied to the host, so the device copy lives only as long as the forward
        needs it; backward brings each one back as a new device tensor while its node runs."""
        if not self.offload:
            return contextlib.nullcontext()
        kept = storages(model)

        def pack(t: torch.Tensor):
            if keeps(t, kept):
                return t
            self.packed.append(t.numel() * t.element_size())
            return tuple(t.shape), t.dtype

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            return torch.empty(packed[0], dtype=packed[1], device="meta")

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @contextlib.contextmanager
    def autocast_forward(self, module: nn.Module):
        """Run ``module``'s forward inside :meth:`autocast_region`, also when activation checkpointing
        recomputes it in backward (torch.utils.checkpoint restores the forward's autocast state)."""
        orig = module.forward

        def forward(*args, **kwargs):
            # in a recomputation this mode is off (it handed Tensor.backward over): put it back
            with self if self._in_backward else contextlib.nullcontext(), self.autocast_region():
                return orig(*args, **kwargs)

        module.forward = forward
        try:
            yield
        finally:
            del module.forward

    def gather_params(self, model: nn.Module, dtype: torch.dtype) -> None:
        """``parallel.fsdp_mixed_precision = 'bf16'``: the forward sees ``model``'s floating-point parameters in
        ``dtype`` (FSDP2's ``param_dtype``), so autocast's casts of them make nothing new: each cast is this
        tensor, made here before any recording, its storage in :attr:`gathered_ids` (what the recorders leave
        out, as they do the parameters)."""
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                t = p.to(dtype)  # in the autograd graph: the gradient still reaches the parameter
                self._gathered[id(p)] = (weakref.ref(p), t)
                self.gathered_ids.add(t.untyped_storage()._cdata)

    def nf4_weights(self, weights: list[torch.Tensor]) -> None:
        """QLoRA: ``weights`` (meta, at their width) are NF4 in the model (``model/lora.py nf4_params``): each
        product with one allocates what ``model/nf4.py`` ``_NF4Linear`` does around it (:class:`_NF4Product`)."""
        self._nf4 = {id(w): w for w in weights}
        self.nf4_seen = set()

    def _nf4_linear(self, args, kwargs) -> Optional[torch.Tensor]:
        """``F.linear`` with an NF4 weight under pure precision (the weight in the input's dtype): through
        :class:`_NF4Product`; None for any other product (autocast: the post-hoc transient, estimate/core.py)."""
        x, w = args[0], (args[1] if len(args) > 1 else kwargs.get("weight"))
        if w is None or self._nf4.get(id(w)) is not w or self._active or x.dtype != w.dtype:
            return None
        self.nf4_seen.add(id(w))
        return _NF4Product.apply(x, w, args[2] if len(args) > 2 else kwargs.get("bias"))

    def _cast(self, a: Any, dtype: torch.dtype, cache: bool) -> Any:
        if not isinstance(a, torch.Tensor) or not a.is_floating_point() or a.dtype == dtype:
            return a
        hit = self._gathered.get(id(a))
        if hit is not None and hit[0]() is a and hit[1].dtype == dtype:
            return hit[1]
        # autocast caches the casts of parameters: fp32 leaves that require grad and are not views (a view of
        # a parameter made under no_grad, as in the chunked loss, is a leaf too), keyed by the tensor through
        # a weak reference, as autocast's cache is (an id alone is reused once a short-lived tensor is gone)
        if cache and a.dtype == torch.float32 and a.is_leaf and a.requires_grad and not a._is_view():
            hit = self._cache.get(id(a))
            if hit is None or hit[0]() is not a:
                hit = self._cache[id(a)] = (weakref.ref(a), a.to(dtype))
            return hit[1]
        return a.to(dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _fn_name(func)
        if name == "backward":
            self._in_backward = True
            try:
                return func(*args, **kwargs)
            finally:
                self._in_backward = False
        if self.cuda and name == "dropout" and func is F.dropout:
            return self._dropout(*args, **kwargs)
        if name == "linear" and self._nf4:
            y = self._nf4_linear(args, kwargs)
            if y is not None:
                return y
        if name == "scaled_dot_product_attention" and not self.sdpa_math:
            if self._active and "scaled_dot_product_attention" in self.lower:
                args = tuple(self._cast(a, self.autocast, False) for a in args)
            fused = _cuda_fused(*args[:2]) if self.cuda else self._cpu_fused.get(args[0].dtype, False)
            if fused:
                return self._fused_attention(*args, **kwargs)
            return func(*args, **kwargs)
        if self._active:
            if name in self.lower:
                args = tuple(self._cast(a, self.autocast, True) for a in args)
                kwargs = {k: self._cast(v, self.autocast, True) for k, v in kwargs.items()}
            elif name in self.fp32:
                args = tuple(self._cast(a, torch.float32, False) for a in args)
        return func(*args, **kwargs)

    @staticmethod
    def _dropout(input, p=0.5, training=True, inplace=False):
        if not training or p <= 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]  # CUDA: a 1-byte mask is kept, not a scaled copy

    @staticmethod
    def _fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
        # memory of the CUDA flash / memory-efficient kernels: the output and a (B, H, T) fp32
        # log-sum-exp are kept for backward (plus, with dropout, the RNG seed and offset)
        return _ATEN._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)[0]


def _nf4_dequantized(w: torch.Tensor) -> torch.Tensor:
    """What ``model/nf4.py`` ``nf4_dequantize`` allocates for ``w``: the int32 index of each byte's pair (2 bytes a
    weight), freed once the table lookup made the values (a weight each, in ``w``'s dtype), which the product
    reads. Returns the values' stand-in (the caller frees it after the product)."""
    codes = torch.empty(2 * w.numel(), dtype=torch.uint8, device="meta")
    values = torch.empty(w.numel() * w.element_size(), dtype=torch.uint8, device="meta")
    del codes
    return values


class _NF4Product(torch.autograd.Function):
    """The memory of ``model/nf4.py`` ``_NF4Linear`` in a meta trace: the forward dequantises the weight (its
    transient around the product) and saves only the weight (here the meta parameter, no new storage); the
    backward dequantises again for the input's gradient. The products are the same as a plain linear's; the
    dequantisation's time is the roofline's (``nf4_dequant_costs``, from the piece's ``nf4_sizes``)."""

    @staticmethod
    def forward(ctx, x, w, bias):
        ctx.save_for_backward(w)
        ctx.bias_grad = bias is not None and bias.requires_grad
        held = _nf4_dequantized(w)
        y = F.linear(x, w, bias)
        del held
        return y

    @staticmethod
    def backward(ctx, gy):
        (w,) = ctx.saved_tensors
        held = _nf4_dequantized(w)
        gx = gy @ w
        del held
        gb = gy.reshape(-1, gy.shape[-1]).sum(0) if ctx.bias_grad else None
        return gx, None, gb
