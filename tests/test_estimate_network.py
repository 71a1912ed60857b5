"""Collectives across nodes (``roofline.group_bandwidth``, ``estimate --gpus-per-node / --network-gbps``): a group of
ranks that spans nodes moves its bytes at the network's line rate per GPU (NCCL's model of a NIC), not NVLink's;
the reference nodes of the GPU table (DGX A100: 8 GPUs, 200 Gb/s each; DGX H100/H200: 400 Gb/s)."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from tokenmill.estimate.bandwidth import group_bandwidth, link_bandwidth
from tokenmill.estimate.gpus import gpu_spec


def test_a_group_over_more_gpus_than_a_node_takes_the_network():
    h100, a100, l4 = gpu_spec("h100-sxm"), gpu_spec("a100-80gb"), gpu_spec("l4")
    assert (h100.node_gpus, h100.nic_gbps, a100.nic_gbps, gpu_spec("h200").nic_gbps) == (8, 400, 200, 400)
    assert group_bandwidth(h100, 8, 1) == link_bandwidth(h100)  # one node: NVLink
    assert group_bandwidth(h100, 16, 1) == 50e9  # 400 Gb/s a GPU
    assert group_bandwidth(a100, 2, 8) == 25e9  # two replicas of an 8-GPU FSDP group: one per node
    assert group_bandwidth(a100, 4, 2) == link_bandwidth(a100)  # 4 x 2 ranks: still one node
    assert group_bandwidth(l4, 64, 1) == link_bandwidth(l4)  # no reference node: its link


def _collectives_ms(*extra) -> float:
    r = run_cli("estimate", "--preset", "gpt2-124m", "--data.source", "synthetic", "--train.batch_size", "1",
                "--model.block_size", "256", "--gpu", "a100-80gb", "--nproc", "16", "--parallel.dp_shard", "16",
                "--parallel.dp_replicate", "1",
                "--json", *extra)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["time_breakdown_ms"]["collectives_ms"]


def test_the_cli_prices_fsdp_over_two_nodes_at_the_network_rate():
    two_nodes, one_node = _collectives_ms(), _collectives_ms("--gpus-per-node", "16")
    # every collective is FSDP's over the 16 ranks: NVLink's 240 GB/s in one node, 200 Gb/s a GPU over two
    assert two_nodes / one_node == pytest.approx(link_bandwidth(gpu_spec("a100-80gb")) / 25e9)
    assert _collectives_ms("--network-gbps", "800") == pytest.approx(two_nodes / 4)


def test_a_node_the_gpu_table_lacks_must_be_described():
    r = run_cli("estimate", "--preset", "gpt2-124m", "--data.source", "synthetic", "--gpu", "l4", "--nproc", "2",
                "--network-gbps", "100")
    assert r.returncode != 0 and "give both --gpus-per-node and --network-gbps" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("flag, value, says", [("--gpus-per-node", "0", "must be >= 1"),
                                               ("--network-gbps", "nan", "expected a finite number"),
                                               ("--network-gbps", "-5", "must be > 0")])
def test_hostile_node_values_are_one_line_errors(flag, value, says):
    r = run_cli("estimate", "--preset", "gpt2-124m", "--data.source", "synthetic", flag, value)
    assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


def test_nccl_channels_follow_nccls_search_rule():
    """estimate/bandwidth.py nccl_channels against what NCCL logs: 24 channels on an HGX A100 (nccl-tests issue
    #100), 16 on an H800's 8 NVLinks (NVIDIA/nccl issue #892); the H100 SXM by the same rule, 24; a PCIe part few."""
    import dataclasses

    from tokenmill.estimate.bandwidth import nccl_channels

    h100 = gpu_spec("h100-sxm")
    assert nccl_channels(gpu_spec("a100-80gb")) == 24 and nccl_channels(h100) == 24
    assert nccl_channels(dataclasses.replace(h100, link_gbs=8 * 25)) == 16  # the H800: 8 NVLink-4 links
    assert nccl_channels(gpu_spec("rtx-4090")) == 4 and nccl_channels(gpu_spec("cpu")) == 0


def test_overlapped_collectives_take_nccls_sms_within_a_node_only():
    """The compute loses channels / SMs of the GPU over the collectives it overlaps (collectives.contention_seconds):
    24 / 108 of the overlapped milliseconds on A100s in one node; across nodes nothing is counted."""
    def timing(nproc: int) -> dict:
        r = run_cli("estimate", "--preset", "gpt2-124m", "--data.source", "synthetic", "--train.batch_size", "1",
                    "--model.block_size", "256", "--gpu", "a100-80gb", "--nproc", str(nproc), "--parallel.dp_shard",
                    str(nproc), "--parallel.dp_replicate", "1", "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["time_breakdown_ms"]

    one, two = timing(8), timing(16)
    overlapped = one["collectives_ms"] - one["collectives_exposed_ms"]
    assert overlapped > 0 and one["collectives_sm_share_ms"] == pytest.approx(overlapped * 24 / 108, rel=1e-6)
    assert two["collectives_sm_share_ms"] == 0.0
