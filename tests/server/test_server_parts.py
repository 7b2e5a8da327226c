"""The server's parts on their own: reply-id memory, stop strings, tool-call splitting, metrics."""

from __future__ import annotations

import json
import os

import pytest

from mlxkv.engine.records import RequestStats
from mlxkv.server.metrics import ServerMetrics
from mlxkv.server.reply_ids import ReplyIds
from mlxkv.server.stop_strings import StopStrings
from mlxkv.server.tool_calls import ToolCallSplitter


def test_reply_ids_attach_to_assistant_messages_only_and_stay_bounded():
    memory = ReplyIds(kept=2)
    memory.remember("one", [1])
    memory.remember("two", [2])
    memory.lookup("one")  # now the most recent
    memory.remember("three", [3])
    assert memory.lookup("two") is None and memory.lookup("one") == [1] and len(memory) == 2
    chat = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "one"},
            {"role": "assistant", "content": "three", "tokens": [9]}, {"role": "assistant", "content": "new"}]
    assert memory.attach(chat) == [chat[0], {"role": "assistant", "content": "one", "tokens": [1]}, chat[2], chat[3]]


def test_reply_ids_survive_a_restart_and_a_torn_line(tmp_path):
    path = tmp_path / "fp" / "reply-ids.jsonl"
    first = ReplyIds(path=path)
    first.remember("hello there", [5, 6, 7])
    first.remember("second", [8])
    first.close()
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
    with open(path, "a") as f:
        f.write('{"k": "abc", "ids": [1,')  # a crash mid-write
    again = ReplyIds(path=path)
    assert again.lookup("hello there") == [5, 6, 7] and again.lookup("second") == [8]
    again.remember("third", [9])
    again.close()
    assert ReplyIds(path=path).lookup("third") == [9]


def test_reply_id_log_is_compacted_past_twice_its_bound(tmp_path):
    path = tmp_path / "reply-ids.jsonl"
    log = ReplyIds(kept=3, path=path)
    for i in range(10):
        log.remember(f"reply {i}", [i])
    log.close()
    reopened = ReplyIds(kept=3, path=path)
    reopened.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and [json.loads(line)["ids"] for line in lines] == [[7], [8], [9]]


def test_an_unusable_reply_log_only_costs_persistence(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    memory = ReplyIds(path=blocker / "reply-ids.jsonl")
    memory.remember("x", [1])
    assert memory.lookup("x") == [1] and "will not survive a restart" in caplog.text


@pytest.mark.parametrize("pieces", [["Hello wor", "ld. STOP here"], ["Hello world. ST", "OP here"],
                                    ["Hello world. S", "T", "O", "P"]])
def test_stop_strings_across_deltas(pieces):
    stops = StopStrings(["STOP", "never"])
    sent = "".join(stops.feed(p) for p in pieces)
    assert sent == "Hello world. " and stops.matched == "STOP"


def test_held_text_is_released_when_no_stop_follows():
    stops = StopStrings(["STOP"])
    assert stops.feed("all ST") == "all " and stops.feed("ILL") == "STILL"
    assert stops.feed(" S") == " " and stops.flush() == "S" and stops.matched is None


def json_parser(text, tools):
    return json.loads(text)


def test_tool_calls_split_across_deltas_and_left_open():
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>", json_parser, None)
    out = [splitter.feed(p) for p in ["Sure. <to", "ol_call>{\"name\": \"f\", ", "\"arguments\": {\"x\": 1}}</tool",
                                      "_call> done <tool_call>{\"name\": \"g\", \"arguments\": {}}"]]
    assert "".join(text for text, _ in out) == "Sure.  done "
    assert out[2][1] == []  # its end marker is not complete yet
    [call] = out[3][1]
    assert call.name == "f" and json.loads(call.arguments) == {"x": 1} and call.input() == {"x": 1}
    rest, [open_call] = splitter.finish()  # cut by max_tokens before its end marker
    assert rest == "" and open_call.name == "g" and len(splitter.calls) == 2


def test_calls_without_an_end_marker_run_to_the_replys_end():
    """Mistral's format: `[TOOL_CALLS]name[ARGS]{...}` and no end marker, read by mlx-lm's own parser."""
    from mlx_lm.tool_parsers import mistral

    splitter = ToolCallSplitter(mistral.tool_call_start, mistral.tool_call_end, mistral.parse_tool_call, None)
    out = [splitter.feed(p) for p in ["Checking. [TOOL", "_CALLS]get_weather[ARGS]{\"city\": ", "\"Oslo\"}"]]
    assert "".join(text for text, _ in out) == "Checking. " and all(calls == [] for _, calls in out)
    rest, [call] = splitter.finish()
    assert rest == "" and call.name == "get_weather" and call.input() == {"city": "Oslo"}


def test_a_malformed_tool_call_is_dropped_not_fatal():
    splitter = ToolCallSplitter("<tool_call>", "</tool_call>", json_parser, None)
    text, calls = splitter.feed("a<tool_call>{not json</tool_call>b")
    assert text == "ab" and calls == []


def test_metrics_render_prometheus_text():
    metrics = ServerMetrics()
    metrics.request_done("/v1/messages", 200)
    metrics.reply_done(RequestStats(100, {"pool": 64, "memory": 0, "disk": 16}, 20, 10, ttft_s=0.2,
                                    decode_tokens_per_s=50.0))
    speculative = {"mode": "lookup", "proposed": 40, "accepted": 30, "steps": 9, "acceptance_rate": 0.75,
                   "tokens_per_step": 3.5}
    text = metrics.render(open_requests=1, pool={"in_use": 3, "cached_free": 4, "free": 5, "size_blocks": 12,
                                                 "budget_blocks": 64, "evictions": 2}, speculative=speculative)
    assert 'mlxkv_requests_total{endpoint="/v1/messages",status="200"} 1' in text
    assert 'mlxkv_cached_tokens_total{tier="disk"} 16' in text
    assert 'mlxkv_time_to_first_token_seconds_bucket{le="0.25"} 1' in text
    assert 'mlxkv_time_to_first_token_seconds_bucket{le="0.1"} 0' in text
    assert "mlxkv_time_per_output_token_seconds_sum 0.02" in text
    assert 'mlxkv_pool_blocks{state="budget_blocks"} 64' in text and "mlxkv_open_requests 1" in text
    assert "mlxkv_speculative_accepted_total 30" in text and "mlxkv_speculative_tokens_per_step 3.5" in text
    assert "mlxkv_speculative" not in metrics.render(0, None, {"mode": None})


def test_a_record_for_a_closed_server_loop_never_raises_on_the_engine_thread():
    """The engine thread queues records through handle.notify; once the
    server's event loop has closed (shutdown), waking it must not raise
    into the engine's step."""
    import asyncio

    from mlxkv.engine.records import GenerationChunk
    from mlxkv.host.request_handle import RequestHandle
    from mlxkv.server.backend import RecordReader

    handle = RequestHandle(1)
    loop = asyncio.new_event_loop()

    async def start_waiting():
        reader = RecordReader(handle)
        waiting = asyncio.ensure_future(reader.next())
        await asyncio.sleep(0)
        return waiting

    waiting = loop.run_until_complete(start_waiting())
    assert handle.notify is not None and not waiting.done()
    loop.close()
    handle._put(GenerationChunk("late", 5))  # must not raise
    assert handle.drain()[0].text == "late"
