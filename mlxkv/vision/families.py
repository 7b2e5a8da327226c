"""Every mlx-vlm model family, and what mlxkv does with a checkpoint of it.

mlx-vlm ships a module per family under mlx_vlm/models/. A family is either
SERVED (its language model runs over mlxkv's paged pool with images, its
tiny model in tiny_families.py's table and its equality tests in
tests/vision/test_vision_engine.py) or has a reason it is not. The reasons
come from reading each module's source (mlx-vlm 0.7.10; docs/vision.md has
the table). tests/vision/test_vision_family_sweep.py lists mlx-vlm's modules and
fails on one listed nowhere here: a new mlx-vlm family waits for a decision.
"""

from __future__ import annotations

# Images over the pool, greedy tokens equal to mlx-vlm's generate (tests/vision/test_vision_engine.py).
SERVED = (
    "qwen2_vl", "qwen2_5_vl", "gemma3", "smolvlm", "idefics3", "qwen3_vl", "qwen3_vl_moe", "mistral3", "pixtral",
    "glm4v", "glm4v_moe", "idefics2", "internvl_chat", "aya_vision", "llava_onevision",
    "kimi_vl", "internvl", "kimi_k25", "glm_ocr", "mage_vl", "cohere_compass", "muse_glimmer", "nemotron_h_nano_omni",
    "mimo_v2", "minimax_m3_vl", "kimi_k3",
    "llava", "llava_next", "granite_vision",
    # their processors take the image token in string content (vision/rendering.py)
    "llmjpvl", "minicpmo",
    "qwen3_omni_moe",
)

TEXT_MODEL = "a text model (no vision tower in mlx-vlm's module): mlx-lm's class of that name serves it"
NOT_GENERATIVE = ("not a chat generator (embedding, retrieval, detection, segmentation, depth, speech or image "
                  "generation)")
RECURRENT_API = ("its gated-delta layers call mlx-vlm's own ArraysCache extensions (update_window, "
                 "update_recurrent), not the mlx-lm cache protocol mlxkv's recurrent states speak")
BIDIRECTIONAL = ("its image tokens (PaliGemma: the whole prompt prefix) attend to each other bidirectionally in "
                 "mlx-vlm, so a block's KV depends on tokens after it; mlxkv's pool and attention are causal")
PER_LAYER_INPUTS = ("its layers take per-layer inputs computed from the prompt's ids beside the embeddings, and its "
                    "last layers reuse earlier layers' KV; mlxkv's rows carry neither")
CROSS_ATTENTION = "its language model cross-attends to the image's states, which the pool's blocks do not hold"
ENCODER_DECODER = "an encoder-decoder: its decoder's cross-attention cache (SimpleKVCache) is not a prefix cache"
DIFFUSION = "a diffusion decoder: it denoises tokens in parallel, not one after another over a KV cache"
INSERTS = ("mlx-vlm's get_input_embeddings puts each image's features in place of its placeholder, more features "
           "than placeholders; mlxkv serves such a merge by expanding the placeholders to its count before they key "
           "blocks (vision/expansion.py: LLaVA-NeXT, Granite Vision), and this family's count is not known there yet")
# family -> what reading (and trying) its merge found beyond INSERTS: what serving it needs
INSERTS_FOUND = {
    "fastvlm": ("its placeholder is the id -200, not a token the engine's step can embed before an image's features "
                "replace it, and mlx-vlm builds its FastViTHD tower at full size whatever the config says (its stage "
                "widths and depths are class constants), so its test model cannot be tiny"),
    "llava_bunny": ("mlx-vlm asserts 729 features an image (SigLIP at 384 px) and puts only the first image's, in place "
                    "of the first -200 placeholder; it has no processor class for Bunny (its prepare_inputs writes the "
                    "-200 itself), so a test model's prompts are 750 tokens an image and the ids are not a tokenizer's"),
    "multi_modality": ("mlx-vlm's Janus inserts num_image_tokens more placeholders at an image's first one, then keeps "
                       "text only before the first placeholder and after the last: one image embeds to the processor's "
                       "length, but a second image's features land after the first's and the text between is dropped; "
                       "and its image processor sizes images at 384 px (576 features an image) unless the SAM hybrid "
                       "tower is configured, so a test model's prompts are 600 tokens an image"),
    "phi4mm": ("mlx-vlm merges its vision or speech LoRA into the language model's weights by a request's modality "
               "(set_modality, on the model object), so in a batch of text and image rows one set of weights serves "
               "all; and each image is one -200 placeholder (its h x w features, from spatial_shapes, in its "
               "place), not a token the engine's step can embed"),
}
CHUNK_MASK = ("mlx-vlm's Llama 4 gives its global layers the mask its first layer's cache makes, a chunked "
              "layer's; over mlxkv's pool that mask covers the chunk, not the context the global layer attends to")
TOKENIZER_ONLY = ("transformers has no processor for its model type, so mlx-vlm 0.7.10 loads only its tokenizer "
                  "and cannot preprocess its images (tried on a tiny model)")
POSITIONS_ON_MODEL = ("mlx-vlm's HunYuan-VL keeps a prompt's four-axis XD-RoPE positions on the model object and "
                      "uses them only while the cache is empty: a prefix hit, a later prefill chunk or another row "
                      "of a batch would get plain positions")
IMAGE_TOKEN_WEIGHTS = ("its language model sends image tokens through their own weights (ERNIE-4.5-VL: multimodal "
                       "experts; ZAYA1-VL: a vision LoRA), chosen by a per-token image mask passed beside the "
                       "embeddings; mlxkv's rows give the language model embeddings and positions only")
OWN_BATCH_MASK = ("mlx-vlm's Inkling builds its own relative-position mask from the key count (offset = keys - "
                  "queries), one for the whole batch, not the cache's mask: in a batch of rows of different lengths "
                  "a row gets another's positions (tried: one row equals mlx-vlm; a batch and preempted rows do not)")
ONE_PLACE = ("mlx-vlm's processor puts a prompt's images in one place, not in the turns that sent them (Molmo: "
             "before the whole prompt, a second image a second prompt of the batch; GOT-OCR: before a bare "
             "instruction, its merge one image a sequence; Step3p7: all at its one <im_patch>, a second an error; "
             "PaddleOCR-VL: a prompt's images stacked as the frames of one, tried: two are an error; PLaMo 2-VL: "
             "before the text of a fixed one-turn template): a conversation's images cannot sit where they were sent")
LAYER_MAP = ("mlx-vlm's Granite 4 Vision embeds only a prompt's first image (pixel_values[0]) and hands its "
             "features to chosen language-model layers (deepstack_layer_map, kept on the model object), not "
             "the first layers mlxkv's rows carry deepstack features to")
UNTESTED = ("not yet run over the pool with images: it needs its tiny model and the equality tests "
            "(docs/vision.md)")
# family -> what a try found standing between it and its tiny model's tests (it stays not yet run: a
# checkpoint of it may well work; mlxkv has not shown it does)
NOT_YET_RUN = {
    "phi3_v": ("read and sized: mlx-vlm builds its tower as CLIP ViT-L/14-336 (24 layers, 1024 wide, 300M "
               "parameters) whatever the config says, and an image is at least 313 placeholders: its test model "
               "would be 1.2 GB and slower than DeepSeek-OCR's SAM encoder (its negative placeholder ids could be "
               "mapped to one token)"),
    "deepseekocr": ("tried: mlx-vlm builds its SAM encoder as SAM ViT-B (12 layers, 768 wide, 96M parameters) "
                    "over 640- or 1024-pixel views whatever the config says: one 640-pixel view took 78 s on the "
                    "test machine's CPU (load 41)"),
    "unlimited_ocr": "read: its model is DeepSeek-OCR's, with DeepSeek-OCR's SAM encoder (see deepseekocr)",
    "deepseek_vl_v2": ("tried twice, its processor's MLX outputs evaluated where the prompt is built and before "
                       "mlx-vlm's generate: mlxkv's replies repeat, and mlx-vlm's generate alone does, but mlx-vlm's "
                       "generate in a process that also runs mlxkv's engine on the same model changes its reply in "
                       "some runs (cause not found), so it is no oracle yet; its tiles an image need "
                       "images_spatial_crop to key them"),
    "muse_spark": ("read: mlx-vlm runs its attention through a Metal kernel (qk_norm_rope), so its test model "
                   "cannot run on the Linux machine the tests run on"),
    "dots_ocr": ("read: mlx-vlm's processor hard-codes Qwen2's image token id 151665: its test model needs a "
                 "151k-token vocabulary and tokenizer"),
    "jina_vlm": ("read: mlx-vlm's processor makes its image processor with its defaults (Qwen2's ids "
                 "151665-151668 for its patch tokens, its crop sizes) whatever the checkpoint says: its test model "
                 "needs a 151k-token vocabulary; its features are added to the patch tokens' embeddings, which the "
                 "whole-prompt path keeps"),
    "youtu_vl": ("tried: mlx-vlm has no processor for it (its checkpoint's is remote code), so its load of a tiny "
                 "one gives a tokenizer alone, which drops the images (no pixel_values), and no installed "
                 "processor makes its SigLIP 2 spatial_shapes and placeholder counts"),
    "molmo2": ("tried: mlx-vlm's load replaces its image processor with one of default settings (378-pixel "
               "crops, up to 8) whatever the checkpoint says, so a test image is hundreds of placeholders (870 for "
               "two small images); its features are added to `image_patch_id` tokens, a row of them closed by "
               "`<im_col>`, each image two views: its spans need their own grouping"),
}

_REASONS = (
    (TEXT_MODEL, (
    "afm7", "afmoe", "apertus", "baichuan_m1", "bailing_moe", "bailing_moe_linear", "bitnet",
    "cohere", "cohere2", "cohere2_moe", "dbrx", "deepseek", "deepseek_v2", "deepseek_v3",
    "deepseek_v32", "deepseek_v4", "deepseek_v41", "dots1", "ernie4_5", "ernie4_5_moe", "exaone",
    "exaone4", "exaone_moe", "falcon_h1", "flint", "gemma", "gemma2", "gemma3_text", "gemma4_text",
    "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt2", "gpt_bigcode", "gpt_neox",
    "gpt_oss", "granite", "granitemoe", "granitemoehybrid", "helium", "hrm_text", "hunyuan",
    "hunyuan_v1_dense", "hy_v4", "internlm2", "internlm3", "iquestloopcoder", "jamba", "k2_horizon",
    "kimi_linear", "klear", "kolibri1", "laguna", "lfm2", "lfm2_moe", "lille_130m", "limite",
    "llama", "llama4_text", "longcat_flash", "longcat_flash_ngram", "longcat_flash_sparse", "mamba",
    "mamba2", "mellum", "mimo", "mimo_v2_flash", "minicpm", "minicpm3", "minimax", "minimax_m3",
    "ministral3", "mistral4", "mixtral", "nanochat", "nemotron", "nemotron_h", "nemotron_nas",
    "nemotron_voicechat", "olmo", "olmo2", "olmo3", "olmoe", "openelm", "phi", "phi3", "phi3small",
    "phimoe", "phixtral", "plamo", "plamo2", "qwen", "qwen2", "qwen2_moe", "qwen3",
    "qwen3_5_moe_text", "qwen3_5_text", "qwen3_moe", "qwen3_next", "recurrent_gemma", "rwkv7",
    "seed_oss", "smollm3", "solar_open", "spark2_5", "stablelm", "starcoder2", "step3p5",
    "telechat3", "xing4_0", "youtu_llm", "z1t",
)),
    (NOT_GENERATIVE, (
    "bert", "bonsai", "colidefics3", "colqwen2_5", "decider2", "dinov2", "embedding_gemma2",
    "ernie_image", "falcon_perception", "flux2", "flux3", "gemma3_embedding", "gliner2_5",
    "ideogram4", "laya", "lfm2_colbert", "lfm2_embedding", "lfm2_encoder", "llada_image",
    "llama_bidirec", "llama_nemotron_vl_embedding", "locateanything", "mage_flow", "ming_image",
    "minimax_h3", "ministral3_embedding", "modernbert", "moge3", "moss_image",
    "openai_privacy_filter", "phi4_siglip", "pp_doclayout_v3", "prism_hadamard_qwen35",
    "qwen3_embedding", "qwen3_vl_embedding", "qwen_image", "rfdetr", "rt_detr_v2", "sam3", "sam3_1",
    "sam3d_body", "sam3d_objects", "sapiens2", "siglip", "video_depth_anything", "xlm_roberta",
    "yolo11", "z_image",
)),
    (RECURRENT_API, (
    "glm5_next", "qwen3_5", "qwen3_5_moe", "qwen4_exp",
    # their language model is mlx-vlm's Qwen3.5's (read from their imports)
    "clef", "indic_ocr", "minicpmv4_6", "minicpmv4_7",
)),
    (BIDIRECTIONAL, (
    "paligemma", "gemma4", "gemma4_unified", "falcon_ocr", "lfm2_vl", "molmo_point",
    "deepseekocr_2", "d1_omni",
    # Moondream: mlx-vlm's _create_prefix_attention_mask, the BOS and the image's tokens a bidirectional prefix
    "moondream2", "moondream3",
)),
    (PER_LAYER_INPUTS, (
    "gemma3n",
)),
    (CROSS_ATTENTION, (
    "mllama",
)),
    (ENCODER_DECODER, (
    "florence2", "nemotron_parse",
)),
    (DIFFUSION, (
    "diffusion_gemma", "nemotron_labs_diffusion", "llada2_moe", "d1",
)),
    (CHUNK_MASK, (
    "llama4",
)),
    (TOKENIZER_ONLY, (
    "mistral_large3",
)),
    (POSITIONS_ON_MODEL, (
    "hunyuan_vl",
)),
    (OWN_BATCH_MASK, (
    "inkling",
)),
    (IMAGE_TOKEN_WEIGHTS, (
    "ernie4_5_moe_vl", "zaya1_vl",
)),
    (ONE_PLACE, (
    "molmo", "got", "step3p7", "paddleocr_vl", "plamo2vl",
)),
    (LAYER_MAP, (
    "granite4_vision",
)),
    *((f"{UNTESTED}; {found}", (family,)) for family, found in NOT_YET_RUN.items()),
    *((f"{INSERTS}: {found}", (family,)) for family, found in INSERTS_FOUND.items()),
)
# family -> why mlxkv does not serve its images
NOT_SERVED = {family: reason for reason, families in _REASONS for family in families}
