"""Structured output through the official clients against a real server (mlxkv/structured/).

The tiny model has random weights: it never writes JSON or a tool call by
chance, so a reply that validates against its schema was made to.
"""

from __future__ import annotations

import json
import logging
import threading

import anthropic
import jsonschema
import openai
import pytest

from server_support import anthropic_client, openai_client, raw, running_server, wait_for
from mlxkv.structured.grammar import Grammar

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "days": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": SCHEMA}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA, "strict": True}}
BAD_SCHEMA = {"type": "object", "properties": {"n": {"type": "frob"}}}


def ask(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Plan a trip to {topic}."}]


def test_json_schema_replies_validate_streamed_and_not(server):
    client = openai_client(server)
    reply = client.chat.completions.create(model="x", messages=ask("Oslo"), max_tokens=60,
                                           response_format=RESPONSE_FORMAT)
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert reply.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model="x", messages=ask("Lima"), max_tokens=60, stream=True,
                                            response_format=RESPONSE_FORMAT)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    free = client.chat.completions.create(model="x", messages=ask("Oslo"), max_tokens=30)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)


def test_json_object_and_an_extra_body_regex(server):
    client = openai_client(server)
    reply = client.chat.completions.create(model="x", messages=ask("Rome"), max_tokens=12,
                                           response_format={"type": "json_object"})
    # Any object: a random model's first key runs on past max_tokens, so the start is what shows.
    assert reply.choices[0].message.content.startswith('{"')
    coded = client.chat.completions.create(model="x", messages=ask("Rome"), max_tokens=20,
                                           extra_body={"grammar": {"type": "regex", "value": "[A-Z]{3}"}})
    assert len(coded.choices[0].message.content) == 3 and coded.choices[0].message.content.isupper()


@pytest.mark.slow  # over ~0.7 s under load: the not-slow budget is nearly spent
def test_tool_choice_required_yields_a_strict_call_whose_arguments_validate(server):
    client = openai_client(server)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = client.chat.completions.create(model="x", messages=ask("Bergen"), max_tokens=80,
                                               tools=[WEATHER], tool_choice=choice)
        [call] = reply.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


@pytest.mark.slow  # over ~0.7 s under load: the not-slow budget is nearly spent
def test_an_uncompilable_schema_is_a_400_in_each_api(server):
    client = openai_client(server)
    with pytest.raises(openai.BadRequestError, match="frob"):
        client.chat.completions.create(model="x", messages=ask("Oslo"), max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": BAD_SCHEMA}})
    with pytest.raises(openai.BadRequestError, match="frob"):
        client.responses.create(model="x", input="hi", max_output_tokens=8,
                                text={"format": {"type": "json_schema", "name": "bad", "schema": BAD_SCHEMA}})
    with pytest.raises(anthropic.BadRequestError, match="frob"):
        anthropic_client(server).messages.create(
            model="x", max_tokens=8, messages=ask("Oslo"), tool_choice={"type": "any"},
            tools=[{"name": "bad", "input_schema": BAD_SCHEMA}])
    with pytest.raises(anthropic.BadRequestError, match="output_config.format: .*frob"):
        anthropic_client(server).messages.create(
            model="x", max_tokens=8, messages=ask("Oslo"),
            output_config={"format": {"type": "json_schema", "schema": BAD_SCHEMA}})


# What Pydantic writes for a model with a nested one: the nested model under $defs, by $ref.
PYDANTIC = {"type": "object", "title": "Trip", "required": ["city", "stops"], "$defs": {"Stop": {
    "type": "object", "title": "Stop", "required": ["name"], "properties": {
        "name": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 0, "maximum": 9}}}},
    "properties": {"city": {"type": "string", "maxLength": 8},
                   "stops": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/Stop"}}}}


@pytest.mark.slow  # decodes a call: ~1 s under load
def test_a_forced_call_to_a_tool_with_its_own_defs_validates(server):
    tool = {"type": "function", "function": {"name": "plan", "parameters": PYDANTIC}}
    reply = openai_client(server).chat.completions.create(model="x", messages=ask("Oslo"), max_tokens=120,
                                                          tools=[tool], tool_choice="required")
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "plan"
    jsonschema.validate(json.loads(call.function.arguments), PYDANTIC)


BAD_REF = {"type": "object", "properties": {"item": {"$ref": "#/$defs/Missing"}}, "$defs": {"Item": {"type": "string"}}}


def test_a_tool_ref_that_does_not_resolve_is_a_400_naming_the_tool_in_each_api(server):
    """Each API's own error shape (the clients raise BadRequestError only from it), before any decoding."""
    says = r"tools: tool 'lookup': \$ref '#/\$defs/Missing' does not resolve"
    with pytest.raises(openai.BadRequestError, match=says) as chat:
        openai_client(server).chat.completions.create(
            model="x", messages=ask("Oslo"), max_tokens=8, tool_choice="required",
            tools=[{"type": "function", "function": {"name": "lookup", "parameters": BAD_REF}}])
    assert chat.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError, match=says):  # auto with a strict tool constrains too
        openai_client(server).responses.create(
            model="x", input="hi", max_output_tokens=8,
            tools=[{"type": "function", "name": "lookup", "strict": True, "parameters": BAD_REF}])
    with pytest.raises(anthropic.BadRequestError, match=says) as messages:
        anthropic_client(server).messages.create(
            model="x", max_tokens=8, messages=ask("Oslo"), tool_choice={"type": "tool", "name": "lookup"},
            tools=[{"name": "lookup", "input_schema": BAD_REF}])
    assert messages.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.slow  # over ~0.7 s under load: the not-slow budget is nearly spent
def test_responses_text_format_validates(server):
    reply = openai_client(server).responses.create(
        model="x", input="Plan a trip to Oslo.", max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)


def test_responses_forced_function_call_validates(server):
    tool = {"type": "function", "name": "get_weather", "strict": True, "parameters": SCHEMA}
    reply = openai_client(server).responses.create(model="x", input="Weather in Oslo?", max_output_tokens=80,
                                                   tools=[tool], tool_choice="required")
    [call] = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)


def test_auto_with_a_strict_tool_is_text_or_a_valid_call(server):
    reply = openai_client(server).chat.completions.create(model="x", messages=ask("Oslo"), max_tokens=30,
                                                          tools=[WEATHER])
    message = reply.choices[0].message
    for call in message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    assert "<tool_call>" not in (message.content or "")  # a call it opens is a call, never loose text


@pytest.mark.slow  # over ~0.7 s under load: the not-slow budget is nearly spent
def test_anthropic_forced_tool_and_output_format_validate(server):
    tool = {"name": "get_weather", "description": "weather", "input_schema": SCHEMA}
    reply = anthropic_client(server).messages.create(
        model="x", max_tokens=80, messages=ask("Oslo"), tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"})
    [use] = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "get_weather" and reply.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMA)
    shaped = anthropic_client(server).messages.create(
        model="x", max_tokens=60, messages=ask("Lima"),
        extra_body={"output_format": {"type": "json_schema", "schema": SCHEMA}})
    jsonschema.validate(json.loads(shaped.content[0].text), SCHEMA)
    # The API's own field since structured outputs left beta, as the client sends it.
    shaped = anthropic_client(server).messages.create(
        model="x", max_tokens=60, messages=ask("Quito"),
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    jsonschema.validate(json.loads(shaped.content[0].text), SCHEMA)


@pytest.mark.slow
def test_responses_text_format_and_forced_calls_validate_streamed(server):
    """#44's "streamed and not", for the Responses text.format and the forced tools of Responses
    and Anthropic: the streamed reply (read back by each official client) validates too."""
    fmt = {"format": {"type": "json_schema", "name": "trip", "schema": SCHEMA, "strict": True}}
    events = list(openai_client(server).responses.create(model="x", input="Plan a trip to Oslo.",
                                                         max_output_tokens=60, text=fmt, stream=True))
    [done] = [e.response for e in events if e.type == "response.completed"]
    jsonschema.validate(json.loads(done.output_text), SCHEMA)
    tool = {"type": "function", "name": "get_weather", "strict": True, "parameters": SCHEMA}
    events = list(openai_client(server).responses.create(model="x", input="Weather in Oslo?", max_output_tokens=80,
                                                         tools=[tool], tool_choice="required", stream=True))
    [done] = [e.response for e in events if e.type == "response.completed"]
    [call] = [item for item in done.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    with anthropic_client(server).messages.stream(
            model="x", max_tokens=80, messages=ask("Oslo"), tool_choice={"type": "any"},
            tools=[{"name": "get_weather", "input_schema": SCHEMA}]) as stream:
        final = stream.get_final_message()
    [use] = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMA)


@pytest.mark.slow
def test_eight_mixed_clients_each_get_their_solo_tokens(server, oracle):
    topics = ["owls", "bridges", "volcanoes", "bread", "comets", "violins", "deserts", "trains"]
    grammar = Grammar.json_schema(SCHEMA)
    solo = {t: oracle.chat(ask(t), max_tokens=40, **({"grammar": grammar} if i % 2 == 0 else {})).text
            for i, t in enumerate(topics)}
    got, errors = {}, []

    def client(i, topic):
        try:
            extra = {"response_format": RESPONSE_FORMAT} if i % 2 == 0 else {}
            reply = openai_client(server).chat.completions.create(model="x", messages=ask(topic), max_tokens=40,
                                                                  **extra)
            got[topic] = reply.choices[0].message.content
        except Exception as e:  # reported below, with the topic
            errors.append((topic, e))

    threads = [threading.Thread(target=client, args=(i, t)) for i, t in enumerate(topics)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == solo
    for topic in topics[::2]:
        jsonschema.validate(json.loads(got[topic]), SCHEMA)


@pytest.mark.slow
def test_prompt_lookup_gives_the_same_constrained_tokens(llama_dir, server):
    messages = [{"role": "user", "content": 'Reply like {"city": "Oslo", "days": 3} or {"city": "Oslo", "days": 4}'}]
    plain = openai_client(server).chat.completions.create(model="x", messages=messages, max_tokens=40,
                                                          response_format=RESPONSE_FORMAT)
    with running_server(llama_dir, speculative="lookup") as fast:
        reply = openai_client(fast).chat.completions.create(model="x", messages=messages, max_tokens=40,
                                                            response_format=RESPONSE_FORMAT)
        speculative = fast.backend.stats().get("speculative", {})
    assert reply.choices[0].message.content == plain.choices[0].message.content
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert speculative.get("mode") == "lookup"


def test_metrics_show_mask_time_and_compile_cache_hits_and_the_debug_log_the_reply(server, caplog):
    client = openai_client(server)
    with caplog.at_level(logging.DEBUG, logger="mlxkv.server.backend"):
        for _ in range(2):  # the same schema twice: the second compile is a cache hit
            client.chat.completions.create(model="x", messages=ask("Quito"), max_tokens=40,
                                           response_format=RESPONSE_FORMAT)
    assert any("constrained reply" in r.getMessage() and "masked out" in r.getMessage() for r in caplog.records)
    wait_for(lambda: server.backend.stats().get("structured", {}).get("compile_cache_hits", 0) > 0)
    status, text, _ = raw(server, "GET", "/metrics")
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("mlxkv_structured"))
    assert status == 200 and int(lines["mlxkv_structured_compile_cache_hits_total"]) >= 1
    assert float(lines["mlxkv_structured_mask_seconds_per_step"]) > 0
