"""Placeholders expanded to the features a merge inserts (families.INSERTS).

mlx-vlm's get_input_embeddings writes most families' image features over
their placeholder tokens, one feature a token, so a prompt's ids and its
embeddings have one length. A few families' merges instead put an image's
features in place of its placeholders, more features than placeholders,
so the embedded prompt is longer than its ids. The pool's blocks, hashes
and positions are the ids', so before the ids key anything each image's
run of placeholders is rewritten to one placeholder a feature it becomes:
then ids, embeddings, positions and block keys have one length, the
image's hash keys the blocks its features overlap, and its features are
written over the expanded placeholders as for any other family.

The processor's own ids stay beside (get_input_embeddings takes them);
prompt.py checks the embedded length against the expansion, so a merge
that changes in mlx-vlm is a clear error, not a misplaced image.
"""

from __future__ import annotations

from mlxkv.errors import MlxkvError

# Families whose merge inserts features and whose count is known here from the processor's outputs.
EXPANDED = ("llava_next", "granite_vision")


def expands(config) -> bool:
    return getattr(config, "model_type", None) in EXPANDED


def check_image_count(config, parts: list[tuple[str, dict]]) -> None:
    """mlx-vlm 0.7.10's LLaVA-NeXT (and Granite Vision) embeds the first image's tiles alone: a second
    image's placeholders would take the first image's blocks, or vanish with the text before them, so
    an expanding family takes one image a request. The error names the second image's part."""
    if expands(config) and len(parts) > 1:
        raise MlxkvError(f"{parts[1][0]}: {config.model_type} takes one image a request (mlx-vlm 0.7.10 embeds "
                         f"the first image's tiles alone: the others would be read as the first); got {len(parts)}")


def expanded_tokens(config, tokens: list[int], image_token: int, inputs: dict) -> list[int]:
    """`tokens` with each image's run of placeholders as long as the features its merge inserts
    (one image: check_image_count ran first)."""
    return _llava_next(config, tokens, image_token, inputs)


def _llava_next(config, tokens: list[int], image_token: int, inputs: dict) -> list[int]:
    """mlx-vlm 0.7.10's LLaVA-NeXT (and Granite Vision, its merge copied) runs its tower over the first image's
    tiles only ([T, P, D]: the base view and the best pinpoint's crops), appends T blocks of P copies of its
    image_newline, and puts block i in place of placeholder i: min(N, 2T) blocks for a run of N placeholders,
    P features each (P: the tower's patches a tile: CLIP's CLS too, unless the "default" strategy drops it)."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    if vision.model_type == "clip_vision_model":
        patches += 1  # its CLS
    if config.vision_feature_select_strategy == "default":
        patches -= 1
    tiles = inputs["pixel_values"].shape[1]
    at = [i for i, t in enumerate(tokens) if t == image_token]
    if not at:
        return tokens
    if at != list(range(at[0], at[-1] + 1)):
        raise MlxkvError(f"messages: {config.model_type}'s image placeholders are not one run")
    blocks = min(len(at), 2 * tiles)
    return tokens[: at[0]] + [image_token] * (blocks * patches) + tokens[at[-1] + 1 :]
