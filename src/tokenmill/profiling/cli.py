"""``tokenmill profile`` and ``tokenmill doctor`` (registered by :func:`register`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tokenmill.config.options import number
from tokenmill.paths import check_text, one_folder


def register(subparsers) -> None:
    """Add the ``profile`` and ``doctor`` sub-commands."""
    from tokenmill.args import add_config_args

    p = subparsers.add_parser(
        "profile", help="a short training run under torch.profiler: trace, memory, report",
        allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a few steps under torch.profiler and write trace.json, profile.md/.json/.png "
        "(and on CUDA a memory snapshot, memory timeline and allocator statistics) into the run directory.",
    )
    g = p.add_argument_group("profiler")
    g.add_argument("--wait", type=number(int, ge=0), default=2, help="steps before the profiler starts")
    g.add_argument("--warmup", type=number(int, ge=0), default=2, help="profiler warm-up steps (traced, then discarded)")
    g.add_argument("--active", type=number(int, ge=1), default=4, help="profiled steps")
    g.add_argument("--per-block", action="store_true", help="attention / MLP regions of every block")
    g.add_argument("--tensorboard", action="store_true", help="also write the TensorBoard profiler trace")
    g.add_argument("--with-stack", action="store_true",
                   help="record Python stacks (slower; names the Python line behind each sync)")
    g.add_argument("--quiet", action="store_true", help="no training log lines")
    add_config_args(p)
    p.set_defaults(func=cmd_profile)

    d = subparsers.add_parser(
        "doctor", help="name a run's main bottleneck and the switches to try", allow_abbrev=False,
        description="Read RUN_DIR's metrics.jsonl, summary.json, config.toml and profile.json (when "
        "present) and print the main bottleneck, its evidence and the switches to try, best first. With --try N, "
        "measure the top N switches as short A/B runs of the run's config.",
    )
    d.add_argument("run_dir", metavar="RUN_DIR", nargs="?", help="the run directory (or --run-dir, as train names it)")
    d.add_argument("--run-dir", dest="run_dir_flag", metavar="RUN_DIR", help=argparse.SUPPRESS)
    d.add_argument("--json", action="store_true", help="machine-readable output")
    t = d.add_argument_group("measuring the advice")
    t.add_argument("--try", dest="try_n", type=number(int, ge=0), default=0, metavar="N",
                   help="run the top N suggested overrides as short A/B runs of the run's config (a fresh process "
                   "each, A and B alternated) and report the measured change: confirmed or not")
    t.add_argument("--try-steps", type=number(int, ge=1), default=30, metavar="S", help="training steps of each A/B run")
    t.add_argument("--try-repeats", type=number(int, ge=1), default=3, metavar="R", help="rounds of A/B runs")
    t.add_argument("--try-timeout", type=number(float, gt=0), default=600.0, metavar="SECONDS", help="limit for each run")
    d.set_defaults(func=cmd_doctor)


def cmd_profile(args: argparse.Namespace) -> int:
    from tokenmill import config as C
    from tokenmill.args import config_from_args
    from tokenmill.profiling.runner import ProfileOptions, prepare_config, run_profile

    if args.resume:
        raise C.ConfigError("profile does not resume runs; give a fresh --run-dir.")
    opts = ProfileOptions(args.wait, args.warmup, args.active, args.per_block, args.tensorboard, args.with_stack)
    given = {k[4:] for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
    cfg = prepare_config(config_from_args(args), opts, given)
    run_dir = Path(check_text(args.run_dir, "--run-dir")) if args.run_dir else (
        Path("runs") / f"profile-{args.preset or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    result = run_profile(cfg, run_dir, opts, quiet=args.quiet)  # the threads are in summary.json
    b = result["breakdown"]["share"]
    print(
        f"tokenmill: profile written to {run_dir}/profile.md (trace: {run_dir}/trace.json); step split: "
        + ", ".join(f"{k} {100 * v:.0f}%" for k, v in b.items())
    )
    print(f"tokenmill: next: tokenmill doctor {run_dir}")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    import sys

    from tokenmill.profiling.doctor import DoctorError, diagnose, format_verdict
    from tokenmill.profiling.trial import format_trials, run_trials

    args.run_dir = one_folder(args.run_dir, args.run_dir_flag, "doctor: give one run directory: tokenmill doctor "
                              "RUN_DIR (or --run-dir RUN_DIR)")
    try:
        verdict = diagnose(args.run_dir)
        verdict["memory_estimate"] = memory_estimate(args.run_dir, verdict)
        for w in verdict["warnings"]:
            print(f"tokenmill: warning: {w}", file=sys.stderr)
        if args.try_n:
            if not args.json:
                print(format_verdict({**verdict, "try": "running"}), flush=True)
            echo = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
            verdict["try"] = run_trials(args.run_dir, verdict, args.try_n, args.try_steps, args.try_repeats,
                                        args.try_timeout, echo)
            print(json.dumps(verdict, indent=2) if args.json else "\n".join(format_trials(verdict["try"])))
            return 0
    except DoctorError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(verdict, indent=2) if args.json else format_verdict(verdict))
    if verdict["memory_estimate"] and not args.json:
        print(f"\nMemory estimate (tokenmill estimate): {verdict['memory_estimate']}")
    return 0


MEMORY_RULES = ("logits_peak", "activation_memory", "optimizer_state_memory", "allocator_thrash", "lora_finetune",
                "qlora_finetune")


def memory_estimate(run_dir: str, verdict: dict) -> str | None:
    """When memory is what the doctor names on a GPU run: the estimator's "this needs about X GB; with
    --... it needs Y GB" for the run's config and GPU (None otherwise)."""
    major = [f["key"] for f in verdict["findings"] if not f["minor"]]
    gpu = verdict["figures"].get("memory_total_mb") and verdict["device"] == "cuda"
    if not gpu or not any(k in MEMORY_RULES for k in major):
        return None
    from tokenmill import config as C
    from tokenmill.estimate import memory_advice
    from tokenmill.profiling.run_files import read_summary

    summary_path = Path(run_dir) / "summary.json"
    try:
        cfg = C.from_dict(C.load_toml(Path(run_dir) / "config.toml"))
    except C.ConfigError:  # a config of another version: no estimate (the findings stand)
        return None
    summary = read_summary(summary_path) if summary_path.is_file() else {}  # a damaged one: one line naming it
    return memory_advice(cfg, summary.get("gpu_name") or "h100-sxm", int(summary.get("world_size") or 1),
                         capacity_mb=verdict["figures"]["memory_total_mb"])
