"""Tests for the tiny random-weight model writer."""

import argparse
import dataclasses
import hashlib
import json
import os

import mlxkv  # noqa: F401  first, so its BLAS loads before mlx.core does
import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate
from mlx_lm.models.cache import make_prompt_cache

from mlxkv.models import tiny as tiny_model
from mlxkv.models.fetch import local_model
from mlxkv.errors import MlxkvError
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model
from mlxkv.models.tiny_families import MIN_LAYERS


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One model per family, shared by the tests that only read them."""
    root = tmp_path_factory.mktemp("families")
    # Seed 0 of qwen3_next happens to say end-of-text first; seed 1 does not.
    seeds = {"qwen3_next": 1}
    return {f: write_tiny_model(root / f, spec_of(f, seed=seeds.get(f, 0))) for f in tiny_model.FAMILIES}


def spec_of(family: str, **fields) -> TinyModelSpec:
    """The default spec of a family, with the layers it needs (Llama 4: a full layer every fourth)."""
    return TinyModelSpec(family=family, num_layers=max(2, MIN_LAYERS.get(family, 1)), **fields)


# The families of the newer cache rules, and their caches' types.
NEWER_RULES = {"deepseek_v32": {"CacheList"}, "llama4": {"ChunkedKVCache", "KVCache"}, "falcon_h1": {"CacheList"},
               "mamba2": {"ArraysCache"}}


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("family", list(tiny_model.FAMILIES))
def test_mlx_lm_loads_exactly_the_written_weights(written, family):
    model, _ = mlx_lm.load(str(written[family]))
    on_disk = mx.load(str(written[family] / "model.safetensors"))
    loaded = dict(tree_flatten(model.parameters()))
    assert loaded.keys() == on_disk.keys()
    for name, value in on_disk.items():
        assert mx.array_equal(loaded[name], value), name


@pytest.mark.parametrize("family", list(tiny_model.FAMILIES))
def test_greedy_generation_is_varied(written, family):
    model, tokenizer = mlx_lm.load(str(written[family]))
    prompt = tokenizer.encode("Once upon a time the cache")
    tokens = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=20)]
    assert len(tokens) >= 5  # random weights can emit eos, but not straight away
    assert len(set(tokens)) >= min(4, len(tokens) // 2), tokens


def test_windowed_families_slide_some_layers_by_the_spec_window_and_the_rest_use_plain_kv(written):
    for family, path in written.items():
        model, _ = mlx_lm.load(str(path))
        kinds = {(type(c).__name__, getattr(c, "max_size", None)) for c in make_prompt_cache(model)}
        if family in tiny_model.WINDOWED_FAMILIES:
            assert kinds == {("KVCache", None), ("RotatingKVCache", TinyModelSpec().sliding_window)}, family
        elif family in tiny_model.RECURRENT_FAMILIES:
            assert kinds == {("KVCache", None), ("ArraysCache", None)}, family
        elif family in NEWER_RULES:
            assert {k for k, _ in kinds} == NEWER_RULES[family], family
        else:
            assert kinds == {("KVCache", None)}, family


def test_same_spec_gives_identical_files(tmp_path):
    spec = TinyModelSpec(family="qwen3", seed=7)
    a = _digests(write_tiny_model(tmp_path / "a", spec))
    b = _digests(write_tiny_model(tmp_path / "b", spec))
    assert a == b
    assert set(a) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


def test_seed_changes_only_the_weights(tmp_path):
    a = _digests(write_tiny_model(tmp_path / "a", TinyModelSpec(seed=1)))
    b = _digests(write_tiny_model(tmp_path / "b", TinyModelSpec(seed=2)))
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_chat_template_and_eos(written):
    _, tokenizer = mlx_lm.load(str(written["llama"]))
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n"
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids


def test_tokenizer_round_trips_any_text(written):
    _, tokenizer = mlx_lm.load(str(written["llama"]))
    texts = ["Hello, world!", "tabs\tand\nnewlines  spaced", "naïve café 🙂 日本語", "x" * 300]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("vocab_size", [259, 2000])
def test_tokenizer_fills_the_vocab(tmp_path, vocab_size):
    path = write_tiny_model(tmp_path / "m", TinyModelSpec(vocab_size=vocab_size))
    _, tokenizer = mlx_lm.load(str(path))
    assert len(tokenizer) == vocab_size


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dtype(tmp_path, dtype):
    model, _ = mlx_lm.load(str(write_tiny_model(tmp_path / "m", TinyModelSpec(dtype=dtype))))
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {getattr(mx, dtype)}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"family": "gpt9"}, r"unknown model family 'gpt9'; choose one of: llama, "),
        ({"dtype": "int8"}, r"unknown dtype 'int8'; choose one of: float32"),
        ({"num_layers": 0}, r"num_layers must be an integer >= 1"),
        ({"hidden_size": 64.0}, r"hidden_size must be an integer"),
        ({"seed": -1}, r"seed must be an integer >= 0"),
        ({"num_heads": 4, "num_kv_heads": 3}, r"multiple of num_kv_heads"),
        ({"hidden_size": 66}, r"hidden_size \(66\) must be a multiple of num_heads"),
        ({"family": "qwen2", "head_dim": 32}, r"qwen2 needs head_dim == hidden_size / num_heads"),
        ({"head_dim": 15}, r"head_dim must be even"),
        ({"family": "gemma3_text", "num_layers": 1}, r"gemma3_text needs num_layers >= 2"),
        ({"vocab_size": 100}, r"vocab_size must be between 259"),
        ({"vocab_size": 10**6}, r"vocab_size must be between"),
        # MLX does not fail an allocation it cannot make: these were a segmentation fault.
        ({"hidden_size": 10**8}, r"GiB to build, more than this machine's"),
        ({"num_layers": 10**7, "hidden_size": 1024}, r"lower --hidden-size, --intermediate-size, --layers"),
    ],
)
def test_bad_spec_is_a_one_line_error(kwargs, message):
    with pytest.raises(MlxkvError, match=message) as info:
        TinyModelSpec(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("family", list(tiny_model.FAMILIES))
def test_the_size_check_counts_the_parameters_the_model_has(written, family):
    on_disk = mx.load(str(written[family] / "model.safetensors"))
    actual = sum(a.size for a in on_disk.values())
    # An upper bound: gemma ties its head to the embedding, starcoder2's MLP has two matrices.
    assert 0.95 * actual <= spec_of(family).approx_parameters <= 1.35 * actual


def test_custom_head_dim(tmp_path):
    spec = TinyModelSpec(family="qwen3", head_dim=32)
    model, _ = mlx_lm.load(str(write_tiny_model(tmp_path / "m", spec)))
    assert model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)


def test_refuses_a_non_empty_non_model_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(MlxkvError, match="not empty"):
        write_tiny_model(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(MlxkvError, match="not a directory"):
        write_tiny_model(tmp_path / "f")


def test_a_path_that_cannot_be_written_is_a_one_line_error(tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(MlxkvError, match=r"cannot write a model to .*f/m: File exists \(.*f\)"):
        write_tiny_model(tmp_path / "f" / "m")
    assert (tmp_path / "f").read_text() == "mine"


def test_fills_an_empty_dir_and_replaces_a_model(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    first = _digests(write_tiny_model(target, TinyModelSpec(seed=1)))
    second = _digests(write_tiny_model(target, TinyModelSpec(seed=2)))
    assert first["model.safetensors"] != second["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging dirs left


def test_tiny_model_is_created_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    path = tiny_model.tiny_model_path()
    assert path == tmp_path / "models" / "tiny"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert local_model("tiny") == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    config = json.loads((path / "config.json").read_text())
    shape = (config["model_type"], config["hidden_size"], config["vocab_size"])
    assert shape == ("llama", 128, 1024)
    assert local_model("mlx-community/Foo") is None


def test_demo_model_race_loser_uses_the_winner(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    build = tiny_model._build

    def build_then_lose(path, spec):
        staging = build(path, spec)
        os.rename(build(path, spec), path)  # another process renames its copy in first
        return staging

    monkeypatch.setattr(tiny_model, "_build", build_then_lose)
    path = tiny_model.tiny_model_path()
    assert tiny_model._is_model(path)
    assert [p.name for p in path.parent.iterdir()] == ["tiny"]


def test_stale_demo_model_is_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXKV_CACHE_DIR", str(tmp_path))
    old = dataclasses.replace(tiny_model.TINY_SPEC, vocab_size=300)
    write_tiny_model(tmp_path / "models" / "tiny", old)
    config = json.loads((tiny_model.tiny_model_path() / "config.json").read_text())
    assert config["vocab_size"] == tiny_model.TINY_SPEC.vocab_size


def test_cli_arguments_build_a_spec():
    parser = argparse.ArgumentParser()
    tiny_model.add_tiny_model_arguments(parser)
    assert tiny_model.spec_from_args(parser.parse_args(["out"])) == TinyModelSpec()
    args = parser.parse_args(
        ["out", "--family", "qwen3", "--layers", "3", "--hidden-size", "96", "--heads", "6",
         "--kv-heads", "3", "--head-dim", "32", "--vocab-size", "600",
         "--intermediate-size", "200", "--dtype", "bfloat16", "--seed", "5"]
    )
    assert args.dir == "out"
    assert tiny_model.spec_from_args(args) == TinyModelSpec(
        family="qwen3", num_layers=3, hidden_size=96, num_heads=6, num_kv_heads=3, head_dim=32,
        vocab_size=600, intermediate_size=200, dtype="bfloat16", seed=5,
    )


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss", "olmo3"])
def test_sliding_pattern_puts_a_full_layer_every_n(tmp_path, family):
    spec = TinyModelSpec(family=family, num_layers=6, sliding_pattern=3, sliding_window=64, seed=5)
    model, _ = mlx_lm.load(str(write_tiny_model(tmp_path / family, spec)))
    kinds = [type(c).__name__ for c in make_prompt_cache(model)]
    assert kinds == ["RotatingKVCache", "RotatingKVCache", "KVCache"] * 2


def test_random_weights_do_not_depend_on_the_global_rng():
    """A class that draws a vector at init (LLaVA's image_newline) gets it from the seed too: with
    it left as drawn, a tiny model depended on what earlier tests took from the global RNG."""
    import mlx.nn as nn

    class WithVector(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.newline = mx.random.normal((4,))
            self.norm = nn.RMSNorm(4)

    def drawn(global_seed):
        mx.random.seed(global_seed)
        return tiny_model.random_weights(WithVector(), seed=3)

    a, b = drawn(1), drawn(2)
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    assert mx.array_equal(a["norm.weight"], mx.ones(4)).item()  # constants stay as the class made them
