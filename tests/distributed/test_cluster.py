"""Joining a set of ranks: a process not started as a rank is told how to start it."""

import pytest

from mlxkv.distributed.cluster import join, launched
from mlxkv.errors import MlxkvError


def test_a_rank_is_recognised_by_the_launch_environment():
    assert launched({"MLX_RANK": "1", "MLX_HOSTFILE": "hosts.json"})
    assert not launched({"MLX_HOSTFILE": "hosts.json"})
    assert not launched({"MLX_RANK": "0"})


def test_a_process_not_started_as_a_rank_gets_the_command_to_start_it():
    with pytest.raises(MlxkvError, match="mlx.launch --hostfile FILE"):
        join("ring", env={})
    with pytest.raises(MlxkvError, match="unknown distributed back-end 'tcp'"):
        join("tcp", env={})


def test_a_hostfile_that_cannot_connect_is_one_line(tmp_path, monkeypatch):
    hosts = tmp_path / "hosts.json"
    hosts.write_text("not json")
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_HOSTFILE", str(hosts))  # MLX reads the environment itself
    with pytest.raises(MlxkvError, match="could not join the distributed set \\(ring\\): ") as error:
        join("ring")
    assert "\n" not in str(error.value)
