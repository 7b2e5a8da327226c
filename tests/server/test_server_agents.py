"""What coding agents need of the server beyond the APIs: per-request head
lines left out, max_tokens as a bound, a log that says why reuse was lost,
and the probes and ids their clients send."""

from __future__ import annotations

import logging
import time

import pytest

from mlxkv.server.prompt_heads import strip_head, strip_head_blocks, strip_heads
from mlxkv.server.server import Server, ServerOptions
from server_support import ScriptedThread, anthropic_client, openai_client, raw

BILLING = "x-anthropic-billing-header: cc_version=2.1.328.{}; cc_entrypoint=cli; cch=00000;"
SYSTEM = "You are an interactive CLI tool that helps users with software engineering tasks. " * 8


def test_claude_code_s_billing_header_is_left_out_as_a_block_or_a_first_line():
    assert strip_head_blocks([BILLING.format("a3f"), SYSTEM]) == [SYSTEM]
    assert strip_head_blocks([BILLING.format("a3f") + "\n" + SYSTEM]) == [SYSTEM]
    assert strip_head(BILLING.format("b71") + "\n" + SYSTEM) == SYSTEM
    assert strip_heads([{"role": "system", "content": BILLING.format("0c2") + "\nHi"},
                        {"role": "user", "content": BILLING}]) == [{"role": "system", "content": "Hi"},
                                                                   {"role": "user", "content": BILLING}]
    # Only at the head: the same words later in a prompt are the user's.
    assert strip_head("Hi\n" + BILLING) == "Hi\n" + BILLING
    assert strip_head_blocks([SYSTEM, BILLING]) == [SYSTEM, BILLING]


def test_a_new_claude_code_session_reuses_the_whole_system_prompt(server):
    client = anthropic_client(server)
    sessions = []
    for hex_id in ("a3f", "b71"):  # two sessions: the header's hex differs
        system = [{"type": "text", "text": BILLING.format(hex_id)}, {"type": "text", "text": SYSTEM}]
        sessions.append(client.messages.create(model="claude-sonnet-4-5", max_tokens=2, system=system,
                                               messages=[{"role": "user", "content": f"Task {hex_id}"}]))
    first, second = (s.usage for s in sessions)
    prompt = first.input_tokens + first.cache_read_input_tokens
    # Everything up to the user's task is a prefix hit for the new session.
    assert second.cache_read_input_tokens >= prompt - 16


def test_max_tokens_past_the_room_left_is_cut_not_refused(server):
    prompt = [40 + i % 300 for i in range(4090)]  # the test pool holds 4,096 tokens
    reply = openai_client(server).completions.create(model="x", prompt=prompt, max_tokens=32000)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 6


def test_claude_code_s_32000_max_tokens_fits_a_small_context(llama_dir):
    thread = ScriptedThread(llama_dir, ["a"])  # a context of 4,096 tokens
    with Server(thread, "scripted", ServerOptions(port=0)).start() as server:
        anthropic_client(server).messages.create(model="x", max_tokens=32000,
                                                 messages=[{"role": "user", "content": "hi"}])
    tokens, options = thread.submitted[0]
    assert options["max_tokens"] == 4096 + 1 - len(tokens)


def test_reply_cap_cuts_every_reply(llama_dir):
    thread = ScriptedThread(llama_dir, ["a"] * 4)
    with Server(thread, "scripted", ServerOptions(port=0, reply_cap=3)).start() as server:
        anthropic_client(server).messages.create(model="x", max_tokens=32000,
                                                 messages=[{"role": "user", "content": "hi"}])
    assert thread.submitted[0][1]["max_tokens"] == 3


def test_debug_log_says_where_a_prompt_stopped_matching_the_cache(server, caplog):
    client = openai_client(server)
    base = [{"role": "system", "content": "Shared rules for every session. " * 6}]
    client.chat.completions.create(model="x", max_tokens=2, messages=base + [{"role": "user", "content": "One"}])
    with caplog.at_level(logging.DEBUG, logger="mlxkv.server"):
        client.chat.completions.create(model="x", max_tokens=2, messages=base + [{"role": "user", "content": "Two"}])
    [line] = [r.getMessage() for r in caplog.records if "stopped matching the cache" in r.getMessage()]
    assert "cached" in line and "'" in line  # the index, and the text on each side


def test_probes_ids_and_the_access_log(server, caplog):
    assert raw(server, "GET", "/")[0] == 200
    assert raw(server, "HEAD", "/")[0] == 200  # Claude Code's first request
    name = server.backend.info.name
    assert name == "llama"  # the model directory's name, not its path
    status, card, _ = raw(server, "GET", f"/v1/models/{name}")
    assert status == 200 and card["id"] == name and card["context_length"] == 4096
    assert openai_client(server).models.retrieve(name).id == name
    status, error, _ = raw(server, "GET", "/v1/models/gpt-4o")
    assert status == 404 and "llama" in error["error"]["message"]
    with caplog.at_level(logging.INFO, logger="mlxkv.server.access"):
        openai_client(server).chat.completions.create(model="x", max_tokens=3,
                                                      messages=[{"role": "user", "content": "Log me."}])
        # The server is the package's: another test's stream may log its end in this window too.
        # The access line is written after the response's last byte: the client can be faster.
        def access_lines():
            return [r.getMessage() for r in caplog.records if r.name == "mlxkv.server.access"
                    and r.getMessage().startswith("POST /v1/chat/completions 200 ") and " out=3 " in r.getMessage()]

        deadline = time.monotonic() + 10
        while not access_lines() and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = access_lines()
    assert lines, [r.getMessage() for r in caplog.records]
    line = lines[-1]
    assert line.startswith("POST /v1/chat/completions 200 prompt=") and " cached=" in line
    assert " ttft=" in line and line.endswith("s")


def test_one_warning_per_server_when_the_template_cannot_render_tools(llama_dir, caplog):
    thread = ScriptedThread(llama_dir, ["ok"])
    thread.engine.tokenizer._tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "<|im_start|>assistant\n")
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
    with Server(thread, "scripted", ServerOptions(port=0)).start() as server, caplog.at_level(logging.WARNING):
        for _ in range(3):
            openai_client(server).chat.completions.create(model="x", tools=tools, max_tokens=2,
                                                          messages=[{"role": "user", "content": "Find it."}])
    warned = [r for r in caplog.records if "does not render tools" in r.getMessage()]
    assert len(warned) == 1


def test_no_warning_when_the_template_renders_tools(llama_dir, caplog):
    thread = ScriptedThread(llama_dir, ["ok"])
    tools = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]
    with Server(thread, "scripted", ServerOptions(port=0)).start() as server, caplog.at_level(logging.WARNING):
        openai_client(server).chat.completions.create(model="x", tools=tools, max_tokens=2,
                                                      messages=[{"role": "user", "content": "Find it."}])
    assert not [r for r in caplog.records if "does not render tools" in r.getMessage()]


@pytest.mark.parametrize("path, body, words", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 5000}]}, "the prompt is too long"),
    ("/v1/completions", {"prompt": "word " * 5000}, "the prompt is too long"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "word " * 5000}]},
     "prompt is too long: ")])
def test_an_oversized_prompt_is_named_as_the_problem(server, path, body, words):
    status, error, _ = raw(server, "POST", path, body)
    message = error["error"]["message"]
    assert status == 400 and words in message and "max_tokens" not in message


def test_a_request_may_turn_speculation_off_in_every_api(llama_dir):
    """mlxkv's own field `speculative`; clients send it as an extra body field."""
    thread = ScriptedThread(llama_dir, ["ok"])
    with Server(thread, "scripted", ServerOptions(port=0)).start() as server:
        chat = [{"role": "user", "content": "Hi."}]
        openai_client(server).chat.completions.create(model="x", messages=chat, max_tokens=2,
                                                      extra_body={"speculative": False})
        openai_client(server).chat.completions.create(model="x", messages=chat, max_tokens=2)
        openai_client(server).responses.create(model="x", input="Hi.", extra_body={"speculative": False})
        anthropic_client(server).messages.create(model="x", messages=chat, max_tokens=2,
                                                 extra_body={"speculative": False})
        status, error, _ = raw(server, "POST", "/v1/chat/completions",
                               {"model": "x", "messages": chat, "speculative": "sometimes"})
    assert [options["speculative"] for _, options in thread.submitted] == [False, True, False, False]
    assert status == 400 and "speculative" in error["error"]["message"]
