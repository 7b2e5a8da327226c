"""The cache tiers' health where a server's operator looks: /v1/cache/stats, /metrics and one log line."""

from __future__ import annotations

import logging

from faults import use_up_inodes
from mlxkv.connectors.disk.connector import DiskKVCacheConnector
from server_support import openai_client, raw, running_server

USER = [{"role": "user", "content": "Name two rivers and one fact about each."}]


def test_an_ssd_tier_restarted_out_of_inodes_shows_in_stats_metrics_and_one_line(llama_dir, oracle, tmpfs,
                                                                                 caplog):
    mnt = tmpfs("4m", inodes=64)
    engine_dir = mnt / "kv"
    DiskKVCacheConnector(engine_dir, bytes(32), block_size=8, num_layers=1, dtype="float32").close()  # made before
    use_up_inodes(mnt)
    expected = oracle.chat(USER, max_tokens=12)
    with caplog.at_level(logging.WARNING), running_server(llama_dir, disk_tier=str(engine_dir)) as server:
        for _ in range(2):
            reply = openai_client(server).chat.completions.create(model="x", messages=USER, max_tokens=12)
            assert reply.choices[0].message.content == expected.text
        _, stats, _ = raw(server, "GET", "/v1/cache/stats")
        _, metrics, _ = raw(server, "GET", "/metrics")
    disk = stats["connector"]["disk"]
    assert disk["state"] == "dropping-writes" and "out of inodes" in disk["reason"]
    assert 'mlxkv_tier_state{tier="disk",state="dropping-writes"} 1' in metrics
    assert 'mlxkv_tier_state{tier="disk",state="ok"} 0' in metrics
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "SSD tier" in r.getMessage()]
    assert said == [f"SSD tier dropping writes: out of inodes (No space left on device): {engine_dir}"]
