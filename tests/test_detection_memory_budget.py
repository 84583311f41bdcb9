"""``LeanMaskRCNN``'s ``test_cfg.mode='tiles'`` / ``'auto'``: settings, tile grid, merge across
tiles, the tiled ``predict`` end to end, the plan choice and the memory budget.

The merge is tested on hand-made tile detections, and the tiled geometry (cutting, offsets, merge,
mask pasting at the original size) with a stand-in tile detector that boxes bright markers, since
a random network's detections say nothing about where objects are. The real network runs tiled
through ``mmdet.apis.inference_detector`` and ``CocoMetric``, and one tile covering the image must
give stock ``MaskRCNN.predict`` bit for bit. The memory bound is measured in a fresh process.
"""
import json
import math

import numpy as np
import pytest
import torch
from mmengine.config import Config
from mmengine.structures import InstanceData

import xcit_mm  # noqa: F401  (registers XCiTBackbone and LeanMaskRCNN)
from fresh_process import run_fresh
from mmdet.registry import MODELS
from mmdet.structures import DetDataSample
from test_lean_detection import (MAX_DETS, SIZES, _assert_same, _meta, _model_cfg, _pair,
                                 _predict)
from xcit_mm.models.detectors import tiled_inference as tiling
from xcit_mm.models.inference.settings import DetectorSettings
from xcit_mm.models.utils import memory_budget
from xcit_mm.models.utils.memory_budget import MemoryBudgetError, MemoryModel

NMS = dict(type='nms', iou_threshold=0.5)
# small models on a shared 2-core machine: one torch thread (conftest), the memory child too
pytestmark = pytest.mark.usefixtures('one_torch_thread')


@pytest.fixture(scope='module')
def pair():
    """(stock MaskRCNN, LeanMaskRCNN), same random weights (``test_lean_detection``'s)."""
    return _pair()


@pytest.fixture
def logged(monkeypatch):
    lines = []
    monkeypatch.setattr(memory_budget, 'print_log', lambda msg, **kw: lines.append(msg))
    return lines


# ---------------------------------------------------------------------- settings
@pytest.mark.parametrize('cfg,match', [
    (dict(mode='slide'), r"mode must be one of \['whole', 'tiles', 'auto', 'stream'\]"),
    (dict(max_memory=6000), r"\['max_memory'\] only apply to mode='auto', but mode is 'whole'"),
    (dict(mode='whole', tile_size=512), r"\['tile_size'\] only apply to mode='tiles'"),
    (dict(mode='tiles', max_memory=6000), r"\['max_memory'\] only apply to mode='auto'"),
    (dict(mode='tiles', memory_model=dict(base_mb=1, mb_per_mpix=1)), "only apply to mode='auto'"),
    (dict(mode='auto'), 'needs max_memory'),
    (dict(mode='auto', max_memory=-1), 'needs max_memory'),
    (dict(mode='auto', max_memory=100, memory_model=dict(base_mb=1)), 'memory_model must be'),
    (dict(mode='tiles', tile_size=16), 'tile_size must be an int or an'),
    (dict(mode='tiles', tile_size=0), 'tile_size must be'),
    (dict(mode='tiles', tile_size=(512, 512, 3)), 'tile_size must be'),
    (dict(mode='tiles', tile_size=512.0), 'tile_size must be'),
    (dict(mode='tiles', tile_size=512, tile_overlap=512), 'less than the smaller tile side 512'),
    (dict(mode='tiles', tile_overlap=-1), 'tile_overlap must be'),
    (dict(mode='stream', window_width=0), 'window_width must be an int'),
    (dict(mode='stream', window_width=4096.0), 'window_width must be an int'),
    (dict(mode='tiles', window_width=4096), r"\['window_width'\] only apply to mode='stream'"),
    (dict(mode='tiles', tile_overlapp=64), r"unknown test_cfg key\(s\) \['tile_overlapp'\]"),
    (dict(mode='tiles', lean=False), 'does not combine with lean=False'),
])
def test_settings_are_checked_with_the_fix_named(cfg, match):
    with pytest.raises(ValueError, match=match):
        DetectorSettings.from_cfg(dict(rpn={}, rcnn={}, **cfg))


def test_settings_defaults_and_build_time_check():
    assert DetectorSettings.from_cfg(dict(rpn={}, rcnn={})).mode == 'whole'
    tiles = DetectorSettings.from_cfg(dict(mode='tiles'))
    assert (tiles.tile_size, tiles.tile_overlap) == ((1024, 1024), 256)
    auto = DetectorSettings.from_cfg(dict(mode='auto', max_memory=6000, tile_size=[512, 768],
                                          memory_model=dict(base_mb=10, mb_per_mpix=20)))
    assert auto.tile_size == (512, 768) and auto.max_memory == 6000.0
    assert auto.memory_model == MemoryModel(10.0, 20.0)
    assert auto.cores_per_window() is None  # the whole width
    banded = DetectorSettings.from_cfg(dict(mode='stream', tile_size=512, window_width=1300))
    assert banded.cores_per_window() == 2  # whole cores
    assert DetectorSettings.from_cfg(dict(mode='stream', window_width=100)).cores_per_window() == 1
    cfg = _model_cfg()
    cfg.test_cfg.max_memory = 6000  # mode 'whole': refused when the model is built
    with pytest.raises(ValueError, match="only apply to mode='auto'"):
        MODELS.build(dict(cfg, type='LeanMaskRCNN'))


def test_a_box_only_roi_head_runs_stock_whole_and_is_refused_tiles():
    """Parts the lean RoI steps do not cover: whole runs them stock; tiles, which need them, are
    refused at build and at predict, naming the parts."""
    cfg = _model_cfg()
    cfg.roi_head.mask_head = cfg.roi_head.mask_roi_extractor = None
    torch.manual_seed(0)
    stock = MODELS.build(dict(cfg, type='MaskRCNN')).eval()
    lean = MODELS.build(dict(cfg, type='LeanMaskRCNN')).eval()
    lean.load_state_dict(stock.state_dict())
    inputs = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(5))
    metas = [_meta((64, 96), (64, 96), (128, 192))]
    expected, got = (_predict(m, inputs, metas)[0].pred_instances for m in (stock, lean))
    assert len(expected) == MAX_DETS and 'masks' not in expected
    for key in ('bboxes', 'labels', 'scores'):
        assert torch.equal(expected[key], got[key]), key
    refused = (r"mode='tiles' / 'auto' need mmdet's StandardRoIHead with an FCNMaskHead "
               r"\(.*\), got StandardRoIHead / NoneType; use mode='whole'")
    lean.test_cfg['mode'] = 'tiles'
    with pytest.raises(ValueError, match=refused):
        _predict(lean, inputs, metas)
    with pytest.raises(ValueError, match=refused):
        MODELS.build(dict(cfg, type='LeanMaskRCNN', test_cfg=lean.test_cfg))


# ---------------------------------------------------------------------- tile grid
@pytest.mark.parametrize('img_hw,input_hw,tile_hw,overlap', [
    ((300, 410), (320, 416), (128, 128), 32), ((1000, 1000), (1024, 1024), (512, 384), 100),
    ((97, 131), (97, 131), (256, 256), 64), ((200, 700), (224, 704), (256, 256), 0),
    ((129, 129), (160, 160), (128, 128), 127)])
def test_tile_grid_covers_the_image_with_overlap_and_ends_on_its_border(
        img_hw, input_hw, tile_hw, overlap):
    tiles = tiling.tile_grid(img_hw, input_hw, tile_hw, overlap)
    covered = np.zeros(img_hw, int)
    for t in tiles:
        covered[t.y0:t.y0 + t.valid_h, t.x0:t.x0 + t.valid_w] += 1
        assert t.y0 + t.h <= input_hw[0] and t.x0 + t.w <= input_hw[1]
        assert (t.cut_top, t.cut_left) == (t.y0 > 0, t.x0 > 0)
        assert t.cut_bottom == (t.y0 + t.valid_h < img_hw[0])
        assert t.cut_right == (t.x0 + t.valid_w < img_hw[1])
    assert covered.min() >= 1
    for axis, (start, extent) in enumerate((('y0', 'h'), ('x0', 'w'))):
        starts = sorted({getattr(t, start) for t in tiles})
        extents = {getattr(t, extent) for t in tiles}
        if img_hw[axis] <= tile_hw[axis]:  # one tile: the whole input (padding included)
            assert starts == [0] and extents == {min(tile_hw[axis], input_hw[axis])}
            continue
        assert extents == {tile_hw[axis]}
        assert starts[-1] + tile_hw[axis] == img_hw[axis]  # last tile on the image border
        steps = np.diff(starts)
        assert (steps <= tile_hw[axis] - overlap).all() and (steps > 0).all()  # >= overlap


def test_cut_tile_copies_and_pads_to_the_size_divisor():
    inputs = torch.arange(2 * 100 * 90, dtype=torch.float32).view(1, 2, 100, 90)
    tile = tiling.tile_grid((100, 90), (100, 90), (50, 40), 10)[1]
    out = tiling.cut_tile(inputs, tile, size_divisor=32, pad_value=-7)
    assert out.shape == (1, 2, 64, 64) and out.is_contiguous()
    assert torch.equal(out[:, :, :50, :40], inputs[:, :, :50, tile.x0:tile.x0 + 40])
    assert (out[:, :, 50:] == -7).all() and (out[:, :, :, 40:] == -7).all()
    whole = tiling.tile_grid((100, 90), (100, 90), (128, 128), 10)[0]  # spans the input: as is
    assert torch.equal(tiling.cut_tile(inputs, whole, 32, 0), inputs)


def test_touches_cut_edge_only_at_tile_sides_inside_the_image():
    tile = tiling.tile_grid((300, 300), (300, 300), (128, 128), 32)[4]  # a middle tile
    assert tile[:4] == (96, 96, 128, 128) and all(tile[6:])
    corner = tiling.tile_grid((300, 300), (300, 300), (128, 128), 32)[0]  # top-left
    boxes = torch.tensor([[10., 10., 50., 50.],  # inside
                          [0., 10., 50., 50.], [10., 3., 50., 50.],  # left / top edge
                          [10., 10., 125., 50.], [10., 10., 50., 128.]])  # right / bottom
    assert touches_list(boxes, tile) == [False, True, True, True, True]
    assert touches_list(boxes, corner) == [False, False, False, True, True]


def touches_list(boxes, tile):
    return tiling.touches_cut_edge(boxes, tile).tolist()


# ---------------------------------------------------------------------- merge
def _dets(rows):
    """InstanceData from rows (x1, y1, x2, y2, score, label, cut, tag); ``tag`` follows each
    detection as its mask logits would."""
    t = torch.tensor(rows, dtype=torch.float32)
    return InstanceData(bboxes=t[:, :4], scores=t[:, 4], labels=t[:, 5].long(),
                        cut=t[:, 6].bool(), tag=t[:, 7].long())


def test_merge_object_across_a_tile_border_is_one_detection_with_the_whole_box():
    # tiles [0, 128) and [96, 224) in x: an object at x 100..180 is whole in the second tile and
    # cut at x = 128 by the first, where it scores higher; the cut box is 35 % of the whole one
    # (IoU below the NMS threshold: NMS alone keeps both)
    dets = _dets([[100, 20, 128, 60, 0.95, 3, 1, 0],
                  [100, 20, 180, 60, 0.80, 3, 0, 1]])
    merged = tiling.merge_tile_detections(dets, NMS, 100)
    assert merged.tag.tolist() == [1] and merged.bboxes.tolist() == [[100, 20, 180, 60]]
    # a cut detection of another class, or one that is no part of a kept box, stays
    dets = _dets([[100, 20, 128, 60, 0.95, 4, 1, 0], [100, 20, 180, 60, 0.80, 3, 0, 1],
                  [100, 80, 128, 110, 0.70, 3, 1, 2]])
    assert sorted(tiling.merge_tile_detections(dets, NMS, 100).tag.tolist()) == [0, 1, 2]


def test_merge_drops_a_cut_box_when_70_percent_of_it_lies_inside_a_kept_one():
    """The containment threshold of docs/lean_detection.md (IoU here below NMS's: 0.375, 0.325)."""
    for whole_x1, kept in ((110, [1]), (114, [0, 1])):  # 75 %, then 65 % of the cut box inside
        dets = _dets([[100, 20, 140, 60, 0.9, 3, 1, 0], [whole_x1, 20, 180, 60, 0.8, 3, 0, 1]])
        assert sorted(tiling.merge_tile_detections(dets, NMS, 100).tag.tolist()) == kept


def test_merge_cut_views_of_an_object_larger_than_the_overlap_are_not_merged():
    """Seen whole in no tile: each cut part is kept (the documented limit of the overlap)."""
    dets = _dets([[10, 20, 128, 60, 0.9, 3, 1, 0], [96, 20, 200, 60, 0.8, 3, 1, 1]])
    assert tiling.merge_tile_detections(dets, NMS, 100).tag.tolist() == [0, 1]


def test_merge_keeps_neighbours_in_the_overlap_and_removes_their_second_views():
    # two objects of one class 4 px apart inside the overlap, each seen whole by both tiles
    dets = _dets([[100, 20, 110, 40, 0.9, 1, 0, 0], [114, 20, 124, 40, 0.8, 1, 0, 1],
                  [100.5, 20, 110.5, 40, 0.85, 1, 0, 2], [114, 20.5, 124, 40, 0.7, 1, 0, 3]])
    merged = tiling.merge_tile_detections(dets, NMS, 100)
    assert merged.tag.tolist() == [0, 1]
    assert torch.equal(merged.scores, torch.tensor([0.9, 0.8]))


def test_merge_nms_is_class_wise_and_max_per_img_keeps_the_best():
    dets = _dets([[0, 0, 50, 50, 0.5, 1, 0, 0], [0, 0, 50, 50, 0.6, 2, 0, 1],
                  [2, 2, 50, 50, 0.7, 1, 0, 2], [200, 200, 250, 250, 0.4, 1, 0, 3]])
    assert tiling.merge_tile_detections(dets, NMS, 100).tag.tolist() == [2, 1, 3]
    assert tiling.merge_tile_detections(dets, NMS, 2).tag.tolist() == [2, 1]
    empty = tiling.merge_tile_detections(dets[:0], NMS, 100)
    assert len(empty) == 0 and set(empty.keys()) == set(dets.keys())


# ---------------------------------------------------------------------- tiled predict
@pytest.mark.parametrize('batch_hw,img_hw,ori_hw', SIZES)
def test_one_tile_over_the_image_is_stock_predict_bit_for_bit(pair, batch_hw, img_hw, ori_hw):
    stock, lean = pair
    torch.manual_seed(1)
    inputs = torch.randn(1, 3, *batch_hw)
    metas = [_meta(batch_hw, img_hw, ori_hw)]
    expected = _predict(stock, inputs, metas)
    lean.test_cfg.update(mode='tiles', tile_size=max(batch_hw), tile_overlap=32)
    try:
        _assert_same(expected, _predict(lean, inputs, metas))
        _assert_same(_predict(stock, inputs, metas, rescale=False),
                     _predict(lean, inputs, metas, rescale=False))
    finally:
        for key in ('mode', 'tile_size', 'tile_overlap'):
            lean.test_cfg.pop(key)


# Markers in channel 0 of the network-scale input: value -> (label, y1, y2, x1, x2). Image 0 is
# 300 x 410 (original 600 x 820) in a 320 x 416 batch; tiles of 128 with overlap 32 start at
# y 0, 96, 172 and x 0, 96, 192, 282. Marker 1 crosses the edge x = 128 of the first tile column
# (cut there, whole in the second column); markers 2 and 3 are neighbours of one class inside the
# overlap of columns 0 and 1, each seen whole twice; marker 4 is in the last tiles of the row and
# column, which end on the image border. Image 1 (200 x 250, not rescaled) has marker 5.
MARKERS = [{1: (0, 40, 60, 115, 135), 2: (0, 140, 150, 102, 110), 3: (0, 140, 150, 112, 120),
            4: (1, 270, 295, 380, 405)}, {5: (1, 180, 195, 10, 30)}]


def _marker_detector(calls):
    """A stand-in for ``_detect_in_tile``: one detection per marker in the tile's image part,
    its box the marker's pixels (tile coordinates), all-foreground mask logits; a view that
    touches the tile's edge scores higher than the whole view (the merge must not care)."""
    def detect(tile_input, meta):
        vh, vw = meta['img_shape']
        plane = tile_input[0, 0, :vh, :vw]
        calls.append(tuple(tile_input.shape[-2:]))
        rows = []
        for value in plane.unique().tolist():
            if value == 0:
                continue
            ys, xs = (plane == value).nonzero(as_tuple=True)
            box = [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]
            at_edge = box[0] == 0 or box[1] == 0 or box[2] == vw or box[3] == vh
            label = [m for m in MARKERS if value in m][0][int(value)][0]
            rows.append(box + [0.9 - 0.01 * value + 0.09 * at_edge, label])
        t = torch.tensor(rows, dtype=torch.float32).view(-1, 6)
        return InstanceData(bboxes=t[:, :4], scores=t[:, 4], labels=t[:, 5].long(),
                            mask_logits=torch.full((len(t), 28, 28), 8.0))
    return detect


def test_tiled_predict_places_merges_and_pastes_markers_in_image_coordinates(pair, monkeypatch):
    _, lean = pair
    calls = []
    monkeypatch.setattr(lean, '_detect_in_tile', _marker_detector(calls))
    monkeypatch.setitem(lean.test_cfg, 'mode', 'tiles')
    monkeypatch.setitem(lean.test_cfg, 'tile_size', 128)
    monkeypatch.setitem(lean.test_cfg, 'tile_overlap', 32)
    inputs = torch.zeros(2, 3, 320, 416)
    for i, markers in enumerate(MARKERS):
        for value, (_, y1, y2, x1, x2) in markers.items():
            inputs[i, 0, y1:y2, x1:x2] = value
    metas = [_meta((320, 416), (300, 410), (600, 820)), _meta((320, 416), (200, 250), (200, 250))]
    out = _predict(lean, inputs, metas)
    assert len(calls) == 12 + 6 and set(calls) == {(128, 128)}
    for i, (markers, sample) in enumerate(zip(MARKERS, out)):
        pred = sample.pred_instances
        scale = 2 if i == 0 else 1
        expected = [[x1 * scale, y1 * scale, x2 * scale, y2 * scale]
                    for _, y1, y2, x1, x2 in markers.values()]
        assert pred.bboxes.tolist() == expected  # whole boxes only, by descending score
        assert pred.labels.tolist() == [m[0] for m in markers.values()]
        assert torch.allclose(pred.scores, torch.tensor([0.9 - 0.01 * v for v in markers]))
        assert pred.masks.shape == (len(markers), ) + metas[i]['ori_shape']
        assert pred.masks.dtype == torch.bool
        for mask, (x1, y1, x2, y2) in zip(pred.masks, expected):
            ys, xs = mask.nonzero(as_tuple=True)  # pasted over the box, nowhere else
            assert [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] == [x1, y1, x2, y2]
            assert mask.sum() == (x2 - x1) * (y2 - y1)


def test_tiled_predict_through_inference_detector_feeds_coco_metric(pair, tmp_path):
    """mmdet's door on a config with ``mode='tiles'`` (test Resize to another size than the
    image's): results of the original size that ``CocoMetric`` encodes and evaluates (box AP 1
    against themselves as ground truth)."""
    from mmdet.apis import inference_detector, init_detector
    from mmdet.evaluation import CocoMetric
    cfg = Config.fromfile('configs/mask_rcnn_xcit_t12_p16_3x_coco.py')
    cfg.model = _model_cfg()
    cfg.model.type = 'LeanMaskRCNN'
    cfg.model.test_cfg.update(mode='tiles', tile_size=128, tile_overlap=32)
    cfg.test_dataloader.dataset.pipeline = [
        dict(type='LoadImageFromFile'), dict(type='Resize', scale=(320, 240), keep_ratio=True),
        dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape',
                                              'scale_factor'))]
    model = init_detector(cfg, device='cpu')
    model.load_state_dict(pair[1].state_dict())
    tiles = []
    detect = model._detect_in_tile
    model._detect_in_tile = lambda x, meta: tiles.append(meta['img_shape']) or detect(x, meta)
    img = np.random.RandomState(6).randint(0, 255, (150, 200, 3), np.uint8)
    result = inference_detector(model, img)
    assert tuple(result.img_shape) == (240, 320) and len(tiles) == 9  # 3 x 3 tiles of 128
    pred = result.pred_instances
    assert set(pred.keys()) == {'bboxes', 'scores', 'labels', 'masks'}
    assert len(pred) == MAX_DETS and pred.masks.shape == (MAX_DETS, 150, 200)
    assert pred.masks.dtype == torch.bool and pred.masks.any()
    assert (pred.bboxes >= 0).all() and (pred.bboxes[:, 0::2] <= 200).all()
    assert (pred.bboxes[:, 1::2] <= 150).all()
    assert (pred.bboxes[:, 2:] > pred.bboxes[:, :2]).all()
    assert (pred.scores[:-1] >= pred.scores[1:]).all()
    assert ((pred.labels >= 0) & (pred.labels < 10)).all()

    from pycocotools import mask as mask_util
    metric = CocoMetric(metric=['bbox', 'segm'], outfile_prefix=str(tmp_path / 'coco'))
    metric.dataset_meta = dict(classes=tuple(str(c) for c in range(10)))
    sample = result.to_dict()
    sample['img_id'] = 0
    masks = pred.masks.numpy()
    sample['instances'] = [
        dict(bbox=b.tolist(), bbox_label=int(lab), ignore_flag=0,
             mask=mask_util.encode(np.asfortranarray(m.astype(np.uint8))))
        for b, lab, m in zip(pred.bboxes, pred.labels, masks)]
    metric.process({}, [sample])
    encoded = metric.results[0][1]['masks']  # the RLE CocoMetric made of our masks
    assert np.array_equal(mask_util.decode(encoded).transpose(2, 0, 1), masks)
    scores = metric.compute_metrics(metric.results)
    # boxes match themselves; a random head leaves some masks empty, which match nothing
    assert scores['bbox_mAP'] == pytest.approx(1.0) and scores['segm_mAP'] > 0.5


# ---------------------------------------------------------------------- auto
def test_auto_runs_whole_when_the_estimate_fits_else_tiles_and_logs_it(
        pair, logged, monkeypatch):
    stock, lean = pair
    inputs = torch.randn(1, 3, 256, 256, generator=torch.Generator().manual_seed(7))
    metas = [_meta((256, 256), (256, 256), (256, 256))]
    monkeypatch.setattr(lean, '_calibrate_memory', lambda *a: pytest.fail('calibrated'))
    for key, value in dict(mode='tiles', tile_size=128, tile_overlap=32).items():
        monkeypatch.setitem(lean.test_cfg, key, value)
    tiled = _predict(lean, inputs, metas)
    monkeypatch.setitem(lean.test_cfg, 'mode', 'auto')
    monkeypatch.setitem(lean.test_cfg, 'memory_model', dict(base_mb=10, mb_per_mpix=1000))
    monkeypatch.setattr(lean, 'calibrated_memory_model', None)
    monkeypatch.setattr(lean, 'last_memory_plan', None)
    # the estimates by hand: the line at the whole input, or at one of the 3 x 3 tiles of 128
    # plus what 50 detections of each tile hold (box, score, label, flag, 28 x 28 logits);
    # the masks' part (base + 50 x 256 x 256 bytes + pasting) is smaller than either
    whole_mb = 10 + 1000 * 256 * 256 / 1e6
    tile_mb = 10 + 1000 * 128 * 128 / 1e6 + 9 * MAX_DETS * (16 + 4 + 8 + 1 + 4 * 28**2) / 2**20
    masks_mb = 10 + (MAX_DETS * 256 * 256 + 13 * 256 * 256 + 2 * MAX_DETS * 10 * 28**2 * 4) / 2**20
    assert masks_mb < tile_mb < whole_mb
    monkeypatch.setitem(lean.test_cfg, 'max_memory', math.ceil(whole_mb))
    _assert_same(_predict(stock, inputs, metas), _predict(lean, inputs, metas))
    assert lean.last_memory_plan.name == 'whole'
    assert lean.last_memory_plan.estimate_mb == pytest.approx(whole_mb)
    assert f'whole within max_memory={math.ceil(whole_mb)} MB' in logged[-1]
    assert f'tiles 3x3 tiles of 128x128 px, overlap 32 px: {tile_mb:.0f} MB' in logged[-1]
    assert lean.calibrated_memory_model is None  # the given line, no calibration
    monkeypatch.setitem(lean.test_cfg, 'max_memory', math.floor(whole_mb))
    _assert_same(tiled, _predict(lean, inputs, metas))
    assert lean.last_memory_plan.name == 'tiles'
    assert lean.last_memory_plan.estimate_mb == pytest.approx(tile_mb)
    assert 'tiles within max_memory=' in logged[-1]
    num_lines = len(logged)  # the same plans and budget again (a test set of one size): no log
    _assert_same(tiled, _predict(lean, inputs, metas))
    assert len(logged) == num_lines and lean.last_memory_plan.name == 'tiles'
    monkeypatch.setitem(lean.test_cfg, 'max_memory', math.floor(tile_mb))
    with pytest.raises(MemoryBudgetError, match=f'to at least {tile_mb:.0f} or'):
        _predict(lean, inputs, metas)


def test_a_flat_line_leaves_the_masks_estimate_at_the_size_they_are_pasted_at(pair, monkeypatch):
    """The masks' part by hand: the base, 50 boolean masks of the pasted size, one mask's
    13 bytes a pixel of pasting, the logits (50 x 10 classes x 28 x 28 floats) twice; pasted at
    the original size with ``rescale``, else at network scale."""
    _, lean = pair
    for key, value in dict(mode='auto', max_memory=10**6, tile_size=128, tile_overlap=32,
                           memory_model=dict(base_mb=10, mb_per_mpix=0)).items():
        monkeypatch.setitem(lean.test_cfg, key, value)
    inputs = torch.zeros(1, 3, 256, 256)
    samples = [DetDataSample(metainfo=_meta((256, 256), (256, 256), (512, 384)))]
    held_mb = 9 * MAX_DETS * (16 + 4 + 8 + 1 + 4 * 28**2) / 2**20
    for rescale, (h, w) in ((True, (512, 384)), (False, (256, 256))):
        masks_mb = 10 + (MAX_DETS * h * w + 13 * h * w + 2 * MAX_DETS * 10 * 28**2 * 4) / 2**20
        whole, *_, tiles = lean.memory_plans(inputs, samples, rescale)
        assert whole.estimate_mb == pytest.approx(masks_mb)
        assert tiles.estimate_mb == pytest.approx(masks_mb + held_mb)


def test_calibration_runs_once_per_model_on_the_first_auto_predict(pair, monkeypatch, logged):
    _, lean = pair
    calls = []
    calibrate = lean._calibrate_memory
    monkeypatch.setattr(tiling, 'CALIBRATION_SIDES', (64, 96, 128))  # a quick one
    monkeypatch.setattr(lean, '_calibrate_memory', lambda x: calls.append(1) or calibrate(x))
    monkeypatch.setattr(lean, 'calibrated_memory_model', None)
    monkeypatch.setattr(lean, 'last_memory_plan', None)
    monkeypatch.setitem(lean.test_cfg, 'mode', 'auto')
    monkeypatch.setitem(lean.test_cfg, 'max_memory', 10**6)
    inputs = torch.randn(1, 3, 64, 96)
    for _ in range(2):
        _predict(lean, inputs, [_meta((64, 96), (64, 96), (64, 96))])
    assert calls == [1] and lean.last_memory_plan.name == 'whole'
    model = lean.calibrated_memory_model
    assert isinstance(model, MemoryModel) and model.base_mb > 0 and model.mb_per_mpix >= 0
    calibrated = [line for line in logged if 'memory calibrated' in line]
    assert len(calibrated) == 1 and '64^2 px' in calibrated[0] and 'RoI branch' in calibrated[0]
    assert f'memory_model=dict(base_mb={math.ceil(model.base_mb)}, ' in calibrated[0]


def test_calibrated_line_has_the_first_stage_slope_and_the_roi_stage_in_its_base(
        pair, monkeypatch, logged):
    """Stand-in stages of known memory: features + proposals hold 40 bytes per input pixel (plus
    the 12 of the random input), the RoI branch 48 MB at any size. The line must have the first
    stage's slope and the RoI stage in its base, so that it bounds both."""
    _, lean = pair
    held = []

    def first_stage(inputs, meta):
        held.append(torch.ones(inputs.shape[-2] * inputs.shape[-1] * 10))  # 40 B / px
        held.pop()
        return [torch.zeros(1)], None

    def roi_stage(maps, meta):
        return torch.ones(48 * 2**20 // 4).sum()

    monkeypatch.setattr(lean, '_features_and_proposals', first_stage)
    monkeypatch.setattr(lean, '_worst_case_roi_stage', roi_stage)
    monkeypatch.setattr(tiling, 'CALIBRATION_SIDES', (512, 1024, 1536))
    model = lean._calibrate_memory(torch.zeros(1, 3, 8, 8))
    slope = (40 + 12) * 1e6 / 2**20
    assert slope * 0.9 < model.mb_per_mpix < slope * 1.15
    assert 48 * 0.95 < model.base_mb < 48 + 16
    assert 'RoI branch: 48 MB more' in logged[-1]


# ---------------------------------------------------------------------- peaks, measured
CHILD = r"""
import copy, json, logging, math, sys, torch
sys.path.insert(0, 'tests')
from mmengine.logging import MMLogger
from test_lean_detection import _meta, _model_cfg, _samples
from mmdet.registry import MODELS
from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
MMLogger.get_current_instance().setLevel(logging.WARNING)
torch.set_num_threads(1)
base_cfg = _model_cfg()
# auto at the tightest budget of each plan (its own estimate), the line calibrated first
size, ori = 1536, 768  # network scale, original: masks small next to the network's maps
cfg = copy.deepcopy(base_cfg)
cfg.test_cfg.rcnn.max_per_img = 5
cfg.test_cfg.update(mode='auto', max_memory=10**6, tile_size=640, tile_overlap=64)
torch.manual_seed(0)
model = MODELS.build(dict(cfg, type='LeanMaskRCNN')).eval()
with torch.no_grad():  # calibrates the line
    model.predict(torch.randn(1, 3, 64, 64), _samples([_meta((64, 64), (64, 64), (64, 64))]))
inputs = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(1))
metas = [_meta((size, size), (size, size), (ori, ori))]
rows = []
for plan in model.memory_plans(inputs, _samples(metas)):
    model.test_cfg.max_memory = math.ceil(plan.estimate_mb)
    with torch.no_grad():
        peak = measure_peak_growth_mb(lambda: model.predict(inputs, _samples(metas)))
    chosen = model.last_memory_plan
    rows.append(dict(budget=model.test_cfg.max_memory, plan=chosen.name, detail=chosen.detail,
                     estimate_mb=chosen.estimate_mb, peak_mb=peak, target=plan.name))
line = list(model.calibrated_memory_model)
del model, inputs
print(json.dumps(dict(line=line, rows=rows)))
"""


def test_measured_peaks_stay_within_the_budgets():
    """One fresh process (malloc returning freed memory at once, so the resident set follows the
    live tensors): auto at the tightest budget of each plan on a 1536 x 1536 input, the peak
    growth of ``predict`` measured (the estimate's error is printed). The whole path's bands of
    rows, once measured here too, went into the stream, whose two plans are among those measured.
    """
    report = run_fresh(CHILD)
    rows = report['rows']
    print('line (base MB, MB per megapixel):', report['line'])
    for row in rows:
        row['error_pct'] = round(100 * (row['peak_mb'] - row['estimate_mb']) / row['estimate_mb'])
        print(json.dumps(row))
    # each plan's estimate as the budget: that plan runs, or an earlier one that fits it too
    assert [row['target'] for row in rows] == ['whole', 'stream', 'stream-disk', 'tiles']
    order = [row['target'] for row in rows]
    for row in rows:
        assert order.index(row['plan']) <= order.index(row['target']), row
        assert row['estimate_mb'] <= row['budget'], row
    assert rows[0]['detail'] == '1536x1536'
    assert rows[-1]['plan'] == 'tiles'
    assert rows[-1]['detail'] == '3x3 tiles of 640x640 px, overlap 64 px'
    assert rows[-1]['budget'] < rows[0]['estimate_mb']  # the whole image did not fit
    for row in rows:
        assert row['peak_mb'] <= row['budget'], row
    assert rows[-1]['peak_mb'] < rows[0]['peak_mb'] / 2, rows
