"""Instance masks pasted over their boxes only, and their COCO RLE, never a mask of the whole image.

mmdet's ``FCNMaskHead`` pastes each detection's 28 x 28 mask logits into an (N, H, W) tensor of the
image: at gigapixel sizes one such mask is gigabytes. Here a mask is sampled exactly as mmdet
samples it (its sigmoid read by ``grid_sample`` at each pixel centre of the box and a pixel
around it, then ``>= threshold``), but over the box alone and a block of columns at a time, and it
becomes either a bool array of the box (for outlines) or the compressed RLE that
``pycocotools.mask.encode`` gives for the whole image's mask (for COCO results and
``CocoMetric``). Each output pixel reads only its own sampling point, so the blocks change
nothing.
"""
from typing import Iterator, List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

# Transient bytes per pixel of a region a mask is pasted into: the sampling grid (2 floats), the
# sampled mask (1 float) and its thresholded copy (1 byte); mmdet's pasting costs the same.
PASTE_BYTES_PER_PIXEL = 13
# Pixels of a box sampled at once when its RLE is made: bounds the transient above.
PASTE_BLOCK_PIXELS = 1 << 22
# An RLE's size, counted as two runs (one object crossing) per column of its box, each run a few
# characters of pycocotools' compressed counts.
RLE_BYTES_PER_COLUMN = 2 * 6


def rle_masks_mb(count: int, box_width: int) -> float:
    """Memory (MB) of making ``count`` masks' RLEs, boxes up to ``box_width`` px wide: their
    strings and one block's sampling."""
    return (count * box_width * RLE_BYTES_PER_COLUMN
            + PASTE_BYTES_PER_PIXEL * PASTE_BLOCK_PIXELS) / 2**20


def box_region(box: Tensor, image_hw: Sequence[int]) -> Tuple[int, int, int, int]:
    """(y0, y1, x0, x1): the pixels mmdet pastes a box's mask into on the CPU (the box's whole
    pixels and one more on each side, inside the image)."""
    H, W = (int(v) for v in image_hw)
    x0 = max(int(torch.floor(box[0])) - 1, 0)
    y0 = max(int(torch.floor(box[1])) - 1, 0)
    x1 = min(int(torch.ceil(box[2])) + 1, W)
    y1 = min(int(torch.ceil(box[3])) + 1, H)
    return y0, max(y1, y0), x0, max(x1, x0)


def _normalised(pixels: Tensor, low: Tensor, high: Tensor) -> Tensor:
    """Pixel indices as ``grid_sample`` coordinates of the box side [low, high]: the pixel centre
    (index + 0.5) mapped to [-1, 1] (a box of zero extent maps to 0 rather than infinity)."""
    coords = (pixels.to(torch.float32) + 0.5 - low) / (high - low) * 2 - 1
    return coords.masked_fill_(torch.isinf(coords), 0)


def sampled_blocks(probs: Tensor, box: Tensor, image_hw: Sequence[int],
                   block_pixels: int = PASTE_BLOCK_PIXELS) -> Iterator[Tuple[int, Tensor]]:
    """The mask probabilities ``probs`` ((h, w) floats, a sigmoid) sampled over the box's paste
    region (:func:`box_region`), a block of whole columns at a time: ``(x, block)`` with ``block``
    (region rows, columns) the columns from ``x`` on."""
    y0, y1, x0, x1 = box_region(box, image_hw)
    if y1 == y0 or x1 == x0:
        return
    device = probs.device
    ys = _normalised(torch.arange(y0, y1, device=device), box[1], box[3])
    source = probs[None, None].to(torch.float32)
    step = max(1, block_pixels // (y1 - y0))
    for start in range(x0, x1, step):
        xs = _normalised(torch.arange(start, min(start + step, x1), device=device), box[0], box[2])
        grid = torch.stack([xs[None, :].expand(len(ys), -1), ys[:, None].expand(-1, len(xs))],
                           dim=2)
        yield start, F.grid_sample(source, grid[None], align_corners=False)[0, 0]


def paste_in_box(mask_logits: Tensor, bboxes: Tensor, image_hw: Sequence[int],
                 threshold: float = 0.5) -> List[Tuple[Tensor, int, int]]:
    """Each instance's mask as ``FCNMaskHead.predict_by_feat`` pastes it, over its box and a pixel
    around it only: ``(mask, x0, y0)``, a bool (h, w) mask whose top-left pixel is (x0, y0) of the
    image."""
    out = []
    for logits, box in zip(mask_logits, bboxes):
        y0, y1, x0, x1 = box_region(box, image_hw)
        mask = torch.zeros(y1 - y0, x1 - x0, dtype=torch.bool, device=logits.device)
        for x, block in sampled_blocks(logits.sigmoid(), box, image_hw):
            mask[:, x - x0:x - x0 + block.shape[1]] = block >= threshold
        out.append((mask, x0, y0))
    return out


def box_mask_rle(logits: Tensor, box: Tensor, image_hw: Sequence[int],
                 threshold: float = 0.5) -> dict:
    """The compressed COCO RLE of one instance's pasted mask (as :func:`paste_in_box` pastes it)
    on the whole image, made block by block from the box alone: ``{'size': [H, W], 'counts':
    bytes}``, what ``pycocotools.mask.encode`` and mmdet's ``encode_mask_results`` give."""
    H = int(image_hw[0])
    y0 = box_region(box, image_hw)[0]
    starts, ends = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for x, block in sampled_blocks(logits.sigmoid(), box, image_hw):
        block_starts, block_ends = _column_runs((block >= threshold).cpu().numpy(), x, y0, H)
        starts.append(block_starts)
        ends.append(block_ends)
    return _rle(np.concatenate(starts), np.concatenate(ends), image_hw)


def coco_rle(mask: np.ndarray, x0: int, y0: int, image_hw: Sequence[int]) -> dict:
    """The compressed RLE (``{'size': [H, W], 'counts': str}``) that
    ``pycocotools.mask.encode`` gives for the whole image's mask holding ``mask`` (bool (h, w))
    at column ``x0``, row ``y0`` and nothing else, made from the runs of ``mask`` alone."""
    H, W = (int(v) for v in image_hw)
    mask = np.asarray(mask, bool)
    h, w = mask.shape
    if not (0 <= x0 and x0 + w <= W and 0 <= y0 and y0 + h <= H):
        raise ValueError(f'mask of shape {mask.shape} at ({x0}, {y0}) is not inside the image '
                         f'{H}x{W}')
    rle = _rle(*_column_runs(mask, x0, y0, H), image_hw)
    return dict(rle, counts=rle['counts'].decode('ascii'))


def _column_runs(mask: np.ndarray, x0: int, y0: int, H: int) -> Tuple[np.ndarray, np.ndarray]:
    """The runs of True pixels of ``mask`` (bool (h, w), top-left pixel at (x0, y0)) down each
    column, column after column: their first pixels and ends (exclusive) as indices of the whole
    image's pixels in column-major (Fortran) order, the order COCO's RLE counts them in."""
    h, w = mask.shape
    padded = np.zeros((w, h + 2), np.int8)  # each column of the box, a zero either end
    padded[:, 1:-1] = mask.T
    step = np.diff(padded, axis=1)
    col, row = np.nonzero(step == 1)
    end_col, end_row = np.nonzero(step == -1)
    return ((x0 + col).astype(np.int64) * H + y0 + row,
            (x0 + end_col).astype(np.int64) * H + y0 + end_row)


def _rle(starts: np.ndarray, ends: np.ndarray, image_hw: Sequence[int]) -> dict:
    """COCO's compressed RLE (counts as bytes) of the whole image's mask whose True runs are
    ``starts``..``ends`` (column-major indices, in order): counts alternate zeros and ones,
    starting with a run of zeros (maybe empty); a run reaching a column's last row and one
    starting the next column's first row are one run."""
    import pycocotools.mask as mask_utils
    H, W = (int(v) for v in image_hw)
    if len(starts) > 1:
        joined = starts[1:] == ends[:-1]
        starts = starts[np.r_[True, ~joined]]
        ends = ends[np.r_[~joined, True]]
    edges = np.concatenate([[0], np.stack([starts, ends], 1).ravel(), [H * W]])
    counts = np.diff(edges)
    if len(counts) > 1 and counts[-1] == 0:  # a mask reaching the last pixel: no zeros after
        counts = counts[:-1]
    rle = mask_utils.frPyObjects({'size': [H, W], 'counts': counts.tolist()}, H, W)
    return {'size': [H, W], 'counts': rle['counts']}
