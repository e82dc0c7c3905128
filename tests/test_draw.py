"""draw_mask: a PNG of one packed line's attention mask, with prompt, branches and padding in distinct colours."""

from __future__ import annotations

import numpy as np
import pytest

from prefixdpo.core.attention.draw import MASK_COLOURS, draw_mask, mask_image
from prefixdpo.data.batch import build_batch
from prefixdpo.data.example import Example


@pytest.fixture
def packed_batch():
    examples = [Example([5, 6, 7], [[8, 9], [10, 11, 12]]), Example([13, 14], [[15], [16, 17], [18]], pairs=((0, 2),))]
    return build_batch(examples, prefix_sharing=True, packs=[[0, 1]], length=20)


def test_mask_image_colours_cells_by_key_kind(packed_batch):
    img = mask_image(packed_batch, 0)
    assert img.shape == (20, 20, 3)
    prompt, (b1, b2, b3) = MASK_COLOURS["prompt"], MASK_COLOURS["branches"][:3]
    assert tuple(img[4, 0]) == prompt          # response 1 of doc 0 sees the prompt
    assert tuple(img[4, 3]) == b1              # ... and its own first token
    assert tuple(img[6, 4]) == MASK_COLOURS["forbidden"]  # response 2 must not see response 1
    assert tuple(img[6, 5]) == b2
    assert tuple(img[9, 2]) == MASK_COLOURS["forbidden"]  # doc 1 must not see doc 0
    assert tuple(img[13, 8]) == prompt and tuple(img[13, 13]) == b3  # doc 1: prompt 8-9, branch 3 at 13
    assert tuple(img[13, 10]) == MASK_COLOURS["forbidden"]
    assert tuple(img[19, 19]) == MASK_COLOURS["padding"] and tuple(img[0, 19]) == MASK_COLOURS["padding"]


def test_draw_mask_writes_a_png_with_every_colour(packed_batch, tmp_path):
    import matplotlib.image

    path = draw_mask(packed_batch, tmp_path / "mask.png")
    pixels = (matplotlib.image.imread(str(path))[..., :3] * 255).round().astype(int).reshape(-1, 3)
    present = {tuple(p) for p in np.unique(pixels, axis=0)}
    for colour in [MASK_COLOURS["prompt"], MASK_COLOURS["padding"], *MASK_COLOURS["branches"][:3]]:
        assert tuple(colour) in present, colour
    with pytest.raises(ValueError, match="line 3 is out of range"):
        draw_mask(packed_batch, tmp_path / "bad.png", line=3)
