"""The part ``first``: what one 15-minute loan of a GPU can say, most valuable first (benchmarks/README.md).

Pieces, in order, each with its own time cap (a piece still running at its cap, or at the part's deadline,
is stopped and recorded with the reason, and the next one starts):

1. ``environment``: GPU, driver, CUDA, cuDNN, Triton and torch versions, the commit, whether the tree had
   local changes (unknown without ``.git``; the source fingerprint says what ran), ``nvidia-smi``;
2. ``gpt2-naive``: GPT-2 124M at T=1024, the ``best`` ladder's baseline rung;
3. ``gpt2-fastest``: the same with the ``best`` ladder's fastest rung's switches (compile, bf16 autocast,
   padded vocabulary, chunked loss, ...; no max-autotune, no recomputation) at the largest batch that
   ``tokenmill estimate`` says fits in 85% of the GPU's memory (no search on the GPU);
4. ``rasbt-baseline`` and 5. ``rasbt-last``: the ``rasbt`` ladder's baseline and its last single-GPU rung
   (the seed's ratio: 142,156 / 12,525 = 11.35x on an A100);
6. ``llama-compiled``: Llama 3.2 1B compiled in bf16 autocast (the ``llama`` ladder's compile rung).

Every measured piece records tokens/s, MFU, peak allocated and reserved memory (and the whole-run peaks and
compile time where the trainer reports them) beside ``tokenmill estimate``'s figures for the same config on
the same GPU, with the error in %. The manifest ``first.json`` and ``first.md`` are rewritten after every
piece. ``python benchmarks/first.py pick-batch CONFIG GPU OUT.json [--smoke]`` is the batch choice (a step).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))  # session_lib beside this file

from session_lib import Stopped, fastest_best_sets, read_ladder, slice_ladder  # noqa: E402

SEED_RASBT = (12_525, 142_156)  # tokens/s of the rasbt ladder's baseline and its last single-GPU rung (A100)
MEMORY_FRACTION = 0.85  # of the GPU's memory the estimate may fill when choosing the batch
TIMED_STEPS = 20  # timed steps per piece (the ladders' own 40-50 cost time a loan does not have; 4-5 windows)
RUNG_KEYS = ("tokens_per_sec", "mfu", "step_time_ms", "peak_alloc_mb", "peak_reserved_mb", "peak_alloc_mb_run",
             "peak_reserved_mb_run", "compile_s", "gpu_name")


@dataclass
class Piece:
    name: str
    what: str
    cap_s: float  # the most it may take (the part's deadline may cut it sooner)
    est_s: float  # what it should take on one H100 (its start, compile and timed steps)
    run: Callable[[Any, dict[str, Any], float], None]  # (session, record, deadline)


def part_first(s: Any) -> None:
    """Run the pieces in order; the manifest and ``first.md`` are rewritten after each."""
    pieces: dict[str, dict[str, Any]] = {}
    s.results["pieces"] = pieces
    table = s.out / "first.md"
    for p in PIECES:
        rec: dict[str, Any] = {"what": p.what, "cap_s": p.cap_s, "status": "running"}
        pieces[p.name] = rec
        limit = min(p.cap_s, s.left())
        if limit < 15:
            rec.update(status="not run", reason=f"the part's time budget is spent ({max(0, s.left()):.0f} s left)")
            continue
        t0 = time.monotonic()
        try:
            p.run(s, rec, t0 + limit)
        except Stopped as e:
            rec.update(status="interrupted", reason=f"the part was stopped by {e} during this piece")
            raise
        except Exception as e:  # noqa: BLE001 - a broken piece must not cost the others
            rec.update(status="failed", reason=f"{type(e).__name__}: {e}")
        finally:
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            s.log(f"[first] {p.name}: {rec['status']}" + (f" ({rec['reason']})" if rec.get("reason") else ""))
            write_table(table, pieces, s)
            s.save()
    if table not in s.top:
        s.top.append(table)


def left(deadline: float) -> float:
    return deadline - time.monotonic()


# ------------------------------------------------------------------------------------------------
# The pieces


def piece_environment(s: Any, rec: dict[str, Any], deadline: float) -> None:
    import shutil

    env = s.results.get("env") or {}
    keys = ("gpu_names", "gpu_capability", "driver", "cuda", "cudnn", "triton", "torch", "python", "git_commit",
            "git_dirty", "git_dirty_note", "source_fingerprint")
    rec.update({k: env.get(k) for k in keys})
    if shutil.which("nvidia-smi"):
        s.step("nvidia-smi", ["nvidia-smi"], min(30, left(deadline)), stdout_file=s.work / "nvidia-smi.txt")
        s.keep(s.work / "nvidia-smi.txt", "first-nvidia-smi.txt")
        rec["nvidia_smi"] = "first-nvidia-smi.txt"
    else:
        rec["nvidia_smi"] = "not found on this machine"
    rec["status"] = "measured" if env.get("torch") else "failed"
    if not env.get("torch"):
        rec["reason"] = env.get("probe_error") or env.get("error") or "the environment probe found no torch"


def one_rung(ladder: str, rung: str, steps: Optional[int] = TIMED_STEPS) -> Callable[[Any, dict[str, Any], float], None]:
    """A piece measuring ``rung`` of the shipped ``ladder``, with the switches the ladder carries to it
    (``steps``: timed steps instead of the ladder's own; None: the ladder's)."""

    def run(s: Any, rec: dict[str, Any], deadline: float) -> None:
        tree = slice_ladder(ladder, [rung], [], cuda_here(s), s.smoke)
        measure_tree(s, rec, deadline, tree, f"{ladder}-{rung}", steps)

    return run


def piece_gpt2_fastest(s: Any, rec: dict[str, Any], deadline: float) -> None:
    from tokenmill import config as C

    tree = read_ladder("best")
    sets, names = fastest_best_sets(cuda_here(s), s.smoke)
    cfg_path = s.work / "gpt2-fastest-config.toml"
    C.save(C.resolve(tree["ladder"]["base_preset"], overrides=sets, overrides_from_string=False), cfg_path)
    gpu = (s.results.get("env", {}).get("gpu_names") or ["h100-sxm"])[0]
    sizing = s.work / "batch.json"
    s.step("pick the batch (tokenmill estimate)", [sys.executable, str(Path(__file__).resolve()), "pick-batch",
                                                   str(cfg_path), gpu, str(sizing), *(["--smoke"] if s.smoke else [])],
           min(60, left(deadline)))
    choice = json.loads(sizing.read_text()) if sizing.exists() else {"batch": None, "reason": "no answer in time"}
    rec["batch_choice"] = choice
    if choice.get("batch"):
        sets["train.batch_size"] = choice["batch"]
    head = dict(tree["ladder"], base=sets)
    head["description"] = (f"The best ladder's fastest rung as carried here ({', '.join(names)}; no max-autotune, "
                           f"no recomputation) at batch {sets['train.batch_size']} ({choice.get('reason')}).\n"
                           + tree["ladder"]["description"])
    rung = {"name": "fastest", "explain": "Every speed switch of the best ladder at the largest batch the "
                                           "estimate says fits."}
    measure_tree(s, rec, deadline, {"ladder": head, "rung": [rung]}, "gpt2-fastest")
    batch = sets["train.batch_size"]
    if rec["status"] == "failed" and "memory" in str(rec.get("reason")) and batch > 8 and left(deadline) > 60:
        # the estimate was too kind: once more at half the batch
        rec["first_try"] = {k: rec.get(k) for k in ("status", "reason", "batch_size", "estimate")}
        head["base"] = {**sets, "train.batch_size": batch // 2}
        measure_tree(s, rec, deadline, {"ladder": head, "rung": [rung]}, "gpt2-fastest-retry")


def piece_rasbt_last(s: Any, rec: dict[str, Any], deadline: float) -> None:
    tree = read_ladder("rasbt")
    last = [r["name"] for r in tree["rung"] if not r.get("launcher") and r.get("requires") != "multi-gpu"][-1]
    rec["rung"] = last
    one_rung("rasbt", last)(s, rec, deadline)
    base = s.results["pieces"].get("rasbt-baseline", {}).get("tokens_per_sec")
    if base and rec.get("tokens_per_sec"):
        rec["ratio_to_baseline"] = round(rec["tokens_per_sec"] / base, 2)
    rec["seed_ratio_a100"] = round(SEED_RASBT[1] / SEED_RASBT[0], 2)


# ------------------------------------------------------------------------------------------------
# One-rung ladders: run, read back


def measure_tree(s: Any, rec: dict[str, Any], deadline: float, tree: dict[str, Any], label: str,
                 steps: Optional[int] = TIMED_STEPS) -> None:
    """Run the one-rung ladder ``tree`` (``tokenmill bench ladder``) within the piece's time and fill ``rec``
    from its ladder.json: the measurement, the estimate beside it, the error in %."""
    from tokenmill.config.toml_out import dumps

    if s.smoke and not cuda_here(s):
        tree = cpu_smoke(tree)
    limit = left(deadline)
    rung_limit = max(10.0, limit - 25)  # the ladder's own start; it then stops its rung with the reason
    tree["ladder"]["timeout_s"] = rung_limit
    path = s.work / f"{label}.toml"
    path.write_text(dumps(tree))
    out = s.work / label
    args = ["bench", "ladder", path, "--out", out, "--quiet", "--timeout", round(rung_limit)]
    args += ["--steps", steps] if steps and not s.smoke else []
    s.tm(f"ladder {label}", args + (["--smoke"] if s.smoke else []), limit)
    step = s.steps[-1]
    rec["ladder_json"] = f"{label}/ladder.json (in the details archive)"
    rung = read_rung(out / "ladder.json")
    if rung is None:
        why = "stopped at its cap" if step.get("timed_out") else f"exit {step.get('rc')}"
        rec.update(status="cut" if step.get("timed_out") else "failed",
                   reason=f"the ladder wrote no result ({why} after {step.get('wall_s')} s of {limit:.0f} s)")
        return
    rec.update(rung_record(rung))
    if step.get("timed_out") and rec["status"] != "measured":
        rec.update(status="cut", reason=f"stopped at its cap of {limit:.0f} s; {rec.get('reason')}")


def read_rung(path: Path) -> Optional[dict[str, Any]]:
    try:
        rungs = json.loads(path.read_text())["rungs"]
    except (OSError, ValueError, KeyError):
        return None
    return rungs[0] if rungs and rungs[0].get("status") in ("measured", "failed", "skipped") else None


def rung_record(rung: dict[str, Any]) -> dict[str, Any]:
    """The figures of a measured rung beside the estimate for the same config (error = estimate / measured - 1)."""
    summary = rung.get("summary") or {}
    train = (rung.get("config") or {}).get("train") or {}
    out: dict[str, Any] = {"status": rung["status"], "reason": rung.get("reason"), "rung_wall_s": rung.get("wall_s"),
                           "batch_size": train.get("batch_size"), "precision": train.get("precision")}
    out.update({k: summary.get(k) for k in RUNG_KEYS})
    out["estimate"] = rung.get("estimate")
    if rung.get("estimate_reason"):
        out["estimate_reason"] = rung["estimate_reason"]
    errors = rung.get("estimate_error_vs_measured") or {}
    out["estimate_error_pct"] = {k: round(100 * v, 1) for k, v in errors.items() if v is not None}
    return out


def cpu_smoke(tree: dict[str, Any]) -> dict[str, Any]:
    """For SMOKE=1 on a CPU: the rung measured eagerly (compile off, no CUDA requirement), so every piece still
    runs its whole path with tiny shapes."""
    head = dict(tree["ladder"], base={**tree["ladder"].get("base", {}), "compile.enabled": False})
    head.pop("requires", None)
    rungs = []
    for r in tree["rung"]:
        r = {k: v for k, v in r.items() if k != "requires"}
        r["set"] = {k: v for k, v in r.get("set", {}).items() if not k.startswith("compile.")}
        rungs.append(r)
    return {"ladder": head, "rung": rungs}


def cuda_here(s: Any) -> bool:
    return bool((s.results.get("env") or {}).get("cuda_available"))


# ------------------------------------------------------------------------------------------------
# The batch: the largest that the estimate says fits


def pick_batch(cfg: Any, gpu: str, fraction: float = MEMORY_FRACTION, multiple: int = 8,
               limit: int = 1024) -> dict[str, Any]:
    """The largest batch (a multiple of ``multiple``) whose estimated peak reserved memory is within
    ``fraction`` of ``gpu``'s: two estimates give memory's fixed part and its part per sample (linear in the
    batch), a third checks the answer (stepping down while it does not fit)."""
    from tokenmill.bench.sizing import with_overrides
    from tokenmill.estimate import estimate, gpu_spec

    spec = gpu_spec(gpu)
    cap = fraction * spec.memory_mb
    probes: dict[int, float] = {}

    def reserved(b: int) -> float:
        probes[b] = round(estimate(with_overrides(cfg, {"train.batch_size": b}), spec, 1).peak_reserved_mb, 1)
        return probes[b]

    lo, hi = multiple, 4 * multiple
    per_sample = (reserved(hi) - reserved(lo)) / (hi - lo)
    fixed = probes[lo] - per_sample * lo
    batch = limit if per_sample <= 0 else int((cap - fixed) / per_sample) // multiple * multiple
    batch = max(multiple, min(limit, batch))
    for _ in range(4):
        if reserved(batch) <= cap or batch <= multiple:
            break
        batch = max(multiple, batch - multiple)
    fits = probes[batch] <= cap
    return {"batch": batch if fits else None, "gpu": spec.name, "cap_mb": round(cap), "estimates_mb": probes,
            "reason": (f"the largest multiple of {multiple} whose estimated peak reserved memory "
                       f"({probes[batch]:,.0f} MiB) is within {fraction:.0%} of the {spec.name}'s"
                       if fits else f"even batch {batch} is estimated over {fraction:.0%} of the GPU's memory")}


def main(argv: list[str]) -> int:
    from tokenmill import atomic
    from tokenmill import config as C

    if len(argv) < 4 or argv[0] != "pick-batch":
        print("usage: first.py pick-batch CONFIG.toml GPU OUT.json [--smoke]", file=sys.stderr)
        return 2
    cfg = C.resolve(config_files=[argv[1]])
    if "--smoke" in argv:  # tiny shapes: the same path, in seconds on a CPU
        cfg = C.validate(C.apply_overrides(cfg, {"model.n_layer": 2, "model.n_head": 2, "model.n_embd": 64,
                                                 "model.block_size": 64}))
    try:
        answer = pick_batch(cfg, argv[2])
    except Exception as e:  # noqa: BLE001 - the piece then runs the ladder's own batch, saying why
        answer = {"batch": None, "reason": f"the estimate failed ({type(e).__name__}: {e}); the ladder's batch"}
    atomic.write_json(argv[3], answer)
    print(json.dumps(answer))
    return 0


# ------------------------------------------------------------------------------------------------
# first.md


def write_table(path: Path, pieces: dict[str, dict[str, Any]], s: Any) -> None:
    from tokenmill import atomic

    def num(v: Any, fmt: str = "{:,.0f}") -> str:
        return "" if v is None or (isinstance(v, float) and not math.isfinite(v)) else fmt.format(v)

    env = (s.results.get("env") or {})
    lines = [f"# first: {', '.join(env.get('gpu_names') or ['no GPU'])}, torch {env.get('torch')}, CUDA "
             f"{env.get('cuda')}, cuDNN {env.get('cudnn')}, Triton {env.get('triton')}, driver {env.get('driver')}; "
             f"commit {s.commit[:12]}" + (" (SMOKE: tiny shapes, figures mean nothing)" if s.smoke else ""), "",
             "| piece | status | batch | tokens/s | MFU | peak alloc MB | peak reserved MB | est. tokens/s | "
             "est. reserved MB | error tokens/s, reserved | compile s | wall s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in pieces.items():
        est = r.get("estimate") or {}
        err = r.get("estimate_error_pct") or {}
        errors = ", ".join(num(err.get(k), "{:+.1f}%") or "-" for k in ("tokens_per_sec", "peak_reserved_mb"))
        errors = "" if errors == "-, -" else errors
        status = r["status"] + (f": {r['reason']}" if r.get("reason") and r["status"] != "measured" else "")
        lines.append(f"| {name} | {status[:160]} | {num(r.get('batch_size'))} | {num(r.get('tokens_per_sec'))} | "
                     f"{num(r.get('mfu'), '{:.1%}')} | {num(r.get('peak_alloc_mb'))} | {num(r.get('peak_reserved_mb'))} | "
                     f"{num(est.get('tokens_per_sec'))} | {num(est.get('peak_reserved_mb'))} | {errors} | "
                     f"{num(r.get('compile_s'), '{:.1f}')} | {num(r.get('wall_s'), '{:.0f}')} |")
    atomic.write_text(path, "\n".join(lines) + "\n")


PIECES = [
    Piece("environment", "GPU, driver, CUDA, cuDNN, Triton, torch, commit, nvidia-smi", 45, 15, piece_environment),
    Piece("gpt2-naive", "GPT-2 124M, T=1024: the best ladder's baseline rung", 75, 25, one_rung("best", "baseline")),
    Piece("gpt2-fastest", "GPT-2 124M, T=1024: the best ladder's fastest switches at the largest batch that fits "
          "(by estimate)", 190, 100, piece_gpt2_fastest),
    Piece("rasbt-baseline", "the rasbt ladder's baseline rung (fp32, hand-written modules)", 75, 30,
          one_rung("rasbt", "baseline")),
    Piece("rasbt-last", "the rasbt ladder's last single-GPU rung (seed: 11.35x the baseline on an A100)", 130, 70,
          piece_rasbt_last),
    Piece("llama-compiled", "Llama 3.2 1B compiled, bf16 autocast: the llama ladder's compile rung", 200, 110,
          one_rung("llama", "compile", steps=None)),
]
FIRST_EST_S = sum(p.est_s for p in PIECES)  # about 6 minutes on one H100, packing included

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
