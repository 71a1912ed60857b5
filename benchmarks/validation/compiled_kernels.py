"""Measure, on a CUDA GPU, the kernels of a GPT-2 124M training step's forward and backward, eager and compiled
(the rasbt ladder's flash-attention and compile rungs), beside the estimator's own kernels for each; write it raw.

For each config: the GPU time of every kernel of one forward + backward (no optimizer step; torch.profiler's CUDA
activity, the median of REPS profiled steps after the warm-up and compilation), summed by kind (matrix products,
fused attention, Inductor's Triton kernels, other ATen kernels) with their counts; and the estimator's kernels for
the same config (its traced pieces, each priced by ``roofline._op_seconds``), summed by the same kinds.

Why: the estimate has the compile rung slower than the eager one (55.0 against 51.1 ms a step on an A100, the
compiled block's backward 2.09 against 1.71 ms: Inductor's gradient reductions priced at ``MEMORY_EFFICIENCY``)
where the rasbt README measured the compile rung 22% faster (issue 32). This says which kind of kernel is off.

About a minute on an H100 (``benchmarks/session.py`` part ``compiled-kernels``):

    python benchmarks/validation/compiled_kernels.py --out compiled_kernels.json
    python benchmarks/validation/compiled_kernels.py --estimate-only --gpu a100-80gb   # the estimator's side only
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict

import torch

from tokenmill.atomic import write_json

RUNGS = ("flash-attention", "compile")  # the rasbt ladder's eager and compiled rungs, as the ladder builds them
REPS = 3
KINDS = ("matmul", "attention", "triton", "other")


def rung_config(rung: str, smoke: bool = False):
    """The rasbt ladder's config at ``rung``, as the ladder runs and estimates it (``bench.configs.rung_config``;
    ``smoke``: the ladder's tiny shapes, for checking the script on a CPU)."""
    from tokenmill.bench.configs import rung_config as ladder_rung_config
    from tokenmill.bench.load import load_ladder

    ladder = load_ladder("rasbt")
    index = next(i for i, r in enumerate(ladder.rungs) if r.name == rung)
    return ladder_rung_config(ladder, index, smoke=smoke).config


def _kind_of_cost(c) -> str:
    return "matmul" if c.dims else "attention" if c.attention else "triton" if c.fused else "other"


def estimated(cfg, gpu) -> dict:
    """The estimator's kernels of one forward + backward: milliseconds and counts by kind, and by piece."""
    from tokenmill.estimate.core import _plan, resolve_layout, vocab_size_of
    from tokenmill.estimate.roofline import _op_seconds

    _, pieces = _plan(cfg, resolve_layout(cfg, 1), vocab_size_of(cfg), True, 0)
    assert len(pieces.blocks) == 1, "one block form (GPT-2)"
    ms, count, by_piece = defaultdict(float), defaultdict(int), {}
    for name, trace, times in [("embed", pieces.embed, 1), *[(k, t, cfg.model.n_layer) for k, t in
                                                              pieces.blocks.items()], ("head", pieces.head, 1)]:
        rnd = trace.rounds[0]
        for side in ("fwd_costs", "bwd_costs"):
            total = 0.0
            for c in getattr(rnd, side):
                s = _op_seconds(c, cfg, gpu, 1) * 1e3 * times
                ms[_kind_of_cost(c)] += s
                count[_kind_of_cost(c)] += times * c.launches  # 0: fused into the kernel before it
                total += s
            by_piece[f"{name} {side[:3]}"] = total
    return {"ms": dict(ms), "kernels": dict(count), "total_ms": sum(ms.values()), "by_piece_ms": by_piece}


def _kind_of_kernel(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas")):
        return "matmul"
    if any(k in n for k in ("flash", "fmha", "attention", "attn")):
        return "attention"
    return "triton" if "triton" in n else "other"


def measured(cfg) -> dict:
    """The GPU kernels of one forward + backward on this GPU: milliseconds and counts by kind (median of REPS)."""
    from torch.profiler import ProfilerActivity, profile

    from tokenmill.model.build import apply_compile, build_gpt

    torch.manual_seed(0)
    model = build_gpt(cfg.model, cfg.model.vocab_size, "cuda")
    model = apply_compile(model, cfg.compile)
    idx = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.block_size), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(idx, idx)[1]
        loss.backward()

    for _ in range(3):  # warm-up, compilation included
        step()
    torch.cuda.synchronize()
    reps = []
    for _ in range(REPS):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        ms, count = defaultdict(float), defaultdict(int)
        for evt in prof.key_averages():
            us = getattr(evt, "self_device_time_total", None)
            if us is None:
                us = getattr(evt, "self_cuda_time_total", 0.0)
            if us and "memcpy" not in evt.key.lower() and "memset" not in evt.key.lower():
                ms[_kind_of_kernel(evt.key)] += us / 1e3
                count[_kind_of_kernel(evt.key)] += evt.count
        reps.append((ms, count))
    mid = sorted(reps, key=lambda r: sum(r[0].values()))[len(reps) // 2]
    return {"ms": dict(mid[0]), "kernels": dict(mid[1]), "total_ms": sum(mid[0].values()),
            "total_ms_of_reps": [sum(r[0].values()) for r in reps]}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="compiled_kernels.json")
    p.add_argument("--estimate-only", action="store_true", help="the estimator's side only (no GPU needed)")
    p.add_argument("--gpu", help="the GPU table's key to estimate for (default: the visible GPU)")
    p.add_argument("--smoke", action="store_true", help="a tiny model (checking the script)")
    args = p.parse_args(argv)
    from tokenmill.errors import ConfigError
    from tokenmill.estimate.gpus import gpu_spec

    if not args.estimate_only and not torch.cuda.is_available():
        print("compiled_kernels.py measures a CUDA GPU; none is visible here (--estimate-only needs none).",
              file=sys.stderr)
        return 2
    name = args.gpu or torch.cuda.get_device_name()
    try:
        gpu = gpu_spec(name)
    except ConfigError:  # a GPU the table does not know: measured all the same, without the estimate
        gpu = None
    start = time.monotonic()
    doc = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "rungs": {}}
    for rung in RUNGS:
        cfg = rung_config(rung, args.smoke)
        row = {"batch": cfg.train.batch_size, "block_size": cfg.model.block_size,
               "compiled": bool(cfg.compile.enabled)}
        if gpu is not None:
            row["estimate"] = estimated(cfg, gpu)
        if not args.estimate_only:
            try:
                row["measured"] = measured(cfg)
            except Exception as e:  # recorded, not raised: the other rung and the estimate still come back
                row["measured"] = {"error": f"{type(e).__name__}: {e}"}
        doc["rungs"][rung] = row
        write_json(args.out, doc | {"wall_s": time.monotonic() - start}, indent=1)
    for rung, row in doc["rungs"].items():
        est, got = row.get("estimate", {}), row.get("measured", {})
        print(f"{rung}: estimate {est.get('total_ms', float('nan')):.1f} ms "
              f"{ {k: round(v, 1) for k, v in est.get('ms', {}).items()} }; measured "
              f"{got.get('total_ms', float('nan')):.1f} ms { {k: round(v, 1) for k, v in got.get('ms', {}).items()} }")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
