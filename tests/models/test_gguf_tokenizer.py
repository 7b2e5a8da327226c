"""GGUF vocabularies through the `tokenizers` library: SentencePiece's own encoder is the
oracle for `llama` vocabularies; byte-level BPE splits text as each named pre-tokenizer."""

from __future__ import annotations

import io

import numpy as np
import pytest
import sentencepiece as spm
from tokenizers import Tokenizer

from mlxkv.models.gguf_tokenizer import write_tokenizer

TEXTS = ["Hello world", "  two leading spaces and  inner  ones", "new\nlines\n\nhere", "naïve café, 日本語!",
         "numbers 12345 and symbols #$%", "The quick brown fox jumps over the lazy dog.", "", " ", "ends with a space "]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello there.",
          "Once upon a time a small model lived in a cache.", "numbers 1 2 3 and words"] * 50


@pytest.fixture(scope="module")
def sentencepiece_model():
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=300,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   minloglevel=2, bos_id=1, eos_id=2, unk_id=0,
                                   # as Llama's and Gemma's models: text is not normalized (nor is it by llama.cpp)
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def gguf_vocabulary(sp) -> dict:
    """The vocabulary as llama.cpp's converter writes a SentencePiece model to GGUF."""
    def kind(i):
        return 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1

    n = sp.get_piece_size()
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": np.array([sp.get_score(i) for i in range(n)], dtype=np.float32),
            "tokenizer.ggml.token_type": np.array([kind(i) for i in range(n)], dtype=np.int32),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.add_bos_token": False}


def test_sentencepiece_vocabularies_encode_as_sentencepiece_does(sentencepiece_model, tmp_path):
    sp = sentencepiece_model
    write_tokenizer(gguf_vocabulary(sp), tmp_path, 4096)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert tokenizer.decode(ids) == sp.decode(ids), text


def test_bos_is_added_when_the_file_says_so(sentencepiece_model, tmp_path):
    meta = {**gguf_vocabulary(sentencepiece_model), "tokenizer.ggml.add_bos_token": True}
    write_tokenizer(meta, tmp_path, 4096)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tokenizer.encode("Hello world").ids == [1] + sentencepiece_model.encode("Hello world")


def test_no_space_prefix_when_the_file_says_so(sentencepiece_model, tmp_path):
    """Gemma's files: text is not given a leading "▁"."""
    meta = {**gguf_vocabulary(sentencepiece_model), "tokenizer.ggml.add_space_prefix": False}
    write_tokenizer(meta, tmp_path, 4096)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    pieces = tokenizer.encode("Hello world", add_special_tokens=False).tokens
    assert not pieces[0].startswith("\u2581") and tokenizer.decode(tokenizer.encode("Hello world").ids) == "Hello world"


def byte_level(pre: str) -> dict:
    letters = [chr(c) for c in range(33, 127)]  # printable ASCII: its own byte-level symbols
    tokens = letters + ["Ġ", "Ċ"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": []}


@pytest.mark.parametrize("pre,digits", [("qwen2", ["1", "2", "3", "4"]), ("llama-bpe", ["123", "4"]),
                                        ("default", ["1234"])])
def test_byte_level_bpe_splits_numbers_as_its_pre_tokenizer(tmp_path, pre, digits):
    write_tokenizer(byte_level(pre), tmp_path, 4096)
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    words = tokenizer.pre_tokenizer.pre_tokenize_str("x1234")
    assert [w for w, _ in words if w.isdigit()] == digits
