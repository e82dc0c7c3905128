"""Draw the attention mask of one packed batch line as a PNG: the picture to check before trusting it.

Each allowed (query, key) cell is coloured by what the key is: shared (on the way to 2+ sequences: a prompt, a
system prompt, earlier turns), or the one sequence (branch) below it, numbered within its trie (one colour per
number); forbidden cells are white; cells of padding queries or keys are grey. The boundaries between the tries of
a line (packed examples) are drawn as lines. The mask drawn is `masks.dense_mask`, the rule every backend uses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prefixdpo.atomic_io import atomic_path
from prefixdpo.core.attention.masks import dense_mask
from prefixdpo.data.lines import Lines

__all__ = ["MASK_COLOURS", "mask_image", "draw_mask"]

# RGB in 0..255: forbidden, padding, prompt, then branches 1, 2, 3, ... (cycled)
MASK_COLOURS = {
    "forbidden": (255, 255, 255),
    "padding": (190, 190, 190),
    "prompt": (33, 102, 172),
    "branches": [(230, 97, 1), (77, 175, 74), (152, 78, 163), (228, 26, 28), (166, 86, 40), (247, 129, 191)],
}


def tree_roots(spans: np.ndarray) -> np.ndarray:
    """Per slot of a line ([L, 2] spans): the number (0, 1, ...) of the trie it belongs to, in line order; -1 for
    padding. A slot starts a new trie when no earlier slot's subtree holds it."""
    tin, tout = spans[:, 0], spans[:, 1]
    out = np.full(len(tin), -1, dtype=np.int64)
    reach, root = -1, -1
    for t in np.flatnonzero(tin >= 0):
        if tin[t] >= reach:
            root += 1
        reach = max(reach, tout[t])
        out[t] = root
    return out


def tree_branches(spans: np.ndarray) -> np.ndarray:
    """Per slot of a line ([L, 2] spans): 0 where it lies on the way to 2+ leaves (shared), else the number
    (1, 2, ...) of the one leaf below it, counted within its trie; -1 for padding. For the picture only."""
    tin, tout = spans[:, 0], spans[:, 1]
    leaves = np.flatnonzero((tout == tin + 1) & (tin >= 0))
    roots = tree_roots(spans)
    first_leaf = {}  # trie -> the index (in `leaves`) of its first leaf
    for i, leaf in enumerate(leaves):
        first_leaf.setdefault(roots[leaf], i)
    out = np.full(len(tin), -1, dtype=np.int64)
    for t in np.flatnonzero(tin >= 0):
        below = np.flatnonzero((leaves >= tin[t]) & (leaves < tout[t]))
        out[t] = 0 if len(below) > 1 else int(below[0]) - first_leaf[roots[t]] + 1
    return out


def mask_image(batch: Lines, line: int = 0) -> np.ndarray:
    """RGB image [L, L, 3] uint8 of line `line` of `batch` (rows = queries, columns = keys), keys coloured shared
    (on the way to 2+ leaves) or by the one leaf they lead to."""
    spans = batch.spans[line : line + 1].cpu()
    allowed = dense_mask(spans)[0, 0].numpy()  # [L, L]
    branch = tree_branches(spans[0].numpy())
    pad = branch < 0
    L = branch.shape[0]
    img = np.empty((L, L, 3), dtype=np.uint8)
    img[:] = MASK_COLOURS["forbidden"]
    img[pad[:, None] | pad[None, :]] = MASK_COLOURS["padding"]
    real = allowed & ~pad[:, None] & ~pad[None, :]
    key_colour = np.empty((L, 3), dtype=np.uint8)
    key_colour[:] = MASK_COLOURS["prompt"]
    branches = MASK_COLOURS["branches"]
    for b in np.unique(branch[branch > 0]):
        key_colour[branch == b] = branches[(int(b) - 1) % len(branches)]
    img[real] = np.broadcast_to(key_colour[None, :, :], (L, L, 3))[real]
    return img


def draw_mask(batch: Lines, path: str | Path, line: int = 0, title: str | None = None) -> Path:
    """Write the mask of `batch`'s line `line` as a PNG at `path` (matplotlib, Agg); returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not 0 <= line < batch.input_ids.shape[0]:
        raise ValueError(f"line {line} is out of range: the batch has {batch.input_ids.shape[0]} lines")
    img = mask_image(batch, line)
    L = img.shape[0]
    spans = batch.spans[line].cpu().numpy()
    doc = tree_roots(spans)
    fig, ax = plt.subplots(figsize=(6.4, 6.4))
    ax.imshow(img, interpolation="nearest")
    starts = [i for i in range(1, L) if doc[i] != doc[i - 1]]
    for s in starts:  # document (and padding) boundaries
        ax.axhline(s - 0.5, color="black", lw=0.6)
        ax.axvline(s - 0.5, color="black", lw=0.6)
    n_branches = int(tree_branches(spans).max())
    handles = [Patch(color=np.array(MASK_COLOURS["prompt"]) / 255, label="shared by 2+ sequences (a prompt)")]
    handles += [Patch(color=np.array(MASK_COLOURS["branches"][(b - 1) % len(MASK_COLOURS["branches"])]) / 255,
                      label=f"branch {b}")
                for b in range(1, min(n_branches, 12) + 1)]
    handles += [Patch(color=np.array(MASK_COLOURS["padding"]) / 255, label="padding"),
                Patch(facecolor="white", edgecolor="black", label="not allowed")]
    ax.legend(handles=handles, loc="upper right", fontsize=7)
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    n_docs = len({int(d) for d in doc if d >= 0})
    ax.set_title(title or f"line {line}: {n_docs} tries, {L} positions")
    fig.tight_layout()
    path = Path(path)
    with atomic_path(str(path)) as tmp:  # the format from the real name: the temporary one has no image suffix
        fig.savefig(tmp, dpi=100, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return path
