"""Expert parallelism (``parallel.ep``): the dispatch math in this process, then 2- and 4-process runs of
``tokenmill train`` (gloo, torchrun) against one process, started from Hugging Face folders and exported back.

Two tiny random folders are built here by ``transformers`` and saved with ``save_pretrained`` (no download):
``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` (2 layers, width 32, 4 experts, top-2, vocabulary 64; Mixtral
renormalises its top-2 weights, this Qwen3-MoE does not). Every run starts from one (``--train.init_from``):
the 2-process layouts and their one-process references from the Mixtral folder, the 4-process layouts and
theirs from the Qwen3-MoE folder. Every run trains on the same global batch of 4 sequences (2 per rank on 2
processes, 1 on 4), so its per-step losses, gradient norms and expert loads equal the one-process run's
within 1e-5 relative (fp32; only the order of sums differs). The load-balancing loss is off: it is a product
of per-rank statistics, so data parallelism changes it with or without experts split. A 2-process step-3
checkpoint resumes in one process, and a 4-process HSDP x EP 4 one under FSDP x EP 2 (another EP degree and
mesh), to the same losses. Last,
``tokenmill export`` writes the final checkpoints of an EP run and of its one-process reference back as
folders of the source's class: transformers loads them and gives the tokenmill runs' logits (1e-5), and the
EP run's equal the reference's within 1e-5 of the largest logit (fp32).
No torchrun launch of its own: its multi-process runs train in the shared 2- and 4-rank launches
(conftest.two_rank_launch and four_rank_launch; the workers are tests/test_parallel.py's).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from test_parallel import _cut_run

REL_TOL = 1e-5
STEPS = 6
GLOBAL_BATCH = 4
BASE = ["--preset", "tiny-moe", "--data.source", "synthetic", "--model.vocab_size", "64", "--train.device", "cpu",
        "--log.progress", "plain", "--log.tensorboard", "false", "--train.precision", "fp32",
        "--model.moe_aux_loss_coef", "0", "--model.moe_z_loss_coef", "0.001", "--train.max_steps", str(STEPS),
        "--log.every_steps", "1", "--train.eval_every_steps", "3",
        "--optim.grad_clip", "0.05"]
ONE = ["--parallel.dp_shard", "1", "--parallel.dp_replicate", "-1", "--parallel.ep", "1"]  # a resume's layout
ACCUM = ["--train.grad_accum_steps", "2"]  # its own reference (the same switch in one process)
CKPT = ["--checkpoint.every_steps", "3", "--checkpoint.keep_last", "5"]
# name -> (processes, options); the global batch is always GLOBAL_BATCH sequences
TWO = {
    "fsdp_ep2": ["--parallel.dp_shard", "2", "--parallel.dp_replicate", "1", "--parallel.ep", "2", *CKPT],
    "ddp_ep2_accum": ["--parallel.ep", "2", *ACCUM],
}
FOUR = {
    "fsdp_ep2": ["--parallel.dp_shard", "4", "--parallel.dp_replicate", "1", "--parallel.ep", "2",
                 "--memory.activation_checkpointing", "1"],  # the recomputed forward exchanges tokens again
    "hsdp_ep4": ["--parallel.dp_shard", "2", "--parallel.dp_replicate", "2", "--parallel.ep", "4", *CKPT],
}
START = {2: "mixtral", 4: "qwen3_moe"}  # the folder each launch (and its one-process references) starts from
# the folders (class, its settings): the runs take their shape from them, not from the preset's [model]
HF_BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=32, bos_token_id=None, eos_token_id=None, pad_token_id=None)
FOLDERS = {
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                                           sliding_window=None)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                              num_experts_per_tok=2, norm_topk_prob=False, head_dim=8)),
}
EXPORT_ATOL = 1e-5  # an exported folder's logits against its run's own (fp32, test_moe_hf's tolerance)


def args(nproc: int, *more: str) -> list[str]:
    """Every rank evaluates the same first GLOBAL_BATCH validation samples, in batches of its batch size."""
    return [*BASE, "--train.batch_size", str(GLOBAL_BATCH // nproc), "--train.eval_batches", str(nproc), *more]


def metric(run_dir: Path, key: str) -> dict[int, float]:
    from tokenmill.train.metrics import read_metrics

    return {r["step"]: r[key] for r in read_metrics(run_dir) if r.get(key) is not None}


def assert_same(got: dict, ref: dict, what: str) -> None:
    assert list(got) == list(ref), (what, list(got), list(ref))
    for s in ref:
        assert abs(got[s] - ref[s]) <= REL_TOL * abs(ref[s]), (what, s, got[s], ref[s])


# ----------------------------------------------------------------------------------------------
# The dispatch math, in this process


def test_regroup_orders_arrived_rows_by_expert_then_source():
    from tokenmill.parallel.expert_parallel import regroup

    recv = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 sources x 3 local experts
    arrived = [(i, e) for i in range(2) for e in range(3) for _ in range(int(recv[i, e]))]
    order, counts = regroup(recv, len(arrived))
    want = sorted(range(len(arrived)), key=lambda r: (arrived[r][1], arrived[r][0], r))
    assert order.tolist() == want and counts.tolist() == [3, 3, 1]


@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    dist.destroy_process_group()


def test_dispatched_experts_equal_the_local_ones(one_rank_mesh):
    """Through the all-to-alls of a one-rank group (split sizes, regrouping, the scaled backwards), a MoE's
    output and every gradient equal the undispatched layer's."""
    from tokenmill import config as C
    from tokenmill.model.moe import MoE
    from tokenmill.parallel.expert_parallel import shard_experts

    cfg = C.resolve("tiny-moe", overrides={"model.moe_impl": "loop"}, overrides_from_string=False).model
    torch.manual_seed(0)
    ref = MoE(cfg)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=0.2)
    moe = MoE(cfg)
    moe.load_state_dict(ref.state_dict())
    assert shard_experts(moe, one_rank_mesh) is moe.experts
    x = torch.randn(3, 5, cfg.n_embd)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(xa), moe(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    torch.testing.assert_close(yb, ya, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(ref.named_parameters(), moe.parameters()):
        torch.testing.assert_close(getattr(b.grad, "_local_tensor", b.grad), a.grad, rtol=1e-6, atol=1e-6, msg=name)


def test_shard_keeps_its_experts_and_counts_every_expert():
    from tokenmill import config as C
    from tokenmill.model.moe import MoE

    cfg = C.resolve("tiny-moe", overrides_from_string=False).model
    moe = MoE(cfg)
    full = moe.experts.gate_up.detach().clone()
    moe.experts.down.requires_grad_(False)
    seen = []  # the dispatch hook sees every expert's rows (it would send them on; here it returns them)
    moe.shard_experts(1, 2, lambda xs, counts, run: seen.append(counts.clone()) or xs)
    assert torch.equal(moe.experts.gate_up, full[2:4]) and not moe.experts.down.requires_grad
    moe(torch.randn(2, 3, cfg.n_embd))
    assert seen[0].numel() == 4 and int(seen[0].sum()) == 2 * 3 * cfg.moe_top_k  # every expert's rows, all slots


@pytest.mark.parametrize("more, message", [
    (["--preset", "tiny", "--parallel.ep", "2"], "parallel.ep=2 splits a mixture of experts over ranks, but this model has none"),
    (["--parallel.ep", "3"], "parallel.ep=3 must divide model.moe_experts (4)"),
    (["--parallel.ep", "4", "--parallel.dp_replicate", "1", "--parallel.dp_shard", "2"],
     "parallel.ep=4 must divide the data-parallel world size (parallel.dp_replicate x dp_shard = 2)"),
    (["--parallel.ep", "2", "--parallel.zero1", "true"], "does not combine with parallel.tp, parallel.pp or parallel.zero1"),
])
def test_bad_expert_parallel_degrees_are_refused_in_one_line(more, message, tmp_path):
    r = run_cli("train", *BASE, *more, "--run-dir", tmp_path / "run")
    assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_expert_parallel_in_one_process_is_refused_with_the_launch(tmp_path):
    """One process is a data-parallel world of one, which ep 2 does not divide (checked when the world is
    known, before anything trains)."""
    r = run_cli("train", *BASE, "--parallel.ep", "2", "--run-dir", tmp_path / "run")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "parallel.ep (2) must divide the data-parallel world size" in r.stderr and "torchrun" in r.stderr


# ----------------------------------------------------------------------------------------------
# 2 and 4 processes


def hf_folder(path: Path, name: str) -> Path:
    """A random ``transformers`` model of FOLDERS[name], every weight perturbed (the router's too, so tokens
    spread over the experts unevenly), saved to ``path``."""
    import transformers

    arch, kw = FOLDERS[name]
    torch.manual_seed(0)
    m = getattr(transformers, arch)(getattr(transformers, arch.replace("ForCausalLM", "Config"))(**HF_BASE, **kw))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    m.save_pretrained(path)
    return path


HAS_HF = importlib.util.find_spec("transformers") is not None


def two_rank_jobs(tmp: Path) -> list[dict]:
    """The 2-process layouts from the Mixtral folder (built here first, in ``tmp/mixtral``): run in the shared
    2-rank launch with other files' 2-rank jobs (conftest.two_rank_launch, TWO_RANK; the workers are
    tests/test_parallel.py's)."""
    if not HAS_HF:
        return []
    start = ["--train.init_from", str(hf_folder(tmp / START[2], START[2]))]
    return [{"argv": args(2, *start, *o), "run_dir": str(tmp / f"2_{n}")} for n, o in TWO.items()]


def four_rank_jobs(tmp: Path) -> list[dict]:
    """The 4-process layouts from the Qwen3-MoE folder (built in ``tmp/qwen3_moe``), then the HSDP x EP 4
    run's step-3 checkpoint resumed under FSDP x EP 2 (another EP degree and mesh): run in the shared 4-rank
    launch (conftest.four_rank_launch, FOUR_RANK)."""
    if not HAS_HF:
        return []
    start = ["--train.init_from", str(hf_folder(tmp / START[4], START[4]))]
    jobs = [{"argv": args(4, *start, *o), "run_dir": str(tmp / f"4_{n}")} for n, o in FOUR.items()]
    jobs.append({"cut": {"src": str(tmp / "4_hsdp_ep4"), "step": 3, "trim_metrics": True},
                 "run_dir": str(tmp / "4_resume_ep2"), "argv": args(
                     4, "--parallel.dp_shard", "4", "--parallel.dp_replicate", "1", "--parallel.ep", "2", "--resume")})
    return jobs


@pytest.fixture(scope="module")
def runs(two_rank_launch, four_rank_launch, tmp_path_factory) -> dict[str, Path]:
    """Run name -> its folder: the two source folders and the multi-process runs (trained in the shared
    launches, see two_rank_jobs and four_rank_jobs), and the one-process references from the same folders,
    trained here."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'tokenmill[hf]')")
    from tokenmill.cli import main

    found = {}
    for launched in (two_rank_launch, four_rank_launch):
        found.update({p.name: p for p in (launched / "ep").iterdir() if p.is_dir()})
    tmp = tmp_path_factory.mktemp("ep")
    start = {n: ["--train.init_from", str(found[name])] for n, name in START.items()}
    for nproc, name in START.items():
        assert main(["train", *args(1, *start[nproc]), "--run-dir", str(tmp / f"ref_{name}")]) == 0
    assert main(["train", *args(1, *start[2], *ACCUM), "--run-dir", str(tmp / "ref_accum")]) == 0
    return {**found, **{p.name: p for p in tmp.iterdir()}}


def reference(name: str) -> str:
    """The one-process run a multi-process run ``name`` equals."""
    return "ref_accum" if "accum" in name else f"ref_{START[4 if name.startswith('4_') else 2]}"


@pytest.mark.slow
def test_expert_parallel_layouts_match_one_process(runs):
    from tokenmill import config as C

    names = [f"2_{n}" for n in TWO] + [f"4_{n}" for n in FOUR] + ["4_resume_ep2"]
    for name in names:
        ref = runs[reference(name)]
        # with accumulation the logged load is the last micro-batch's, a different slice of the batch per layout
        keys = ("loss", "grad_norm", "val_loss") + (() if "accum" in name else ("moe_load_max", "moe_load_1"))
        for key in keys:
            assert_same(metric(runs[name], key), metric(ref, key), f"{name} {key}")
        model = C.load_toml(runs[name] / "config.toml")["model"]  # the source's shape, not the preset's
        assert model == C.load_toml(ref / "config.toml")["model"], name
        assert (model["moe_router"], model["qk_norm"]) == (
            ("softmax-topk", True) if ref.name == "ref_qwen3_moe" else ("softmax-topk-renorm", False)), name
    summary = json.loads((runs["2_fsdp_ep2"] / "summary.json").read_text())
    assert summary["layout"] == "fsdp+ep"
    assert summary["params"] == json.loads((runs["ref_mixtral"] / "summary.json").read_text())["params"]


@pytest.mark.slow
def test_expert_parallel_checkpoint_is_whole_and_resumes_in_one_process(runs, tmp_path):
    """The 2-process EP checkpoints hold every expert under its usual name: read whole in one process they
    equal the one-process run's weights; one process resumes the step-3 one to the same later losses."""
    from tokenmill.checkpoint import load_model
    from tokenmill.cli import main

    got, _, path = load_model(runs["2_fsdp_ep2"])
    want, _, _ = load_model(runs["ref_mixtral"])
    assert path.suffix == ".dcp"
    got_sd, want_sd = got.state_dict(), want.state_dict()
    assert got_sd.keys() == want_sd.keys()
    for k in want_sd:
        assert torch.allclose(got_sd[k], want_sd[k], rtol=1e-4, atol=2e-5), k
    cut = tmp_path / "cut"
    _cut_run(runs["2_fsdp_ep2"], cut, 3, trim_metrics=True)
    assert main(["train", *args(1, *ONE), "--run-dir", str(cut), "--resume"]) == 0
    assert_same(metric(cut, "loss"), metric(runs["ref_mixtral"], "loss"), "ep2 -> one process")


def logits(m, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = m(x)
    return out.logits if hasattr(out, "logits") else out[0]


@pytest.mark.slow
@pytest.mark.parametrize("run, name", [("2_fsdp_ep2", "mixtral"), ("4_hsdp_ep4", "qwen3_moe")])
def test_expert_parallel_run_exports_to_its_source_class(runs, tmp_path, run, name):
    """``tokenmill export`` of the EP run's final checkpoint and of the one-process run's: transformers loads
    both as the source folder's class, each gives its tokenmill run's logits, and the two give the same
    logits, which training moved away from the source's."""
    import transformers

    from tokenmill.checkpoint import load_model

    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    got = {}
    for which in (run, f"ref_{name}"):
        r = run_cli("export", "--run-dir", runs[which], "--out", tmp_path / which)
        assert r.returncode == 0, r.stderr
        out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / which).eval()
        assert type(out).__name__ == FOLDERS[name][0]
        model = load_model(runs[which])[0].eval()
        got[which] = logits(out, x)
        torch.testing.assert_close(got[which], logits(model, x), atol=EXPORT_ATOL, rtol=0, msg=which)
    ref = got[f"ref_{name}"]  # EP's logits within REL_TOL of the largest one (~1; measured ~1e-6 apart)
    torch.testing.assert_close(got[run], ref, atol=REL_TOL * float(ref.abs().max()), rtol=0)
    src = transformers.AutoModelForCausalLM.from_pretrained(runs[name]).eval()
    assert (logits(src, x) - got[run]).abs().max() > 1e-2  # the 6 steps moved them (~0.3)
