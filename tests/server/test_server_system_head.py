"""The server passes the system-and-tools head it rendered with a hybrid's request:
after a restart, a new chat on the head hits the head's whole blocks from the SSD
tier, though only one chat ever used it (issue 45 item 4)."""

from __future__ import annotations

import pytest

from server_support import raw, running_server
from mlxkv.chat.prompting import chat_prompt
from mlxkv.models.loader import load_model
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

BLOCK = 8  # server_support.CACHE's
SYSTEM = {"role": "system", "content": "You are a careful agent. Read the files before you edit them. " * 2}
TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the project",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def ask(server, user: str) -> dict:
    body = {"model": "m", "messages": [SYSTEM, {"role": "user", "content": user}], "tools": TOOLS,
            "max_tokens": 2, "temperature": 0}
    status, reply, _ = raw(server, "POST", "/v1/chat/completions", body)
    assert status == 200, reply
    return reply["usage"]


@pytest.mark.slow  # two server starts
def test_a_new_chat_on_the_rendered_head_hits_it_after_a_restart(tmp_path):
    model = str(write_tiny_model(tmp_path / "qwen3_next", TinyModelSpec(family="qwen3_next", num_layers=2, seed=45)))
    alone = chat_prompt(load_model(model).tokenizer, [SYSTEM], add_generation_prompt=False, tools=TOOLS)
    cache = dict(disk_tier=str(tmp_path / "kv"), checkpoint_write_ratio=1e9)  # only the close writes checkpoints
    with running_server(model, **cache) as server:
        ask(server, "list the files in the project, please")
    with running_server(model, **cache) as server:  # a restart
        usage = ask(server, "what does the README say about tests?")
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(alone) // BLOCK * BLOCK > 4 * BLOCK
