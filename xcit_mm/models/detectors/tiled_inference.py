"""Tiled Mask R-CNN inference: the pieces of ``LeanMaskRCNN``'s ``test_cfg.mode='tiles'`` /
``'auto'`` that need no model, apart so that each can be tested on hand-made inputs: the checked
``test_cfg`` (:func:`read_tiled_test_cfg`), the tile grid (:func:`tile_grid`, :func:`cut_tile`),
the merge of the tiles' detections (:func:`merge_tile_detections`: a detection cut by a tile edge
must not survive next to the same object seen whole in a neighbouring tile) and the parts of a
plan's memory estimate that are not the network's calibrated line.
"""
import math
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from mmcv.ops import batched_nms
from mmengine.structures import InstanceData
from torch import Tensor

from mmdet.structures.bbox import bbox_overlaps

from ..inference.row_stream import read_band_mb
from ..utils.memory_budget import MB, MemoryModel, read_budget_mb, read_memory_model

MODES = ('whole', 'tiles', 'auto')
# Network-scale tiles of about the size a COCO detector is trained and tested at (800 x 1333),
# so each tile looks like an image the detector knows; the overlap is what an object may measure
# (network pixels) and still be seen whole in some tile.
DEFAULT_TILE_SIZE = (1024, 1024)
DEFAULT_TILE_OVERLAP = 256
# The smallest tile side: XCiT needs 32 px to reach its stride-32 level.
MIN_TILE_SIZE = 32
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

KNOWN_KEYS = ('rpn', 'rcnn', 'lean', 'mode', 'tile_size', 'tile_overlap', 'max_memory',
              'memory_model', 'band_mb')
TILE_KEYS = ('tile_size', 'tile_overlap')
BUDGET_KEYS = ('max_memory', 'memory_model')


class TiledTestCfg(NamedTuple):
    """The checked top-level ``test_cfg`` of ``LeanMaskRCNN`` (network-scale pixels, MB)."""
    mode: str = 'whole'
    lean: bool = True
    tile_size: Tuple[int, int] = DEFAULT_TILE_SIZE
    tile_overlap: int = DEFAULT_TILE_OVERLAP
    max_memory: Optional[float] = None
    memory_model: Optional[MemoryModel] = None
    band_mb: Optional[float] = None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _read_tile_size(value, owner: str) -> Tuple[int, int]:
    pair = (value, value) if _is_int(value) else value
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(map(_is_int, pair))
            and min(pair) >= MIN_TILE_SIZE):
        raise ValueError(
            f'{owner}: test_cfg.tile_size must be an int or an (h, w) pair of ints, each at '
            f'least {MIN_TILE_SIZE} (network-scale pixels), e.g. tile_size=1024 or '
            f'tile_size=(1024, 1536); got {value!r}')
    return int(pair[0]), int(pair[1])


def read_tiled_test_cfg(test_cfg, owner: str = 'LeanMaskRCNN') -> TiledTestCfg:
    """The top-level keys of ``test_cfg`` (next to ``rpn`` and ``rcnn``), checked: a
    ``ValueError`` naming the key and the fix for a malformed one, and for a key the mode does
    not use (``max_memory`` with ``mode='whole'`` would promise a budget nothing keeps) or an
    unknown one (a misspelt ``tile_overlap`` would leave the default in force)."""
    if test_cfg is None:
        return TiledTestCfg()
    unknown = sorted(set(test_cfg) - set(KNOWN_KEYS))
    if unknown:
        raise ValueError(f'{owner}: unknown test_cfg key(s) {unknown}; the keys are '
                         f'{list(KNOWN_KEYS)} (docs/lean_detection.md)')
    mode = test_cfg.get('mode', 'whole')
    if mode not in MODES:
        raise ValueError(f"{owner}: test_cfg.mode must be one of {list(MODES)}, got {mode!r}")
    lean = test_cfg.get('lean', True)
    if not isinstance(lean, bool):
        raise ValueError(f'{owner}: test_cfg.lean must be True or False, got {lean!r}')
    given = [k for k in TILE_KEYS + BUDGET_KEYS if test_cfg.get(k, None) is not None]
    if mode == 'whole' and given:
        raise ValueError(
            f"{owner}: test_cfg {given} only apply to mode='tiles' or mode='auto', but mode is "
            f"'whole'; set mode='auto' (with max_memory) or mode='tiles', or remove them")
    if mode == 'tiles' and any(k in given for k in BUDGET_KEYS):
        raise ValueError(
            f"{owner}: test_cfg {[k for k in given if k in BUDGET_KEYS]} only apply to "
            "mode='auto' (whole image if it fits the budget, else tiles); mode='tiles' always "
            "tiles: set mode='auto' or remove them")
    if mode != 'whole' and not lean:
        raise ValueError(f"{owner}: test_cfg.mode={mode!r} runs the lean path on each tile; "
                         "it does not combine with lean=False (remove one of them)")
    band_mb = read_band_mb(test_cfg.get('band_mb', None), owner)
    if band_mb is not None and not lean:
        raise ValueError(f'{owner}: test_cfg.band_mb makes the lean path run in bands; it does '
                         'not combine with lean=False (remove one of them)')
    if mode == 'whole':
        return TiledTestCfg(lean=lean, band_mb=band_mb)
    tile_size = test_cfg.get('tile_size', None)
    tile_size = _read_tile_size(DEFAULT_TILE_SIZE if tile_size is None else tile_size, owner)
    overlap = test_cfg.get('tile_overlap', None)
    overlap = DEFAULT_TILE_OVERLAP if overlap is None else overlap
    if not (_is_int(overlap) and 0 <= overlap < min(tile_size)):
        raise ValueError(
            f'{owner}: test_cfg.tile_overlap must be an int of network-scale pixels, at least '
            f'0 and less than the smaller tile side {min(tile_size)} (tile_size={tile_size}); '
            f'make it larger than the largest object to be seen whole in one tile; got '
            f'{overlap!r}')
    if mode == 'tiles':
        return TiledTestCfg('tiles', True, tile_size, int(overlap), band_mb=band_mb)
    return TiledTestCfg('auto', True, tile_size, int(overlap), read_budget_mb(test_cfg, owner),
                        read_memory_model(test_cfg.get('memory_model', None), owner), band_mb)


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
