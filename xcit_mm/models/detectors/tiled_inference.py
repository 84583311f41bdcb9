"""``LeanMaskRCNN``'s tiles without the model: the grid, the merge of the tiles' detections and the
memory estimates besides the network's line (docs/lean_detection.md)."""
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch.nn.functional as F
from mmcv.ops import batched_nms
from mmengine.structures import InstanceData
from torch import Tensor

from mmdet.structures.bbox import bbox_overlaps

from ..utils.memory_budget import MB
from .box_masks import PASTE_BYTES_PER_PIXEL, rle_masks_mb

# A box within this many network pixels (one cell of the stride-4 level) of a tile edge inside the
# image counts as cut by it: box regression does not always end exactly on the edge.
EDGE_MARGIN = 4.0
# A cut detection duplicates a kept one of its class with this fraction of its box inside the kept
# box (the cut box is the kept box's part inside the tile, up to box noise).
CONTAINED_THR = 0.7
# Square input sides at which features + proposals are measured for ``mode='auto'``'s line: small
# (each is one run), yet far enough apart for the slope to stand out of the noise.
CALIBRATION_SIDES = (256, 384, 512)


class Tile(NamedTuple):
    """One tile (network scale): corner, extent, the part inside the image (its ``img_shape``),
    and whether each side lies inside the image (``cut_*``: an object may continue there)."""
    y0: int
    x0: int
    h: int
    w: int
    valid_h: int
    valid_w: int
    cut_top: bool
    cut_bottom: bool
    cut_left: bool
    cut_right: bool


def axis_tiles(length: int, input_length: int, tile: int, overlap: int) -> List[Tuple[int, int]]:
    """(start, extent) of the tiles along one axis: the whole input if the image fits a tile
    (the whole-image run), else steps of ``tile - overlap``, the last ending on the image border."""
    if length <= tile:
        return [(0, min(tile, input_length))]
    starts = list(range(0, length - tile, tile - overlap)) + [length - tile]
    return [(start, tile) for start in starts]


def tile_grid(img_hw: Sequence[int], input_hw: Sequence[int], tile_hw: Sequence[int],
              overlap: int) -> List[Tile]:
    """The tiles covering an image of ``img_hw`` inside a batch input of ``input_hw``, row-major."""
    (img_h, img_w), (in_h, in_w) = img_hw[:2], input_hw[:2]
    tiles = []
    for y0, h in axis_tiles(int(img_h), int(in_h), tile_hw[0], overlap):
        for x0, w in axis_tiles(int(img_w), int(in_w), tile_hw[1], overlap):
            valid_h, valid_w = min(h, img_h - y0), min(w, img_w - x0)
            tiles.append(Tile(y0, x0, h, w, valid_h, valid_w, y0 > 0, y0 + valid_h < img_h,
                              x0 > 0, x0 + valid_w < img_w))
    return tiles


def padded_hw(tile: Tile, input_hw: Sequence[int], size_divisor: int) -> Tuple[int, int]:
    """The tile's input size: padded to ``size_divisor`` where the tile is a part of the batch
    input, as is where it spans it (so that one tile over the input is the whole-image run)."""
    d = max(1, int(size_divisor))
    return tuple(extent if extent == int(full) else math.ceil(extent / d) * d
                 for extent, full in zip((tile.h, tile.w), input_hw[-2:]))


def cut_tile(inputs: Tensor, tile: Tile, size_divisor: int, pad_value: float) -> Tensor:
    """A contiguous copy of ``tile`` of an input (1, C, H, W), padded as the preprocessor pads."""
    out = inputs[:, :, tile.y0:tile.y0 + tile.h, tile.x0:tile.x0 + tile.w]
    pad_h, pad_w = padded_hw(tile, inputs.shape, size_divisor)
    if (pad_h, pad_w) != (tile.h, tile.w):
        return F.pad(out, (0, pad_w - tile.w, 0, pad_h - tile.h), value=float(pad_value))
    return out.contiguous()


def image_meta(img_hw: Sequence[int], input_hw: Sequence[int]) -> dict:
    """The meta of an input seen as an unscaled image of its own (a tile; a calibration run)."""
    valid = tuple(img_hw)
    return dict(img_shape=valid, ori_shape=valid, pad_shape=tuple(input_hw),
                batch_input_shape=tuple(input_hw), scale_factor=(1.0, 1.0))


def touches_cut_edge(bboxes: Tensor, tile: Tile) -> Tensor:
    """Which boxes (tile coordinates) touch a side of ``tile`` inside the image: their object may
    be cut there, and seen whole by a neighbouring tile."""
    x1, y1, x2, y2 = bboxes.unbind(1)
    return ((x1 <= EDGE_MARGIN) & tile.cut_left | (y1 <= EDGE_MARGIN) & tile.cut_top
            | (x2 >= tile.valid_w - EDGE_MARGIN) & tile.cut_right
            | (y2 >= tile.valid_h - EDGE_MARGIN) & tile.cut_bottom)


def merge_tile_detections(dets: InstanceData, nms_cfg: dict, max_per_img: int) -> InstanceData:
    """One image's detections from its tiles' (image coordinates, ``cut`` flags): cut ones seen
    whole elsewhere dropped, then the RoI head's NMS and the ``max_per_img`` best (docs/)."""
    if len(dets) == 0:
        return dets
    keep = ~dets.cut
    order = dets.cut.nonzero(as_tuple=False)[:, 0]
    order = order[dets.scores[order].argsort(descending=True, stable=True)]
    cut_boxes = dets.bboxes[order]
    duplicate = bbox_overlaps(cut_boxes, dets.bboxes, mode='iof') >= CONTAINED_THR
    if nms_cfg.get('iou_threshold', None) is not None:
        duplicate |= bbox_overlaps(cut_boxes, dets.bboxes, mode='iou') > nms_cfg['iou_threshold']
    duplicate &= dets.labels[order][:, None] == dets.labels[None, :]
    for row, index in enumerate(order.tolist()):
        if not bool((duplicate[row] & keep).any()):  # seen whole nowhere: kept
            keep[index] = True
    dets = dets[keep]
    kept, index = batched_nms(dets.bboxes, dets.scores, dets.labels, dict(nms_cfg))
    dets = dets[index]
    dets.scores = kept[:, -1]  # NMS variants that rescore (soft-NMS) return the new scores
    if max_per_img > 0:
        dets = dets[:max_per_img]
    return dets


def paste_estimate_mb(metas: Sequence[dict], rescale: bool, max_per_img: int,
                      num_mask_channels: int, mask_side: int, mask_format: str = 'bitmap',
                      box_width: Optional[int] = None) -> float:
    """Memory (MB) of pasting a batch's masks at the size ``FCNMaskHead`` pastes them. Bitmaps:
    every image's boolean masks, one mask's transients, all mask logits and one image's sigmoid.
    RLE (``mask_format='rle'``): the detections' own class logits and their RLEs, boxes up to
    ``box_width`` px wide (default: the image's width)."""
    mask_hws = []
    for meta in metas:
        h, w = meta['ori_shape'][:2]
        scale_w, scale_h = (1, 1) if rescale else meta['scale_factor'][:2]
        mask_hws.append((int(round(h * scale_h)), int(round(w * scale_w))))
    if mask_format == 'rle':
        widest = max(w for _, w in mask_hws) if box_width is None else box_width
        count = max_per_img * len(mask_hws)
        return count * mask_side**2 * 4 / MB + rle_masks_mb(count, widest)
    logits = max_per_img * num_mask_channels * mask_side**2 * 4
    masks = sum(max_per_img * h * w for h, w in mask_hws)
    transient = PASTE_BYTES_PER_PIXEL * max(h * w for h, w in mask_hws)
    return (masks + transient + logits * (len(mask_hws) + 1)) / MB
