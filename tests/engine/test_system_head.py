"""A hybrid keeps the system-and-tools head the server rendered: the first chat on a
head leaves a checkpoint at its end, so after a restart a new chat on it resumes
there (issue 45 item 4), with output equal to a cold run."""

from __future__ import annotations

import pytest

from family_support import model_with_oracle
from mlxkv.chat.prompting import chat_prompt
from mlxkv.chat.system_head import SystemHeads, common_prefix, head_length
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.errors import MlxkvError
from mlxkv.host.engine_thread import EngineThread
from mlxkv.models.tiny import TinyModelSpec

BLOCK = 16
SYSTEM = {"role": "system", "content": "You are a careful agent. Read the files before you edit them. " * 3}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the project",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return model_with_oracle(tmp_path_factory.mktemp("head") / "qwen3_next",
                             TinyModelSpec(family="qwen3_next", num_layers=2, seed=44))


def chat(loaded, user: str) -> tuple[list[int], int]:
    messages = [SYSTEM, {"role": "user", "content": user}]
    prompt = chat_prompt(loaded.tokenizer, messages, tools=TOOLS)
    return prompt, head_length(loaded.tokenizer, messages, TOOLS, prompt, BLOCK)


def config_for(disk: str) -> CacheConfig:
    # No write-through (the ratio): only what the close writes survives the restart.
    return CacheConfig(block_size=BLOCK, num_blocks=128, memory_tier_bytes=0, disk_tier=disk,
                       checkpoint_interval=4096, checkpoint_write_ratio=1e9)


def engine_for(loaded, disk: str) -> Engine:
    return Engine(loaded, config_for(disk), prefill_chunk=512)


def test_the_head_is_the_system_and_tools_in_whole_blocks(hybrid):
    _, loaded, _ = hybrid
    prompt, head = chat(loaded, "list the files")
    alone = chat_prompt(loaded.tokenizer, [SYSTEM], add_generation_prompt=False, tools=TOOLS)
    assert prompt[:len(alone)] == alone and head == len(alone) // BLOCK * BLOCK >= 2 * BLOCK
    assert head_length(loaded.tokenizer, [{"role": "user", "content": "hi"}], None, prompt, BLOCK) == 0


class NeedsAUser:
    """A template that refuses a chat without a user turn, as Qwen3.5's does."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, messages, **options):
        if not any(m["role"] == "user" for m in messages):
            raise ValueError("No user query found in messages.")
        return self.tokenizer.apply_chat_template(messages, **options)

    def encode(self, text, **options):
        return self.tokenizer.encode(text, **options)


def test_a_template_that_wants_a_user_turn_still_has_a_head(hybrid):
    _, loaded, _ = hybrid
    prompt, head = chat(loaded, "list the files")
    other, _ = chat(loaded, "what does the README say?")
    found = head_length(NeedsAUser(loaded.tokenizer), [SYSTEM, {"role": "user", "content": "x"}], TOOLS, prompt, BLOCK)
    assert found % BLOCK == 0 and head <= found <= common_prefix(prompt, other)


def test_a_new_chat_on_a_rendered_head_resumes_there_after_a_restart(hybrid, tmp_path):
    _, loaded, reference = hybrid
    disk = str(tmp_path / "kv")
    first, head = chat(loaded, "list the files in the project, please")
    with engine_for(loaded, disk) as engine:  # the head's first chat: no other chain shares it yet
        engine.generate(first, max_tokens=2, head=head)
    second, _ = chat(loaded, "what does the README say about tests?")
    with engine_for(loaded, disk) as engine:  # a restart
        result = engine.generate(second, max_tokens=6)
        with pytest.raises(MlxkvError, match="head must be a whole number"):
            engine.generate(second, max_tokens=1, head=-1)
    assert result.stats.cached_tokens["disk"] == head
    assert result.tokens == reference(second, 6)



def chat_in_engine(path, loaded, disk, messages) -> None:
    with engine_for(loaded, disk) as engine:
        engine.chat(messages, max_tokens=1)


def chat_in_thread(path, loaded, disk, messages) -> None:
    """As the chat app sends a turn: messages, templated on the submitting thread."""
    thread = EngineThread(path, config_for(disk), load=lambda model, cache, report: Engine(loaded, cache, prefill_chunk=512))
    thread.start().wait_ready(timeout=120)
    try:
        list(thread.submit(messages=messages, max_tokens=1))
    finally:
        thread.close()


@pytest.mark.slow  # two restarts
@pytest.mark.parametrize("first_chat", [chat_in_engine, chat_in_thread])
def test_a_chat_s_system_head_is_found_without_the_server(hybrid, tmp_path, first_chat):
    """Engine.chat and the chat app's EngineThread.submit find the head themselves."""
    path, loaded, _ = hybrid
    disk = str(tmp_path / "kv")
    first_chat(path, loaded, disk, [SYSTEM, {"role": "user", "content": "list the files"}])
    second = chat_prompt(loaded.tokenizer, [SYSTEM, {"role": "user", "content": "and the tests?"}])
    alone = chat_prompt(loaded.tokenizer, [SYSTEM], add_generation_prompt=False)
    with engine_for(loaded, disk) as engine:  # a restart
        assert engine.generate(second, max_tokens=1).stats.cached_tokens["disk"] == len(alone) // BLOCK * BLOCK > 0


def test_a_system_text_seen_before_is_not_rendered_again(hybrid):
    """Agents re-send one system-and-tools head every turn: SystemHeads renders it once."""
    _, loaded, _ = hybrid
    renders = []

    class Counting(NeedsAUser):
        def apply_chat_template(self, messages, **options):
            renders.append(len(messages))
            return self.tokenizer.apply_chat_template(messages, **options)

    heads, tokenizer = SystemHeads(), Counting(loaded.tokenizer)
    lengths = set()
    for user in ("list the files", "what does the README say?"):
        prompt, head = chat(loaded, user)
        lengths.add(heads.length(tokenizer, [SYSTEM, {"role": "user", "content": user}], TOOLS, prompt, BLOCK))
        assert lengths == {head}
    assert renders == [1]  # the system message alone, once
