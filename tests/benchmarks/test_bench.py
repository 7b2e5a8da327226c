"""`mlxkv bench engine` at a tiny size: rows are well formed. No speed is asserted."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import redis

from mlxkv import cli
from mlxkv.benchmarks import engine as bench
from mlxkv.benchmarks.report import DISTRIBUTED_NOT_RUN
from mlxkv.errors import MlxkvError
from mlxkv.models.tiny import TinyModelSpec

CONTEXT = 64
KEYS = {"name", "unit", "ours", "baseline", "baseline_name", "ratio", "goal", "met", "note", "model"}


def _check_rows(rows: list[dict], block_size: int = bench.BLOCK_SIZE) -> None:
    assert len(rows) == 2 + len(bench.kv_lengths(CONTEXT, block_size))
    for row in rows:
        assert KEYS <= row.keys(), row
        for key in ("ours", "baseline", "ratio"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    decode, ttft, *kv = rows
    # Correctness, not speed: the peer is the oracle for greedy tokens.
    assert decode["unit"] == "tok/s" and decode["tokens_identical"]
    assert ttft["unit"] == "ms" and ttft["cached_tokens"] == CONTEXT
    for row in kv:
        assert 0 <= row["waste_tokens"] < block_size and row["met"]
        assert row["blocks"] * block_size == row["tokens"] + row["waste_tokens"]
        assert row["mlx_lm_bytes"] >= row["baseline"] * 1024


def test_engine_rows(llama_dir):
    rows = bench.run_engine_benchmark(context=CONTEXT, decode_tokens=6, rounds=2, model=llama_dir, log=lambda _: None)
    _check_rows(rows)
    table = bench.format_rows(rows)
    assert all(row["name"] in table for row in rows)
    assert "greedy tokens identical" in table


def test_cli_bench_json(monkeypatch, capsys):
    # The bench model, shrunk: written into the test's private cache dir.
    monkeypatch.setattr(bench, "BENCH_SPEC", TinyModelSpec(family="llama", seed=7))
    monkeypatch.setattr(bench, "ROUNDS", 1)
    assert cli.main(["bench", "engine", "--context", str(CONTEXT), "--decode-tokens", "4", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(row.pop("suite") == "engine" for row in rows)
    _check_rows(rows)


def test_bad_sizes_are_user_errors(llama_dir):
    with pytest.raises(MlxkvError):
        bench.run_engine_benchmark(context=CONTEXT, decode_tokens=1, model=llama_dir)
    with pytest.raises(MlxkvError, match="context"):
        bench.run_engine_benchmark(context=10**6, decode_tokens=4, model=llama_dir)


def _has_direct_io(directory) -> bool:
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / "direct-probe"
    probe.write_bytes(b"\0" * 4096)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        return False
    return True


@pytest.mark.slow  # its gap rows build a model with 128 KiB of KV per token
def test_tiers_benchmark_rows(tmp_path, redis_server):
    from mlxkv.benchmarks.tiers import run_tiers_benchmark
    from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

    model = write_tiny_model(tmp_path / "hd32", TinyModelSpec(head_dim=32, seed=3))
    server = redis_server()
    rows = run_tiers_benchmark(model=str(model), restore_tokens=64, read_blocks=8, directory=str(tmp_path),
                               log=lambda *_: None, remote_tier=server.url, gap_tokens=64, choice_tokens=64)
    assert [r["name"] for r in rows] == ["restore 64 tok from SSD", "SSD tier read", "memory tier hydrate",
                                         "memory tier 8-bit", "restore 64 tok from remote", "remote tier read",
                                         "restore-or-recompute TTFT, SSD at 25 MB/s",
                                         "restore-or-recompute TTFT, SSD at 2 MB/s",
                                         "stream gap, pool hit", "stream gap, SSD restore"]
    assert "64 tokens from disk" in rows[-1]["note"] and "128 KiB of KV per token" in rows[-2]["note"]
    for r in rows:
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0
    assert "64 tokens hydrated from disk" in rows[0]["note"]
    assert "64 tokens hydrated from the server" in rows[4]["note"]
    assert list(redis.Redis.from_url(server.url).scan_iter()) == []  # the bench's keys are gone after it
    read = rows[1]
    # The O_DIRECT raw read is measured where the directory's file system has O_DIRECT.
    assert (read["raw_direct_mb_s"] > 0) == ("O_DIRECT read" in read["note"])
    if _has_direct_io(tmp_path):
        assert read["raw_direct_mb_s"] > 0


def test_windows_benchmark_rows():
    from mlxkv.benchmarks.windows import KV_GOAL, run_windows_benchmark

    spec = TinyModelSpec(family="gemma3_text", num_layers=6, sliding_pattern=6, sliding_window=32, seed=4)
    gemma4 = TinyModelSpec(family="gemma4_text", num_layers=5, sliding_pattern=5, sliding_window=32, seed=4)
    rows = run_windows_benchmark(context=200, prefix=96, rounds=1, spec=spec, gemma4=gemma4, log=lambda _: None)
    kv, ttft, kv4 = rows
    assert "gemma3_text 6 layers" in kv["model"] and "sliding32:0" in kv["model"]
    # Bytes, not speed: the sliding layers hold their window, as mlx-lm's RotatingKVCache does.
    assert kv["ratio"] <= KV_GOAL and kv["met"]
    assert kv["all_full_bytes"] > 2 * kv["ours"] * 2**20
    assert ttft["cached_tokens"] == 96
    # Gemma 4's wider global head shares pages with the sliding layers' (two per page layer).
    assert "sliding32[k2x16v2x16/2]:0,1" in kv4["model"] and "full[k2x32v2x32/1]:4" in kv4["model"]
    assert kv4["ratio"] <= KV_GOAL and kv4["met"], kv4


def test_hybrid_benchmark_rows():
    from mlxkv.benchmarks.hybrid import run_hybrid_benchmark

    spec = TinyModelSpec(family="qwen3_next", num_layers=4, sliding_pattern=4, seed=4)
    prefill, turn, ssd = run_hybrid_benchmark(prompt_tokens=72, rounds=1, spec=spec, log=lambda _: None)
    assert "recurrent:0x2,1x2,2x2" in prefill["model"]
    for r in (prefill, turn, ssd):
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
    # The second turn resumes at the first turn's last full block (72 + 32 tokens).
    assert turn["cached_tokens"] == (72 + 32) // 16 * 16
    # Three turns: a checkpoint written through at each one's end, and their KV.
    assert ssd["checkpoint_bytes"] > 0 and ssd["kv_bytes"] > 0


def test_memory_benchmark_row(llama_dir):
    from mlxkv.benchmarks.memory import run_memory_benchmark

    (r,) = run_memory_benchmark(model=llama_dir, log=lambda _: None)
    assert r["tokens_identical"] and math.isfinite(r["ratio"]) and r["ratio"] > 0
    assert "16 of " in r["note"]  # the pool made one growth step's blocks, not its budget


@pytest.mark.slow
def test_the_mac_report_runs_end_to_end_here_on_the_cpu_path(tmp_path):
    from mlxkv.benchmarks.report import ReportSizes, run_report
    from mlxkv.models.tiny import write_tiny_model

    model = str(write_tiny_model(tmp_path / "hd32", TinyModelSpec(head_dim=32, seed=3)))
    sizes = ReportSizes(kernel_contexts=(64,), kernel_batches=(1, 2), kernel_queries=(1, 4), context=64, decode_tokens=4, rounds=1,
                        restore_tokens=64, read_blocks=8, model=model, gap_tokens=64, choice_tokens=64)
    json_path, md_path = run_report(tmp_path / "report", sizes, log=lambda *_: None)
    report = json.loads(json_path.read_text())
    machine = report["machine"]
    assert {"chip", "memory_gib", "os", "mlx", "mlx_lm", "attention"} <= machine.keys() and machine["mlx"]
    assert set(report["suites"]) == {"kernels", "tiers", "engine", "memory"}
    assert [(r["context"], r["batch"], r["queries"]) for r in report["suites"]["kernels"]] == [
        (64, 1, 1), (64, 1, 4), (64, 2, 1), (64, 2, 4)]
    assert all(math.isfinite(r["ratio"]) for name in ("tiers", "engine", "memory") for r in report["suites"][name])
    text = md_path.read_text()
    for heading in ("# mlxkv report", "## Paged kernel decode / SDPA", "## tiers", "## engine", "## memory"):
        assert heading in text
    assert f"| chip | {machine['chip']} |" in text
    assert DISTRIBUTED_NOT_RUN in text  # no hostfile: the distributed rows say how to run them


def _distributed_record() -> dict:
    """A rank 0 record of `bench distributed` (distributed_rank.measure), made up."""
    return dict(model="llama 4 layers", tokens=[1, 2, 3], decode_tps=10.0, layers=4, hidden=256, dtype_bytes=2,
                allreduce_bytes_per_token=4096.0, steps=66, step_s=2.0, plan_s=0.05, plan_wait_s=0.01,
                plan_exchanges=66, plan_collectives=68, plan_bytes=68_000)


def test_the_mac_report_runs_the_distributed_rows_on_a_hostfiles_set_first(tmp_path, monkeypatch):
    """A fake runner in place of every suite: given a hostfile, the report asks the distributed
    suite for that set, before the others, and prints its rows; docs/distributed.md names the
    command the report gives when it has none."""
    from mlxkv.benchmarks import distributed, engine, kernels, memory, tiers
    from mlxkv.benchmarks.report import markdown, run_report

    order, asked = [], []

    def runner(name, rows=()):
        return lambda *args, **kwargs: order.append(name) or asked.append(args) or list(rows)

    for module, run in ((kernels, "run_kernel_benchmark"), (tiers, "run_tiers_benchmark"),
                        (engine, "run_engine_benchmark"), (memory, "run_memory_benchmark")):
        monkeypatch.setattr(module, run, runner(module.__name__))
    one = two = _distributed_record()
    monkeypatch.setattr(distributed, "run_distributed_benchmark",
                        runner("distributed", distributed._rows(one, two, shared_cpu=False)))
    (tmp_path / "hosts.json").write_text("[]")
    json_path, md_path = run_report(tmp_path / "r", log=lambda *_: None, hostfile=str(tmp_path / "hosts.json"),
                                    backend="jaccl")
    assert order[0] == "distributed" and asked[0] == (str(tmp_path / "hosts.json"), "jaccl")
    rows = json.loads(json_path.read_text())["suites"]["distributed"]
    assert [r["name"] for r in rows] == ["greedy tokens, 2 ranks", "plan collective / step time",
                                         "all-reduced bytes per token", "decode tok/s, 2 ranks vs 1"]
    assert all(KEYS <= r.keys() for r in rows) and rows[2]["met"]  # 4096 = 2 x 4 x 256 x 2
    text = md_path.read_text()
    assert "## distributed" in text and "| greedy tokens, 2 ranks | 1 tokens equal |" in text
    assert DISTRIBUTED_NOT_RUN not in text and "Model: llama 4 layers." in text
    report = json.loads(json_path.read_text())
    del report["suites"]["distributed"]  # as a report without a hostfile has it
    assert DISTRIBUTED_NOT_RUN in markdown(report)
    docs = (Path(__file__).parents[2] / "docs" / "distributed.md").read_text()
    assert DISTRIBUTED_NOT_RUN.split("On two Macs: ")[1].split(" (")[0] in docs


@pytest.mark.parametrize("argv, error", [
    (["bench", "mac", "--hostfile", "no-such-hosts.json"], "no hostfile no-such-hosts.json"),
    (["bench", "engine", "--hostfile", "hosts.json"], "--hostfile is a flag of `mlxkv bench distributed`"),
    (["bench", "distributed", "--hostfile", "no-such-hosts.json"], "bench distributed: no hostfile no-such-hosts.json"),
])
def test_a_hostfile_in_the_wrong_place_is_a_one_line_error(argv, error, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mlxkv: error: {error}") and "\n" not in err
    assert not list(tmp_path.iterdir())  # no empty report left behind


def test_rank_zeros_record_is_found_among_what_mlx_launch_prints():
    from mlxkv.benchmarks.distributed import _record

    assert _record('{"not": "it"}\nrank 1 of 2 ready\n{"tokens": [1]}\n[launch] done\n') == {"tokens": [1]}
    with pytest.raises(MlxkvError, match="rank 0 printed no record"):
        _record("ssh: connect to host mac-b.local: Connection refused\n")


def test_an_unwritable_report_is_a_one_line_error_before_any_benchmark(tmp_path, capsys):
    assert cli.main(["bench", "mac", "--report", str(tmp_path / "no-such-dir" / "report")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlxkv: error: cannot write the report") and "\n" not in err


@pytest.mark.slow
def test_serve_benchmark_rows(llama_dir):
    """Both servers in their own processes at a tiny size: rows are well formed, replies agree."""
    from mlxkv.benchmarks.serve import Switch, Workload, run_serve_benchmark

    rows = run_serve_benchmark(llama_dir, (Workload(sessions=2, turns=2, system_words=60, tool_words=10,
                                                    reply_tokens=4),), Switch(context_words=300, reply_tokens=2))
    assert [r["name"] for r in rows] == ["agent wall time", "median warm TTFT", "median TTFT after restart",
                                         "TTFT after unload and reload", "model switch (unload, load, 1 token)"]
    for row in rows:
        assert KEYS <= row.keys() and row["ours"] > 0 and row["baseline"] > 0, row
    assert rows[0]["first_replies_identical"]


@pytest.mark.slow
def test_speculative_benchmark_rows(llama_dir, monkeypatch):
    from mlxkv.benchmarks import speculative

    monkeypatch.setattr(speculative, "EDIT_LINES", 25)  # the tiny model reads bytes: a short file
    monkeypatch.setattr(speculative, "EDIT_TOKENS", 24)
    monkeypatch.setattr(speculative, "CHAT_TOKENS", 12)
    monkeypatch.setattr(speculative, "_is_quantized", lambda model: True)  # the float copy's rows, on a float model
    rows = speculative.run_speculative_benchmark(llama_dir, rounds=1, log=lambda message: None)
    names = ["code edit (lookup)", "free chat (lookup)", "batch of 8 code edits (lookup)", "code edit (draft: itself)",
             "code edit (draft: itself, every step)"]
    assert [r["name"] for r in rows] == names + [n.replace(")", ", float32 copy)") for n in names]
    assert all(r["tokens_identical"] for r in rows)
    assert rows[4]["acceptance"] == 1.0 and rows[9]["acceptance"] == 1.0  # a model drafting for itself is always right


def test_the_serve_benches_without_the_openai_client_say_how_to_install_it(monkeypatch):
    """openai is a dev dependency: a plain install running `mlxkv bench serve` gets one line, not an ImportError."""
    from mlxkv.benchmarks import serve

    monkeypatch.setitem(__import__("sys").modules, "openai", None)  # what `import openai` meets when it is missing
    with pytest.raises(MlxkvError, match="pip install openai"):
        serve._Process(["true"], 1, "m")
