"""``tokenmill bench ladder | max-batch | max-model``.

    tokenmill bench ladder --list
    tokenmill bench ladder rasbt --out runs/rasbt [--smoke] [--steps N] [--set train.device=cuda]
    tokenmill bench ladder my-ladder.toml
    tokenmill bench max-batch --preset gpt2-124m --train.precision bf16-autocast
    tokenmill bench max-model my-config.toml --memory.activation_checkpointing 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

from tokenmill import config as C


def register(subparsers) -> None:
    """Add ``bench`` and its sub-commands to the tokenmill parser."""
    from tokenmill.cli import add_config_args

    p = subparsers.add_parser("bench", help="ladders of speed/memory switches and sizing searches",
                              description="Ladders of cumulative speed/memory switches measured rung by rung, "
                                          "and searches for the largest batch or model that fits (docs/bench.md).")
    sub = p.add_subparsers(dest="bench_command", required=True)

    lad = sub.add_parser("ladder", help="run a ladder of cumulative switches, rung by rung",
                         description="Run each rung in a fresh training subprocess; write ladder.json, "
                                     "ladder.md and ladder.png into --out.")
    lad.add_argument("name", nargs="?", help="a shipped ladder (see --list) or a path to a ladder .toml file")
    lad.add_argument("--list", action="store_true", help="list the shipped ladders and exit")
    lad.add_argument("--out", help="output folder (default runs/bench-NAME-DATE)")
    lad.add_argument("--smoke", action="store_true",
                     help="tiny shapes and a few steps: checks the machinery (CPU-friendly), figures mean nothing")
    lad.add_argument("--steps", type=int, help="timed steps per rung (overrides [ladder.measure])")
    lad.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="config override applied to the base of every rung (repeatable)")
    lad.add_argument("--timeout", type=float, help="per-rung time limit in seconds (default from the ladder)")
    lad.add_argument("--quiet", action="store_true", help="do not echo the training output of each rung")
    lad.set_defaults(func=cmd_ladder)

    for name, help_text in (("max-batch", "largest micro-batch that trains without running out of memory"),
                            ("max-model", "largest GPT-2/GPT-3-family model that trains with these switches")):
        sp = sub.add_parser(name, help=help_text, description=help_text + "; each probe is a subprocess.",
                            allow_abbrev=False)
        add_config_args(sp)
        sp.add_argument("config_file", nargs="?", metavar="CONFIG.toml",
                        help="a TOML config file (the same as --config FILE, applied before any --config)")
        sp.add_argument("--probe-steps", type=int, default=3, help="training steps per probe")
        sp.add_argument("--memory-cap-mb", type=float,
                        help="count a probe whose peak reserved CUDA memory exceeds this as too big")
        sp.add_argument("--timeout", type=float, default=600.0, help="per-probe time limit in seconds")
        sp.add_argument("--nproc", type=int, default=1, help="processes per probe (> 1: launched with torchrun)")
        if name == "max-batch":
            sp.add_argument("--start", type=int, default=1, help="first batch size probed")
            sp.add_argument("--max-batch-limit", type=int, default=1024, help="largest batch size probed")
            sp.set_defaults(func=cmd_max_batch)
        else:
            sp.add_argument("--shapes", help="custom shapes 'NAME:LAYERS:HEADS:WIDTH,...' or 'LAYERS:HEADS:WIDTH,...'")
            sp.add_argument("--max-params", type=float, help="leave out shapes above this many parameters")
            sp.set_defaults(func=cmd_max_model)


# ----------------------------------------------------------------------------------------------
# ladder


def parse_sets(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise C.ConfigError(f"--set expects KEY=VALUE (e.g. train.device=cuda), got {item!r}.")
        out[key.strip()] = value.strip()
    from tokenmill.bench.schema import MEASURE_KEYS

    specs = C.field_specs()
    for key in out:
        if key not in specs:
            raise C.ConfigError(f"--set: unknown config key '{key}'.{C._closest(key, list(specs))}")
        if key in MEASURE_KEYS:
            raise C.ConfigError(f"--set {key}: the bench sets {', '.join(MEASURE_KEYS)} from the ladder's "
                                "[ladder.measure]; use --steps N for the timed steps per rung.")
    return out


def list_ladders() -> str:
    from tokenmill.bench.schema import load_ladder, shipped_ladders

    lines = []
    for name in shipped_ladders():
        lad = load_ladder(name)
        lines.append(f"{name}  ({len(lad.rungs)} rungs, headline {lad.headline})\n    {lad.description}")
    return "\n".join(lines)


def cmd_ladder(args: argparse.Namespace) -> int:
    from tokenmill.bench.ladder import run_ladder
    from tokenmill.bench.schema import load_ladder

    if args.list:
        print(list_ladders())
        return 0
    if not args.name:
        raise C.ConfigError("give a ladder name or a ladder .toml path; `tokenmill bench ladder --list` shows them.")
    if args.steps is not None and args.steps < 1:
        raise C.ConfigError("--steps must be >= 1.")
    ladder = load_ladder(args.name)
    cli_set = parse_sets(args.set)
    out = Path(args.out) if args.out else Path("runs") / f"bench-{ladder.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = run_ladder(ladder, out, smoke=args.smoke, timed_steps=args.steps, cli_set=cli_set,
                     timeout_s=args.timeout, echo_runs=not args.quiet)
    failed = [r["name"] for r in doc["rungs"] if r["status"] == "failed"]
    if failed:
        print(f"tokenmill bench: {len(failed)} rung(s) failed: {', '.join(failed)} (reasons in the table)")
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------
# sizing


def sizing_config(args: argparse.Namespace) -> C.Config:
    """The config of a sizing search: --preset, the positional config file, --config files, options."""
    from tokenmill.cli import config_from_args

    if args.config_file:
        args.config = [args.config_file, *args.config]
        args.config_file = None
    return config_from_args(args)


def _sizing_setup(args: argparse.Namespace, kind: str):
    from tokenmill.bench.sizing import SubprocessProbe

    if args.resume:
        raise C.ConfigError(f"--resume has no meaning for bench {kind}.")
    if args.probe_steps < 2:
        raise C.ConfigError("--probe-steps must be >= 2 (the first step is warm-up).")
    cfg = sizing_config(args)
    out = Path(args.run_dir) if args.run_dir else Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    launcher = "torchrun" if args.nproc > 1 else None
    probe = SubprocessProbe(cfg, out, "batch" if kind == "max-batch" else "model", args.probe_steps,
                            args.timeout, args.memory_cap_mb, launcher, args.nproc)
    return cfg, out, probe


def _context(cfg: C.Config, args: argparse.Namespace) -> dict:
    from tokenmill.bench.env import probe_environment

    return {"config": cfg.to_dict(), "probe_steps": args.probe_steps, "memory_cap_mb": args.memory_cap_mb,
            "nproc": args.nproc, "environment": probe_environment()}


def _search_and_write(kind: str, search, cfg: C.Config, args: argparse.Namespace, out: Path) -> Optional[dict]:
    """Run a sizing search; write ``OUT/KIND.json`` (result + config + device environment) and return
    the result, or print the error and return None."""
    from tokenmill.bench.sizing import SizingError, write_result

    try:
        found = search()
    except SizingError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return None
    result = {"kind": kind, **found, **_context(cfg, args)}
    write_result(result, out / f"{kind}.json")
    return result


def cmd_max_batch(args: argparse.Namespace) -> int:
    from tokenmill.bench.sizing import search_max_batch

    cfg, out, probe = _sizing_setup(args, "max-batch")
    print(f"tokenmill bench max-batch: batch sizes {args.start}..{args.max_batch_limit}, "
          f"block_size {cfg.model.block_size}, grad_accum {cfg.train.grad_accum_steps}; probes in {out}/probes")
    result = _search_and_write("max-batch", lambda: search_max_batch(probe, args.start, args.max_batch_limit),
                               cfg, args, out)
    if result is None:
        return 1
    b = result["max_batch"]
    if b == 0:
        print("tokenmill bench max-batch: even the first batch size does not fit.")
    else:
        note = " (the search limit: larger may fit; raise --max-batch-limit)" if result["hit_limit"] else ""
        print(f"tokenmill bench max-batch: largest micro-batch that fits: {b}{note}")
    print(f"wrote {out / 'max-batch.json'}")
    return 0 if b else 1


def parse_shapes(text: str) -> list[tuple[str, int, int, int]]:
    shapes = []
    for item in (x for x in text.split(",") if x.strip()):
        parts = item.strip().split(":")
        try:
            nums = [int(p) for p in parts[-3:]]
        except ValueError:
            nums = []
        if len(parts) not in (3, 4) or len(nums) != 3:
            raise C.ConfigError(f"--shapes: expected NAME:LAYERS:HEADS:WIDTH or LAYERS:HEADS:WIDTH, got {item!r}.")
        name = parts[0] if len(parts) == 4 else f"L{nums[0]}-H{nums[1]}-E{nums[2]}"
        shapes.append((name, *nums))
    return shapes


def cmd_max_model(args: argparse.Namespace) -> int:
    from tokenmill.bench.sizing import fmt_params, model_shapes, search_max_model

    cfg, out, probe = _sizing_setup(args, "max-model")
    shapes = model_shapes(cfg, parse_shapes(args.shapes) if args.shapes else None, args.max_params)
    if not shapes:
        raise C.ConfigError("no model shape left to probe (check --shapes / --max-params).")
    print(f"tokenmill bench max-model: {len(shapes)} shapes from {shapes[0]['name']} to {shapes[-1]['name']}, "
          f"batch {cfg.train.batch_size} x block {cfg.model.block_size}; probes in {out}/probes")
    result = _search_and_write("max-model", lambda: search_max_model(shapes, probe), cfg, args, out)
    if result is None:
        return 1
    best = result["largest"]
    if best is None:
        print("tokenmill bench max-model: even the smallest shape does not fit.")
    else:
        note = " (the largest shape probed: larger may fit)" if result["hit_limit"] else ""
        print(f"tokenmill bench max-model: largest that fits: {best['name']} "
              f"({best['n_layer']} layers, {best['n_head']} heads, width {best['n_embd']}, "
              f"{fmt_params(best['params'])} parameters){note}")
    print(f"wrote {out / 'max-model.json'}")
    return 0 if best else 1
