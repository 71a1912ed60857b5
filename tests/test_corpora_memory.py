"""``prepare`` streams: the peak resident memory of its processes is the same for a corpus 10x larger
(tokenizing, and training the BPE). Measured as a child process's peak RSS (getrusage RUSAGE_CHILDREN
in a fresh wrapper process, which waits for the prepare, which waits for its tokenizer processes)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

WORDS = "the quick brown fox jumps over the lazy dog héllo wörld café data mill tokens shard stream".split()

# the wrapper: run the CLI in a child, print the largest peak RSS among it and its descendants (KiB)
MEASURE = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""
# the prepare, with 64 KiB pieces so that even the small corpus fills the pipeline
CLI = """
import importlib, sys
importlib.import_module("tokenmill.data.prepare").CHUNK_BYTES = 1 << 16
from tokenmill.cli import main
sys.exit(main(sys.argv[1:]))
"""


def corpus(path: Path, megabytes: float) -> Path:
    rnd = random.Random(0)
    size = 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 1e6:
            line = json.dumps({"text": " ".join(rnd.choices(WORDS, k=rnd.randint(20, 600)))}) + "\n"
            f.write(line)
            size += len(line.encode())
    return path


def peak_rss_kib(src: Path, out: Path, *args: str) -> int:
    cmd = [sys.executable, "-c", MEASURE, sys.executable, "-c", CLI, "prepare", str(src), "--out", str(out),
           "--workers", "2", "--no-progress", "--shard-tokens", str(1 << 20), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("what,args,mb", [("tokenize", ("--tokenizer", "bytes"), 3.0),
                                          ("train-bpe", ("--tokenizer", "bpe", "--vocab-size", "300"), 1.5)])
def test_peak_memory_is_flat_in_the_corpus_size(tmp_path, what, args, mb):
    small = peak_rss_kib(corpus(tmp_path / "small.jsonl", mb), tmp_path / "a", *args)
    large = peak_rss_kib(corpus(tmp_path / "large.jsonl", 10 * mb), tmp_path / "b", *args)
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert meta["splits"]["train"]["tokens"] > 10 * mb * 1e6 / 8  # the large corpus was tokenized
    margin = max(16 * 1024, 0.05 * small)
    assert abs(large - small) <= margin, f"{what}: peak RSS {small} KiB for {mb} MB, {large} KiB for {10 * mb} MB"
