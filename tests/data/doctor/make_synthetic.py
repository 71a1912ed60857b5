"""Write the SYNTHETIC GPU run directories of tests/data/doctor (``python tests/data/doctor/make_synthetic.py``).

Nothing here was recorded on a GPU: each run directory is hand-made, with figures of the size a
gpt2-124m run on one H100 shows, so that the doctor's CUDA-only rules are tested through
``tokenmill doctor RUN_DIR`` without a GPU. Every profile.json says so in its ``synthetic`` key.
Replace a directory with a run recorded by ``tokenmill profile`` on a GPU when one is at hand.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenmill import config as C

HERE = Path(__file__).parent
NOTE = ("SYNTHETIC: hand-made by tests/data/doctor/make_synthetic.py for tests/test_doctor.py, with figures of "
        "the size a gpt2-124m run on one H100 shows; not recorded on a GPU")
GPU = {"name": "NVIDIA H100 80GB HBM3", "capability": [9, 0], "total_mb": 81559.0}


def profile(step: float, share: dict, *, busy: float, kernels: float, mean_us: float, gemm: float = 0.5,
            syncs: tuple = (), recompute_ms: float = 0.0, peak_mb: float = 9000.0, tokens: int = 8192) -> dict:
    """A profile.json body in the layout `tokenmill profile` writes (three profiled steps)."""
    ms = {k: v * step for k, v in share.items()}
    each = {k: [v * f for f in (0.98, 1.0, 1.02)] for k, v in ms.items()}
    each["step"] = [step * f for f in (0.98, 1.0, 1.02)]
    sources = [{"call": c, "op": op, "parent": parent, "region": region, "python": "", "per_step": n,
                "ms_per_step": t} for c, op, parent, region, n, t in syncs]
    return {
        "synthetic": NOTE, "version": 1, "device": "cuda", "tokens_per_step": tokens,
        "schedule": {"wait": 2, "warmup": 2, "active": 3},
        "breakdown": {"steps": [5, 6, 7], "ms_per_step": {**ms, "step": step}, "share": share, "each_step_ms": each,
                      "recompute": {"basis": "synthetic", "ops_per_step": 60.0 if recompute_ms else 0.0,
                                    "ops_host_ms_per_step": 0.0, "host_ms_per_step": 0.0,
                                    "device_ms_per_step": recompute_ms},
                      "outside": {"basis": "synthetic", "eval_ms_per_step": 0.0, "steps_with_eval": 0}},
        "host_busy": {"basis": "synthetic", "busy_fraction": 0.9, "ops_per_step": kernels * 0.8, "mean_op_us": 12.0},
        "device_busy": {"basis": "synthetic", "busy_fraction": busy, "busy_ms_per_step": busy * step,
                        "window_ms_per_step": step, "ms_per_step_by_launching_phase": {},
                        "kernels_per_step": kernels, "mean_kernel_us": mean_us, "gemm_share": gemm,
                        "attention_kernel_share": 0.1},
        "top_ops": [], "top_kernels": [],
        "syncs": {"basis": "blocking CUDA runtime calls", "per_step": sum(s["per_step"] for s in sources),
                  "ms_per_step": sum(s["ms_per_step"] for s in sources), "sources": sources},
        "memory": {"basis": "CUDA caching allocator (absolute)", "device": "cuda", "peak_mb": peak_mb,
                   "step_start_mb": 0.6 * peak_mb, "transient_mb": 0.4 * peak_mb, "peak_step": 6, "peak_at_ms": 10.0,
                   "peak_at_fraction": 0.3, "peak_region": "backward", "peak_op": "aten::mm", "top_live": []},
        "allocator": {"during_profiled_steps": {"num_alloc_retries": 0, "num_device_alloc": 0, "num_device_free": 0,
                                                "num_ooms": 0, "num_sync_all_streams": 0},
                      "cuda_malloc_per_step": 0.0, "cuda_free_per_step": 0.0, "alloc_retries_total": 0,
                      "allocated_mb": 0.5 * peak_mb, "reserved_mb": 1.1 * peak_mb,
                      "reserved_minus_allocated_mb": 0.6 * peak_mb, "peak_allocated_mb": peak_mb,
                      "peak_reserved_mb": 1.1 * peak_mb, "inactive_split_mb": 0.0, "device_total_mb": GPU["total_mb"]},
        "per_block": None, "gpu": GPU, "files": {}, "notes": [NOTE],
    }


def summary(cfg: C.Config, tokens_per_sec: float) -> dict:
    tokens = cfg.train.batch_size * cfg.train.grad_accum_steps * cfg.model.block_size
    return {"synthetic": NOTE, "steps": cfg.train.max_steps, "start_step": 0, "params": 124_475_904,
            "flops_per_token": 8.5e8, "tokens_per_step": tokens, "tokens_per_sec": tokens_per_sec, "device": "cuda",
            "gpu_name": GPU["name"], "world_size": 1}


def write(name: str, overrides: dict, prof: dict | None = None, metrics: list | None = None, tps: float = 1e5) -> None:
    cfg = C.resolve("gpt2-124m", overrides={"data.source": "synthetic", "model.vocab_size": 50304,
                                            "train.device": "cuda", **overrides}, overrides_from_string=False)
    d = HERE / name
    d.mkdir(exist_ok=True)
    C.save(cfg, d / "config.toml")
    (d / "summary.json").write_text(json.dumps(summary(cfg, tps), indent=1) + "\n")
    if prof is not None:
        (d / "profile.json").write_text(json.dumps(prof, indent=1) + "\n")
    if metrics is not None:
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))


def main() -> None:
    base = {"train.precision": "bf16-autocast", "optim.impl": "fused"}
    # batch 1: ~4000 short kernels per step, the GPU idle more than half the step, torch.compile off
    write("cuda_compile_off", {**base, "train.batch_size": 1},
          profile(60.0, {"data": 0.01, "h2d": 0.005, "forward": 0.35, "backward": 0.5, "optimizer": 0.1,
                         "idle": 0.035}, busy=0.45, kernels=4000, mean_us=6.75, gemm=0.35, tokens=1024))
    # pageable batches copied with blocking copies: a fifth of the step in h2d
    write("cuda_pageable_copies", {**base, "train.batch_size": 16},
          profile(120.0, {"data": 0.01, "h2d": 0.2, "forward": 0.25, "backward": 0.45, "optimizer": 0.07,
                          "idle": 0.02}, busy=0.8, kernels=1500, mean_us=64.0, tokens=16384,
                  syncs=(("cudaMemcpyAsync", "", "aten::copy_", "h2d", 1.0, 0.4),)))
    # activation checkpointing at a quarter of the GPU's memory: the recompute is a fifth of the step
    write("cuda_checkpointing_spare_memory", {**base, "train.batch_size": 8, "memory.activation_checkpointing": 1},
          profile(150.0, {"data": 0.005, "h2d": 0.005, "forward": 0.25, "backward": 0.65, "optimizer": 0.07,
                          "idle": 0.02}, busy=0.97, kernels=2600, mean_us=56.0, recompute_ms=30.0, peak_mb=19000.0))
    # metrics only: one worker with 5 ms of CPU work per sample cannot feed the GPU
    rows = [{"step": s, "loss": 6.0, "lr": 6e-4, "grad_norm": 1.0, "tokens_per_sec": 40960.0, "data_ms": 120.0,
             "h2d_ms": 1.0, "forward_ms": 25.0, "backward_ms": 45.0, "optimizer_ms": 8.0, "other_ms": 1.0 + d,
             "step_ms": 200.0 + d} for s, d in ((10, 0.0), (20, 2.0), (30, -2.0), (40, 1.0))]
    write("cuda_data_workers", {**base, "train.batch_size": 8, "data.num_workers": 1, "data.cpu_work_ms": 5.0,
                                "train.max_steps": 40}, metrics=rows, tps=40960.0)


if __name__ == "__main__":
    main()
