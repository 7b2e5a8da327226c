"""Encoder embedding models through mlx-embeddings: mlxkv's vectors are the package's own,
batched or not, and a checkpoint of an encoder family without the extra is one line."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlxkv.errors import MlxkvError
from mlxkv.models.encoder import checkpoint_config, encoder_embeddings, encoder_family, load_encoder
from mlxkv.models.loader import load_model
from tiny_encoder import write_tiny_bert

TEXTS = ["a short one", "a somewhat longer text about harbours and boats at dawn", "x"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return str(write_tiny_bert(tmp_path_factory.mktemp("encoder") / "bert"))


@pytest.mark.slow  # importing mlx-embeddings (transformers) takes a second
def test_vectors_equal_mlx_embeddings_own_batched_or_not(bert):
    encoder = load_encoder(bert)
    assert encoder_family(checkpoint_config(bert)) == "BERT" and encoder.max_context == 64
    ids = [list(encoder.tokenizer.encode(t)) for t in TEXTS]
    alone = np.stack([np.array(encoder.model(mx.array([i])).text_embeds[0]) for i in ids])
    padded = encoder.tokenizer.batch_encode_plus(TEXTS, padding=True, return_tensors="mlx")
    theirs = np.array(encoder.model(padded["input_ids"], attention_mask=padded["attention_mask"]).text_embeds)
    np.testing.assert_allclose(encoder_embeddings(encoder, ids), alone, atol=1e-5)
    np.testing.assert_allclose(encoder_embeddings(encoder, ids, batch=2), theirs, atol=1e-5)


def test_an_encoder_checkpoint_without_the_extra_is_a_one_line_refusal(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    monkeypatch.setitem(sys.modules, "mlx_embeddings.utils", None)  # as if not installed: the import fails
    with pytest.raises(MlxkvError) as caught:
        load_encoder(str(tmp_path))
    message = str(caught.value)
    assert "\n" not in message and "an embedding model (BERT)" in message
    assert "pip install 'mlxkv[embeddings]'" in message


def test_an_encoder_given_to_chat_or_generate_says_what_serves_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "xlm-roberta"}))
    with pytest.raises(MlxkvError, match=r"an embedding model \(XLM-R\): `mlxkv serve` serves it on /v1/embeddings"):
        load_model(str(tmp_path))
