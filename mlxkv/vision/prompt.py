"""A chat prompt with images: its ids, where its images sit, and the language model's inputs.

Built once per request: the processor renders the template and expands
each image's placeholder by its grid; the vision tower runs once and its
output is merged into the prompt's embeddings; Qwen's M-RoPE positions are
computed for the whole prompt. Each image's span of placeholder tokens
and its content hash go into the block keys (image_keys.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxkv.chat.context_window import fit_messages
from mlxkv.errors import MlxkvError
from mlxkv.vision import compat, expansion, rendering
from mlxkv.vision.image_keys import ImageSpan, image_hash, image_token_counts
from mlxkv.vision.images import MAX_IMAGE_PIXELS, image_parts, is_image_part, load_image
from mlxkv.vision.model import RowInputs, VisionModel
from mlxkv.vision.rope_deltas import prefix_key

MAX_IMAGES = 16  # the default images per request


@dataclass
class VisionPrompt:
    """Built on any thread (the processor's numpy work); `row_inputs` runs the model on the engine's."""

    tokens: list[int]
    spans: list[ImageSpan]
    pixel_values: np.ndarray | list[np.ndarray]  # a list: one array an image, each of its own size (_pixels)
    grid: np.ndarray | None  # per image (t, h, w); None for families without one
    # A tiled family's [1, T, H, W] pixel_attention_mask (pixels [1, T, C, H, W], T tiles of all images);
    # its image's span runs from its first placeholder to its last, one run of placeholders a tile.
    pixel_mask: np.ndarray | None = None
    tiles: list[int] | None = None  # per image, its rows of pixel_values when it has no grid (its tiles)
    # Pixtral's (Mistral 3's) per image (h, w): its images are padded to the largest in pixel_values;
    # an image's span is its rows of placeholders, broken by [IMG_BREAK] and ended by [IMG_END].
    sizes: np.ndarray | None = None
    # What else the processor returned, for the families whose images are embedded over the whole prompt
    # (_whole_prompt_inputs): LLaVA-OneVision's image_sizes, Kimi-VL's image_grid_hws, InternVL's image_token_index.
    extras: dict | None = None
    # The processor's ids, which get_input_embeddings takes, when `tokens` has each image's placeholders
    # expanded to the features its merge inserts (expansion.py; None: `tokens` are the processor's).
    processor_tokens: list[int] | None = None

    @property
    def image_tokens(self) -> int:
        return image_token_counts(self.spans, 0)[0]

    def cached_image_tokens(self, cached: int) -> int:
        """Image tokens within the first `cached` tokens (a prefix hit's)."""
        return image_token_counts(self.spans, cached)[1]

    # A prompt is read as its ids wherever ids go (limits, replies, logs); only the engine looks further.
    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index):
        return self.tokens[index]

    def __iter__(self):
        return iter(self.tokens)

    def row_inputs(self, model: VisionModel, num_computed: int = 0, first: bool = True) -> RowInputs:
        """The language model's inputs: the vision tower's output merged in, M-RoPE positions.
        With `num_computed` tokens already cached past every image, the rest is text: its
        embeddings are its tokens' and its positions its indices plus the prompt's delta, so only
        that delta is needed (rope_deltas.py), and no image is embedded. A request's `first`
        inputs count its image tokens in the stats (a resumed one's do not again)."""
        if first:
            model.encoder_cache.count_prompt(*image_token_counts(self.spans, num_computed))
        last = max(s.end for s in self.spans)
        key = prefix_key(self.tokens, last, self.grid)
        if num_computed >= last:
            return self._text_inputs(model, key, last)
        inputs = self._image_inputs(model)
        model.rope_deltas.put(key, inputs.delta)
        return inputs

    def _text_inputs(self, model: VisionModel, key: bytes, last: int) -> RowInputs:
        """Inputs of a row whose uncomputed tokens all follow its last image: its delta alone."""
        delta = model.rope_deltas.get(key)
        if delta is None:  # not seen in this process (a hit from the SSD tier after a restart)
            grid = None if self.grid is None else mx.array(self.grid)
            delta = _delta(compat.rope_index(model.vlm, mx.array([self.tokens]), grid)[1])
            model.rope_deltas.put(key, delta)
        width = compat.embed_tokens(model.vlm, mx.array([self.tokens[:1]])).shape[-1]
        return RowInputs(mx.zeros((0, width)), mx.zeros((3, 0), mx.int32), delta, from_position=last)

    def _image_inputs(self, model: VisionModel) -> RowInputs:
        """The whole prompt's embeddings, its images' features merged in, and its positions."""
        if not compat.per_image_features(model.vlm):
            return self._whole_prompt_inputs(model)
        extra = {} if self.grid is None else {"image_grid_thw": mx.array(self.grid)}
        if self.pixel_mask is not None:
            extra = {"pixel_attention_mask": mx.array(self.pixel_mask)}
        features = [self._features(model, k) for k in range(len(self.spans))]
        deepstack = None
        if compat.deepstack_layers(model.vlm):  # [1 + k, n, D] an image: merged features, then deepstack's
            deepstack = _dense(self.tokens, model.image_token_id, mx.concatenate([f[1:] for f in features], axis=1))
            features = [f[0] for f in features]
        embeds, positions, deltas = compat.input_embeddings_from_features(
            model.vlm, mx.array([self.tokens]), mx.array(self.pixel_values), mx.concatenate(features), **extra)
        if positions is None:
            positions = mx.broadcast_to(mx.arange(len(self.tokens))[None, None], (3, 1, len(self.tokens)))
        return RowInputs(embeds[0], positions[:, 0], _delta(deltas), deepstack=deepstack)

    def _whole_prompt_inputs(self, model: VisionModel) -> RowInputs:
        """The embeddings of the tokens with each image's features at its placeholders, and the positions
        mlx-vlm gives the prompt. With every image in the encoder cache no vision tower runs; else
        mlx-vlm's get_input_embeddings embeds the whole prompt with all the processor's inputs (any family
        that writes an image's features over its placeholders), and each image's features are kept."""
        if compat.deepstack_layers(model.vlm):  # this path keeps embeddings and positions only
            raise MlxkvError(f"{model.vlm.config.model_type}: its deepstack features would be dropped on the "
                             f"whole-prompt path; it must be embedded image by image (vision/compat.py)")
        ids = mx.array([self.tokens])
        features = [model.encoder_cache.get(span.digest) for span in self.spans]
        if any(f is None for f in features):
            extras = {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in (self.extras or {}).items()}
            given = mx.array([self.processor_tokens or self.tokens])
            embeds, positions, deltas = compat.input_embeddings(model.vlm, given, _mx_pixels(self.pixel_values), **extras)
            if embeds.shape[1] != len(self.tokens):  # an inserting merge expansion.py does not count as mlx-vlm does
                raise MlxkvError(f"messages: {len(self.tokens)} prompt tokens became {embeds.shape[1]} embeddings")
            at = np.array(self.tokens) == model.image_token_id
            for span in self.spans:
                inside = np.flatnonzero(at[span.start : span.end]) + span.start
                kept = embeds[0, mx.array(inside)]
                mx.eval(kept)
                model.encoder_cache.put(span.digest, kept)
        else:
            embeds = compat.merged_embeddings(model.vlm, ids, mx.concatenate(features), model.image_token_id)
            positions, deltas = compat.rope_index(model.vlm, ids, None if self.grid is None else mx.array(self.grid))
        n = len(self.tokens)
        positions = mx.broadcast_to(mx.arange(n)[None], (3, n)) if positions is None else positions[:, 0]
        return RowInputs(embeds[0], positions, _delta(deltas))

    def _features(self, model: VisionModel, k: int) -> mx.array:
        """Image k's vision tower output: from the encoder cache, or computed and kept there."""
        digest = self.spans[k].digest
        features = model.encoder_cache.get(digest)
        if features is None:
            a, b = _pixel_rows(self, k)
            span = self.tokens[self.spans[k].start : self.spans[k].end]
            ids = mx.full((1, span.count(model.image_token_id)), model.image_token_id)
            if self.pixel_mask is not None:
                features = compat.tile_features(model.vlm, ids, mx.array(self.pixel_values[:, a:b]),
                                                mx.array(self.pixel_mask[:, a:b]))
            elif self.sizes is not None:
                h, w = (int(x) for x in self.sizes[k])
                pixels = mx.array(self.pixel_values[k : k + 1, :, :h, :w])
                features = compat.placeholder_features(model.vlm, ids, pixels, image_sizes=mx.array([[h, w]]))
            else:
                pixels = mx.array(self.pixel_values[a:b])
                grid = None if self.grid is None else mx.array(self.grid[k : k + 1])
                features = compat.vision_features(model.vlm, pixels, grid)
            mx.eval(features)
            model.encoder_cache.put(digest, features)
        return features


def _dense(tokens: list[int], image_token: int, features: mx.array) -> mx.array:
    """[k, L, D]: deepstack `features` [k, n, D] at the prompt's n placeholder positions, zeros elsewhere."""
    at = mx.array([i for i, t in enumerate(tokens) if t == image_token])
    dense = mx.zeros((features.shape[0], len(tokens), features.shape[-1]), features.dtype)
    return dense.at[:, at].add(features)


def _delta(deltas) -> int:
    """mlx-vlm's rope_deltas as one int (None: a family with plain positions)."""
    return 0 if deltas is None else int(mx.array(deltas).reshape(-1)[0].item())


def _pixel_rows(prompt: VisionPrompt, k: int) -> tuple[int, int]:
    """Image k's rows of pixel_values: its grid's patches, or its tiles."""
    sizes = [int(np.prod(g)) for g in prompt.grid] if prompt.grid is not None else prompt.tiles
    rows = np.cumsum([0] + sizes)
    return int(rows[k]), int(rows[k + 1])


def vision_prompt(model, messages: list[dict], max_pixels: int = MAX_IMAGE_PIXELS,
                  max_images: int = MAX_IMAGES) -> VisionPrompt:
    """The prompt of chat `messages` with image parts; MlxkvError naming a bad part.
    No MLX work: a server's worker thread may build it."""
    if not isinstance(model, VisionModel):
        raise MlxkvError("messages.content: this model takes text only; it has no vision tower loaded")
    parts = image_parts(messages)
    if len(parts) > max_images:
        raise MlxkvError(f"{parts[max_images][0]}: more than {max_images} images in one request")
    expansion.check_image_count(model.vlm.config, parts)
    images = [load_image(part, where, max_pixels) for where, part in parts]
    processor = model.processor
    text = rendering.render(processor, model.vlm.config.model_type, messages)
    inputs = compat.prompt_inputs(model.vlm, compat.prepare_inputs(processor, text, images, return_tensors="np"))
    pixels = _pixels(inputs["pixel_values"])
    grid = inputs.get("image_grid_thw")
    grid = None if grid is None else np.asarray(grid)
    tokens = processor_tokens = np.asarray(inputs["input_ids"])[0].tolist()
    if expansion.expands(model.vlm.config):
        tokens = expansion.expanded_tokens(model.vlm.config, tokens, model.image_token_id, inputs)
    mask = inputs.get("pixel_attention_mask")
    mask = None if mask is None else np.asarray(mask)
    # Pixtral's sizes crop its padded images; any other family's image_sizes are a layout in the key.
    sizes = inputs.get("image_sizes") if compat.padded_image_sizes(model.vlm) else None
    sizes = None if sizes is None else np.asarray(sizes)
    groups = _even(_images(tokens, model.image_token_id, compat.global_image_token_id(processor),
                           compat.image_end_token_id(processor)), len(images), mask)
    if len(groups) != len(images):
        raise MlxkvError(f"messages: {len(images)} images became {len(groups)} image spans in the prompt")
    # InternVL's tiles of all images are [1, T, C, H, W]: an image's rows are its tiles.
    total = pixels.shape[1] if getattr(pixels, "ndim", 1) == 5 and mask is None and len(pixels) == 1 else len(pixels)
    rows = _image_rows(groups, total, grid, mask, sizes)
    spans = _spans(groups, pixels, rows, grid, mask, compat.processor_settings(processor), sizes,
                   compat.per_image_inputs(inputs, len(groups)))
    extras = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    return VisionPrompt(tokens, spans, pixels, grid, mask, None if grid is not None else rows, sizes, extras,
                        processor_tokens if tokens is not processor_tokens else None)


def _pixels(values) -> np.ndarray | list[np.ndarray]:
    """pixel_values as one array, or as one array an image when the processor sizes each image on its
    own (Nemotron Nano Omni's [C, H, W]): an image's rows are then its own array."""
    if isinstance(values, (list, tuple)) and len({np.shape(v) for v in values}) > 1:
        return [np.asarray(v) for v in values]
    return np.asarray(values)


def _mx_pixels(pixels):
    return [mx.array(p) for p in pixels] if isinstance(pixels, list) else mx.array(pixels)


def _image_rows(groups: list, total: int, grid, mask, sizes) -> list[int]:
    """Each image's rows of pixel_values (what its hash covers): its grid's patches, its tiles (a run of
    placeholders a tile; Pixtral's: one padded image), one row an image, else its share of the rows by
    its placeholders: tiles of one token count each (InternVL's, Aya Vision's)."""
    if grid is not None:
        return [int(np.prod(g)) for g in grid]
    if mask is not None:
        return [len(tiles) for tiles in groups]
    if sizes is not None or total == len(groups):
        return [1] * len(groups)
    counts = [sum(n for _, n in tiles) for tiles in groups]
    if any(total * c % sum(counts) for c in counts):
        raise MlxkvError(f"messages: {total} image rows do not divide among images of {counts} tokens")
    return [total * c // sum(counts) for c in counts]


def fitted_vision_prompt(model, messages: list[dict], limit: int) -> tuple[VisionPrompt, int]:
    """The prompt of the newest turns that fit in `limit` tokens, and how many messages were left
    out (chat/context_window.py). Turns are left out whole, so an image is in the prompt with all
    its tokens or not at all. A chat that cannot fit is returned whole, for the request check."""
    prompt = vision_prompt(model, messages)
    if len(prompt) <= limit:
        return prompt, 0
    built = {id(messages): prompt}

    def measure(m: list[dict]) -> int:
        if id(m) not in built:
            built[id(m)] = vision_prompt(model, m)
        return len(built[id(m)])

    # Where the window's steps fall: a message's text tokens plus its images' (known from the whole prompt).
    images = iter(span.length for span in prompt.spans)
    encode = model.processor.tokenizer.encode
    counts = {}
    for m in messages:
        parts = m["content"] if isinstance(m.get("content"), list) else [{"type": "text", "text": m.get("content")}]
        counts[id(m)] = sum(next(images) if is_image_part(p) else len(encode(p.get("text") or "")) for p in parts)
    kept, left_out = fit_messages(messages, limit, measure, count=lambda m: counts[id(m)])
    return built[id(kept)], left_out


def _runs(tokens: list[int], image_token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of placeholder tokens."""
    runs, start = [], None
    for i, t in enumerate(list(tokens) + [None]):
        if t == image_token and start is None:
            start = i
        elif t != image_token and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def _images(tokens: list[int], image_token: int, global_token: int | None,
            end_token: int | None = None) -> list[list[tuple[int, int]]]:
    """Each image's runs of placeholders: one run, a tiled image's tiles (the last after its
    global-view token), or an image's rows (the last before its end token: Pixtral's [IMG_END])."""
    runs = _runs(tokens, image_token)
    if global_token is None and end_token is None:
        return [[run] for run in runs]
    images, tiles = [], []
    for start, n in runs:
        tiles.append((start, n))
        last = (start > 0 and tokens[start - 1] == global_token if global_token is not None
                else start + n < len(tokens) and tokens[start + n] == end_token)
        if last:
            images.append(tiles)
            tiles = []
    return images + ([tiles] if tiles else [])


def _even(groups: list, count: int, mask) -> list:
    """Idefics2 with image splitting: each image is the same number of crops plus itself, a run of
    placeholders each, with no token to tell where an image ends; its runs are then grouped evenly."""
    if mask is None or len(groups) == count or count == 0 or len(groups) % count:
        return groups
    k = len(groups) // count
    return [[run for group in groups[i * k : (i + 1) * k] for run in group] for i in range(count)]


def _spans(images: list[list[tuple[int, int]]], pixels: np.ndarray, rows: list[int], grid, mask, settings: dict,
           sizes=None, layouts: list | None = None) -> list[ImageSpan]:
    """Each image's span, first placeholder to last, keyed by its own pixels and grid (or tiles' mask,
    or its size: a padded image is keyed by its own pixels, not by the padding its neighbours set;
    or its `layouts` entry, compat.per_image_inputs': Kimi-VL's patch grid)."""
    bounds = np.cumsum([0] + rows)
    spans = []
    for k, tiles in enumerate(images):
        a, b = bounds[k], bounds[k + 1]
        start, end = tiles[0][0], tiles[-1][0] + tiles[-1][1]
        if mask is not None:
            digest = image_hash(pixels[:, a:b], mask[:, a:b], settings)
        elif sizes is not None:
            h, w = (int(x) for x in sizes[k])
            digest = image_hash(pixels[k, :, :h, :w], sizes[k], settings)
        elif getattr(pixels, "ndim", 1) == 5:
            digest = image_hash(_own_tiles(pixels, k, a, b, len(images)), layouts and layouts[k], settings)
        else:
            digest = image_hash(pixels[a:b], grid[k] if grid is not None else layouts and layouts[k], settings)
        spans.append(ImageSpan(start, end - start, digest))
    return spans


def _own_tiles(pixels: np.ndarray, k: int, a: int, b: int, count: int) -> np.ndarray:
    """Image k's tiles [T, C, H, W] of a 5-D pixel_values, the same whichever images share its request:
    LLaVA-OneVision's [images, tiles, ...] pads each image's tiles with zeros to the most tiles, InternVL's
    [1, all tiles, ...] holds every image's tiles in a row (rows a:b are image k's)."""
    tiles = pixels[k] if len(pixels) == count else pixels[0][a:b]
    while len(tiles) > 1 and not tiles[-1].any():
        tiles = tiles[:-1]
    return tiles
