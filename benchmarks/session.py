"""The parts of a GPU session (run by ``benchmarks/gpu_session.sh``; see benchmarks/README.md).

Each part fits one call on the lent machine: its steps share a budget (``PART_BUDGET_S``, under the
call's 10 minutes) and each step is stopped at the part's deadline or its own cap; a ladder's rungs
run with a per-rung time limit chosen so that all of them fit. What a part leaves in the output folder
is what the device returns: at most 8 files, each at most 16 MiB, none in a sub-folder:

- ``PART.json``: the manifest (part, commit, environment, each step's command, exit status and time,
  the files, the part's headline results);
- ``PART.log``: every step's output;
- ``PART-details.tar.gz``: everything else the steps wrote (rung run folders, metrics, traces), less
  checkpoints; when it would exceed 16 MiB its largest members are left out, and the manifest names them;
- up to 5 result files (a ladder's ``PART-ladder.json/.md/.png``, profiles, summaries).

A ladder part may run a slice of a shipped ladder: the chosen rungs, with the switches of the rungs
before them in the base, as the ladder itself carries them; a *deferred* rung's switch is left out
(it runs in a later part). ``SMOKE=1`` (``--smoke``) runs every part with tiny shapes on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # session_lib beside this file

from session_lib import MAX_BYTES, MAX_FILES, copy_log, layout, pack, read_ladder, runnable_here, slice_ladder  # noqa: E402, F401

PART_BUDGET_S = 510.0  # the steps of a part; packing follows (the part ends within 9 minutes)
TINY = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "64", "--model.block_size", "64",
        "--train.batch_size", "2"]
BEST_DEFERRED = ["compile-max-autotune"]  # minutes of autotuning: measured alone, in its own part


@dataclass
class Part:
    """One device call's worth of measurements (``ladder``/``rungs``: the ladder rungs it measures)."""

    name: str
    what: str
    goal: str
    run: Callable[[Session], None]
    ladder: Optional[str] = None
    rungs: Optional[Callable[[list[str]], list[str]]] = None


@dataclass
class Session:
    """The state of one part's run: its folders, deadline, steps and results."""

    part: str
    out: Path
    commit: str
    smoke: bool
    work: Path = field(init=False)
    start: float = field(default_factory=time.monotonic)
    steps: list[dict[str, Any]] = field(default_factory=list)
    top: list[Path] = field(default_factory=list)  # result files copied into out
    results: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work = Path(os.environ.get("TOKENMILL_SESSION_WORK", "/tmp/tokenmill-session")) / self.part
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.log_path = self.work / f"{self.part}.log"

    def left(self) -> float:
        return PART_BUDGET_S - (time.monotonic() - self.start)

    def log(self, text: str) -> None:
        print(text, flush=True)
        with open(self.log_path, "a") as f:
            f.write(text + "\n")

    def step(self, name: str, argv: list[str], cap_s: float, stdout_file: Optional[Path] = None) -> int:
        """Run ``argv`` (its own process group) for at most ``cap_s`` and the part's remaining time.
        At the limit it gets SIGINT (tokenmill stops its rung processes and exits), then SIGKILL."""
        limit = min(cap_s, self.left())
        rec: dict[str, Any] = {"name": name, "argv": argv, "limit_s": round(limit, 1)}
        self.steps.append(rec)
        if limit < 15:
            rec.update(rc=None, skipped="the part's time budget is spent")
            self.log(f"[{self.part}] {name}: skipped, the part's time budget is spent")
            return -1
        self.log(f"[{self.part}] {name} (limit {limit:.0f} s): {' '.join(argv)}")
        t0 = time.monotonic()
        with open(self.log_path, "a") as log:
            out = open(stdout_file, "w") if stdout_file else log
            proc = subprocess.Popen(argv, stdout=out, stderr=log, cwd=ROOT, start_new_session=True,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"))
            timed_out = False
            try:
                proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                _stop(proc)
            finally:
                if stdout_file:
                    out.close()
        rec.update(rc=proc.returncode, wall_s=round(time.monotonic() - t0, 1), timed_out=timed_out)
        self.log(f"[{self.part}] {name}: exit {proc.returncode} after {rec['wall_s']} s"
                 + (" (stopped at its time limit)" if timed_out else ""))
        return proc.returncode

    def tm(self, name: str, args: list[str], cap_s: float, stdout_file: Optional[Path] = None) -> int:
        return self.step(name, [sys.executable, "-m", "tokenmill", *map(str, args)], cap_s, stdout_file)

    def keep(self, src: Path, name: str) -> None:
        """Copy a result file into the output folder (as ``name``) if it exists."""
        if src.is_file():
            dst = self.out / name
            shutil.copyfile(src, dst)
            self.top.append(dst)


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ------------------------------------------------------------------------------------------------
# Ladders, whole or sliced


def ladder_step(s: Session, name: str, rung_timeout_s: float, rungs: Optional[list[str]] = None,
                deferred: Optional[list[str]] = None, fold_all: bool = False) -> None:
    """Run (a slice of) a shipped ladder; keep its JSON, Markdown and figure. The per-rung limit is
    ``rung_timeout_s``, lowered so that the rungs that will run here all fit in the part's time left."""
    import tomli_w

    cuda = cuda_available()
    tree = read_ladder(name)
    if rungs:
        tree = slice_ladder(name, rungs, deferred or [], cuda, s.smoke, fold_all)
    will_run = [r for r in tree["rung"] if runnable_here(r, tree, cuda, s.smoke)]
    timeout = max(30.0, min(rung_timeout_s, (s.left() - 40) / max(1, len(will_run))))
    s.results["rung_timeout_s"] = round(timeout)
    target = name
    if rungs:
        tree["ladder"]["timeout_s"] = timeout
        path = s.work / f"{s.part}-ladder.toml"
        path.write_text(tomli_w.dumps(tree))
        target = str(path)
    out = s.work / s.part
    args = ["bench", "ladder", target, "--out", out, "--quiet", "--timeout", round(timeout)]
    s.tm(f"ladder {name}", args + (["--smoke"] if s.smoke else []), cap_s=len(tree["rung"]) * timeout + 60)
    finish_ladder(out, s)
    for ext in ("json", "md", "png"):
        s.keep(out / f"ladder.{ext}", f"{s.part}-ladder.{ext}")


def finish_ladder(out: Path, s: Session) -> None:
    """After a ladder stopped at its limit: the Markdown and figure from the rungs it finished."""
    doc_path = out / "ladder.json"
    if not doc_path.exists():
        return
    doc = json.loads(doc_path.read_text())
    s.results["rungs"] = {r["name"]: {"status": r["status"], "reason": r.get("reason"),
                                      **{k: (r.get("summary") or {}).get(k) for k in
                                         ("tokens_per_sec", "mfu", "peak_alloc_mb", "peak_reserved_mb")}}
                          for r in doc["rungs"]}
    if (out / "ladder.md").exists():
        return
    try:
        from tokenmill.bench import report

        report.derive(doc)
        report.write_outputs(doc, out, s.log)
        s.results["note"] = "the ladder was stopped at the part's limit; ladder.md/.png made from its finished rungs"
    except Exception as e:  # noqa: BLE001 - the JSON is what matters; say why the rest is missing
        s.results["note"] = f"the ladder was stopped; ladder.md could not be made: {e}"


def cuda_available() -> bool:
    p = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                       capture_output=True, text=True, timeout=120)
    return p.stdout.strip().endswith("True")


# ------------------------------------------------------------------------------------------------
# The parts


def part_check(s: Session) -> None:
    """The CUDA tier only (``pytest -m gpu``, every test run: no -x), with the GPU's facts."""
    if shutil.which("nvidia-smi"):
        s.step("nvidia-smi", ["nvidia-smi"], 30, stdout_file=s.work / "nvidia-smi.txt")
    junit = s.work / "junit.xml"
    s.step("pytest -m gpu", [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rfEsxX", "-p", "no:cacheprovider",
                             f"--junitxml={junit}", "tests"], 480, stdout_file=s.work / "pytest.txt")
    s.results["pytest"] = junit_counts(junit)
    s.keep(s.work / "pytest.txt", "check-pytest.txt")
    s.keep(junit, "check-junit.xml")
    s.keep(s.work / "nvidia-smi.txt", "check-nvidia-smi.txt")


def junit_counts(path: Path) -> dict[str, Any]:
    """Totals and the names of the tests that did not pass, from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET

    if not path.exists():
        return {"error": "pytest wrote no report (stopped before the end?)"}
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    out: dict[str, Any] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    for kind in ("failure", "error", "skipped"):  # test id -> message
        out[f"{kind}_tests"] = {f"{c.get('classname')}::{c.get('name')}": (c.find(kind).get("message") or "")[:300]
                     for c in suite.iter("testcase") if c.find(kind) is not None}
    return out


def part_memory(s: Session) -> None:
    """The book's memory configuration (goal: <= 5 GB peak at <= 1.5 x the baseline's step time) and
    the book-memory ladder's baseline rung it is compared with."""
    run = s.work / "book-memory-5gb"
    s.tm("book-memory-5gb", ["train", "--preset", "gpt2-large", "--config", "benchmarks/configs/book-memory-5gb.toml",
                             "--run-dir", run, "--log.progress", "plain", *smoke_args(s)], 240)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    if (run / "summary.json").exists():
        from tokenmill.config import tomllib

        doc = {"kind": "train", "summary": json.loads((run / "summary.json").read_text()),
               "config": tomllib.loads((run / "config.toml").read_text()), "environment": s.results.get("env")}
        (s.work / "book-memory-5gb.json").write_text(json.dumps(doc, indent=2))
        s.keep(s.work / "book-memory-5gb.json", "book-memory-5gb.json")
    ladder_step(s, "book-memory", 150, rungs=["baseline"])
    s.results["goal"] = memory_goal(run, s.work / s.part / "ladder.json")


def memory_goal(run: Path, ladder_json: Path) -> dict[str, Any]:
    """Peak allocated memory of the 5 GB configuration against 5 GiB, and its step time against the
    book-memory baseline rung's (same model, batch and context)."""
    if not (run / "summary.json").exists():
        return {"error": "the book-memory-5gb run wrote no summary"}
    mine = json.loads((run / "summary.json").read_text())
    out: dict[str, Any] = {"peak_alloc_mb": mine.get("peak_alloc_mb"), "limit_mb": 5 * 1024,
                           "tokens_per_sec": mine.get("tokens_per_sec")}
    if out["peak_alloc_mb"] is not None:
        out["peak_ok"] = out["peak_alloc_mb"] <= out["limit_mb"]
    base = None
    if ladder_json.exists():
        rungs = json.loads(ladder_json.read_text())["rungs"]
        base = next((r.get("summary") for r in rungs if r["name"] == "baseline" and r["status"] == "measured"), None)
    if base and base.get("tokens_per_sec") and mine.get("tokens_per_sec"):
        out["baseline_tokens_per_sec"] = base["tokens_per_sec"]
        out["step_time_ratio"] = base["tokens_per_sec"] / mine["tokens_per_sec"]  # same tokens per step
        out["ratio_ok"] = out["step_time_ratio"] <= 1.5
    return out


def part_max_model(s: Session) -> None:
    """The largest GPT trainable on this GPU with every single-GPU memory switch (goal: >= 9B)."""
    out = s.work / "max-model"
    shapes = ["--shapes", "a:2:2:64,b:2:2:128", "--model.vocab_size", "256"] if s.smoke else []
    s.tm("bench max-model", ["bench", "max-model", "--config", "benchmarks/configs/max-model-memory.toml",
                             "--run-dir", out, "--probe-steps", 3, "--timeout", 110, *shapes], 480)
    s.keep(out / "max-model.json", "max-model-result.json")
    if (out / "max-model.json").exists():
        res = json.loads((out / "max-model.json").read_text())
        largest = res.get("largest") or {}
        s.results["goal"] = {"largest": largest.get("name"), "params": largest.get("params"),
                             "goal_params": 9e9, "ok": (largest.get("params") or 0) >= 9e9}


def part_profile(s: Session) -> None:
    """``tokenmill profile`` + ``doctor`` of gpt2-124m as preset and of the best ladder's fastest
    configuration (every rung but max-autotune, or the fastest measured rung of ``BEST_JSON``)."""
    runs = {"baseline": ["--preset", "gpt2-124m", "--data.source", "synthetic", "--model.vocab_size", "50257"]}
    fastest = s.work / "fastest.toml"
    runs["fastest"] = ["--config", fastest]
    s.results["fastest_from"] = write_fastest_config(fastest, os.environ.get("BEST_JSON"), s.smoke)
    for label, args in runs.items():
        d = s.work / f"profile-{label}"
        extra = [*smoke_args(s), "--compile.enabled", "false"] if s.smoke else []
        s.tm(f"profile {label}", ["profile", *args, "--run-dir", d, "--quiet", *extra], 200 if label == "baseline" else 260)
        if (d / "profile.json").exists():
            s.tm(f"doctor {label}", ["doctor", d, "--json"], 60, stdout_file=d / "doctor.json")
            s.tm(f"doctor {label} (text)", ["doctor", d], 60)
        shutil.rmtree(d / "checkpoints", ignore_errors=True)
        s.keep(d / "profile.md", f"profile-{label}.md")
        s.keep(d / "profile.json", f"profile-{label}.json")
        try:
            verdict = json.loads((d / "doctor.json").read_text())
            s.results[label] = {"verdict": verdict.get("verdict"), "main": verdict.get("main")}
        except (OSError, ValueError):
            s.results[label] = {"verdict": None}


def write_fastest_config(path: Path, best_json: Optional[str], smoke: bool) -> str:
    """The config to profile as the fastest: the fastest measured rung of a ladder.json, or the best
    ladder with every rung's switch (but the deferred max-autotune) on. Returns where it came from."""
    from tokenmill import config as C

    if best_json and Path(best_json).is_file():
        doc = json.loads(Path(best_json).read_text())
        ok = [r for r in doc["rungs"] if r["status"] == "measured" and (r.get("summary") or {}).get("tokens_per_sec")]
        if ok:
            best = max(ok, key=lambda r: r["summary"]["tokens_per_sec"])
            cfg = C.from_dict(best["config"])
            cfg.checkpoint.save_final = False
            C.save(cfg, path)
            return f"{best_json}: rung {best['name']}"
    tree = read_ladder("best")
    sets = dict(tree["ladder"].get("base", {}))
    for r in tree["rung"]:
        if r["name"] not in BEST_DEFERRED and runnable_here(r, tree, not smoke and cuda_available(), smoke):
            sets.update(r.get("set", {}))
    sets.update({"train.eval_batches": 0, "log.tensorboard": False, "checkpoint.save_final": False})
    C.save(C.resolve(tree["ladder"]["base_preset"], overrides=sets, overrides_from_string=False), path)
    return "the best ladder, every rung but " + ", ".join(BEST_DEFERRED)


def part_book_perf(s: Session) -> None:
    """book-perf needs the embedded corpus as bytes: prepare it first (cached), then the ladder."""
    s.tm("prepare the corpus (bytes)", ["train", "--preset", "tiny", "--data.tokenizer", "bytes", "--train.device",
                                        "cpu", "--train.max_steps", 1, "--run-dir", s.work / "prepare"], 240)
    shutil.rmtree(s.work / "prepare", ignore_errors=True)
    ladder_step(s, "book-perf", 70)


DOCMASK_RUNS = {  # label -> flags on top of gpt2-124m on the embedded corpus (BPE 4,096: it has end-of-text ids)
    "plain": [],
    "document-mask": ["--data.document_mask", "true"],
    "document-mask-positions": ["--data.document_mask", "true", "--data.document_positions", "true"],
}


def part_document_mask(s: Session) -> None:
    """What keeping documents apart costs: gpt2-124m, batch 16, compiled, on the embedded corpus, without and
    with ``data.document_mask`` (the SDPA mask takes the flash kernel away), A then B then A-with-positions."""
    steps, compiled = (4, "false") if s.smoke else (60, "true")
    base = ["--preset", "gpt2-124m", "--train.max_steps", steps, "--train.batch_size", 16, "--compile.enabled",
            compiled, "--train.eval_batches", 0, "--checkpoint.save_final", "false", "--log.every_steps", 2 if s.smoke else 10,
            "--log.tensorboard", "false", *smoke_args(s)]
    for label, extra in DOCMASK_RUNS.items():
        d = s.work / f"docmask-{label}"
        s.tm(f"train {label}", ["train", *base, "--run-dir", d, *extra], 150)
        s.keep(d / "summary.json", f"docmask-{label}.json")
        try:
            summary = json.loads((d / "summary.json").read_text())
            s.results[label] = {k: summary.get(k) for k in ("tokens_per_sec", "step_time_ms", "final_loss")}
            peaks = [json.loads(line).get("peak_alloc_mb") for line in (d / "metrics.jsonl").read_text().splitlines()]
            s.results[label]["peak_alloc_mb"] = max((p for p in peaks if p is not None), default=None)
        except (OSError, ValueError):
            s.results[label] = {"tokens_per_sec": None}


def smoke_args(s: Session) -> list[str]:
    return TINY if s.smoke else []


Select = Callable[[list[str]], list[str]]  # the ladder's rung names -> the rungs of a part


def ladder_part(part: str, what: str, goal: str, name: str, timeout_s: float, rungs: Optional[Select] = None,
                deferred: Optional[list[str]] = None, fold_all: bool = False) -> Part:
    """A part that runs the rungs ``rungs`` selects of the shipped ladder ``name`` (all of them: None)."""

    def run(s: Session) -> None:
        selected = rungs([r["name"] for r in read_ladder(name)["rung"]]) if rungs else None
        ladder_step(s, name, timeout_s, selected, deferred, fold_all)

    return Part(part, what, goal, run, ladder=name, rungs=rungs or (lambda names: list(names)))


def _index(names: list[str], rung: str) -> int:
    if rung not in names:
        raise SystemExit(f"the ladder has no rung '{rung}' (it has {names}): update benchmarks/session.py PARTS")
    return names.index(rung)


def these(*rungs: str) -> Select:
    return lambda names: [names[_index(names, r)] for r in rungs]


def before(rung: str, but: tuple[str, ...] = ()) -> Select:
    return lambda names: [n for n in names[: _index(names, rung)] if n not in but]


def from_(rung: str, but: tuple[str, ...] = ()) -> Select:
    """``rung`` and every rung after it (rungs added to a ladder later land here)."""
    return lambda names: [n for n in names[_index(names, rung):] if n not in but]


def span(first: str, stop: str, but: tuple[str, ...] = ()) -> Select:
    """``first`` and the rungs after it, up to (not including) ``stop``."""
    return lambda names: [n for n in names[_index(names, first):_index(names, stop)] if n not in but]


_BEST_1 = ("baseline", "cudnn-attention", "compile")
_BEST_2 = ("vocab-pad-64", "batch-32", "batch-64")
RECOMPUTE = ("checkpoint-blocks", "selective-checkpointing")  # the last rungs of best and llama: speed for memory

# in order of value: the CUDA tier, the headline goals, then the remaining ladders
PARTS = [
    Part("check", "the CUDA tier (pytest -m gpu) and nvidia-smi", "every CUDA path works", part_check),
    ladder_part("best", "best ladder: baseline, cudnn-attention, compile", "600k tokens/s (GPT-2 124M, one H100)",
                "best", 150, these(*_BEST_1)),
    ladder_part("best-2", "best ladder: vocab-pad-64, batch-32, batch-64 (on top of best)", "600k tokens/s",
                "best", 150, these(*_BEST_2), BEST_DEFERRED),
    ladder_part("best-3", "best ladder: chunked-loss .. fp8-tensorwise but max-autotune (on top of best-2)",
                "600k tokens/s", "best", 200, span("chunked-loss", RECOMPUTE[0], but=tuple(BEST_DEFERRED)),
                BEST_DEFERRED),
    ladder_part("best-4", "best ladder: whole-block and selective checkpointing and every later rung (on top of "
                "best-3)", "what recomputation costs, whole blocks vs selective", "best", 200,
                from_(RECOMPUTE[0], but=tuple(BEST_DEFERRED)), BEST_DEFERRED),
    Part("memory", "configs/book-memory-5gb.toml and the book-memory baseline rung",
         "<= 5 GB peak at <= 1.5 x the baseline's step time", part_memory),
    Part("max-model", "bench max-model with configs/max-model-memory.toml", ">= 9B parameters on one 80 GB GPU",
         part_max_model),
    ladder_part("rasbt", "rasbt ladder: the eager rungs (baseline .. flash-attention)",
                "every rung in the seed's direction", "rasbt", 60, before("compile")),
    ladder_part("rasbt-2", "rasbt ladder: compile and every later rung (on top of rasbt)",
                "last rung >= 3.3 x 142,156 tokens/s", "rasbt", 160, from_("compile")),
    Part("profile", "profile + doctor: gpt2-124m preset and the best ladder's fastest config", "the bottleneck named",
         part_profile),
    ladder_part("llama", "llama ladder: the eager rungs (baseline .. fused-qkv)",
                "the naive Llama 3.2 1B and what each eager switch buys", "llama", 55, before("compile")),
    ladder_part("llama-2", "llama ladder: compile and batch-4 (on top of llama)",
                "what torch.compile and a larger batch add", "llama", 220, these("compile", "batch-4")),
    ladder_part("llama-3", "llama ladder: chunked-loss and batch-8 (on top of llama-2)",
                "the fastest Llama 3.2 1B configuration on one GPU", "llama", 220, span("chunked-loss", RECOMPUTE[0])),
    ladder_part("llama-4", "llama ladder: whole-block and selective checkpointing and every later rung (on top of "
                "llama-3)", "what recomputation costs, whole blocks vs selective", "llama", 240, from_(RECOMPUTE[0])),
    ladder_part("memory-ladder", "memory ladder: the rungs before the optimizer switches",
                "one rung per memory switch", "memory", 90, before("optimizer-in-backward")),
    ladder_part("memory-ladder-2", "memory ladder: the optimizer switches (on top of memory-ladder)",
                "one rung per memory switch", "memory", 110, span("optimizer-in-backward", "lora")),
    ladder_part("memory-ladder-3", "memory ladder: LoRA, then LoRA and QLoRA on Llama 3.1 8B, and every later rung "
                "(on top of memory-ladder-2)", "the largest preset a 24 GB GPU fine-tunes", "memory", 200, from_("lora")),
    ladder_part("book-memory", "book-memory ladder (the FSDP rung needs 2 GPUs)", "the book's direction per rung",
                "book-memory", 100),
    Part("book-perf", "book-perf ladder, after preparing the byte-level corpus (the DDP rung needs 2 GPUs)",
         "the book's direction per rung", part_book_perf, ladder="book-perf", rungs=lambda names: list(names)),
    ladder_part("optimizers", "optimizers ladder: AdamW and Muon at equal tokens (gpt-mini, 65,536 samples)",
                "Muon's final loss against AdamW's at equal tokens, and what its step costs", "optimizers", 110),
    Part("document-mask", "gpt2-124m on the embedded corpus without and with data.document_mask (and positions)",
         "what keeping documents apart costs in tokens/s and memory", part_document_mask),
    ladder_part("best-autotune", "best ladder: compile-max-autotune on top of every other best rung but the "
                "checkpointing ones", "what max-autotune adds", "best", 480, these(*BEST_DEFERRED), list(RECOMPUTE),
                fold_all=True),
]


def list_parts() -> str:
    lines = ["parts, in order of value (one device call each, each ends within 9 minutes):"]
    for i, p in enumerate(PARTS, 1):
        lines.append(f"{i:>2}. {p.name:<16} {p.what}  [goal: {p.goal}]")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Packing: what the device returns


def run_part(part: Part, out: Path, commit: str, smoke: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    s = Session(part.name, out, commit, smoke)
    s.log(f"[{part.name}] {part.what}; commit {commit}{' [SMOKE: tiny shapes, figures mean nothing]' if smoke else ''}")
    try:
        from tokenmill.bench.env import probe_environment

        s.results["env"] = probe_environment()
    except Exception as e:  # noqa: BLE001 - the measurements still count; say what is missing
        s.results["env"] = {"error": str(e)}
    error = None
    try:
        part.run(s)
    except Exception as e:  # noqa: BLE001 - pack whatever the part produced, then report
        error = f"{type(e).__name__}: {e}"
        s.log(f"[{part.name}] error: {error}")
    extra = [p for p in s.top if p.exists()][5:]  # at most 5 result files beside manifest, log, archive
    for p in extra:
        p.unlink()
    manifest = {
        "part": part.name, "what": part.what, "goal": part.goal, "commit": commit, "smoke": smoke,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "wall_s": round(time.monotonic() - s.start, 1),
        "budget_s": PART_BUDGET_S, "error": error, "steps": s.steps,
        "environment": s.results.pop("env", None), "results": s.results,
        "moved_into_archive": [p.name for p in extra],
    }
    manifest["archive"] = pack(s)
    path = out / f"{part.name}.json"
    path.write_text(json.dumps(manifest, indent=2, default=str))
    manifest["layout"] = layout(out)
    path.write_text(json.dumps(manifest, indent=2, default=str))
    failed = [st["name"] for st in s.steps if st.get("rc") not in (0, None) or st.get("timed_out")]
    s.log(f"[{part.name}] done in {manifest['wall_s']} s -> {out}: {manifest['layout']['count']} files"
          + ("" if manifest["layout"]["ok"] else " (LAYOUT NOT OK: see the manifest)")
          + (f"; steps not ok: {', '.join(failed)}" if failed else ""))
    copy_log(s)
    return 0 if (manifest["layout"]["ok"] and not failed and error is None) else 1


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="One part of a GPU session (see benchmarks/README.md).")
    ap.add_argument("part", nargs="?", help="a part name (--list shows them)")
    ap.add_argument("out", nargs="?", help="output folder ($OUT on the device)")
    ap.add_argument("--commit", help="the commit the working tree is at (recorded in every JSON)")
    ap.add_argument("--list", action="store_true", help="the parts, in order of value")
    ap.add_argument("--smoke", action="store_true", default=os.environ.get("SMOKE") == "1",
                    help="tiny shapes on any machine (default: SMOKE=1 in the environment)")
    args = ap.parse_args(argv)
    if args.list:
        print(list_parts())
        return 0
    parts = {p.name: p for p in PARTS}
    if args.part not in parts or not args.out:
        print(f"usage: gpu_session.sh PART OUT_DIR COMMIT | --list\n{list_parts()}", file=sys.stderr)
        return 2
    if not args.commit:
        print("give the commit as the third argument (the device has no .git)", file=sys.stderr)
        return 2
    os.environ["TOKENMILL_GIT_COMMIT"] = args.commit
    return run_part(parts[args.part], Path(args.out).resolve(), args.commit, args.smoke)


if __name__ == "__main__":
    sys.exit(main())
