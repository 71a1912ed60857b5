"""The GPUs ``tokenmill estimate`` knows: memory, memory bandwidth and link bandwidth per GPU.

Compute peaks are not repeated here: each GPU's ``device_name`` (what ``torch.cuda.get_device_name()``
reports) is looked up in the MFU peak table, :data:`tokenmill.model.flops.PEAK_FLOPS`, so the estimate
and the trainer's MFU use the same figures.

Figures are datasheet values: ``memory_mb`` is the memory CUDA reports as total (MiB); ``hbm_gbs`` the
memory bandwidth; ``link_gbs`` the bandwidth one GPU can send to its peers in one direction (NVLink
for the SXM parts, else PCIe), which collectives are charged against; ``sm`` the streaming multiprocessors
and ``cc`` the compute capability (NVIDIA's datasheets and CUDA's compute-capability table).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from tokenmill.errors import ConfigError
from tokenmill.model.flops import peak_flops


@dataclass(frozen=True)
class GPU:
    key: str
    name: str  # as torch.cuda.get_device_name() reports it
    memory_mb: float
    hbm_gbs: float
    link_gbs: float
    link: str
    sm: int = 0  # streaming multiprocessors (datasheet): the waves of a matrix product's tiles
    cc: tuple = (0, 0)  # compute capability: 8.0 Ampere A100, 8.9 Ada, 9.0 Hopper

    @property
    def cublas_workspace(self) -> int:
        """Bytes of cuBLAS workspace PyTorch allocates per handle and stream: ``:4096:8`` (32 MiB) from compute
        capability 9.0 (Hopper) on, ``:4096:2:16:8`` (8 MiB + 128 KiB) before (aten/src/ATen/cuda/CublasHandlePool.cpp,
        ``getChosenWorkspaceSize``)."""
        return 4096 * 8 * 1024 if self.cc[0] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8

    def peak(self, mode: str) -> Optional[float]:
        """Dense peak FLOP/s for a math mode ('fp32', 'tf32', 'bf16', 'fp16'), from the MFU table."""
        return peak_flops(self.name, mode) if self.key != "cpu" else None


GPUS: dict[str, GPU] = {g.key: g for g in (
    GPU("a100-40gb", "NVIDIA A100-SXM4-40GB", 40_536, 1_555, 300, "NVLink 3 (600 GB/s both ways)", 108, (8, 0)),
    GPU("a100-80gb", "NVIDIA A100-SXM4-80GB", 81_038, 2_039, 300, "NVLink 3 (600 GB/s both ways)", 108, (8, 0)),
    GPU("h100-sxm", "NVIDIA H100 80GB HBM3", 81_079, 3_350, 450, "NVLink 4 (900 GB/s both ways)", 132, (9, 0)),
    GPU("h100-pcie", "NVIDIA H100 PCIe", 81_079, 2_000, 64, "PCIe 5.0 x16", 114, (9, 0)),
    GPU("h200", "NVIDIA H200", 143_771, 4_800, 450, "NVLink 4 (900 GB/s both ways)", 132, (9, 0)),
    GPU("l4", "NVIDIA L4", 22_491, 300, 32, "PCIe 4.0 x16", 58, (8, 9)),
    GPU("rtx-4090", "NVIDIA GeForce RTX 4090", 24_217, 1_008, 32, "PCIe 4.0 x16", 128, (8, 9)),
    GPU("cpu", "cpu", 0, 50, 10, "shared memory"),
)}
_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "4090": "rtx-4090", "rtx4090": "rtx-4090"}


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def gpu_spec(name: str) -> GPU:
    """A GPU by key ('h100-sxm'), alias ('h100'), or the name torch reports ('NVIDIA H100 80GB HBM3')."""
    n = _norm(name)
    for key, gpu in GPUS.items():
        if n in (_norm(key), _norm(gpu.name)):
            return gpu
    for alias, key in _ALIASES.items():
        if n == _norm(alias):
            return GPUS[key]
    for gpu in GPUS.values():  # a reported name with extra words, e.g. "NVIDIA A100-SXM4-80GB MIG..."
        if gpu.key != "cpu" and _norm(gpu.name) in n:
            return gpu
    keys = ", ".join(GPUS)
    raise ConfigError(f"unknown GPU '{name}'; known: {keys} (see docs/estimate.md for their figures).")


def gpu_table_markdown() -> str:
    """The table of docs/estimate.md."""
    rows = ["| key | torch name | memory (MiB) | HBM GB/s | link GB/s | bf16 / tf32 / fp32 TFLOPS |",
            "|---|---|---|---|---|---|"]
    for g in GPUS.values():
        if g.key == "cpu":
            continue
        peaks = " / ".join(f"{(g.peak(m) or 0) / 1e12:.0f}" for m in ("bf16", "tf32", "fp32"))
        rows.append(f"| `{g.key}` | {g.name} | {g.memory_mb:,.0f} | {g.hbm_gbs:,} | {g.link_gbs} ({g.link}) | {peaks} |")
    return "\n".join(rows)
