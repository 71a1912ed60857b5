"""The ``optimizers`` ladder (AdamW and Muon at equal tokens): every rung resolves, the rungs differ only
in the optimizer settings, and a --smoke run through the real CLI on a CPU trains every rung to a finite
loss on the same number of samples."""

from __future__ import annotations

import json
import math

import pytest

from conftest import run_cli
from tokenmill import config as C
from tokenmill.bench.configs import rung_config
from tokenmill.bench.load import load_ladder


def test_rungs_change_only_the_optimizer():
    ladder = load_ladder("optimizers")
    assert [r.name for r in ladder.rungs] == ["adamw", "adamw-lr-2e-3", "muon", "muon-lr-0.04"]
    cfgs = [rung_config(ladder, i).config for i in range(len(ladder.rungs))]
    assert [(c.optim.name, c.optim.lr, c.optim.muon_lr if c.optim.name == "muon" else None) for c in cfgs] == [
        ("adamw", 1e-3, None), ("adamw", 2e-3, None), ("muon", 1e-3, 0.02), ("muon", 1e-3, 0.04)]
    steps = {c.train.max_steps for c in cfgs}
    assert steps == {65536 // 64}  # equal tokens: every rung covers the same samples
    for c in cfgs:
        assert C.validate(c) is c
    rest = [{k: v for k, v in c.to_dict().items() if k != "optim"} for c in cfgs]
    assert all(r == rest[0] for r in rest)


@pytest.mark.slow
def test_smoke_run_trains_adamw_and_muon_and_lists_every_rung(tmp_path, monkeypatch):
    out = tmp_path / "out"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the rungs' processes inherit it (as from conftest.cpu_env)
    # the ladder in this process (its rungs still run in their own processes): one interpreter start less
    p = run_cli("bench", "ladder", "optimizers", "--smoke", "--quiet", "--out", out, "--rungs", "adamw,muon")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((out / "ladder.json").read_text())
    rungs = {r["name"]: r for r in doc["rungs"]}
    assert list(rungs) == ["adamw", "adamw-lr-2e-3", "muon", "muon-lr-0.04"]
    for name, r in rungs.items():
        if name not in ("adamw", "muon"):  # the lr variants: listed, not run (--rungs), their configs resolved
            assert r["status"] == "skipped" and r["reason"].startswith("not selected (--rungs)"), name
            continue
        assert r["status"] == "measured", (name, r.get("reason"))
        assert math.isfinite(r["metrics"]["final_loss"]) and r["metrics"]["final_loss"] < math.log(256)
    assert rungs["muon"]["config"]["optim"]["name"] == "muon"
    assert len({r["config"]["train"]["max_steps"] for r in rungs.values()}) == 1
