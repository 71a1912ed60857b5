"""``tokenmill prepare --format chat``: conversations rendered with a model's own chat template, token ids equal
to transformers' ``apply_chat_template(..., tokenize=True)``, and an exact assistant-only loss mask.

The templates (tests/chat_templates/*.jinja) are the public chat templates of Llama 3 and 3.2 (with its date and
tools), Qwen2.5, Qwen3, SmolLM2 and Mistral 7B Instruct v0.3 (plus generation-marked variants written here); each runs on a small byte-level BPE built here with that family's special tokens, saved as
a Hugging Face folder (tokenizer.json + tokenizer_config.json / chat_template.jinja)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from tokenmill.cli import main  # noqa: E402
from tokenmill.data.chat import (  # noqa: E402
    LEARN_BIT,
    START_BIT,
    ChatSettings,
    ChatTemplate,
    Conversation,
    conversation_sequences,
    new_counts,
)
from tokenmill.data.chat_prepare import prepare_chat  # noqa: E402
from tokenmill.data.dataset import IGNORE_INDEX, WindowDataset, open_token_data  # noqa: E402
from tokenmill.errors import BadRecordError, DataError  # noqa: E402

TEMPLATES = Path(__file__).parent / "chat_templates"
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "What is the capital of France? Paris is the capital.",
             "You are a helpful assistant.", "Hello! How can I help you today?", "def add(a, b): return a + b"] * 3
FAMILIES = {  # special tokens (and added non-special ones) of each family, bos, eos
    "llama3": (["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], [],
               "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_5": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"], None, "<|im_end|>"),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>", "<think>", "</think>"],
              None, "<|im_end|>"),
    "smollm2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], [], "<|im_start|>", "<|im_end|>"),
    "mistral": (["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                 "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [], "<s>", "</s>"),
}
FAMILIES["smollm2_generation"] = FAMILIES["smollm2"]
FAMILIES["llama3_2"] = FAMILIES["llama3_generation"] = FAMILIES["llama3"]
EOT = {"llama3": "<|eot_id|>", "llama3_2": "<|eot_id|>", "qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>", "smollm2": "<|im_end|>", "mistral": "</s>"}


def _build(family: str, folder: Path, template: str | None, in_config: bool = False) -> Path:
    specials, plain, bos, eos = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if plain:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos)
    fast.save_pretrained(str(folder))
    if template is not None:
        if in_config:  # the older place: tokenizer_config.json's "chat_template"
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
            (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
        else:
            (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = _build(family, tmp_path_factory.mktemp(family),
                                  (TEMPLATES / f"{family}.jinja").read_text(), in_config=family == "llama3")
        return made[family]

    return get


def _spans(ids: np.ndarray, mask: np.ndarray, tok) -> list[str]:
    """The learned runs of tokens, each decoded."""
    learned = (mask & LEARN_BIT).astype(bool)
    out, i = [], 0
    while i < len(ids):
        if learned[i]:
            j = i
            while j < len(ids) and learned[j]:
                j += 1
            out.append(tok.decode([int(t) for t in ids[i:j]]))
            i = j
        else:
            i += 1
    return out


def _reference(ct: ChatTemplate, conv: Conversation, **kw) -> list[int]:
    return list(ct.tok.apply_chat_template(conv.messages, tools=conv.tools, tokenize=True, return_dict=False, **kw))


TALK = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital."},
        {"role": "user", "content": "And of Spain?"},
        {"role": "assistant", "content": "Madrid.\nIt is the capital of Spain."}]


@pytest.mark.parametrize("family", ["llama3", "llama3_2", "qwen2_5", "qwen3", "smollm2", "mistral"])
def test_ids_equal_transformers_and_only_replies_are_learned(model_dir, family):
    ct = ChatTemplate(model_dir(family))
    msgs = TALK[1:] if family == "mistral" else TALK  # v0.3 renders the system message only before a last user turn
    conv = Conversation([dict(m) for m in msgs])
    ids, mask = ct.encode(conv, "assistant")
    assert ids.tolist() == _reference(ct, conv)
    assert ct.eot == EOT[family]
    replies = [m["content"] for m in msgs if m["role"] == "assistant"]
    want = {"llama3": [r.strip() + "<|eot_id|>" for r in replies], "llama3_2": [r.strip() + "<|eot_id|>" for r in replies],
            "mistral": [" " + r.strip() + "</s>" for r in replies],
            # Qwen3 writes an empty thinking block before the last reply (part of what the model generates)
            "qwen3": [replies[0] + "<|im_end|>", "<think>\n\n</think>\n\n" + replies[1] + "<|im_end|>"],
            }.get(family, [r + "<|im_end|>" for r in replies])
    assert _spans(ids, mask, ct.tok) == want
    assert mask[0] == START_BIT and not (mask[1:] & START_BIT).any()


def test_qwen3_thinking_blocks(model_dir):
    """Reasoning of the last reply is learned with it; an earlier reply's reasoning, which the template drops once
    a later question follows, is in neither the ids nor the mask."""
    ct = ChatTemplate(model_dir("qwen3"))
    conv = Conversation([{"role": "user", "content": "What is 2 + 3?"},
                         {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n5"},
                         {"role": "user", "content": "And 2 + 4?"},
                         {"role": "assistant", "content": "6", "reasoning_content": "add again"}])
    ids, mask = ct.encode(conv, "assistant")
    assert ids.tolist() == _reference(ct, conv)
    assert _spans(ids, mask, ct.tok) == ["5<|im_end|>", "<think>\nadd again\n</think>\n\n6<|im_end|>"]
    assert "add them" not in ct.tok.decode(ids.tolist())
    # a reasoning reply followed by a tool result and a later question: the template renders that reply
    # differently once the question follows, so the conversation is refused with that reason
    tool = Conversation([{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": "", "reasoning_content": "call it",
                          "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": "Paris"}}}]},
                         {"role": "tool", "content": "sunny"},
                         {"role": "assistant", "content": "Sunny."},
                         {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Welcome."}])
    with pytest.raises(BadRecordError, match="renders earlier turns differently"):
        ct.encode(tool, "assistant")


def test_qwen2_5_tool_calls_are_learned(model_dir):
    ct = ChatTemplate(model_dir("qwen2_5"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conv = Conversation([{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "content": "sunny"},
                         {"role": "assistant", "content": "It is sunny."}], tools)
    ids, mask = ct.encode(conv, "assistant")
    assert ids.tolist() == _reference(ct, conv)
    assert _spans(ids, mask, ct.tok) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        "It is sunny.<|im_end|>"]


def test_llama3_2_tool_calls_are_learned(model_dir):
    ct = ChatTemplate(model_dir("llama3_2"))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conv = Conversation([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                             "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                         {"role": "tool", "content": "sunny"},
                         {"role": "assistant", "content": "It is sunny."}], tools)
    ids, mask = ct.encode(conv, "assistant")
    assert ids.tolist() == _reference(ct, conv)
    assert "Today Date:" in ct.tok.decode(ids.tolist())
    assert _spans(ids, mask, ct.tok) == ['{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>',
                                         "It is sunny.<|eot_id|>"]


@pytest.mark.parametrize("family", ["smollm2_generation", "llama3_generation"])
def test_mask_equals_transformers_generation_mask(model_dir, family):
    """Where the template marks replies with {% generation %}, transformers computes the assistant mask itself:
    equal to ours, token for token."""
    ct = ChatTemplate(model_dir(family))
    conv = Conversation([dict(m) for m in TALK] + [{"role": "user", "content": "Thanks!"},
                                                       {"role": "assistant", "content": "You are welcome."}])
    ids, mask = ct.encode(conv, "assistant")
    ref = ct.tok.apply_chat_template(conv.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == ref["input_ids"]
    assert ((mask & LEARN_BIT) > 0).astype(int).tolist() == ref["assistant_masks"]
    assert sum(ref["assistant_masks"]) > 10


def test_learn_modes(model_dir):
    ct = ChatTemplate(model_dir("llama3"))
    conv = Conversation([dict(m) for m in TALK])
    ids, last = ct.encode(conv, "last")
    assert _spans(ids, last, ct.tok) == ["Madrid.\nIt is the capital of Spain.<|eot_id|>"]
    _, every = ct.encode(conv, "all")
    assert every[0] == START_BIT and (every[1:] == LEARN_BIT).all()


def _settings(**kw) -> ChatSettings:
    base = dict(seed=0, val_fraction=0.0, dtype="uint16", vocab_size=10**6, learn="assistant", overflow="split",
                block_size=None)
    return ChatSettings(**{**base, **kw})


def test_overflow_drop_and_split(model_dir):
    ct = ChatTemplate(model_dir("smollm2"))
    turns = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(6):
        turns += [{"role": "user", "content": f"Question {i}: what is the capital of France?"},
                  {"role": "assistant", "content": f"Answer {i}: Paris is the capital."}]
    conv = Conversation(turns)
    whole = len(_reference(ct, conv))
    block = whole // 2
    counts = new_counts()
    assert conversation_sequences(ct, conv, _settings(block_size=block, overflow="drop"), counts) == []
    assert counts["too_long"] == 1
    counts = new_counts()
    seqs = conversation_sequences(ct, conv, _settings(block_size=block), counts)
    assert counts["split"] == 1 and len(seqs) >= 2
    answers = []
    for ids, mask in seqs:
        assert len(ids) <= block and mask[0] == START_BIT
        text = ct.tok.decode(ids.tolist())
        assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")  # each piece keeps it
        assert text.endswith("Paris is the capital.<|im_end|>\n")  # no question without its answer
        answers += _spans(ids, mask, ct.tok)
    assert answers == [f"Answer {i}: Paris is the capital.<|im_end|>" for i in range(6)]
    # only the last reply learned: the pieces without it learn nothing and are dropped, counted
    counts = new_counts()
    seqs = conversation_sequences(ct, conv, _settings(block_size=block, learn="last"), counts)
    assert len(seqs) == 1 and counts["no_learned"] >= 1
    # an exchange longer than the window alone is dropped, counted
    counts = new_counts()
    long = Conversation(turns[:3] + [{"role": "user", "content": "Why? " * 80}, {"role": "assistant", "content": "No."}])
    block = len(_reference(ct, Conversation(turns[:3]))) + 4
    seqs = conversation_sequences(ct, long, _settings(block_size=block), counts)
    assert counts["exchanges_dropped"] == 1 and len(seqs) == 1


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GOOD = [{"messages": TALK},
        {"conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "How can I help you today?"}]},
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hello.", "output": "Hello."}]


def test_prepare_cli_formats_and_loader_targets(model_dir, tmp_path, capsys):
    folder = model_dir("qwen2_5")
    src = _write_jsonl(tmp_path / "chat.jsonl", GOOD * 12)
    out = tmp_path / "data"
    assert main(["prepare", str(src), "--out", str(out), "--format", "chat", "--tokenizer-from", str(folder),
                 "--workers", "1", "--no-progress", "--val-fraction", "0.2", "--shard-tokens", "1024"]) == 0
    printed = capsys.readouterr().out
    assert "chat: 48 conversation(s) -> 48 sequence(s)" in printed and "end of turn '<|im_end|>'" in printed
    meta = json.loads((out / "meta.json").read_text())
    assert meta["chat"]["learn"] == "assistant" and meta["tokenizer"]["eot_id"] is None
    assert (out / "chat_template.jinja").read_text() == (TEMPLATES / "qwen2_5.jinja").read_text()
    ct = ChatTemplate(folder)
    ref = [ct.encode(Conversation(m), "assistant") for m in
           [TALK, [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "How can I help you today?"}],
            [{"role": "user", "content": "Add the numbers.\n\n2 and 3"}, {"role": "assistant", "content": "5"}],
            [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello."}]]]
    tf, vf = open_token_data(out, "train"), open_token_data(out, "val")
    ids = np.concatenate([np.asarray(tf.tokens), np.asarray(vf.tokens)])
    masks = np.concatenate([np.asarray(tf.masks), np.asarray(vf.masks)])
    assert sorted(ids.tolist()) == sorted(np.concatenate([i for i, _ in ref * 12]).tolist())
    assert (masks & LEARN_BIT).sum() == 12 * sum(int((m & LEARN_BIT).sum()) for _, m in ref)
    assert (masks & START_BIT).astype(bool).sum() == 48
    starts = np.flatnonzero(masks & START_BIT).tolist() + [len(ids)]
    stored = [(ids[x:y].tolist(), masks[x:y].tolist()) for x, y in zip(starts, starts[1:])]
    assert all(seq in [(i.tolist(), m.tolist()) for i, m in ref] for seq in stored)  # each sequence whole, exact
    assert len(tf.mask_shards) >= 2 and (out / "train.mask-00001.bin").is_file()  # one mask shard per token shard
    ds = WindowDataset(tf, 32, "sequential", ids=torch.uint16, loss_mask=True)
    start = int(np.argmax(np.asarray(tf.masks) & LEARN_BIT)) - 10  # a window holding the start of a reply
    x, y = ds.window(start)
    m = np.asarray(tf.masks[start + 1:start + 33])
    assert y.dtype == torch.int32 and x.dtype == torch.uint16
    assert (y[torch.from_numpy((m & 1) == 0)] == IGNORE_INDEX).all()
    learned = torch.from_numpy((m & 1) == 1)
    assert learned.any()
    assert torch.equal(y[learned].long(), torch.from_numpy(np.asarray(tf.tokens[start + 1:start + 33]).astype(np.int64))[learned])
    loss = torch.nn.functional.cross_entropy(torch.zeros(32, tf.vocab_size), y.long())
    assert torch.isfinite(loss)


def test_bad_records_are_counted_and_lose_nothing(model_dir, tmp_path, capsys):
    bad = [{"messages": [{"role": "user", "content": "no answer"}]},
           {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "  "}]},
           {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                         {"role": "assistant", "content": "c"}]}]
    src = _write_jsonl(tmp_path / "chat.jsonl", [GOOD[1], *bad, GOOD[2]])
    out = prepare_chat(src, tmp_path / "data", ChatTemplate(model_dir("mistral")), workers=1, progress=False,
                       val_fraction=0.0)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"tokenmill: warning: '{src}' record 2: has no assistant turn (nothing to learn); skipped",
        f"tokenmill: warning: '{src}' record 3: message 2 (assistant) has empty content; skipped",
        f"tokenmill: warning: '{src}' record 4: the chat template refused it: After the optional system message, "
        "conversation roles must alternate user/assistant/user/assistant/...; skipped"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["prepare"]["bad_records"] == 3 and meta["chat"]["counts"]["conversations"] == 2
    with pytest.raises(DataError, match=r"record 2: has no assistant turn \(nothing to learn\)\. Fix: .*--on-bad-record"):
        prepare_chat(src, tmp_path / "stop", ChatTemplate(model_dir("mistral")), workers=1, progress=False,
                     on_bad_record="stop")
    assert not (tmp_path / "stop").exists()


def test_template_problems_are_one_clear_line(model_dir, tmp_path):
    bare = _build("smollm2", tmp_path / "bare", None)
    with pytest.raises(DataError, match=r"has no chat template .* Fix: pass --chat-template FILE"):
        ChatTemplate(bare)
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(DataError, match="puts no special token right after an assistant reply"):
        ChatTemplate(bare, plain)
    ct = ChatTemplate(bare, TEMPLATES / "smollm2.jinja")  # --chat-template FILE gives the folder one
    assert ct.eot == "<|im_end|>"
    src = _write_jsonl(tmp_path / "x.jsonl", [{"text": "not a conversation"}])
    with pytest.raises(DataError, match=r"record 1 has none of the fields 'messages', 'conversations'.*Fix: "):
        prepare_chat(src, tmp_path / "out", ct, workers=1, progress=False)


@pytest.mark.slow
def test_prepare_chat_parquet_with_workers(model_dir, tmp_path):
    """Parquet rows (messages as a list of structs), two tokenizer processes: the same folder as one."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
            for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet", row_group_size=7)
    ct = ChatTemplate(model_dir("llama3"))
    one = prepare_chat(tmp_path / "chat.parquet", tmp_path / "one", ct, workers=1, progress=False)
    two = prepare_chat(tmp_path / "chat.parquet", tmp_path / "two", ct, workers=2, progress=False)
    for name in ("train.bin", "train.mask.bin", "val.bin", "val.mask.bin"):
        assert (one / name).read_bytes() == (two / name).read_bytes()
    meta = json.loads((one / "meta.json").read_text())
    assert meta["chat"]["counts"]["conversations"] == 40


def test_a_reply_ended_by_another_token_never_overruns(model_dir, tmp_path):
    """A template that ends tool-call replies with another token than its end-of-turn one: the mask would run into
    the tool result, so the conversation is refused with the reason."""
    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}{% if m.tool_calls %}"
                   "{{ 'call ' + m.tool_calls[0].function.name + '<|endoftext|>\\n' }}{% else %}"
                   "{{ m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    ct = ChatTemplate(model_dir("smollm2"), tpl)
    conv = Conversation([{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "w"}}]},
                         {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}])
    with pytest.raises(BadRecordError, match=r"message 2 \(assistant\): the template ends this reply without '<\|im_end\|>'"):
        ct.encode(conv, "assistant")


def test_cli_options_go_together(model_dir, tmp_path, capsys):
    src = _write_jsonl(tmp_path / "c.jsonl", GOOD)
    assert main(["prepare", str(src), "--out", str(tmp_path / "a"), "--format", "chat", "--tokenizer", "bpe"]) == 1
    assert "pass --tokenizer-from HF_MODEL_FOLDER" in capsys.readouterr().err
    assert main(["prepare", str(src), "--out", str(tmp_path / "b"), "--block-size", "64"]) == 1
    assert "--chat-template and --block-size go with --format chat" in capsys.readouterr().err
    assert main(["prepare", str(src), "--out", str(tmp_path / "c"), "--format", "chat", "--no-progress", "--workers",
                 "1", "--tokenizer-from", str(model_dir("llama3")), "--block-size", "40", "--chat-overflow", "drop",
                 "--chat-learn", "last", "--val-fraction", "0"]) == 0
    out = capsys.readouterr().out
    assert "window 40 tokens (drop): 1 too long dropped" in out and "(last; end of turn '<|eot_id|>')" in out


def test_replacing_a_folder_file_by_file_keeps_masks_and_template(model_dir, tmp_path, monkeypatch):
    """With the working directory inside --out the folder is replaced file by file: the mask shards and the
    template are moved in too, and a text prepare over it later leaves no stale mask behind."""
    src = _write_jsonl(tmp_path / "c.jsonl", GOOD * 4)
    out = tmp_path / "data"
    ct = ChatTemplate(model_dir("smollm2"))
    prepare_chat(src, out, ct, workers=1, progress=False)
    monkeypatch.chdir(out)
    prepare_chat(src, out, ct, learn="last", workers=1, progress=False)
    tf = open_token_data(out, "train")
    assert json.loads((out / "meta.json").read_text())["chat"]["learn"] == "last"
    assert (out / "chat_template.jinja").is_file() and len(np.asarray(tf.masks)) == len(tf)
    text = tmp_path / "t.txt"
    text.write_text("plain text " * 50)
    assert main(["prepare", str(text), "--out", str(out), "--tokenizer", "bytes", "--no-progress"]) == 0
    assert not list(out.glob("*.mask*.bin")) and not (out / "chat_template.jinja").exists()
