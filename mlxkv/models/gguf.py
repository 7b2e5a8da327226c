"""GGUF files (LM Studio's, Ollama's, llama.cpp's) as mlx-lm model directories.

`mx.load(path, return_metadata=True)` reads a GGUF's tensors, its Q4_0,
Q4_1 and Q8_0 weights as MLX's affine quantization (weight, scales,
biases; groups of 32), and its metadata: the model's shape, the BPE
tokenizer (tokens and merges) and the chat template. This renames the
tensors to mlx-lm's llama names, writes config.json, tokenizer.json and
tokenizer_config.json, and keeps the result in the mlxkv cache, imported
once per file (by path, size and modification time).

Two things differ from a Hugging Face llama:
- llama.cpp stores q and k permuted for its rotary layout, which is
  mlx-lm's `rope_traditional: true` (no weights are moved);
- scales and biases are float16 in the file and float32 here: MLX's CPU
  back-end ran the float16 quantized matmul ~25x slower; on a GPU the
  cost is a few percent of a 4-bit model's bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from mlxkv.errors import MlxkvError, first_line
from mlxkv.system.paths import cache_root

ARCHITECTURES = ("llama",)  # mlx-lm's llama class runs these GGUF architectures unchanged
GROUP_SIZE = 32  # every GGUF block quantization mx.load reads uses blocks of 32
FORMAT = 1  # bump when the written directory changes

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def imported_model(path: str | os.PathLike) -> Path:
    """The mlx-lm directory of GGUF file `path`, importing it on first use."""
    source = Path(path).expanduser()
    try:
        st = source.stat()
    except OSError as e:
        raise MlxkvError(f"cannot read GGUF file {str(path)!r}: {e.strerror}") from None
    key = hashlib.sha256(f"{FORMAT}:{source.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"gguf-{source.stem}-{key}"
    if (target / "config.json").exists():
        return target
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        write_model(source, staging)
        staging.rename(target)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if not (isinstance(e, OSError) and (target / "config.json").exists()):  # else: another process won
            raise
    return target


def write_model(source: Path, directory: Path) -> None:
    try:
        _write_model(source, directory)
    except MlxkvError as e:
        raise MlxkvError(f"cannot import {source.name}: {e}") from None


def _write_model(source: Path, directory: Path) -> None:
    import mlx.core as mx

    try:
        tensors, meta = mx.load(str(source), return_metadata=True)
    except Exception as e:  # mx.load names the unsupported quant type or the bad file
        raise MlxkvError(first_line(e)) from None
    arch = str(meta.get("general.architecture", "unknown"))
    if arch not in ARCHITECTURES:
        raise MlxkvError(f"architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise MlxkvError(f"tokenizer {kind!r} is not supported (supported: gpt2, byte-level BPE)")
    weights = {_mlx_name(name): _widen(t) for name, t in tensors.items()}
    config = model_config(meta, weights, arch)
    directory.mkdir(parents=True)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(meta, directory)


def _mlx_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")  # weight, scales or biases
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    raise MlxkvError(f"tensor {name!r} has no place in a llama model")


def _widen(t):
    import mlx.core as mx

    return t.astype(mx.float32) if t.dtype in (mx.float16, mx.bfloat16) else t


def _meta(meta: dict, key: str, default=None):
    value = meta.get(key)
    if value is None:
        if default is None:
            raise MlxkvError(f"metadata {key!r} is missing")
        return default
    return value.item() if hasattr(value, "item") else value


def model_config(meta: dict, weights: dict, arch: str) -> dict:
    p = f"{arch}."
    heads = _meta(meta, p + "attention.head_count")
    hidden = _meta(meta, p + "embedding_length")
    config = {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _meta(meta, p + "block_count"),
        "intermediate_size": _meta(meta, p + "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta(meta, p + "attention.head_count_kv", heads),
        "head_dim": _meta(meta, p + "attention.key_length", hidden // heads),
        "rms_norm_eps": float(_meta(meta, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_meta(meta, p + "rope.freq_base", 10000.0)),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": _meta(meta, p + "context_length", 4096),
        "tie_word_embeddings": "lm_head.weight" not in weights,
        "rope_traditional": True,  # llama.cpp's q/k permutation (module docstring)
        "bos_token_id": _meta(meta, "tokenizer.ggml.bos_token_id", -1),
        "eos_token_id": _meta(meta, "tokenizer.ggml.eos_token_id", -1),
    }
    quantization = _quantization(weights)
    if quantization:
        config["quantization"] = quantization
    return config


def _quantization(weights: dict) -> dict:
    """mlx-lm's quantization config: the common bits, and a per-module entry where a tensor differs."""
    bits = {}
    for name, scales in weights.items():
        if name.endswith(".scales"):
            module = name[: -len(".scales")]
            packed = weights[f"{module}.weight"].shape[-1]
            bits[module] = packed * 32 // (scales.shape[-1] * GROUP_SIZE)
    if not bits:
        return {}
    common = max(set(bits.values()), key=list(bits.values()).count)
    quantization = {"group_size": GROUP_SIZE, "bits": common}
    for module, b in bits.items():
        if b != common:
            quantization[module] = {"group_size": GROUP_SIZE, "bits": b}
    return quantization


def write_tokenizer(meta: dict, directory: Path) -> None:
    """tokenizer.json from the GGUF's byte-level BPE, and tokenizer_config.json with its chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if meta.get("tokenizer.ggml.pre") == "smollm":  # digits one by one, as SmolLM's own tokenizer
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    special = [t for t, kind in zip(tokens, types) if kind in (3, 4)]  # control and user-defined
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.save(str(directory / "tokenizer.json"))

    def token(key: str) -> str | None:
        i = _meta(meta, key, -1)
        return tokens[i] if 0 <= i < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_meta(meta, "tokenizer.ggml.add_bos_token", False)),
        "model_max_length": _meta(meta, "llama.context_length", 4096),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
