"""A stream opened while its model loads: the model's lease is never lost."""

import asyncio
from types import SimpleNamespace

import pytest
from starlette.requests import ClientDisconnect

from mlxkv.server.loading_stream import KEEPALIVE_LINE, loading_stream

SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}}


def _request(released: list):
    models = SimpleNamespace(release=released.append)
    app = SimpleNamespace(state=SimpleNamespace(keepalive=0.01, models=models))
    return SimpleNamespace(url=SimpleNamespace(path="/v1/chat/completions"), app=app, state=SimpleNamespace())


async def _handler(request):
    raise AssertionError("the client left: the request is never handled")


async def _receive():
    return {"type": "http.disconnect"}


def _client(lease, leave_after: int):
    """An ASGI send that fails (the client has gone) at its `leave_after`th message, after
    `on_leave` ran: the load finishing in that turn, or not."""
    sent = []

    async def send(message):
        if len(sent) == leave_after:
            lease.on_leave()
            raise OSError("the client has gone")
        sent.append(message)

    return send


async def _serve(leave_after: int, leased_on_leave: bool) -> list:
    released = []
    task = asyncio.get_running_loop().create_future()
    task.on_leave = (lambda: task.set_result("slot")) if leased_on_leave else (lambda: None)
    response = loading_stream(_request(released), _handler, task)
    with pytest.raises(ClientDisconnect):
        await response(SCOPE, _receive, _client(task, leave_after))
    await asyncio.sleep(0)
    if not task.done():
        assert released == []  # nothing leased yet
        task.set_result("slot")
        await asyncio.sleep(0)
    return released


def test_a_client_gone_in_the_turn_its_model_loaded_gives_the_lease_back():
    # headers and a keep-alive went out; the load finished as the client left
    assert asyncio.run(_serve(leave_after=2, leased_on_leave=True)) == ["slot"]


def test_a_client_gone_while_its_model_loads_gives_the_lease_back_once_taken():
    assert asyncio.run(_serve(leave_after=2, leased_on_leave=False)) == ["slot"]


def test_a_client_gone_before_the_headers_went_out_gives_the_lease_back():
    """The headers' send failed, so the stream's generator never started: the lease still goes back."""
    assert asyncio.run(_serve(leave_after=0, leased_on_leave=False)) == ["slot"]
    assert asyncio.run(_serve(leave_after=0, leased_on_leave=True)) == ["slot"]


def test_the_keep_alives_go_out_while_the_model_loads():
    async def run():
        task = asyncio.get_running_loop().create_future()
        task.on_leave = lambda: None
        sent = []

        async def send(message):
            sent.append(message)
            if len(sent) == 3:
                raise OSError("the client has gone")

        with pytest.raises(ClientDisconnect):
            await loading_stream(_request([]), _handler, task)(SCOPE, _receive, send)
        task.set_result("slot")
        return sent

    sent = asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[1]["body"] == KEEPALIVE_LINE.encode()
