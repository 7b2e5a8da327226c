"""Tiny `ModelArgs` for every mlx-lm family, as mlx-lm's own model tests build them.

`family_args(family)` is a config dict that the family's `ModelArgs.from_dict`
takes (it drops keys the class does not have): the shared tiny sizes below,
then the family's own keys. The family sweep (tests/models/test_family_sweep.py)
builds a random-weight model of each from it; a family mlx-lm adds in a new
release is tried on the shared sizes alone, so the sweep names it at once.
"""

from __future__ import annotations

import copy

from mlxkv.models import compat

VOCAB = 512
LAYERS = 4
# The shared tiny sizes: attention, MLP, mixture of experts and latent attention
# under the names most families use. Families override what they name otherwise.
COMMON = {
    "hidden_size": 64, "num_hidden_layers": LAYERS, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "rms_norm_eps": 1e-5, "norm_eps": 1e-5,
    "layer_norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "use_bias": False,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "n_routed_experts": 4,
    "n_shared_experts": 1, "num_shared_experts": 1, "num_local_experts": 4, "shared_expert_intermediate_size": 64,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "partial_rotary_factor": 1.0, "rope_scaling": None, "sliding_window": 32,
}
MAMBA = {"mamba_d_conv": 4, "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_n_heads": 4, "mamba_d_head": 16,
         "mamba_proj_bias": False, "mamba_conv_bias": True, "mamba_expand": 2}
GATED_DELTA = {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
               "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4}
_WINDOWS4 = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]
_ALTERNATE4 = ["sliding_attention", "full_attention"] * 2
_PER_TYPE_ROPE = {"full_attention": {"rope_theta": 10000.0, "rope_type": "default"},
                  "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
_YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
_LLAMA4_ROPE = {"rope_theta": 10000.0, "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 1024}


def _text(inner: str, **extra) -> dict:
    """A vision-language wrapper: the text model's keys under text_config."""
    return {"text_config": {**COMMON, "model_type": inner, **extra}}


# Each family's keys on top of COMMON.
FAMILY_ARGS: dict[str, dict] = {
    "Klear": {"mlp_only_layers": [0], "decoder_sparse_step": 2},
    "afm7": {"hidden_dim": 64, "num_layers": LAYERS, "num_kv_reuse_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "afmoe": {"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
              "num_dense_layers": 1},
    "apertus": {"post_norm": True, "qk_norm": True},
    "baichuan_m1": {"sliding_window_layers": [0, 2], "conv_window": 2},
    "bailing_hybrid": {"layer_group_size": 2, "group_norm_size": 1, "kv_lora_rank": 16, "q_lora_rank": None,
                       "moe_shared_expert_intermediate_size": 64},
    "bailing_moe": {},
    "bailing_moe_linear": {"layer_group_size": 2, "group_norm_size": 1, "first_k_dense_replace": 0},
    "bailing_moe_v3": {"layer_group_size": 2, "moe_shared_expert_intermediate_size": 64, "short_conv_kernel_size": 4},
    "bitnet": {},
    "cohere": {"logit_scale": 0.0625},
    "cohere2": {"sliding_window_pattern": 2},
    "dbrx": {"d_model": 64, "n_layers": LAYERS, "n_heads": 4,
             "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 10000}},
    "deepseek": {"moe_layer_freq": 1},
    "deepseek_v2": {"moe_layer_freq": 1, "rope_scaling": _YARN},
    "deepseek_v3": {"moe_layer_freq": 1},
    "deepseek_v32": {"moe_layer_freq": 1, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 24,
                     "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "deepseek_v41": {"head_dim": 32, "q_lora_rank": 16, "qk_rope_head_dim": 8, "o_groups": 2, "o_lora_rank": 16,
                     "num_experts_per_tok": 2, "sliding_window": 16, "compress_ratios": [1, 4, 1, 4],
                     "kv_source_layer_ids": [0, 1, 2, 3], "index_source_layer_ids": [0, 1, 2, 3],
                     "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8, "candidate_topk_blocks": 4,
                     "candidate_block_size": 4, "hc_mult": 2, "hc_sinkhorn_iters": 3},
    "dots1": {},
    "ernie4_5": {"head_dim": None},
    "ernie4_5_moe": {"moe_num_experts": 4},
    "exaone": {"num_layers": LAYERS},
    "exaone4": {"sliding_window_pattern": "LLLG"},
    "exaone_moe": {"layer_types": _WINDOWS4, "is_moe_layer": [False, True, True, True]},
    "falcon_h1": {**MAMBA, "mamba_d_ssm": 64, "mamba_chunk_size": 16},
    "gear": {"layer_types": _WINDOWS4},
    "gemma": {},
    "gemma2": {"query_pre_attn_scalar": 16},
    "gemma3": _text("gemma3_text", sliding_window_pattern=2),
    "gemma3_text": {"sliding_window_pattern": 2},
    "gemma3n": _text("gemma3n", num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB, layer_types=_ALTERNATE4,
                     activation_sparsity_pattern=[0.0] * LAYERS, hidden_size_per_layer_input=16, altup_num_inputs=2,
                     altup_coef_clip=1.0, altup_correct_scale=True, altup_active_idx=0, laurel_rank=8,
                     rope_local_base_freq=10000.0, final_logit_softcapping=30.0),
    "gemma4": _text("gemma4_text", head_dim=16, global_head_dim=32, num_key_value_heads=1,
                    num_kv_shared_layers=0, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=16,
                    sliding_window_pattern=2, layer_types=_ALTERNATE4),
    "gemma4_text": {"global_head_dim": 32, "num_key_value_heads": 1, "num_kv_shared_layers": 2,
                    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "layer_types": _ALTERNATE4},
    "glm": {},
    "glm4": {"partial_rotary_factor": 0.5},
    "glm4_moe": {"use_qk_norm": True, "partial_rotary_factor": 0.5},
    "glm4_moe_lite": {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1},
    "glm_moe_dsa": {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 24, "topk_method": "noaux_tc",
                    "scoring_func": "sigmoid", "moe_layer_freq": 1, "rope_parameters": {"rope_theta": 10000.0}},
    "gpt2": {"n_ctx": 1024, "n_embd": 64, "n_head": 4, "n_layer": LAYERS, "n_positions": 1024},
    "gpt_bigcode": {"n_embd": 64, "n_layer": LAYERS, "n_inner": 128, "n_head": 4, "n_positions": 1024,
                    "multi_query": True},
    "gpt_neox": {"rotary_emb_base": 10000, "rotary_pct": 0.25},
    "gpt_oss": {"layer_types": _ALTERNATE4},
    "gptj": {"n_embd": 64, "n_head": 4, "n_layer": LAYERS, "n_positions": 1024, "rotary_dim": 8},
    "granite": {"logits_scaling": 1.0, "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
                "residual_multiplier": 1.0},
    "granitemoe": {"logits_scaling": 1.0, "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
                   "residual_multiplier": 1.0},
    "granitemoehybrid": {**MAMBA, "logits_scaling": 1.0, "attention_multiplier": 0.25, "embedding_multiplier": 1.0,
                         "residual_multiplier": 1.0, "shared_intermediate_size": 64,
                         "layer_types": ["mamba", "attention", "mamba", "attention"]},
    "helium": {},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}, "moe_topk": 2, "num_shared_expert": 1, "use_mixed_mlp_moe": True, "use_qk_norm": True,
                "use_cla": False, "cla_share_factor": 2},
    "hunyuan_v1_dense": {"use_qk_norm": True},
    "internlm2": {"bias": False},
    "internlm3": {"bias": False, "qkv_bias": False},
    "iquestloopcoder": {},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2,
              "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2},
    "kimi_k25": _text("deepseek_v3"),
    "kimi_k3": _text("kimi_linear", num_key_value_heads=4, num_experts_per_token=2, linear_attn_config={
        "num_heads": 4, "head_dim": 16, "kda_layers": [1, 3], "short_conv_kernel_size": 4}),
    "kimi_linear": {"model_max_length": 4096, "num_key_value_heads": 4,
                    "linear_attn_config": {"num_heads": 4, "head_dim": 16, "kda_layers": [1, 3],
                                           "short_conv_kernel_size": 4}},
    "kimi_vl": _text("deepseek_v3"),
    "laguna": {"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
               "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
               "num_attention_heads_per_layer": [4, 4, 4, 4]},
    "lfm2": {"conv_bias": False, "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 128, "block_multiple_of": 16,
             "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": False,
             "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lfm2-vl": _text("lfm2", conv_bias=False, conv_L_cache=3, block_dim=64, block_ff_dim=128, block_multiple_of=16,
                     block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False,
                     layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "lfm2_moe": {"use_expert_bias": True, "num_dense_layers": 1, "conv_bias": False, "conv_L_cache": 3,
                 "layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "lille-130m": {"block_size": 1024, "n_embd": 64, "n_head": 4, "n_kv_heads": 2, "n_layer": LAYERS},
    "llama": {},
    "llama4": _text("llama4", attention_chunk_size=32, intermediate_size_mlp=128, interleave_moe_layer_step=2,
                    num_local_experts=2, num_experts_per_tok=1, use_qk_norm=True),
    "llama4_text": {"intermediate_size_mlp": 128, "no_rope_layers": [1, 1, 1, 0], "use_qk_norm": True,
                    "attention_chunk_size": 32},
    "longcat_flash": {"attention_method": "MLA", "zero_expert_type": "identity", "ffn_hidden_size": 128,
                      "moe_topk": 2, "expert_ffn_hidden_size": 64, "zero_expert_num": 2, "num_layers": 2,
                      "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "longcat_flash_ngram": {"attention_method": "MLA", "zero_expert_type": "identity", "ffn_hidden_size": 128,
                            "moe_topk": 2, "expert_ffn_hidden_size": 64, "zero_expert_num": 2, "num_layers": 2,
                            "mla_scale_q_lora": True, "mla_scale_kv_lora": True},
    "mamba": {"state_size": 16, "conv_kernel": 4, "use_conv_bias": True, "time_step_rank": 8},
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "conv_kernel": 4, "n_groups": 2,
               "use_conv_bias": True, "time_step_limit": [0.0, float("inf")], "time_step_rank": "auto",
               "tie_word_embeddings": True},
    "mellum": {"layer_types": _WINDOWS4, "rope_parameters": _PER_TYPE_ROPE},
    "mimo": {},
    "mimo_v2_flash": {"hybrid_layer_pattern": [0, 1, 0, 1], "moe_layer_freq": [0, 1, 0, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "sliding_window_size": 32, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                      "layernorm_epsilon": 1e-5, "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4,
                      "swa_num_key_value_heads": 4, "v_head_dim": 16, "swa_head_dim": 16, "swa_v_head_dim": 16},
    "minicpm": {"dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 12},
    "minicpm3": {"dim_model_base": 64, "scale_depth": 1.4, "scale_emb": 12, "rope_scaling": {}},
    "minimax": {"shared_intermediate_size": 64, "rotary_dim": 8},
    "minimax_m3_vl": _text("minimax_m3", intermediate_size=64, dense_intermediate_size=128,
                           shared_intermediate_size=64, rotary_dim=8, mlp_layer_types=["dense", "moe", "moe", "moe"],
                           sparse_attention_freq=[0, 1, 0, 1],
                           index_n_heads=2, index_head_dim=16, index_block_size=16, index_topk_blocks=2),
    "ministral3": {"rope_parameters": _LLAMA4_ROPE},
    "mistral3": _text("ministral3", rope_parameters=_LLAMA4_ROPE),
    "mistral4": {"rope_parameters": {**_LLAMA4_ROPE, **_YARN}},
    "mixtral": {},
    "muse_glimmer": {"layer_types": _WINDOWS4},
    "muse_spark": _text("muse_spark", post_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0},
                        layer_rope_theta=[10000.0] * LAYERS, layer_types=_WINDOWS4, final_logit_softcapping=30.0,
                        output_multiplier=1.0, moe_hidden_size=64, mlp_layer_types=["sparse"] * LAYERS,
                        num_shared_experts=0),
    "nanbeige": {},
    "nanochat": {},
    "nemotron": {"hidden_act": "relu2", "partial_rotary_factor": 0.5},
    "nemotron-nas": {"block_configs": [
        {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": i == 1},
         "ffn": {"ffn_mult": 1.5, "no_op": False, "replace_with_linear": False}} for i in range(LAYERS)]},
    "nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 16, "mamba_proj_bias": False, "ssm_state_size": 16,
                   "conv_kernel": 4, "n_groups": 1, "use_conv_bias": True, "hybrid_override_pattern": ["M", "*", "-", "M"]},
    "olmo": {"d_model": 64, "n_layers": LAYERS, "n_heads": 4, "mlp_ratio": 2, "embedding_size": VOCAB},
    "olmo2": {},
    "olmo3": {"layer_types": _WINDOWS4},
    "olmo_hybrid": {**GATED_DELTA, "linear_allow_neg_eigval": True,
                    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"]},
    "olmoe": {},
    "openelm": {"num_transformer_layers": LAYERS, "model_dim": 64, "ffn_dim_divisor": 16,
                "num_query_heads": [4, 4, 8, 8], "num_kv_heads": [1, 2, 2, 4], "ffn_multipliers": [1.0, 1.5, 2.0, 2.5]},
    "phi": {"num_key_value_heads": 4},
    "phi3": {"num_key_value_heads": 4},
    # Its head masks ids from 100256 on (its tokenizer's dummies): smaller vocabularies are written out of bounds.
    "phi3small": {"vocab_size": 100352, "dense_attention_every_n_layers": 2, "ff_intermediate_size": 128, "gegelu_limit": 20.0,
                  "blocksparse_num_local_blocks": 2, "blocksparse_vert_stride": 2},
    "phimoe": {},
    "phixtral": {"num_vocab": VOCAB, "model_dim": 64, "num_heads": 4, "num_layers": LAYERS, "rotary_dim": 8},
    "pixtral": _text("llama"),
    "plamo": {"n_shared_head": 2},
    "plamo2": {"hidden_size_per_head": 16, "attention_window_size": 32, "mamba_d_state": 16, "mamba_num_heads": 4,
               "mamba_step": 2, "mamba_chunk_size": 16},
    "plamo3": {"window_size": 32, "sliding_window_pattern": 2},
    # A Hadamard-rotated 2-bit pack of Qwen3.5: packed modules take widths in multiples of 128
    # (rotation blocks of 512 and more; 0: no rotation).
    "prism_hadamard_qwen35": {**_text("qwen3_5_text", **GATED_DELTA, full_attention_interval=2, hidden_size=128,
                                      head_dim=32),
                              "schema_version": 1, "tensor_namespace": "mlx-lm-text",
                              "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
                              "modules": [{"path": p, "embedding": p.endswith("embed_tokens"), "dtype": "float16",
                                           "block": 0} for p in ("model.embed_tokens", "model.layers.1.self_attn.q_proj",
                                                                   "model.layers.1.self_attn.o_proj")]},
    "qwen": {"kv_channels": 16, "num_attention_heads": 4, "no_bias": True},
    "qwen2": {},
    "qwen2_moe": {},
    "qwen2_vl": _text("qwen2"),
    "qwen3": {},
    "qwen3_5": _text("qwen3_5_text", **GATED_DELTA, full_attention_interval=2),
    "qwen3_5_moe": _text("qwen3_5_moe_text", **GATED_DELTA, full_attention_interval=2),
    "qwen3_moe": {},
    "qwen3_next": {**GATED_DELTA, "full_attention_interval": 2},
    "qwen3_vl": _text("qwen3"),
    "qwen3_vl_moe": _text("qwen3_moe"),
    "recurrent_gemma": {"conv1d_width": 4, "logits_soft_cap": 30.0, "attention_window_size": 32,
                        "block_types": ["recurrent", "attention"], "num_key_value_heads": 1},
    "rwkv7": {"a_low_rank_dim": 8, "v_low_rank_dim": 8, "gate_low_rank_dim": 8, "decay_low_rank_dim": 8},
    "seed_oss": {},
    "smollm3": {},
    "solar_open": {},
    "spark2_5": {"layer_types": _WINDOWS4, "rope_parameters": _PER_TYPE_ROPE},
    "stablelm": {"use_qkv_bias": False, "partial_rotary_factor": 0.25},
    "starcoder2": {},
    "step3p5": {"num_attention_groups": 2, "moe_num_experts": 4, "moe_top_k": 2, "share_expert_dim": 64,
                "layer_types": _WINDOWS4},
    "talkie": {},
    "telechat3": {},
    "youtu_llm": {},
}


def family_args(family: str) -> dict:
    """The config dict of a tiny `family` model (a fresh copy: ModelArgs may change it)."""
    args = {**COMMON, **FAMILY_ARGS.get(family, {}), "model_type": family}
    if "text_config" in args:
        args["text_config"].setdefault("vocab_size", VOCAB)
    return copy.deepcopy(args)


def tiny_family_model(family: str, seed: int = 0):
    """(model, config): a random-weight tiny model of an mlx-lm family module, in float32."""
    from mlxkv.models.tiny import random_weights  # tiny.py imports this module

    model_class, args_class = compat.family_classes(family)
    config = family_args(family)
    model = model_class(args_class.from_dict(family_args(family)))
    model.load_weights(list(random_weights(model, seed).items()))
    return model, config
