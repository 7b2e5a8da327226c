"""A stream opened while its model loads: the model's lease is never lost."""

import asyncio
from types import SimpleNamespace

from mlxkv.server.loading_stream import KEEPALIVE_LINE, _after_load


def _request(released: list):
    models = SimpleNamespace(release=released.append)
    app = SimpleNamespace(state=SimpleNamespace(keepalive=0.01, models=models))
    return SimpleNamespace(url=SimpleNamespace(path="/v1/chat/completions"), app=app, state=SimpleNamespace())


async def _handler(request):
    raise AssertionError("the client left: the request is never handled")


def test_a_client_gone_in_the_turn_its_model_loaded_gives_the_lease_back():
    async def run():
        released = []
        lease = asyncio.get_running_loop().create_future()
        stream = _after_load(_request(released), _handler, lease)
        assert await stream.__anext__() == KEEPALIVE_LINE  # waiting for the load
        lease.set_result("slot")  # the load finished and leased the model to this stream...
        await stream.aclose()  # ...in the turn its client went away
        await asyncio.sleep(0)
        return released

    assert asyncio.run(run()) == ["slot"]


def test_a_client_gone_while_its_model_loads_gives_the_lease_back_once_taken():
    async def run():
        released = []
        lease = asyncio.get_running_loop().create_future()
        stream = _after_load(_request(released), _handler, lease)
        await stream.__anext__()
        await stream.aclose()
        assert released == []  # nothing leased yet
        lease.set_result("slot")
        await asyncio.sleep(0)
        return released

    assert asyncio.run(run()) == ["slot"]
