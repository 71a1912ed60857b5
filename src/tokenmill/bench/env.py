"""What machine a benchmark ran on.

The GPU facts are read in a short-lived subprocess (``python -m tokenmill.bench.env`` prints them as
JSON), so the bench process itself never creates a CUDA context that would hold GPU memory while
the rungs run.
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
    """torch/CUDA versions and the visible GPUs (run inside the subprocess)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": count > 0,
        "gpu_count": count,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(count)],
    }


def probe_environment(timeout_s: float = 120.0) -> dict[str, Any]:
    """Device facts from a subprocess plus host, Python and git facts from here."""
    try:
        out = subprocess.run([sys.executable, "-m", "tokenmill.bench.env"], capture_output=True, text=True,
                             timeout=timeout_s, check=True)
        facts = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        facts = {"torch": None, "cuda": None, "cuda_available": False, "gpu_count": 0, "gpu_names": [],
                 "probe_error": str(e)}
    facts.update(host_facts())
    return facts


def host_facts() -> dict[str, Any]:
    import tokenmill

    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tokenmill_version": tokenmill.__version__,
        **git_facts(),
    }


def _git(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)


def git_facts(path: Optional[Path] = None) -> dict[str, Any]:
    """The commit of the tokenmill checkout this code runs from (``git rev-parse HEAD``).

    Git is trusted only when this file is tracked by the repository around it: an installed copy
    inside another project's repository (a virtual environment in it, say) must not record that
    project's commit. A copy of the source without ``.git`` (e.g. shipped to a GPU machine) may name
    its commit in ``TOKENMILL_GIT_COMMIT``. ``path``: the file to check instead of this one (tests)."""
    if os.environ.get("TOKENMILL_GIT_COMMIT"):
        return {"git_commit": os.environ["TOKENMILL_GIT_COMMIT"], "git_dirty": False}
    here = Path(path or __file__).resolve()
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
    print(json.dumps(device_facts()))
