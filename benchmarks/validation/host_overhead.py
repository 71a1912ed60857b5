"""Measure the host (CPU) cost of one training step's operations, the figures behind the estimator's host model
(``tokenmill.estimate.roofline``: HOST_OP_US, COMPILED_KERNEL_US, GRAPH_CALL_US).

A GPT of 2 and of 4 blocks with tiny shapes (context 8, width 64: the CPU kernels take next to no time, so what
is timed is Python, the dispatcher, autograd and the launch path) runs forward and backward on the CPU, eager and
compiled (Inductor). The eager cost per dispatched ATen op is the 4-block time over its op count (every op the
model's code dispatches, views included, counted by a TorchDispatchMode); the compiled cost is split into a
per-kernel part (the slope between 2 and 4 blocks over the kernels added, the kernels counted by the
estimator's own Inductor model) and a per-graph-call part (the rest, over the graph calls of a step: forward and
backward). Run it on the host that will drive the GPU to see its figures:

    python benchmarks/validation/host_overhead.py
"""

from __future__ import annotations

import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tokenmill import config as C
from tokenmill.estimate.trace import trace_pieces
from tokenmill.model.build import build_gpt


def _cfg(n_layer: int, compiled: bool) -> C.Config:
    over = {"data.source": "synthetic", "model.n_layer": n_layer, "model.n_embd": 64, "model.n_head": 4,
            "model.block_size": 8, "model.vocab_size": 64, "train.batch_size": 1, "compile.enabled": compiled}
    return C.concrete(C.resolve("gpt2-124m", overrides=over, overrides_from_string=False), "cpu", False)


def _step_seconds(model, x, reps: int = 20, rounds: int = 25) -> float:
    for _ in range(5):
        model(x, x)[1].backward()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            model(x, x)[1].backward()
        times.append((time.perf_counter() - t0) / reps)
    return min(times)  # the least disturbed round: other processes only ever add time


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _kernels(cfg: C.Config) -> float:
    p = trace_pieces(cfg, 64, "cpu")
    pieces = [p.embed, p.head] + [p.blocks[k] for k in p.kinds]
    return sum(c.launches for tr in pieces for c in tr.rounds[0].fwd_costs + tr.rounds[0].bwd_costs)


def measure() -> dict[str, float]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randint(0, 64, (1, 8))
    out: dict[str, float] = {}
    eager = build_gpt(_cfg(4, False).model, 64, "cpu")
    with _Count() as counter:
        eager(x, x)[1].backward()
    out["eager_ops"] = counter.n
    out["host_op_us"] = 1e6 * _step_seconds(eager, x) / counter.n
    t, k = {}, {}
    for n in (2, 4):
        cfg = _cfg(n, True)
        model = build_gpt(cfg.model, 64, "cpu")
        model.compile()
        t[n] = _step_seconds(model, x)
        k[n] = _kernels(cfg)
    out["compiled_kernel_us"] = 1e6 * (t[4] - t[2]) / (k[4] - k[2])
    out["graph_call_us"] = 1e6 * (t[4] - k[4] * out["compiled_kernel_us"] / 1e6) / 2  # forward + backward calls
    return out


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    for key, value in measure().items():
        print(f"{key}: {value:.2f}")
