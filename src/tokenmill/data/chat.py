"""Chat data for supervised fine-tuning: ``tokenmill prepare FILES --format chat --tokenizer-from HFDIR``.

Each record (a JSON Lines object, a Parquet / Arrow row) is one conversation, in one of three shapes:
OpenAI ``messages`` (``role``: system / user / assistant / tool, ``content``, optionally ``tool_calls``,
``reasoning_content``; the record's ``tools`` go to the template), ShareGPT ``conversations``
(``from``: system / human / gpt / tool, ``value``) or Alpaca (``instruction``, ``input``, ``output``:
one user turn, the instruction and the input joined by a blank line, and one assistant reply).

A conversation is rendered with the model's own chat template by transformers'
``apply_chat_template`` (the ``[hf]`` extra): the same Jinja environment (``raise_exception``,
``strftime_now``, ``tojson``, ``{% generation %}``) and the same special-token variables, so the token
ids are the ones the model sees at inference, not an imitation of them. The ids are the one-shot
``apply_chat_template(conversation, tokenize=True)``.

The loss mask (exact, per token): for each assistant message ``k`` the conversation before it is
rendered with the generation prompt; that text must be the start of the whole rendering (else the
template renders earlier turns differently once later turns follow, and the conversation is refused
with that reason). The reply's tokens run from there to the end of the template's end-of-turn token
(the first special token after an assistant reply, found once by rendering a probe conversation:
``<|eot_id|>``, ``<|im_end|>``, ``</s>``), and each boundary must fall between two tokens of the one-shot
ids (checked by tokenizing the text up to it). ``learn``: 'assistant' (every reply), 'last' (the last
reply), 'all' (every token). The first token of every stored sequence is never learned (in a packed
window it would be predicted from the previous conversation).

Stored beside the token shards: one ``uint8`` mask shard per token shard (``train.mask.bin`` or
``train.mask-00000.bin`` ...), byte ``t`` for token ``t``: bit 0 (1) the token is learned (a target of the
loss), bit 1 (2) a sequence (a conversation or a piece of one) starts here. ``meta.json`` describes them
under ``"chat"`` (docs/data.md, Chat data). No end-of-text token is added between conversations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.errors import BadRecordError, DataError

LEARN = ("assistant", "last", "all")
OVERFLOW = ("drop", "split")
LEARN_BIT, START_BIT = 1, 2
MASK_FORMAT = "tokenmill-loss-mask"
TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "tool": "tool", "function_response": "tool", "observation": "tool"}
_PROBE = "PROBE-REPLY-7f3a"


BadConversation = BadRecordError  # a conversation that cannot be used: reported as a bad record, with the reason


def mask_split_name(split: str) -> str:
    """The SplitWriter name of a split's mask shards: files ``train.mask.bin`` / ``train.mask-00000.bin``."""
    return f"{split}.mask"


# ----------------------------------------------------------------------------------------------
# The template and the tokenizer


def _transformers():
    try:
        import transformers
    except ImportError:
        raise DataError(
            "--format chat renders conversations with the model's chat template through transformers. Fix: "
            "`pip install 'tokenmill[hf]'` (or `pip install transformers jinja2`)."
        ) from None
    return transformers


class ChatTemplate:
    """A model folder's tokenizer and chat template: renders, tokenizes and masks conversations."""

    def __init__(self, folder: str | Path, template_file: str | Path | None = None):
        self.folder = Path(folder).expanduser()
        self.tok = _load_tokenizer(self.folder)
        self.template = _template_text(self.tok, self.folder, template_file)
        self.template_from = str(template_file) if template_file is not None else str(self.folder)
        self.specials = sorted({t.content for t in self.tok.added_tokens_decoder.values() if t.special}, key=len,
                               reverse=True)
        self.eot = _find_end_of_turn(self)
        try:
            self.encode(Conversation([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                                      {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Ok."}]),
                        "assistant")
        except BadConversation as e:
            raise DataError(f"the chat template of '{self.template_from}' cannot be masked exactly: a plain "
                            f"user/assistant/user/assistant conversation fails: {e}. Fix: pass --chat-template FILE "
                            "with a template whose rendering of a conversation starts with the rendering of each "
                            "earlier part.") from None

    def render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        try:
            return self.tok.apply_chat_template(messages, tools=tools, chat_template=self.template, tokenize=False,
                                                add_generation_prompt=generation_prompt)
        except Exception as e:  # the template's raise_exception (jinja2's TemplateError) or a template bug
            raise BadConversation(f"the chat template refused it: {str(e).strip()[:300]}") from None

    def ids(self, messages: list[dict], tools) -> list[int]:
        """The one-shot ids: ``apply_chat_template(messages, tokenize=True)``."""
        try:
            return list(self.tok.apply_chat_template(messages, tools=tools, chat_template=self.template,
                                                     tokenize=True, return_dict=False))
        except Exception as e:
            raise BadConversation(f"the chat template refused it: {str(e).strip()[:300]}") from None

    def fingerprint(self) -> str:
        return hashlib.sha256(f"{self.tok.backend_tokenizer.to_str()}|{self.template}".encode()).hexdigest()

    def encode(self, conv: Conversation, learn: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)`` of one conversation (see the module doc); BadConversation with the reason."""
        msgs, tools = conv.messages, conv.tools
        text = self.render(msgs, tools, False)
        ids = self.ids(msgs, tools)
        spans = [] if learn == "all" else self._reply_spans(msgs, tools, text, learn)
        cuts = sorted({c for span in spans for c in span})
        parts = self.tok([text[:c] for c in cuts], add_special_tokens=False)["input_ids"] if cuts else []
        at = {}
        for c, part in zip(cuts, parts):
            if ids[: len(part)] != list(part):
                raise BadConversation(
                    f"a token merges across the edge of an assistant reply (at character {c} of the rendered "
                    f"conversation: {text[max(0, c - 20):c]!r} | {text[c:c + 20]!r}), so the reply has no exact "
                    "token boundary")
            at[c] = len(part)
        mask = np.full(len(ids), LEARN_BIT if learn == "all" else 0, dtype=np.uint8)
        for a, b in spans:
            mask[at[a]:at[b]] = LEARN_BIT
        if len(mask):
            mask[0] = START_BIT
        return np.asarray(ids, dtype=np.uint32), mask

    def _reply_spans(self, msgs: list[dict], tools, text: str, learn: str) -> list[tuple[int, int]]:
        """Character spans of the learned replies in ``text``: after the generation prompt, through the
        end-of-turn token."""
        turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
        spans = []
        for k in turns[-1:] if learn == "last" else turns:
            if k == 0:
                raise BadConversation("message 1 is an assistant reply with nothing before it")
            prefix = self.render(msgs[:k], tools, True)
            if not text.startswith(prefix):
                raise BadConversation(
                    f"message {k + 1} (assistant): the messages before it, rendered with the generation prompt, "
                    "are not the start of the whole rendered conversation (the template renders earlier turns "
                    "differently once later turns follow), so the reply cannot be located exactly")
            end = text.find(self.eot, len(prefix))
            if end < 0:
                raise BadConversation(f"message {k + 1} (assistant): no end-of-turn token {self.eot!r} follows it")
            end += len(self.eot)
            upto = self.render(msgs[: k + 1], tools, False) if k + 1 < len(msgs) else text
            if text.startswith(upto) and end > len(upto):  # the reply ended with another token: never overrun it
                raise BadConversation(f"message {k + 1} (assistant): the template ends this reply without "
                                      f"{self.eot!r} (its end-of-turn token elsewhere)")
            spans.append((len(prefix), end))
        return spans


def _load_tokenizer(folder: Path):
    transformers = _transformers()
    if not folder.is_dir():
        raise DataError(
            f"--tokenizer-from '{folder}': --format chat needs a Hugging Face model folder (tokenizer.json, "
            "tokenizer_config.json with its chat template). Fix: pass the folder of the model to fine-tune.")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True, use_fast=True)
    except Exception as e:
        raise DataError(f"--tokenizer-from '{folder}': its tokenizer cannot be loaded by transformers "
                        f"({str(e).strip()[:200]}). Fix: pass a Hugging Face model folder with tokenizer.json.") from None


def _template_text(tok, folder: Path, template_file) -> str:
    if template_file is not None:
        path = Path(template_file).expanduser()
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"--chat-template '{path}' cannot be read ({e}). Fix: pass a UTF-8 Jinja file.") from None
    tpl = tok.chat_template
    if isinstance(tpl, dict):
        tpl = tpl.get("default")
    if not isinstance(tpl, str) or not tpl.strip():
        raise DataError(
            f"'{folder}' has no chat template (no 'chat_template' in tokenizer_config.json and no "
            f"{TEMPLATE_FILE}). Fix: pass --chat-template FILE, a Jinja chat template for this model.")
    return tpl


def _find_end_of_turn(ct: ChatTemplate) -> str:
    """The special token the template puts right after an assistant reply (only blanks between)."""
    text, why = None, ""
    for probe in ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}],
                  [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": _PROBE}]):
        try:
            text = ct.render(probe, None, False)
            break
        except BadConversation as e:
            why = str(e)
    if text is None or _PROBE not in text:
        raise DataError(f"the chat template of '{ct.template_from}' cannot render a user/assistant conversation"
                        f"{': ' + why if why else ''}. Fix: pass --chat-template FILE.")
    tail = text[text.index(_PROBE) + len(_PROBE):]
    found = [(tail.find(s), s) for s in ct.specials if s in tail]
    if found:
        i, s = min(found)
        if not tail[:i].strip():
            return s
    raise DataError(
        f"the chat template of '{ct.template_from}' puts no special token right after an assistant reply "
        f"({tail[:40]!r} follows it), so the end of a reply cannot be learned. Fix: pass --chat-template FILE "
        "with a template that ends each reply with its end-of-turn token.")


# ----------------------------------------------------------------------------------------------
# Records -> conversations


@dataclass
class Conversation:
    messages: list[dict]
    tools: list | None = None


def to_conversation(obj) -> Conversation:
    """A record as a conversation (OpenAI ``messages``, ShareGPT ``conversations`` or Alpaca); BadConversation
    when it is none of them or is malformed."""
    if not isinstance(obj, dict):
        raise BadConversation(f"is {type(obj).__name__}, not an object")
    if "messages" in obj:
        msgs = _openai(obj["messages"])
        tools = obj.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise BadConversation(f"'tools' is {type(tools).__name__}, not a list")
        conv = Conversation(msgs, tools or None)
    elif "conversations" in obj:
        conv = Conversation(_sharegpt(obj["conversations"]))
    elif "instruction" in obj and "output" in obj:
        conv = Conversation(_alpaca(obj))
    else:
        raise BadConversation(f"has none of the fields 'messages', 'conversations' or 'instruction' + 'output' "
                              f"(its fields: {sorted(obj)[:12]})")
    _check_messages(conv.messages)
    return conv


def _openai(msgs) -> list[dict]:
    if not isinstance(msgs, list):
        raise BadConversation(f"'messages' is {type(msgs).__name__}, not a list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise BadConversation(f"message {i + 1} has role {role!r}; expected one of {list(ROLES)}")
        out.append({k: v for k, v in m.items() if v is not None})  # as transformers drops None values
    return out


def _sharegpt(turns) -> list[dict]:
    if not isinstance(turns, list):
        raise BadConversation(f"'conversations' is {type(turns).__name__}, not a list")
    out = []
    for i, t in enumerate(turns):
        who = t.get("from") if isinstance(t, dict) else None
        if who not in SHAREGPT_ROLES:
            raise BadConversation(f"turn {i + 1} is from {who!r}; expected one of {sorted(SHAREGPT_ROLES)}")
        out.append({"role": SHAREGPT_ROLES[who], "content": t.get("value")})
    return out


def _alpaca(obj: dict) -> list[dict]:
    inst, inp, out = obj.get("instruction"), obj.get("input") or "", obj.get("output")
    for name, v in (("instruction", inst), ("input", inp), ("output", out)):
        if not isinstance(v, str):
            raise BadConversation(f"'{name}' is {type(v).__name__}, not text")
    return [{"role": "user", "content": f"{inst}\n\n{inp}" if inp.strip() else inst},
            {"role": "assistant", "content": out}]


def _check_messages(msgs: list[dict]) -> None:
    if not msgs:
        raise BadConversation("has no messages")
    if not any(m["role"] == "assistant" for m in msgs):
        raise BadConversation("has no assistant turn (nothing to learn)")
    for i, m in enumerate(msgs):
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise BadConversation(f"message {i + 1} ({m['role']}): content is {type(content).__name__}, not text")
        if not (content or "").strip() and not m.get("tool_calls"):
            raise BadConversation(f"message {i + 1} ({m['role']}) has empty content")


def _check_reply_text(msgs: list[dict], eot: str) -> None:
    for i, m in enumerate(msgs):
        for key in ("content", "reasoning_content"):
            if m["role"] == "assistant" and isinstance(m.get(key), str) and eot in m[key]:
                raise BadConversation(f"message {i + 1} (assistant) holds the end-of-turn token text {eot!r}")


# ----------------------------------------------------------------------------------------------
# Conversations -> stored sequences (the window policy)


@dataclass(frozen=True)
class ChatSettings:
    """What a tokenizer process needs besides the template and the input list."""

    seed: int
    val_fraction: float
    dtype: str
    vocab_size: int
    learn: str
    overflow: str
    block_size: int | None


def conversation_sequences(ct: ChatTemplate, conv: Conversation, st: ChatSettings, counts: dict) -> list:
    """The ``(ids, mask)`` sequences stored for one conversation. Longer than ``block_size`` tokens: dropped
    (``overflow='drop'``) or cut at exchange boundaries (``'split'``: each piece is the leading system messages
    plus whole exchanges, a user message and everything up to the next one, rendered as a conversation of
    its own; an exchange longer than the window alone is dropped; a piece never ends with an unanswered
    message). A sequence with no learned token is dropped. Everything dropped is counted."""
    _check_reply_text(conv.messages, ct.eot)
    block = st.block_size
    if block is not None and len(ct.ids(conv.messages, conv.tools)) > block:
        if st.overflow == "drop":
            counts["too_long"] += 1
            return []
        counts["split"] += 1
        pieces = _split(ct, conv, block, counts)
        last = max(k for k, m in enumerate(conv.messages) if m["role"] == "assistant")
        out = []
        for idx in pieces:
            if st.learn == "last" and last not in idx:
                counts["no_learned"] += 1  # only the piece with the last reply learns
                continue
            out.append(ct.encode(Conversation([conv.messages[i] for i in idx], conv.tools), st.learn))
    else:
        out = [ct.encode(conv, st.learn)]
    kept = [(ids, mask) for ids, mask in out if (mask & LEARN_BIT).any()]
    counts["no_learned"] += len(out) - len(kept)
    return kept


def _split(ct: ChatTemplate, conv: Conversation, block: int, counts: dict) -> list[list[int]]:
    """Message indices of each piece (greedy: as many whole exchanges as fit the window)."""
    msgs = conv.messages
    head = []
    while len(head) < len(msgs) and msgs[len(head)]["role"] == "system":
        head.append(len(head))
    groups: list[list[int]] = []
    for i in range(len(head), len(msgs)):
        if msgs[i]["role"] == "user" or not groups:
            groups.append([i])
        else:
            groups[-1].append(i)

    def fits(idx: list[int]) -> bool:
        return len(ct.ids([msgs[i] for i in head + idx], conv.tools)) <= block

    pieces, cur = [], []
    for g in groups:
        if cur and fits(cur + g):
            cur = cur + g
            continue
        if cur:
            pieces.append(cur)
        cur = g if fits(g) else []
        if not cur:
            counts["exchanges_dropped"] += 1
    if cur:
        pieces.append(cur)
    out = []
    for p in pieces:
        while p and msgs[p[-1]]["role"] != "assistant":
            p = p[:-1]  # never keep a question whose answer is not in the piece
        if p:
            out.append(head + p)
    return out


def new_counts() -> dict:
    """The counts of what the window policy did (see :func:`conversation_sequences`)."""
    return {"conversations": 0, "too_long": 0, "split": 0, "exchanges_dropped": 0, "no_learned": 0}
