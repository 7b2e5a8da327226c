"""The server's side of an encoder embedding model: /v1/embeddings only.

It reads as ServingBackend does where the server and the embeddings endpoint
look (info, thread, stop_at, text_tokens, token_ids, longest_input, embed,
stats, close); every generating endpoint gets the 400 that names its kind.
"""

from __future__ import annotations

from concurrent.futures import Future

from mlxkv.engine.limits import RequestLimits
from mlxkv.errors import MlxkvError
from mlxkv.host.encoder_thread import EncoderThread
from mlxkv.models.embedding import EMBEDDING
from mlxkv.models.encoder import encoder_embeddings
from mlxkv.server.api_errors import ApiError
from mlxkv.server.backend import ModelInfo, not_for_replies


def _model_info(name: str, encoder) -> ModelInfo:
    config = encoder.config
    vocab = config.get("vocab_size")
    # No pool: the limits only check token ids against the vocabulary.
    limits = RequestLimits(vocab, encoder.max_context, num_blocks=0, block_size=1)
    return ModelInfo(name, encoder.tokenizer, limits, encoder.max_context, tiers="none (an encoder keeps no KV cache)",
                     nbytes=encoder.nbytes, kind=EMBEDDING)


class EncoderBackend:
    def __init__(self, thread: EncoderThread, name: str):
        self.thread = thread
        thread.wait_ready()
        self.info = thread.call(lambda encoder: _model_info(name, encoder)).result()
        self.stop_at: float | None = None  # read by the server's stop; an embedding request is short

    @property
    def longest_input(self) -> int:
        return self.info.max_context or 512

    def text_tokens(self, text: str) -> list[int]:
        return list(self.info.tokenizer.encode(text))  # with the family's [CLS]/[SEP] or <s>/</s>

    def token_ids(self, ids: list[int]) -> list[int]:
        try:
            return self.info.limits.token_ids(ids)
        except MlxkvError as e:
            raise ApiError(400, str(e), param="input") from None

    def embed(self, token_lists: list[list[int]]) -> Future:
        return self.thread.call(lambda encoder: encoder_embeddings(encoder, token_lists))

    def chat_tokens(self, *args, **kwargs):
        raise not_for_replies(self.info)

    chat_prompt = chat_tokens

    def reply_limit(self, *args, **kwargs):
        raise not_for_replies(self.info)

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass
