"""Measure, on a CUDA GPU, activation offloading (``memory.offload_activations``, ``tokenmill.model.offload``)
against the estimator's replay of it (``estimate/techniques.py offload_stall_seconds``), and write it raw as JSON.

GPT-2 124M at batch 8 x 1024 under bf16 autocast, eager, without and with every block checkpointed, each with
offloading off and on, as the trainer applies it (the hooks around the forward): milliseconds per forward and
backward (median of CUDA events; no optimizer step, so the difference on - off is the offload's own cost), the
peak allocated memory, the bytes the hooks moved and how many tensors stayed on the device; beside each pair the
estimate's activation_offload_ms, host_mb and the difference of its peak allocated memory.

About half a minute on an H100 (``benchmarks/session.py`` part ``offload``):

    python benchmarks/validation/offload_overlap.py --out offload_overlap.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from tokenmill import config as C
from tokenmill.atomic import write_json

BATCH, REPS = 8, 10


def _cfg(ac: int, offload: bool) -> C.Config:
    over = {"data.source": "synthetic", "train.batch_size": BATCH, "train.precision": "bf16-autocast",
            "memory.activation_checkpointing": ac, "memory.offload_activations": offload, "model.dropout": 0.0}
    return C.resolve("gpt2-124m", overrides=over, overrides_from_string=False)


def _measure(cfg: C.Config) -> dict:
    from contextlib import nullcontext

    from tokenmill.model.build import apply_activation_checkpointing, build_gpt
    from tokenmill.model.offload import ActivationOffload

    torch.manual_seed(0)
    model = build_gpt(cfg.model, cfg.model.vocab_size, "cuda")
    if cfg.memory.activation_checkpointing:
        apply_activation_checkpointing(model, cfg.memory.activation_checkpointing)
    idx = torch.randint(0, cfg.model.vocab_size, (BATCH, cfg.model.block_size), device="cuda")
    times, hooks = [], None
    for i in range(3 + REPS):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hooks = ActivationOffload(model, torch.device("cuda")) if cfg.memory.offload_activations else nullcontext()
        start.record()
        with torch.autocast("cuda", dtype=torch.bfloat16), hooks:
            loss = model(idx, idx)[1]
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    out = {"ms": statistics.median(times), "peak_alloc_mb": torch.cuda.max_memory_allocated() / 2 ** 20}
    if cfg.memory.offload_activations:
        out |= {"moved_mb": hooks.moved / 2 ** 20, "stayed": hooks.stayed}
    del model
    torch.cuda.empty_cache()
    return out


def _estimated(cfg: C.Config, gpu) -> dict:
    from tokenmill.estimate import estimate

    e = estimate(cfg, gpu)
    return {"step_ms": e.step_ms, "offload_ms": e.time_breakdown_ms["activation_offload_ms"],
            "host_mb": e.host_mb, "peak_alloc_mb": e.peak_alloc_mb}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="offload_overlap.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("offload_overlap.py measures a CUDA GPU; none is visible here.", file=sys.stderr)
        return 2
    from tokenmill.errors import ConfigError
    from tokenmill.estimate.gpus import gpu_spec

    name = torch.cuda.get_device_name()
    try:
        gpu = gpu_spec(name)
    except ConfigError:  # a GPU the table does not know: measured all the same, without the estimate
        gpu = None
    start = time.monotonic()
    pairs = []
    for ac in (0, 1):
        off, on = _cfg(ac, False), _cfg(ac, True)
        m_off, m_on = _measure(off), _measure(on)
        pair = {"activation_checkpointing": ac, "off": m_off, "on": m_on, "offload_ms": m_on["ms"] - m_off["ms"],
                "saved_mb": m_off["peak_alloc_mb"] - m_on["peak_alloc_mb"]}
        if gpu is not None:
            e_off, e_on = _estimated(off, gpu), _estimated(on, gpu)
            pair["estimate"] = {"off": e_off, "on": e_on, "saved_mb": e_off["peak_alloc_mb"] - e_on["peak_alloc_mb"]}
        pairs.append(pair)
    doc = {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "batch": BATCH, "pairs": pairs,
           "wall_s": time.monotonic() - start}
    write_json(args.out, doc, indent=1)
    for pair in pairs:
        print(f"checkpointing {pair['activation_checkpointing']}: offload costs {pair['offload_ms']:.1f} ms, "
              f"saves {pair['saved_mb']:.0f} MiB (estimate: {pair.get('estimate', {}).get('on', {}).get('offload_ms')}"
              f" ms, {pair.get('estimate', {}).get('saved_mb')} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
