"""LICENSE, Dockerfile and .dockerignore against pyproject.toml (no Docker engine runs here, so this
checks what can be checked without one), and optional dependencies that stay optional."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from conftest import cpu_env

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_license_matches_pyproject():
    text = (ROOT / "LICENSE").read_text()
    assert pyproject()["project"]["license"] == {"text": "MIT"}
    assert text.startswith("MIT License\n")
    assert re.search(r"^Copyright \(c\) \d{4} tokenmill authors$", text, re.M)
    assert "THE SOFTWARE IS PROVIDED \"AS IS\"" in text


def test_dockerfile_base_image_is_an_official_pytorch_cuda_runtime():
    ins = dockerfile_instructions()
    args = dict(a.split("=", 1) for w, a in ins if w == "ARG" and "=" in a)
    froms = [a for w, a in ins if w == "FROM"]
    assert froms == ["${PYTORCH_IMAGE}"]
    m = re.fullmatch(r"pytorch/pytorch:(\d+)\.(\d+)\.(\d+)-cuda12\.\d+-cudnn9-runtime", args["PYTORCH_IMAGE"])
    assert m, args["PYTORCH_IMAGE"]
    # the image's torch satisfies tokenmill's torch requirement (pip then keeps it)
    req = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch"))
    need = tuple(int(x) for x in re.fullmatch(r"torch>=(\d+)\.(\d+)", req).groups())
    assert tuple(int(x) for x in m.groups()[:2]) >= need


def _ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore ``patterns`` exclude ``path`` or one of its parent folders (no '!' rules used)."""
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    return any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.removeprefix("**/")) for pat in patterns for p in prefixes)


def test_dockerfile_copies_existing_files_not_dockerignored():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert not any(p.startswith("!") for p in patterns)  # _ignored does not model exceptions
    copied = []
    for word, rest in dockerfile_instructions():
        if word == "COPY":
            copied += rest.split()[:-1]  # the last argument is the destination
    assert copied, "the Dockerfile copies nothing"
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: no such file in the repository"
        assert not _ignored(src, patterns), f"COPY {src}: excluded by .dockerignore"
    # what the package build reads is copied: pyproject.toml, its readme, the license, the sources
    project = pyproject()["project"]
    for need in ("pyproject.toml", project["readme"], "LICENSE", "src"):
        assert need in copied, need
    assert _ignored(".git", patterns) and _ignored("runs/x/metrics.jsonl", patterns)


def test_dockerfile_installs_all_extras_and_runs_tokenmill():
    ins = dockerfile_instructions()
    runs = " ".join(a for w, a in ins if w == "RUN")
    installs = re.findall(r"pip install [^&]*?[\"']?\.\[([a-z0-9_,-]+)\][\"']?", runs)
    assert installs == ["all"], runs
    extras = pyproject()["project"]["optional-dependencies"]
    # 'all' holds every user-facing extra's packages (dev is for development)
    in_all = set(extras["all"])
    for name, pkgs in extras.items():
        if name not in ("all", "dev"):
            assert set(pkgs) <= in_all, f"extra '{name}' has packages missing from 'all': {set(pkgs) - in_all}"
    assert "--constraint" in runs  # the image's CUDA torch is kept
    entry = [a for w, a in ins if w == "ENTRYPOINT"]
    assert entry == ['["tokenmill"]'] and "tokenmill" in pyproject()["project"]["scripts"]


@pytest.mark.slow
def test_hf_extra_and_optional_imports():
    extras = pyproject()["project"]["optional-dependencies"]
    assert {p.split(">=")[0] for p in extras["hf"]} == {"transformers", "safetensors"}
    assert not any(d.startswith(("transformers", "safetensors")) for d in pyproject()["project"]["dependencies"])
    # import tokenmill, the CLI and the HF converter without importing transformers or safetensors
    code = ("import sys, tokenmill, tokenmill.cli, tokenmill.model.hf; tokenmill.cli.build_parser(); "
            "bad = [m for m in ('transformers', 'safetensors') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cpu_env(), timeout=120)
    assert r.returncode == 0, r.stderr
