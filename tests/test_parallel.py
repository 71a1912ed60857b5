"""Multi-process training on CPU (gloo, 2 processes launched by torchrun).

Every layout must train on the same global batches as one process: per-step losses equal the
single-process run with ``batch_size x dp`` within 1e-5 relative (fp32, dropout 0; only the order of
floating-point sums differs). Several layouts run one after the other inside one torchrun launch (this
file is also the worker script: ``python -m torch.distributed.run ... test_parallel.py --worker SPEC``)
to keep the import/launch cost to two launches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_env, tiny_cfg

REL_TOL = 1e-5
STEPS = 6


def losses(run_dir) -> dict[int, float]:
    from tokenmill.train.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if r.get("loss") is not None}


def assert_same_losses(got: dict, ref: dict, rel: float = REL_TOL, what: str = "") -> None:
    assert list(got) == list(ref), (what, list(got), list(ref))
    for s in ref:
        assert abs(got[s] - ref[s]) <= rel * abs(ref[s]), (what, s, got[s], ref[s])


def launch(tmp_path: Path, jobs: list[dict], nproc: int = 2, max_restarts: int = 0, timeout: int = 150):
    spec = tmp_path / f"spec-{len(list(tmp_path.glob('spec-*')))}.json"
    spec.write_text(json.dumps({"jobs": jobs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", __file__, "--worker", str(spec)]
    env = cpu_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


def common(**over) -> dict:
    base = {"train.max_steps": STEPS, "log.every_steps": 1, "train.eval_batches": 0, "train.batch_size": 4}
    base.update(over)
    return base


def single(tmp_path: Path, name: str, **over) -> dict[int, float]:
    """The single-process reference: the same global batch in one process (micro-batch x 2)."""
    from tokenmill.train.trainer import train

    over = common(**over)
    over["train.batch_size"] *= 2
    train(tiny_cfg(**over), tmp_path / name, quiet=True)
    return losses(tmp_path / name)


LAYOUTS = {
    "ddp": {},
    "ddp_accum": {"train.grad_accum_steps": 2, "parallel.ddp_bucket_mb": 0.01,
                  "parallel.ddp_grad_as_bucket_view": True},
    "zero1": {"parallel.zero1": True},
    "fsdp_zero3": {"parallel.dp_shard": 2, "checkpoint.every_steps": 3, "checkpoint.keep_last": 5},
    "fsdp_zero2": {"parallel.dp_shard": 2, "parallel.fsdp_reshard_after_forward": False,
                   "train.grad_accum_steps": 2},
    "fsdp_bf16": {"parallel.dp_shard": 2, "parallel.fsdp_mixed_precision": "bf16"},
}


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict[int, float]:
    return single(tmp_path_factory.mktemp("ref"), "ref")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """One torchrun launch training every layout, then a resume of the FSDP run's step-3 DCP
    checkpoint under DDP (a different layout) in the same launch."""
    tmp = tmp_path_factory.mktemp("dist")
    jobs = [{"cfg": common(**over), "run_dir": str(tmp / name)} for name, over in LAYOUTS.items()]
    jobs.append({"cut": {"src": str(tmp / "fsdp_zero3"), "step": 3}, "run_dir": str(tmp / "fsdp_to_ddp"),
                 "cfg": common(), "resume": True})
    launch(tmp, jobs)
    return tmp


def test_layouts_match_single_process(two_rank_runs, ref, tmp_path):
    ref_accum = single(tmp_path, "ref_accum", **{"train.grad_accum_steps": 2})
    for name in ("ddp", "zero1", "fsdp_zero3"):
        assert_same_losses(losses(two_rank_runs / name), ref, what=name)
    for name in ("ddp_accum", "fsdp_zero2"):
        assert_same_losses(losses(two_rank_runs / name), ref_accum, what=name)
    # bf16 parameters for compute (fp32 reduction): close, not equal
    assert_same_losses(losses(two_rank_runs / "fsdp_bf16"), ref, rel=2e-2, what="fsdp_bf16")


def test_rank0_writes_global_metrics(two_rank_runs):
    run = two_rank_runs / "ddp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["layout"] == "ddp"
    assert summary["tokens_per_step"] == 4 * 2 * 32  # micro-batch x dp x block: global tokens
    assert (run / "config.toml").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one writer: no duplicated lines
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{STEPS:08d}.pt"]


def test_fsdp_dcp_checkpoint_resumes_in_other_layouts(two_rank_runs, ref, tmp_path):
    from tokenmill.parallel.checkpointing import list_all
    from tokenmill.train.trainer import train

    fsdp = two_rank_runs / "fsdp_zero3"
    assert [(s, p.name) for s, p in list_all(fsdp)] == [(3, "step_00000003.dcp"), (6, "step_00000006.dcp")]
    # 2-rank FSDP checkpoint -> 2-rank DDP (resumed inside the launch)
    assert_same_losses(losses(two_rank_runs / "fsdp_to_ddp"), ref, what="fsdp->ddp")
    # 2-rank FSDP checkpoint -> one process
    cut = tmp_path / "fsdp_to_single"
    _cut_run(fsdp, cut, 3)
    over = common()
    over["train.batch_size"] *= 2
    train(tiny_cfg(**over), cut, resume=True, quiet=True)
    assert_same_losses(losses(cut), ref, what="fsdp->single")


def test_elastic_restart_resumes_after_a_rank_dies(tmp_path):
    """Rank 1 exits hard after step 5 on the first attempt (test-only fault injection through the
    ``on_step_end`` callback); torchrun restarts both workers, which resume from the step-4
    checkpoint and finish with the full loss trajectory."""
    over = common(**{"train.max_steps": 8, "checkpoint.every_steps": 2})
    launch(tmp_path, [{"cfg": over, "run_dir": str(tmp_path / "run"), "kill_rank1_at_step": 5}], max_restarts=1)
    ref = single(tmp_path, "ref", **{"train.max_steps": 8})
    assert_same_losses(losses(tmp_path / "run"), ref, what="elastic")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["start_step"] == 4


def test_cpu_only_switches_are_refused():
    from tokenmill.parallel.data_parallel import apply_data_parallel
    from tokenmill.parallel.world import ParallelError, World

    cfg = tiny_cfg(**{"parallel.zero1": True}).parallel
    with pytest.raises(ParallelError, match="multi-process"):
        apply_data_parallel(None, World(), cfg)


def test_bad_degrees_are_reported():
    from tokenmill.config import ParallelConfig
    from tokenmill.parallel.world import ParallelError, resolve_degrees

    assert resolve_degrees(ParallelConfig(), 8) == (8, 1)
    assert resolve_degrees(ParallelConfig(dp_replicate=2, dp_shard=-1), 8) == (2, 4)
    with pytest.raises(ParallelError, match="multiply to the number of processes"):
        resolve_degrees(ParallelConfig(dp_replicate=2, dp_shard=2), 8)
    with pytest.raises(ParallelError, match="not divisible"):
        resolve_degrees(ParallelConfig(dp_replicate=3, dp_shard=-1), 8)


def _cut_run(src: Path, dst: Path, step: int) -> None:
    """A copy of run ``src`` as it was right after its step-``step`` checkpoint (later ones removed)."""
    shutil.copytree(src, dst)
    for p in (dst / "checkpoints").iterdir():
        if int(p.name[5:13]) > step:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


# ----------------------------------------------------------------------------------------------
# The worker (run by torchrun, not by pytest)


def _worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    from tokenmill.parallel.world import init_process_group
    from tokenmill.train.trainer import train

    init_process_group("gloo", torch.device("cpu"))
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    try:
        for job in json.loads(Path(spec_path).read_text())["jobs"]:
            if "cut" in job:
                if dist.get_rank() == 0:
                    _cut_run(Path(job["cut"]["src"]), Path(job["run_dir"]), job["cut"]["step"])
                dist.barrier()
            kill_at = job.get("kill_rank1_at_step")

            def fault(step, kill_at=kill_at):
                if step == kill_at and dist.get_rank() == 1 and not restarted:
                    os._exit(1)

            train(tiny_cfg(**job["cfg"]), job["run_dir"], resume=job.get("resume", False), on_step_end=fault,
                  quiet=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    import torch

    torch.set_num_threads(1)
    _worker(sys.argv[2])
