import pytest

from server_support import running_server


@pytest.fixture(scope="package")
def server(llama_dir):
    """One real server on the tiny llama for the package's tests; each test uses its own prompts."""
    with running_server(llama_dir) as s:
        yield s
