"""Writing models as GGUF files the way llama.cpp does, for the import's round trips.

Independent of mlxkv's importer on purpose: its own name tables (llama.cpp's
tensor names), its own K-quant quantizers (the `gguf` package quantizes only
the legacy types), and the `gguf` package's writer and dequantizers as the
reference for what the file holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as T

LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "mlp.gate": "ffn_gate_inp", "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
         "mlp.switch_mlp.up_proj": "ffn_up_exps", "mlp.switch_mlp.down_proj": "ffn_down_exps"}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float16).reshape(len(x), 1).view(np.uint8)


def _safe_div(x, d):
    return np.where(d > 0, x / np.where(d > 0, d, 1), 0)


def _with_min(x: np.ndarray, q_max: int, s_max: int):
    """Per sub-block (rows of x): scale and min codes against super-block d and dmin, then q."""
    lo, hi = np.minimum(x.min(-1), 0), x.max(-1)
    scale, minimum = (hi - lo) / q_max, -lo
    d = (scale.max(-1) / s_max).astype(np.float16)
    dmin = (minimum.max(-1) / s_max).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[:, None])), 0, s_max).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(minimum, dmin.astype(np.float32)[:, None])), 0, s_max).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.clip(np.rint(_safe_div(x + offset[..., None], step[..., None])), 0, q_max).astype(np.uint8)
    return d, dmin, sc, mn, q


def _symmetric(x: np.ndarray, q_lo: int, s_max: int):
    scale = np.abs(x).max(-1) / -q_lo
    d = (scale.max(-1) / s_max).astype(np.float16)
    sc = np.clip(np.rint(_safe_div(scale, d.astype(np.float32)[:, None])), 0, s_max).astype(np.int16)
    step = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.rint(_safe_div(x, step[..., None])), q_lo, -q_lo - 1).astype(np.int16)
    return d, sc, q


def _k_scale_bytes(sc, mn):
    out = np.zeros((len(sc), 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((mn[:, 4:8] & 0xF) << 4)
    return out


def _nibble_pairs(q):  # [n, 256] -> [n, 128]: byte 32p + l holds values 64p + l and 64p + 32 + l
    q = q.reshape(len(q), 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128)


def _crumbs(q):  # [n, 256] 2-bit -> [n, 64]: byte 32h + l holds values 128h + 32j + l at bits 2j
    q = q.reshape(len(q), 2, 4, 32).astype(np.uint8)
    return (q[:, :, 0] | q[:, :, 1] << 2 | q[:, :, 2] << 4 | q[:, :, 3] << 6).reshape(len(q), 64)


def _bitplane(bits):  # [n, 256] 0/1 -> [n, 32]: bit i of byte l is value 32i + l
    b = bits.reshape(len(bits), 8, 32).astype(np.uint8)
    return np.bitwise_or.reduce(b << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)


def quantize_k(x: np.ndarray, kind: T) -> np.ndarray:
    """Rows [n, 256 * k] as K-quant blocks [n, k * block bytes]."""
    rows = len(x)
    b = x.reshape(-1, 256).astype(np.float32)
    if kind in (T.Q4_K, T.Q5_K):
        d, dmin, sc, mn, q = _with_min(b.reshape(-1, 8, 32), 15 if kind == T.Q4_K else 31, 63)
        q = q.reshape(-1, 256)
        parts = [_f16(d), _f16(dmin), _k_scale_bytes(sc, mn)]
        if kind == T.Q5_K:
            parts.append(_bitplane(q >> 4))
        parts.append(_nibble_pairs(q & 0xF))
    elif kind == T.Q2_K:
        d, dmin, sc, mn, q = _with_min(b.reshape(-1, 16, 16), 3, 15)
        parts = [sc | (mn << 4), _crumbs(q.reshape(-1, 256)), _f16(d), _f16(dmin)]
    elif kind == T.Q3_K:
        d, sc, q = _symmetric(b.reshape(-1, 16, 16), -4, 31)
        u, s = (q + 4).reshape(-1, 256).astype(np.uint8), (sc + 32).astype(np.uint8)
        scales = np.zeros((len(b), 12), np.uint8)
        scales[:, 0:8] = (s[:, 0:8] & 0xF) | ((s[:, 8:16] & 0xF) << 4)
        high = (s >> 4).reshape(-1, 4, 4)  # [k // 4, k % 4]
        scales[:, 8:12] = high[:, 0] | high[:, 1] << 2 | high[:, 2] << 4 | high[:, 3] << 6
        parts = [_bitplane(u >> 2), _crumbs(u & 3), scales, _f16(d)]
    elif kind == T.Q6_K:
        d, sc, q = _symmetric(b.reshape(-1, 16, 16), -32, 127)
        u = (q + 32).reshape(-1, 2, 4, 32).astype(np.uint8)  # [half, quarter, l]
        ql = np.concatenate([u[:, :, 0] & 0xF | (u[:, :, 2] & 0xF) << 4,
                             u[:, :, 1] & 0xF | (u[:, :, 3] & 0xF) << 4], axis=2)
        qh = u[:, :, 0] >> 4 | (u[:, :, 1] >> 4) << 2 | (u[:, :, 2] >> 4) << 4 | (u[:, :, 3] >> 4) << 6
        parts = [ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16(d)]
    else:
        raise ValueError(kind)
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def quantize(x: np.ndarray, kind: T) -> np.ndarray:
    if kind in (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K):
        return quantize_k(x.reshape(-1, x.shape[-1]), kind).reshape(*x.shape[:-1], -1)
    return gguf.quants.quantize(x.astype(np.float32), kind)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """q or k as llama.cpp's converter stores them for its rotary layout (rows only: blocks stay whole)."""
    out = w.shape[0]
    return w.reshape(heads, 2, out // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, gemma: bool) -> str:
    module, _, suffix = hf.rpartition(".")
    if module.startswith("model.layers."):
        _, _, i, rest = module.split(".", 3)
        return f"blk.{i}.{(GEMMA_LAYER if gemma else LAYER)[rest]}.{suffix}"
    return f"{TOP[module]}.{suffix}"


def write_gguf(model_dir: str, path: Path, arch: str, choose, meta_extra: dict | None = None,
               weights: dict | None = None, extra_tensors: dict | None = None) -> dict[str, np.ndarray]:
    """Write model_dir's model (or `weights`) as llama.cpp would for `arch`, each weight
    in the type `choose(hf_name, array)` returns; returns the weights as the file holds them,
    dequantized by the `gguf` package, in the Hugging Face layout."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    weights = weights or {k: np.array(v.astype(mx.float32)) for k, v in mx.load(f"{model_dir}/model.safetensors").items()}
    gemma = arch.startswith("gemma")
    writer = gguf.GGUFWriter(str(path), arch)
    held = {}
    for name, w in sorted(weights.items()):
        kind = choose(name, w) if w.ndim >= 2 else T.F32
        raw = w if kind == T.F32 else quantize(w, kind)
        held[name] = w if kind == T.F32 else gguf.quants.dequantize(raw, kind).reshape(w.shape)
        stored = raw + 1 if gemma and name.endswith("norm.weight") else raw  # llama.cpp: Gemma norms + 1
        heads = {"self_attn.q_proj": config["num_attention_heads"],
                 "self_attn.k_proj": config["num_key_value_heads"]}.get(name.rpartition(".")[0].split(".", 3)[-1])
        if arch == "llama" and heads:
            stored = _permute(stored, heads)
        writer.add_tensor(gguf_name(name, gemma), np.ascontiguousarray(stored),
                          raw_dtype=None if kind == T.F32 else kind)
    for name, tensor in (extra_tensors or {}).items():  # e.g. rope_freqs.weight, as GGUF names them
        writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    _write_metadata(writer, arch, config, model_dir, meta_extra or {})
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _write_metadata(writer, arch: str, config: dict, model_dir: str, extra: dict) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_context_length(config["max_position_embeddings"])
    for key, value in extra.items():
        writer.add_key_value(f"{arch}.{key}" if not key.startswith("tokenizer.") else key, *value)
    bpe = json.loads((Path(model_dir) / "tokenizer.json").read_text())
    vocab = {**bpe["model"]["vocab"], **{t["content"]: t["id"] for t in bpe["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in bpe["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in bpe["model"]["merges"]])
    writer.add_eos_token_id(vocab["<|im_end|>"])
    template = json.loads((Path(model_dir) / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        writer.add_chat_template(template)
