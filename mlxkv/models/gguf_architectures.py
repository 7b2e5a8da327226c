"""GGUF architectures as mlx-lm families: tensor names, hyper-parameters, rope and norm conventions.

What llama.cpp's converter changed on the way to GGUF, undone here:
- llama (Llama, SmolLM, Mistral-7B-style files: llama.cpp has no separate
  mistral architecture) stores q and k permuted for its interleaved rotary
  layout: that is mlx-lm's `rope_traditional: true`, no weights moved. Every
  other family here keeps the Hugging Face layout (NeoX rotary, mlx-lm's default);
- gemma2 and gemma3 store every RMSNorm weight plus one (llama.cpp
  multiplies by w, Gemma by 1 + w); mlx-lm's Gemma norms add the one
  themselves, so it is taken off again;
- gemma's attention scale is 1/sqrt(head_dim), except at 27B, where llama.cpp
  (and Gemma) use 1/sqrt(hidden / heads): the layer count says which;
- Llama 3.1+ files carry their rope scaling as a tensor of per-frequency
  factors (`rope_freqs`); it becomes mlx-lm's llama3 rope_scaling when the
  usual parameters reproduce it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from mlxkv.errors import MlxkvError

_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_EXPERTS = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.switch_mlp.gate_proj",
            "ffn_up_exps": "mlp.switch_mlp.up_proj", "ffn_down_exps": "mlp.switch_mlp.down_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors that are not weights of the text model: a gemma3 file from Ollama
# carries its vision tower (v.*) and projector (mm.*); rope factors become config.
SKIPPED_PREFIXES = ("v.", "mm.")
CONFIG_TENSORS = ("rope_freqs", "rope_factors_long", "rope_factors_short")


@dataclass(frozen=True)
class Architecture:
    model_type: str  # mlx-lm's
    layer_names: dict[str, str]  # GGUF layer tensor -> mlx-lm module under model.layers.N
    rope_traditional: bool = False
    norm_shift: float = 0.0  # subtracted from every norm weight
    extra: tuple[str, ...] = field(default=())  # which hyper-parameter groups config() adds


ARCHITECTURES = {
    "llama": Architecture("llama", {**_NORMS, **_ATTENTION, **_MLP}, rope_traditional=True, extra=("llama3",)),
    "qwen2": Architecture("qwen2", {**_NORMS, **_ATTENTION, **_MLP}),
    "qwen3": Architecture("qwen3", {**_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP}),
    "qwen3moe": Architecture("qwen3_moe", {**_NORMS, **_ATTENTION, **_QK_NORMS, **_EXPERTS}, extra=("moe",)),
    "gemma2": Architecture("gemma2", {**_GEMMA_NORMS, **_ATTENTION, **_MLP}, norm_shift=1.0, extra=("gemma2",)),
    "gemma3": Architecture("gemma3_text", {**_GEMMA_NORMS, **_ATTENTION, **_QK_NORMS, **_MLP}, norm_shift=1.0,
                           extra=("gemma3",)),
    "phi3": Architecture("phi3", {**_NORMS, "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                                  "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}, extra=("phi3",)),
}


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise MlxkvError(f"architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return ARCHITECTURES[name]


def mlx_name(arch: Architecture, name: str) -> str | None:
    """mlx-lm's name of GGUF tensor `name` (`blk.3.attn_q.weight`); None for one that is not a weight."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    if name.startswith(SKIPPED_PREFIXES) or stem in CONFIG_TENSORS:
        return None
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in arch.layer_names:
        return f"model.layers.{parts[1]}.{arch.layer_names[parts[2]]}.{suffix}"
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    raise MlxkvError(f"tensor {name!r} has no place in a {arch.model_type} model")


def is_norm(mlx_name: str) -> bool:
    return mlx_name.endswith(("norm.weight", "layernorm.weight"))


class Hyper:
    """The `<arch>.*` metadata, with llama.cpp's defaults where a key is optional."""

    def __init__(self, meta: dict, arch: str):
        self.meta, self.prefix = meta, f"{arch}."

    def get(self, key: str, default=None):
        value = self.meta.get(self.prefix + key)
        if value is None:
            if default is None:
                raise MlxkvError(f"metadata {self.prefix + key!r} is missing")
            return default
        return value.item() if hasattr(value, "item") else value


def model_config(meta: dict, arch_name: str, tensors: dict[str, np.ndarray], vocab_size: int) -> dict:
    """config.json for mlx-lm, from the file's hyper-parameters (`tensors`: the config tensors, as floats)."""
    arch, h = architecture(arch_name), Hyper(meta, arch_name)
    heads, hidden = int(h.get("attention.head_count")), int(h.get("embedding_length"))
    config = {
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(h.get("block_count")),
        "intermediate_size": int(h.get("feed_forward_length", 0)) or hidden * 4,
        "num_attention_heads": heads,
        "num_key_value_heads": int(h.get("attention.head_count_kv", heads)),
        "head_dim": int(h.get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(h.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(h.get("rope.freq_base", 10000.0)),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(h.get("context_length", 4096)),
        "rope_traditional": arch.rope_traditional,
    }
    for group in arch.extra:
        config.update(_EXTRA[group](h, config, tensors))
    return config


def _llama3(h: Hyper, config: dict, tensors: dict) -> dict:
    factors = tensors.get("rope_freqs.weight")
    return {} if factors is None else {"rope_scaling": llama3_rope_scaling(factors, config)}


def llama3_rope_scaling(factors: np.ndarray, config: dict) -> dict:
    """mlx-lm's llama3 rope_scaling whose per-frequency factors are `factors`
    (Meta's published parameters: low 1, high 4, an 8192 original context)."""
    scaling = {"rope_type": "llama3", "factor": round(float(factors.max()), 3), "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if not np.allclose(llama3_factors(scaling, config["head_dim"], config["rope_theta"]), factors, rtol=1e-3):
        raise MlxkvError("its rope_freqs tensor is not Llama 3's rope scaling")
    return scaling


def llama3_factors(scaling: dict, dims: int, base: float) -> np.ndarray:
    """Each rotary frequency's divisor under Llama 3's scaling (what llama.cpp stores in rope_freqs)."""
    freqs = base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelen = 2 * math.pi * freqs
    old = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = np.clip((old / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def _moe(h: Hyper, config: dict, tensors: dict) -> dict:
    return {"num_experts": int(h.get("expert_count")), "num_experts_per_tok": int(h.get("expert_used_count")),
            "moe_intermediate_size": int(h.get("expert_feed_forward_length")),
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}  # llama.cpp normalizes


def _gemma_scale(config: dict, layers_at_27b: int) -> float:
    if config["num_hidden_layers"] == layers_at_27b:
        return config["hidden_size"] / config["num_attention_heads"]
    return config["head_dim"]


def _gemma2(h: Hyper, config: dict, tensors: dict) -> dict:
    return {"attn_logit_softcapping": float(h.get("attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": float(h.get("final_logit_softcapping", 30.0)),
            "query_pre_attn_scalar": _gemma_scale(config, 46)}


def _gemma3(h: Hyper, config: dict, tensors: dict) -> dict:
    extra = {"query_pre_attn_scalar": _gemma_scale(config, 62),
             "rope_theta": float(h.get("rope.freq_base", h.get("rope.global.freq_base", 1_000_000.0))),
             "rope_local_base_freq": float(h.get("rope.local.freq_base", 10000.0)),
             "sliding_window": int(h.get("attention.sliding_window", 512)),
             "sliding_window_pattern": int(h.get("attention.sliding_window_pattern", 6))}
    factor = float(h.get("rope.scaling.factor", 1.0))
    if factor != 1.0:
        extra["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    return extra


def _phi3(h: Hyper, config: dict, tensors: dict) -> dict:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    extra = {"partial_rotary_factor": int(h.get("rope.dimension_count", head_dim)) / head_dim}
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is not None and short is not None:
        extra["rope_scaling"] = {"type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()}
        extra["original_max_position_embeddings"] = int(h.get("rope.scaling.original_context_length", 4096))
    return extra


_EXTRA = {"llama3": _llama3, "moe": _moe, "gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3}
