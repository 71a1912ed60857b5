"""The one table of GPU facts: dense peak FLOP/s per precision, FP8 tensor cores, and for the GPUs ``tokenmill
estimate`` models, memory, memory and link bandwidth, SMs and compute capability.

Read by MFU (``model/flops.py peak_flops``), FP8 (``model/fp8.py has_fp8``, ``fp8_peak_flops``) and the estimator
(``estimate/gpus.py``: its GPU list is the rows that have a ``key``), and through them by the doctor. Here, on
the model's floor, because MFU and FP8 need it and the estimator sits above them.

A row matches the name torch reports (``torch.cuda.get_device_name()``, split at spaces, hyphens, underscores
and slashes, case-insensitive) when all its ``words`` occur; the first matching row wins, so specific rows go
first. A MIG slice matches nothing (the full GPU's peak would be wrong).

Figures are datasheet values. Peaks: 'bf16'/'fp16' tensor cores with fp32 accumulation, 'tf32' TF32 tensor
cores, 'fp32' the non-tensor FP32 rate; None: no such mode, or no figure we are sure of (then no MFU is
reported). ``memory_mb`` is the memory CUDA reports as total (MiB); ``hbm_gbs`` the memory bandwidth;
``link_gbs`` what one GPU can send to its peers in one direction (NVLink for the SXM parts, else PCIe); ``sm``
the streaming multiprocessors and ``cc`` the compute capability (NVIDIA's datasheets and CUDA's
compute-capability table); ``pcie`` the generation of the x16 PCIe link to the host (datasheets: 'PCIe Gen4',
'PCIe Gen5'; 0 where not given). ``node_gpus`` and ``nic_gbps``: NVIDIA's reference node for the SXM parts, what a
run across nodes goes through (the estimator's collectives): DGX A100, eight A100s and eight single-port ConnectX-6
HDR InfiniBand adapters at 200 Gb/s for the compute fabric (DGX A100 datasheet); DGX H100 and DGX H200, eight GPUs and
eight ConnectX-7 NDR links at 400 Gb/s (DGX H100/H200 datasheets); ``tokenmill estimate --gpus-per-node /
--network-gbps`` describe another system. ``tensor_cores``: bf16/TF32 tensor cores (compute capability 8.0 and newer), what the
doctor's fp32-math rule asks when a run recorded no capability; implied by ``fp8`` or a bf16 peak, else given.

Rows with no peak (MFU None) stand for their tensor-core and FP8 facts alone: A10, A10G, A30, A40, L40, the RTX A
series, B200/GB200 and the GeForce RTX 30/40/50 series (datasheet tensor rates we are not sure of: GeForce parts
run fp16 with fp32 accumulation at a reduced rate). A word ending in ``*`` matches any word it begins (``30*``:
3060, 3090), so a family row goes after its specific rows. Not listed: H800, V100S.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["GPU_TABLE", "GPUFacts", "gpu_facts"]

_UNKNOWN: dict[str, Optional[float]] = {"bf16": None, "fp16": None, "tf32": None, "fp32": None}
# H100 SXM, H200 (SXM) and GH200: the same GH100 compute at the same clocks.
_HOPPER_SXM: dict[str, Optional[float]] = {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}
_A100: dict[str, Optional[float]] = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
_NVLINK3, _NVLINK4 = "NVLink 3 (600 GB/s both ways)", "NVLink 4 (900 GB/s both ways)"


@dataclass(frozen=True)
class GPUFacts:
    """One row: ``key`` names the GPU for ``tokenmill estimate --gpu`` ('' when the estimator does not model
    it: only the peaks and FP8 are known), ``name`` as torch reports it."""

    words: tuple[str, ...]
    peaks: dict[str, Optional[float]] = field(default_factory=lambda: dict(_UNKNOWN))
    fp8: bool = False  # FP8 tensor cores (compute capability 8.9 and newer: Ada, Hopper)
    key: str = ""
    name: str = ""
    memory_mb: float = 0.0
    hbm_gbs: float = 0.0
    link_gbs: float = 0.0
    link: str = ""
    sm: int = 0
    cc: tuple = (0, 0)
    tensor_cores: bool = False
    pcie: int = 0  # PCIe generation of the host link (x16)  # bf16/TF32 tensor cores; set from ``fp8`` or a bf16 peak when those say so
    node_gpus: int = 0  # GPUs in NVIDIA's reference node for this part (DGX/HGX baseboard: 8); 0: none
    nic_gbps: int = 0  # that node's compute-fabric NIC line rate per GPU, Gb/s (one NIC per GPU); 0: none

    def __post_init__(self):
        if self.fp8 or self.peaks.get("bf16") is not None:
            object.__setattr__(self, "tensor_cores", True)


GPU_TABLE: tuple[GPUFacts, ...] = (
    GPUFacts(("GH200",), _HOPPER_SXM, True),
    GPUFacts(("H200", "NVL"), _UNKNOWN, True),  # NVL parts run lower clocks than SXM
    GPUFacts(("H200",), _HOPPER_SXM, True, "h200", "NVIDIA H200", 143_771, 4_800, 450, _NVLINK4, 132, (9, 0),
             pcie=5, node_gpus=8, nic_gbps=400),
    GPUFacts(("H100", "NVL"), _UNKNOWN, True),
    GPUFacts(("H100", "PCIE"), {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51.2e12}, True,
             "h100-pcie", "NVIDIA H100 PCIe", 81_079, 2_000, 64, "PCIe 5.0 x16", 114, (9, 0), pcie=5),
    GPUFacts(("H100", "SXM5"), _HOPPER_SXM, True),
    GPUFacts(("H100", "SXM"), _HOPPER_SXM, True),
    GPUFacts(("H100", "HBM3"), _HOPPER_SXM, True,  # the SXM part reports "NVIDIA H100 80GB HBM3"
             "h100-sxm", "NVIDIA H100 80GB HBM3", 81_079, 3_350, 450, _NVLINK4, 132, (9, 0), pcie=5, node_gpus=8,
             nic_gbps=400),
    GPUFacts(("H100",), _UNKNOWN, True),
    GPUFacts(("A100", "40GB"), _A100, False, "a100-40gb", "NVIDIA A100-SXM4-40GB", 40_536, 1_555, 300, _NVLINK3, 108,
             (8, 0), pcie=4, node_gpus=8, nic_gbps=200),
    GPUFacts(("A100", "80GB"), _A100, False, "a100-80gb", "NVIDIA A100-SXM4-80GB", 81_038, 2_039, 300, _NVLINK3, 108,
             (8, 0), pcie=4, node_gpus=8, nic_gbps=200),
    GPUFacts(("A100",), _A100, False),
    GPUFacts(("L40S",), {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183e12, "fp32": 91.6e12}, True),
    GPUFacts(("L4",), {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}, True,
             "l4", "NVIDIA L4", 22_491, 300, 32, "PCIe 4.0 x16", 58, (8, 9), pcie=4),
    GPUFacts(("RTX", "4090"), {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}, True,
             "rtx-4090", "NVIDIA GeForce RTX 4090", 24_217, 1_008, 32, "PCIe 4.0 x16", 128, (8, 9), pcie=4),
    GPUFacts(("L40*",), _UNKNOWN, True),  # L40 (Ada); L40S has its row above
    GPUFacts(("A10*",), _UNKNOWN, tensor_cores=True),  # A10, A10G, RTX A1000 (Ampere); A100 has its rows above
    GPUFacts(("A30*",), _UNKNOWN, tensor_cores=True),  # A30, RTX A3000 (Ampere)
    GPUFacts(("A40*",), _UNKNOWN, tensor_cores=True),  # A40, RTX A400/A4000/A4500 (Ampere)
    GPUFacts(("A6000",), _UNKNOWN, tensor_cores=True),  # RTX A6000 (Ampere)
    GPUFacts(("GB200",), _UNKNOWN, True),  # Blackwell
    GPUFacts(("B200",), _UNKNOWN, True),
    GPUFacts(("RTX", "30*"), _UNKNOWN, tensor_cores=True),  # GeForce RTX 30 series (Ampere)
    GPUFacts(("RTX", "40*"), _UNKNOWN, tensor_cores=True),  # GeForce RTX 40 series (Ada; FP8 left to rows we know)
    GPUFacts(("RTX", "50*"), _UNKNOWN, tensor_cores=True),  # GeForce RTX 50 series (Blackwell)
    GPUFacts(("V100", "SXM2"), {"bf16": None, "fp16": 125e12, "tf32": None, "fp32": 15.7e12}),
    GPUFacts(("V100", "PCIE"), {"bf16": None, "fp16": 112e12, "tf32": None, "fp32": 14e12}),
)


def gpu_facts(device_name: str, mig: bool = False) -> Optional[GPUFacts]:
    """The row of :data:`GPU_TABLE` for the name torch reports, or None (unlisted, a CPU, a MIG slice). With
    ``mig``, a MIG slice gets its full GPU's row: for the facts a slice keeps (tensor cores, FP8), never a peak."""
    kept = _ROWS.get((device_name, mig))  # the estimator asks once per traced kernel: remembered per table
    if kept is not None and kept[0] is GPU_TABLE:
        return kept[1]
    words = set(re.split(r"[\s\-_/]+", device_name.upper()))
    row = None
    if "MIG" not in words or mig:  # a slice of the GPU: the full-GPU peak would be wrong
        row = next((r for r in GPU_TABLE if all(_has(words, w) for w in r.words)), None)
    if len(_ROWS) < 256:
        _ROWS[(device_name, mig)] = (GPU_TABLE, row)
    return row


_ROWS: dict[tuple[str, bool], tuple[tuple, Optional[GPUFacts]]] = {}


def _has(words: set[str], word: str) -> bool:
    """``word`` is one of ``words``, or, ending in ``*``, begins one of them."""
    if word.endswith("*"):
        return any(w.startswith(word[:-1]) for w in words)
    return word in words
