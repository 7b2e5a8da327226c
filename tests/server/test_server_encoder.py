"""An encoder embedding model (a tiny BERT, through mlx-embeddings) beside a chat model in a
real `mlxkv serve` process, through the official openai client: its vectors are the
package's own, batched or not, in float or base64, cut to `dimensions`; each model refuses
the other's endpoint with a 400 naming its kind."""

from __future__ import annotations

import base64
import subprocess
import sys

import mlx.core as mx
import numpy as np
import openai
import pytest

from server_support import wait_for
from tiny_encoder import write_tiny_bert

pytestmark = pytest.mark.slow
TEXTS = ["a short one", "a somewhat longer text about harbours and boats at dawn", "x"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return str(write_tiny_bert(tmp_path_factory.mktemp("encoder") / "bert"))


@pytest.fixture(scope="module")
def served(bert, llama_dir):
    process = subprocess.Popen([sys.executable, "-m", "mlxkv.cli", "serve", "--model", f"embed={bert}",
                                "--model", f"llama={llama_dir}", "--port", "0", "--no-disk-tier",
                                "--block-size", "8", "--num-blocks", "256"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("mlxkv serve: http://127.0.0.1:"), process.stderr.read()
        port = int(line.split("http://127.0.0.1:")[1].split(" ")[0])
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    finally:
        process.terminate()
        process.communicate(timeout=60)


def own_vectors(bert: str) -> np.ndarray:
    """mlx-embeddings' own: its loader, its tokenizer, its model's text_embeds, each text alone."""
    from mlx_embeddings import load

    model, tokenizer = load(bert)
    return np.stack([np.array(model(mx.array([tokenizer.encode(t)])).text_embeds[0]) for t in TEXTS])


def test_embeddings_of_an_encoder_model_equal_mlx_embeddings_own(served, bert):
    expected = own_vectors(bert)
    batch = served.embeddings.create(model="embed", input=TEXTS)
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.model == "embed"
    np.testing.assert_allclose(np.array([d.embedding for d in batch.data]), expected, atol=1e-5)
    one = served.embeddings.create(model="embed", input=TEXTS[1])
    np.testing.assert_allclose(one.data[0].embedding, expected[1], atol=1e-5)
    cut = served.embeddings.with_raw_response.create(model="embed", input=TEXTS[1], encoding_format="base64",
                                                     dimensions=8).http_response.json()
    got = np.frombuffer(base64.b64decode(cut["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(got, expected[1][:8] / np.linalg.norm(expected[1][:8]), atol=1e-5)
    with pytest.raises(openai.BadRequestError, match="dimensions: 33 is more than the model's 32"):
        served.embeddings.create(model="embed", input="x", dimensions=33)


def test_each_kind_refuses_the_others_endpoint_naming_its_kind(served):
    with pytest.raises(openai.BadRequestError, match="'llama' is a chat model, not an embedding model"):
        served.embeddings.create(model="llama", input="hi")
    with pytest.raises(openai.BadRequestError, match="'embed' is an embedding model: it serves /v1/embeddings"):
        served.chat.completions.create(model="embed", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert served.chat.completions.create(model="llama", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=2).choices[0].message.content is not None
