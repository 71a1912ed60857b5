"""The CUDA tier: every switch of the README's technique table, run on a CUDA GPU (``pytest -m gpu``).

Skipped, with the reason, where ``torch.cuda.is_available()`` is false. Most tests go through the real
command line (``python -m tokenmill train|profile ...``) at tiny shapes (the ``tiny`` preset: 2 layers,
width 32, block 32, synthetic ids over 64 tokens) for a few steps, and read what the run wrote
(``metrics.jsonl``, ``summary.json``, checkpoints, profiles). To stay within the tier's budget (at most
4 minutes on one H100), the command-line runs are independent processes started together at the first
test that needs one (at most ``MAX_PARALLEL`` at a time; the GPU has room for many tiny models), and
each test waits for its own. Two numerical checks run in this process on ``tokenmill.model.GPT``
directly: the SDPA kernels against the math kernel, and the chunked loss against the full one in bf16.

Distributed switches: DDP, ZeRO-1, TP and PP need several GPUs (a one-process torchrun job is a
world of one in tokenmill, see ``parallel/world.py``); FSDP2 runs here over NCCL in a one-process
torchrun job through tokenmill's ``apply_fsdp`` (:func:`test_fsdp_under_torchrun_one_process`), and
through the trainer once tokenmill has a one-process FSDP layout
(:func:`test_fsdp_layout_through_the_cli_under_torchrun`, an expected failure until then).
Switches that exist only in newer trees (``model.norm='triton'``, ``data.cuda_prefetch``, ...) and
optional packages (torchao, triton) are skipped with the reason where absent.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch

from tokenmill import config as C

CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="the CUDA tier needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

MAX_PARALLEL = 8  # command-line runs at once (tiny models: the GPU and 16 cores have room)
VOCAB = 64
STEPS = 4
BASE = ["--preset", "tiny", "--data.source", "synthetic", "--model.vocab_size", str(VOCAB),
        "--train.device", "cuda", "--train.max_steps", str(STEPS), "--log.every_steps", "2",
        "--log.progress", "plain", "--train.eval_batches", "1"]


def tm_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "tokenmill", *map(str, args)]


def torchrun_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", *map(str, args)]


# ------------------------------------------------------------------------------------------------
# Scripts run in their own processes (written into the runs folder)


ALLOC_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from tokenmill.cli import main
    rc = main(sys.argv[2:])
    segments = torch.cuda.memory_snapshot() if torch.cuda.is_initialized() else []
    with open(sys.argv[1], "w") as f:
        json.dump({"rc": rc, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
                   "expandable": [s.get("is_expandable") for s in segments]}, f)
""")

FSDP_SCRIPT = textwrap.dedent("""
    import contextlib, json, os, sys
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from tokenmill import config as C
    from tokenmill.model import GPT
    from tokenmill.parallel.data_parallel import apply_fsdp
    from tokenmill.parallel.world import World

    mp = sys.argv[2]
    cfg = C.resolve("tiny", overrides={"data.source": "synthetic", "model.vocab_size": 64, "train.device": "cuda",
                                       "parallel.fsdp_mixed_precision": mp}, overrides_from_string=False)
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    mesh = init_device_mesh("cuda", (1, 1, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    world = World(rank=0, local_rank=0, size=1, device=dev, mesh=mesh)
    models = []
    for fsdp in (False, True):
        torch.manual_seed(0)
        m = GPT(cfg.model, 64).to(dev)
        if fsdp:
            apply_fsdp(m, world, cfg.parallel)
        models.append((m, torch.optim.AdamW(m.parameters(), lr=1e-3)))
    g = torch.Generator().manual_seed(1)
    losses = {"plain": [], "fsdp": []}
    for step in range(3):
        x = torch.randint(0, 64, (4, 32), generator=g).to(dev)
        for (m, opt), key in zip(models, losses):
            # the reference for FSDP's bf16 parameter policy is bf16 autocast
            bf16 = mp == "bf16" and key == "plain"
            with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                _, loss = m(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[key].append(loss.item())
    kinds = sorted({type(p).__name__ for p in models[1][0].parameters()})
    with open(sys.argv[1], "w") as f:
        json.dump({"losses": losses, "param_types": kinds}, f)
    dist.destroy_process_group()
""")


# ------------------------------------------------------------------------------------------------
# The command-line runs: one process each, started together, waited for by the tests


@dataclass
class Job:
    """One command-line run: ``argv`` with ``{run}`` replaced by its run directory."""

    argv: list[str]
    timeout_s: float = 150.0
    env: dict[str, str] = field(default_factory=dict)
    # filled in by the pool
    run_dir: Optional[Path] = None
    rc: Optional[int] = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


def train_job(*extra: str, steps: int = STEPS, timeout_s: float = 150.0, **env: str) -> Job:
    return Job(tm_cmd("train", *BASE, "--train.max_steps", str(steps), *extra, "--run-dir", "{run}"), timeout_s,
               dict(env))


# technique-table switches, grouped so that each run exercises several compatible ones
SWITCH_JOBS: dict[str, Job] = {
    # hand-written model, every non-default form: manual attention with a mask buffer, 3 q/k/v Linears,
    # hand-written LayerNorm and GELU, vocabulary padding (64 -> 128), TF32, for-loop AdamW, accumulation
    "hand-written-tf32-accum": train_job(
        "--model.attention", "manual", "--model.causal_mask", "buffer", "--model.fused_qkv", "false",
        "--model.norm", "manual", "--model.gelu", "manual", "--model.vocab_pad_multiple", "128",
        "--train.tf32", "true", "--optim.impl", "for-loop", "--train.grad_accum_steps", "2"),
    "manual-attention-mask-on-the-fly": train_job(
        "--model.attention", "manual", "--model.causal_mask", "on_the_fly", "--train.precision", "bf16-autocast"),
    # SDPA with each kernel forced; bf16 autocast (flash and cuDNN need half precision), fused AdamW,
    # activation checkpointing
    "sdpa-flash-autocast-fused-ckpt": train_job(
        "--model.attention", "sdpa", "--model.sdpa_backend", "flash", "--train.precision", "bf16-autocast",
        "--optim.impl", "fused", "--memory.activation_checkpointing", "1"),
    "sdpa-efficient-pure-bf16-chunked": train_job(
        "--model.sdpa_backend", "efficient", "--train.precision", "bf16", "--optim.impl", "foreach",
        "--model.loss_impl", "chunked", "--model.loss_chunk_size", "48"),
    "sdpa-cudnn-autocast-accum": train_job(
        "--model.sdpa_backend", "cudnn", "--train.precision", "bf16-autocast", "--train.grad_accum_steps", "2",
        "--memory.activation_checkpointing", "2"),
    "sdpa-math-optimizer-in-backward": train_job(
        "--model.sdpa_backend", "math", "--memory.optimizer_in_backward", "true", "--optim.grad_clip", "0"),
    "fp16-gradscaler": train_job("--train.precision", "fp16-autocast", "--optim.impl", "foreach"),
    "optimizer-offload": train_job("--memory.optimizer_offload", "true"),
    "offload-activations-autocast-ckpt": train_job(
        "--memory.offload_activations", "true", "--train.precision", "bf16-autocast",
        "--memory.activation_checkpointing", "1"),
    "optimizer-offload-gradients-autocast-accum": train_job(
        "--memory.optimizer_offload", "true", "--memory.offload_gradients", "true",
        "--train.precision", "bf16-autocast", "--train.grad_accum_steps", "2"),
    "adamw-8bit": train_job("--memory.optimizer_8bit", "true", "--train.precision", "bf16-autocast"),
    "pinned-non-blocking-workers": train_job(
        "--data.pin_memory", "true", "--data.non_blocking", "true", "--data.num_workers", "2",
        "--data.prefetch_factor", "2", "--data.persistent_workers", "true"),
    "compile-default": train_job(
        "--compile.enabled", "true", "--train.precision", "bf16-autocast", steps=6, timeout_s=240),
    # perf hints on: Inductor says on stderr when it does not use CUDA graphs
    "compile-reduce-overhead": train_job(
        "--compile.enabled", "true", "--compile.mode", "reduce-overhead", steps=6, timeout_s=240,
        TORCH_LOGS="perf_hints"),
    "compile-per-block": train_job(
        "--compile.enabled", "true", "--compile.scope", "block", "--train.precision", "bf16-autocast",
        steps=6, timeout_s=240),
}
# switches that other work adds: a run is skipped (with the reason) while its config value does not exist
SWITCH_JOBS.update({
    "triton-layernorm": train_job("--model.norm", "triton", "--train.precision", "bf16-autocast"),
    "triton-layernorm-compiled": train_job("--model.norm", "triton", "--compile.enabled", "true", steps=6,
                                           timeout_s=240),
    "cuda-prefetch-narrow-ids": train_job(
        "--data.cuda_prefetch", "true", "--data.pin_memory", "true", "--data.non_blocking", "true",
        "--data.narrow_ids", "true", "--train.grad_accum_steps", "2"),
    "pure-bf16-no-fp32-islands-padded-loss": train_job(
        "--train.precision", "bf16", "--model.fp32_islands", "false", "--model.attention", "manual",
        "--model.norm", "manual", "--model.vocab_pad_multiple", "128", "--model.loss_over_padded_vocab", "true"),
})
NEEDS_PACKAGE = {"adamw-8bit": "torchao", "triton-layernorm": "triton", "triton-layernorm-compiled": "triton"}

# the resume pair: an uninterrupted run that also keeps its step-4 checkpoint (the resumed copy starts there)
RESUME_COMMON = {
    # deterministic fp32 kernels, dropout on: the CUDA RNG state must be restored for equal losses
    "fp32-manual-dropout": ["--model.attention", "manual", "--model.dropout", "0.1"],
    # bf16 autocast, SDPA math kernel, fused AdamW (its step counters live on the GPU)
    "autocast-fused-adamw": ["--model.sdpa_backend", "math", "--train.precision", "bf16-autocast",
                             "--optim.impl", "fused", "--model.dropout", "0.1"],
}
RESUME_ARGS = ["--train.max_steps", "8", "--log.every_steps", "1", "--checkpoint.every_steps", "4",
               "--checkpoint.keep_last", "3"]

NO_ALLOC_CONF = {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": ""}  # "" = unset for the run
FSDP_CLI = ["-m", "tokenmill", "train", *BASE, "--parallel.dp_shard", "-1", "--parallel.dp_replicate", "1",
            "--checkpoint.every_steps", "2", "--run-dir", "{run}"]

OTHER_JOBS: dict[str, Job] = {
    **{f"resume-{k}": Job(tm_cmd("train", *BASE, *v, *RESUME_ARGS, "--run-dir", "{run}"))
       for k, v in RESUME_COMMON.items()},
    "profile": Job(tm_cmd("profile", *BASE[:BASE.index("--train.max_steps")], "--log.progress", "plain",
                          "--run-dir", "{run}", "--quiet", "--with-stack", "--wait", "1", "--warmup", "1",
                          "--active", "2")),
    # tokenmill profile starts the allocator's history before train() applies the allocator settings
    "profile-expandable": Job(tm_cmd("profile", *BASE[:BASE.index("--train.max_steps")], "--log.progress", "plain",
                                     "--memory.expandable_segments", "true", "--run-dir", "{run}", "--quiet",
                                     "--wait", "1", "--warmup", "1", "--active", "2"),
                              env=NO_ALLOC_CONF),
    # the allocator script writes {run}.json; PYTORCH_CUDA_ALLOC_CONF is cleared for these two
    **{f"alloc-{on}": Job([sys.executable, "{root}/alloc.py", "{run}.json", "train", *BASE,
                           "--memory.expandable_segments", on, "--run-dir", "{run}"], env=NO_ALLOC_CONF)
       for on in ("true", "false")},
    **{f"fsdp-{mp}": Job(torchrun_cmd("{root}/fsdp.py", "{run}.json", mp), timeout_s=180) for mp in ("none", "bf16")},
    "fsdp-cli": Job(torchrun_cmd(*FSDP_CLI), timeout_s=180),
}
SCRIPTS = {"alloc.py": ALLOC_SCRIPT, "fsdp.py": FSDP_SCRIPT}

ALL_JOBS = {**SWITCH_JOBS, **OTHER_JOBS}
# which jobs each test waits for (the pool starts only those of the selected tests)
TEST_JOBS = {
    "test_switch_runs_on_cuda": list(SWITCH_JOBS),
    "test_resume_on_cuda_equals_uninterrupted_run": [f"resume-{k}" for k in RESUME_COMMON],
    "test_profile_on_cuda_writes_memory_snapshot": ["profile"],
    "test_profile_keeps_expandable_segments": ["profile-expandable"],
    "test_expandable_segments_take_effect": ["alloc-true", "alloc-false"],
    "test_fsdp_under_torchrun_one_process": ["fsdp-none", "fsdp-bf16"],
    "test_fsdp_layout_through_the_cli_under_torchrun": ["fsdp-cli"],
}
# slowest first: they start in the first wave
ORDER = ["compile-default", "compile-reduce-overhead", "compile-per-block", "triton-layernorm-compiled", "profile",
         "profile-expandable", "fsdp-none", "fsdp-bf16", "fsdp-cli",
         *[k for k in ALL_JOBS if not k.startswith(("compile-", "profile", "fsdp-", "triton-layernorm-compiled"))]]


class Pool:
    """Starts jobs in the background, ``MAX_PARALLEL`` at a time; :meth:`result` waits for one."""

    def __init__(self, jobs: dict[str, Job], root: Path):
        self.jobs, self.root = jobs, root
        self.slots = threading.Semaphore(MAX_PARALLEL)
        self.env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1",
                        TOKENMILL_CACHE=str(root / "cache"))
        for name, text in SCRIPTS.items():
            (root / name).write_text(text)
        threading.Thread(target=self._start_all, daemon=True).start()

    def _start_all(self) -> None:
        for name in [k for k in ORDER if k in self.jobs]:
            self.slots.acquire()
            threading.Thread(target=self._run, args=(name,), daemon=True).start()

    def _run(self, name: str) -> None:
        job = self.jobs[name]
        job.run_dir = self.root / name
        argv = [a.replace("{run}", str(job.run_dir)).replace("{root}", str(self.root)) for a in job.argv]
        t0 = time.perf_counter()
        try:
            env = {k: v for k, v in {**self.env, **job.env}.items() if v != ""}  # "" = unset it
            p = subprocess.run(argv, capture_output=True, text=True, timeout=job.timeout_s, env=env)
            job.rc, job.stdout, job.stderr = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            job.rc, job.stderr = -1, f"timed out after {job.timeout_s:.0f} s\n{e.stderr or ''}"
        finally:
            job.wall_s = time.perf_counter() - t0
            self.slots.release()
            job.done.set()

    def result(self, name: str) -> Job:
        job = self.jobs[name]
        if not job.done.wait(timeout=job.timeout_s + 600):
            raise AssertionError(f"job {name} never finished")
        return job


@pytest.fixture(scope="module", autouse=True)
def pool(request, tmp_path_factory) -> Pool:
    wanted: set[str] = set()
    for item in request.session.items:
        if item.module is request.module:
            jobs = TEST_JOBS.get(getattr(item, "originalname", item.name), [])
            param = getattr(getattr(item, "callspec", None), "params", {}).get("name")
            wanted.update([param] if param in jobs else jobs)  # a selected switch starts only its own job
    jobs = {k: v for k, v in ALL_JOBS.items() if k in wanted and not _missing_package(k)}
    return Pool(jobs, tmp_path_factory.mktemp("gpu-runs"))


def _missing_package(job: str) -> Optional[str]:
    """Why ``job`` cannot run here: a Python package or a config value this tokenmill lacks (or None)."""
    import importlib.util
    import typing

    pkg = NEEDS_PACKAGE.get(job)
    if pkg and importlib.util.find_spec(pkg) is None:
        return f"needs the Python package {pkg} (not installed)"
    specs = C.field_specs()
    argv = ALL_JOBS[job].argv
    for key, value in zip(argv, argv[1:]):
        if key.startswith("--") and "." in key and not key.startswith("--nproc"):
            field_type = specs.get(key[2:], (None,))[0]
            if key[2:] not in specs:
                return f"config field {key[2:]} does not exist in this tokenmill"
            choices = typing.get_args(field_type) if typing.get_origin(field_type) is typing.Literal else ()
            if choices and value not in choices:
                return f"{key[2:]}={value!r} is not a choice in this tokenmill ({list(choices)})"
    return None


def ok(job: Job) -> Job:
    """Assert the run exited 0 with no traceback; return it."""
    where = f"{' '.join(job.argv)}\n--- stdout\n{job.stdout[-3000:]}\n--- stderr\n{job.stderr[-6000:]}"
    assert job.rc == 0, f"exit status {job.rc} after {job.wall_s:.0f} s: {where}"
    assert "Traceback" not in job.stderr, where
    return job


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if r.get("loss") is not None}


def checkpoint_files(run_dir: Path) -> dict[int, Path]:
    return {int(p.stem.split("_")[1]): p for p in sorted((run_dir / "checkpoints").glob("step_*.pt"))}


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


# ------------------------------------------------------------------------------------------------
# Every technique switch on CUDA, through the command line


@pytest.mark.parametrize("name", list(SWITCH_JOBS))
def test_switch_runs_on_cuda(pool, name):
    """Exit 0, a finite first loss near ln(vocab), the logged steps, peak memory and MFU on the GPU."""
    missing = _missing_package(name)
    if missing:
        pytest.skip(missing)
    job = ok(pool.result(name))
    rows = [r for r in metrics(job.run_dir) if r.get("loss") is not None]
    steps = 6 if "compile" in name else STEPS
    assert [r["step"] for r in rows] == list(range(2, steps + 1, 2)), rows
    for r in rows:
        assert math.isfinite(r["loss"]), r
        assert r["peak_alloc_mb"] > 0 and r["peak_reserved_mb"] >= r["peak_alloc_mb"], r
        if r.get("grad_norm") is not None:  # None when the optimizer steps inside backward
            assert math.isfinite(r["grad_norm"]), r
    assert abs(rows[0]["loss"] - math.log(VOCAB)) < 1.0, rows[0]  # a fresh model predicts ~uniformly
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["device"] == "cuda" and summary["gpu_name"], summary
    assert summary["tokens_per_sec"] and summary["tokens_per_sec"] > 0, summary
    assert any(r.get("val_loss") is not None and math.isfinite(r["val_loss"]) for r in metrics(job.run_dir))
    cfg = C.from_dict(C.load_toml(job.run_dir / "config.toml"))
    _check_mfu(summary, cfg)
    extra = SWITCH_CHECKS.get(name)
    if extra:
        extra(job, cfg, rows)


def _check_mfu(summary: dict, cfg: C.Config) -> None:
    """On a GPU of the peak table the run reports an MFU in (0, 1)."""
    from tokenmill.model import math_mode, peak_flops

    if peak_flops(summary["gpu_name"], math_mode(cfg.train.precision, cfg.train.tf32)):
        assert summary["mfu"] is not None and 0 < summary["mfu"] < 1, summary


def _check_fp16(job: Job, cfg: C.Config, rows: list[dict]) -> None:
    """The GradScaler ran: its state is in the checkpoint (a finite power-of-two scale at most the
    initial 2**16), and the logged gradient norm is the unscaled one (not ~65536 times too large)."""
    ckpts = checkpoint_files(job.run_dir)
    assert STEPS in ckpts, ckpts
    scaler = load_checkpoint(ckpts[STEPS])["scaler"]
    scale = float(scaler["scale"])
    assert 0 < scale <= 2.0**16 and math.log2(scale).is_integer(), scaler
    assert all(r["grad_norm"] < 100 for r in rows), rows


def _check_reduce_overhead(job: Job, cfg: C.Config, rows: list[dict]) -> None:
    """CUDA graphs were used: Inductor's perf hints (TORCH_LOGS=perf_hints) name any graph it left out."""
    skipped = [ln for ln in job.stderr.splitlines() if "skipping cudagraphs" in ln.lower()]
    assert not skipped, "compile.mode reduce-overhead ran without CUDA graphs:\n" + "\n".join(skipped[:5])


def _check_vocab_padding(job: Job, cfg: C.Config, rows: list[dict]) -> None:
    """The padded head (64 -> 128 rows) is in the checkpoint; the loss is over the 64 real ids."""
    sd = load_checkpoint(checkpoint_files(job.run_dir)[STEPS])["model"]
    assert sd["wte.weight"].shape[0] == 128, {k: tuple(v.shape) for k, v in sd.items() if "wte" in k}


def _check_pure_bf16(job: Job, cfg: C.Config, rows: list[dict]) -> None:
    """Pure bf16: the weights and AdamW moments saved are bf16."""
    state = load_checkpoint(checkpoint_files(job.run_dir)[STEPS])
    assert {v.dtype for v in state["model"].values() if v.is_floating_point()} == {torch.bfloat16}
    moments = [t for s in state["optimizer"]["state"].values() for k, t in s.items() if k.startswith("exp_avg")]
    assert moments and {t.dtype for t in moments} == {torch.bfloat16}


SWITCH_CHECKS = {
    "fp16-gradscaler": _check_fp16,
    "compile-reduce-overhead": _check_reduce_overhead,
    "hand-written-tf32-accum": _check_vocab_padding,
    "sdpa-efficient-pure-bf16-chunked": _check_pure_bf16,
}


# ------------------------------------------------------------------------------------------------
# Resume on CUDA


@pytest.mark.parametrize("variant", list(RESUME_COMMON))
def test_resume_on_cuda_equals_uninterrupted_run(pool, tmp_path, variant):
    """A run resumed on CUDA from the step-4 checkpoint continues the uninterrupted run's trajectory.

    The uninterrupted run (8 steps, a checkpoint every 4, dropout 0.1) keeps its step-4 checkpoint;
    a copy of that checkpoint and of the metrics up to step 4 in a fresh run directory is exactly what
    a run killed after step 4 leaves. ``--resume`` must restore model, optimizer, scheduler, data
    position and the CPU and CUDA RNG states (dropout masks), so steps 5-8 give the same losses
    (deterministic kernels: bit-exact is expected; 1e-6 relative allows only last-bit differences)
    and the same final weights."""
    full = ok(pool.result(f"resume-{variant}")).run_dir
    ckpts = checkpoint_files(full)
    assert sorted(ckpts) == [4, 8], ckpts
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copy(ckpts[4], cut / "checkpoints" / ckpts[4].name)
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics(full) if r["step"] <= 4))
    argv = tm_cmd("train", *BASE, *RESUME_COMMON[variant], *RESUME_ARGS, "--run-dir", cut, "--resume")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=150, env=dict(os.environ, OMP_NUM_THREADS="2"))
    ok(Job(argv, rc=p.returncode, stdout=p.stdout, stderr=p.stderr))
    assert "resumed from" in p.stdout, p.stdout
    assert json.loads((cut / "summary.json").read_text())["start_step"] == 4
    a, b = step_losses(full), step_losses(cut)
    assert list(b) == list(range(1, 9)), b
    for s in range(5, 9):
        assert abs(a[s] - b[s]) <= 1e-6 * abs(a[s]), (s, a[s], b[s], a, b)
    wa = load_checkpoint(checkpoint_files(full)[8])["model"]
    wb = load_checkpoint(checkpoint_files(cut)[8])["model"]
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=1e-6, atol=1e-7, msg=k)


# ------------------------------------------------------------------------------------------------
# Profile on CUDA


def test_profile_on_cuda_writes_memory_snapshot(pool):
    """``tokenmill profile`` on CUDA: the memory snapshot with allocator history, the HTML memory
    timeline, kernels and allocator statistics in profile.json; ``tokenmill doctor`` reads it."""
    job = ok(pool.result("profile"))
    d = job.run_dir
    with open(d / "memory_snapshot.pickle", "rb") as f:
        snap = pickle.load(f)
    assert snap["segments"], "the snapshot holds no allocator segment"
    events = [e for trace in snap.get("device_traces", []) for e in trace]
    assert events and {"alloc", "free_completed"} & {e.get("action") for e in events}, "no allocation history"
    prof = json.loads((d / "profile.json").read_text())
    assert prof["device"] == "cuda" and prof["gpu"]["name"]
    assert prof["top_kernels"] and prof["device_busy"]["kernels_per_step"] > 0
    assert prof["allocator"]["reserved_mb"] >= prof["allocator"]["allocated_mb"] > 0
    assert (d / "memory_timeline.html").exists(), prof["notes"]
    doc = subprocess.run(tm_cmd("doctor", d, "--json"), capture_output=True, text=True, timeout=120)
    assert doc.returncode == 0, doc.stderr
    verdict = json.loads(doc.stdout)
    assert verdict["device"] == "cuda" and "profile.json" in verdict["sources"], verdict


def test_expandable_segments_take_effect(pool):
    """``memory.expandable_segments`` sets the allocator before CUDA starts: every segment of the
    training process is expandable; without the switch none is (the check can tell them apart)."""
    for on in ("true", "false"):
        job = ok(pool.result(f"alloc-{on}"))
        res = json.loads(Path(f"{job.run_dir}.json").read_text())
        assert res["rc"] == 0 and res["expandable"], res
        assert None not in res["expandable"], f"this torch's snapshot has no 'is_expandable' field: {res}"
        if on == "true":
            assert "expandable_segments:True" in (res["conf"] or ""), res
            assert all(res["expandable"]), res
        else:
            assert not any(res["expandable"]), res


@pytest.mark.parametrize("mixed_precision", ["none", "bf16"])
def test_fsdp_under_torchrun_one_process(pool, mixed_precision):
    """FSDP2 (tokenmill's ``apply_fsdp``: every block, then the root) over NCCL in a one-process
    torchrun job: the parameters become DTensors and three AdamW steps give the plain model's losses
    (fp32: 1e-5 relative; the bf16 parameter policy against bf16 autocast: 2e-2)."""
    job = ok(pool.result(f"fsdp-{mixed_precision}"))
    res = json.loads(Path(f"{job.run_dir}.json").read_text())
    assert res["param_types"] == ["DTensor"], res
    tol = 1e-5 if mixed_precision == "none" else 2e-2
    for a, b in zip(res["losses"]["plain"], res["losses"]["fsdp"]):
        assert math.isfinite(b) and abs(a - b) <= tol * abs(a), res


def test_fsdp_layout_through_the_cli_under_torchrun(pool):
    """``torchrun --nproc-per-node 1 -m tokenmill train --parallel.dp_shard -1 --parallel.dp_replicate 1``:
    one-process FSDP through the trainer over a 1-rank NCCL mesh (DCP checkpoint, resume); the same path
    on gloo is tests/test_parallel.py::test_one_process_fsdp_under_torchrun."""
    job = ok(pool.result("fsdp-cli"))
    run = job.run_dir
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1
    assert summary["layout"] == "fsdp", summary["layout"]
    assert list((run / "checkpoints").glob("step_*.dcp")), "an FSDP run writes DCP checkpoints"
    argv = torchrun_cmd(*[str(run) if a == "{run}" else a for a in FSDP_CLI], "--train.max_steps", "6", "--resume")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-6000:]
    assert list(step_losses(run)) == [2, 4, 6]


def test_profile_keeps_expandable_segments(pool):
    """``tokenmill profile --memory.expandable_segments true``: the profiled run's allocator uses
    expandable segments (every segment of its memory snapshot), as ``tokenmill train`` does. The
    profiler starts the allocator's history (which initialises CUDA) before the trainer applies the
    allocator settings, so this checks that order."""
    job = ok(pool.result("profile-expandable"))
    with open(job.run_dir / "memory_snapshot.pickle", "rb") as f:
        segments = pickle.load(f)["segments"]
    flags = [seg.get("is_expandable") for seg in segments]
    assert flags and all(flags), f"segments not expandable: {flags}"


# ------------------------------------------------------------------------------------------------
# Numerics in this process: SDPA kernels and the chunked loss on tokenmill.model.GPT


def _model_cfg(**over) -> C.ModelConfig:
    base = {"data.source": "synthetic", "model.vocab_size": VOCAB, "train.device": "cuda", "model.dropout": 0.0}
    return C.resolve("tiny", overrides={**base, **over}, overrides_from_string=False).model


def _loss_and_grads(mcfg: C.ModelConfig, vocab: int, x, y, mode: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of a freshly seeded GPT on CUDA; ``mode``: fp32, bf16-autocast or bf16 (pure)."""
    from tokenmill.model import GPT

    torch.manual_seed(0)
    model = GPT(mcfg, vocab).cuda()
    if mode == "bf16":
        model.to(torch.bfloat16)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if mode == "bf16-autocast" else nullcontext()
    with ctx:
        _, loss = model(x, y)
    loss.backward()
    return loss.float().item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("backend", ["flash", "efficient", "cudnn"])
def test_sdpa_backend_matches_math_kernel(backend):
    """Each forced SDPA kernel (bf16 autocast) gives the math kernel's loss (1e-2 relative) and gradients
    (3e-2 relative per parameter: bf16 operands, whose outputs alone differ by up to ~1e-2, and the
    math kernel accumulates in fp32)."""
    x, y = (torch.randint(0, VOCAB, (4, 32), device="cuda") for _ in range(2))
    ref_loss, ref = _loss_and_grads(_model_cfg(**{"model.sdpa_backend": "math"}), VOCAB, x, y, "bf16-autocast")
    loss, got = _loss_and_grads(_model_cfg(**{"model.sdpa_backend": backend}), VOCAB, x, y, "bf16-autocast")
    assert abs(loss - ref_loss) <= 1e-2 * abs(ref_loss), (loss, ref_loss)
    errs = {k: _rel(got[k], ref[k]) for k in ref}
    assert max(errs.values()) <= 3e-2, errs


@pytest.mark.parametrize("mode", ["bf16", "bf16-autocast"])
def test_chunked_loss_matches_full_loss_in_bf16(mode):
    """Chunked against full cross-entropy in bf16 (pure and autocast), same seed and batch, vocabulary
    512 over 256 tokens in chunks of 48 (a short last chunk). Tolerances: loss 1e-3 relative (the same
    bf16 logits, summed in another order); each parameter's gradient 2e-2 relative (bf16 rounding of
    the logit gradients, once per chunk instead of once); and against the fp32 full-loss gradients
    the chunked error is at most 1.5 times the full loss's own bf16 error (+1e-3)."""
    vocab = 512
    over = {"model.vocab_size": vocab, "model.n_embd": 64, "model.n_head": 4, "model.block_size": 64,
            "model.loss_chunk_size": 48}
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randint(0, vocab, (4, 64), generator=g).cuda() for _ in range(2))
    _, ref = _loss_and_grads(_model_cfg(**over), vocab, x, y, "fp32")
    full_loss, full = _loss_and_grads(_model_cfg(**over), vocab, x, y, mode)
    ch_loss, ch = _loss_and_grads(_model_cfg(**over, **{"model.loss_impl": "chunked"}), vocab, x, y, mode)
    assert math.isfinite(ch_loss) and abs(ch_loss - full_loss) <= 1e-3 * abs(full_loss), (ch_loss, full_loss)
    errs = {k: _rel(ch[k], full[k]) for k in full}
    assert max(errs.values()) <= 2e-2, errs
    flat = lambda d: torch.cat([d[k].flatten() for k in sorted(d)])  # noqa: E731
    err_chunked, err_full = _rel(flat(ch), flat(ref)), _rel(flat(full), flat(ref))
    assert err_chunked <= 1.5 * err_full + 1e-3, (err_chunked, err_full)


def test_activation_offload_on_cuda_keeps_the_math_and_frees_the_device():
    """memory.offload_activations' hooks (tokenmill.model.offload) on CUDA: the side stream's pinned copies give the
    same gradients as no offloading (1e-6 relative: the same kernels on the same inputs; copies are exact), the
    weights stay, at most IN_FLIGHT tensors are kept on the device when the forward ends, and the memory the
    forward leaves allocated drops by at least half of what moved."""
    from tokenmill.model.build import build_gpt
    from tokenmill.model.offload import IN_FLIGHT, ActivationOffload

    mcfg = _model_cfg(**{"model.n_layer": 4, "model.n_embd": 256, "model.n_head": 4, "model.block_size": 256})
    torch.manual_seed(0)
    model = build_gpt(mcfg, VOCAB, "cuda")
    idx = torch.randint(0, VOCAB, (8, 256), device="cuda")

    def run(ctx):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with ctx:
            loss = model(idx, idx)[1]
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - base
        loss.backward()
        torch.cuda.synchronize()
        return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, held

    plain, held_plain = run(nullcontext())
    hooks = ActivationOffload(model, torch.device("cuda"))
    moved, held_off = run(hooks)
    errs = {n: _rel(moved[n], plain[n]) for n in plain}
    assert max(errs.values()) <= 1e-6, errs
    assert hooks.moved > 0 and not hooks.pending and not hooks.resident and hooks.stayed <= IN_FLIGHT
    assert held_plain - held_off >= 0.5 * hooks.moved, (held_plain, held_off, hooks.moved)
