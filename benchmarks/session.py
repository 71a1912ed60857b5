"""The parts of a GPU session (run by ``benchmarks/gpu_session.sh``; see benchmarks/README.md).

Each part fits one call of a 15-minute loan (start-up included): its steps share a budget (``PART_BUDGET_S``,
about 7 minutes) and each step is stopped at the part's deadline or its own cap; a ladder's rungs run with a
per-rung time limit chosen so that all of them fit. ``first`` (``first.py``) and ``cuda-tier`` together fit
one loan. What a part leaves in the output folder is what the device returns: at most 8 files, each at most
16 MiB, none in a sub-folder:

- ``PART.json``: the manifest (part, commit, environment, each step's command, exit status and time,
  the files, the part's headline results), rewritten atomically after every step, so a part killed at any
  moment leaves a whole one; SIGINT/SIGTERM end a part cleanly with its files, and no process it started
  outlives it (``session_lib``: tags and the reaper);
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

from first import FIRST_EST_S, part_first  # noqa: E402
from session_lib import (  # noqa: E402, F401
    BEST_DEFERRED,
    MAX_BYTES,
    MAX_FILES,
    RECOMPUTE,
    TAG_VAR,
    Stopped,
    copy_log,
    fastest_best_sets,
    kill_tagged,
    layout,
    pack,
    read_ladder,
    runnable_here,
    slice_ladder,
    start_reaper,
    stop_on_signals,
)

# the steps of a part; packing follows. A loan is 15 minutes with its start-up (1-3 min): one part of about
# 7 minutes per call leaves room for the start and a second, short call (README: the device commands)
PART_BUDGET_S = 420.0
TINY = ["--model.n_layer", "2", "--model.n_head", "2", "--model.n_embd", "64", "--model.block_size", "64",
        "--train.batch_size", "2"]


@dataclass
class Part:
    """One device call's worth of measurements (``ladder``/``rungs``: the ladder rungs it measures)."""

    name: str
    what: str
    goal: str
    run: Callable[[Session], None]
    ladder: Optional[str] = None
    rungs: Optional[Callable[[list[str]], list[str]]] = None
    est_s: Optional[float] = None  # estimated wall time on one H100 (ladder parts: from their rungs)
    budget_s: float = PART_BUDGET_S


@dataclass
class Session:
    """The state of one part's run: its folders, deadline, steps and results."""

    part: str
    out: Path
    commit: str
    smoke: bool
    budget_s: float = PART_BUDGET_S
    meta: dict[str, Any] = field(default_factory=dict)  # what the manifest says of the part (what, goal)
    work: Path = field(init=False)
    start: float = field(default_factory=time.monotonic)
    date: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    steps: list[dict[str, Any]] = field(default_factory=list)
    top: list[Path] = field(default_factory=list)  # result files copied into out
    results: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None
    stopped_by: Optional[str] = None  # SIGINT / SIGTERM

    def __post_init__(self) -> None:
        self.work = Path(os.environ.get("TOKENMILL_SESSION_WORK", "/tmp/tokenmill-session")) / self.part
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.log_path = self.work / f"{self.part}.log"
        self.tag = os.environ.get(TAG_VAR) or f"{self.part}-{os.getpid()}-{time.time_ns()}"

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)

    def manifest(self) -> dict[str, Any]:
        return {
            "part": self.part, **self.meta, "commit": self.commit, "smoke": self.smoke,
            "date": self.date, "wall_s": round(time.monotonic() - self.start, 1),
            "budget_s": self.budget_s, "error": self.error, "stopped_by": self.stopped_by, "steps": self.steps,
            "environment": self.results.get("env"), "results": {k: v for k, v in self.results.items() if k != "env"},
        }

    def save(self, **extra: Any) -> dict[str, Any]:
        """Rewrite the manifest atomically (after every step: a part killed at any moment leaves a whole
        manifest of what it finished)."""
        from tokenmill import atomic

        doc = {**self.manifest(), **extra}
        atomic.write_json(self.out / f"{self.part}.json", doc, default=str)
        return doc

    def log(self, text: str) -> None:
        print(text, flush=True)
        with open(self.log_path, "a") as f:
            f.write(text + "\n")

    def step(self, name: str, argv: list[str], cap_s: float, stdout_file: Optional[Path] = None,
             env: Optional[dict[str, str]] = None) -> int:
        """Run ``argv`` (its own process group, tagged) for at most ``cap_s`` and the part's remaining time.
        At the limit it gets SIGINT (tokenmill stops its rung processes and exits), then SIGKILL; a
        :class:`Stopped` part stops it the same way, sooner, and records it as interrupted."""
        limit = min(cap_s, self.left())
        rec: dict[str, Any] = {"name": name, "argv": [str(a) for a in argv], "limit_s": round(limit, 1)}
        self.steps.append(rec)
        if limit < 15:
            rec.update(rc=None, skipped="the part's time budget is spent")
            self.log(f"[{self.part}] {name}: skipped, the part's time budget is spent")
            self.save()
            return -1
        self.log(f"[{self.part}] {name} (limit {limit:.0f} s): {' '.join(rec['argv'])}")
        t0 = time.monotonic()
        rec["interrupted"] = True  # until it has run (a signal may land at any line below)
        with open(self.log_path, "a") as log, open(stdout_file or os.devnull, "w") as own:
            proc = subprocess.Popen(rec["argv"], stdout=own if stdout_file else log, stderr=log, cwd=ROOT,
                                    start_new_session=True, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", TAG_VAR: self.tag, **(env or {})})
            try:
                rec["pid"] = proc.pid
                self.save()
                proc.wait(timeout=limit)
                rec["interrupted"] = False
            except subprocess.TimeoutExpired:
                rec["timed_out"], rec["interrupted"] = True, False
                _stop(proc)
            except BaseException:
                _stop(proc, waits=(10, 5))
                raise
            finally:
                rec.update(rc=proc.returncode, wall_s=round(time.monotonic() - t0, 1))
                rec.setdefault("timed_out", False)
                self.save()
        self.log(f"[{self.part}] {name}: exit {proc.returncode} after {rec['wall_s']} s"
                 + (" (stopped at its time limit)" if rec["timed_out"] else ""))
        return proc.returncode

    def tm(self, name: str, args: list[str], cap_s: float, stdout_file: Optional[Path] = None) -> int:
        return self.step(name, [sys.executable, "-m", "tokenmill", *map(str, args)], cap_s, stdout_file)

    def keep(self, src: Path, name: str) -> None:
        """Copy a result file into the output folder (as ``name``) if it exists."""
        if src.is_file():
            dst = self.out / name
            shutil.copyfile(src, dst)
            self.top.append(dst)


def _stop(proc: subprocess.Popen, waits: tuple[float, float] = (20, 10)) -> None:
    for sig, wait in zip((signal.SIGINT, signal.SIGKILL), waits):
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
    from tokenmill.config.toml_out import dumps

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
        path.write_text(dumps(tree))
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


# The CUDA tier's runs start in parallel (tests/test_gpu.py: up to 8 processes, 4 of them compiling): Inductor's
# own compile workers (one per core by default) would put 4 x 16 processes on the 16 cores of the lent machine
TIER_ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "4", "OMP_NUM_THREADS": "2"}

# the short CUDA tier, in order of value: explicit node ids (pytest runs them in this order)
CUDA_TIER = [
    *[f"tests/test_gpu.py::test_switch_runs_on_cuda[{name}]" for name in (
        "hand-written-tf32-accum", "manual-attention-mask-on-the-fly", "sdpa-flash-autocast-fused-ckpt",
        "sdpa-efficient-pure-bf16-chunked", "sdpa-cudnn-autocast-accum", "sdpa-math-optimizer-in-backward",
        "fp16-gradscaler", "optimizer-offload", "offload-activations-autocast-ckpt",
        "optimizer-offload-gradients-autocast-accum", "adamw-8bit",
        "pinned-non-blocking-workers", "triton-layernorm", "cuda-prefetch-narrow-ids",
        "pure-bf16-no-fp32-islands-padded-loss")],
    "tests/test_gpu.py::test_resume_on_cuda_equals_uninterrupted_run",
    "tests/test_gpu.py::test_profile_on_cuda_writes_memory_snapshot",
    "tests/test_gpu.py::test_sdpa_backend_matches_math_kernel",
    "tests/test_gpu.py::test_chunked_loss_matches_full_loss_in_bf16",
    "tests/test_gpu.py::test_activation_offload_on_cuda_keeps_the_math_and_frees_the_device",  # side-stream copies
    "tests/test_flex_attention.py::test_flex_gradients_equal_explicit_on_cuda",  # no backward on CPU: GPU only
    "tests/test_loader.py::test_prefetcher_on_cuda_side_stream_same_batches_in_order",
    "tests/test_async_checkpoint.py::test_background_checkpoints_on_cuda_equal_synchronous_ones",
    "tests/test_kernels.py::test_on_cuda_matches_native_bf16",
    "tests/test_data.py::test_pinned_loader_on_cuda",
    "tests/test_memory.py::test_optimizer_offload_keeps_state_off_gpu",
    "tests/test_sac.py::test_dropout_masks_survive_selective_checkpointing_on_cuda",
    "tests/test_sft_packing.py::test_packed_flex_on_cuda_equals_conversations_one_by_one",  # chat packing, flex
    "tests/test_qlora.py::test_compiled_qlora_keeps_no_dequantised_weight_on_cuda",  # QLoRA compiled: no bf16 copy
]
CUDA_TIER_CAP_S = 165.0  # pytest is stopped here (SIGINT: it still writes its JUnit XML), within the 3 minutes


def part_check(s: Session) -> None:
    """The whole CUDA tier (``pytest -m gpu``, every test run: no -x), with the GPU's facts."""
    pytest_step(s, "pytest -m gpu", ["-m", "gpu", "tests"], 360)


def part_cuda_tier(s: Session) -> None:
    """The short CUDA tier: :data:`CUDA_TIER` in that order, stopped by the clock at :data:`CUDA_TIER_CAP_S`
    (no -x, no --maxfail: every test that starts in time runs), with the GPU's facts."""
    pytest_step(s, "pytest (the short CUDA tier)", CUDA_TIER, CUDA_TIER_CAP_S)


def pytest_step(s: Session, name: str, args: list[str], cap_s: float) -> None:
    if shutil.which("nvidia-smi"):
        s.step("nvidia-smi", ["nvidia-smi"], 30, stdout_file=s.work / "nvidia-smi.txt")
    junit = s.work / "junit.xml"
    s.step(name, [sys.executable, "-m", "pytest", *args, "-q", "-rfEsxX", "-p", "no:cacheprovider",
                  f"--junitxml={junit}"], cap_s, stdout_file=s.work / "pytest.txt", env=TIER_ENV)
    s.results["pytest"] = junit_counts(junit)
    s.results["pytest_env"] = TIER_ENV
    if s.steps[-1].get("timed_out"):
        s.results["pytest"]["stopped_by_the_clock_s"] = cap_s
    if all("::" in a for a in args):
        s.results["pytest"]["not_run"] = not_run(junit, args)
    s.keep(s.work / "pytest.txt", f"{s.part}-pytest.txt")
    s.keep(junit, f"{s.part}-junit.xml")
    s.keep(s.work / "nvidia-smi.txt", f"{s.part}-nvidia-smi.txt")


def not_run(junit: Path, node_ids: list[str]) -> list[str]:
    """The node ids of which pytest's JUnit XML reports no test case (stopped by the clock before them)."""
    import xml.etree.ElementTree as ET

    try:
        seen = {(c.get("classname"), c.get("name")) for c in ET.parse(junit).getroot().iter("testcase")}
    except (OSError, ET.ParseError):
        return list(node_ids)
    out = []
    for node in node_ids:
        path, name = node.split("::", 1)
        cls = path.removesuffix(".py").replace("/", ".")
        if not any(c == cls and (n == name or (n or "").startswith(name + "[")) for c, n in seen):
            out.append(node)
    return out


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


def profile_part(label: str) -> Callable[[Session], None]:
    """``tokenmill profile`` + ``doctor`` of gpt2-124m as preset (``baseline``) or of the best ladder's fastest
    configuration (``fastest``: its fastest rung's switches but max-autotune and recomputation, or the fastest
    measured rung of ``BEST_JSON``)."""

    def run(s: Session) -> None:
        if label == "baseline":
            args = ["--preset", "gpt2-124m", "--data.source", "synthetic", "--model.vocab_size", "50257"]
        else:
            fastest = s.work / "fastest.toml"
            s.results["fastest_from"] = write_fastest_config(fastest, os.environ.get("BEST_JSON"), s.smoke)
            args = ["--config", fastest]
        d = s.work / f"profile-{label}"
        extra = [*smoke_args(s), "--compile.enabled", "false"] if s.smoke else []
        s.tm(f"profile {label}", ["profile", *args, "--run-dir", d, "--quiet", *extra], 260)
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

    return run


def write_fastest_config(path: Path, best_json: Optional[str], smoke: bool) -> str:
    """The config to profile as the fastest: the fastest measured rung of a ladder.json, or the switches of the
    best ladder's fastest rung as the ladder carries them here (:func:`fastest_best_sets`: without the
    deferred max-autotune and the recompute rungs). Returns where it came from."""
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
    sets, names = fastest_best_sets(not smoke and cuda_available(), smoke)
    sets.update({"train.eval_batches": 0, "log.tensorboard": False, "checkpoint.save_final": False})
    C.save(C.resolve(read_ladder("best")["ladder"]["base_preset"], overrides=sets, overrides_from_string=False), path)
    return "the best ladder's rungs " + ", ".join(names) + " (not " + ", ".join([*BEST_DEFERRED, *RECOMPUTE]) + ")"


def book_perf_part(rungs: Select) -> Callable[[Session], None]:
    """book-perf needs the embedded corpus as bytes: prepare it first (cached on a warm machine), then the rungs
    ``rungs`` selects of the ladder."""

    def run(s: Session) -> None:
        s.tm("prepare the corpus (bytes)", ["train", "--preset", "tiny", "--data.tokenizer", "bytes", "--train.device",
                                            "cpu", "--train.max_steps", 1, "--run-dir", s.work / "prepare"], 150)
        shutil.rmtree(s.work / "prepare", ignore_errors=True)
        ladder_step(s, "book-perf", 70, rungs([r["name"] for r in read_ladder("book-perf")["rung"]]))

    return run


DOCMASK_RUNS = {  # label -> flags on top of gpt2-124m on the embedded corpus (BPE 4,096: it has end-of-text ids)
    "plain": [],
    "document-mask": ["--data.document_mask", "true"],  # model.document_attention 'auto': FlexAttention on CUDA
    "document-mask-explicit": ["--data.document_mask", "true", "--model.document_attention", "explicit"],
}  # (data.document_positions adds a gather of the angles: not worth a fourth run of the part's 7 minutes)


def part_document_mask(s: Session) -> None:
    """What keeping documents apart costs: gpt2-124m, batch 16, compiled, on the embedded corpus, without and
    with ``data.document_mask``: FlexAttention's block mask (the default on CUDA), then the explicit SDPA mask
    (``model.document_attention explicit``, which takes the flash kernel away)."""
    steps, compiled = (4, "false") if s.smoke else (60, "true")
    base = ["--preset", "gpt2-124m", "--train.max_steps", steps, "--train.batch_size", 16, "--compile.enabled",
            compiled, "--train.eval_batches", 0, "--checkpoint.save_final", "false", "--log.every_steps", 2 if s.smoke else 10,
            "--log.tensorboard", "false", *smoke_args(s)]
    for label, extra in DOCMASK_RUNS.items():
        d = s.work / f"docmask-{label}"
        s.tm(f"train {label}", ["train", *base, "--run-dir", d, *extra], 130)
        s.keep(d / "summary.json", f"docmask-{label}.json")
        try:
            summary = json.loads((d / "summary.json").read_text())
            s.results[label] = {k: summary.get(k) for k in ("tokens_per_sec", "step_time_ms", "final_loss")}
            peaks = [json.loads(line).get("peak_alloc_mb") for line in (d / "metrics.jsonl").read_text().splitlines()]
            s.results[label]["peak_alloc_mb"] = max((p for p in peaks if p is not None), default=None)
        except (OSError, ValueError):
            s.results[label] = {"tokens_per_sec": None}


def part_gemm_efficiency(s: Session) -> None:
    """The estimator's outside figures measured on this GPU (benchmarks/validation/gemm_efficiency.py): matrix
    products by shape and precision, bandwidth, fused attention, launch costs, NF4 dequantisation; raw JSON."""
    dst = s.work / "gemm_efficiency.json"
    s.step("gemm efficiency", [sys.executable, "benchmarks/validation/gemm_efficiency.py", "--out", dst,
                               "--budget-s", 30 if s.smoke else 100], 120)
    s.keep(dst, "gemm_efficiency.json")


def part_compiled_kernels(s: Session) -> None:
    """GPT-2 124M's forward and backward kernels, eager and compiled (the rasbt ladder's flash-attention and compile
    rungs), by kind beside the estimator's (benchmarks/validation/compiled_kernels.py); raw JSON."""
    dst = s.work / "compiled_kernels.json"
    cmd = [sys.executable, "benchmarks/validation/compiled_kernels.py", "--out", dst]
    s.step("compiled kernels", cmd + (["--estimate-only", "--gpu", "a100-80gb", "--smoke"] if s.smoke else []), 150)
    s.keep(dst, "compiled_kernels.json")


def part_offload(s: Session) -> None:
    """Activation offloading measured against its estimate (benchmarks/validation/offload_overlap.py): GPT-2 124M,
    with and without checkpointing, offloading off and on: time, peak memory, bytes moved; raw JSON."""
    dst = s.work / "offload_overlap.json"
    s.step("offload overlap", [sys.executable, "benchmarks/validation/offload_overlap.py", "--out", dst], 120)
    s.keep(dst, "offload_overlap.json")


SFT_RUNG_S = 90.0  # per rung of the sft ladder: gpt2-124m compiled, 38 steps of 32 x 512 tokens


def part_sft_packing(s: Session) -> None:
    """Padded against packed chat windows (the ``sft`` ladder) on a chat folder built here with nothing downloaded
    (benchmarks/chat_corpus.py: needs transformers); tokens/s and learned tokens/s per rung."""
    folder = s.work / "chat"
    if s.step("build the chat corpus", [sys.executable, "benchmarks/chat_corpus.py", folder, "--workers", 4,
                                        "--conversations", 2000 if s.smoke else 20000], 100) != 0:
        s.results["note"] = "the chat corpus was not built (transformers missing? see the step's log)"
        return
    out = s.work / s.part
    timeout = max(30.0, min(SFT_RUNG_S, (s.left() - 40) / 3))
    args = ["bench", "ladder", "sft", "--out", out, "--quiet", "--timeout", round(timeout),
            "--set", f"data.path={folder / 'data'}"]
    s.tm("ladder sft", args + (["--smoke"] if s.smoke else []), cap_s=3 * timeout + 60)
    finish_ladder(out, s)
    for ext in ("json", "md", "png"):
        s.keep(out / f"ladder.{ext}", f"{s.part}-ladder.{ext}")
    try:
        doc = json.loads((out / "ladder.json").read_text())
        s.results["learned"] = {r["name"]: {k: (r.get("summary") or {}).get(k) for k in
                                            ("learned_tokens_per_sec", "padding_frac", "learned_frac")}
                                for r in doc["rungs"]}
    except (OSError, ValueError, KeyError):
        pass


def smoke_args(s: Session) -> list[str]:
    return TINY if s.smoke else []


Select = Callable[[list[str]], list[str]]  # the ladder's rung names -> the rungs of a part


def ladder_part(part: str, what: str, goal: str, name: str, timeout_s: float, rungs: Optional[Select] = None,
                deferred: Optional[list[str]] = None, fold_all: bool = False) -> Part:
    """A part that runs the rungs ``rungs`` selects of the shipped ladder ``name`` (all of them: None)."""

    def run(s: Session) -> None:
        selected = rungs([r["name"] for r in read_ladder(name)["rung"]]) if rungs else None
        ladder_step(s, name, timeout_s, selected, deferred, fold_all)

    select = rungs or (lambda names: list(names))
    return Part(part, what, goal, run, ladder=name, rungs=select, est_s=ladder_estimate(name, select, timeout_s))


START_S, PACK_S = 25.0, 15.0  # a part's environment probe and first imports; packing its files


def ladder_estimate(name: str, select: Select, timeout_s: float, extra_s: float = 0.0) -> float:
    """The most a ladder part takes on one GPU: every rung that runs there at its limit (as
    :func:`ladder_step` sets it), with the start and the packing."""
    tree = read_ladder(name)
    chosen = select([r["name"] for r in tree["rung"]])
    n = sum(1 for r in tree["rung"] if r["name"] in chosen and runnable_here(r, tree, True, False))
    per_rung = max(30.0, min(timeout_s, (PART_BUDGET_S - extra_s - START_S - 40) / max(1, n)))
    return min(PART_BUDGET_S, START_S + extra_s + n * per_rung) + PACK_S


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


_DEF = tuple(BEST_DEFERRED)
_600K = "600k tokens/s (GPT-2 124M, one H100)"
_MEM = "one rung per memory switch"

# in order of value: the first look and the short CUDA tier (one loan: the two device commands of
# benchmarks/README.md), then the headline goals, then the remaining ladders; every part fits one loan
PARTS = [
    Part("first", "the first look: environment; GPT-2 124M naive vs fastest; rasbt first and last single-GPU rung; "
         "Llama 3.2 1B compiled (each beside its estimate)", "what one loan can say, most valuable first",
         part_first, est_s=FIRST_EST_S + PACK_S),
    Part("cuda-tier", "the short CUDA tier: eager switches, resume, memory snapshot, SDPA kernels, chunked loss, "
         "prefetcher, async checkpoints, kernels", "every CUDA path that matters most works", part_cuda_tier,
         est_s=START_S + 15 + CUDA_TIER_CAP_S, budget_s=CUDA_TIER_CAP_S + 40),
    Part("gemm-efficiency", "the estimator's outside figures on this GPU: torch.matmul by shape (bf16, TF32, fp32), "
         "bandwidth, fused attention, launch costs, NF4 dequantisation", "the roofline's constants measured, not "
         "borrowed", part_gemm_efficiency, est_s=START_S + 120 + PACK_S),
    Part("compiled-kernels", "GPT-2 124M's forward + backward kernels, eager and compiled, by kind beside the "
         "estimator's", "what compile's kernels cost, against the estimate that has them slower than eager",
         part_compiled_kernels, est_s=START_S + 150 + PACK_S),
    ladder_part("best", "best ladder: baseline, cudnn-attention, compile", _600K, "best", 150,
                these("baseline", "cudnn-attention", "compile")),
    ladder_part("best-2", "best ladder: vocab-pad-64, batch-32, batch-64 (on top of best)", _600K, "best", 150,
                these("vocab-pad-64", "batch-32", "batch-64"), BEST_DEFERRED),
    ladder_part("best-3", "best ladder: loss-only, chunked-loss, batch-128 (on top of best-2)", _600K, "best", 190,
                span("loss-only", "triton-layernorm", but=_DEF), BEST_DEFERRED),
    ladder_part("best-4", "best ladder: triton-layernorm, fp8-tensorwise (FP8 needs torchao) (on top of best-3)",
                _600K, "best", 190, span("triton-layernorm", RECOMPUTE[0], but=_DEF), BEST_DEFERRED),
    Part("check", "the whole CUDA tier (pytest -m gpu) and nvidia-smi", "every CUDA path works", part_check,
         est_s=START_S + 15 + 360 + PACK_S),
    ladder_part("best-5", "best ladder: whole-block and selective checkpointing and every later rung (on top of "
                "best-4)", "what recomputation costs, whole blocks vs selective", "best", 190,
                from_(RECOMPUTE[0], but=_DEF), BEST_DEFERRED),
    Part("memory", "configs/book-memory-5gb.toml and the book-memory baseline rung",
         "<= 5 GB peak at <= 1.5 x the baseline's step time", part_memory, est_s=START_S + 240 + 150 + PACK_S),
    Part("max-model", "bench max-model with configs/max-model-memory.toml", ">= 9B parameters on one 80 GB GPU",
         part_max_model, est_s=PART_BUDGET_S + PACK_S),
    ladder_part("rasbt", "rasbt ladder: baseline, mask-on-the-fly, tf32, fused-adamw",
                "every rung in the seed's direction", "rasbt", 80, before("pin-memory")),
    ladder_part("rasbt-2", "rasbt ladder: pin-memory .. flash-attention (on top of rasbt)",
                "every rung in the seed's direction", "rasbt", 80, span("pin-memory", "compile")),
    ladder_part("rasbt-3", "rasbt ladder: compile and every later rung (on top of rasbt-2; DDP needs 4 GPUs)",
                "last rung >= 3.3 x 142,156 tokens/s", "rasbt", 126, from_("compile")),
    Part("profile", "profile + doctor: gpt2-124m as preset", "the bottleneck named", profile_part("baseline"),
         est_s=START_S + 260 + 60 + 60 + PACK_S),
    Part("profile-2", "profile + doctor: the best ladder's fastest config (no max-autotune, no recomputation)",
         "the bottleneck named", profile_part("fastest"), est_s=START_S + 260 + 60 + 60 + PACK_S),
    ladder_part("llama", "llama ladder: baseline, tf32, fused-adamw, pin-memory",
                "the naive Llama 3.2 1B and what each eager switch buys", "llama", 80, before("bf16-autocast")),
    ladder_part("llama-2", "llama ladder: bf16-autocast .. fused-qkv (on top of llama)",
                "what each eager switch buys", "llama", 80, span("bf16-autocast", "compile")),
    ladder_part("llama-3", "llama ladder: compile and batch-4 (on top of llama-2)",
                "what torch.compile and a larger batch add", "llama", 190, these("compile", "batch-4")),
    ladder_part("llama-4", "llama ladder: chunked-loss and batch-8 (on top of llama-3)",
                "the fastest Llama 3.2 1B configuration on one GPU", "llama", 190, span("chunked-loss", RECOMPUTE[0])),
    ladder_part("llama-5", "llama ladder: whole-block and selective checkpointing and every later rung (on top of "
                "llama-4)", "what recomputation costs, whole blocks vs selective", "llama", 190, from_(RECOMPUTE[0])),
    ladder_part("memory-ladder", "memory ladder: baseline, bf16, chunked-loss, activation-checkpointing", _MEM,
                "memory", 90, before("offload-activations")),
    ladder_part("memory-ladder-2", "memory ladder: offload-activations, the allocator switches (on top of "
                "memory-ladder)", _MEM, "memory", 110, span("offload-activations", "optimizer-in-backward")),
    ladder_part("memory-ladder-3", "memory ladder: the optimizer switches (on top of memory-ladder-2)", _MEM,
                "memory", 90, span("optimizer-in-backward", "lora")),
    ladder_part("memory-ladder-4", "memory ladder: LoRA, then LoRA and QLoRA on Llama 3.1 8B, and every later rung "
                "(on top of memory-ladder-3)", "the largest preset a 24 GB GPU fine-tunes", "memory", 200, from_("lora")),
    ladder_part("book-memory", "book-memory ladder (the FSDP rung needs 2 GPUs)", "the book's direction per rung",
                "book-memory", 95),
    Part("book-perf", "book-perf ladder: baseline .. non-blocking, after preparing the byte-level corpus",
         "the book's direction per rung", book_perf_part(before("compile-reduce-overhead")), ladder="book-perf",
         rungs=before("compile-reduce-overhead"),
         est_s=ladder_estimate("book-perf", before("compile-reduce-overhead"), 70, extra_s=150)),
    Part("book-perf-2", "book-perf ladder: compile-reduce-overhead and every later rung (the DDP rung needs 2 GPUs)",
         "the book's direction per rung", book_perf_part(from_("compile-reduce-overhead")), ladder="book-perf",
         rungs=from_("compile-reduce-overhead"),
         est_s=ladder_estimate("book-perf", from_("compile-reduce-overhead"), 70, extra_s=150)),
    ladder_part("optimizers", "optimizers ladder: AdamW at lr 1e-3 and 2e-3 (gpt-mini, 65,536 samples)",
                "Muon's final loss against AdamW's at equal tokens", "optimizers", 170, before("muon")),
    ladder_part("optimizers-2", "optimizers ladder: Muon at muon_lr 0.02 and 0.04 (on top of optimizers)",
                "Muon's final loss against AdamW's at equal tokens, and what its step costs", "optimizers", 170,
                from_("muon")),
    Part("document-mask", "gpt2-124m on the embedded corpus without and with data.document_mask (FlexAttention, "
         "the explicit mask)", "what keeping documents apart costs in tokens/s and memory, and what "
         "FlexAttention gives back", part_document_mask, est_s=START_S + 3 * 130 + PACK_S),
    Part("sft-packing", "sft ladder: gpt2-124m on a chat folder built here, padded, packed with the explicit mask, "
         "packed with FlexAttention", "what packing gives a fine-tune in learned tokens/s", part_sft_packing,
         ladder="sft", rungs=lambda names: list(names), est_s=START_S + 100 + 3 * SFT_RUNG_S + PACK_S),
    ladder_part("moe", "moe ladder: OLMoE's shapes on 4 layers; the experts as a loop, grouped, at batch 8, compiled",
                "what the grouped experts, a larger batch and compile buy a mixture of experts", "moe", 100),
    Part("offload", "activation offloading on a side stream against its estimate: GPT-2 124M, with and without "
         "checkpointing, offloading off and on", "the offload's wait and saving measured, beside the replay",
         part_offload, est_s=START_S + 120 + PACK_S),
    ladder_part("best-autotune", "best ladder: compile-max-autotune on top of every other best rung but the "
                "checkpointing ones", "what max-autotune adds", "best", 380, these(*BEST_DEFERRED), list(RECOMPUTE),
                fold_all=True),
]


def list_parts() -> str:
    lines = ["parts, in order of value (one device call each; ~minutes: the most it takes on one H100):"]
    for i, p in enumerate(PARTS, 1):
        lines.append(f"{i:>2}. {p.name:<16} ~{(p.est_s or p.budget_s) / 60:.1f} min  {p.what}  [goal: {p.goal}]")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Packing: what the device returns


def run_part(part: Part, out: Path, commit: str, smoke: bool) -> int:
    """Run one part and leave its files in ``out``. The manifest is rewritten after every step; SIGINT or
    SIGTERM stops the running step and the part still packs and writes its files (exit 130 / 143); every
    process a step started is ended, even when the part itself is killed (its reaper)."""
    out.mkdir(parents=True, exist_ok=True)
    s = Session(part.name, out, commit, smoke, part.budget_s, meta={"what": part.what, "goal": part.goal})
    s.save()
    reaper = start_reaper(s.tag)
    try:
        try:
            s.log(f"[{part.name}] {part.what}; commit {commit}"
                  f"{' [SMOKE: tiny shapes, figures mean nothing]' if smoke else ''}")
            s.results["env"] = _environment()
            s.save()
            part.run(s)
        except Stopped as e:
            s.stopped_by = str(e)
            s.log(f"[{part.name}] stopped by {e}: packing what it finished")
        except Exception as e:  # noqa: BLE001 - pack whatever the part produced, then report
            s.error = f"{type(e).__name__}: {e}"
            s.log(f"[{part.name}] error: {s.error}")
        s.save()
        return finish(s)
    except Stopped as e:  # a signal while packing: the manifest on disk stays whole
        s.stopped_by = s.stopped_by or str(e)
        return 130
    finally:
        kill_tagged(s.tag)
        reaper.kill()
        reaper.wait()


def _environment() -> dict[str, Any]:
    try:
        from tokenmill.bench.env import probe_environment

        return probe_environment(timeout_s=90)
    except Exception as e:  # noqa: BLE001 - the measurements still count; say what is missing
        return {"error": str(e)}


def finish(s: Session) -> int:
    """Pack the details, check the layout, write the final manifest; the part's exit status."""
    extra = [p for p in s.top if p.exists()][5:]  # at most 5 result files beside manifest, log, archive
    for p in extra:
        p.unlink()
    archive = pack(s)
    s.save(moved_into_archive=[p.name for p in extra], archive=archive)
    manifest = s.save(moved_into_archive=[p.name for p in extra], archive=archive, layout=layout(s.out))
    failed = [st["name"] for st in s.steps if st.get("rc") not in (0, None) or st.get("timed_out")]
    s.log(f"[{s.part}] done in {manifest['wall_s']} s -> {s.out}: {manifest['layout']['count']} files"
          + ("" if manifest["layout"]["ok"] else " (LAYOUT NOT OK: see the manifest)")
          + (f"; steps not ok: {', '.join(failed)}" if failed else ""))
    copy_log(s)
    if s.stopped_by:
        return 143 if s.stopped_by == "SIGTERM" else 130
    return 0 if (manifest["layout"]["ok"] and not failed and s.error is None) else 1


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
    previous = stop_on_signals()  # SIGINT/SIGTERM: run_part ends cleanly with its files (see its doc)
    try:
        return run_part(parts[args.part], Path(args.out).resolve(), args.commit, args.smoke)
    except Stopped as e:  # before the part had started: gpu_session.sh's first manifest stays
        print(f"gpu_session: stopped by {e} before the part started", file=sys.stderr)
        return 128 + e.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
