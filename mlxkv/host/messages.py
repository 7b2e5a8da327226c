"""What the engine thread's queue carries (engine_thread.py): a request, a call, or the close."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from mlxkv.host.request_handle import RequestHandle


@dataclass
class Submit:
    """A request, its prompt templated already (on the submitting thread)."""

    handle: RequestHandle
    prompt: object  # text or token ids
    options: dict


@dataclass
class Call:
    fn: Callable
    future: Future


@dataclass
class Close:
    pass
