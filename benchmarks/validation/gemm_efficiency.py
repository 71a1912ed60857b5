"""Measure, on a CUDA GPU, the figures the estimator's roofline (``tokenmill.estimate.roofline``) and host model
(``tokenmill.estimate.host``) take from outside sources today, and write them raw as JSON:

- ``matmul``: ``torch.matmul`` over a grid of shapes (square, a depth sweep at 4096 x 4096 outputs, GPT-2 and
  Llama projections, LoRA's rank-8..64 factors, an unpadded 50,257 vocabulary) in bf16, fp32 with TF32 and plain
  fp32: milliseconds (median of CUDA events), TFLOPS, and beside each the estimator's own prediction (its
  tile/wave share of the SMs, its depth share and its efficiency) so the measured efficiency by shape can replace
  ``MATMUL_EFFICIENCY``, ``K_OVERHEAD`` (measured on the H100 only), ``UNALIGNED`` and the memory floor;
- ``bandwidth``: a copy, an add, a sum and a row softmax of 1 GiB tensors (GB/s): against
  ``STREAM_MEMORY_EFFICIENCY``, ``REDUCE_MEMORY_EFFICIENCY`` (BabelStream's Copy and Dot on Azure's A100/H100) and
  ``MEMORY_EFFICIENCY`` (``estimate/bandwidth.py``: this GPU's own);
- ``attention``: fused causal SDPA forward + backward (TFLOPS): against ``estimate/attention.py``'s published
  FlashAttention-2 shares (this GPU's own, and fp32's ``ATTENTION_EFFICIENCY``);
- ``launch``: host microseconds per eager op (a tiny add, dispatched 2,000 times) and GPU microseconds per
  tiny kernel replayed in a CUDA graph: ``HOST_OP_US`` + ``CUDA_LAUNCH_US`` on a GPU host, ``KERNEL_MIN_US``;
- ``host_link``: pinned host <-> GPU copies of 256 MiB (GB/s), each direction alone, both at once (one copy engine
  per direction?), and a device-to-host copy on a side stream beside a matmul on the compute stream (does it
  hide?): against ``roofline.host_link_bytes_s`` and activation offloading's overlap
  (``techniques.offload_stall_seconds``);
- ``nf4``: the NF4 dequantisation of a 4096 x 4096 weight (when torchao imports), tokenmill's
  (``model/nf4.py``) against ``roofline.nf4_dequant_costs``, and torchao's ``get_original_weight`` beside it.

About a minute on an H100 (``benchmarks/session.py`` part ``gemm-efficiency``, at most 120 s):

    python benchmarks/validation/gemm_efficiency.py --out gemm_efficiency.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tokenmill.atomic import write_json

SQUARE = [(n, n, n) for n in (512, 1024, 2048, 4096, 8192)]
MODEL = [(8192, 768, 2304), (8192, 768, 3072), (8192, 3072, 768), (8192, 768, 50257), (8192, 768, 50304),
         (8192, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096), (4224, 8192, 2048), (1024, 768, 768)]
# the depth sweep of OpenXLA's H100 table that roofline.depth_share is read from (4096 x 4096 outputs, K = 256 ... 4096)
DEPTH = [(4096, k, 4096) for k in (256, 512, 1024, 2048, 4096)]
LORA = [(t, d, r) for t in (2048, 8192) for d in (768, 4096) for r in (8, 16, 64)] + \
       [(t, r, d) for t in (2048, 8192) for d in (768, 4096) for r in (8, 16, 64)]


def _time_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _matmuls(gpu, deadline: float) -> list[dict]:
    from tokenmill.estimate.recorder import OpCost
    from tokenmill.estimate.roofline import depth_share, matmul_bytes, matmul_efficiency, quantization

    out = []
    for mode, dtype, tf32 in (("bf16", torch.bfloat16, False), ("tf32", torch.float32, True),
                              ("fp32", torch.float32, False)):
        torch.backends.cuda.matmul.allow_tf32 = tf32
        for m, k, n in SQUARE + DEPTH + MODEL + LORA:
            if time.monotonic() > deadline:
                return out
            a = torch.randn(m, k, device="cuda", dtype=dtype)
            b = torch.randn(k, n, device="cuda", dtype=dtype)
            ms = _time_ms(lambda a=a, b=b: torch.matmul(a, b))
            c = OpCost("mm", flops=2.0 * m * k * n, math="bf16" if dtype == torch.bfloat16 else "fp32",
                       min_dim=min(m, k, n), aligned=all(d % 8 == 0 for d in (m, k, n)), dims=(1, m, k, n))
            out.append({"mode": mode, "m": m, "k": k, "n": n, "ms": ms, "tflops": c.flops / ms / 1e9,
                        "bytes": matmul_bytes(c), "est_sm_share": quantization(c.dims, gpu.sm) if gpu.sm else None,
                        "est_depth_share": depth_share(k, mode), "est_efficiency": matmul_efficiency(c, mode, gpu)})
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def _bandwidth() -> dict:
    x = torch.empty(2 ** 29, device="cuda", dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    copy = _time_ms(lambda: y.copy_(x), 10)
    add = _time_ms(lambda: torch.add(x, y, out=y), 10)
    total = _time_ms(lambda: x.sum(), 10)  # a one-pass reduction: REDUCE_MEMORY_EFFICIENCY
    rows = x.view(-1, 4096)  # softmax over rows, as attention's scores (MEMORY_EFFICIENCY)
    soft = _time_ms(lambda: torch.softmax(rows, -1), 10)
    return {"bytes": x.nbytes, "copy_gbs": 2 * x.nbytes / copy / 1e6, "add_gbs": 3 * x.nbytes / add / 1e6,
            "sum_gbs": x.nbytes / total / 1e6, "softmax_gbs": 2 * x.nbytes / soft / 1e6}


def _attention() -> list[dict]:
    import torch.nn.functional as F

    out = []
    for b, h, t, d in ((8, 12, 1024, 64), (2, 32, 4096, 128), (1, 12, 1024, 64)):
        q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

        def run(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        ms = _time_ms(run, 10)
        flops = 3.5 * 2 * 2.0 * b * h * t * t * d * 0.5  # forward + backward (2.5 x), the causal half
        out.append({"b": b, "h": h, "t": t, "d": d, "ms": ms, "tflops": flops / ms / 1e9})
    return out


def _launch() -> dict:
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    host_us = (time.perf_counter() - t0) / n * 1e6  # issue rate: Python, dispatcher, launch
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g):
            for _ in range(200):
                x.add_(1)
    torch.cuda.synchronize()
    graph_ms = _time_ms(g.replay, 20)
    return {"host_us_per_eager_op": host_us, "gpu_us_per_graph_kernel": graph_ms * 1000 / 200}


def _nf4() -> dict:
    from tokenmill.estimate.roofline import nf4_dequant_costs

    try:
        from tokenmill.model.nf4 import nf4_dequantize, to_nf4
        w = to_nf4(torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16))
    except Exception as e:  # torchao missing or failing: recorded, the rest of the file still written
        return {"error": f"{type(e).__name__}: {e}"}
    costs = nf4_dequant_costs(4096 * 4096, 2)
    return {"numel": 4096 * 4096, "ms": _time_ms(lambda: nf4_dequantize(w, torch.bfloat16), 10),
            "torchao_ms": _time_ms(lambda: w.get_original_weight(), 10),
            "est_bytes": sum(c.bytes for c in costs), "est_kernels": len(costs)}


def _host_link() -> dict:
    dev = torch.empty(2 ** 27, device="cuda", dtype=torch.bfloat16)  # 256 MiB
    host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
    host2 = torch.empty_like(host).pin_memory()
    dev2 = torch.empty_like(dev)
    side = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def both():
        with torch.cuda.stream(side):
            host.copy_(dev, non_blocking=True)
        dev2.copy_(host2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)

    def beside():
        with torch.cuda.stream(side):
            host.copy_(dev, non_blocking=True)
        for _ in range(4):
            a @ a
        torch.cuda.current_stream().wait_stream(side)

    d2h = _time_ms(lambda: host.copy_(dev, non_blocking=True), 5)
    h2d = _time_ms(lambda: dev2.copy_(host2, non_blocking=True), 5)
    matmuls = _time_ms(lambda: [a @ a for _ in range(4)], 5)
    gb = dev.nbytes / 1e6
    return {"bytes": dev.nbytes, "d2h_gbs": gb / d2h, "h2d_gbs": gb / h2d, "both_ms": _time_ms(both, 5),
            "d2h_ms": d2h, "h2d_ms": h2d, "matmuls_ms": matmuls, "d2h_beside_matmuls_ms": _time_ms(beside, 5)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="gemm_efficiency.json")
    p.add_argument("--budget-s", type=float, default=100.0, help="stop the matmul grid after this long")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_efficiency.py measures a CUDA GPU; none is visible here.", file=sys.stderr)
        return 2
    from tokenmill.errors import ConfigError
    from tokenmill.estimate.gpus import gpu_spec

    name = torch.cuda.get_device_name()
    try:
        gpu = gpu_spec(name)
    except ConfigError:  # a GPU the table does not know: measured all the same, without the estimator's figures
        from tokenmill.estimate.gpus import GPU
        gpu = GPU("unknown", name, 0, 0, 0, "", torch.cuda.get_device_properties(0).multi_processor_count)
    start = time.monotonic()
    doc = {"device": name, "sm": torch.cuda.get_device_properties(0).multi_processor_count,
           "torch": torch.__version__, "cuda": torch.version.cuda, "launch": _launch(), "bandwidth": _bandwidth(),
           "attention": _attention(), "host_link": _host_link(), "nf4": _nf4()}
    doc["matmul"] = _matmuls(gpu, start + args.budget_s - 15)
    doc["wall_s"] = time.monotonic() - start
    write_json(args.out, doc, indent=1)
    print(f"{len(doc['matmul'])} products, launch {doc['launch']}, bandwidth {doc['bandwidth']}: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
