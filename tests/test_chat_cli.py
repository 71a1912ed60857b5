"""``tokenmill chat`` and the chat template in ``tokenmill export``.

A tiny random ``LlamaForCausalLM`` (built with transformers) with the small Llama 3 tokenizer and template of
tests/test_chat_prepare.py is the model; ``transformers``' own ``apply_chat_template`` + greedy ``generate`` is the
reference for every reply (the text, exactly). The CLI runs in this process (``tokenmill.cli.main``) with stdin
replaced: not a terminal, so each line is one user turn and stdout holds only the replies."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

from test_chat_prepare import TEMPLATES, _build  # noqa: E402
from tokenmill.cli import main  # noqa: E402
from tokenmill.data.chat import START_BIT  # noqa: E402
from tokenmill.data.dataset import open_token_data  # noqa: E402

EOT = "<|eot_id|>"
CHATS = [[{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "Paris is the capital."}],
         [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "How can I help you today?"},
          {"role": "user", "content": "Add the numbers."}, {"role": "assistant", "content": "5"}],
         [{"role": "user", "content": "def add(a, b): return a + b"}, {"role": "assistant", "content": "It adds."}]]


def _llama(folder: Path, family: str = "llama3", seed: int = 0, max_positions: int = 128) -> Path:
    _build(family, folder, (TEMPLATES / f"{family}.jinja").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("chat")
    folder = _llama(d / "llama")
    return {"dir": d, "folder": folder, "tok": transformers.AutoTokenizer.from_pretrained(folder),
            "model": transformers.LlamaForCausalLM.from_pretrained(folder).eval()}


def reference(model, tok, messages: list[dict], max_new: int = 8) -> str:
    """transformers' greedy reply to ``messages`` (the template's generation prompt), stopping at end of turn."""
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    eot = tok.convert_tokens_to_ids(EOT)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=[eot],
                             pad_token_id=eot)
    return tok.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)


class Recorder(io.StringIO):
    """stdout that counts its writes (the reply is streamed: written as it grows, not once)."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, s):
        self.writes.append(s)
        return super().write(s)


def chat(monkeypatch, capsys, argv: list[str], lines: list[str]) -> tuple[int, str, str, Recorder]:
    out = Recorder()
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{ln}\n" for ln in lines)))
    monkeypatch.setattr(sys, "stdout", out)
    code = main(["chat", *map(str, argv), "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"])
    monkeypatch.undo()
    return code, out.getvalue(), capsys.readouterr().err, out


def test_greedy_replies_equal_transformers_streamed(world, monkeypatch, capsys):
    m, tok = world["model"], world["tok"]
    code, out, err, rec = chat(monkeypatch, capsys, [world["folder"]], ["Hello there", "What is the capital?"])
    assert code == 0, err
    u1, u2 = ({"role": "user", "content": c} for c in ("Hello there", "What is the capital?"))
    r1 = reference(m, tok, [u1])
    r2 = reference(m, tok, [u1, {"role": "assistant", "content": r1}, u2])
    assert out == f"{r1}\n{r2}\n" and r1 and r2
    assert len(rec.writes) >= 6  # streamed: pieces as the text grows, then each reply's newline
    assert err.count("(reply cut at --max-new-tokens)") == 2 and "Traceback" not in err


def test_reset_and_system_change_the_rendered_prompt(world, monkeypatch, capsys):
    m, tok = world["model"], world["tok"]
    lines = ["Hi", "/system You are terse.", "Hi", "/reset", "Hi", "/system", "Hi"]
    code, out, err, _ = chat(monkeypatch, capsys, [world["folder"]], lines)
    assert code == 0, err
    hi, sys_msg = {"role": "user", "content": "Hi"}, {"role": "system", "content": "You are terse."}
    r1 = reference(m, tok, [hi])
    r2 = reference(m, tok, [sys_msg, hi, {"role": "assistant", "content": r1}, hi])  # history kept, system added
    r3 = reference(m, tok, [sys_msg, hi])  # /reset: the conversation forgotten, the system prompt kept
    r4 = reference(m, tok, [hi, {"role": "assistant", "content": r3}, hi])  # /system alone: removed
    assert out == f"{r1}\n{r2}\n{r3}\n{r4}\n"
    assert "(system prompt set)" in err and "(conversation reset, the system prompt kept)" in err


def test_reply_stops_at_the_end_of_turn_token(world, monkeypatch, capsys):
    """The head row of <|eot_id|> made a scaled copy of a token the model greedily says at step 3: the reply ends
    there, without the token, as transformers' generate with eos = <|eot_id|> ends it."""
    tok, folder = world["tok"], world["dir"] / "stops"
    shutil.copytree(world["folder"], folder)
    model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    hi = [{"role": "user", "content": "Hi"}]
    ids = tok.apply_chat_template(hi, add_generation_prompt=True, tokenize=True, return_dict=False)
    said = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)[0, len(ids):].tolist()
    eot = tok.convert_tokens_to_ids(EOT)
    with torch.no_grad():
        model.lm_head.weight[eot] = 1.5 * model.lm_head.weight[said[3]]
    model.save_pretrained(folder)
    ends = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=[eot],
                          pad_token_id=eot)[0, len(ids):].tolist()
    assert eot in ends and len(ends) < 8  # the reference stops at end of turn
    code, out, err, _ = chat(monkeypatch, capsys, [folder], ["Hi"])
    assert code == 0 and out == reference(model, tok, hi) + "\n" and "reply cut" not in err


def test_folder_without_template_unsupported_family_and_missing_paths(world, monkeypatch, capsys):
    bare = world["dir"] / "bare"
    shutil.copytree(world["folder"], bare, ignore=shutil.ignore_patterns("chat_template.jinja"))
    code, out, err, _ = chat(monkeypatch, capsys, [bare], ["Hi"])
    assert code == 1 and out == "" and err.count("\n") == 1 and "has no chat template" in err
    assert "--chat-template FILE" in err and "Traceback" not in err
    code, out, err, _ = chat(monkeypatch, capsys, [bare, "--chat-template", TEMPLATES / "llama3.jinja"], ["Hi"])
    assert code == 0 and out == reference(world["model"], world["tok"], [{"role": "user", "content": "Hi"}]) + "\n"
    bert = world["dir"] / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    code, _, err, _ = chat(monkeypatch, capsys, [bert], ["Hi"])
    assert code == 1 and err.count("\n") == 1 and "BertForMaskedLM" in err and "LlamaForCausalLM" in err
    run = world["dir"] / "run-empty"
    (run / "checkpoints").mkdir(parents=True)
    code, _, err, _ = chat(monkeypatch, capsys, [run], ["Hi"])
    assert code == 1 and err.count("\n") == 1 and "no checkpoint" in err and "tokenmill train" in err
    code, _, err, _ = chat(monkeypatch, capsys, [world["dir"] / "lama"], ["Hi"])
    assert code == 1 and "does not exist" in err and "Did you mean" in err and str(world["folder"]) in err
    code, _, err, _ = chat(monkeypatch, capsys, [world["dir"]], ["Hi"])
    assert code == 1 and "neither a tokenmill run directory" in err
    # --run-dir, as train names a run's folder, is the same path; none or two different ones: one line
    code, out, err, _ = chat(monkeypatch, capsys, ["--run-dir", world["folder"]], ["Hi"])
    assert code == 0 and out == reference(world["model"], world["tok"], [{"role": "user", "content": "Hi"}]) + "\n"
    code, _, err, _ = chat(monkeypatch, capsys, [], ["Hi"])  # a usage error: exit 2, as argparse's
    assert code == 2 and err.count("\n") == 1 and "give one run directory or model folder" in err
    code, _, err, _ = chat(monkeypatch, capsys, [world["folder"], "--run-dir", bare], ["Hi"])
    assert code == 2 and "got " in err


def _sequences(data: Path) -> list[list[int]]:
    out = []
    for split in ("train", "val"):
        tf = open_token_data(data, split)
        ids, masks = np.asarray(tf.tokens), np.asarray(tf.masks)
        starts = np.flatnonzero(masks & START_BIT).tolist() + [len(ids)]
        out += [ids[a:b].tolist() for a, b in zip(starts, starts[1:])]
    return out


def test_export_writes_the_template_and_chat_runs_on_the_run(world, tmp_path, monkeypatch, capsys):
    """prepare --format chat, a run started from the folder (step 0: its weights), export: the exported tokenizer
    renders each conversation to the very ids the run's data holds, a transformers pipeline chats with the export,
    and tokenmill chat on the run replies as transformers does on the export."""
    src, data, run, out = tmp_path / "chats.jsonl", tmp_path / "data", tmp_path / "run", tmp_path / "hf"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS * 4))
    assert main(["prepare", str(src), "--out", str(data), "--format", "chat", "--tokenizer-from", str(world["folder"]),
                 "--workers", "1", "--no-progress", "--val-fraction", "0.25"]) == 0
    assert main(["train", "--run-dir", str(run), "--train.init_from", str(world["folder"]), "--data.path", str(data),
                 "--train.device", "cpu", "--train.max_steps", "0", "--log.progress", "plain",
                 "--log.tensorboard", "false", "--model.block_size", "64"]) == 0
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0
    assert f"chat template from {run / 'tokenizer' / 'chat_template.jinja'}" in capsys.readouterr().out  # the run's copy
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (out / "chat_template.jinja").read_text() == (TEMPLATES / "llama3.jinja").read_text()
    assert tok.bos_token == "<|begin_of_text|>" and tok.eos_token == EOT
    rendered = [tok.apply_chat_template(c, tokenize=True, return_dict=False) for c in CHATS]
    assert sorted(_sequences(data)) == sorted(rendered * 4)  # exactly the ids the run trained on
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids(EOT)]
    pipe = transformers.pipeline("text-generation", model=str(out), device="cpu")
    said = pipe([{"role": "user", "content": "Hello!"}], max_new_tokens=3, do_sample=False)
    assert said[0]["generated_text"][-1]["role"] == "assistant"
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    code, text, err, _ = chat(monkeypatch, capsys, [run], ["Hello there", "Paris?"])
    u1, u2 = {"role": "user", "content": "Hello there"}, {"role": "user", "content": "Paris?"}
    r1 = reference(model, tok, [u1])
    assert code == 0 and text == f"{r1}\n{reference(model, tok, [u1, {'role': 'assistant', 'content': r1}, u2])}\n"
    # another template than the run's data: refused; the data's template gone everywhere: said, with the fix
    code, _, err, _ = chat(monkeypatch, capsys, [run, "--chat-template", TEMPLATES / "llama3_2.jinja"], ["Hi"])
    assert code == 1 and err.count("\n") == 1 and "is not the template" in err and "drop --chat-template" in err
    (data / "chat_template.jinja").write_text("{{ 'changed' }}")
    (run / "tokenizer" / "chat_template.jinja").unlink(missing_ok=True)  # were the run to keep a copy of its own
    (world["folder"] / "chat_template.jinja").rename(tmp_path / "moved.jinja")
    try:
        code, _, err, _ = chat(monkeypatch, capsys, [run], ["Hi"])
        assert code == 1 and err.count("\n") == 1 and "sha256" in err and "--chat-template FILE" in err
        assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "hf2")]) == 0
        assert "no chat template written" in capsys.readouterr().err
        code, text, err, _ = chat(monkeypatch, capsys, [run, "--chat-template", tmp_path / "moved.jinja"], ["Hello there"])
        assert code == 0 and text == f"{r1}\n"
    finally:
        (tmp_path / "moved.jinja").rename(world["folder"] / "chat_template.jinja")


def test_training_refuses_chat_data_of_another_tokenizer(world, tmp_path, capsys):
    """Chat data prepared with one model's tokenizer, fine-tuning another model: refused at the start, one line."""
    src, data = tmp_path / "chats.jsonl", tmp_path / "data"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    other = _llama(tmp_path / "qwen", "qwen2_5")
    assert main(["prepare", str(src), "--out", str(data), "--format", "chat", "--tokenizer-from", str(world["folder"]),
                 "--workers", "1", "--no-progress", "--val-fraction", "0"]) == 0
    capsys.readouterr()
    assert main(["train", "--run-dir", str(tmp_path / "run"), "--train.init_from", str(other), "--data.path",
                 str(data), "--train.device", "cpu", "--train.max_steps", "0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tokenizer" in err and f"--tokenizer-from {other}" in err


class Interrupting(Recorder):
    """stdout that sends this process a SIGINT (a Ctrl-C) at the first piece of each reply."""

    def write(self, s):
        if s and s != "\n" and (not self.writes or self.writes[-1].endswith("\n")):
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(s)


def test_ctrl_c_stops_the_reply_each_time_and_at_the_prompt_ends(world, monkeypatch, capsys):
    m, tok, before = world["model"], world["tok"], signal.getsignal(signal.SIGINT)
    out = Interrupting()
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\nHello there\n"))
    monkeypatch.setattr(sys, "stdout", out)
    code = main(["chat", str(world["folder"]), "--temperature", "0", "--max-new-tokens", "8", "--device", "cpu"])
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 0 and err.count("(reply stopped)") == 2 and "interrupted" not in err  # the second one too
    first, second = out.getvalue().split("\n")[:2]
    u = {"role": "user", "content": "Hello there"}
    full = reference(m, tok, [u])
    assert first and full.startswith(first) and len(first) < len(full)  # cut after its first piece
    assert reference(m, tok, [u, {"role": "assistant", "content": first}, u]).startswith(second) and second

    class Stdin(io.StringIO):  # a Ctrl-C while the program waits for the second line
        def readline(self, *a):
            if self.tell():
                os.kill(os.getpid(), signal.SIGINT)
            return super().readline(*a)

    monkeypatch.setattr(sys, "stdin", Stdin("Hello there\nunread\n"))
    code = main(["chat", str(world["folder"]), "--temperature", "0", "--max-new-tokens", "4", "--device", "cpu"])
    monkeypatch.undo()
    captured = capsys.readouterr()
    assert code == 130 and captured.err.endswith("tokenmill: interrupted\n") and captured.out.count("\n") == 1
    assert signal.getsignal(signal.SIGINT) is before  # the test process's own handler is back


@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 20, "top_p": 0.9}],
                         ids=["greedy", "sampled"])
def test_streamed_ids_are_generates_and_end_at_a_full_context(kw):
    """stream_tokens yields GPT.generate's ids one by one (same cache, same draws for the same generator) and
    stops once the sequence fills block_size (24: 5 prompt ids + 20 new at most)."""
    from test_sample import build, prompt
    from tokenmill.train.sample import stream_tokens

    m = build(vocab_pad_multiple=16, dropout=0.1)
    p = prompt(B=1)
    want = m.generate(p, 12, generator=torch.Generator().manual_seed(3), **kw)[0, 5:].tolist()
    got = list(stream_tokens(m, p[0].tolist(), 12, generator=torch.Generator().manual_seed(3), **kw))
    assert got == want and m.training  # the mode is restored
    full = list(stream_tokens(m, p[0].tolist(), 100, generator=torch.Generator().manual_seed(3), **kw))
    assert len(full) == 20 and full[:12] == want


def test_export_of_a_text_run_keeps_its_init_from_folders_template(world, tmp_path, capsys):
    """A run on plain text tokenized with the folder's tokenizer, started from a folder with a chat template: the
    export carries that template and its special tokens, rendering as the folder does."""
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 60)
    data, run, out = tmp_path / "text", tmp_path / "run", tmp_path / "hf"
    assert main(["prepare", str(tmp_path / "text.txt"), "--out", str(data), "--tokenizer-from", str(world["folder"]),
                 "--workers", "1", "--no-progress"]) == 0
    assert main(["train", "--run-dir", str(run), "--train.init_from", str(world["folder"]), "--data.path", str(data),
                 "--train.device", "cpu", "--train.max_steps", "0", "--log.progress", "plain",
                 "--log.tensorboard", "false", "--model.block_size", "32"]) == 0
    assert main(["export", "--run-dir", str(run), "--out", str(out)]) == 0
    assert f"chat template from {world['folder']}" in capsys.readouterr().out
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token) == (world["tok"].bos_token, world["tok"].eos_token)
    for c in CHATS:
        assert tok.apply_chat_template(c, tokenize=True, return_dict=False) == \
            world["tok"].apply_chat_template(c, tokenize=True, return_dict=False)


def test_a_conversation_beyond_the_context_leaves_out_its_oldest_exchange(world, monkeypatch, capsys):
    """--context 40: the second turn's whole conversation does not fit, so it is asked alone; a message longer than
    the context alone gets no reply (an empty line keeps the replies one per input line), is not kept, and the chat
    goes on."""
    m, tok = world["model"], world["tok"]
    u1, u2 = {"role": "user", "content": "Hello there"}, {"role": "user", "content": "What is the capital?"}
    r1 = reference(m, tok, [u1])
    whole = tok.apply_chat_template([u1, {"role": "assistant", "content": r1}, u2], add_generation_prompt=True,
                                    tokenize=True, return_dict=False)
    assert len(whole) >= 40 > len(tok.apply_chat_template([u2], add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)) + 8
    code, out, err, _ = chat(monkeypatch, capsys, [world["folder"], "--context", "40"],
                             ["Hello there", "What is the capital?", "fox " * 40, "Hello there"])
    r2 = reference(m, tok, [u2])
    again = tok.apply_chat_template([u2, {"role": "assistant", "content": r2}, u1], add_generation_prompt=True,
                                    tokenize=True, return_dict=False)
    assert len(again) >= 40  # the last turn too is asked alone (the long message was never kept)
    assert code == 0 and out == f"{r1}\n{r2}\n\n{r1}\n"
    assert err.count("the oldest 1 exchange(s) left out of the prompt") == 2 and "beyond the context of 40" in err
