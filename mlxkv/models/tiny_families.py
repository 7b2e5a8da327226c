"""The families `mlxkv tiny-model` writes, and what each adds to the shared config.

Every family shares the config keys of tiny.model_config; the ones here
add their own: sliding windows small enough that test prompts wrap them,
and the recurrent layers of the hybrid families, sized from the spec's
heads so they stay tiny.
"""

from __future__ import annotations

# Extra config.json keys per family, on top of the ones every family shares.
FAMILIES = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "phi3": {},
    "starcoder2": {"norm_epsilon": 1e-5},
    "olmo2": {},
    # Sliding-window families: their windows (spec.sliding_window) are
    # small, so that test prompts wrap them.
    "gemma3_text": {"sliding_window_pattern": 2},  # every other layer slides
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2},  # alternating, with attention sinks
    "olmo3": {},  # three sliding layers to one full
    # Hybrids of attention and recurrent layers (mlx-lm's ArraysCache).
    "qwen3_next": {"linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25, "num_experts": 0,
                   "num_experts_per_tok": 1, "decoder_sparse_step": 1},  # gated delta net
    "lfm2": {"norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3, "block_multiple_of": 16,
             "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False},  # short convolutions
    "nemotron_h": {"attention_bias": False, "mamba_proj_bias": False, "ssm_state_size": 16, "conv_kernel": 4,
                   "n_groups": 1, "mlp_bias": False, "layer_norm_epsilon": 1e-5, "use_bias": False,
                   "use_conv_bias": True},  # Mamba 2, attention and MLP layers
}
WINDOWED_FAMILIES = ("gemma3_text", "gpt_oss", "olmo3")
RECURRENT_FAMILIES = ("qwen3_next", "lfm2", "nemotron_h")
# A full-attention layer every this many layers, unless the spec says (sliding_pattern).
_PERIODS = {"gpt_oss": 2, "olmo3": 4, "qwen3_next": 2, "lfm2": 2, "nemotron_h": 3}


def family_config(spec) -> dict:
    """The family's own config keys for a TinyModelSpec."""
    return {**FAMILIES[spec.family], **_windows(spec), **_recurrent(spec)}


def mixer_scale(family: str) -> float:
    """A layer's token mixer against plain attention's weights (gated delta net's projections are wider)."""
    return 1.25 if family == "qwen3_next" else 1.0


def mlp_layers(spec) -> int:
    """Layers with an MLP: all, but Nemotron-H's own MLP layers are separate from its mixers."""
    if spec.family != "nemotron_h":
        return spec.num_layers
    return _recurrent(spec)["hybrid_override_pattern"].count("-")


def _period(spec) -> int:
    return min(spec.sliding_pattern or _PERIODS[spec.family], spec.num_layers)


def _full_at(spec, i: int) -> bool:
    """Whether layer i attends fully: one in every period, the last of it (at least one, and one other)."""
    return (i + 1) % _period(spec) == 0


def _windows(spec) -> dict:
    if spec.family not in WINDOWED_FAMILIES:
        return {}
    extra = {"sliding_window": spec.sliding_window}
    if spec.family == "gemma3_text":
        if spec.sliding_pattern is not None:
            extra["sliding_window_pattern"] = spec.sliding_pattern
        return extra
    extra["layer_types"] = ["full_attention" if _full_at(spec, i) else "sliding_attention"
                            for i in range(spec.num_layers)]
    return extra


def _recurrent(spec) -> dict:
    if spec.family not in RECURRENT_FAMILIES:
        return {}
    head_dim, layers = spec.resolved_head_dim, range(spec.num_layers)
    ffn = spec.intermediate_size or 3 * spec.hidden_size
    if spec.family == "qwen3_next":  # Qwen3-Next's ratios: twice the value heads, half the head dim
        return {"linear_num_value_heads": 2 * spec.num_heads, "linear_num_key_heads": spec.num_heads,
                "linear_key_head_dim": max(2, head_dim // 2), "linear_value_head_dim": max(2, head_dim // 2),
                "full_attention_interval": _period(spec), "mlp_only_layers": list(layers),
                "shared_expert_intermediate_size": ffn, "moe_intermediate_size": ffn}
    if spec.family == "lfm2":
        return {"block_dim": spec.hidden_size, "block_ff_dim": ffn,
                "layer_types": ["full_attention" if _full_at(spec, i) else "conv" for i in layers]}
    # nemotron_h: Mamba layers, an attention layer closing each period, and
    # an MLP layer (no cache) now and then, so cache slots and layers differ.
    pattern = ["*" if _full_at(spec, i) else "-" if i % 4 == 3 else "M" for i in layers]
    return {"mamba_num_heads": spec.num_heads, "mamba_head_dim": head_dim,
            "hybrid_override_pattern": pattern}
