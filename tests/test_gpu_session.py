"""benchmarks/gpu_session.sh on a CPU: parts in order of value, and what a part leaves for the device to
return (at most 8 files of at most 16 MiB, at most 2 folders deep, the commit in the JSON).

Two parts run for real with ``SMOKE=1`` (the CUDA tier, hidden from any GPU so it only collects and
skips; and a one-rung ladder slice, whose rung is skipped on a CPU); the packing, slicing and goal
logic is checked in this process on small inputs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
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


def run_part(part: str, out: Path, work: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SMOKE="1", TOKENMILL_SESSION_WORK=str(work), OMP_NUM_THREADS="1",
               PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")  # never the real CUDA tier from a CPU test
    return subprocess.run(["bash", str(SCRIPT), part, str(out), *extra], capture_output=True, text=True, env=env,
                          timeout=240, cwd=ROOT)


def check_layout(out: Path) -> list[Path]:
    """What the device returns: <= 8 files, each <= 16 MiB, nothing deeper than OUT/a/b/file."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for p in files:
        assert p.stat().st_size <= 16 * 2**20, p
        assert len(p.relative_to(out).parts) <= 3, p
    return files


def test_list_prints_the_parts_in_order_of_value():
    p = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    names = [line.split()[1] for line in p.stdout.splitlines()[1:]]
    assert names == [part.name for part in session.PARTS]
    assert names[:2] == ["check", "best"] and names[-1] == "best-autotune"
    assert {"memory", "max-model", "rasbt", "profile", "book-perf", "llama", "llama-2", "llama-3"} <= set(names)


def test_check_part_leaves_the_cuda_tier_report(tmp_path):
    out = tmp_path / "out"
    p = run_part("check", out, tmp_path / "work", COMMIT)
    assert p.returncode == 0, p.stdout + p.stderr
    names = {f.name for f in check_layout(out)}
    assert {"check.json", "check.log", "check-details.tar.gz", "check-pytest.txt", "check-junit.xml"} <= names
    manifest = json.loads((out / "check.json").read_text())
    assert manifest["commit"] == COMMIT and manifest["environment"]["git_commit"] == COMMIT
    assert manifest["layout"]["ok"] and manifest["smoke"] is True
    (step,) = [s for s in manifest["steps"] if s["name"] == "pytest -m gpu"]
    assert "-x" not in step["argv"] and ["-m", "gpu"] == step["argv"][3:5]  # the CUDA tier only, every test
    counts = manifest["results"]["pytest"]
    assert counts["tests"] >= 20 and counts["failures"] == counts["errors"] == 0
    skipped = counts["skipped_tests"]  # no GPU here: every test of the tier is skipped, with its reason
    assert skipped and all("CUDA" in why for why in skipped.values()), skipped
    assert any("test_gpu::test_switch_runs_on_cuda" in t for t in skipped)


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
    """The llama ladder's parts: the eager rungs, then compile and batch-4 on top of them, then the chunked
    loss and the batch it makes room for on top of everything before (as the ladder carries them)."""
    names = [r["name"] for r in session.read_ladder("llama")["rung"]]
    parts = {p.name: p.rungs(names) for p in session.PARTS if p.ladder == "llama"}
    assert parts["llama"] == names[: names.index("compile")] and parts["llama-2"] == ["compile", "batch-4"]
    last = session.slice_ladder("llama", parts["llama-3"], [], cuda=True, smoke=False)
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

    for name in ("best", "rasbt", "memory", "book-memory", "book-perf", "llama"):
        tree = session.read_ladder(name)
        names = [r["name"] for r in tree["rung"]]
        parts = [p for p in session.PARTS if p.ladder == name]
        counts = Counter(n for p in parts for n in p.rungs(names))
        assert counts == Counter(names), (name, counts)
        for p in parts:
            chosen = p.rungs(names)
            will_run = [r for r in tree["rung"] if r["name"] in chosen and session.runnable_here(r, tree, True, False)]
            assert len(will_run) * 45 <= session.PART_BUDGET_S - 40, (p.name, [r["name"] for r in will_run])
