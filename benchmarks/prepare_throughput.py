"""How fast `tokenmill prepare` tokenizes, against the tokenizer libraries' own batch encoders, and how
fast the training loader serves batches.

    python benchmarks/prepare_throughput.py                    # 50 MB and 200 MB corpora, every CPU
    python benchmarks/prepare_throughput.py --sizes 20M,100M --workers 2 --json out.json

For each corpus size (JSON Lines records of this Python's standard-library sources, repeated to the
size; the file is written once under --dir) and each tokenizer (GPT-2 through tiktoken, GPT-2 through
Hugging Face `tokenizers`), it measures on the same cores:

* the library alone: the texts already in memory, encoded with the library's batch call using every
  worker thread (`tiktoken.Encoding.encode_ordinary_batch(num_threads=W)`,
  `tokenizers.Tokenizer.encode_batch` with RAYON_NUM_THREADS=W), in batches of about 8 MB of text;
* `prepare`: reading, parsing and splitting the JSON Lines file, tokenizing with W worker processes and
  writing the token shards (wall time of the whole call);

and prints MB/s of text for both and their ratio (prepare / library), and the CPU seconds per MB each
spends (all threads and processes) and their ratio: on a machine shared with other work the wall-clock
ratio moves with the load, the CPU ratio much less. Then the loader: tokens/s of
`build_train_loader` over the prepared folder for batch 16 x 1024 (random windows), with 0 and 2
DataLoader workers, against the 600k tokens/s GPT-2 124M takes on one H100.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

H100_GPT2_TOKENS_PER_S = 600_000


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}.get(t[-1:], 1)
    return int(float(t[:-1] if scale != 1 else t) * scale)


def make_corpus(path: Path, size: int) -> int:
    """JSON Lines of stdlib source files (one record each, repeated) up to ``size`` bytes of text."""
    from tokenmill.data.stdlib import embedded_corpus_files

    texts = [f.read_text(encoding="utf-8", errors="replace") for f in embedded_corpus_files()]
    if path.is_file() and path.stat().st_size >= size:
        return path.stat().st_size
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < size:
            for i, t in enumerate(texts):
                line = json.dumps({"text": t, "id": i}) + "\n"
                f.write(line)
                written += len(line)
                if written >= size:
                    break
    return path.stat().st_size


def library_seconds(name: str, corpus: Path, workers: int) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of all its threads, text bytes) to encode the corpus's texts with the library's own batch encoder, run in a
    fresh process so its thread count is exactly ``workers``."""
    code = f"""
import json, time, sys
from tokenmill.data.gpt2 import gpt2_encoding, packaged_gpt2_dir
texts = [json.loads(l)["text"] for l in open({str(corpus)!r}, encoding="utf-8")]
batches, cur, n = [], [], 0
for t in texts:
    cur.append(t); n += len(t)
    if n >= 8_000_000:
        batches.append(cur); cur, n = [], 0
batches.append(cur)
if {name!r} == "tiktoken":
    enc = gpt2_encoding()
    run = lambda b: enc.encode_ordinary_batch(b, num_threads={workers})
else:
    from tokenizers import Tokenizer, models, pre_tokenizers
    d = packaged_gpt2_dir()
    tok = Tokenizer(models.BPE.from_file(str(d / "encoder.json"), str(d / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    run = lambda b: tok.encode_batch(b, add_special_tokens=False)
run(batches[0][:10])
t0, c0 = time.perf_counter(), time.process_time()
for b in batches:
    run(b)
print(time.perf_counter() - t0, time.process_time() - c0, sum(len(t.encode()) for t in texts))
"""
    env = {**os.environ, "RAYON_NUM_THREADS": str(workers), "TOKENIZERS_PARALLELISM": "true"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    secs, cpu, nbytes = out.stdout.split()
    return float(secs), float(cpu), int(nbytes)


def prepare_seconds(name: str, corpus: Path, out: Path, workers: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the process and its tokenizer processes) of ``prepare`` on the
    corpus (fresh process)."""
    code = f"""
import resource, time
from tokenmill.data import prepare
from tokenmill.data.gpt2 import packaged_gpt2_dir
from tokenmill.data.tokenizers import BpeTokenizer
tok = 'gpt2'
if {name!r} == "tokenizers":
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    d = packaged_gpt2_dir()
    t = Tokenizer(models.BPE.from_file(str(d / "encoder.json"), str(d / "vocab.bpe")))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    tok = BpeTokenizer(t, None, 50256)
def cpu():
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
t0, c0 = time.perf_counter(), cpu()
prepare({str(corpus)!r}, {str(out)!r}, tok, workers={workers}, progress=False, val_fraction=0.01)
print(time.perf_counter() - t0, cpu() - c0)
"""
    out_ = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall, cpu = out_.stdout.split()[-2:]
    return float(wall), float(cpu)


def loader_tokens_per_s(folder: Path, workers: int, steps: int = 200) -> float:
    """Tokens/s of the training loader (batch 16 x 1024, random windows) over ``folder``."""
    from types import SimpleNamespace

    from tokenmill.data import WindowDataset, build_train_loader, open_token_data

    cfg = SimpleNamespace(num_workers=workers, prefetch_factor=4, persistent_workers=workers > 0, pin_memory=False)
    ds = WindowDataset(open_token_data(folder, "train", validate="quick"), 1024, "random", seed=0)
    loader = iter(build_train_loader(ds, cfg, 16, 1, 0, steps + 10))
    for _ in range(10):
        next(loader)
    t0 = time.perf_counter()
    for _ in range(steps):
        next(loader)
    return steps * 16 * 1024 / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="50M,200M", help="corpus sizes (default: 50M,200M)")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="cores to use (default: all)")
    ap.add_argument("--tokenizers", default="tiktoken,tokenizers", help="which libraries (default: both)")
    ap.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "tokenmill-bench-prepare"),
                    help="where the corpora and outputs go (default: a folder in the system's temp dir)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs visible, "
          f"{args.workers} used; python {platform.python_version()}")
    print(f"{'corpus':>8} {'library':>10} {'library MB/s':>13} {'prepare MB/s':>13} {'ratio':>6} "
          f"{'library CPU s/MB':>17} {'prepare CPU s/MB':>17} {'CPU ratio':>9}")
    for size in [parse_size(s) for s in args.sizes.split(",")]:
        corpus = root / f"corpus-{size // 10**6}M.jsonl"
        make_corpus(corpus, size)
        for name in args.tokenizers.split(","):
            lib_s, lib_cpu, nbytes = library_seconds(name, corpus, args.workers)
            prep_s, prep_cpu = prepare_seconds(name, corpus, root / f"out-{name}-{size // 10**6}M", args.workers)
            mb = nbytes / 1e6
            row = {"corpus_bytes": size, "text_bytes": nbytes, "library": name, "workers": args.workers,
                   "library_mb_s": mb / lib_s, "prepare_mb_s": mb / prep_s, "ratio": lib_s / prep_s,
                   "library_cpu_s_per_mb": lib_cpu / mb, "prepare_cpu_s_per_mb": prep_cpu / mb,
                   "cpu_ratio": lib_cpu / prep_cpu}
            rows.append(row)
            print(f"{size / 1e6:>7.0f}M {name:>10} {row['library_mb_s']:>13.2f} {row['prepare_mb_s']:>13.2f} "
                  f"{row['ratio']:>6.2f} {row['library_cpu_s_per_mb']:>17.3f} {row['prepare_cpu_s_per_mb']:>17.3f} "
                  f"{row['cpu_ratio']:>9.2f}", flush=True)
    folder = root / f"out-{args.tokenizers.split(',')[0]}-{parse_size(args.sizes.split(',')[0]) // 10**6}M"
    loader = {w: loader_tokens_per_s(folder, w) for w in (0, 2)}
    for w, v in loader.items():
        print(f"loader, batch 16 x 1024, {w} workers: {v:,.0f} tokens/s = "
              f"{v / H100_GPT2_TOKENS_PER_S:.1f} x GPT-2 124M on one H100 ({H100_GPT2_TOKENS_PER_S:,} tokens/s)")
    if args.json:
        Path(args.json).write_text(json.dumps({"prepare": rows, "loader_tokens_per_s": loader}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
