"""A tiny random-weight BERT in the Hugging Face layout, built offline from mlx-embeddings'
own class: config.json, model.safetensors and a WordPiece tokenizer that adds [CLS] and
[SEP] as BERT's does. Nothing is downloaded."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from mlxkv.models.tiny import random_weights
from real_parts import require

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("a an the of to and in on at for with about short long longer text harbours boats dawn "
         "somewhat one two three x y z hello world rivers sea ship").split()
CONFIG = {"architectures": ["BertModel"], "model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64,
          "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0}


def _tokenizer(vocab: dict[str, int]) -> Tokenizer:
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return tokenizer


def write_tiny_bert(directory: Path, seed: int = 7) -> Path:
    """Without mlx-embeddings (the `embeddings` extra): a skip, or a failure under CI."""
    require("mlx-embeddings", importlib.util.find_spec("mlx_embeddings"))
    from mlx_embeddings.models.bert import Model, ModelArgs

    directory.mkdir(parents=True, exist_ok=True)
    letters = [c for c in "abcdefghijklmnopqrstuvwxyz"] + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS + letters + list(".,!?"))}
    config = {**CONFIG, "vocab_size": len(vocab)}
    (directory / "config.json").write_text(json.dumps(config))
    weights = random_weights(Model(ModelArgs.from_dict(config)), seed)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, {"format": "mlx"})
    _tokenizer(vocab).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]", "model_max_length": 64}))
    return directory
