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
    # Sliding layers beside full ones of a head twice as wide (K/V of two shapes).
    "gemma4_text": {"num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0, "final_logit_softcapping": 30.0,
                    "use_double_wide_mlp": False},
    # Latent attention with a sparse indexer: the indexer's keys are a second cache per layer.
    "deepseek_v32": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_layer_freq": 1,
                     "first_k_dense_replace": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                     "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                     "attention_bias": False, "rope_scaling": None},
    # Chunked local attention, a full layer every fourth (keys under text_config).
    "llama4": {"attention_bias": False, "interleave_moe_layer_step": 2, "num_local_experts": 2,
               "num_experts_per_tok": 1, "use_qk_norm": True, "rope_scaling": None},
    # Mamba and attention side by side in every layer (a CacheList each).
    "falcon_h1": {"mamba_d_state": 16, "mamba_d_conv": 4, "mamba_n_groups": 1, "mamba_chunk_size": 16},
    # Mamba 2 layers alone: no attention, only states.
    "mamba2": {"state_size": 16, "n_groups": 1, "conv_kernel": 4, "use_bias": False, "use_conv_bias": True,
               "time_step_limit": [0.0, float("inf")], "time_step_rank": "auto", "layer_norm_epsilon": 1e-5},
}
WINDOWED_FAMILIES = ("gemma3_text", "gpt_oss", "olmo3", "gemma4_text")
RECURRENT_FAMILIES = ("qwen3_next", "lfm2", "nemotron_h")
# Families whose own config keys are nested under text_config.
TEXT_CONFIG_FAMILIES = ("llama4",)
# The least layers a family's spec needs: Llama 4's model reads its fourth cache (a full layer).
MIN_LAYERS = {**{f: 2 for f in WINDOWED_FAMILIES + RECURRENT_FAMILIES}, "llama4": 4}
# A full-attention layer every this many layers, unless the spec says (sliding_pattern).
_PERIODS = {"gpt_oss": 2, "olmo3": 4, "qwen3_next": 2, "lfm2": 2, "nemotron_h": 3, "gemma4_text": 5}


def family_config(spec) -> dict:
    """The family's own config keys for a TinyModelSpec."""
    return {**FAMILIES[spec.family], **_windows(spec), **_recurrent(spec), **_shapes(spec)}


def _shapes(spec) -> dict:
    """Keys sized from the spec's heads: a wider global head, latent attention, Mamba dims."""
    head_dim, ffn = spec.resolved_head_dim, spec.intermediate_size or 3 * spec.hidden_size
    if spec.family == "gemma4_text":
        return {"global_head_dim": 2 * head_dim, "vocab_size_per_layer_input": spec.vocab_size}
    if spec.family == "deepseek_v32":
        return {"kv_lora_rank": 2 * head_dim, "q_lora_rank": spec.hidden_size // 2, "qk_rope_head_dim": head_dim // 2,
                "qk_nope_head_dim": head_dim, "v_head_dim": head_dim, "moe_intermediate_size": ffn // 2,
                "index_n_heads": max(1, spec.num_heads // 2), "index_head_dim": head_dim,
                "index_topk": 2 * spec.sliding_window}
    if spec.family == "llama4":
        return {"attention_chunk_size": spec.sliding_window, "intermediate_size_mlp": ffn}
    if spec.family == "falcon_h1":
        return {"mamba_n_heads": spec.num_heads, "mamba_d_head": head_dim, "mamba_d_ssm": spec.num_heads * head_dim}
    if spec.family == "mamba2":
        # Mamba 2's heads span twice the model width (expand 2), as its configs check.
        return {"num_heads": 2 * spec.hidden_size // head_dim, "expand": 2, "tie_word_embeddings": False}
    return {}


# A layer's token mixer against plain attention's weights: gated delta net's projections
# are wider, Gemma 4's global head, latent attention with its indexer and MoE, Mamba's.
_MIXER_SCALES = {"qwen3_next": 1.25, "gemma4_text": 1.5, "deepseek_v32": 3.5, "falcon_h1": 2.25, "mamba2": 2.3}


def mixer_scale(family: str) -> float:
    """A layer's token mixer against plain attention's weights (see _MIXER_SCALES)."""
    return _MIXER_SCALES.get(family, 1.0)


def mlp_layers(spec) -> int:
    """Layers with an MLP: all, but Mamba 2 has none and Nemotron-H's are separate from its mixers."""
    if spec.family == "mamba2":
        return 0
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
