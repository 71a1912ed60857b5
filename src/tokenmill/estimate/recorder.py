"""The recorder: every tensor storage a traced piece of code allocates and frees, and what each
operation costs.

:class:`Recorder` is a ``TorchDispatchMode``: it sees every ATen operation below autograd, forward and
backward (the recomputation of checkpointed blocks included). It records an event when an operation
returns a tensor on a new storage (``('a', sid, nbytes, label)``) and when a storage is no longer
referenced by anything, Python or autograd (``('f', sid)``, found through a weak reference to the
storage, checked before every operation). It also records each kernel's cost for the roofline
(:class:`OpCost`): FLOPs of matrix products (from the operand shapes), bytes read and written by the rest;
views cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# matrix products: FLOPs from the shapes; everything else is charged the bytes it reads and writes
_ATEN = torch.ops.aten
_FREE_OPS = {"detach", "alias", "lift_fresh", "_to_copy_meta", "_unsafe_view", "empty", "empty_like", "empty_strided", "new_empty",
             "new_empty_strided"}  # no kernel (an allocation is not a kernel: the recorder still counts its bytes held)


@dataclass
class OpCost:
    """One kernel: ``flops`` for a matrix product (``math``: its input dtype), else ``bytes`` moved."""

    name: str
    flops: float = 0.0
    bytes: float = 0.0
    math: Optional[str] = None  # 'fp32' | 'bf16' | 'fp16' for matrix products
    attention: bool = False  # a fused attention kernel (its own, lower, efficiency)
    min_dim: int = 0  # the smallest of a matrix product's M, N, K (small ones use tensor cores less well)
    aligned: bool = True  # every dimension a multiple of 8 (else tensor cores run slower kernels)
    launches: float = 1.0  # kernel launches (0: fused into the previous kernel by torch.compile)
    dims: tuple = ()  # a matrix product's (batch, M, K, N): its tiles and waves on the GPU's SMs
    attn: tuple = ()  # a fused attention's (batch x heads, sequence, head size): estimate/attention.py
    fused: bool = False  # one of Inductor's generated kernels (estimate/inductor.py), not an eager ATen kernel


# In-place ops that write their first input without reading it (a copy, a fill, a masked or indexed write, a
# random draw): its bytes count once. Every other in-place op (add_, mul_, exp_...) reads its input and writes it
# back, twice the bytes, as an out-of-place op reading and writing a tensor of that size.
OVERWRITES = frozenset({"copy_", "fill_", "zero_", "masked_fill_", "index_put_", "uniform_", "normal_", "bernoulli_",
                        "random_", "exponential_"})


def _dtype_name(dt: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, "fp32")


def _numel_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _matmul_flops(name: str, args: tuple, out: Any) -> float:
    """FLOPs of a matrix product from its operand shapes (2 per multiply-add)."""
    if name in ("mm", "addmm"):
        a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if name in ("bmm", "baddbmm"):
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
    return 0.0


def _attention_flops(name: str, args: tuple) -> float:
    """A causal fused attention: q@k^T and att@v over the lower triangle (half the T x T matrix);
    backward about 2.5 times forward (it recomputes the scores)."""
    q = args[0]
    B, H, T, D = q.shape[0], q.shape[1], q.shape[2], q.shape[3]
    fwd = 2 * 2.0 * B * H * T * T * D * 0.5
    return fwd * (2.5 if "backward" in name else 1.0)


def attention_shape(q: torch.Tensor) -> tuple[int, int, int]:
    """(batch x heads, sequence, head size) of a fused attention's query (B, H, T, D)."""
    return int(q.shape[0]) * int(q.shape[1]), int(q.shape[2]), int(q.shape[3])


# Ops that read only the rows (or elements) their index names, not the whole tensor they index: charged the
# bytes their kernels touch (ATen's CUDA kernels: embedding and index_select copy the indexed rows; gather one
# element per index; nll_loss_forward reads one log-probability per target, NLLLoss.cu; nll_loss_backward
# zero-fills its gradient (its full size written once) and scatters one value per target)
_GATHERS = {"embedding", "index_select", "gather", "nll_loss_forward", "nll_loss_backward"}


def _gather_bytes(name: str, args: list[torch.Tensor], outs: list[torch.Tensor]) -> int:
    """Bytes an indexing kernel moves: the indices, what it reads through them and what it writes."""
    written = sum(_numel_bytes(t) for t in outs)
    index = [t for t in args if not t.is_floating_point()]
    idx = sum(_numel_bytes(t) for t in index)
    n_idx = sum(t.numel() for t in index)
    src = next((t for t in args if t.is_floating_point() and t.dim() > 1), None)
    elem = src.element_size() if src is not None else 4
    if name.startswith("nll_loss"):  # one value per target read (forward) or scattered into the zeroed gradient
        return idx + n_idx * elem + written
    return idx + 2 * written  # the rows read equal the rows written


class Recorder(TorchDispatchMode):
    """Storage allocation/free events and per-op costs of everything dispatched while active.

    ``external``: storages allocated before recording (parameters, buffers) that are never reported.
    ``events``: ``('a', sid, nbytes, label)``, ``('f', sid)`` and ``('m', name)`` markers, in order.
    """

    def __init__(self, external: Optional[set[int]] = None):
        super().__init__()
        self.external = external or set()
        self.live: dict[int, tuple[StorageWeakRef, int, int]] = {}  # storage key -> (ref, sid, nbytes)
        self.events: list[tuple] = []
        self.costs: list[OpCost] = []
        self.sizes: dict[int, int] = {}
        self.n_ops = 0  # operations dispatched (views included)
        self._next = 0

    # storages -----------------------------------------------------------------------------
    def sweep(self) -> None:
        """Report every recorded storage that nothing references any more."""
        dead = [k for k, (ref, _, _) in self.live.items() if ref.expired()]
        for k in dead:
            self.events.append(("f", self.live.pop(k)[1]))

    def sid(self, t: torch.Tensor, label: str = "") -> Optional[int]:
        """The id of ``t``'s storage, recording a new allocation the first time it is seen."""
        st = t.untyped_storage()
        key = st._cdata
        if key in self.external:
            return None
        ent = self.live.get(key)
        if ent is not None:
            if not ent[0].expired():
                return ent[1]
            self.events.append(("f", self.live.pop(key)[1]))  # an address reused by a new storage
        nbytes = st.nbytes()
        if nbytes == 0:
            return None
        sid = self._next
        self._next += 1
        self.live[key] = (StorageWeakRef(st), sid, nbytes)
        self.sizes[sid] = nbytes
        self.events.append(("a", sid, nbytes, label))
        return sid

    def mark(self, name: str) -> None:
        self.sweep()
        self.events.append(("m", name))

    # dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.sweep()
        self.n_ops += 1
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.sid(t, name)
        self._cost(func, name, args, out)
        return out

    def _cost(self, func, name: str, args: tuple, out: Any) -> None:
        if func.is_view or name in _FREE_OPS or func.namespace == "prim":
            return
        tensors = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
        if name in ("mm", "addmm", "bmm", "baddbmm"):
            a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
            dims = (a.shape[-2], a.shape[-1], b.shape[-1])
            batch = int(a.shape[0]) if a.dim() == 3 else 1
            self.costs.append(OpCost(name, flops=_matmul_flops(name, args, out), math=_dtype_name(a.dtype),
                                     min_dim=int(min(dims)), aligned=all(d % 8 == 0 for d in dims),
                                     dims=(batch, *(int(d) for d in dims))))
            return
        if "scaled_dot_product" in name:
            self.costs.append(OpCost(name, flops=_attention_flops(name, args), math=_dtype_name(args[0].dtype),
                                     attention=True, attn=attention_shape(args[0])))
            return
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name in _GATHERS:
            self.costs.append(OpCost(name, bytes=float(_gather_bytes(name, tensors, outs))))
            return
        moved = sum(_numel_bytes(t) for t in tensors) + sum(_numel_bytes(t) for t in outs)
        if name in OVERWRITES and outs and tensors and outs[0] is tensors[0]:
            moved -= _numel_bytes(outs[0])  # writes its input without reading it: counted once
        self.costs.append(OpCost(name, bytes=float(moved)))
