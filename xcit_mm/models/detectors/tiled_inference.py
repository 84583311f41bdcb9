"""Tiled Mask R-CNN inference: the pieces of ``LeanMaskRCNN``'s ``test_cfg.mode='tiles'`` /
``'auto'`` that need no model, apart so that each can be tested on hand-made inputs: the tile
grid (:func:`tile_grid`, :func:`cut_tile`), the merge of the tiles' detections
(:func:`merge_tile_detections`: a detection cut by a tile edge must not survive next to the same
object seen whole in a neighbouring tile) and the parts of a plan's memory estimate that are not
the network's calibrated line. Its settings are ``inference.settings.DetectorSettings``.
"""
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from mmcv.ops import batched_nms
from mmengine.structures import InstanceData
from torch import Tensor

from mmdet.structures.bbox import bbox_overlaps

from ..utils.memory_budget import MB

# A box within this many network pixels (one cell of the stride-4 level) of a tile edge inside the
# image counts as cut by it: box regression does not always end exactly on the edge.
EDGE_MARGIN = 4.0
# A cut detection is a duplicate of a kept detection of its class when this fraction of its box
# lies inside the kept box (the cut box is the kept box's part inside the tile, up to box noise),
# or when their IoU exceeds the NMS threshold.
CONTAINED_THR = 0.7
# Input sides (square) at which the peak memory of features + proposals is measured for the line
# of ``mode='auto'``: small, since calibrating runs the backbone at each once, yet far enough
# apart that the slope (the per-pixel maps) stands out of the measurement noise.
CALIBRATION_SIDES = (256, 384, 512)
# Transient bytes per pixel of the region mmdet pastes one mask into (``_do_paste_mask``): the
# sampling grid (2 floats), the sampled mask (1 float) and its thresholded copy (1 byte).
PASTE_BYTES_PER_PIXEL = 13


# ---------------------------------------------------------------------- tile grid
class Tile(NamedTuple):
    """One tile of an image (network-scale coordinates of the batch input): top-left corner
    ``(y0, x0)``, extent ``(h, w)``, the part inside the image ``(valid_h, valid_w)`` (its
    ``img_shape``), and whether each side lies inside the image (``cut_*``: an object may
    continue there)."""
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
    """(start, extent) of the tiles along one axis of an image of ``length`` pixels: one from 0
    if the image fits a tile (the whole batch input if that fits: the whole-image run), else
    stepping by ``tile - overlap``, the last one ending on the image border (image pixels only).
    """
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
    """The tile's input size: padded to a multiple of ``size_divisor`` along an axis where the tile
    is a part of the batch input; as the batch input where it spans it (the data preprocessor
    padded that already), so that one tile over the whole input is the whole-image run."""
    d = max(1, int(size_divisor))
    return tuple(extent if extent == int(full) else math.ceil(extent / d) * d
                 for extent, full in zip((tile.h, tile.w), input_hw[-2:]))


def cut_tile(inputs: Tensor, tile: Tile, size_divisor: int, pad_value: float) -> Tensor:
    """A contiguous copy of ``tile`` of one image's batch input (1, C, H, W), padded at the bottom
    and right with ``pad_value`` to :func:`padded_hw`, as the data preprocessor pads whole images
    (its ``pad_value`` is applied to the normalised input)."""
    out = inputs[:, :, tile.y0:tile.y0 + tile.h, tile.x0:tile.x0 + tile.w]
    pad_h, pad_w = padded_hw(tile, inputs.shape, size_divisor)
    if (pad_h, pad_w) != (tile.h, tile.w):
        return F.pad(out, (0, pad_w - tile.w, 0, pad_h - tile.h), value=float(pad_value))
    return out.contiguous()


def tile_meta(tile: Tile, input_hw: Sequence[int]) -> dict:
    """The meta of a tile seen as an image of its own (for the RPN and the bbox head, which clamp
    boxes to ``img_shape``; nothing is rescaled on a tile)."""
    valid = (tile.valid_h, tile.valid_w)
    return dict(img_shape=valid, ori_shape=valid, pad_shape=tuple(input_hw),
                batch_input_shape=tuple(input_hw), scale_factor=(1.0, 1.0))


def touches_cut_edge(bboxes: Tensor, tile: Tile, margin: float = EDGE_MARGIN) -> Tensor:
    """Which boxes (tile coordinates) touch a side of ``tile`` that lies inside the image: their
    object may be cut there, and a neighbouring tile may see it whole."""
    cut = torch.zeros(bboxes.shape[0], dtype=torch.bool, device=bboxes.device)
    if tile.cut_left:
        cut |= bboxes[:, 0] <= margin
    if tile.cut_top:
        cut |= bboxes[:, 1] <= margin
    if tile.cut_right:
        cut |= bboxes[:, 2] >= tile.valid_w - margin
    if tile.cut_bottom:
        cut |= bboxes[:, 3] >= tile.valid_h - margin
    return cut


# ---------------------------------------------------------------------- merge
def drop_cut_duplicates(bboxes: Tensor, scores: Tensor, labels: Tensor, cut: Tensor,
                        iou_thr: Optional[float],
                        contained_thr: float = CONTAINED_THR) -> Tensor:
    """Which detections to keep (bool): every uncut one, then each cut one, in descending score,
    that duplicates none kept before it (the cut view of an object may score higher than its
    whole view in a neighbouring tile, yet only the whole box is right).

    A duplicate is of the same class and has ``contained_thr`` of its box inside the kept box
    (plain NMS would keep it: its IoU with the whole box is the visible fraction) or an IoU above
    ``iou_thr`` (the NMS threshold). A cut detection seen whole nowhere (an object larger than
    the overlap) is kept.
    """
    keep = ~cut
    order = cut.nonzero(as_tuple=False)[:, 0]
    if order.numel() == 0:
        return keep
    order = order[scores[order].argsort(descending=True, stable=True)]
    cut_boxes = bboxes[order]
    duplicate = bbox_overlaps(cut_boxes, bboxes, mode='iof') >= contained_thr
    if iou_thr is not None:
        duplicate |= bbox_overlaps(cut_boxes, bboxes, mode='iou') > iou_thr
    duplicate &= labels[order][:, None] == labels[None, :]
    for row, index in enumerate(order.tolist()):
        if not bool((duplicate[row] & keep).any()):
            keep[index] = True
    return keep


def merge_tile_detections(dets: InstanceData, nms_cfg: dict, max_per_img: int,
                          contained_thr: float = CONTAINED_THR) -> InstanceData:
    """One image's detections from its tiles' (concatenated ``dets``: image-coordinate
    ``bboxes``, ``scores``, ``labels``, ``cut`` and per-detection fields such as mask logits):
    cut duplicates dropped (:func:`drop_cut_duplicates`), class-wise NMS with the RoI head's
    ``nms`` config (as its ``multiclass_nms``: the same object seen whole in two tiles), the
    ``max_per_img`` best in descending score. One tile's detections come out unchanged.
    """
    if len(dets) == 0:
        return dets
    keep = drop_cut_duplicates(dets.bboxes, dets.scores, dets.labels, dets.cut,
                               nms_cfg.get('iou_threshold', None), contained_thr)
    dets = dets[keep]
    kept, index = batched_nms(dets.bboxes, dets.scores, dets.labels, dict(nms_cfg))
    dets = dets[index]
    dets.scores = kept[:, -1]  # NMS variants that rescore (soft-NMS) return the new scores
    if max_per_img > 0:
        dets = dets[:max_per_img]
    return dets


# ---------------------------------------------------------------------- memory estimates
def mask_output_hw(meta: dict, rescale: bool) -> Tuple[int, int]:
    """The size ``FCNMaskHead.predict_by_feat`` pastes an image's masks at."""
    h, w = meta['ori_shape'][:2]
    if rescale:
        return int(h), int(w)
    scale_w, scale_h = meta['scale_factor'][:2]
    return int(round(h * scale_h)), int(round(w * scale_w))


def paste_estimate_mb(mask_hws: Sequence[Tuple[int, int]], max_per_img: int,
                      num_mask_channels: int, mask_side: int) -> float:
    """Memory (MB) of pasting a batch's masks once the feature maps are gone: the boolean
    ``max_per_img x H x W`` masks of every image, the transients of pasting one mask over a whole
    image, and the mask logits of all images with the sigmoid of one."""
    logits = max_per_img * num_mask_channels * mask_side**2 * 4
    masks = sum(max_per_img * h * w for h, w in mask_hws)
    transient = PASTE_BYTES_PER_PIXEL * max(h * w for h, w in mask_hws)
    return (masks + transient + logits * (len(mask_hws) + 1)) / MB


def held_bytes_per_detection(mask_side: int) -> int:
    """What a tile's detection holds until the merge: box (4 floats), score, label (int64), cut
    flag and the mask logits of its class (``mask_side ** 2`` floats)."""
    return 4 * 4 + 4 + 8 + 1 + 4 * mask_side**2
