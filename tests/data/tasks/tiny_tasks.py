"""The documents of tokenmill's offline test tasks: read from the JSON Lines file beside this one, so the tasks
load from any working directory and nothing is downloaded (lm-eval's ``custom_dataset`` hook)."""

import json
from pathlib import Path

import datasets


def _split(name: str) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (Path(__file__).parent / name).read_text(encoding="utf-8").splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def multiple_choice(**_kwargs) -> datasets.DatasetDict:
    return _split("tiny_mc.jsonl")


def generation(**_kwargs) -> datasets.DatasetDict:
    return _split("tiny_gen.jsonl")


def perplexity(**_kwargs) -> datasets.DatasetDict:
    return _split("tiny_ppl.jsonl")
