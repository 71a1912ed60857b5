"""A chat folder built on this machine, with nothing downloaded: the `sft` ladder's data (benchmarks/session.py part
`sft-packing`; by hand: `python benchmarks/chat_corpus.py OUT` then `tokenmill bench ladder sft --set data.path=OUT/data`).

Conversations from the running Python's standard library: for each documented function, a user asks what it does
and the assistant answers with its docstring's first paragraph (every third conversation has a system message, every
fifth a second exchange about its module), so replies run from a few tokens to a few hundred, as instruction data
does. The tokenizer is a byte-level BPE of 4,096 ids trained here on those conversations, saved as a transformers
tokenizer folder with a ChatML template (`<|im_start|>role ... <|im_end|>`), and `tokenmill prepare --format chat`
renders and masks them with it: OUT/model (the tokenizer), OUT/chats.jsonl, OUT/data (the chat folder).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def documented_functions(limit: int) -> list[tuple[str, str, str]]:
    """(module, function, first paragraph of its docstring) from the standard library's sources, in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                para = doc.split("\n\n")[0].strip() if doc else ""
                if len(para) >= 20:
                    out.append((module, node.name, para))
                    if len(out) >= limit:
                        return out
    return out


def conversations(limit: int) -> list[dict]:
    out = []
    for i, (module, name, para) in enumerate(documented_functions(limit)):
        msgs = [{"role": "user", "content": f"What does {name} in the {module} module do?"},
                {"role": "assistant", "content": para}]
        if i % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "You answer questions about Python's standard library."})
        if i % 5 == 0:
            msgs += [{"role": "user", "content": f"Which module holds {name}?"},
                     {"role": "assistant", "content": f"It is defined in {module}."}]
        out.append({"messages": msgs})
    return out


def tokenizer_folder(texts: list[str], folder: Path) -> None:
    """A byte-level BPE of 4,096 ids trained on ``texts``, saved with the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=4096, special_tokens=SPECIALS, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(TEMPLATE)


def build(out: Path, limit: int = 20000, workers: int = 4) -> Path:
    """OUT/model, OUT/chats.jsonl and the prepared chat folder OUT/data (returned)."""
    out.mkdir(parents=True, exist_ok=True)
    chats = conversations(limit)
    (out / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    tokenizer_folder([m["content"] for c in chats for m in c["messages"]], out / "model")
    cmd = [sys.executable, "-m", "tokenmill", "prepare", str(out / "chats.jsonl"), "--out", str(out / "data"),
           "--format", "chat", "--tokenizer-from", str(out / "model"), "--workers", str(workers), "--no-progress",
           "--val-fraction", "0.02"]
    subprocess.run(cmd, check=True)
    return out / "data"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=4)
    a = ap.parse_args()
    print(build(a.out, a.conversations, a.workers))
