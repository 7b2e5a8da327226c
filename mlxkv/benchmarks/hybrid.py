"""`mlxkv bench hybrid`: a recurrent/attention hybrid's prefill, next turn and SSD bytes.

On a Qwen3-Next-shaped model (three gated-delta-net layers to one full
attention layer; the linear layers' state is 32 value heads of 128 x 128,
2 MiB each in fp32; 16 query / 2 KV heads of 256), measured in one run:

- cold prefill tok/s with checkpoints on against mlx-lm's own prefill of
  the same prompt, rounds alternated (the checkpoints cut a prefill chunk
  at the prompt's last full block);
- warm/cold TTFT of a chat's second turn: the first turn's prompt and reply
  come back through the checkpoint at the reply's last full block;
- bytes the SSD tier writes per 1k prompt tokens over a three-turn chat:
  checkpoints against the KV blocks written beside them (goal: at most
  half, the bound of the default checkpoint write ratio of 2).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from pathlib import Path

from mlx_lm.generate import stream_generate

from mlxkv.benchmarks.engine import (
    BENCH_SPEC, BLOCK_SIZE, TTFT_GOAL, _stderr, _tokens, bench_model_path, describe_model,
)
from mlxkv.benchmarks.rows import format_rows, row  # noqa: F401  (format_rows: the suite's printer)
from mlxkv.config import CacheConfig
from mlxkv.connectors.disk.cache_dir import block_files
from mlxkv.connectors.disk.run_file import read_metadata
from mlxkv.connectors.disk.state_file import STATE_FORMAT
from mlxkv.engine.engine import Engine
from mlxkv.models.loader import load_model
from mlxkv.models.tiny import TinyModelSpec

# The bench model (engine.py) with Qwen3-Next's attention shape and 3:1 layer pattern.
QWEN3_NEXT_SPEC = dataclasses.replace(BENCH_SPEC, family="qwen3_next", num_heads=16, head_dim=256,
                                      sliding_pattern=4)
PREFILL_GOAL = 0.95  # our cold prefill tok/s over mlx-lm's, at least
REPLY_TOKENS = 32
NEW_TOKENS = 32  # the user's next message
SSD_GOAL = 0.5  # checkpoint bytes written over KV bytes written, at most


def run_hybrid_benchmark(prompt_tokens: int = 512, rounds: int = 3, spec: TinyModelSpec = QWEN3_NEXT_SPEC,
                         log=None) -> list[dict]:
    """Rows of {name, unit, ours, baseline, ratio, goal, met, note, ...}; asserts no speed."""
    log = log or _stderr
    path = str(bench_model_path(spec, log))
    loaded = load_model(path)
    engine = Engine(loaded, CacheConfig(block_size=BLOCK_SIZE, memory_tier_bytes=0))
    described = describe_model(engine) + f"; groups: {engine.coordinator.group_layout.describe()}"
    log(described)
    vocab = loaded.config["vocab_size"]
    prompt = _tokens(prompt_tokens, vocab, seed=3)
    log(f"cold prefill of {prompt_tokens} tokens, {rounds} rounds per side ...")
    rows = [_prefill_row(engine, prompt, rounds)]
    log("second chat turn, warm and cold ...")
    rows.append(_turn_row(engine, prompt, rounds, vocab))
    log("SSD bytes over a three-turn chat ...")
    rows.append(_ssd_row(path, prompt, vocab))
    for r in rows:
        r["model"] = described
    return rows


def _prefill_row(engine: Engine, prompt: list[int], rounds: int) -> dict:
    model, tokenizer = engine.model, engine.tokenizer
    ours, theirs = [], []
    for r in range(rounds):
        # A new cache salt each round: nothing is hit.
        run_ours = lambda: ours.append(  # noqa: E731
            engine.generate(prompt, max_tokens=1, cache_salt=f"cold-{r}").stats.prompt_tokens_per_s)
        run_theirs = lambda: theirs.append(  # noqa: E731
            next(iter(stream_generate(model, tokenizer, prompt, max_tokens=1))).prompt_tps)
        for run in (run_ours, run_theirs) if r % 2 == 0 else (run_theirs, run_ours):
            run()
    ratio = statistics.median(o / t for o, t in zip(ours, theirs))
    return row(
        f"cold prefill, {len(prompt)} tok", "tok/s", statistics.median(ours), statistics.median(theirs),
        "mlx-lm stream_generate prefill", f">= {PREFILL_GOAL:.2f}", ratio >= PREFILL_GOAL,
        f"{rounds} alternated rounds, checkpoints on; ratio is the median of per-round ratios",
        ratio=ratio, samples_ours=ours, samples_baseline=theirs,
    )


def _turn_row(engine: Engine, prompt: list[int], rounds: int, vocab: int) -> dict:
    salt = "chat"
    reply = engine.generate(prompt, max_tokens=REPLY_TOKENS, cache_salt=salt).tokens
    turns = [prompt + reply + _tokens(NEW_TOKENS, vocab, seed=200 + i) for i in range(rounds)]
    warm = [engine.generate(t, max_tokens=1, cache_salt=salt).stats for t in turns]
    cold = [engine.generate(t, max_tokens=1, cache_salt=f"cold-turn-{i}").stats for i, t in enumerate(turns)]
    best_warm, best_cold = min(s.ttft_s for s in warm) * 1e3, min(s.ttft_s for s in cold) * 1e3
    hit = min(s.cached_tokens["pool"] for s in warm)
    return row(
        f"ttft, 2nd turn ({len(turns[0])} tok)", "ms", best_warm, best_cold, "same turn, cold",
        f"<= {TTFT_GOAL:.2f}", best_warm / best_cold <= TTFT_GOAL,
        f"best of {rounds} warm / {rounds} cold; {hit} tokens hit (the first turn to its reply's last full block)",
        cached_tokens=hit, prompt_tokens=len(turns[0]),
    )


def _ssd_row(path: str, prompt: list[int], vocab: int) -> dict:
    """Bytes the turns write through, against KV; the checkpoint a close (or idle) adds is reported apart.

    Since a short chat must survive a restart, an idle or closing engine
    writes each conversation's newest checkpoint once (cache/coordinator.py);
    that is one checkpoint per conversation, not per turn.
    """
    with tempfile.TemporaryDirectory() as disk:
        config = CacheConfig(block_size=BLOCK_SIZE, memory_tier_bytes=0, disk_tier=disk)
        with Engine(load_model(path), config) as engine:
            chat, computed = list(prompt), 0
            for turn in range(3):
                result = engine.generate(chat, max_tokens=REPLY_TOKENS)
                computed += result.stats.computed_tokens
                chat += result.tokens + _tokens(NEW_TOKENS, vocab, seed=300 + turn)
            engine.connector.flush(60)
            kv, states = _bytes_by_kind(Path(disk))
        at_close = _bytes_by_kind(Path(disk))[1] - states
    per_1k = 1000 / computed
    return row(
        "SSD bytes / 1k prompt tokens", "MiB", states * per_1k / 2**20, kv * per_1k / 2**20,
        "KV blocks written", f"<= {SSD_GOAL}", states <= SSD_GOAL * kv,
        f"3 turns, {computed} prompt tokens computed; checkpoints {states / 2**20:.1f} MiB, "
        f"KV {kv / 2**20:.1f} MiB during the turns; a request's checkpoint is written once the KV since the "
        f"last one on disk is {config.checkpoint_write_ratio:g}x its bytes; the close then wrote the "
        f"chat's newest checkpoint once ({at_close / 2**20:.1f} MiB), so it survives a restart",
        checkpoint_bytes=states, kv_bytes=kv, computed_tokens=computed, checkpoint_bytes_at_close=at_close,
    )


def _bytes_by_kind(root: Path) -> tuple[int, int]:
    kv = states = 0
    for fp_dir in root.iterdir():
        if not fp_dir.is_dir():
            continue
        for path, size in block_files(fp_dir):
            if read_metadata(path).get("format") == STATE_FORMAT:
                states += size
            else:
                kv += size
    return kv, states
