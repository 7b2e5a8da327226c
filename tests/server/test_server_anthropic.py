"""The Anthropic Messages API, driven by the official `anthropic` client against a real server."""

from __future__ import annotations

import anthropic
import pytest

from mlxkv.server.server import Server, ServerOptions
from server_support import ScriptedThread, anthropic_client, raw

SYSTEM = "You are a patient teacher."


def question(topic: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": f"Explain {topic} to a child, "},
                                         {"type": "text", "text": "with an example."}]}]


def test_message_equals_engine_chat_and_the_stream_equals_it(server, oracle):
    client = anthropic_client(server)
    message = client.messages.create(model="claude-anything", max_tokens=20, system=SYSTEM,
                                     messages=question("magnets"))
    expected = oracle.chat([{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "Explain magnets to a child, with an example."}],
                           max_tokens=20)
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == expected.text
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert message.model == server.backend.info.name
    u = message.usage
    assert u.input_tokens + u.cache_read_input_tokens == len(expected.prompt_tokens)
    assert u.output_tokens == len(expected.tokens)
    with client.messages.stream(model="x", max_tokens=20, system=SYSTEM, messages=question("magnets")) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == expected.text and final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == u.output_tokens


def test_stream_events_come_in_the_documented_order(server):
    events = list(anthropic_client(server).messages.create(model="x", max_tokens=6, messages=question("rain"),
                                                           stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_second_turn_reads_the_first_from_the_cache(server):
    client = anthropic_client(server)
    messages = question("volcanic islands")
    first = client.messages.create(model="x", max_tokens=16, messages=messages)
    messages += [{"role": "assistant", "content": first.content[0].text},
                 {"role": "user", "content": "Why?"}]
    second = client.messages.create(model="x", max_tokens=4, messages=messages)
    whole_turn = first.usage.input_tokens + first.usage.cache_read_input_tokens + first.usage.output_tokens - 1
    assert second.usage.cache_read_input_tokens == whole_turn // 8 * 8


def test_count_tokens_counts_the_prompt(server, oracle):
    count = anthropic_client(server).messages.count_tokens(model="x", system=SYSTEM, messages=question("stars"))
    prompt = oracle.apply_chat_template([{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": "Explain stars to a child, with an example."}])
    assert count.input_tokens == len(prompt)


def test_tool_use_blocks_from_mlx_lm_s_parser(llama_dir):
    script = ['<tool_call>{"name": "lookup", "arguments": {"q": "tides"}}</tool_call>', ""]
    thread = ScriptedThread(llama_dir, script)
    tools = [{"name": "lookup", "description": "search", "input_schema": {"type": "object"}}]
    history = [{"role": "user", "content": "Find tides."},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "lookup",
                                                  "input": {"q": "moon"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "full moon"}]}]
    with Server(thread, "scripted", ServerOptions(port=0)).start() as server:
        client = anthropic_client(server)
        message = client.messages.create(model="x", max_tokens=50, tools=tools, messages=history)
        with client.messages.stream(model="x", max_tokens=50, tools=tools, messages=history) as stream:
            final = stream.get_final_message()
    for m in (message, final):
        assert m.stop_reason == "tool_use"
        [block] = [b for b in m.content if b.type == "tool_use"]
        assert block.name == "lookup" and block.input == {"q": "tides"}
    prompt = thread.engine.tokenizer.decode(thread.submitted[0][0])
    # The earlier call and its result reached the template as tool_calls and a tool message.
    assert '"name": "lookup", "arguments": {"q": "moon"}' in prompt and "<|im_start|>tool\nfull moon" in prompt


def test_bad_requests_get_anthropic_errors(server):
    ok = [{"role": "user", "content": "hi"}]
    for body, words in [({"messages": ok}, "max_tokens"),
                        ({"max_tokens": 0, "messages": ok}, "max_tokens"),
                        ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
                        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
                         "messages.0.content.0.source: an image block needs a source"),
                        ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {
                            "type": "base64", "media_type": "image/png", "data": 5}}]}]},
                         "messages.0.content.0: the image is not valid base64"),
                        # an image in a tool_result (an agent's screenshot) is read and named, not refused
                        ({"max_tokens": 5, "messages": [*ok, {"role": "assistant", "content": [
                            {"type": "tool_use", "id": "t", "name": "shot", "input": {}}]}, {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "a"}, {
                                "type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                            "data": "AA=="}}]}]}]},
                         "messages.2.content.0.content.1: llama takes text only"),
                        ({"max_tokens": 5, "messages": ok, "temperature": 3}, "temperature")]:
        status, error, _ = raw(server, "POST", "/v1/messages", body)
        assert status == 400 and error["type"] == "error", body
        assert error["error"]["type"] == "invalid_request_error" and words in error["error"]["message"], error
    with pytest.raises(anthropic.BadRequestError, match=r"prompt is too long: 10017 tokens > 4095 maximum"):
        anthropic_client(server).messages.create(model="x", max_tokens=5, messages=[
            {"role": "user", "content": "word " * 5000}])


def test_stop_sequences_end_with_stop_sequence(server, oracle):
    full = oracle.chat([{"role": "user", "content": "Explain fog to a child, with an example."}], max_tokens=20).text
    stop = full[4:7]
    message = anthropic_client(server).messages.create(model="x", max_tokens=20, stop_sequences=[stop],
                                                       messages=question("fog"))
    assert message.content[0].text == full[:full.index(stop)]
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
