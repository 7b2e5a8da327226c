"""Chat prompts from a tokenizer alone: no model, no pool.

A chat's prompt is its template's text, with each earlier reply kept as
the ids the model generated where that is safe (reply_tokens.py). A chat
longer than the room it has loses its oldest turns (context_window.py).
"""

from __future__ import annotations

from mlxkv.chat.context_window import fit_messages
from mlxkv.chat.reply_tokens import chat_tokens, is_token_list
from mlxkv.errors import MlxkvError


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False))


def check_messages(messages) -> None:
    """Chat messages as chat templates take them; the templates' own errors
    ("'dict object' has no attribute 'content'") do not say which message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise MlxkvError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise MlxkvError(f"chat message {i} is a {type(m).__name__}, not a dict with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in m:
                raise MlxkvError(f"chat message {i} has no {key!r}")
            if not isinstance(m[key], str):
                raise MlxkvError(f"chat message {i}'s {key!r} must be text, got {type(m[key]).__name__}")
        if "tokens" in m and not is_token_list(m["tokens"]):
            raise MlxkvError(f"chat message {i}'s 'tokens' must be a list of token ids (the reply as generated)")


def chat_prompt(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                model_name: str = "this model", tools: list | None = None) -> list[int]:
    """The chat's prompt ids; replies that carry their generated ids keep them."""
    if not has_chat_template(tokenizer):
        raise MlxkvError(f"model {model_name!r} has no chat template; use raw prompts")
    check_messages(messages)
    return chat_tokens(tokenizer, messages, add_generation_prompt, tools)


def fitted_chat_prompt(tokenizer, messages: list[dict], limit: int,
                       model_name: str = "this model") -> tuple[list[int], int]:
    """The prompt of the newest turns that fit in `limit` tokens, and how many
    messages were left out (context_window.py). A chat that cannot fit is
    returned whole, for the request check to refuse with its own error."""
    tokens = chat_prompt(tokenizer, messages, model_name=model_name)
    if len(tokens) <= limit:
        return tokens, 0
    # Each list is templated once: the whole chat is already, and the window
    # that fits is the one measured last. The lists stay in `templated` with
    # their tokens, so no id is reused meanwhile.
    templated = {id(messages): (messages, tokens)}

    def measure(m: list[dict]) -> int:
        if id(m) not in templated:
            templated[id(m)] = (m, chat_prompt(tokenizer, m, model_name=model_name))
        return len(templated[id(m)][1])

    kept, left_out = fit_messages(messages, limit, measure, count=lambda m: len(tokenizer.encode(m["content"])))
    return templated[id(kept)][1], left_out
