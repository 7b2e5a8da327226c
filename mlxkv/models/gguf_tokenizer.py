"""A GGUF's tokenizer as tokenizer.json and tokenizer_config.json, through the `tokenizers` library.

Two kinds of vocabulary (`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE with its merges (Llama 3, Qwen, SmolLM). How text
  is split before BPE is named by `tokenizer.ggml.pre`; the splitting
  expressions below are those tokenizers' own (llama.cpp's llama-vocab.cpp
  lists them);
- `llama`: SentencePiece BPE (Llama 2, Mistral 7B, Gemma, Phi-3): pieces
  with scores, "▁" for a space, bytes as `<0xNN>` pieces. SentencePiece
  merges the adjacent pair whose joined piece scores highest, so the merge
  list is every split of a piece into two pieces, ranked by the joined
  piece's score. `tokenizer.ggml.add_space_prefix` says whether a space is
  put before the text (Gemma's files say no).
Control and user-defined tokens (types 3 and 4) are matched whole, before BPE.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from mlxkv.errors import MlxkvError

log = logging.getLogger(__name__)

KINDS = ("gpt2", "llama")
_SPECIAL_TYPES = (3, 4)  # control, user-defined
_NORMAL, _BYTE = 1, 6
SPACE = "\u2581"  # SentencePiece's "▁"

_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LETTERS = r"[^\r\n\p{L}\p{N}]?\p{L}+"
_TAIL = r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
SPLITS = {
    "llama-bpe": rf"{_CONTRACTIONS}|{_LETTERS}|\p{{N}}{{1,3}}|{_TAIL}",  # Llama 3
    "qwen2": rf"{_CONTRACTIONS}|{_LETTERS}|\p{{N}}|{_TAIL}",
    "tekken": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
               r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
               r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),  # Mistral Nemo
}
# Other names llama.cpp gives the same expressions.
SPLITS.update({"llama3": SPLITS["llama-bpe"], "smaug-bpe": SPLITS["llama-bpe"], "dbrx": SPLITS["llama-bpe"],
               "deepseek-r1-qwen": SPLITS["qwen2"]})
GPT2_PRES = ("default", "gpt-2", "gpt2", None)


def write_tokenizer(meta: dict, directory: Path, context_length: int) -> None:
    kind = meta.get("tokenizer.ggml.model")
    if kind not in KINDS:
        raise MlxkvError(f"tokenizer {kind!r} is not supported (supported: gpt2 byte-level BPE, "
                         "llama SentencePiece)")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = _types(meta, len(tokens))
    tokenizer = byte_level_bpe(meta, tokens) if kind == "gpt2" else sentencepiece_bpe(meta, tokens, types)
    from tokenizers import AddedToken

    special = [t for t, kind in zip(tokens, types) if kind in _SPECIAL_TYPES]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    _add_bos(meta, tokens, tokenizer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(meta, tokens, context_length),
                                                                indent=1))


def _add_bos(meta: dict, tokens: list[str], tokenizer) -> None:
    """BOS before every encoded text when the file says so (llama.cpp's add_bos_token)."""
    from tokenizers import processors

    bos = _token(meta, tokens, "tokenizer.ggml.bos_token_id")
    if bos is not None and bool(meta.get("tokenizer.ggml.add_bos_token", False)):
        bos_id = int(meta["tokenizer.ggml.bos_token_id"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])


def _types(meta: dict, n: int) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    return [_NORMAL] * n if types is None else np.asarray(types).tolist()


def byte_level_bpe(meta: dict, tokens: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    pre = meta.get("tokenizer.ggml.pre")
    if pre in SPLITS:
        split = pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated")
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        if pre not in GPT2_PRES and pre != "smollm":
            log.warning("pre-tokenizer %r is not known here; splitting text as GPT-2 does", pre)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.pre_tokenizer = byte_level if pre != "smollm" else pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])  # digits one by one, as SmolLM's own
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def sentencepiece_bpe(meta: dict, tokens: list[str], types: list[int]):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = np.asarray(meta.get("tokenizer.ggml.scores", np.zeros(len(tokens))), dtype=np.float64)
    unk = _token(meta, tokens, "tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=spm_merges(tokens, scores, types),
                       unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # A space before the text, even one that starts with a space, and after each special
    # token, as SentencePiece's dummy prefix and llama.cpp's tokenizer put it.
    spaces = [normalizers.Replace(" ", SPACE)]
    tokenizer.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if prefix else []) + spaces)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tokenizer


def spm_merges(tokens: list[str], scores: np.ndarray, types: list[int]) -> list[tuple[str, str]]:
    """Every (left, right) whose join is a normal piece, best-scoring join first."""
    ids = {t: i for i, t in enumerate(tokens) if types[i] in (_NORMAL, *_SPECIAL_TYPES)}
    ranked = []
    for joined, i in ids.items():
        if types[i] != _NORMAL:
            continue
        for cut in range(1, len(joined)):
            left, right = joined[:cut], joined[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _token(meta: dict, tokens: list[str], key: str) -> str | None:
    i = meta.get(key)
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None


def tokenizer_config(meta: dict, tokens: list[str], context_length: int) -> dict:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": _token(meta, tokens, "tokenizer.ggml.bos_token_id"),
        "eos_token": _token(meta, tokens, "tokenizer.ggml.eos_token_id"),
        "unk_token": _token(meta, tokens, "tokenizer.ggml.unknown_token_id"),
        "pad_token": _token(meta, tokens, "tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": context_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return config
