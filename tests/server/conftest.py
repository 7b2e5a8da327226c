import pytest

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from server_support import CACHE, running_server


@pytest.fixture(scope="package")
def server(llama_dir):
    """One real server on the tiny llama for the package's tests; each test uses its own prompts."""
    with running_server(llama_dir) as s:
        yield s


@pytest.fixture(scope="package")
def oracle(llama_dir):
    """Engine.chat in this process, on the same model and pool shape: the answers to match."""
    with Engine.load(llama_dir, CacheConfig(**CACHE)) as engine:
        yield engine
