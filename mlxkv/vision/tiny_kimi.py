"""The tiny models of the Kimi vision family (Kimi-VL, Kimi K2.5, Kimi K3): MoonViT towers over 14 px
patches merged 2 x 2, `<|media_pad|>` a merged patch; tiny_families.py's table reads them."""

from __future__ import annotations

from mlxkv.models.tiny import SPECIAL_TOKENS
from mlxkv.vision.tiny_configs import QWEN_VL_TEMPLATE, _as_family


KIMI_VL_VISION_TOKENS = ["<|media_start|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]


def kimi_vl_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                   **_) -> dict:
    """Kimi-VL: a MoonViT tower over 14 px patches merged 2 x 2, `<|media_pad|>` x (h * w / 4) an image;
    a DeepSeek-V3 (multi-head latent attention, a dense layer then routed and shared experts)."""
    text = {"model_type": "deepseek_v3", "vocab_size": vocab_size, "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "moe_intermediate_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
            "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "qk_nope_head_dim": 8, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
            "first_k_dense_replace": 1, "max_position_embeddings": 4096, "rope_theta": 10000.0}
    return {
        "model_type": "kimi_vl", "architectures": ["KimiVLForConditionalGeneration"], "text_config": text,
        "vision_config": {"model_type": "moonvit", "depth": 1, "embed_dim": 32, "hidden_size": 32, "num_heads": 2,
                          "intermediate_size": 64, "patch_size": 14, "init_pos_emb_height": 8,
                          "init_pos_emb_width": 8, "merge_kernel_size": [2, 2]},
        "media_placeholder_token_id": ids["<|media_pad|>"], "vocab_size": vocab_size,
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "kimi_vl", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }


def kimi_k25_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                    **_) -> dict:
    """Kimi K2.5: Kimi-VL's MoonViT, placeholders and DeepSeek-V3 language model."""
    return _as_family(kimi_vl_config(vocab_size, ids, hidden, layers, seed), "kimi_k25",
                      "KimiK25ForConditionalGeneration")


KIMI_VL_TEMPLATE = QWEN_VL_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                            "<|media_start|>image<|media_content|><|media_pad|><|media_end|>")
KIMI_VL_PREPROCESSOR = {"image_processor_type": "KimiVLImageProcessor", "processor_class": "KimiVLProcessor",
                        "patch_size": 14, "merge_kernel_size": [2, 2], "in_token_limit": 256,
                        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
KIMI_K3_VISION_TOKENS = ["<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"]


def kimi_k3_config(vocab_size: int, ids: dict[str, int], hidden: int = 64, layers: int = 2, seed: int = 0,
                   **_) -> dict:
    """Kimi K3: a MoonViT-3D over 14 px patches merged 2 x 2, `<|media_pad|>` x its merged patches; a Kimi
    Linear (latent attention then gated-delta layers, experts)."""
    from mlxkv.models.tiny_args import family_args

    text = {**family_args("kimi_k3")["text_config"], "hidden_size": hidden, "num_hidden_layers": layers,
            "vocab_size": vocab_size}
    text["linear_attn_config"] = {**text["linear_attn_config"], "kda_layers": [2]}
    return {
        "model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
        "vocab_size": vocab_size,
        "vision_config": {"model_type": "moonvit3d", "patch_size": 14, "init_pos_emb_height": 8,
                          "init_pos_emb_width": 8, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
                          "vt_hidden_size": 32, "vt_intermediate_size": 64, "qkv_hidden_size": 96,
                          "mm_hidden_size": 32, "text_hidden_size": hidden, "merge_kernel_size": [2, 2]},
        "media_placeholder_token_id": ids["<|media_pad|>"],
        "eos_token_id": [SPECIAL_TOKENS.index("<|im_end|>")],
        "mlxkv_tiny_model": {"family": "kimi_k3", "hidden_size": hidden, "num_layers": layers, "seed": seed},
    }
