"""Masks pasted over their boxes only (``box_masks``) and ``test_cfg.mask_format='rle'``.

Expected values come from mmdet: its ``_do_paste_mask`` (the mask head's CPU paste), its
``encode_mask_results`` and pycocotools' ``encode`` of the whole image's mask, and stock
``predict``'s (N, H, W) masks of the same model.
"""
import numpy as np
import pycocotools.mask as mask_utils
import pytest
import torch
from test_lean_detection import _meta, _pair, _predict, _samples

from mmdet.evaluation.metrics import CocoMetric
from mmdet.models.roi_heads.mask_heads.fcn_mask_head import _do_paste_mask
from mmdet.structures.mask import encode_mask_results
from xcit_mm.models.detectors import box_masks
from xcit_mm.models.detectors.box_masks import box_mask_rle, coco_rle, paste_in_box
from xcit_mm.models.utils.memory_budget import MemoryBudgetError

HW = (200, 328)


def _boxes_and_logits(n=30, hw=(61, 83), seed=0):
    """Random mask logits and boxes of every kind: inside, across the image's edges, covering it,
    of zero width, and outside it."""
    g = torch.Generator().manual_seed(seed)
    H, W = hw
    corner = torch.rand(n, 2, generator=g) * torch.tensor([W, H]) - 10
    boxes = torch.cat([corner, corner + torch.rand(n, 2, generator=g) * 50], 1)
    boxes[:4] = torch.tensor([[-5., -3, W + 4, H + 7], [10., 10, 10, 30], [W + 1., 2, W + 9, 9],
                              [0.5, 0.5, W - 0.5, H - 0.5]])
    return torch.randn(n, 28, 28, generator=g) * 4, boxes


def _stock_mask(logits, box, hw):
    """The whole image's mask as mmdet's mask head pastes it on the CPU."""
    full = torch.zeros(hw, dtype=torch.bool)
    pasted, region = _do_paste_mask(logits[None, None].sigmoid(), box[None], *hw)
    full[region] = pasted[0] >= 0.5
    return full


@pytest.mark.parametrize('block_pixels', [box_masks.PASTE_BLOCK_PIXELS, 97])
def test_masks_pasted_in_their_boxes_are_mmdets_bit_for_bit(block_pixels, monkeypatch):
    """In blocks of whole columns (97 px: a column or two of a box at a time) the box's mask and
    its RLE equal mmdet's pasted mask and pycocotools' RLE of it, every kind of box."""
    monkeypatch.setattr(box_masks, 'PASTE_BLOCK_PIXELS', block_pixels)
    monkeypatch.setattr(box_masks.sampled_blocks, '__defaults__', (block_pixels, ))
    hw = (61, 83)
    logits, boxes = _boxes_and_logits(hw=hw)
    for i, ((mask, x0, y0), box) in enumerate(zip(paste_in_box(logits, boxes, hw), boxes)):
        expected = _stock_mask(logits[i], box, hw)
        got = torch.zeros(hw, dtype=torch.bool)
        got[y0:y0 + mask.shape[0], x0:x0 + mask.shape[1]] = mask
        assert torch.equal(got, expected), i
        rle = box_mask_rle(logits[i], box, hw)
        assert rle == encode_mask_results(expected[None].numpy())[0], i


def test_rle_of_a_mask_in_its_box_is_the_whole_images():
    """coco_rle from the box's mask alone equals pycocotools' encoding of the whole image's
    mask: boxes at the image's edges, a box over every row (runs going on across columns), an
    empty mask."""
    rs = np.random.RandomState(0)
    h, w = 37, 53
    for y0, x0, bh, bw in ((0, 0, 5, 7), (30, 40, 7, 13), (0, 10, h, 6), (0, 0, h, w),
                           (12, 3, 1, 1), (3, 4, 9, 9)):
        for fill in (0.0, 0.5, 1.0):
            mask = rs.rand(bh, bw) < fill
            full = np.zeros((h, w), np.uint8)
            full[y0:y0 + bh, x0:x0 + bw] = mask
            rle = coco_rle(mask, x0, y0, (h, w))
            assert rle == {'size': [h, w], 'counts': mask_utils.encode(
                np.asfortranarray(full))['counts'].decode()}, (y0, x0, bh, bw, fill)


@pytest.fixture(scope='module')
def lean():
    model = _pair()[1]
    with torch.no_grad():  # clearer winners than the random heads give
        model.rpn_head.rpn_cls.weight.mul_(20)
        model.roi_head.bbox_head.fc_cls.weight.mul_(20)
    model.test_cfg.rcnn.score_thr = 0.3
    return model


def _run(model, metas, rescale=True, **test_cfg):
    keys = dict(mode='stream', tile_size=128, **test_cfg)
    model.test_cfg.update(keys)
    try:
        image = torch.randn(1, 3, *HW, generator=torch.Generator().manual_seed(0))
        return _predict(model, image, metas, rescale)[0].pred_instances
    finally:
        for key in keys:
            model.test_cfg.pop(key)


@pytest.mark.parametrize('rescale', [True, False])
def test_rle_masks_are_the_bitmaps_encoded_and_coco_metric_stores_the_same(lean, rescale):
    """mask_format='rle' through predict, on an image resized from 150 x 246: the boxes are the
    bitmap run's, each RLE is mmdet's encoding of its bitmap, and CocoMetric keeps the same
    results from both."""
    metas = [dict(_meta(HW, HW, (150, 246)), img_id=0)]
    bitmap = _run(lean, metas, rescale)
    rle = _run(lean, metas, rescale, mask_format='rle')
    assert len(bitmap) > 3 and isinstance(rle.masks, list)
    assert torch.equal(rle.bboxes, bitmap.bboxes) and torch.equal(rle.scores, bitmap.scores)
    assert rle.masks == encode_mask_results(bitmap.masks.numpy())
    assert bitmap.masks.shape[1:] == ((150, 246) if rescale else HW)
    # ground truth: the confident detections (COCO's own evaluation of both result formats)
    keep = bitmap.scores > 0.5
    gt = [dict(bbox=box.tolist(), bbox_label=int(label), ignore_flag=0, mask=mask)
          for box, label, mask in zip(bitmap.bboxes[keep], bitmap.labels[keep],
                                      encode_mask_results(bitmap.masks[keep].numpy()))]
    metrics = []
    for instances in (bitmap, rle):
        metric = CocoMetric(metric=['bbox', 'segm'])
        metric.dataset_meta = dict(classes=[str(c) for c in range(10)])
        metric.process({}, [dict(img_id=0, ori_shape=bitmap.masks.shape[1:], width=0, height=0,
                                 instances=gt, pred_instances=dict(
                                     bboxes=instances.bboxes, scores=instances.scores,
                                     labels=instances.labels, masks=instances.masks))])
        metrics.append(metric.evaluate(1))
    assert metrics[0] == metrics[1] and metrics[1]['coco/segm_mAP'] > 0.5


def _plans(model, side, **test_cfg):
    """The auto plans for a side² image (a shape, no pixels) with a given network line."""
    keys = dict(mode='auto', tile_size=1024, max_memory=3000,
                memory_model=dict(base_mb=10, mb_per_mpix=50), **test_cfg)
    model.test_cfg.update(keys)
    try:
        image = torch.empty(1, 3, 1, 1).expand(1, 3, side, side)
        return model.memory_plans(image, _samples([_meta((side, side), (side, side),
                                                         (side, side))]))
    finally:
        for key in keys:
            model.test_cfg.pop(key)


def test_auto_counts_whole_image_masks_and_rle_fits_where_they_do_not(lean):
    """8192² within 3000 MB: up to 100 bitmaps of the whole image per core fit no plan, and the
    error names mask_format='rle'; with RLEs the stream fits."""
    bitmap = _plans(lean, 8192)
    assert all(p.estimate_mb > 3000 for p in bitmap)
    assert "mask_format='rle'" in {p.name: p for p in bitmap}['stream'].detail
    with pytest.raises(MemoryBudgetError, match="mask_format='rle' pastes each in its box"):
        lean._choose_memory_plan(bitmap, 3000, 'LeanMaskRCNN on 8192²')
    rle = _plans(lean, 8192, mask_format='rle')
    assert lean._choose_memory_plan(rle, 3000, 'LeanMaskRCNN on 8192²').name == 'stream'
    assert "mask_format" not in ' '.join(p.detail for p in rle)


@pytest.mark.parametrize('test_cfg, words', [
    (dict(mode='stream', mask_format='png'), "mask_format must be 'bitmap'"),
    (dict(mode='whole', mask_format='rle'), "only apply to mode='tiles' or mode='auto' or"),
    (dict(mode='stream', mask_format='rle', rcnn=dict(mask_thr_binary=-1)),
     'set mask_thr_binary >= 0'),
])
def test_a_bad_mask_format_is_refused_at_build_naming_the_fix(test_cfg, words):
    with pytest.raises(ValueError, match=words):
        _pair(**test_cfg)
