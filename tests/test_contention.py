"""CPU oversubscription: a run that asks for more threads than the free cores is told so at start, with
the setting to use."""

import pytest

from conftest import tiny_cfg
from tokenmill.train import device as D


@pytest.mark.parametrize("threads, procs, cores, load, note", [
    (2, 1, 2, 0.1, False),  # an idle 2-core machine: 2 threads fit
    (2, 1, 2, 2.0, True),  # another CPU-heavy job on both cores
    (8, 1, 8, 7.5, True),
    (1, 1, 2, 2.0, False),  # one thread always gets a core
    (4, 2, 8, 0.0, False),  # 2 processes x 4 threads on 8 idle cores
    (4, 4, 8, 0.0, True),  # 16 threads on 8 cores
])
def test_contention_note(threads, procs, cores, load, note):
    got = D.cpu_contention({"intra_op": threads, "inter_op": 1, "cpu_count": cores, "local_world_size": procs}, load)
    assert (got is not None) == note, got
    if note:
        assert f"{threads * procs} CPU threads" in got and "OMP_NUM_THREADS=" in got
        fit = int(got.split("OMP_NUM_THREADS=")[1].split()[0])
        assert 1 <= fit * procs <= max(1, cores - load) or fit == 1


@pytest.mark.slow
def test_a_busy_machine_is_named_at_the_start_of_a_cpu_run(tmp_path, monkeypatch, capsys):
    from tokenmill.train.trainer import train

    monkeypatch.delenv(D.NOTED_ENV, raising=False)  # said once per process tree: not yet in this test
    monkeypatch.setattr(D.os, "getloadavg", lambda: (64.0, 64.0, 64.0))  # as if 64 busy processes ran
    monkeypatch.setattr(D.torch, "get_num_threads", lambda: 4)
    train(tiny_cfg(**{"train.max_steps": 1, "train.eval_batches": 0}), tmp_path)
    out = capsys.readouterr().out
    assert "load average of 64.0" in out and "OMP_NUM_THREADS=1" in out, out
