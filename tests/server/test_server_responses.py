"""The Responses API, driven by the official `openai` client's `responses.create` against a real server."""

from __future__ import annotations

import openai
import pytest

from mlxkv.server.server import Server, ServerOptions
from server_support import ScriptedThread, openai_client, raw

INSTRUCTIONS = "You are a careful coding agent."


def items(task: str) -> list[dict]:
    return [{"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": f"Fix the bug in {task}, "},
                         {"type": "input_text", "text": "then run the tests."}]}]


def chat(task: str) -> list[dict]:
    return [{"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": f"Fix the bug in {task}, then run the tests."}]


def test_a_response_equals_engine_chat_streamed_or_not(server, oracle):
    client = openai_client(server)
    response = client.responses.create(model="gpt-5-codex", instructions=INSTRUCTIONS, input=items("parser.py"),
                                       max_output_tokens=16, store=False)
    expected = oracle.chat(chat("parser.py"), max_tokens=16)
    assert response.output_text == expected.text and response.model == server.backend.info.name
    assert response.status == {"length": "incomplete", "stop": "completed"}[expected.finish_reason]
    assert response.usage.input_tokens == len(expected.prompt_tokens)
    assert response.usage.output_tokens == len(expected.tokens)
    events = list(client.responses.create(model="x", instructions=INSTRUCTIONS, input=items("parser.py"),
                                          max_output_tokens=16, store=False, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
    final = events[-1].response
    assert final.output_text == expected.text
    # The second run of the same prompt reads it from the cache, and says so.
    assert final.usage.input_tokens_details.cached_tokens == len(expected.prompt_tokens) // 8 * 8


def test_a_string_input_is_a_user_message_and_a_developer_message_a_system_one(server, oracle):
    client = openai_client(server)
    plain = client.responses.create(model="x", input="Say hello.", max_output_tokens=8, store=False)
    assert plain.output_text == oracle.chat([{"role": "user", "content": "Say hello."}], max_tokens=8).text
    developer = client.responses.create(model="x", max_output_tokens=8, store=False, input=[
        {"role": "developer", "content": INSTRUCTIONS}, {"role": "user", "content": "Say hello."}])
    assert developer.output_text == oracle.chat([{"role": "system", "content": INSTRUCTIONS},
                                                 {"role": "user", "content": "Say hello."}], max_tokens=8).text


def test_previous_response_id_continues_the_stored_conversation_from_the_cache(server):
    client = openai_client(server)
    first = client.responses.create(model="x", instructions=INSTRUCTIONS, input=items("cache.py"),
                                    max_output_tokens=20)
    follow = [{"role": "user", "content": "Now explain the fix."}]
    second = client.responses.create(model="x", instructions=INSTRUCTIONS, input=follow, max_output_tokens=4,
                                     previous_response_id=first.id)
    # The same prompt as sending the whole conversation, and all of the first turn is a prefix hit.
    whole = client.responses.create(model="x", instructions=INSTRUCTIONS, max_output_tokens=4, store=False,
                                    input=items("cache.py") + [{"role": "assistant", "content": first.output_text}]
                                    + follow)
    assert second.usage.input_tokens == whole.usage.input_tokens
    turn = first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens_details.cached_tokens == turn // 8 * 8
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        client.responses.create(model="x", input="hi", previous_response_id="resp_nothing")
    unstored = client.responses.create(model="x", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError, match="no stored response"):
        client.responses.create(model="x", input="hi", previous_response_id=unstored.id)


def test_tools_reach_the_template_and_calls_come_back_as_function_call_items(llama_dir):
    script = ["Checking.", '<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>', ""]
    thread = ScriptedThread(llama_dir, script)
    tools = [{"type": "function", "name": "shell", "description": "run a command",
              "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
             {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "lookup"}]},
             {"type": "web_search"}]
    history = items("main.py") + [
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "pwd"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "/work"}]
    with Server(thread, "scripted", ServerOptions(port=0)).start() as server:
        client = openai_client(server)
        response = client.responses.create(model="x", input=history, tools=tools, store=False)
        events = list(client.responses.create(model="x", input=history, tools=tools, store=False, stream=True))
    assert [item.type for item in response.output] == ["message", "function_call"]
    call = response.output[1]
    assert call.name == "shell" and call.arguments == '{"cmd": "ls"}' and call.call_id
    assert response.output_text == "Checking."
    kinds = [e.type for e in events]
    assert kinds.index("response.function_call_arguments.delta") < kinds.index(
        "response.function_call_arguments.done") < len(kinds) - 2
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert [i.type for i in events[-1].response.output] == ["message", "function_call"]
    prompt = thread.engine.tokenizer.decode(thread.submitted[0][0])
    # Function and namespaced tools rendered, the built-in one left out; the earlier call and its output too.
    assert '"name": "shell"' in prompt and '"name": "lookup"' in prompt and "web_search" not in prompt
    assert '"arguments": {"cmd": "pwd"}' in prompt and "<|im_start|>tool\n/work" in prompt


def test_bad_responses_requests_get_openai_errors(server):
    cases = [({}, "input"), ({"input": [{"role": "wizard", "content": "x"}]}, "input.0.role"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              "input.0.content.0: an image URL must be a base64 data: URL"),
             ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "x"},
                                                      {"type": "input_image", "image_url": "data:image/png;base64,"},
                                                      {"type": "input_audio"}]}]},
              "input.0.content.2: 'input_audio' parts are not supported"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}]},
              "input.0.content.0: a file_id image is not supported here"),
             ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 123}]}]},
              "input.0.content.0.text: expected a string, got int"),
             ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
             ({"input": "word " * 5000}, "the prompt is too long")]
    for body, words in cases:
        status, error, _ = raw(server, "POST", "/v1/responses", body)
        assert status == 400 and words in error["error"]["message"], (body, error)
        assert error["error"]["type"] == "invalid_request_error"
