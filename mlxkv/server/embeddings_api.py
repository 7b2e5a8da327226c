"""POST /v1/embeddings, OpenAI's form: `input` a string, a list of strings, or token ids
(one list or several); `encoding_format` float or base64; `dimensions` cuts each vector
to its first N values and normalizes it again (Matryoshka-trained models allow it).

The model's forward pass runs on the thread that owns its MLX state (backend.embed): a
decoder's engine thread, between steps, or an encoder's own (host/encoder_thread.py).
A chat model is a 400 naming its kind: its last hidden state is no embedding anyone
trained it to give.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import numpy as np
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse

from mlxkv.models.embedding import EMBEDDING
from mlxkv.server.api_errors import ApiError
from mlxkv.server.http_support import Lenient, off_loop, parse_body
from mlxkv.server.model_router import routed

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingsRequest(Lenient):
    model: str = ""
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)


async def embeddings(request: Request):
    body = await parse_body(request, EmbeddingsRequest)
    backend = await routed(request, body.model)
    if backend.info.kind != EMBEDDING:
        raise ApiError(400, f"model {backend.info.name!r} is a {backend.info.kind} model, not an embedding model; "
                            "serve an embedding model (Qwen3-Embedding, a BERT) for /v1/embeddings", param="model")
    token_lists = await off_loop(_token_lists, backend, body.input)
    vectors = await asyncio.wrap_future(backend.embed(token_lists))
    if body.dimensions is not None:
        if body.dimensions > vectors.shape[1]:
            raise ApiError(400, f"dimensions: {body.dimensions} is more than the model's {vectors.shape[1]}",
                           param="dimensions")
        vectors = vectors[:, :body.dimensions]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    n = sum(len(t) for t in token_lists)
    return JSONResponse({"object": "list", "data": data, "model": backend.info.name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


def _token_lists(backend, given) -> list[list[int]]:
    if isinstance(given, str):
        given = [given]
    if not given:
        raise ApiError(400, "input: give a string, a list of strings, or token ids", param="input")
    if all(isinstance(x, int) for x in given):
        given = [given]
    if len(given) > MAX_INPUTS:
        raise ApiError(400, f"input: at most {MAX_INPUTS} inputs per request, got {len(given)}", param="input")
    lists = [backend.text_tokens(x) if isinstance(x, str) else backend.token_ids(list(x)) for x in given]
    longest = backend.longest_input
    for i, tokens in enumerate(lists):
        if not tokens:
            raise ApiError(400, f"input.{i}: it is empty", param="input")
        if len(tokens) > longest:
            raise ApiError(400, f"input.{i}: {len(tokens)} tokens, more than the model's {longest}", param="input")
    return lists


def _encoded(vector: np.ndarray, encoding: str):
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.astype(float).tolist()
