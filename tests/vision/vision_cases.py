"""Images the vision tests send."""


def make_image(width: int = 112, height: int = 84, seed: int = 0):
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)
