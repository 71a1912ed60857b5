"""Pieces of a ``torch.compile``'d model, traced as Inductor runs them (``compile.enabled``).

The estimate of an eager piece records every ATen operation (:mod:`.trace`). A compiled piece does not
run those operations: AOTAutograd traces its forward and backward into one joint graph, its min-cut
partitioner decides which tensors the forward saves for backward (recomputing cheap element-wise ops
instead of saving them), and Inductor fuses element-wise chains into kernels that never write their
intermediates. So here the piece is captured the way ``torch.compile`` captures it: the same model code,
under the same device model (:mod:`.device`: CUDA's autocast lists and fused attention), is traced by
``aot_function`` on fake CPU tensors with Inductor's decompositions and the min-cut partitioner
(``torch._functorch.partitioners.min_cut_rematerialization_partition``, the one Inductor uses), and
:mod:`.inductor` turns the two graphs into buffers, frees and kernels. Nothing is fitted: what is kept is
what the graphs hold.

Which pieces are compiled follows :func:`tokenmill.model.build.apply_compile`: ``compile.scope='model'``
compiles the embeddings, the blocks and the head with the loss; ``compile.loss_outside`` leaves the head
and the loss eager; ``compile.scope='block'`` compiles the blocks only. The chunked loss is costed as it runs
under compile: one opaque operator (``model/loss.py``) whose chunk loop runs eagerly inside the graph. An activation-checkpointed block keeps only its input in forward and runs its
compiled forward again in backward (Dynamo marks the checkpointed region for recomputation); one checkpointed with an
op policy ('save-matmuls') is captured with the policy's tags, so it keeps what the partition keeps (:func:`selective`).

Two measured behaviours of compiled training are part of the model: the logits the model returns beside
its loss get a materialised zero gradient in backward (``autograd.Function`` materialises the gradient
of an output nobody used), and backward may overwrite a saved tensor in place (measured on the CPU with
the profiler: ``tests/test_estimate_compile.py``).

Cost: one ``aot_function`` trace per kind of piece, about a second for a GPT-2 block on a laptop core,
plus a one-time import of ``torch._functorch`` (about 1.5 s). The graphs are kept for the process (:func:`captured`):
estimates that differ only in the GPU, the accumulation or the checkpoint wrapper trace them once.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tokenmill.errors import GraphCaptured
from tokenmill.estimate.device import DeviceModel
from tokenmill.estimate.inductor import GraphPlan, plan_graph
from tokenmill.estimate.pieces import PieceTrace, Round, nf4_names  # noqa: F401
from tokenmill.model.lora import nf4_params, nf4_weights


class _Call(nn.Module):
    """``fn`` as a module owning ``model``, so ``torch.func.functional_call`` can swap its tensors."""

    def __init__(self, model: nn.Module, fn: Callable):
        super().__init__()
        self.model, self.fn = model, fn

    def forward(self, *args):
        return self.fn(*args)


@dataclass
class Graphs:
    fw: object
    bw: object
    inputs: list[str]  # role of each forward input: 'param:NAME', 'buffer' (the model's), 'x', 'aux'
    n_user: int  # user outputs of the forward (the rest is saved for backward)


def capture(module: nn.Module, fn: Callable, names: list[str], acts: list[tuple], devmode: DeviceModel,
            grad_of: list[int], autocast: bool = True) -> Graphs:
    """Trace ``fn(*acts)`` forward and backward as ``torch.compile`` does, on fake CPU tensors, with ``module``'s
    parameters and buffers ``names`` as graph inputs (``fn`` may use no others). ``acts``: (role, shape,
    dtype, requires_grad) of the other inputs; ``grad_of``: the indices of the outputs backward starts from."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    wrapper = _Call(module, fn)
    own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    keys = [f"model.{n}" for n in names]
    got: dict[str, object] = {}

    def keep(slot: str):
        def compiler(gm, _example):
            got[slot] = gm
            return make_boxed_func(gm if slot == "fw" else _stop)  # backward: captured, not run
        return compiler

    fake = FakeTensorMode()
    with fake:
        tensors = [torch.empty(own[n].shape, dtype=own[n].dtype,
                               requires_grad=isinstance(own[n], nn.Parameter) and own[n].requires_grad) for n in names]
        extra = [torch.empty(shape, dtype=dt, requires_grad=rg) for _, shape, dt, rg in acts]

    def run(*flat):
        mapping = dict(zip(keys, flat[: len(keys)]))
        region = devmode.autocast_region() if autocast else _null()
        with devmode, region:
            return torch.func.functional_call(wrapper, mapping, tuple(flat[len(keys):]), tie_weights=True,
                                              strict=False)

    compiled = aot_function(run, keep("fw"), keep("bw"), partition_fn=min_cut_rematerialization_partition,
                            decompositions=_decompositions(select_decomp_table()), num_params_buffers=len(keys),
                            enable_log=False)  # no printed graphs for torch's logs: only the graphs are kept
    with fake:
        outs = compiled(*tensors, *extra)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        if "bw" not in got:  # a backward compiled lazily (else the forward compiled both: nothing to run)
            roots = [outs[i] for i in grad_of]
            with contextlib.suppress(GraphCaptured):
                torch.autograd.backward(roots, [torch.ones_like(r) if r.dim() == 0 else torch.empty_like(r)
                                                for r in roots])
    roles = [f"param:{n}" if isinstance(own[n], nn.Parameter) else "buffer" for n in names]
    roles += [r for r, *_ in acts]
    fw, bw = got["fw"], got["bw"]
    n_saved = sum(1 for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents"))
    return Graphs(fw, bw, roles, len(_outputs(fw)) - n_saved)


def _stop(*_args):
    """The backward graph's stand-in once it is compiled and captured (errors.GraphCaptured)."""
    raise GraphCaptured


def captured(key: tuple, module: nn.Module, fn: Callable, names: list[str], acts: list[tuple],
             devmode: DeviceModel, grad_of: list[int]) -> Graphs:
    """:func:`capture`, memoised for the process by ``key`` (empty: not memoised; ``GRAPH_CACHE_SIZE`` 0: off):
    everything that shapes the graphs (the piece's model, its input shapes, the device model), nothing they do
    not depend on (the GPU's balance and the number of rounds read the graphs later: :func:`build_piece`)."""
    hit = _GRAPHS.get(key) if key and GRAPH_CACHE_SIZE else None
    if hit is not None:
        _GRAPHS.move_to_end(key)
        return hit
    g = capture(module, fn, names, acts, devmode, grad_of)
    if key and GRAPH_CACHE_SIZE:  # the graphs are only read downstream (inductor.plan_graph, build_piece)
        _GRAPHS[key] = g
        while len(_GRAPHS) > GRAPH_CACHE_SIZE:
            _GRAPHS.popitem(last=False)
    return g


_GRAPHS: OrderedDict[tuple, Graphs] = OrderedDict()
GRAPH_CACHE_SIZE = 32


def _null():

    return contextlib.nullcontext()


def _decompositions(table: dict) -> dict:
    """Inductor's decompositions, less any of the attention kernels (Inductor calls those as they are)."""
    return {op: fn for op, fn in table.items() if "scaled_dot_product" not in str(op) and "attention" not in str(op)}


def _outputs(gm) -> list:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    args = out.args[0]
    return list(args) if isinstance(args, (tuple, list)) else [args]


# ----------------------------------------------------------------------------------------------
# The two graphs as a traced piece


class _Ids:
    """Storage ids of one piece: graph buffers and harness tensors, with their sizes."""

    def __init__(self, sizes: dict[int, int]):
        self.sizes = sizes
        self.next = 0

    def new(self, nbytes: int) -> int:
        sid = self.next
        self.next += 1
        self.sizes[sid] = int(nbytes)
        return sid


def _play(plan: GraphPlan, ids: _Ids, bound: dict[str, int], refs: dict[int, int], label: str,
          events: list) -> dict[str, int]:
    """Append ``plan``'s events with storage ids; ``bound``: placeholder -> id (several placeholders may
    share a storage: ``refs`` counts them, the storage is freed with the last). Returns buffer -> id."""
    sid = dict(bound)
    for e in plan.events:
        if e[0] == "a":
            sid[e[1]] = ids.new(e[2])
            refs[sid[e[1]]] = refs.get(sid[e[1]], 0) + 1
            events.append(("a", sid[e[1]], e[2], label))
        elif e[1] in sid:
            s = sid[e[1]]
            refs[s] -= 1
            if refs[s] == 0:
                events.append(("f", s))
    return sid


def _saved_ids(g: Graphs, fw_ids: dict[str, int], fw_plan: GraphPlan) -> dict[str, Optional[int]]:
    """Backward's saved-tensor placeholders -> the storage id the forward made (None: a parameter)."""
    names = [n.name for n in g.bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    bufs = fw_plan.outputs[g.n_user:]
    return {n: (fw_ids.get(b) if b is not None else None) for n, b in zip(names, bufs)}


def build_piece(name: str, g: Graphs, devmode: DeviceModel, rounds: int, x_nbytes: int = 0, gy: bool = True,
                zero_tangent: bool = False, checkpointed: bool = False, accumulate_first: frozenset = frozenset()
                ) -> PieceTrace:
    """A :class:`PieceTrace` from the captured graphs: forward events (the input, the graph's buffers), backward
    events (the output's gradient, the saved tensors freed at their last use, the gradients), kernels.
    ``gy``: the harness hands the first output's gradient over (a block, the embeddings); ``zero_tangent``:
    instead the first output (the logits) gets a materialised zero gradient; ``accumulate_first``:
    parameters whose gradient already exists in the first round (a tied head's)."""
    trace = PieceTrace(name, [], {})
    ids = _Ids(trace.sizes)
    cpu = not devmode.cuda
    x_name = next((n.name for n, r in zip(_placeholders(g.fw), g.inputs) if r == "x"), None)
    balance = getattr(devmode, "pad_balance", None)
    fw_plan = plan_graph(g.fw, cpu, pad_balance=balance)
    bw_names = _placeholders(g.bw)
    saved_names = [n.name for n in bw_names if not n.name.startswith("tangents")]
    reusable = {n for n, b in zip(saved_names, fw_plan.outputs[g.n_user:])
                if b is not None and b != x_name and b not in fw_plan.outputs[: g.n_user]}
    bw_plan = plan_graph(g.bw, cpu, freeable_inputs={n.name for n in bw_names}, reusable_inputs=reusable,
                         pad_balance=balance)
    for r in range(rounds):
        trace.rounds.append(_round(g, ids, fw_plan, bw_plan, x_name, x_nbytes, gy, zero_tangent,
                                   checkpointed, accumulate=(r > 0), tied=accumulate_first if r == 0 else frozenset(),
                                   offload=devmode.offload))
    if devmode.offload:  # what goes to the host: what the graph saves but parameters (checkpointed: its input)
        trace.host_sizes = ([x_nbytes] if x_name is not None else []) if checkpointed else moved_sizes(g, fw_plan)
    return trace


def _placeholders(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _forward(g: Graphs, ids: _Ids, fw_plan: GraphPlan, x: Optional[int], x_name: Optional[str],
             events: list, label: str) -> tuple[dict[str, int], dict[int, int]]:
    refs: dict[int, int] = {}
    bound = {x_name: x} if x_name is not None and x is not None else {}
    if x is not None:
        refs[x] = 10 ** 6  # the piece's input: freed by the harness rules, never by the graph
    fw_ids = _play(fw_plan, ids, bound, refs, label, events)
    return fw_ids, refs



def _round(g: Graphs, ids: _Ids, fw_plan: GraphPlan, bw_plan: GraphPlan, x_name: Optional[str], x_nbytes: int,
           gy_wanted: bool, zero_tangent: bool, checkpointed: bool, accumulate: bool, tied: frozenset,
           offload: bool = False) -> Round:
    fwd: list = []
    bwd: list = []
    x = ids.new(x_nbytes) if x_name is not None else None
    if x is not None:
        fwd.append(("a", x, x_nbytes, "x"))
    fwd.append(("m", "fwd"))
    fw_ids, _ = _forward(g, ids, fw_plan, x, x_name, fwd, "compiled")
    user = [fw_ids.get(b) if b is not None else None for b in fw_plan.outputs[: g.n_user]]
    saved = _saved_ids(g, fw_ids, fw_plan)
    fwd += [("f", s) for s in _dropped(set(saved.values()) - {None}, x, user, checkpointed, offload)]
    bwd.append(("m", "bwd"))
    xb = x  # offloaded, what backward reads comes back as new device tensors (offloaded())
    if offload:
        saved, xb = offloaded(g, saved, ids, bwd, x, x_nbytes, checkpointed)
    if checkpointed:
        fw_ids, _ = _forward(g, ids, fw_plan, xb, x_name, bwd, "compiled")
        again = {fw_ids.get(b) for b in fw_plan.outputs[: g.n_user] if b is not None}
        saved = _saved_ids(g, fw_ids, fw_plan)
        for s in again - set(saved.values()) - {xb}:
            bwd.append(("f", s))
    refs: dict[int, int] = {}
    bound: dict[str, int] = {}
    for name, s in saved.items():
        if s is not None:
            bound[name] = s
            refs[s] = refs.get(s, 0) + 1
    gy = None
    tangents = [n for n in _placeholders(g.bw) if n.name.startswith("tangents")]
    if tangents and (gy_wanted or zero_tangent):
        v = tangents[0].meta.get("val")
        size = v.numel() * v.element_size()
        gy = ids.new(size)
        bwd.append(("a", gy, size, "gy" if gy_wanted else "zeros"))
        bound[tangents[0].name], refs[gy] = gy, 1
    bw_ids = _play(bw_plan, ids, bound, refs, "compiled", bwd)
    if checkpointed and xb is not None and xb not in saved.values():
        bwd.append(("f", xb))  # the checkpoint's saved input
    grads, gx = _gradients(g, bw_plan, bw_ids, accumulate, tied, bwd)
    head_loss_only = not gy_wanted and not zero_tangent  # a head returning the loss alone
    y = None if head_loss_only or not user else user[0]
    for s in user[0 if head_loss_only else 1:]:  # the loss: the trainer holds it through backward
        if s is not None and s not in saved.values():
            bwd.append(("f", s))
    if y is not None and y in saved.values() and g.n_user > 1:
        y = None  # the logits backward needs: freed by the piece itself, not by the step
    bwd.append(("m", "end"))
    costs_f = [k.cost for k in fw_plan.kernels]
    costs_b = ([k.cost for k in fw_plan.kernels] if checkpointed else []) + [k.cost for k in bw_plan.kernels]
    rnd = Round(fwd, bwd, costs_f, costs_b, grads, compiled=True)
    rnd.x, rnd.y, rnd.gy, rnd.gx = x, y, (gy if gy_wanted else None), gx
    return rnd


def _dropped(saved: set, x: Optional[int], user: list, checkpointed: bool, offload: bool) -> set:
    """The storages a compiled piece's forward leaves behind: checkpointed, all it saved but its input (which the
    checkpoint saves: offloaded, to the host too); offloaded, all it saved and its input (copied to the host);
    else its input when backward does not read it (the harness drops it)."""
    xs = {x} - {None}
    if checkpointed:
        return (saved - xs - set(user)) | (xs if offload else set())
    if offload:
        return (saved | xs) - set(user)
    return xs - saved


def offloaded(g: Graphs, saved: dict[str, Optional[int]], ids: _Ids, bwd: list, x: Optional[int], x_nbytes: int,
              checkpointed: bool) -> tuple[dict[str, Optional[int]], Optional[int]]:
    """``memory.offload_activations`` (``tokenmill.model.offload``) around a compiled piece: AOTAutograd saves the
    forward graph's saved tensors through the saved-tensor hooks, which keep the parameters on the device and
    send the rest to the host in the forward; its backward, reading ``ctx.saved_tensors`` once, brings them back
    at its start as new device tensors, freed at their last use. A checkpointed region saves its input (and its
    parameters, kept): the input comes back. Returns the placeholders bound to the copies and the input backward
    reads."""
    if checkpointed:
        if x is None:
            return saved, x
        xb = ids.new(x_nbytes)
        bwd.append(("a", xb, x_nbytes, "unpacked"))
        return saved, xb
    out = dict(saved)
    for n in _placeholders(g.bw):
        v = n.meta.get("val")
        if n.name.startswith("tangents") or saved.get(n.name) is None or not isinstance(v, torch.Tensor):
            continue  # a parameter (None) stays on the device
        size = v.numel() * v.element_size()
        out[n.name] = ids.new(size)
        bwd.append(("a", out[n.name], size, "unpacked"))
    return out, x


def moved_sizes(g: Graphs, fw_plan: GraphPlan) -> list[int]:
    """Bytes of each of the tensors a compiled piece's forward saves for its backward but the model's parameters and
    buffers, or views of them (what offloading moves; ``tokenmill.model.offload.keeps``)."""
    kept = {n.name for n, r in zip(_placeholders(g.fw), g.inputs) if r.startswith("param:") or r == "buffer"}
    names = [n for n in _placeholders(g.bw) if not n.name.startswith("tangents")]
    vals = [n.meta.get("val") for n, b in zip(names, fw_plan.outputs[g.n_user:]) if b not in kept]
    return [v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)]


def _gradients(g: Graphs, bw_plan: GraphPlan, bw_ids: dict[str, int], accumulate: bool, tied: frozenset,
               events: list) -> tuple[dict[str, int], Optional[int]]:
    """Parameter name -> gradient storage (new gradients only) and the input's gradient; accumulated
    gradients (a later micro-batch, a tied head's) are added into the existing ones and freed."""
    grads: dict[str, int] = {}
    gx = None
    for role, b in zip(g.inputs, bw_plan.outputs):
        s = bw_ids.get(b) if b is not None else None
        if s is None:
            continue
        if role == "x":
            gx = s
        elif role.startswith("param:"):
            name = role[len("param:"):]
            if accumulate or name in tied:
                events.append(("f", s))
            else:
                grads[name] = s
    return grads, gx


# ----------------------------------------------------------------------------------------------
# The pieces


def _finish(trace: PieceTrace, params: dict[str, torch.Tensor], prefix: str = "") -> PieceTrace:
    trace.param_trainable = {prefix + n: bool(p.requires_grad) for n, p in params.items()}
    trace.param_bytes = {prefix + n: p.numel() * p.element_size() for n, p in params.items()}
    trace.param_dtype = {prefix + n: p.dtype for n, p in params.items()}
    trace.param_shape = {prefix + n: tuple(p.shape) for n, p in params.items()}
    for rnd in trace.rounds:
        rnd.grads = {prefix + n: s for n, s in rnd.grads.items()}
    return trace


class _Region(nn.Module):
    """The block under the device model, also where the checkpoint recomputes it in backward (where the mode
    that ran the forward is off: AOTAutograd traces backward after it)."""

    def __init__(self, inner: nn.Module, devmode: DeviceModel):
        super().__init__()
        self.inner, self.devmode = inner, devmode

    def forward(self, *args):
        from torch.overrides import _get_current_function_mode_stack

        off = self.devmode not in _get_current_function_mode_stack()
        with self.devmode if off else _null(), self.devmode.autocast_region():
            return self.inner(*args)


def selective(block: nn.Module, inner: nn.Module, devmode: DeviceModel, rope: bool) -> Optional[Callable]:
    """A block checkpointed with an op policy (``memory.activation_checkpointing_policy`` but 'full': the wrapper's
    ``context_fn``) as ``torch.compile`` runs it: Dynamo turns ``torch.utils.checkpoint`` into the
    ``tag_activation_checkpoint`` operator, whose body AOTAutograd traces under the policy's dispatch mode, which
    tags each op of the joint graph with its policy (``node.meta['recompute']``); the min-cut partitioner then
    saves what is MUST_SAVE and recomputes in the backward graph what is PREFER_RECOMPUTE (torch 2.11-2.13:
    ``torch/_higher_order_ops/wrap.py``, ``torch/utils/checkpoint.py``, ``torch/_functorch/partitioners.py``).
    The same operator is called here, on a one-node graph of the block, so the saved tensors are the partition's
    own. None for a plain block or whole-block recomputation ('full': :func:`build_piece`'s ``checkpointed``)."""
    context_fn = getattr(getattr(block, "checkpoint_fn", None), "keywords", {}).get("context_fn")
    if inner is block or context_fn is None:
        return None
    from torch import fx
    from torch._higher_order_ops.wrap import tag_activation_checkpoint

    g = fx.Graph()
    xs = [g.placeholder(n) for n in (("x", "cos", "sin") if rope else ("x",))]
    g.output(g.call_module("block", (xs[0], (xs[1], xs[2])) if rope else (xs[0],)))
    body = fx.GraphModule({"block": _Region(inner, devmode)}, g)
    body.meta["_checkpoint_context_fn"] = context_fn  # where Dynamo puts the checkpoint's context_fn
    return lambda *a: tag_activation_checkpoint(body, *a)


def compiled_block(model: nn.Module, block: nn.Module, shape: tuple, act_dtype: torch.dtype, devmode: DeviceModel,
                   rounds: int, key: tuple = ()) -> PieceTrace:
    """One compiled transformer block (an activation-checkpointed one recomputes its forward in backward; one
    checkpointed selectively recomputes what its policy does not save: :func:`selective`)."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)
    params = dict(inner.named_parameters())
    names = list(params) + [n for n, _ in inner.named_buffers()]
    acts = [("x", shape, act_dtype, True)]
    rope = model.cfg.pos_emb == "rope"
    sac = selective(block, inner, devmode, rope)
    if sac is not None:
        fn = sac  # its graphs depend on the policy: the caller's key names it
        acts += [("buffer", tuple(model.rope_cos.shape), model.rope_cos.dtype, False)] * 2 if rope else []
    elif rope:
        acts += [("buffer", tuple(model.rope_cos.shape), model.rope_cos.dtype, False)] * 2  # the model's buffers

        def fn(x, cos, sin):
            return inner(x, (cos, sin))
    else:
        def fn(x):
            return inner(x)
    g = captured(key, inner, fn, names, acts, devmode, grad_of=[0])
    x_nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=act_dtype).element_size()
    trace = build_piece("block", g, devmode, rounds, x_nbytes=x_nbytes,
                        checkpointed=inner is not block and sac is None)
    trace.buffer_bytes = sum(b.numel() * b.element_size() for b in block.buffers())
    nf4 = nf4_params(block)  # QLoRA's NF4 weights, walked once
    trace.nf4_sizes = nf4_weights(block, nf4)
    prefix = {m: n for n, m in model.named_modules()}[block] + "."
    trace.param_nf4 = {prefix + n for n in nf4_names(params, nf4)}
    return _finish(trace, params, prefix)


def compiled_head(model: nn.Module, shape: tuple, act_dtype: torch.dtype, devmode: DeviceModel,
                  rounds: int, key: tuple = ()) -> PieceTrace:
    """The final norm, the head and the loss compiled with the model: the logits are returned (and get a
    zero gradient) unless ``model.return_logits`` is off, the cross-entropy fused."""
    params = {n: p for n, p in model.named_parameters() if n.startswith(("ln_f.", "lm_head."))}
    if model.cfg.tie_embeddings:
        params["wte.weight"] = model.wte.weight
    acts = [("x", shape, act_dtype, True), ("aux", shape[:2], torch.long, False)]
    keep = model.cfg.return_logits

    def fn(x, t):
        logits, loss = model.head_loss(model.ln_f(x), t)
        return (logits, loss) if keep else loss

    g = captured(key, model, fn, list(params), acts, devmode, grad_of=[1 if keep else 0])
    x_nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=act_dtype).element_size()
    trace = build_piece("head", g, devmode, rounds, x_nbytes=x_nbytes, gy=False, zero_tangent=keep)
    return _finish(trace, params)


def compiled_embed(model: nn.Module, batch: int, seq: int, devmode: DeviceModel, rounds: int,
                   key: tuple = ()) -> PieceTrace:
    """Token (and learned position) embeddings, compiled with the model; with a tied head the token
    embedding's gradient of the first micro-batch adds into the head's."""
    params = {n: p for n, p in model.named_parameters() if n.startswith(("wte.", "wpe."))}
    blocks, ln_f = model.blocks, model.ln_f
    model.blocks, model.ln_f = nn.ModuleList(), None  # trunk() = the embeddings only
    try:
        g = captured(key, model, lambda idx: model.trunk(idx), list(params),
                     [("aux", (batch, seq), torch.long, False)], devmode, grad_of=[0])
    finally:
        model.blocks, model.ln_f = blocks, ln_f
    tied = frozenset({"wte.weight"}) if model.cfg.tie_embeddings else frozenset()
    trace = build_piece("embed", g, devmode, rounds, accumulate_first=tied)
    return _finish(trace, params)
