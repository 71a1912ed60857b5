"""What Inductor keeps of an AOT-partitioned graph: which nodes become buffers, when each is freed, and
which kernels run (:func:`plan_graph`).

``torch.compile`` hands Inductor two FX graphs of ATen ops per compiled region, the forward and the
backward that AOTAutograd's min-cut partitioner made (:mod:`.compiled` captures them on fake tensors).
Inductor does not run them op by op: it *inlines* element-wise ops into the kernel of their consumer, so
an intermediate becomes a buffer ("is realised") only where the lowering needs one. The rules below are
those of ``torch/_inductor/graph.py`` (``GraphLowering.run_node``) and ``ir.py`` (``StorageBox``), read
from the PyTorch source, with the thresholds read from ``torch._inductor.config`` at run time:

- matrix products, attention kernels and every op Inductor falls back to (*extern* kernels) write their
  outputs to buffers, and their inputs must be buffers (``ExternKernel.realize_input``);
- reductions (``sum``, ``amax``, ``var_mean``, ...) and scatters (``index_put`` with accumulation, the
  embedding's backward) write buffers; a scatter into a constant (the one-hot of the cross-entropy's
  backward) is element-wise (``optimize_scatter_upon_const_tensor``);
- graph outputs are buffers (the forward's outputs are what backward saves);
- an element-wise result used more than once is stored rather than recomputed when its expression reads
  more than ``realize_reads_threshold`` buffers or has more than ``realize_opcount_threshold`` ops (on a
  CPU also when it uses exp/log/tanh/sigmoid), and any expression reading more than
  ``realize_acc_reads_threshold`` buffers is stored (``StorageBox.should_realize_on_reuse``,
  ``has_exceeded_max_reads``), as is one of more than ``LARGE_INNER_FN`` ops (``has_large_inner_fn``);
- views are free; everything else is inlined into the kernel that consumes it.

A buffer is freed after the last kernel that reads it (Inductor's generated code drops each buffer after
its last use, and the backward receives its saved tensors as boxed arguments it may free). A fused kernel
whose input dies there and has the output's dtype and size writes its output in place of that input
(``config.inplace_buffers``), when that input may be reused: a buffer of the graph, or in backward a
saved tensor the forward made (not a forward output, not an input of the forward).

Kernels for the roofline: a matrix product's FLOPs; a fused kernel moves the bytes of the buffers it
reads and writes. Consecutive fused kernels over the same number of elements that feed each other count
as one launch (Inductor's vertical fusion).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from tokenmill.estimate.recorder import OpCost, _attention_flops, _dtype_name, attention_shape

_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var_mean", "var", "std", "prod", "any", "all",
               "argmax", "argmin", "logsumexp", "cumsum", "cumprod", "norm", "linalg_vector_norm"}
_SCATTERS = {"index_put", "_unsafe_index_put", "scatter", "scatter_add", "scatter_reduce", "index_add",
             "index_copy", "index_reduce", "embedding_dense_backward"}
_CONSTANTS = {"full", "zeros", "ones", "scalar_tensor", "iota", "arange", "full_like", "zeros_like", "ones_like"}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
_VIEW_LISTS = {"split", "split_with_sizes", "unbind", "chunk", "tensor_split"}
_HEAVY = {"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"}
# The longest row Inductor reduces in one persistent kernel when the reduction runs over the innermost dimensions
# (torch/_inductor/choices.py, InductorChoices.should_use_persistent_reduction: {ReductionHint.INNER: 1024}; the
# same in torch 2.11 and 2.13, estimate/torch_rules.py). A longer row, or another reduction shape, loops.
PERSISTENT_INNER = 1024
# A pointwise expression with a single user is stored rather than inlined only past this many ops
# (torch/_inductor/graph.py GraphLowering.run_node: "Realize if a Pointwise has too much stuff to be inlined",
# has_large_inner_fn(threshold=100), the larger of 100 and realize_opcount_threshold); the lower
# realize_opcount_threshold applies to an expression used more than once (StorageBox.should_realize_on_reuse).
LARGE_INNER_FN = 100
# On a GPU (Triton), Inductor's post-grad pass turns amax(x) followed by sum(exp(x - amax)) over the same rows into
# one reduction that reads x once (torch/_inductor/fx_passes/post_grad.py prepare_softmax_online, behind
# config.online_softmax, on by default in torch 2.11 and 2.13).
ONLINE_SOFTMAX = True


def thresholds(cpu: bool) -> dict[str, int]:
    """Inductor's realisation thresholds (``torch._inductor.config``) for a CPU or a GPU graph."""
    try:
        from torch._inductor import config as ic
    except ImportError:  # pragma: no cover - every PyTorch with torch.compile has it
        return {"reads": 4, "opcount": 50 if cpu else 30, "acc_reads": 12 if cpu else 8}

    def pick(name: str, cpu_name: str, default_name: str, fallback: int) -> int:
        v = getattr(ic, name, None)
        if v is None:
            v = getattr(ic, cpu_name if cpu else default_name, fallback)
        return int(v)

    return {"reads": int(getattr(ic, "realize_reads_threshold", 4)),
            "opcount": pick("realize_opcount_threshold", "realize_cpu_opcount_threshold",
                            "_realize_opcount_threshold_default", 50 if cpu else 30),
            "acc_reads": pick("realize_acc_reads_threshold", "realize_cpu_acc_reads_threshold",
                              "_realize_acc_reads_threshold_default", 12 if cpu else 8)}


def _name(node) -> str:
    t = node.target
    return getattr(getattr(t, "overloadpacket", None), "__name__", None) or getattr(t, "__name__", str(t))


def _val(node) -> Optional[torch.Tensor]:
    v = node.meta.get("val") if hasattr(node, "meta") else None
    return v if isinstance(v, torch.Tensor) else None


def _nbytes(v: torch.Tensor) -> int:
    try:
        return int(v.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return v.numel() * v.element_size()


@dataclass
class Kernel:
    """One kernel of a graph: an extern call (``cost`` with FLOPs, or bytes for other fallbacks) or a fused
    element-wise/reduction kernel (``cost`` with bytes); ``launches`` is 0 when it fuses into the previous."""

    cost: OpCost
    launches: int = 1


@dataclass
class GraphPlan:
    """The memory events and kernels of one graph. ``events``: ``('a', buffer, nbytes)`` and ``('f', buffer)``
    in order, buffers named by FX node (a placeholder's name for an input); ``outputs``: the buffer or
    placeholder each graph output lives in (None for a non-tensor)."""

    events: list[tuple] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    outputs: list[Optional[str]] = field(default_factory=list)
    placeholders: list[str] = field(default_factory=list)


class _Graph:
    """The realisation analysis of one FX graph (module doc)."""

    def __init__(self, gm, cpu: bool, freeable_inputs: set[str], reusable_inputs: set[str],
                 pad_balance: Optional[float] = None):
        self.pad_balance = None if cpu else pad_balance
        self.nodes = list(gm.graph.nodes)
        self.th = thresholds(cpu)
        self.cpu = cpu
        self.freeable_inputs, self.reusable_inputs = freeable_inputs, reusable_inputs
        self.kind: dict[str, str] = {}
        self.base: dict[str, str] = {}  # a view's node -> the node whose buffer it views
        self.reads: dict[str, frozenset] = {}  # an inlined expression's buffers
        self.ops: dict[str, int] = {}
        self.heavy: dict[str, bool] = {}
        self.realised: list[str] = []  # in the order they run
        self.is_buf: set[str] = set()
        self.by_name = {n.name: n for n in self.nodes}
        self.loaded: dict[str, set[str]] = {}  # the buffers each kernel reads from a reduction's registers: _held

    # classification -----------------------------------------------------------------------------
    def classify(self, n) -> str:
        if n.op == "placeholder":
            return "input"
        if n.op != "call_function":
            return "other"
        name = _name(n)
        if n.target is operator.getitem:
            src = n.args[0]
            return "view" if self.kind.get(src.name) in ("view", "input") else "item"
        if name in _VIEW_LISTS or name in ("alias", "_unsafe_view", "view", "reshape", "lift_fresh"):
            return "view"
        if getattr(n.target, "is_view", False):
            return "view"
        if name in _MATMULS or "scaled_dot_product" in name or "attention" in name or "convolution" in name:
            return "extern"
        if name in _REDUCTIONS:
            return "reduction"
        if name in _SCATTERS:
            if name.startswith("scatter") and n.args and self.kind.get(n.args[0].name) == "constant":
                return "pointwise"  # one-hot into a constant: element-wise (optimize_scatter_upon_const_tensor)
            return "scatter"
        if name in _CONSTANTS:
            return "constant"
        if name in ("cat",):
            return "reduction"  # a buffer the inputs are written into
        ns = getattr(n.target, "namespace", "aten")
        if ns not in ("aten", "prims") or isinstance(n.meta.get("val"), (tuple, list)):
            return "extern"
        return "pointwise"

    def resolve(self, node) -> str:
        """The node whose buffer (or inlined expression) ``node`` stands for."""
        name = node.name
        while name in self.base:
            name = self.base[name]
        return name

    # realisation ---------------------------------------------------------------------------------
    def realise(self, name: str) -> None:
        if name in self.is_buf or self.kind.get(name) in ("input", "view", "item"):
            return
        self.is_buf.add(name)
        self.realised.append(name)

    def _tensor_inputs(self, n) -> list:
        out = []
        for a in n.all_input_nodes:
            if _val(a) is not None or self.kind.get(a.name) in ("view", "item"):
                out.append(a)
        return out

    def _expr(self, n) -> None:
        """Reads, op count and heaviness of ``n``'s expression when inlined."""
        reads: set = set()
        ops, heavy = 1, _name(n) in _HEAVY
        for a in self._tensor_inputs(n):
            b = self.resolve(a)
            if b in self.is_buf or self.kind.get(b) in ("input", "item", "extern", "reduction", "scatter"):
                reads.add(b)
            else:
                reads |= self.reads.get(b, frozenset())
                ops += self.ops.get(b, 0)
                heavy = heavy or self.heavy.get(b, False)
        self.reads[n.name], self.ops[n.name], self.heavy[n.name] = frozenset(reads), ops, heavy

    def analyse(self) -> None:
        for n in self.nodes:
            k = self.kind[n.name] = self.classify(n)
            if k == "view":
                self.base[n.name] = n.args[0].name if n.args and hasattr(n.args[0], "name") else n.name
                if self.base[n.name] == n.name:
                    del self.base[n.name]
                continue
            if k in ("input", "other", "item"):  # an item: one output of a multi-output kernel, its own buffer
                continue
            if k == "extern":
                for a in self._tensor_inputs(n):
                    self.realise(self.resolve(a))
            self._expr(n)
            if k in ("extern", "reduction", "scatter"):
                self.realise(n.name)
                continue
            users = len(n.users)
            big = self.ops[n.name] > self.th["opcount"]
            if users > 1 and any(u.op == "output" for u in n.users):
                self.realise(n.name)
            elif users > 1 and (big or len(self.reads[n.name]) > self.th["reads"] or (self.cpu and self.heavy[n.name])):
                self.realise(n.name)
            elif k == "pointwise" and (len(self.reads[n.name]) > self.th["acc_reads"]
                                       or self.ops[n.name] > max(LARGE_INNER_FN, self.th["opcount"])):
                self.realise(n.name)
        out = next(n for n in self.nodes if n.op == "output")
        for a in out.all_input_nodes:
            self.realise(self.resolve(a))

    # the run ------------------------------------------------------------------------------------
    def outputs_of(self, name: str) -> list[str]:
        """The buffers a realised node writes: its own, or those of its items (a multi-output kernel)."""
        n = self.by_name[name]
        if isinstance(n.meta.get("val"), (tuple, list)):
            return [u.name for u in n.users if u.target is operator.getitem and _val(u) is not None]
        return [name]

    def run_reads(self, name: str) -> set[str]:
        n = self.by_name[name]
        if self.kind[name] == "extern":
            return {self.resolve(a) for a in self._tensor_inputs(n)}
        return set(self.reads[name])

    def size(self, buf: str) -> int:
        v = _val(self.by_name[buf])
        return _nbytes(v) if v is not None else 0

    def _is_input(self, b: str) -> bool:
        return self.kind.get(b) == "input"

    def plan(self) -> GraphPlan:
        self.analyse()
        out = next(n for n in self.nodes if n.op == "output")
        outs = [self.resolve(a) if hasattr(a, "name") else None for a in _flat(out.args[0])]
        keep = {b for b in outs if b is not None}
        reads = {r: self.run_reads(r) for r in self.realised}
        last: dict[str, int] = {}
        for i, r in enumerate(self.realised):
            for b in reads[r]:
                last[b] = i
        plan = GraphPlan(outputs=outs,
                         placeholders=[n.name for n in self.nodes if n.op == "placeholder"])
        ev = plan.events
        for p in plan.placeholders:  # a saved tensor backward never reads
            if p in self.freeable_inputs and p not in last and p not in keep:
                ev.append(("f", p))
        group_numel, group_outs, reduced = -1, set(), set()
        held: dict[str, tuple[int, frozenset, bool]] = {}  # reductions' results holding rows: _held
        gid, group_of, kernel_of = -1, [], []  # each realised node's fused kernel and its entry in plan.kernels
        for i, r in enumerate(self.realised):
            made = self.outputs_of(r)
            dying = [b for b in sorted(reads[r]) if last.get(b) == i and b not in keep and self._freeable(b)]
            fused = self.kind[r] != "extern"
            if fused and len(made) == 1:
                spot = next((b for b in dying if self._reusable(b) and self._same(b, made[0])), None)
                if spot is not None:  # written in place of an input that dies here
                    ev.append(("f", spot))
                    dying.remove(spot)
            pad = None if fused else self._padding(r)
            for j, nbytes in enumerate(pad[0] if pad else []):  # padded copies of the operands
                ev.append(("a", f"{r}#pad{j}", nbytes))
                plan.kernels.append(Kernel(OpCost("constant_pad_nd", bytes=2.0 * nbytes)))
            for o in made:
                ev.append(("a", o, pad[1] if pad else self.size(o)))
            for j, _ in enumerate(pad[0] if pad else []):
                ev.append(("f", f"{r}#pad{j}"))
            for b in dying:
                ev.append(("f", b))
            for o in made:
                if o not in last and o not in keep:
                    ev.append(("f", o))
            cost, numel = self._cost(r, made, reads[r], pad[2] if pad else None)
            # vertical fusion: a kernel over the group's elements, or over a reduction's outputs (an epilogue such
            # as a norm's rsqrt), that reads what the group wrote runs in the group's kernel
            epilogue = fused and numel in reduced and numel != group_numel
            joins = fused and (numel == group_numel or epilogue) and bool(reads[r] & group_outs)
            if fused:
                cost = self._held(r, made, reads[r], numel, cost, held)
            gid += 0 if joins else 1
            group_of.append(gid)
            kernel_of.append(len(plan.kernels))
            plan.kernels.append(Kernel(cost, 0 if joins else 1))
            if fused:
                if not joins:
                    group_outs, group_numel, reduced = set(), numel, set()
                group_outs |= set(made)
                if self.kind[r] == "reduction":
                    reduced |= {self._numel(o) for o in made}
            else:
                group_numel, group_outs, reduced = -1, set(), set()
        self._drop_local(plan, group_of, kernel_of, reads, keep)
        return plan

    def _drop_local(self, plan: GraphPlan, group_of: list[int], kernel_of: list[int], reads: dict[str, set],
                    keep: set[str]) -> None:
        """Inductor never stores a buffer whose every reader is fused into the kernel that writes it
        (``codegen/common.py`` ``remove_kernel_local_buffers``): on a GPU, a fused buffer read only within its own
        group of fused kernels, in a group whose reductions are persistent (no second loop that would need it
        again), costs neither its write nor its reads, and is never allocated."""
        if self.cpu:
            return
        unsafe = {group_of[i] for i, r in enumerate(self.realised)
                  if self.kind[r] == "reduction" and not self._persistent(r)}
        readers_of: dict[str, list[int]] = {}
        for j, q in enumerate(self.realised):
            for b in reads[q]:
                readers_of.setdefault(b, []).append(j)
        local: set[str] = set()
        for i, r in enumerate(self.realised):
            if self.kind[r] == "extern" or group_of[i] in unsafe:
                continue
            for b in self.outputs_of(r):
                readers = readers_of.get(b, [])
                if b in keep or not readers or any(group_of[j] != group_of[i] for j in readers):
                    continue
                local.add(b)
                for j in [i] + [j for j in readers if b not in self.loaded.get(self.realised[j], ())]:
                    k = plan.kernels[kernel_of[j]]
                    k.cost = replace(k.cost, bytes=k.cost.bytes - self.size(b))
        plan.events[:] = [e for e in plan.events if e[1] not in local]

    def _held(self, r: str, made: list[str], reads: set[str], numel: int, cost: OpCost,
              held: dict[str, tuple[int, frozenset, bool]]) -> OpCost:
        """``cost`` less the buffers a reduction this kernel fuses with has already loaded. Inductor's scheduler
        fuses a kernel over a reduction's rows (same element count) that reads its result into that reduction's
        kernel, wherever the graph lists it. The buffers both read are loaded once when the reduction is
        *persistent* (its rows held in registers: :meth:`_persistent`); and on a GPU the sum of
        ``exp(x - amax(x))`` reads ``x`` in the same loop as its ``amax`` however long the row
        (``config.online_softmax``: the post-grad pass ``prepare_softmax_online``, Triton only), though the
        element-wise work after a looped row reads it again. ``held`` maps each such result (the reduction's, and an
        epilogue's over it such as a norm's rsqrt) to (the rows' element count, the buffers loaded, persistent);
        updated here."""
        over = [held[b] for b in reads if b in held]
        is_sum = _name(self.by_name[r]) == "sum"
        if over and self.kind[r] != "reduction" and all(n != numel for n, _, _ in over):
            for o in made:  # an epilogue over the reduction's results: it stands for them
                held[o] = over[0]
            return cost
        loaded = set().union(*(got for n, got, kept in over if n == numel and (kept or is_sum))) & reads
        self.loaded[r] = loaded
        persistent = self._persistent(r)
        if persistent or (_name(self.by_name[r]) == "amax" and not self.cpu and ONLINE_SOFTMAX):
            for o in made:
                held[o] = (numel, frozenset(reads), persistent)
        if loaded:
            return replace(cost, bytes=cost.bytes - sum(self.size(b) for b in loaded))
        return cost

    def _numel(self, buf: str) -> int:
        v = _val(self.by_name[buf])
        return v.numel() if v is not None else -1

    def _persistent(self, r: str) -> bool:
        """Whether Inductor generates the reduction ``r`` of a GPU graph as a *persistent* reduction: over the innermost
        dimensions of its input, at most ``PERSISTENT_INNER`` elements a row (``choices.py``
        ``should_use_persistent_reduction``, ReductionHint.INNER). Such a kernel loads a whole row once and keeps
        it in registers, so the element-wise work fused after it in the same kernel (a norm's normalisation, a
        softmax's division) reads those inputs again from registers, not from memory; a longer row loops over
        memory again (a second pass the plan's next kernel already counts)."""
        n = self.by_name[r]
        if self.cpu or self.kind[r] != "reduction" or _name(n) not in _REDUCTIONS or not n.args:
            return False  # a CPU graph's C++ kernels loop over a row once per pass
        x = _val(n.args[0]) if hasattr(n.args[0], "name") else None
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        if x is None or x.dim() == 0 or not isinstance(dims, (list, tuple)) or not dims:
            return False
        reduced = sorted(int(d) % x.dim() for d in dims)
        inner = reduced == list(range(x.dim() - len(reduced), x.dim()))
        rnumel = 1
        for d in reduced:
            rnumel *= int(x.shape[d])
        return inner and rnumel <= PERSISTENT_INNER

    def _freeable(self, b: str) -> bool:
        return not self._is_input(b) or b in self.freeable_inputs

    def _reusable(self, b: str) -> bool:
        return not self._is_input(b) or b in self.reusable_inputs

    def _same(self, a: str, b: str) -> bool:
        va, vb = _val(self.by_name[a]), _val(self.by_name[b])
        return va is not None and vb is not None and va.dtype == vb.dtype and _nbytes(va) == _nbytes(vb)

    def _mm_operands(self, r: str) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        n = self.by_name[r]
        ins = [v for v in (_val(a) for a in self._tensor_inputs(n)) if v is not None]
        if _name(n) not in _MATMULS or len(ins) < 2:
            return None
        return (ins[0], ins[1]) if _name(n) in ("mm", "bmm") else (ins[-2], ins[-1])

    def _padding(self, r: str) -> Optional[tuple[list[int], int, tuple]]:
        """Inductor's ``pad_mm`` pass on a GPU (``config.shape_padding``, fx_passes/pad_mm.py): a matrix product
        with a dimension that is not a multiple of 8 (fp16/bf16) or 4 (fp32) and that is compute bound
        (arithmetic intensity ``MNK / (MK + KN + MN)`` over half the GPU's FLOP/byte balance) gets zero-padded
        copies of its operands and a padded output it slices (Inductor keeps the padding when its benchmark
        finds it faster, as it is for tensor cores on misaligned shapes). Returns (bytes of each padded
        operand, bytes of the padded output, (batch, M, K, N) padded) or None."""
        ops = self._mm_operands(r) if self.pad_balance else None
        if ops is None:
            return None
        a, b = ops
        align = {torch.bfloat16: 8, torch.float16: 8, torch.float32: 4}.get(a.dtype, 0)
        if not align:
            return None
        batch = a.shape[0] if a.dim() == 3 else 1
        m, k, n = int(a.shape[-2]), int(a.shape[-1]), int(b.shape[-1])
        pm, pk, pn = (-(-d // align) * align for d in (m, k, n))
        # is_mm_compute_bound: intensity over half the machine balance (the 0.5 is pad_mm.py's own)
        if (pm, pk, pn) == (m, k, n) or m * n * k <= 0.5 * self.pad_balance * (m * k + k * n + m * n):
            return None
        size = a.element_size()
        pads = ([batch * pm * pk * size] if (pm, pk) != (m, k) else []) + \
               ([batch * pk * pn * size] if (pk, pn) != (k, n) else [])
        return pads, batch * pm * pn * size, (batch, pm, pk, pn)

    def _cost(self, r: str, made: list[str], reads: set[str], padded: Optional[tuple] = None
              ) -> tuple[OpCost, int]:
        n = self.by_name[r]
        name = _name(n)
        ins = [_val(a) for a in self._tensor_inputs(n)]
        ins = [v for v in ins if v is not None]
        if padded is not None:
            batch, m, k, nn = padded
            a = self._mm_operands(r)[0]
            return OpCost(name, flops=2.0 * batch * m * k * nn, math=_dtype_name(a.dtype), min_dim=min(m, k, nn),
                          dims=(batch, m, k, nn)), -1
        if name in _MATMULS and len(ins) >= 2:
            a, b = (ins[0], ins[1]) if name in ("mm", "bmm") else (ins[1], ins[2])
            batch = a.shape[0] if a.dim() == 3 else 1
            dims = (a.shape[-2], a.shape[-1], b.shape[-1])
            flops = 2.0 * batch * dims[0] * dims[1] * dims[2]
            return OpCost(name, flops=flops, math=_dtype_name(a.dtype), min_dim=int(min(dims)),
                          aligned=all(d % 8 == 0 for d in dims), dims=(int(batch), *(int(d) for d in dims))), -1
        if "scaled_dot_product" in name and ins and ins[0].dim() == 4:
            return OpCost(name, flops=_attention_flops(name, (ins[0],)), math=_dtype_name(ins[0].dtype),
                          attention=True, attn=attention_shape(ins[0])), -1
        moved = sum(self.size(o) for o in made) + sum(self.size(b) for b in reads)
        numel = max([v.numel() for v in ins] or [0]) if self.kind[r] == "reduction" else \
            max((_val(self.by_name[o]).numel() for o in made if _val(self.by_name[o]) is not None), default=0)
        return OpCost(name, bytes=float(moved), fused=True), numel


def _flat(x) -> list:
    if isinstance(x, (tuple, list)):
        return [y for e in x for y in _flat(e)]
    return [x]


def plan_graph(gm, cpu: bool, freeable_inputs: set[str] = frozenset(),
               reusable_inputs: set[str] = frozenset(), pad_balance: Optional[float] = None) -> GraphPlan:
    """The buffers and kernels of one AOT graph as Inductor runs it (module doc). ``freeable_inputs``:
    placeholders the graph may free after their last use (backward's saved tensors and tangents);
    ``reusable_inputs``: those of them it may also overwrite in place (saved tensors the forward made);
    ``pad_balance``: the GPU's FLOP/byte balance for ``pad_mm`` (None: no padding, as on a CPU)."""
    return _Graph(gm, cpu, set(freeable_inputs), set(reusable_inputs), pad_balance).plan()
