"""``tokenmill chat PATH``: talk to a run's model or a Hugging Face folder through its chat template.

- **The model**: a run directory's newest good checkpoint (:func:`tokenmill.train.sample.load_run`, LoRA merged),
  or a Hugging Face folder of a family ``train.init_from`` reads (:func:`tokenmill.train.init_from.find_source`,
  :func:`tokenmill.model.hf.load_hf`; its context capped by ``--context``, default 4096, so the KV cache stays
  small).
- **The template**: a run's is the one its chat data was prepared with (found by its sha256, as ``tokenmill
  export`` finds it: :func:`tokenmill.checkpoint.export.find_chat_files`), with the run's own tokenizer; a
  folder's is its own; ``--chat-template FILE`` gives one where there is none (for a run trained on chat data it
  must be that data's template). Conversations are rendered by transformers' ``apply_chat_template`` with the
  generation prompt (:class:`tokenmill.data.chat.ChatTemplate`: the template, its tokenizer, its end-of-turn
  token), exactly as ``prepare --format chat`` rendered the training data.
- **A reply** is drawn with the KV cache (:func:`tokenmill.train.sample.stream_tokens`: ``generate``'s step),
  printed as its decoded text grows, and ends at the template's end-of-turn token (or the tokenizer's eos),
  at ``--max-new-tokens`` or when the context is full. The oldest exchanges are left out of the prompt when
  the conversation outgrows the context (said on stderr).
- **Input**: a terminal gets a prompt; otherwise stdin is read line by line, one user turn per line, and only
  the replies go to stdout (one per turn, each ended by a newline). ``/reset`` forgets the conversation (the
  system prompt stays), ``/system TEXT`` sets the system prompt (``/system`` alone removes it), ``/quit`` ends.
- **Signals** (:mod:`tokenmill.signals`): Ctrl-C during a reply stops that reply (what was said stays in the
  conversation) and the handling is installed afresh, so the next Ctrl-C is a first one again; a second Ctrl-C
  before the first is answered, a Ctrl-C at the prompt (exit 130), EOF or ``/quit`` (exit 0) end the program.
"""

from __future__ import annotations

import difflib
import hashlib
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, TextIO

import torch

from tokenmill import signals
from tokenmill.errors import DataError, SampleError
from tokenmill.model import GPT

__all__ = ["ChatModel", "ChatOptions", "chat_loop", "load_chat_model"]

DEFAULT_CONTEXT = 4096  # a Hugging Face folder's context for chat, at most (its KV cache is allocated whole)
GRACE_S = 2.0  # a Ctrl-C during a reply is taken at the next token; one token taking longer raises it there


@dataclass
class ChatModel:
    """A model to chat with: the GPT (on ``device``), its chat template with tokenizer (``template``: a
    :class:`tokenmill.data.chat.ChatTemplate`), the ids that end a reply, and a name for messages."""

    model: GPT
    template: object
    stop_ids: set
    device: torch.device
    name: str


@dataclass
class ChatOptions:
    temperature: float = 0.7
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    max_new_tokens: int = 512
    seed: int = 0


@dataclass
class _State:
    system: Optional[str] = None
    turns: list = field(default_factory=list)  # user and assistant messages, oldest first


# ----------------------------------------------------------------------------------------------
# Loading


def load_chat_model(path: str | Path, chat_template: str | Path | None = None, checkpoint: str | Path | None = None,
                    device: torch.device | str = "cpu", context: Optional[int] = None) -> ChatModel:
    """The model and template of a run directory or a Hugging Face folder (see the module doc)."""
    from tokenmill.model import hf

    p = Path(path).expanduser()
    if not p.exists():
        names = [q.name for q in p.parent.iterdir() if q.is_dir()] if p.parent.is_dir() else []
        close = difflib.get_close_matches(p.name, names, n=1, cutoff=0.6)
        raise SampleError(f"'{p}' does not exist.{f' Did you mean {p.parent / close[0]}?' if close else ''} Pass a "
                          "run directory or a Hugging Face model folder.")
    if (p / hf.CONFIG_NAME).is_file():  # a Hugging Face folder: its family is checked (one line if unsupported)
        model, template = _load_folder(p, chat_template, context)
    elif p.is_dir() and not (p / "checkpoints").exists() and not (p / "config.toml").is_file():
        raise SampleError(f"'{p}' is neither a tokenmill run directory (no checkpoints/) nor a Hugging Face model "
                          "folder (no config.json). Pass a run directory or a model folder.")
    else:
        model, template = _load_run(p, chat_template, checkpoint, context)
    tok = template.tok
    stop = {tok.convert_tokens_to_ids(template.eot)}
    if tok.eos_token_id is not None:
        stop.add(tok.eos_token_id)
    return ChatModel(model.to(device), template, stop, torch.device(device), str(p))


def _load_folder(p: Path, chat_template, context: Optional[int]):
    from tokenmill.data.chat import ChatTemplate
    from tokenmill.model import hf
    from tokenmill.train.init_from import find_source

    src = find_source(p)  # the same checks as train.init_from
    bs = min(src.fields["block_size"], context or DEFAULT_CONTEXT)
    template = ChatTemplate(p, chat_template)
    mcfg, sd = hf.load_hf(p, block_size=bs)
    model = GPT(mcfg, mcfg.vocab_size)
    model.load_state_dict(sd)
    return model, template


def _load_run(p: Path, chat_template, checkpoint, context: Optional[int]):
    from tokenmill.train.sample import load_run

    model, cfg, tok_dir = load_run(p, "cpu", checkpoint)
    template = _run_template(p, cfg, tok_dir, chat_template)
    if context is not None and context < model.cfg.block_size:
        model.cfg.block_size = context  # the KV cache's capacity; positions stay those the model trained with
    return model, template


def _run_template(run_dir: Path, cfg, tok_dir: Path, chat_template):
    """The run's chat template with its own tokenizer, as ``tokenmill export`` writes them (built in a temporary
    folder and loaded from there)."""
    from tokenmill.checkpoint.export import ChatFiles, find_chat_files, write_chat_files
    from tokenmill.data.chat import ChatTemplate
    from tokenmill.data.tokenizers import write_hf_tokenizer_for_data

    chat = find_chat_files(tok_dir, cfg)
    if chat_template is not None:
        path = Path(chat_template).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise SampleError(f"--chat-template '{path}' cannot be read ({e}). Fix: pass a UTF-8 Jinja file.") from None
        if chat.trained_sha256 and hashlib.sha256(text.encode("utf-8")).hexdigest() != chat.trained_sha256:
            raise SampleError(
                f"--chat-template '{path}' is not the template {run_dir} was trained with (its data was prepared "
                f"with the template of sha256 {chat.trained_sha256[:12]}...): the model learned that one's format. "
                "Fix: drop --chat-template to use the run's own, or pass that very file.")
        chat = ChatFiles(text, str(path), chat.specials, chat.end_of_turn, chat.trained_sha256)
    elif chat.template is None:
        why = chat.missing or "its data is not chat data and its train.init_from has no chat template"
        raise SampleError(f"{run_dir} has no chat template: {why}. Fix: pass --chat-template FILE, a Jinja chat "
                          "template for this model (for a run trained on chat data, the one its data was prepared with).")
    tmp = Path(tempfile.mkdtemp(prefix="tokenmill-chat-"))
    try:
        _, skipped = write_hf_tokenizer_for_data(tok_dir, tmp)  # no length limit: the context is checked here
        if skipped:
            raise SampleError(f"{run_dir}: its tokenizer cannot be used by transformers' chat template ({skipped}).")
        write_chat_files(tmp, chat)
        return ChatTemplate(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# The conversation


def _messages(st: _State) -> list[dict]:
    return ([{"role": "system", "content": st.system}] if st.system else []) + st.turns


def prompt_ids(cm: ChatModel, messages: list[dict]) -> list[int]:
    """The ids of ``messages`` rendered with the generation prompt: ``apply_chat_template(messages,
    add_generation_prompt=True, tokenize=True)`` with the model's template."""
    ct = cm.template
    try:
        return list(ct.tok.apply_chat_template(messages, chat_template=ct.template, tokenize=True,
                                               add_generation_prompt=True, return_dict=False))
    except Exception as e:  # the template's raise_exception (jinja2's TemplateError) or a template bug
        raise DataError(f"the chat template refused the conversation: {str(e).strip()[:300]}") from None


def _fit(cm: ChatModel, st: _State, err: TextIO) -> Optional[list[int]]:
    """The prompt of the conversation, its oldest exchanges left out (and forgotten, said on ``err``) until it
    leaves room for a reply in the context; None, with the last message dropped and the rest kept, when that
    message alone does not fit."""
    bs = cm.model.cfg.block_size
    ids = prompt_ids(cm, _messages(st))
    if len(ids) < bs:
        return ids
    alone = prompt_ids(cm, _messages(_State(st.system, st.turns[-1:])))
    if len(alone) >= bs:
        st.turns.pop()
        print(f"tokenmill: that message makes a prompt of {len(alone)} tokens, beyond the context of {bs}; nothing "
              "generated. Send a shorter one.", file=err, flush=True)
        return None
    dropped = 0
    while len(ids) >= bs:
        users = [i for i, m in enumerate(st.turns) if m["role"] == "user"]
        del st.turns[: users[1]]
        dropped += 1
        ids = prompt_ids(cm, _messages(st))
    print(f"tokenmill: note: the oldest {dropped} exchange(s) left out of the prompt to fit the context of {bs} "
          "tokens", file=err, flush=True)
    return ids


def _reply(cm: ChatModel, ids: list[int], opts: ChatOptions, gen: torch.Generator, out: TextIO) -> tuple[str, str]:
    """Draw and print one reply; ``(text, how it ended)``: 'end' (end of turn), 'length', 'context', 'stopped'
    (Ctrl-C)."""
    from tokenmill.train.sample import stream_tokens

    tok, new, printed, ended = cm.template.tok, [], "", "length"
    steps = stream_tokens(cm.model, ids, opts.max_new_tokens, opts.temperature, opts.top_k, opts.top_p, gen, cm.device)
    try:
        with signals.graceful(GRACE_S):
            for t in steps:
                if t in cm.stop_ids:
                    ended = "end"
                    break
                new.append(t)
                text = tok.decode(new, skip_special_tokens=True)
                if not text.endswith("\ufffd") and len(text) > len(printed):  # a whole character more
                    out.write(text[len(printed):])
                    out.flush()
                    printed = text
                if (signum := signals.requested()) is not None:
                    if signals.take(signum) != signal.SIGINT:
                        raise signals.exception(signum)  # SIGTERM: the program ends
                    ended = "stopped"
                    break
            else:
                if len(ids) + len(new) >= cm.model.cfg.block_size and len(new) < opts.max_new_tokens:
                    ended = "context"
    except signals.Terminated:
        raise
    except KeyboardInterrupt:  # a token took longer than the grace time (or no handler is installed)
        ended = "stopped"
    finally:
        steps.close()
    if ended == "stopped" and signals.received() is not None:
        signals.finish(owned=False)  # the Ctrl-C was answered (the reply stopped): forget it, so the next
        signals.install()  # Ctrl-C during a reply is a first one again, and one at the prompt ends the program
    text = tok.decode(new, skip_special_tokens=True)
    out.write(text[len(printed):] + "\n")
    out.flush()
    return text, ended


_ENDED = {"length": "reply cut at --max-new-tokens", "context": "reply cut: the context is full",
          "stopped": "reply stopped"}


def _command(line: str, st: _State, err: TextIO) -> Optional[bool]:
    """A /command: True to go on, False to end; None: not a command (the line is a user turn)."""
    word, _, rest = line.partition(" ")
    if word == "/reset":
        st.turns.clear()
        print("tokenmill: (conversation reset" + (", the system prompt kept)" if st.system else ")"), file=err)
    elif word == "/system":
        st.system = rest.strip() or None
        print(f"tokenmill: (system prompt {'set' if st.system else 'removed'})", file=err)
    elif word in ("/quit", "/exit"):
        return False
    else:
        return None
    return True


def chat_loop(cm: ChatModel, opts: ChatOptions, stdin: TextIO | None = None, out: TextIO | None = None,
              err: TextIO | None = None) -> int:
    """Talk until EOF or ``/quit`` (0); see the module doc. A terminal gets a prompt; otherwise each line of
    ``stdin`` is one user turn."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    tty = stdin.isatty()
    if tty:
        print(f"chatting with {cm.name} (end of turn {cm.template.eot!r}). /system TEXT sets the system prompt, "
              "/reset forgets the conversation, Ctrl-C stops a reply, Ctrl-D ends.", file=err)
    st, gen = _State(), torch.Generator(device=cm.device).manual_seed(opts.seed)
    while True:
        line = _read(stdin, tty)
        if line is None:
            return 0
        line = line.rstrip("\r\n")
        if not line.strip():
            continue
        go = _command(line, st, err) if line.startswith("/") else None
        if go is not None:
            if not go:
                return 0
            continue
        st.turns.append({"role": "user", "content": line})
        try:
            ids = _fit(cm, st, err)
        except DataError as e:
            st.turns.pop()
            ids = None
            print(f"tokenmill: error: {e}", file=err, flush=True)
        if ids is None:  # no reply: an empty line keeps a script's replies one per line of input
            print(file=out, flush=True)
            continue
        text, ended = _reply(cm, ids, opts, gen, out)
        st.turns.append({"role": "assistant", "content": text})
        if ended in _ENDED:
            print(f"tokenmill: ({_ENDED[ended]})", file=err, flush=True)


def _read(stdin: TextIO, tty: bool) -> Optional[str]:
    """The next line; None at EOF."""
    if not tty:
        line = stdin.readline()
        return line or None
    try:
        return input("> ")
    except EOFError:
        print(file=sys.stderr)
        return None
