"""Fixtures of the kernel tests: where kernels run (the GPU on Metal, else the MSL harness)."""

from __future__ import annotations

import mlxkv  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest

from mlxkv.attention import kernels, self_check
from msl.harness import SKIP_REASON, clang_available, shared_harness
from msl.paged import instantiation_launches


@pytest.fixture(scope="session")
def device():
    """None on Metal (kernels run on the GPU), else the harness."""
    if mx.metal.is_available():
        return None
    if not clang_available():
        pytest.skip(SKIP_REASON)
    return shared_harness()


@pytest.fixture(scope="session")
def all_built(device):
    """Every instantiation compiled up front, on all cores (the full run needs them all)."""
    if device is not None:
        launches = instantiation_launches().values()
        device.build_many([(device.translation_unit(launch), None) for launch in launches])


@pytest.fixture
def on_device(device, monkeypatch):
    if device is not None:
        monkeypatch.setattr(kernels, "run_launch", device.run)



_checks: dict = {}


@pytest.fixture
def checked_once(monkeypatch):
    """self_check.check_kernels answered once per (shape, runner) in the session, for tests of
    what follows a check (the speed gate, doctor): the check itself is test_self_check.py's."""
    check = self_check.check_kernels

    def once(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in _checks:
            _checks[key] = check(*args, **kwargs)
        return _checks[key]

    monkeypatch.setattr(self_check, "check_kernels", once)


@pytest.fixture(autouse=True)
def _own_gate_store(tmp_path, monkeypatch):
    """Each test's speed gate stores its choice in its own cache dir: a gate one test timed
    with canned times is never another's."""
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path / "cache"))
