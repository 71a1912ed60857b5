"""What machine a benchmark ran on.

The GPU facts are read in a short-lived subprocess (``python -m tokenmill.bench.env`` prints them as
JSON), so the bench process itself never creates a CUDA context that would hold GPU memory while
the rungs run; a torch built without CUDA and ROCm (a CPU wheel) can create none, so there they are
read in the bench process.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional


def device_facts() -> dict[str, Any]:
    """torch/CUDA/cuDNN/Triton versions and the visible GPUs (run inside the subprocess)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn_version(cudnn),
        "triton": package_version("triton") or package_version("pytorch-triton"),
        "cuda_available": count > 0,
        "gpu_count": count,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(count)],
        "gpu_capability": list(torch.cuda.get_device_capability(0)) if count else None,
    }


def cudnn_version(v: Optional[int]) -> Optional[str]:
    """cuDNN's version number as text: 90800 -> '9.8.0' (major * 10000 from cuDNN 9), 8902 -> '8.9.2'."""
    if not v:
        return None
    major, rest = (v // 10000, v % 10000) if v >= 90000 else (v // 1000, v % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def package_version(name: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def driver_version() -> dict[str, Any]:
    """The NVIDIA driver's version from ``nvidia-smi`` (None, with the reason, where it is absent or fails)."""
    import shutil

    if not shutil.which("nvidia-smi"):
        return {"driver": None}
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return {"driver": None, "driver_error": str(e)}
    lines = p.stdout.split()
    return {"driver": lines[0]} if p.returncode == 0 and lines else {"driver": None,
                                                                       "driver_error": p.stderr.strip()[-300:]}


def source_fingerprint(root: Optional[Path] = None) -> str:
    """A hash of tokenmill's source as it is here (every file of the package but caches, by path and
    content): equal on two machines when they run the same code. A copy without ``.git`` (a GPU machine)
    cannot say whether it has local changes; compare this with ``python -m tokenmill.bench.env
    --fingerprint`` run in a clean checkout of the recorded commit."""
    import hashlib

    import tokenmill

    root = root or Path(tokenmill.__file__).resolve().parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".so"):
            h.update(str(p.relative_to(root).as_posix()).encode() + b"\0" + p.read_bytes() + b"\0")
    return "sha256:" + h.hexdigest()[:32]


def probe_environment(timeout_s: float = 120.0) -> dict[str, Any]:
    """Device facts (from a subprocess where torch could reach a GPU) plus host, Python and git facts
    from here."""
    facts = device_facts() if gpuless_torch() else device_facts_subprocess(timeout_s)
    facts.update(driver_version())
    facts.update(host_facts())
    return facts


def gpuless_torch() -> bool:
    """Whether this torch is built without CUDA and ROCm: it can create no GPU context, so its device
    facts are read in this process (sparing an interpreter start that imports torch)."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


def device_facts_subprocess(timeout_s: float) -> dict[str, Any]:
    """:func:`device_facts` read by ``python -m tokenmill.bench.env``, so that this process creates no CUDA
    context; a probe that fails or times out gives CPU facts with ``probe_error``."""
    try:
        out = subprocess.run([sys.executable, "-m", "tokenmill.bench.env"], capture_output=True, text=True,
                             timeout=timeout_s, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        return {"torch": None, "cuda": None, "cuda_available": False, "gpu_count": 0, "gpu_names": [],
                "probe_error": str(e)}


def host_facts() -> dict[str, Any]:
    import tokenmill

    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tokenmill_version": tokenmill.__version__,
        **git_facts(),
        "source_fingerprint": source_fingerprint(),
    }


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)


def git_facts(path: Optional[Path] = None) -> dict[str, Any]:
    """The commit of the tokenmill checkout this code runs from (``git rev-parse HEAD``).

    Git is trusted only when this file is tracked by the repository around it: an installed copy
    inside another project's repository (a virtual environment in it, say) must not record that
    project's commit. A copy of the source without ``.git`` (e.g. shipped to a GPU machine) may name
    its commit in ``TOKENMILL_GIT_COMMIT``; whether that copy has local changes is then unknown
    (``git_dirty`` None, ``source_fingerprint`` says what ran) unless git here is at that very commit.
    ``path``: the file to check instead of this one (tests)."""
    found = _git_checkout(Path(path or __file__).resolve())
    given = os.environ.get("TOKENMILL_GIT_COMMIT")
    if given and found.get("git_commit") != given:
        return {"git_commit": given, "git_dirty": None,
                "git_dirty_note": "unknown: the commit was given (TOKENMILL_GIT_COMMIT), not read from a .git "
                                  "here; compare source_fingerprint with that commit's"}
    return found


def _git_checkout(here: Path) -> dict[str, Any]:
    unknown = {"git_commit": None, "git_dirty": None}
    try:
        if _git(["ls-files", "--error-unmatch", here.name], here.parent).returncode != 0:
            return unknown  # not in a git checkout, or not tokenmill's own
        head = _git(["rev-parse", "HEAD"], here.parent)
        dirty = _git(["status", "--porcelain", "--untracked-files=no"], here.parent)
    except (OSError, subprocess.SubprocessError):
        return unknown
    if head.returncode != 0 or dirty.returncode != 0:
        return unknown
    return {"git_commit": head.stdout.strip() or None, "git_dirty": bool(dirty.stdout.strip())}


def gpu_label(env: dict[str, Any]) -> str:
    names = env.get("gpu_names") or []
    if not names:
        return "cpu"
    return names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"


if __name__ == "__main__":
    print(source_fingerprint() if sys.argv[1:] == ["--fingerprint"] else json.dumps(device_facts()))
