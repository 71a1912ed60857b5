"""``tokenmill bench ladder | max-batch | max-model``.

    tokenmill bench ladder --list
    tokenmill bench ladder rasbt --out runs/rasbt [--smoke] [--steps N] [--set train.device=cuda]
    tokenmill bench ladder my-ladder.toml
    tokenmill bench ladder rasbt --estimate [--gpu a100-40gb]
    tokenmill bench max-batch --preset gpt2-124m --train.precision bf16-autocast
    tokenmill bench max-model my-config.toml --memory.activation_checkpointing 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Optional

from tokenmill import config as C
from tokenmill.config.options import number
from tokenmill.paths import check_text


def register(subparsers) -> None:
    """Add ``bench`` and its sub-commands to the tokenmill parser."""
    from tokenmill.args import add_config_args

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
    lad.add_argument("--steps", type=number(int, ge=1), help="timed steps per rung (overrides [ladder.measure])")
    lad.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="config override applied to the base of every rung (repeatable)")
    lad.add_argument("--timeout", type=number(float, gt=0), help="per-rung time limit in seconds (default from the ladder)")
    lad.add_argument("--quiet", action="store_true", help="do not echo the training output of each rung")
    lad.add_argument("--rungs", metavar="NAME,...",
                     help="run only these rungs (the others are listed as not selected; the switches of those that "
                          "would have run are still carried, so each chosen rung trains its whole-ladder config)")
    lad.add_argument("--estimate", action="store_true",
                     help="predict every rung with `tokenmill estimate` instead of running it (no GPU needed)")
    lad.add_argument("--gpu", help="with --estimate: the GPU to predict for (default: the ladder's reference "
                                   "hardware; `tokenmill estimate --gpus` lists them)")
    lad.set_defaults(func=cmd_ladder)

    for name, help_text in (("max-batch", "largest micro-batch that trains without running out of memory"),
                            ("max-model", "largest model of the config's family (GPT-2/GPT-3 or Llama/Qwen/SmolLM shapes) that trains with these switches")):
        sp = sub.add_parser(name, help=help_text, description=help_text + "; each probe is a subprocess.",
                            allow_abbrev=False)
        add_config_args(sp)
        sp.add_argument("config_file", nargs="?", metavar="CONFIG.toml",
                        help="a TOML config file (the same as --config FILE, applied before any --config)")
        sp.add_argument("--probe-steps", type=number(int), default=3, help="training steps per probe")
        sp.add_argument("--memory-cap-mb", type=number(float, gt=0),
                        help="count a probe whose peak reserved CUDA memory exceeds this as too big")
        sp.add_argument("--timeout", type=number(float, gt=0), default=600.0, help="per-probe time limit in seconds")
        sp.add_argument("--nproc", type=number(int, ge=1), default=1, help="processes per probe (> 1: launched with torchrun)")
        sp.add_argument("--estimate-only", action="store_true",
                        help="answer from `tokenmill estimate` alone, running nothing (no GPU needed; the default "
                             "when no CUDA GPU is visible and train.device is not cpu)")
        sp.add_argument("--gpu", help="the GPU the estimate is for (default: the visible one, else h100-sxm; "
                                      "`tokenmill estimate --gpus` lists them)")
        sp.add_argument("--no-estimate", action="store_true",
                        help="search with real probes only, without starting from the estimate's answer")
        if name == "max-batch":
            sp.add_argument("--start", type=number(int, ge=1), default=1, help="first batch size probed")
            sp.add_argument("--max-batch-limit", type=number(int, ge=1), default=1024, help="largest batch size probed")
            sp.set_defaults(func=cmd_max_batch)
        else:
            sp.add_argument("--shapes", help="custom shapes 'NAME:LAYERS:HEADS:WIDTH,...' or 'LAYERS:HEADS:WIDTH,...'")
            sp.add_argument("--max-params", type=number(float, gt=0), help="leave out shapes above this many parameters")
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


def chosen_rungs(ladder, names: Optional[str]) -> Optional[set[str]]:
    """``--rungs a,b``: the set of rung names, each checked against the ladder (None: every rung)."""
    if names is None:
        return None
    chosen = {n.strip() for n in names.split(",") if n.strip()}
    known = [r.name for r in ladder.rungs]
    for name in sorted(chosen):
        if name not in known:
            raise C.ConfigError(f"--rungs: ladder '{ladder.name}' has no rung '{name}'.{C._closest(name, known)} "
                                f"Its rungs: {', '.join(known)}.")
    if not chosen:
        raise C.ConfigError("--rungs: give at least one rung name (e.g. --rungs baseline,compile).")
    return chosen


def list_ladders() -> str:
    from tokenmill.bench.load import load_ladder
    from tokenmill.bench.schema import shipped_ladders

    lines = []
    for name in shipped_ladders():
        lad = load_ladder(name)
        lines.append(f"{name}  ({len(lad.rungs)} rungs, headline {lad.headline})\n    {lad.description}")
    return "\n".join(lines)


def cmd_ladder(args: argparse.Namespace) -> int:
    from tokenmill.bench.ladder import run_ladder
    from tokenmill.bench.load import load_ladder

    if args.list:
        print(list_ladders())
        return 0
    if not args.name:
        raise C.ConfigError("give a ladder name or a ladder .toml path; `tokenmill bench ladder --list` shows them.")
    if args.steps is not None and args.steps < 1:
        raise C.ConfigError("--steps must be >= 1.")
    ladder = load_ladder(args.name)
    cli_set = parse_sets(args.set)
    if args.estimate:
        return _estimate_ladder(args, ladder, cli_set)
    if args.gpu:
        raise C.ConfigError("--gpu goes with --estimate (a real run uses the GPU it runs on).")
    out = Path(check_text(args.out, "--out")) if args.out else Path("runs") / f"bench-{ladder.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = run_ladder(ladder, out, smoke=args.smoke, timed_steps=args.steps, cli_set=cli_set,
                     timeout_s=args.timeout, echo_runs=not args.quiet, only=chosen_rungs(ladder, args.rungs))
    failed = [r["name"] for r in doc["rungs"] if r["status"] == "failed"]
    if failed:
        print(f"tokenmill bench: {len(failed)} rung(s) failed: {', '.join(failed)} (reasons in the table)")
    return 1 if failed else 0


def _estimate_ladder(args: argparse.Namespace, ladder, cli_set: dict[str, str]) -> int:
    from tokenmill.bench.predict import predict_ladder

    if args.smoke or args.steps is not None or args.timeout is not None:
        raise C.ConfigError("--smoke / --steps / --timeout have no meaning with --estimate (nothing runs).")
    out = Path(check_text(args.out, "--out")) if args.out else Path("runs") / f"estimate-{ladder.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    doc = predict_ladder(ladder, out, args.gpu, cli_set)
    failed = [r["name"] for r in doc["rungs"] if r["status"] == "failed"]
    if failed:
        print(f"tokenmill bench: {len(failed)} rung(s) could not be estimated: {', '.join(failed)}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------------------------
# sizing


def sizing_config(args: argparse.Namespace) -> C.Config:
    """The config of a sizing search: --preset, the positional config file, --config files, options."""
    from tokenmill.args import config_from_args

    if args.config_file:
        args.config = [args.config_file, *args.config]
        args.config_file = None
    return config_from_args(args)


def _sizing_setup(args: argparse.Namespace, kind: str):
    """(config, output folder, probe, estimate probe or None, whether only the estimate answers)."""
    from tokenmill.bench.sizing import EstimateProbe, SubprocessProbe

    if args.resume:
        raise C.ConfigError(f"--resume has no meaning for bench {kind}.")
    if args.probe_steps < 2:
        raise C.ConfigError("--probe-steps must be >= 2 (the first step is warm-up).")
    if args.estimate_only and args.no_estimate:
        raise C.ConfigError("--estimate-only and --no-estimate exclude each other.")
    cfg = sizing_config(args)
    out = Path(args.run_dir) if args.run_dir else Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    launcher = "torchrun" if args.nproc > 1 else None
    what = "batch" if kind == "max-batch" else "model"
    probe = SubprocessProbe(cfg, out, what, args.probe_steps, args.timeout, args.memory_cap_mb, launcher, args.nproc)
    gpu, visible = _estimate_gpu(args)
    on_cpu = cfg.train.device == "cpu"
    only = args.estimate_only or (not visible and not on_cpu and not args.no_estimate)
    if only and not args.estimate_only:
        print(f"tokenmill bench {kind}: no CUDA GPU is visible: answering from the estimate for {gpu} "
              "(as --estimate-only; --train.device cpu probes the CPU instead)")
    guide = None
    if only or not (args.no_estimate or on_cpu):
        guide = EstimateProbe(cfg, what, gpu, args.nproc, args.memory_cap_mb)
    return cfg, out, probe, guide, only


def _estimate_gpu(args: argparse.Namespace) -> tuple[str, bool]:
    """(the GPU estimates are for, whether a CUDA GPU is visible): --gpu, else the visible one when the
    table knows it, else h100-sxm."""
    import torch

    visible = torch.cuda.is_available()
    if args.gpu:
        return args.gpu, visible
    if visible:
        from tokenmill.estimate import gpu_spec

        name = torch.cuda.get_device_name()
        try:
            return gpu_spec(name).key, True
        except C.ConfigError:
            print(f"tokenmill bench: {name} is not in the estimate's GPU table; estimates are for an h100-sxm")
    return "h100-sxm", visible


def _guess(kind: str, guide, search_fn) -> Optional[Any]:
    """The estimate's answer, printed; None when the estimate cannot say."""
    from tokenmill.bench.sizing import SizingError

    try:
        res = search_fn(guide)
    except SizingError as e:
        print(f"tokenmill bench {kind}: no estimate ({e}); searching with probes only")
        return None
    return res


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

    cfg, out, probe, guide, only = _sizing_setup(args, "max-batch")
    quiet = lambda line: None  # noqa: E731
    est = None
    if guide is not None:
        est = _guess("max-batch", guide, lambda g: search_max_batch(g, args.start, args.max_batch_limit,
                                                                     log=print if only else quiet))
        if est is not None:
            print(f"tokenmill bench max-batch: the estimate for {guide.spec.name}: largest micro-batch "
                  f"{est['max_batch']}" + (" (the limit)" if est["hit_limit"] else ""))
    if only:
        result = est and {**est, "estimate_only": True, "gpu": guide.spec.name}
        if result is not None:
            result = {"kind": "max-batch", **result, **_context(cfg, args)}
            from tokenmill.bench.sizing import write_result

            write_result(result, out / "max-batch.json")
    else:
        where = f"; probes in {out}/probes"
        print(f"tokenmill bench max-batch: batch sizes {args.start}..{args.max_batch_limit}, "
              f"block_size {cfg.model.block_size}, grad_accum {cfg.train.grad_accum_steps}{where}")
        guess = est["max_batch"] if est and est["max_batch"] else None
        result = _search_and_write("max-batch", lambda: search_max_batch(probe, args.start, args.max_batch_limit,
                                                                         guess=guess), cfg, args, out)
        if result is not None and est is not None:
            result["estimate"] = {k: est[k] for k in ("max_batch", "hit_limit")} | {"gpu": guide.spec.name}
            from tokenmill.bench.sizing import write_result

            write_result(result, out / "max-batch.json")
    if result is None:
        return 1
    b = result["max_batch"]
    src = " (estimated, nothing run)" if only else ""
    if b == 0:
        print(f"tokenmill bench max-batch: even the first batch size does not fit{src}.")
    else:
        note = " (the search limit: larger may fit; raise --max-batch-limit)" if result["hit_limit"] else ""
        print(f"tokenmill bench max-batch: largest micro-batch that fits: {b}{note}{src}")
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

    cfg, out, probe, guide, only = _sizing_setup(args, "max-model")
    shapes = model_shapes(cfg, parse_shapes(args.shapes) if args.shapes else None, args.max_params)
    if not shapes:
        raise C.ConfigError("no model shape left to probe (check --shapes / --max-params).")
    print(f"tokenmill bench max-model: {len(shapes)} shapes from {shapes[0]['name']} to {shapes[-1]['name']}, "
          f"batch {cfg.train.batch_size} x block {cfg.model.block_size}"
          + ("" if only else f"; probes in {out}/probes"))
    quiet = lambda line: None  # noqa: E731
    est = None
    if guide is not None:
        est = _guess("max-model", guide, lambda g: search_max_model(shapes, g, log=print if only else quiet))
        if est is not None:
            name = est["largest"]["name"] if est["largest"] else "none"
            print(f"tokenmill bench max-model: the estimate for {guide.spec.name}: largest that fits: {name}")
    if only:
        result = None
        if est is not None:
            from tokenmill.bench.sizing import write_result

            result = {"kind": "max-model", **est, "estimate_only": True, "gpu": guide.spec.name, **_context(cfg, args)}
            write_result(result, out / "max-model.json")
    else:
        guess = shapes.index(est["largest"]) if est and est["largest"] else None
        result = _search_and_write("max-model", lambda: search_max_model(shapes, probe, guess=guess), cfg, args, out)
        if result is not None and est is not None:
            from tokenmill.bench.sizing import write_result

            result["estimate"] = {"largest": est["largest"]["name"] if est["largest"] else None, "gpu": guide.spec.name}
            write_result(result, out / "max-model.json")
    if result is None:
        return 1
    best = result["largest"]
    if best is None:
        print("tokenmill bench max-model: even the smallest shape does not fit.")
    else:
        note = " (the largest shape probed: larger may fit)" if result["hit_limit"] else ""
        print(f"tokenmill bench max-model: largest that fits: {best['name']} "
              f"({best['n_layer']} layers, {best['n_head']} heads, width {best['n_embd']}, "
              f"{fmt_params(best['params'])} parameters){note}" + (" (estimated, nothing run)" if only else ""))
    print(f"wrote {out / 'max-model.json'}")
    return 0 if best else 1
