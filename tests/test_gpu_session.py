"""benchmarks/gpu_session.sh on a CPU: parts in order of value, each fitting one call of a 15-minute loan,
and what a part leaves for the device to return (at most 8 files of at most 16 MiB, at most 2 folders deep,
the commit in the JSON).

Parts run for real with ``SMOKE=1`` (the short CUDA tier, hidden from any GPU so it only collects and skips;
a one-rung ladder slice, whose rung is skipped on a CPU; the part ``first``, killed at seeded random moments
with SIGINT, SIGTERM and SIGKILL); the packing, slicing, batch choice and goal logic is checked in this
process on small inputs."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _session_module():
    spec = importlib.util.spec_from_file_location("gpu_session_parts", ROOT / "benchmarks" / "session.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


session = _session_module()
first = sys.modules["first"]  # benchmarks/first.py, imported by session.py
session_lib = sys.modules["session_lib"]


def smoke_env(work: Path, **extra: str) -> dict[str, str]:
    return dict(os.environ, SMOKE="1", TOKENMILL_SESSION_WORK=str(work), OMP_NUM_THREADS="1",
                PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", **extra)  # never the real CUDA tier from a CPU test


def run_part(part: str, out: Path, work: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), part, str(out), *extra], capture_output=True, text=True,
                          env=smoke_env(work), timeout=240, cwd=ROOT)


def check_layout(out: Path) -> list[Path]:
    """What the device returns: <= 8 files, each <= 16 MiB, nothing deeper than OUT/a/b/file."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for p in files:
        assert p.stat().st_size <= 16 * 2**20, p
        assert len(p.relative_to(out).parts) <= 3, p
    return files


@pytest.mark.slow
def test_list_prints_the_parts_in_order_of_value_with_their_time():
    p = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    rows = [line.split() for line in p.stdout.splitlines()[1:]]
    names = [row[1] for row in rows]
    assert names == [part.name for part in session.PARTS]
    assert names[:2] == ["first", "cuda-tier"] and names[-1] == "best-autotune"
    assert {"memory", "max-model", "rasbt", "profile", "book-perf", "llama", "llama-2", "llama-3", "check"} <= set(names)
    for row, part in zip(rows, session.PARTS):  # each part's time, as --list shows it, fits one call of a loan
        assert row[2] == f"~{part.est_s / 60:.1f}" and row[3] == "min", row
        assert part.est_s <= 7.5 * 60 and part.budget_s <= session.PART_BUDGET_S == 420, (part.name, part.est_s)
    # the two device commands of one loan: 15 minutes, of which start-up takes up to 3
    assert session.PARTS[0].est_s + session.PARTS[1].est_s <= 10 * 60
    assert session.PARTS[0].est_s <= 7 * 60


def test_the_device_commands_are_in_the_readme():
    text = (ROOT / "benchmarks" / "README.md").read_text()
    for part in ("first", "cuda-tier"):
        assert f'bash benchmarks/gpu_session.sh {part} "$OUT" ' in text, part
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    assert ".device-wheels" not in text + script and "import tomli_w" not in script  # nothing to carry


@pytest.mark.slow
def test_cuda_tier_runs_its_tests_in_order_of_value_and_reports_them(tmp_path):
    out = tmp_path / "out"
    p = run_part("cuda-tier", out, tmp_path / "work", COMMIT)
    assert p.returncode == 0, p.stdout + p.stderr
    names = {f.name for f in check_layout(out)}
    assert {"cuda-tier.json", "cuda-tier.log", "cuda-tier-details.tar.gz", "cuda-tier-pytest.txt",
            "cuda-tier-junit.xml"} <= names
    manifest = json.loads((out / "cuda-tier.json").read_text())
    assert manifest["commit"] == COMMIT and manifest["environment"]["git_commit"] == COMMIT
    assert manifest["environment"]["git_dirty"] is None  # no way to know from a commit given as an argument
    assert manifest["layout"]["ok"] and manifest["smoke"] is True
    (step,) = [s for s in manifest["steps"] if s["name"].startswith("pytest")]
    assert step["argv"][3:3 + len(session.CUDA_TIER)] == session.CUDA_TIER  # in order of value
    assert not any(a == "-x" or a.startswith("--maxfail") for a in step["argv"])
    assert step["limit_s"] <= session.CUDA_TIER_CAP_S and manifest["budget_s"] <= 210
    assert manifest["results"]["pytest_env"]["TORCHINDUCTOR_COMPILE_THREADS"] == "4"
    counts = manifest["results"]["pytest"]
    assert counts["tests"] >= len(session.CUDA_TIER) and counts["failures"] == counts["errors"] == 0
    skipped = counts["skipped_tests"]  # no GPU here: every test of the tier is skipped, with its reason
    assert len(skipped) == counts["tests"] and all("CUDA" in why for why in skipped.values()), skipped
    assert any("test_gpu::test_switch_runs_on_cuda[fp16-gradscaler]" in t for t in skipped)
    assert counts["not_run"] == [] and "stopped_by_the_clock_s" not in counts


@pytest.mark.slow
def test_compiled_kernels_part_returns_the_estimators_kernels_by_kind(tmp_path):
    """On a CPU (SMOKE) the part runs the script's estimate-only side for an A100: both rasbt rungs, the eager one
    without Inductor kernels and the compiled one with them, each sum the pieces' milliseconds."""
    out = tmp_path / "out"
    p = run_part("compiled-kernels", out, tmp_path / "work", COMMIT)
    assert p.returncode == 0, p.stdout + p.stderr
    assert {f.name for f in check_layout(out)} >= {"compiled-kernels.json", "compiled_kernels.json"}
    doc = json.loads((out / "compiled_kernels.json").read_text())
    eager, compiled = (doc["rungs"][r]["estimate"] for r in ("flash-attention", "compile"))
    assert "triton" not in eager["ms"] and compiled["ms"]["triton"] > 0 and compiled["kernels"]["triton"] > 0
    for est in (eager, compiled):
        assert est["total_ms"] == pytest.approx(sum(est["by_piece_ms"].values()))
        assert est["total_ms"] == pytest.approx(sum(est["ms"].values())) and est["ms"]["matmul"] > 0


def test_the_tests_the_clock_stopped_are_named(tmp_path):
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite tests="2"><testcase classname="tests.test_gpu" name="test_a[x]"/>'
        '<testcase classname="tests.test_loader" name="test_b"/><testcase time="0.0"/></testsuite></testsuites>')
    ids = ["tests/test_gpu.py::test_a", "tests/test_loader.py::test_b", "tests/test_gpu.py::test_c[y]"]
    assert session.not_run(tmp_path / "junit.xml", ids) == ["tests/test_gpu.py::test_c[y]"]
    assert session.not_run(tmp_path / "missing.xml", ids) == ids


@pytest.mark.slow
def test_ladder_slice_part_leaves_ladder_files_and_commit(tmp_path):
    out = tmp_path / "out"
    p = run_part("best-autotune", out, tmp_path / "work", COMMIT)
    assert p.returncode == 0, p.stdout + p.stderr
    names = {f.name for f in check_layout(out)}
    assert {"best-autotune.json", "best-autotune-ladder.json", "best-autotune-ladder.md",
            "best-autotune-details.tar.gz"} <= names
    doc = json.loads((out / "best-autotune-ladder.json").read_text())
    assert doc["environment"]["git_commit"] == COMMIT
    assert [r["name"] for r in doc["rungs"]] == ["compile-max-autotune"]
    assert doc["rungs"][0]["status"] == "skipped"  # torch.compile on a CPU in --smoke
    with tarfile.open(out / "best-autotune-details.tar.gz") as tar:
        members = tar.getnames()
    assert "best-autotune-ladder.toml" in members and "best-autotune/ladder.json" in members
    manifest = json.loads((out / "best-autotune.json").read_text())
    assert manifest["commit"] == COMMIT and manifest["results"]["rungs"]["compile-max-autotune"]["status"] == "skipped"


def test_the_commit_is_required_where_there_is_no_git(tmp_path, capsys):
    assert session.main(["check", str(tmp_path / "out")]) == 2
    assert "commit" in capsys.readouterr().err
    assert session.main(["no-such-part", str(tmp_path / "out"), "--commit", COMMIT]) == 2


def test_slice_folds_the_earlier_rungs_and_leaves_out_the_deferred():
    tree = session.read_ladder("best")
    sets = {r["name"]: r.get("set", {}) for r in tree["rung"]}
    part = session.slice_ladder("best", ["vocab-pad-64", "batch-32"], ["compile-max-autotune"], cuda=True, smoke=False)
    assert [r["name"] for r in part["rung"]] == ["vocab-pad-64", "batch-32"]
    base = part["ladder"]["base"]
    assert base["model.sdpa_backend"] == "cudnn" and base["compile.enabled"] is True  # earlier rungs, carried
    assert "compile.mode" not in base  # the deferred max-autotune rung
    assert base["train.batch_size"] == tree["ladder"]["base"]["train.batch_size"]  # later rungs: not folded
    # on a CPU in --smoke the ladder skips the CUDA and compile rungs, so a slice does not carry them
    cpu = session.slice_ladder("best", ["vocab-pad-64"], [], cuda=False, smoke=True)["ladder"]["base"]
    assert cpu.get("model.sdpa_backend") == tree["ladder"]["base"]["model.sdpa_backend"] and "compile.enabled" not in cpu
    # fold_all: every other rung under the one measured (max-autotune at batch 128 with the chunked loss)
    last = session.slice_ladder("best", ["compile-max-autotune"], [], cuda=True, smoke=False, fold_all=True)
    assert last["ladder"]["base"]["train.batch_size"] == sets["batch-128"]["train.batch_size"]
    assert last["ladder"]["base"]["model.loss_impl"] == "chunked"
    with pytest.raises(SystemExit, match="no rung"):
        session.slice_ladder("best", ["no-such-rung"], [], cuda=True, smoke=False)


def test_llama_parts_slice_the_ladder_at_compile():
    """The llama ladder's parts: the eager rungs (in two parts), then compile and batch-4 on top of them, then the
    chunked loss and the batch it makes room for on top of everything before (as the ladder carries them)."""
    names = [r["name"] for r in session.read_ladder("llama")["rung"]]
    parts = {p.name: p.rungs(names) for p in session.PARTS if p.ladder == "llama"}
    assert parts["llama"] + parts["llama-2"] == names[: names.index("compile")]
    assert parts["llama-3"] == ["compile", "batch-4"]
    last = session.slice_ladder("llama", parts["llama-4"], [], cuda=True, smoke=False)
    base = last["ladder"]["base"]
    assert (base["compile.enabled"], base["train.batch_size"], base["model.attention"], base["model.fused_qkv"]) == (
        True, 4, "sdpa", True)
    assert [r["name"] for r in last["rung"]] == ["chunked-loss", "batch-8"] and base["model.loss_impl"] == "full"


def test_pack_leaves_out_the_largest_members_to_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["session_lib"], "MAX_BYTES", 256 * 1024)  # the layout rules live there
    monkeypatch.setenv("TOKENMILL_SESSION_WORK", str(tmp_path / "work"))
    s = session.Session("demo", tmp_path / "out", COMMIT, smoke=True)
    s.out.mkdir()
    (s.work / "rungs" / "00-a").mkdir(parents=True)
    (s.work / "rungs" / "00-a" / "metrics.jsonl").write_text('{"step": 1}\n' * 100)
    (s.work / "trace.json").write_bytes(os.urandom(400 * 1024))  # incompressible: cannot fit
    (s.work / "snapshot.pickle").write_bytes(bytes(2 * 2**20))  # over 6 x the limit: left out untried
    (s.work / "checkpoints").mkdir()
    (s.work / "checkpoints" / "step_00000001.pt").write_bytes(b"weights")
    s.log("hello")
    info = session.pack(s)
    archive = s.out / "demo-details.tar.gz"
    assert archive.stat().st_size <= 256 * 1024
    assert [d.split(" ")[0] for d in info["dropped_to_fit_16MiB"]] == ["snapshot.pickle", "trace.json"]
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "rungs/00-a/metrics.jsonl" in names and not any("checkpoints" in n for n in names)
    assert (s.out / "demo.log").read_text() == "hello\n"


def test_layout_flags_what_the_device_would_not_return(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules["session_lib"], "MAX_BYTES", 1024)
    for i in range(9):
        (tmp_path / f"f{i}.txt").write_text("x")
    (tmp_path / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c" / "deep.txt").write_text("x")
    (tmp_path / "big.bin").write_bytes(b"0" * 2048)
    got = session.layout(tmp_path)
    assert not got["ok"] and got["count"] == 11
    assert got["too_deep"] == ["a/b/c/deep.txt"] and got["too_big"] == ["big.bin"]
    ok_dir = tmp_path / "ok"
    (ok_dir / "a" / "b").mkdir(parents=True)
    (ok_dir / "a" / "b" / "file.txt").write_text("x")  # OUT/a/b/file comes back
    assert session.layout(ok_dir)["ok"]


def test_memory_goal_compares_with_the_baseline_rung(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"peak_alloc_mb": 4800.0, "tokens_per_sec": 1000.0}))
    ladder = tmp_path / "ladder.json"
    ladder.write_text(json.dumps({"rungs": [{"name": "baseline", "status": "measured",
                                             "summary": {"tokens_per_sec": 1400.0}}]}))
    goal = session.memory_goal(run, ladder)
    assert goal["peak_ok"] and goal["step_time_ratio"] == pytest.approx(1.4) and goal["ratio_ok"]
    (run / "summary.json").write_text(json.dumps({"peak_alloc_mb": 5200.0, "tokens_per_sec": 600.0}))
    goal = session.memory_goal(run, ladder)
    assert not goal["peak_ok"] and not goal["ratio_ok"]
    assert "error" in session.memory_goal(tmp_path / "missing", ladder)


def test_every_single_gpu_rung_is_in_exactly_one_part_and_fits():
    """Ladders grow: every rung of the single-GPU ladders is measured by exactly one part (rungs added
    later land in the part that runs a ladder's tail), and no part has so many rungs to run on a GPU
    that each would get under 45 s of the part's budget."""
    from collections import Counter

    for name in ("best", "rasbt", "memory", "book-memory", "book-perf", "llama", "optimizers"):
        tree = session.read_ladder(name)
        names = [r["name"] for r in tree["rung"]]
        parts = [p for p in session.PARTS if p.ladder == name]
        counts = Counter(n for p in parts for n in p.rungs(names))
        assert counts == Counter(names), (name, counts)
        for p in parts:
            chosen = p.rungs(names)
            will_run = [r for r in tree["rung"] if r["name"] in chosen and session.runnable_here(r, tree, True, False)]
            assert len(will_run) * 45 <= session.PART_BUDGET_S - 40, (p.name, [r["name"] for r in will_run])


# ------------------------------------------------------------------------------------------------
# The part `first`


def test_first_pieces_fit_in_order_of_value():
    names = [p.name for p in first.PIECES]
    assert names == ["environment", "gpt2-naive", "gpt2-fastest", "rasbt-baseline", "rasbt-last", "llama-compiled"]
    assert first.FIRST_EST_S + session.PACK_S <= 7 * 60  # under 7 minutes on one H100, by estimate
    assert all(p.est_s < p.cap_s for p in first.PIECES)  # every cap leaves room over its estimate


def test_the_fastest_config_is_the_best_ladders_fastest_rung_without_autotune_or_recompute(tmp_path):
    from tokenmill import config as C

    sets, names = session.fastest_best_sets(cuda=True, smoke=False)
    assert "compile-max-autotune" not in names and not set(session.RECOMPUTE) & set(names)
    assert names[:3] == ["baseline", "cudnn-attention", "compile"] and "batch-128" in names
    assert "memory.activation_checkpointing" not in sets and "memory.activation_checkpointing_policy" not in sets
    assert "compile.mode" not in sets
    assert (sets["compile.enabled"], sets["model.vocab_pad_multiple"], sets["model.loss_impl"],
            sets["train.batch_size"]) == (True, 64, "chunked", 128)
    path = tmp_path / "fastest.toml"
    where = session.write_fastest_config(path, None, smoke=True)  # a CPU: the CUDA-only rungs are not carried
    cfg = C.from_dict(C.load_toml(path))
    assert cfg.memory.activation_checkpointing == 0 and cfg.compile.mode != "max-autotune-no-cudagraphs"
    assert cfg.model.loss_impl == "chunked" and cfg.train.batch_size == 128 and "not compile-max-autotune" in where


@pytest.mark.slow
def test_the_batch_is_the_largest_the_estimate_fits():
    """A small model on an 80 GB GPU: the chosen batch's estimated peak is within 85% of the memory and the
    next multiple of 8 is not (the estimate is linear in the batch: two estimates give the answer)."""
    from tokenmill import config as C
    from tokenmill.bench.sizing import with_overrides
    from tokenmill.estimate import estimate, gpu_spec

    cfg = C.resolve("gpt2-124m", overrides={"model.n_layer": 1, "model.n_embd": 128, "model.n_head": 2,
                                            "model.vocab_size": 8192, "data.source": "synthetic",
                                            "train.precision": "bf16-autocast"}, overrides_from_string=False)
    got = first.pick_batch(cfg, "h100-sxm", limit=8192)
    cap = 0.85 * gpu_spec("h100-sxm").memory_mb
    assert got["batch"] and got["batch"] % 8 == 0 and got["cap_mb"] == round(cap)
    assert got["estimates_mb"][got["batch"]] <= cap, got
    over = estimate(with_overrides(cfg, {"train.batch_size": got["batch"] + 8}), gpu_spec("h100-sxm"), 1)
    assert over.peak_reserved_mb > cap, (got, over.peak_reserved_mb)


def test_a_rung_record_sets_the_measurement_beside_the_estimate():
    rung = {"status": "measured", "wall_s": 80.0, "config": {"train": {"batch_size": 192, "precision": "bf16-autocast"}},
            "summary": {"tokens_per_sec": 600_000.0, "mfu": 0.41, "peak_alloc_mb": 60_000.0, "peak_reserved_mb": 64_000.0,
                        "peak_alloc_mb_run": 61_000.0, "compile_s": 48.5},
            "estimate": {"tokens_per_sec": 540_000.0, "peak_reserved_mb": 70_400.0},
            "estimate_error_vs_measured": {"tokens_per_sec": -0.1, "peak_reserved_mb": 0.1}}
    rec = first.rung_record(rung)
    assert (rec["batch_size"], rec["tokens_per_sec"], rec["mfu"], rec["compile_s"]) == (192, 600_000.0, 0.41, 48.5)
    assert rec["peak_alloc_mb_run"] == 61_000.0 and rec["peak_reserved_mb_run"] is None  # .get: absent is None
    assert rec["estimate_error_pct"] == {"tokens_per_sec": -10.0, "peak_reserved_mb": 10.0}
    tree = session.slice_ladder("llama", ["compile"], [], cuda=True, smoke=False)
    cpu = first.cpu_smoke(tree)
    assert tree["rung"][0]["set"] == {"compile.enabled": True} and cpu["rung"][0]["set"] == {}
    assert cpu["ladder"]["base"]["compile.enabled"] is False and "requires" not in cpu["rung"][0]


@pytest.mark.slow
def test_environment_names_cudnn_and_says_when_local_changes_are_unknown(tmp_path, monkeypatch):
    from tokenmill.bench import env

    assert (env.cudnn_version(90800), env.cudnn_version(8902), env.cudnn_version(None)) == ("9.8.0", "8.9.2", None)
    monkeypatch.setenv("TOKENMILL_GIT_COMMIT", COMMIT)
    facts = env.git_facts(tmp_path / "copy" / "env.py")  # a copy without .git: the commit is given, not read
    assert facts["git_commit"] == COMMIT and facts["git_dirty"] is None and "unknown" in facts["git_dirty_note"]
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "b.toml").write_text("y = 2\n")
    before = env.source_fingerprint(tmp_path / "pkg")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.pyc").write_bytes(b"cache")
    assert env.source_fingerprint(tmp_path / "pkg") == before  # caches do not count
    (tmp_path / "pkg" / "sub" / "b.toml").write_text("y = 3\n")
    assert env.source_fingerprint(tmp_path / "pkg") != before


@pytest.mark.slow
def test_tagged_processes_are_found_and_killed_in_their_own_sessions():
    tag = f"unit-{os.getpid()}-{time.time_ns()}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True,
                             env=dict(os.environ, **{session_lib.TAG_VAR: tag}))
    try:
        deadline = time.monotonic() + 10
        while child.pid not in session_lib.tagged_pids(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert session_lib.tagged_pids(tag) == [child.pid]
        assert child.pid in session_lib.kill_tagged(tag)
        assert child.wait(timeout=10) == -signal.SIGKILL and session_lib.tagged_pids(tag) == []
    finally:
        child.kill()


def _processes_with(tag: str) -> list[int]:
    return session_lib.tagged_pids(tag)


def _kill_first_at(tmp_path: Path, sig: signal.Signals, at_s: float) -> dict:
    """Start the part `first` (SMOKE=1), send ``sig`` after ``at_s`` seconds, and check what it left."""
    out, tag = tmp_path / f"out-{sig.name}", f"test-{sig.name}-{os.getpid()}-{time.time_ns()}"
    proc = subprocess.Popen(["bash", str(SCRIPT), "first", str(out), COMMIT], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env=smoke_env(tmp_path / f"work-{sig.name}", TOKENMILL_SESSION_TAG=tag))
    time.sleep(at_s)
    proc.send_signal(sig)  # bash execs python: the part itself gets it
    _, err = proc.communicate(timeout=120)
    deadline = time.monotonic() + 10  # SIGKILL: the reaper ends what the part started
    while _processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with(tag), f"{sig.name} at {at_s:.1f} s left processes running"
    manifest = json.loads((out / "first.json").read_text())  # whole JSON, whatever the moment
    files = check_layout(out)
    assert all(f.parent == out for f in files)
    return {"rc": proc.returncode, "manifest": manifest, "stderr": err, "at_s": at_s}


@pytest.mark.slow
def test_first_killed_at_any_moment_leaves_a_whole_manifest_and_no_process(tmp_path):
    """SIGINT, SIGTERM and SIGKILL at seeded random moments (the three runs side by side): every time a valid
    first.json of what finished (pieces in order: measured ones with their figures, then the one it was in),
    at most 8 files directly in OUT, and no process of the part left running."""
    rng = random.Random(33)
    plan = [(signal.SIGINT, rng.uniform(3, 12)), (signal.SIGTERM, rng.uniform(12, 30)),
            (signal.SIGKILL, rng.uniform(5, 30))]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: _kill_first_at(tmp_path, *p), plan))
    order = [p.name for p in first.PIECES]
    for (sig, at), got in zip(plan, results):
        m = got["manifest"]
        assert m["part"] == "first" and m["commit"] == COMMIT, m
        pieces = m.get("results", {}).get("pieces", {})
        assert list(pieces) == order[:len(pieces)], (sig.name, at, list(pieces))
        for name, rec in pieces.items():
            if rec["status"] == "measured" and name != "environment":
                assert rec["tokens_per_sec"] > 0 and rec["batch_size"] >= 1, rec
        if sig == signal.SIGKILL:
            assert got["rc"] == -signal.SIGKILL
        elif m["stopped_by"] == "a signal before the part started":  # gpu_session.sh's manifest: python had not started
            assert got["rc"] in (-sig, 128 + sig) and not pieces, got
        else:
            assert got["rc"] == 128 + sig, (sig.name, at, got["rc"], got["stderr"][-2000:])
            assert m["stopped_by"] == sig.name and "layout" in m and m["layout"]["ok"], m
            assert all(st.get("rc") is not None or st.get("skipped") or st.get("interrupted") for st in m["steps"])
            assert not pieces or list(pieces.values())[-1]["status"] in ("interrupted", "measured"), pieces
            assert "Traceback" not in got["stderr"], got["stderr"][-3000:]
