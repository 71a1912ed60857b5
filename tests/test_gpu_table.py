"""The one GPU table (``model/gpus.py``) as the doctor's fp32-math rule reads it: the GPUs the rule's own name
list used to match still have tensor cores there, and a run on one with no capability recorded still gets the
finding; the others still do not."""

from __future__ import annotations

import pytest

from test_doctor import cuda_facts
from tokenmill.model.flops import peak_flops
from tokenmill.model.gpus import GPU_TABLE, gpu_facts
from tokenmill.profiling.doctor import rank
from tokenmill.profiling.model_rules import has_tensor_cores

# The rule's former list, matched as substrings of the upper-cased name: the reference the table must agree with.
OLD_LIST = ("A100", "A10", "A30", "A40", "A6000", "L4", "L40", "H100", "H200", "GH200", "B200", "RTX 30",
            "RTX 40", "RTX 50", "3090", "4090", "5090")
NAMES = ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA A10", "NVIDIA A10G", "NVIDIA A30", "NVIDIA A40",
         "NVIDIA RTX A6000", "NVIDIA RTX A4000", "NVIDIA RTX A1000", "NVIDIA L4", "NVIDIA L40", "NVIDIA L40S",
         "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA GH200 480GB",
         "NVIDIA B200", "NVIDIA GB200", "NVIDIA GeForce RTX 3060 Laptop GPU", "NVIDIA GeForce RTX 3090 Ti",
         "NVIDIA GeForce RTX 4070", "NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 5090", "Quadro RTX 4000",
         "NVIDIA A100-SXM4-40GB MIG 1g.5gb")
NOT_LISTED = ("Tesla V100-SXM2-16GB", "Tesla T4", "NVIDIA GeForce GTX 1080 Ti", "NVIDIA RTX A5000",
              "NVIDIA RTX 6000 Ada Generation", "cpu", "")


def old_match(name: str) -> bool:
    return any(g in name.upper() for g in OLD_LIST)


def fp32_run(name: str) -> dict:
    return cuda_facts(gpu_name=name, gpu_capability=None, gemm_share=0.7,
                      config={"train.precision": "fp32", "train.tf32": False})


@pytest.mark.parametrize("name", NAMES + NOT_LISTED)
def test_the_table_has_tensor_cores_where_the_old_list_did(name):
    assert has_tensor_cores(None, name) == old_match(name), name
    found = [f for f in rank(fp32_run(name)) if f["key"] == "fp32_math"]
    if old_match(name):
        assert len(found) == 1 and found[0]["score"] == pytest.approx(0.35)  # 0.5 x the planted gemm share
        assert found[0]["title"] == "fp32 math on a tensor-core GPU" and name in found[0]["evidence"][0]
    else:
        assert found == []


def test_the_capability_decides_when_recorded():
    assert has_tensor_cores((8, 0), "some unlisted name") and has_tensor_cores((9, 0), "")
    assert not has_tensor_cores((7, 5), "NVIDIA A100-SXM4-40GB")  # the measured capability wins over the name


def test_rows_without_peaks_report_no_mfu_and_rows_with_peaks_have_tensor_cores():
    for name in ("NVIDIA A10G", "NVIDIA A30", "NVIDIA L40", "NVIDIA B200", "NVIDIA GeForce RTX 3090"):
        row = gpu_facts(name)
        assert row is not None and row.tensor_cores and peak_flops(name, "bf16") is None, name
    for row in GPU_TABLE:
        if row.fp8 or row.peaks["bf16"] is not None:
            assert row.tensor_cores, row.words
    assert not gpu_facts("Tesla V100-SXM2-16GB").tensor_cores  # fp16 tensor cores only: no bf16/TF32
    assert gpu_facts("NVIDIA A100-SXM4-80GB").key == "a100-80gb"  # a family row never shadows a specific one
    assert gpu_facts("NVIDIA GeForce RTX 4090").key == "rtx-4090"
    mig = "NVIDIA H100 80GB HBM3 MIG 1g.10gb"  # a slice keeps its GPU's tensor cores, never its peak
    assert gpu_facts(mig) is None and gpu_facts(mig, mig=True).tensor_cores and peak_flops(mig, "bf16") is None
