"""Replies sent back with the ids the model generated (mlxkv/reply_tokens.py)."""

from __future__ import annotations

import pytest

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.chat.reply_tokens import text_only
from mlxkv.models.tiny import CHAT_TEMPLATE

BLOCK = 8
QUESTION = [{"role": "user", "content": "Tell me about the sea and the ships that sail upon it."}]


@pytest.fixture(scope="module")
def engine(model_dirs):
    return Engine.load(model_dirs["llama"], CacheConfig(block_size=BLOCK, num_blocks=64))


@pytest.fixture(scope="module")
def first(engine):
    return engine.chat(QUESTION, max_tokens=24)


def with_reply(reply_text: str, ids, follow_up: str = "And then?") -> list[dict]:
    return QUESTION + [{"role": "assistant", "content": reply_text, "tokens": ids},
                       {"role": "user", "content": follow_up}]


def fed(result) -> list[int]:
    """What the model read of a turn: its prompt and reply, less a final EOS."""
    ids = result.prompt_tokens + result.tokens
    return ids[:-1] if result.finish_reason == "stop" else ids


def test_a_reply_sent_back_with_its_ids_is_reused_whole(engine, first):
    second = engine.chat(with_reply(first.text, first.tokens), max_tokens=4)
    history = fed(first)
    assert second.prompt_tokens[: len(history)] == history
    # Every full block of the first turn is a pool hit, the reply's included;
    # with the text alone, reuse stops where re-tokenizing the reply differs.
    assert second.stats.cached_tokens["pool"] >= (len(history) - 1) // BLOCK * BLOCK
    assert second.stats.cached_tokens["pool"] > len(first.prompt_tokens)
    # After the reply, the template's own text, tokenized as it would be.
    plain = engine.apply_chat_template(text_only(with_reply(first.text, first.tokens)))
    tail = engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n",
                                   add_special_tokens=False)
    assert second.prompt_tokens[len(history):] == plain[-len(tail):] == tail


def test_the_reused_prompt_answers_as_a_cold_one(engine, first, model_dirs):
    messages = with_reply(first.text, first.tokens, "What next?")
    warm = engine.chat(messages, max_tokens=6)
    assert warm.stats.cached_tokens["pool"] > len(first.prompt_tokens)
    cold = Engine.load(model_dirs["llama"], CacheConfig(block_size=BLOCK, num_blocks=64))
    assert cold.generate(warm.prompt_tokens, max_tokens=6).tokens == warm.tokens


def test_a_third_turn_keeps_both_replies(engine, first):
    messages = with_reply(first.text, first.tokens)
    second = engine.chat(messages, max_tokens=12)
    messages += [second.as_message(), {"role": "user", "content": "More."}]
    third = engine.chat(messages, max_tokens=2)
    assert third.prompt_tokens[: len(fed(second))] == fed(second)


def test_a_final_eos_id_is_left_to_the_template(engine, first):
    eos = sorted(engine.tokenizer.eos_token_ids)[0]
    ids = fed(first)[len(first.prompt_tokens):]
    assert engine.apply_chat_template(with_reply(first.text, ids + [eos])) == \
        engine.apply_chat_template(with_reply(first.text, ids))


@pytest.mark.parametrize("ids", [
    pytest.param(lambda ids: ids[:-3], id="a reply cut short of its text"),
    pytest.param(lambda ids: ids[3:], id="ids of other text"),
    pytest.param(lambda ids: [10**9], id="ids outside the vocabulary"),
    pytest.param(lambda ids: [-1], id="a negative id"),
    pytest.param(lambda ids: [], id="no ids"),
])
def test_ids_that_are_not_the_text_fall_back_to_the_text(engine, first, ids):
    messages = with_reply(first.text, ids(first.tokens))
    assert engine.apply_chat_template(messages) == engine.apply_chat_template(text_only(messages))


def test_a_reply_whose_leading_space_the_detokenizer_dropped_keeps_its_ids(engine):
    # mlx-lm's streaming detokenizer drops a reply's first space; the model
    # generated it, and its KV is cached with it.
    ids = engine.tokenizer.encode(" the sea, and the ships", add_special_tokens=False)
    shown = engine.tokenizer.decode(ids)
    assert shown.startswith(" ")
    asked = engine.apply_chat_template(QUESTION)
    for text in (shown[1:], shown):
        assert engine.apply_chat_template(with_reply(text, ids))[: len(asked) + len(ids)] == asked + ids
    two_short = engine.apply_chat_template(with_reply(shown[1:].lstrip(), [*engine.tokenizer.encode(" ", add_special_tokens=False), *ids]))
    assert two_short == engine.apply_chat_template(text_only(with_reply(shown[1:].lstrip(), [])))


def test_ids_on_a_user_message_are_ignored(engine, first):
    messages = [dict(QUESTION[0], tokens=[5, 6, 7])]
    assert engine.apply_chat_template(messages) == engine.apply_chat_template(QUESTION)


def test_a_template_that_trims_replies_gets_the_text(model_dirs):
    engine = Engine.load(model_dirs["llama"], CacheConfig(block_size=BLOCK, num_blocks=64))
    text = " the sea, the ships \n"
    # A split the tokenizer would not make, as sampling can pick.
    ids = [i for c in text for i in engine.tokenizer.encode(c, add_special_tokens=False)]
    assert engine.tokenizer.decode(ids) == text and engine.tokenizer.encode(text, add_special_tokens=False) != ids
    messages = with_reply(text, ids)
    asked = engine.apply_chat_template(QUESTION)
    assert engine.apply_chat_template(messages)[: len(asked) + len(ids)] == asked + ids  # rendered verbatim: kept
    engine.tokenizer._tokenizer.chat_template = CHAT_TEMPLATE.replace("message['content']",
                                                                      "message['content'] | trim")
    assert engine.apply_chat_template(messages) == engine.apply_chat_template(text_only(messages))
    assert engine.tokenizer.decode(engine.apply_chat_template(messages)).count("the sea, the ships<|im_end|>") == 1


def sentencepiece_like(template: str):
    """A tokenizer that marks a word's leading space in the word's token, as Llama 2's and Mistral's do."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "[INST]", "[/INST]"])
    tokenizer.train_from_iterator(["the sea and the ships sail upon it, hello world"] * 50, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.chat_template = template
    return TokenizerWrapper(hf)


def test_a_template_space_before_a_reply_is_not_read_twice():
    # Mistral-style: the template writes a space, then the reply, whose
    # first token ("▁hello") holds its own space: spliced, the space would
    # be read twice. The text is tokenized instead.
    from mlxkv.chat.reply_tokens import spliced_chat_tokens

    tokenizer = sentencepiece_like(
        "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
        "{% else %}{{ ' ' + m['content'] }}</s>{% endif %}{% endfor %}")
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids)[0] == "▁hello"
    messages = [{"role": "user", "content": "the sea"},
                {"role": "assistant", "content": tokenizer.decode(ids), "tokens": ids},
                {"role": "user", "content": "the ships"}]
    assert spliced_chat_tokens(tokenizer, messages) is None
