"""Round trips through the GGUF import: tiny models of each family written as llama.cpp
writes them (its names, its q/k permutation for llama, Gemma's norms plus one), in
K-quants and others, imported, and run: the greedy tokens of the weights the file holds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V
from mlx.utils import tree_flatten
from mlx_lm.generate import stream_generate

from gguf_export import write_gguf
from mlxkv.config import CacheConfig
from mlxkv.engine.engine import Engine
from mlxkv.errors import MlxkvError
from mlxkv.models import compat
from mlxkv.models.fetch import local_model
from mlxkv.models.tiny import TinyModelSpec, write_tiny_model

PROMPT = [(7 * i + 3) % 400 + 3 for i in range(40)]
CACHE = dict(block_size=16, num_blocks=256, memory_tier_bytes=0)
# Rows of 256 and more: K-quant blocks are 256 values.
WIDE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=512)


def q4_k_m(name, w):  # llama.cpp's Q4_K_M: Q6_K where precision matters most
    return T.Q6_K if any(s in name for s in ("v_proj", "down_proj", "lm_head")) else T.Q4_K


def q5_k_m(name, w):
    return T.Q8_0 if "embed" in name else T.Q6_K if "down_proj" in name else T.Q5_K


def q4_k_s(name, w):
    return T.Q6_K if "embed" in name or "lm_head" in name else T.Q4_K


def q3_k(name, w):
    return T.Q8_0 if "embed" in name else T.Q3_K if "mlp" in name else T.Q5_K


def q2_k(name, w):
    return T.Q6_K if "embed" in name or "lm_head" in name else T.Q2_K if "mlp" in name else T.Q4_K


def with_random_norms(model_dir: str, seed: int) -> dict[str, np.ndarray]:
    """The model's weights with its norm scales drawn (a tiny model's are all ones,
    which would hide a norm convention gone wrong)."""
    rng = np.random.default_rng(seed)
    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(f"{model_dir}/model.safetensors").items()}
    for name, w in weights.items():
        if name.endswith("norm.weight"):
            weights[name] = (w + 0.3 * rng.normal(size=w.shape)).astype(np.float32)
    return weights


def reference_dir(model_dir: str, held: dict, directory) -> str:
    """The original model directory holding the weights the GGUF holds."""
    shutil.copytree(model_dir, directory)
    mx.save_safetensors(str(directory / "model.safetensors"), {k: mx.array(v) for k, v in held.items()},
                        metadata={"format": "mlx"})
    return str(directory)


def logits(path: str) -> np.ndarray:
    model, _ = mlx_lm.load(path)
    return np.array(model(mx.array([PROMPT]))[0].astype(mx.float32))


def imported_and_reference(tmp_path, model_dir, arch, choose, extra=None, seed=0, extra_tensors=None):
    original = with_random_norms(model_dir, seed)
    held = write_gguf(model_dir, tmp_path / f"{arch}.gguf", arch, choose, extra, weights=original,
                      extra_tensors=extra_tensors)
    imported = local_model(str(tmp_path / f"{arch}.gguf"))
    return imported, reference_dir(model_dir, held, tmp_path / "reference"), original


def round_trip(tmp_path, model_dir, arch, choose, extra=None, seed=0, extra_tensors=None):
    imported, reference, original = imported_and_reference(tmp_path, model_dir, arch, choose, extra, seed,
                                                           extra_tensors)
    model, tokenizer = mlx_lm.load(reference)
    expected = [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=12)]
    with Engine.load(imported, CacheConfig(**CACHE)) as engine:
        assert engine.generate(PROMPT, max_tokens=12).tokens == expected
    return imported, reference, original


def within_own_error(imported, reference, original_dir, original, tmp_path):
    """The import's logits differ from those of the weights the file holds by less than
    the file's own quantization moved them from the original weights."""
    unquantized = reference_dir(original_dir, original, tmp_path / "unquantized")
    ref = logits(reference)
    assert np.abs(logits(imported) - ref).max() < np.abs(logits(unquantized) - ref).max()


@pytest.fixture(scope="module")
def wide_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    specs = {"llama": TinyModelSpec(family="llama", seed=11, **WIDE),
             "qwen3": TinyModelSpec(family="qwen3", seed=12, **WIDE),
             # llama.cpp's gemma3: a full-attention layer every 6th
             "gemma3": TinyModelSpec(family="gemma3_text", seed=13, num_layers=6, sliding_pattern=6, **WIDE)}
    return {name: str(write_tiny_model(root / name, spec)) for name, spec in specs.items()}


GEMMA3_META = {"attention.sliding_window": (32, V.UINT32)}


@pytest.mark.parametrize("arch,choose", [("llama", q4_k_m), ("qwen3", q5_k_m), ("gemma3", q4_k_s)])
def test_k_quant_models_round_trip_within_their_own_error(wide_dirs, tmp_path, arch, choose):
    extra = GEMMA3_META if arch == "gemma3" else None
    imported, reference, original = round_trip(tmp_path, wide_dirs[arch], arch, choose, extra)
    within_own_error(imported, reference, wide_dirs[arch], original, tmp_path)
    config = json.loads(open(f"{imported}/config.json").read())
    assert config["rope_traditional"] == (arch == "llama")  # only llama.cpp's llama permutes q and k
    bits = {m: q["bits"] for m, q in config["quantization"].items() if isinstance(q, dict)}
    if arch == "llama":  # Q4_K at 4 bits; Q6_K at 8, per tensor
        assert config["quantization"]["bits"] == 4
        assert bits["model.layers.0.self_attn.v_proj"] == bits["lm_head"] == 8


@pytest.mark.parametrize("arch,choose", [("qwen3", q3_k), ("gemma3", q2_k)])
def test_requantized_k_quants_stay_within_their_own_error(wide_dirs, tmp_path, arch, choose):
    """Q2_K and Q3_K (a scale per 16 values) are requantized: logits move by up to about
    a fifth of the file's own error, enough to flip a random model's near-ties, so
    the greedy tokens are not compared; a wrong convention would move them by more."""
    extra = GEMMA3_META if arch == "gemma3" else None
    imported, reference, original = imported_and_reference(tmp_path, wide_dirs[arch], arch, choose, extra)
    within_own_error(imported, reference, wide_dirs[arch], original, tmp_path)


def write_family_model(directory, family: str, config: dict, tokenizer_dir: str) -> str:
    """A random-weight model of an mlx-lm family tiny.py does not write, with the tiny tokenizer."""
    shutil.copytree(tokenizer_dir, directory)
    model_class, args_class = compat.model_classes(family)
    config = {**json.loads((directory / "config.json").read_text()), **config, "model_type": family}
    model = model_class(args_class.from_dict(config))
    keys = mx.random.split(mx.random.key(5), 256)
    weights = {n: (mx.random.normal(v.shape, key=keys[i]) / v.shape[-1] ** 0.5 if v.ndim >= 2 else v)
               for i, (n, v) in enumerate(tree_flatten(model.parameters()))}
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_qwen2_phi3_and_mistral_round_trip(model_dirs, tmp_path):
    for family, arch in (("qwen2", "qwen2"), ("phi3", "phi3"), ("mistral", "llama")):
        run = tmp_path / family
        run.mkdir()
        round_trip(run, model_dirs[family], arch, lambda name, w: T.Q8_0)


def test_qwen3_moe_round_trips(llama_dir, tmp_path):
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
           "mlp_only_layers": [], "norm_topk_prob": True, "head_dim": 16, "tie_word_embeddings": False}
    model_dir = write_family_model(tmp_path / "moe", "qwen3_moe", moe, llama_dir)
    extra = {"expert_count": (4, V.UINT32), "expert_used_count": (2, V.UINT32), "expert_feed_forward_length": (64, V.UINT32)}
    round_trip(tmp_path, model_dir, "qwen3moe", lambda name, w: T.Q8_0 if "switch" in name else T.F32, extra)


def test_gemma2_round_trips_with_its_softcaps(llama_dir, tmp_path):
    gemma2 = {"head_dim": 16, "query_pre_attn_scalar": 16, "attn_logit_softcapping": 20.0,
              "final_logit_softcapping": 10.0, "tie_word_embeddings": True}
    model_dir = write_family_model(tmp_path / "gemma2", "gemma2", gemma2, llama_dir)
    extra = {"attn_logit_softcapping": (20.0, V.FLOAT32), "final_logit_softcapping": (10.0, V.FLOAT32)}
    imported, _, _ = round_trip(tmp_path, model_dir, "gemma2", lambda name, w: T.Q8_0, extra)
    config = json.loads(open(f"{imported}/config.json").read())
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (20.0, 10.0)
    assert config["query_pre_attn_scalar"] == 16 and config["model_type"] == "gemma2"


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def test_llama3_rope_scaling_comes_back_from_rope_freqs(llama_dir, tmp_path):
    """Llama 3.1+ files carry their rope scaling as per-frequency factors; mlx-lm's
    Llama3RoPE, built from the published parameters, gives the factors to write."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    model_dir = tmp_path / "llama3"
    shutil.copytree(llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(rope_theta=500000.0, rope_scaling=LLAMA3_SCALING, max_position_embeddings=131072)
    (model_dir / "config.json").write_text(json.dumps(config))
    dims, base = config["head_dim"], config["rope_theta"]
    rope = Llama3RoPE(dims, 131072, base=base, scaling_config=LLAMA3_SCALING)
    factors = np.array(rope._freqs) / base ** (np.arange(0, dims, 2) / dims)
    assert np.isclose(factors.max(), 8.0) and np.isclose(factors.min(), 1.0)
    imported, _, _ = round_trip(tmp_path, str(model_dir), "llama", lambda name, w: T.Q8_0,
                                extra_tensors={"rope_freqs.weight": factors})
    assert json.loads(open(f"{imported}/config.json").read())["rope_scaling"] == LLAMA3_SCALING
    factors[-1] = 3.0  # no set of Llama 3's parameters makes these
    write_gguf(str(model_dir), tmp_path / "odd.gguf", "llama", lambda name, w: T.Q8_0,
               extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(MlxkvError, match="cannot import odd.gguf: its rope_freqs tensor is not Llama 3's rope scaling"):
        local_model(str(tmp_path / "odd.gguf"))


def test_damaged_files_are_one_line_errors_and_leave_nothing_behind(llama_dir, tmp_path):
    whole = tmp_path / "whole.gguf"
    write_gguf(llama_dir, whole, "llama", lambda name, w: T.Q8_0)
    data = whole.read_bytes()
    cases = {"truncated.gguf": (data[: len(data) - 1000], "is truncated: tensor"),
             "header.gguf": (data[:200], "damaged GGUF header"),
             "version.gguf": (data[:4] + (9).to_bytes(4, "little") + data[8:], "GGUF version 9 is not supported"),
             "empty.gguf": (b"", "not a GGUF file")}
    for name, (content, words) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(MlxkvError, match=words) as error:
            local_model(str(tmp_path / name))
        assert str(error.value).startswith(f"cannot import {name}: ") and "\n" not in str(error.value)
    imports = {p.name for p in (Path(local_model(str(whole))).parent).iterdir()}
    assert not [n for n in imports if n.endswith(".tmp") or n.startswith(("gguf-truncated", "gguf-header"))]
