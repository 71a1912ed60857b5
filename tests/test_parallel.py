"""Multi-process training on CPU (gloo, 2 and 4 processes launched by torchrun).

Every layout must train on the same global batches as one process: per-step losses equal the
single-process run with ``batch_size x dp`` within 1e-5 relative (fp32, dropout 0; only the order of
floating-point sums differs). Several layouts run one after the other inside one torchrun launch (this
file is also the worker script: ``python -m torch.distributed.run ... test_parallel.py --worker SPEC``)
to keep the import/launch cost down: every 2-rank layout in one launch, every 4-rank layout in another.
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


def preset_cfg(preset: str = "tiny", **over):
    """``conftest.tiny_cfg``'s test settings (synthetic tokens, vocab 64, CPU) on another test preset
    (``tiny-llama``: the Llama-family model, see tests/test_parallel_families.py)."""
    if preset == "tiny":
        return tiny_cfg(**over)
    from tokenmill import config as C

    base = {"data.source": "synthetic", "model.vocab_size": 64, "train.device": "cpu", "log.progress": "plain",
            "log.tensorboard": False}
    return C.resolve(preset, overrides={**base, **over}, overrides_from_string=False)


def single(tmp_path: Path, name: str, dp: int = 2, preset: str = "tiny", **over) -> dict[int, float]:
    """The single-process reference: the same global batch in one process (micro-batch x dp)."""
    from tokenmill.train.trainer import train

    over = common(**over)
    over["train.batch_size"] *= dp
    train(preset_cfg(preset, **over), tmp_path / name, quiet=True)
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
    # the book's FSDP accumulation: reduce-scatter after every micro-batch (parallel.sync_every_microbatch)
    "fsdp_sync_each": {"parallel.dp_shard": 2, "train.grad_accum_steps": 2, "parallel.sync_every_microbatch": True},
}


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict[int, float]:
    return single(tmp_path_factory.mktemp("ref"), "ref")


def two_rank_jobs(tmp: Path) -> list[dict]:
    """Every data-parallel layout, then a resume of the FSDP run's step-3 DCP checkpoint under DDP (a
    different layout), then the 2-rank tensor and pipeline layouts (MP_2, read through ``mp2_runs``), and the
    DDP run whose rank 1 dies (ELASTIC): run in one 2-rank launch with other files' 2-rank jobs
    (conftest.two_rank_launch, TWO_RANK; the dying run last, the launch restarted once for it)."""
    jobs = [{"cfg": common(**over), "run_dir": str(tmp / name)} for name, over in LAYOUTS.items()]
    jobs.append({"cut": {"src": str(tmp / "fsdp_zero3"), "step": 3}, "run_dir": str(tmp / "fsdp_to_ddp"),
                 "cfg": common(), "resume": True})
    assert not set(MP_2) & {*LAYOUTS, "fsdp_to_ddp", "elastic"}  # one folder per run
    jobs += [{"cfg": common(**over), "run_dir": str(tmp / name)} for name, (over, _, _) in MP_2.items()]
    return jobs + [{"cfg": common(**ELASTIC), "run_dir": str(tmp / "elastic"), "kill_rank1_at_step": 5}]


def four_rank_jobs(tmp: Path) -> list[dict]:
    """The 4-rank layouts (MP_4), run in one 4-rank launch with tests/test_parallel_families.py's
    (conftest.four_rank_launch)."""
    return [{"cfg": common(**over), "run_dir": str(tmp / name)} for name, (over, _, _) in MP_4.items()]


@pytest.fixture(scope="module")
def two_rank_runs(two_rank_launch):
    return two_rank_launch / "gpt2"


@pytest.mark.slow
def test_layouts_match_single_process(two_rank_runs, ref, tmp_path):
    ref_accum = single(tmp_path, "ref_accum", **{"train.grad_accum_steps": 2})
    for name in ("ddp", "zero1", "fsdp_zero3"):
        assert_same_losses(losses(two_rank_runs / name), ref, what=name)
    for name in ("ddp_accum", "fsdp_zero2", "fsdp_sync_each"):
        assert_same_losses(losses(two_rank_runs / name), ref_accum, what=name)
    # bf16 parameters for compute (fp32 reduction): close, not equal
    assert_same_losses(losses(two_rank_runs / "fsdp_bf16"), ref, rel=2e-2, what="fsdp_bf16")


@pytest.mark.slow
def test_one_process_fsdp_under_torchrun(tmp_path, ref, monkeypatch):
    """``--parallel.dp_shard -1`` under a one-process torchrun shards over a 1-rank mesh (the FSDP path on
    one GPU): layout 'fsdp', DCP checkpoints, and the single-process losses (the same global batch 8).
    Trained in this process, in the environment torchrun gives its one worker (the trainer joins and leaves
    the 1-rank gloo group itself); a torchrun launch would only add its processes' imports."""
    import socket

    from tokenmill.checkpoint import list_checkpoints
    from tokenmill.train.trainer import train

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for k, v in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "LOCAL_WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": port}.items():
        monkeypatch.setenv(k, str(v))
    over = common(**{"train.batch_size": 8, "checkpoint.every_steps": 3})
    train(tiny_cfg(**over, **{"parallel.dp_shard": -1, "parallel.dp_replicate": 1}), tmp_path / "fsdp1", quiet=True)
    import torch.distributed as dist

    assert not dist.is_initialized()  # the trainer left the group it joined
    summary = json.loads((tmp_path / "fsdp1" / "summary.json").read_text())
    assert (summary["layout"], summary["world_size"]) == ("fsdp", 1)
    assert [p.name for _, p in list_checkpoints(tmp_path / "fsdp1")][-1] == f"step_{STEPS:08d}.dcp"
    assert_same_losses(losses(tmp_path / "fsdp1"), ref, what="fsdp on one rank")


@pytest.mark.slow
def test_rank0_writes_global_metrics(two_rank_runs):
    run = two_rank_runs / "ddp"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["layout"] == "ddp"
    assert summary["tokens_per_step"] == 4 * 2 * 32  # micro-batch x dp x block: global tokens
    assert (run / "config.toml").exists()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one writer: no duplicated lines
    assert [p.name for p in (run / "checkpoints").iterdir()] == [f"step_{STEPS:08d}.pt"]


@pytest.mark.slow
def test_fsdp_dcp_checkpoint_resumes_in_other_layouts(two_rank_runs, ref, tmp_path):
    from tokenmill.checkpoint import list_checkpoints as list_all
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


# Tensor and pipeline parallel layouts: name -> (overrides of the distributed run, overrides of its
# single-process reference, data-parallel degree). TP needs separate q/k/v matrices and PP an untied
# head (the references use the same model); clipping at 0.1 is active in every step, so the global
# gradient norm across shards and stages is checked too.
SEPARATE_QKV = {"model.fused_qkv": False}
UNTIED = {"model.tie_embeddings": False}
CLIP = {"optim.grad_clip": 0.1}
EVAL = {"train.eval_batches": 2, "train.eval_every_steps": 3}
# Activation checkpointing (bit-identical) and the chunked loss ride along, against plain references.
AC = {"memory.activation_checkpointing": 1}
MP_2 = {
    "tp": ({"parallel.tp": 2, "checkpoint.every_steps": 3, **SEPARATE_QKV, **CLIP, **AC}, {**SEPARATE_QKV, **CLIP}, 1),
    "pp_gpipe": ({"parallel.pp": 2, "parallel.pp_schedule": "gpipe", "checkpoint.every_steps": 3,
                  "model.loss_impl": "chunked", "model.loss_chunk_size": 48, **UNTIED, **CLIP, **EVAL},
                 {**UNTIED, **CLIP, **EVAL}, 1),
    "pp_1f1b_accum": ({"parallel.pp": 2, "parallel.pp_microbatches": 4, "train.grad_accum_steps": 2, **UNTIED,
                       **AC}, {"train.grad_accum_steps": 2, **UNTIED}, 1),
}
MP_4 = {
    "fsdp_tp": ({"parallel.dp_shard": 2, "parallel.tp": 2, **SEPARATE_QKV, **CLIP}, {**SEPARATE_QKV, **CLIP}, 2),
    "pp_fsdp": ({"parallel.pp": 2, "parallel.dp_shard": 2, **UNTIED, **CLIP}, {**UNTIED, **CLIP}, 2),
    "pp_tp": ({"parallel.pp": 2, "parallel.tp": 2, **SEPARATE_QKV, **UNTIED}, {**SEPARATE_QKV, **UNTIED}, 1),
}


def metric(run_dir, key: str) -> dict[int, float]:
    from tokenmill.train.metrics import read_metrics

    return {r["step"]: r[key] for r in read_metrics(run_dir) if r.get(key) is not None}


@pytest.fixture(scope="module")
def mp2_runs(two_rank_runs):
    """The MP_2 runs, trained in the launch of ``two_rank_runs``."""
    return two_rank_runs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MP_2))
def test_tensor_and_pipeline_parallel_match_single_process(mp2_runs, name, tmp_path):
    _, ref_over, dp = MP_2[name]
    ref = single(tmp_path, "ref", dp=dp, **ref_over)
    run = mp2_runs / name
    assert_same_losses(losses(run), ref, what=name)
    assert_same_losses(metric(run, "grad_norm"), metric(tmp_path / "ref", "grad_norm"), what=f"{name} grad_norm")
    assert_same_losses(metric(run, "val_loss"), metric(tmp_path / "ref", "val_loss"), what=f"{name} val_loss")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["layout"] == name.split("_")[0] and summary["params"] == json.loads(
        (tmp_path / "ref" / "summary.json").read_text())["params"]
    # the final sharded checkpoint, read whole in one process, holds the single-process run's weights
    import torch

    from tokenmill.checkpoint import load_model as load_checkpoint_model

    got, _, path = load_checkpoint_model(run)
    want, _, _ = load_checkpoint_model(tmp_path / "ref")
    assert path.suffix == ".dcp"
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert got_sd.keys() == want_sd.keys()
    for k in want_sd:
        # Adam turns summation-order rounding (the chunked loss) into weight differences up to ~1e-5;
        # a weight that was not trained, or not loaded, is off by about lr = 1e-3
        assert torch.allclose(got_sd[k], want_sd[k], rtol=1e-4, atol=2e-5), (name, k)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp", "pp_gpipe"])
def test_model_parallel_checkpoint_resumes_in_one_process(mp2_runs, name, tmp_path):
    """The step-3 DCP checkpoint of a 2-rank TP or PP run holds the whole model under its usual
    names: one process resumes it and trains on to the same losses."""
    from tokenmill.train.trainer import train

    _, ref_over, dp = MP_2[name]
    cut = tmp_path / "cut"
    _cut_run(mp2_runs / name, cut, 3)
    over = common(**ref_over)
    train(tiny_cfg(**over), cut, resume=True, quiet=True)
    assert_same_losses(losses(cut), losses(mp2_runs / name), what=f"{name}->single")


@pytest.mark.slow
def test_four_rank_combinations_match_single_process(four_rank_launch, tmp_path):
    """FSDP x TP, PP x FSDP and PP x TP on 4 processes (2 x 2 meshes): losses and gradient norms.

    Under FSDP x TP the column-wise TP weights carry a ``_StridedShard`` placement from FSDP; a norm
    that counted it as replicated would be off by a few 1e-3 relative (and clip wrongly)."""
    runs = four_rank_launch / "gpt2"
    for name, (_, ref_over, dp) in MP_4.items():
        ref = single(tmp_path, name, dp=dp, **ref_over)
        assert_same_losses(losses(runs / name), ref, what=name)
        assert_same_losses(metric(runs / name, "grad_norm"), metric(tmp_path / name, "grad_norm"),
                           what=f"{name} grad_norm")
        assert json.loads((runs / name / "summary.json").read_text())["layout"] == name.replace("_", "+")


ELASTIC = {"checkpoint.every_steps": 2}


@pytest.mark.slow
def test_elastic_restart_resumes_after_a_rank_dies(two_rank_runs, ref):
    """Rank 1 exits hard after step 5 on the first attempt (test-only fault injection through the
    ``on_step_end`` callback); torchrun (``--max-restarts=1``) restarts both workers, which resume from the
    step-4 checkpoint and finish with the full loss trajectory (the uninterrupted run's, ``ref``). The last
    job of the shared 2-rank launch (two_rank_jobs): the restart costs no launch of its own."""
    run = two_rank_runs / "elastic"
    assert_same_losses(losses(run), ref, what="elastic")
    assert json.loads((run / "summary.json").read_text())["start_step"] == 4


@pytest.mark.slow
def test_two_nodes_rendezvous_with_c10d(tmp_path, ref):
    """The multi-node command line of docs/parallel.md: two torchrun agents ("nodes", one worker
    each) meet through the c10d rendezvous at one endpoint and train as one 2-rank DDP job."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"jobs": [{"cfg": common(), "run_dir": str(tmp_path / "run")}]}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "tokenmill-test",
           __file__, "--worker", str(spec)]
    env = cpu_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    nodes = [subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    outs = [n.communicate(timeout=150)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2
    assert_same_losses(losses(tmp_path / "run"), ref, what="c10d")


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
    # one process (no torchrun): the message says how to launch the processes
    with pytest.raises(ParallelError, match="torchrun --nproc-per-node 4 -m tokenmill train"):
        resolve_degrees(ParallelConfig(dp_shard=2, tp=2), 1)
    with pytest.raises(ParallelError, match="torchrun --nproc-per-node 2 -m tokenmill train"):
        resolve_degrees(ParallelConfig(dp_replicate=1, tp=2), 1)


def test_strided_shard_counts_as_a_shard_in_the_grad_norm():
    """FSDP2 puts ``_StridedShard`` on the FSDP dimension of column-wise TP weights; its ``is_shard()``
    is False in newer torch, yet each rank holds a different part."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    from tokenmill.optim.grad_norm import _is_shard

    assert _is_shard(Shard(0)) and not _is_shard(Replicate()) and not _is_shard(Partial())
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        pytest.skip("this torch has no _StridedShard")
    assert _is_shard(_StridedShard(0, split_factor=2))


def _cut_run(src: Path, dst: Path, step: int, trim_metrics: bool = False) -> None:
    """A copy of run ``src`` as it was right after its step-``step`` checkpoint (later ones removed; with
    ``trim_metrics`` the later metrics too, so the resumed run logs them afresh)."""
    shutil.copytree(src, dst)
    if trim_metrics:
        lines = (dst / "metrics.jsonl").read_text().splitlines()
        (dst / "metrics.jsonl").write_text("".join(ln + "\n" for ln in lines if json.loads(ln).get("step", 0) <= step))
    for p in (dst / "checkpoints").iterdir():
        if int(p.name[5:13]) > step:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


# ----------------------------------------------------------------------------------------------
# The worker (run by torchrun, not by pytest)


def _jobs_to_run(jobs: list[dict], restarted: bool) -> list[dict]:
    """All ``jobs``; in workers torchrun restarted, those from the first one without a summary.json on, which
    must be the job whose rank 1 exits on purpose (``kill_rank1_at_step``, the last of its launch: see
    conftest._shared_launch). Any other job that failed fails the launch, as without restarts."""
    if not restarted:
        return jobs
    todo = [job for job in jobs if not (Path(job["run_dir"]) / "summary.json").exists()]
    if not todo or "kill_rank1_at_step" not in todo[0] or todo != jobs[len(jobs) - len(todo):]:
        raise SystemExit(f"restarted with unexpected jobs left: {[job['run_dir'] for job in todo]}")
    return todo


def _worker(spec_path: str) -> None:
    import torch
    import torch.distributed as dist

    from tokenmill.parallel.world import init_process_group
    from tokenmill.train.trainer import Callbacks, train

    init_process_group("gloo", torch.device("cpu"))
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    try:
        for job in _jobs_to_run(json.loads(Path(spec_path).read_text())["jobs"], restarted):
            if "cut" in job:
                if dist.get_rank() == 0:
                    cut = job["cut"]
                    _cut_run(Path(cut["src"]), Path(job["run_dir"]), cut["step"], cut.get("trim_metrics", False))
                dist.barrier()
            if "argv" in job:  # a command line: ``tokenmill train ARGV --run-dir RUN_DIR``
                from tokenmill.cli import main

                if code := main(["train", *job["argv"], "--run-dir", job["run_dir"]]):
                    raise SystemExit(f"{job['run_dir']}: exit {code}")
                continue
            kill_at = job.get("kill_rank1_at_step")

            def fault(step, kill_at=kill_at):
                if step == kill_at and dist.get_rank() == 1 and not restarted:
                    os._exit(1)

            cfg = preset_cfg(job.get("preset", "tiny"), **job["cfg"])
            train(cfg, job["run_dir"], resume=job.get("resume", False), callbacks=Callbacks(on_step_end=fault),
                  quiet=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    import torch

    torch.set_num_threads(1)
    _worker(sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # every run's files are written and closed: skip the interpreter's teardown (~1 s of CPU a rank)


@pytest.mark.parametrize("preset, tied", [("tiny-llama", False), (None, True)])
def test_fsdp_shards_untied_embeddings_and_head_as_units_of_their_own(preset, tied):
    """apply_fsdp (the trainer's) over torch's fake process group, rank 0 of 4: an untied embedding is a unit freed
    after its forward, the final norm with the head one kept for its backward, the root holding nothing; tied,
    they stay with the root (one parameter, one unit). The estimator reads the same rule (edge_units_apart)."""
    import sys

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tokenmill import config as C
    from tokenmill.model.build import build_gpt
    from tokenmill.model.gpt import edge_units_apart
    from tokenmill.parallel.data_parallel import apply_fsdp
    from tokenmill.parallel.world import World

    cfg = C.resolve(preset, overrides={"parallel.dp_shard": 4, "model.vocab_size": 64}, overrides_from_string=False)
    assert cfg.model.tie_embeddings == tied and edge_units_apart(cfg.model) == (not tied)
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 4, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
        model = build_gpt(cfg.model, 64, "cpu")
        apply_fsdp(model, World(0, 0, 4, 1, 4, torch.device("cpu"), mesh, False, fsdp=True), cfg.parallel)

        def group(module):
            g = module._get_fsdp_state()._fsdp_param_group
            return None if g is None else ({p._module_info.param_name for p in g.fsdp_params},
                                           g.post_forward_mesh_info is not None)

        root = group(model)
        if tied:
            assert root is not None and "weight" in root[0] and root[1] is False  # wte (= lm_head), ln_f: the root
            assert not hasattr(model.wte, "_get_fsdp_state")
        else:
            assert root is None  # nothing left to the root
            assert group(model.wte) == ({"weight"}, True)  # freed after its forward
            assert group(model.lm_head) == ({"weight"}, False)  # ln_f and lm_head: kept for their backward
            names = {n for n, _ in model.named_parameters() if not n.startswith("blocks.")}
            assert names == {"wte.weight", "ln_f.weight", "lm_head.weight"}
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook
