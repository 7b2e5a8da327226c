"""Chat prompts that carry earlier replies as the ids the model generated.

Why: every chat turn re-sends the whole conversation, and a chat template
renders an earlier reply from its text. Tokenizing that text again need not
give back the ids the model produced: a real model's reply does not
whenever it picked a split the tokenizer would not make, and a
random-weight model's almost never does. The prefix
cache hits only up to the first id that differs, so from there on the chat
was recomputed on every turn. mlx-lm's own chat keeps the generated ids in
its cache across turns; this does the same for a stateless prompt.

An assistant message may carry `"tokens"`: its reply's ids, as streamed.
They replace the reply's text in the prompt when both hold:
- they decode to exactly the message's text, or to one leading space more
  (so a reply cut short, edited, or from another tokenizer falls back to
  its text), and
- the template puts each such reply's text in verbatim (one that trims or
  rewrites replies is left to tokenize its own output).
The text around the replies is tokenized piece by piece. The first piece is
the whole earlier prompt, so it tokenizes as that prompt did; the later
ones start right after a reply, where templates put a special token. The
result must decode to the same text as the whole text tokenized at once.
"""

from __future__ import annotations

from collections.abc import Sequence

# Private-use code points: no reply holds them, and no template rewrites them.
_MARK = "\ue000mlxkv-reply-{}\ue001"


def is_token_list(ids) -> bool:
    return isinstance(ids, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


def text_only(messages: Sequence[dict]) -> list[dict]:
    """The messages as chat templates take them, without reply ids."""
    return [{k: v for k, v in m.items() if k != "tokens"} for m in messages]


def chat_tokens(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True,
                tools: list | None = None) -> list[int]:
    """The chat's prompt ids: spliced where its replies' ids can be, else the
    template's text tokenized (as the template's own tokenize does it).
    `tools`: function definitions for templates that render them."""
    text = _render(tokenizer, text_only(messages), add_generation_prompt, tools)
    spliced = spliced_chat_tokens(tokenizer, messages, add_generation_prompt, text=text, tools=tools)
    return spliced if spliced is not None else _encode(tokenizer, text)


def spliced_chat_tokens(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True,
                        text: str | None = None, tools: list | None = None) -> list[int] | None:
    """The chat's prompt with each usable reply's own ids in place of its
    text; None when no reply carries usable ids or the template does not
    render replies verbatim. `text`: the template's text, if rendered already."""
    replies = _usable_replies(tokenizer, messages)
    if not replies:
        return None
    plain = text_only(messages)
    marked = [dict(m, content=_MARK.format(i)) if i in replies else m for i, m in enumerate(plain)]
    text, pieces = text if text is not None else _render(tokenizer, plain, add_generation_prompt, tools), []
    rest = _render(tokenizer, marked, add_generation_prompt, tools)
    for i in replies:
        piece, mark, rest = rest.partition(_MARK.format(i))
        if not mark:
            return None  # the template dropped or rewrote this reply
        pieces.append(piece)
    if "".join(p + plain[i]["content"] for p, i in zip(pieces, replies)) + rest != text:
        return None  # it renders a reply other than verbatim (trimmed, say)
    tokens: list[int] = []
    for piece, (ids, _) in zip(pieces, replies.values()):
        tokens += _encode(tokenizer, piece) + ids
    tokens += _encode(tokenizer, rest)
    # What the prompt says: the template's text, each reply as its ids read.
    meant = "".join(p + read for p, (_, read) in zip(pieces, replies.values())) + rest
    return tokens if _reads_as(tokenizer, tokens, meant) else None


def _usable_replies(tokenizer, messages: Sequence[dict]) -> dict[int, tuple[list[int], str]]:
    """Message index -> (ids, their text), for assistant messages whose ids decode to their text.

    A final end-of-sequence id is dropped: the model never read it (its KV
    was never computed), and the template writes its own end of turn. The
    ids may read one space more than the text: mlx-lm's streaming
    detokenizer drops a reply's leading space, which the model did generate.
    """
    eos = set(getattr(tokenizer, "eos_token_ids", None) or ())
    usable = {}
    for i, m in enumerate(messages):
        ids = list(m.get("tokens") or ())
        if m.get("role") != "assistant" or not ids:
            continue
        if ids[-1] in eos:
            ids.pop()
        try:
            read = tokenizer.decode(ids) if ids else None
        except (ValueError, TypeError, OverflowError, IndexError):  # ids outside the vocabulary
            read = None
        if read is not None and read in (m["content"], " " + m["content"]):
            usable[i] = (ids, read)
    return usable


def _reads_as(tokenizer, tokens: list[int], text: str) -> bool:
    """Whether ids tokenized in pieces still read as `text` tokenized whole.

    A SentencePiece tokenizer marks a word's leading space in the word's own
    token, so a template's space before a reply would be read twice. A
    byte-level one decodes back to the text exactly, which is checked first:
    encoding the whole text again costs as much as the splice.
    """
    decoded = tokenizer.decode(tokens)
    return decoded == text or decoded == tokenizer.decode(_encode(tokenizer, text))


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools: list | None = None) -> str:
    extra = {"tools": tools} if tools else {}  # some templates test `tools is defined`
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)


def _encode(tokenizer, text: str) -> list[int]:
    # As the template's own tokenize does: its text already holds any BOS.
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []
