"""``tokenmill profile`` and ``tokenmill doctor`` (registered by :func:`register`)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def register(subparsers) -> None:
    """Add the ``profile`` and ``doctor`` sub-commands."""
    from tokenmill.cli import add_config_args

    p = subparsers.add_parser(
        "profile", help="a short training run under torch.profiler: trace, memory, report",
        allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Train a few steps under torch.profiler and write trace.json, profile.md/.json/.png "
        "(and on CUDA a memory snapshot, memory timeline and allocator statistics) into the run directory.",
    )
    g = p.add_argument_group("profiler")
    g.add_argument("--wait", type=int, default=2, help="steps before the profiler starts")
    g.add_argument("--warmup", type=int, default=2, help="profiler warm-up steps (traced, then discarded)")
    g.add_argument("--active", type=int, default=4, help="profiled steps")
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
        "present) and print the main bottleneck, its evidence and the switches to try, best first.",
    )
    d.add_argument("run_dir", metavar="RUN_DIR")
    d.add_argument("--json", action="store_true", help="machine-readable output")
    d.set_defaults(func=cmd_doctor)


def cmd_profile(args: argparse.Namespace) -> int:
    from tokenmill import config as C
    from tokenmill.cli import config_from_args
    from tokenmill.profiling.runner import ProfileOptions, prepare_config, run_profile

    if args.resume:
        raise C.ConfigError("profile does not resume runs; give a fresh --run-dir.")
    opts = ProfileOptions(args.wait, args.warmup, args.active, args.per_block, args.tensorboard, args.with_stack)
    given = {k[4:] for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
    cfg = prepare_config(config_from_args(args), opts, given)
    run_dir = Path(args.run_dir) if args.run_dir else (
        Path("runs") / f"profile-{args.preset or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    )
    result = run_profile(cfg, run_dir, opts, quiet=args.quiet)
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

    try:
        verdict = diagnose(args.run_dir)
    except DoctorError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 1
    for w in verdict["warnings"]:
        print(f"tokenmill: warning: {w}", file=sys.stderr)
    print(json.dumps(verdict, indent=2) if args.json else format_verdict(verdict))
    return 0
