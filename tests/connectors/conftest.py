"""Fixtures of the tier tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def fast_backoff(monkeypatch):
    """The remote tier probes a down server after 50 ms, at most 200 ms apart: recoveries within a test's patience."""
    from mlxkv.connectors.remote import link

    monkeypatch.setattr(link, "BACKOFF_MIN_S", 0.05)
    monkeypatch.setattr(link, "BACKOFF_MAX_S", 0.2)
