"""``tokenmill estimate``: memory and speed of a config on a GPU, predicted on the CPU.

    tokenmill estimate --preset gpt2-124m --gpu a100-40gb
    tokenmill estimate --preset gpt2-xl --gpu h100-sxm --nproc 8 --parallel.dp_shard -1 --json
    tokenmill estimate --gpus
    tokenmill estimate --preset llama3.1-8b --model.block_size 2048 --train.batch_size 1 --finetune
"""

from __future__ import annotations

import argparse
import json

from tokenmill import config as C
from tokenmill.config.options import number

DEFAULT_GPU = "h100-sxm"


def register(subparsers) -> None:
    """Add the ``estimate`` sub-command."""
    from tokenmill.args import add_config_args

    p = subparsers.add_parser(
        "estimate", help="predict per-GPU memory and step time of a config, without a GPU", allow_abbrev=False,
        description="Predict the per-rank peak allocated and reserved GPU memory (with its breakdown) and the "
                    "step time and tokens/s of a training config on a GPU, from the model's own code traced on "
                    "the CPU (docs/estimate.md).")
    g = p.add_argument_group("estimate")
    g.add_argument("--gpu", default=DEFAULT_GPU, help=f"GPU key or name (default {DEFAULT_GPU}; --gpus lists them; "
                                                      "'cpu' for a CPU run)")
    g.add_argument("--nproc", type=number(int, ge=1), default=1, help="processes (GPUs) of the run; parallel.* set the layout")
    g.add_argument("--gpus-per-node", type=number(int, ge=1), default=None,
                   help="GPUs a node holds: collectives over more ranks cross the network (default: the GPU's "
                        "reference node, 8 for the A100/H100/H200 SXM; --gpus lists it)")
    g.add_argument("--network-gbps", type=number(float, gt=0), default=None,
                   help="the network's line rate per GPU between nodes, Gb/s (default: the reference node's, 200 on "
                        "a DGX A100, 400 on a DGX H100/H200)")
    g.add_argument("--json", action="store_true", help="machine-readable output")
    g.add_argument("--advice", action="store_true",
                   help="also say which switches bring the memory under the GPU's: those with the same numerics first, "
                        "then pure bf16, 8-bit AdamW, an NF4 base; more GPUs only when none fits (a few more seconds)")
    g.add_argument("--gpus", action="store_true", help="list the GPUs and their figures, and exit")
    g.add_argument("--finetune", action="store_true",
                   help="which GPU a fine-tune of this config needs: a line per GPU with the peak memory of a full "
                        "fine-tune, of LoRA (lora.*, else rank 16 on every projection) and of QLoRA, and whether "
                        "each fits; from the usual fine-tuning recipe (bf16 weights, activation checkpointing, "
                        "the chunked loss, a micro-batch of one sequence accumulated to the same global batch) "
                        "where you set none of those fields")
    add_config_args(p)
    p.set_defaults(func=cmd_estimate)


def _gpu(args: argparse.Namespace):
    """``--gpu``, with ``--gpus-per-node`` / ``--network-gbps`` over its reference node where given."""
    if args.gpus_per_node is None and args.network_gbps is None:
        return args.gpu
    import dataclasses

    from tokenmill.estimate.gpus import gpu_spec

    spec = gpu_spec(args.gpu)
    node = args.gpus_per_node or spec.node_gpus
    net = args.network_gbps or spec.nic_gbps
    if not node or not net:
        raise C.ConfigError(f"{spec.name} has no reference node: give both --gpus-per-node and --network-gbps.")
    return dataclasses.replace(spec, node_gpus=node, nic_gbps=net)


def cmd_estimate(args: argparse.Namespace) -> int:
    from tokenmill.args import config_from_args
    from tokenmill.estimate import estimate
    from tokenmill.estimate.gpus import gpu_table_markdown

    if args.gpus:
        print(gpu_table_markdown())
        return 0
    if args.resume or args.run_dir:
        raise C.ConfigError("--run-dir / --resume have no meaning for estimate (nothing runs).")
    cfg = config_from_args(args)
    gpu = _gpu(args)
    if args.finetune:
        from tokenmill.estimate.finetune import format_finetune, lora_advice

        print(format_finetune(cfg, args.nproc, chosen_keys(args)))
        if args.advice:
            print(f"\nadvice: {lora_advice(cfg, gpu, args.nproc, chosen_keys(args))}")
        return 0
    est = estimate(cfg, gpu, args.nproc)
    advice = None
    if args.advice or (est.fits is False and not args.json):
        from tokenmill.estimate.advice import memory_advice

        advice = memory_advice(cfg, gpu, args.nproc)
    if args.json:
        out = est.to_dict()
        if advice:
            out["advice"] = advice
        print(json.dumps(out, indent=2))
    else:
        print(format_estimate(est, cfg, advice))
    return 0


def chosen_keys(args: argparse.Namespace) -> set[str]:
    """The config keys the user set: on the command line or in a ``--config`` file (not the preset's)."""
    keys = {k[4:] for k in vars(args) if k.startswith("cfg:")}
    for path in args.config:
        keys |= set(C.flatten(C.load_toml(path), str(path)))
    return keys


def _mb(v: float) -> str:
    return f"{v:,.0f}"


def format_estimate(est, cfg: C.Config, advice: str | None = None) -> str:
    """The estimate as a short report."""
    t, m = cfg.train, cfg.model
    lines = [
        f"tokenmill estimate: {est.params / 1e6:,.1f}M parameters, micro-batch {t.batch_size} x {m.block_size} tokens, "
        f"{t.grad_accum_steps} accumulation step(s), {est.nproc} process(es): {est.layout}",
        f"GPU: {est.gpu}" + (f" ({_mb(est.capacity_mb)} MiB)" if est.capacity_mb else "")
        + f", precision {est.precision}",
        "",
        "memory per rank (MiB, at the allocated peak: " + (est.at_peak or "?") + ")",
    ]
    for k, v in est.breakdown_mb.items():
        if v >= 0.5:
            lines.append(f"  {k:<24}{_mb(v):>10}")
    lines.append(f"  {'peak allocated':<24}{_mb(est.peak_alloc_mb):>10}")
    lines.append(f"  {'allocator slack':<24}{_mb(est.allocator_slack_mb):>10}")
    fit = ""
    if est.capacity_mb:
        share = 100 * est.peak_reserved_mb / est.capacity_mb
        fit = f"   {'fits' if est.fits else 'DOES NOT FIT'}: {share:.0f}% of {_mb(est.capacity_mb)} MiB"
    lines.append(f"  {'peak reserved':<24}{_mb(est.peak_reserved_mb):>10}{fit}")
    u = est.uncertainty
    if u and est.memory_range_mb:
        lo, hi = est.memory_range_mb
        lines.append(f"  expected error +-{100 * u['memory']:.0f}%: {_mb(lo)}-{_mb(hi)} MiB ({u['memory_basis']}, "
                     f"regime {u['regime']})")
    per_block = ", ".join(f"{v:,.1f} ({k})" for k, v in est.activations_per_block_mb.items())
    lines.append(f"  activations kept per block: {per_block}")
    if est.host_mb:
        lines.append(f"  host (pinned) memory for the optimizer: {_mb(est.host_mb)} MiB")
    mfu = f", MFU {100 * est.mfu:.0f}%" if est.mfu else ""
    lines += ["", f"time per optimizer step: {est.step_ms:,.1f} ms -> {est.tokens_per_sec:,.0f} tokens/s{mfu}"]
    from tokenmill.estimate.sft import format_chat

    lines += format_chat(est)  # a chat fine-tune: learned tokens/s
    if u and est.tokens_per_sec_range:
        lo, hi = est.tokens_per_sec_range
        lines.append(f"  expected error +-{100 * u['speed']:.0f}%: {lo:,.0f}-{hi:,.0f} tokens/s ({u['speed_basis']})")
    parts = ", ".join(f"{k[:-3].replace('_', ' ')} {v:,.1f} ms" for k, v in est.time_breakdown_ms.items() if v >= 0.05)
    lines.append(f"  {parts}")
    from tokenmill.estimate.moe import format_moe

    lines += format_moe(est)  # a mixture of experts: its parts
    for n in est.notes:
        lines.append(f"note: {n}")
    if advice:
        lines += ["", f"advice: {advice}"]
    return "\n".join(lines)
