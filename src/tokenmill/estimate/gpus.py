"""The GPUs ``tokenmill estimate`` knows: the rows of the one GPU table (:data:`tokenmill.model.gpus.GPU_TABLE`)
that have a ``key`` (memory, memory and link bandwidth, SMs, compute capability), and the CPU.

Compute peaks and FP8 are read from the same table through the name torch reports (``GPU.peak``, ``GPU.fp8``:
:func:`tokenmill.model.flops.peak_flops`, :func:`tokenmill.model.fp8.has_fp8`), so the estimate, the trainer's MFU
and the FP8 check use the same figures; docs/estimate.md lists them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from tokenmill.errors import ConfigError
from tokenmill.model.flops import peak_flops
from tokenmill.model.fp8 import has_fp8
from tokenmill.model.gpus import GPU_TABLE


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
    pcie: int = 0  # PCIe generation of the host link (x16): roofline.host_link_bytes_s
    node_gpus: int = 0  # GPUs a node holds (0: unknown, one node): collectives over more cross the network
    nic_gbps: float = 0.0  # the network's line rate per GPU, Gb/s (roofline.group_bandwidth)

    @property
    def cublas_workspace(self) -> int:
        """Bytes of cuBLAS workspace PyTorch allocates per handle and stream: ``:4096:8`` (32 MiB) from compute
        capability 9.0 (Hopper) on, ``:4096:2:16:8`` (8 MiB + 128 KiB) before (aten/src/ATen/cuda/CublasHandlePool.cpp,
        ``getChosenWorkspaceSize``)."""
        return 4096 * 8 * 1024 if self.cc[0] >= 9 else 4096 * 1024 * 2 + 16 * 1024 * 8

    def peak(self, mode: str) -> Optional[float]:
        """Dense peak FLOP/s for a math mode ('fp32', 'tf32', 'bf16', 'fp16'), from the one GPU table (MFU's)."""
        return peak_flops(self.name, mode) if self.key != "cpu" else None

    @property
    def fp8(self) -> bool:
        """FP8 tensor cores, from the one GPU table (what ``train.fp8``'s check reads)."""
        return self.key != "cpu" and has_fp8(self.name)


GPUS: dict[str, GPU] = {g.key: g for g in (
    *(GPU(r.key, r.name, r.memory_mb, r.hbm_gbs, r.link_gbs, r.link, r.sm, r.cc, r.pcie, r.node_gpus, r.nic_gbps)
      for r in GPU_TABLE if r.key),
    GPU("cpu", "cpu", 0, 50, 10, "shared memory"),
)}
_ALIASES = {"a100": "a100-80gb", "h100": "h100-sxm", "4090": "rtx-4090", "rtx4090": "rtx-4090"}


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def gpu_spec(name: str | GPU) -> GPU:
    """A GPU by key ('h100-sxm'), alias ('h100'), or the name torch reports ('NVIDIA H100 80GB HBM3'); a
    :class:`GPU` is itself (``estimate --gpus-per-node``/``--network-gbps`` make one)."""
    if isinstance(name, GPU):
        return name
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
    rows = ["| key | torch name | memory (MiB) | HBM GB/s | link GB/s | node (GPUs, Gb/s network per GPU) "
            "| bf16 / tf32 / fp32 TFLOPS |",
            "|---|---|---|---|---|---|---|"]
    for g in GPUS.values():
        if g.key == "cpu":
            continue
        peaks = " / ".join(f"{(g.peak(m) or 0) / 1e12:.0f}" for m in ("bf16", "tf32", "fp32"))
        node = f"{g.node_gpus}, {g.nic_gbps:g}" if g.node_gpus else "-"
        rows.append(f"| `{g.key}` | {g.name} | {g.memory_mb:,.0f} | {g.hbm_gbs:,} | {g.link_gbs} ({g.link}) | {node} "
                    f"| {peaks} |")
    return "\n".join(rows)
