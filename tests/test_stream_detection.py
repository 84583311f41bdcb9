"""LeanMaskRCNN's ``mode='stream'``: Mask R-CNN's heads core by core on the scene's own features.

Expected values come from the whole-image path, which is stock ``MaskRCNN.predict`` bit for bit
(tests/test_lean_detection.py): its feature maps, and its detections on one core covering the
image. The small random model of test_lean_detection keeps this file fast.
"""
import os

import numpy as np
import pytest
import torch
from mmengine.structures import InstanceData
from test_lean_detection import _meta, _pair, _predict, _samples

from mmdet.structures.bbox import bbox2roi, bbox_overlaps
from xcit_mm.models.detectors.box_masks import paste_in_box
from xcit_mm.models.inference import det_stream
from xcit_mm.models.inference.det_stream import FeatureWindow
from xcit_mm.models.inference.fpn_data_flow import fpn_rows
from xcit_mm.models.inference.row_stream import TensorRows, TokenMaps

HW = (200, 328)  # neither side a multiple of the cores (64 px steps)
# Streamed features against the whole forward's: the band's sums and convolutions add up in
# another order (measured 4.1e-6 on these maps).
FEATURE_TOL = 2e-5


@pytest.fixture(scope='module')
def lean():
    model = _pair()[1]
    with torch.no_grad():  # clearer winners than the random heads give, fewer near ties
        model.rpn_head.rpn_cls.weight.mul_(20)
        model.roi_head.bbox_head.fc_cls.weight.mul_(20)
    model.test_cfg.rcnn.score_thr = 0.3
    return model


def _image(seed=0):
    return torch.randn(1, 3, *HW, generator=torch.Generator().manual_seed(seed))


def _stream(model, **test_cfg):
    model.test_cfg.update(dict(mode='stream', **test_cfg))
    return model


def _whole(model):
    for key in ('mode', 'tile_size', 'feature_margin', 'token_maps', 'band_mb'):
        model.test_cfg.pop(key, None)
    return model


def _windows_of(model, image, cores, margin, tallest=False):
    """The window of each row of cores, and the whole forward's levels; with ``tallest``, each
    as tall as the tallest (as the stream moves them: one buffer, the shared rows moved in
    place), else as tall as its cores and margins (the first shorter: a new buffer once)."""
    with torch.no_grad():
        whole = model._lean_extract_feat(image)
        with TokenMaps(torch.device('cpu')) as maps:
            trunk = model.backbone.stream_trunk(lambda a, b: image[:, :, a:b], HW, maps, 1)
            levels = [model.backbone.level_rows(t, i, HW) for i, t in enumerate(trunk)]
            window = FeatureWindow(fpn_rows(levels, model.neck, 1), model._stream_strides(),
                                   band_mb=0.01)  # bands of one cell row of P6: many bands
            edges = det_stream.core_edges(HW[0], cores)
            rows_tall = max(b - a for a, b in edges) + 2 * margin if tallest else 0
            for rows in edges:
                window.move(*det_stream.window_rows(rows, margin, HW[0], rows_tall))
                yield window, whole


@pytest.mark.parametrize('cores, margin, tallest', [
    (64, 64, False), (64, 64, True), (128, 0, False), (1024, 64, False)])
def test_each_window_holds_the_whole_images_features_cropped(lean, cores, margin, tallest):
    moves = 0
    for window, whole in _windows_of(lean, _image(), cores, margin, tallest):
        moves += 1
        for level, (held, full) in enumerate(zip(window.held, whole)):
            stride = lean._stream_strides()[level]
            first, stop = det_stream.cells(window.top, window.bottom, stride, full.shape[2])
            assert window.first[level] == first and held.shape == full[:, :, first:stop].shape
            assert (held - full[:, :, first:stop]).abs().max() < FEATURE_TOL
    assert moves == len(det_stream.core_edges(HW[0], cores))


def test_a_window_of_a_scene_whose_rows_exceed_the_band_is_made_a_row_at_a_time(lean):
    """Where one row of the finest level's maps is more than ``band_mb`` (a very wide scene),
    the window's bands are one row of it, the first band too: never a coarse level's cell of
    rows at once, which would hold that many rows of every map."""
    image = _image()
    with torch.no_grad(), TokenMaps(torch.device('cpu')) as maps:
        trunk = lean.backbone.stream_trunk(lambda a, b: image[:, :, a:b], HW, maps, 1)
        levels = [lean.backbone.level_rows(t, i, HW) for i, t in enumerate(trunk)]
        outs = fpn_rows(levels, lean.neck, 1)
        calls, make = [], outs[0].rows
        outs[0].rows = lambda a, b: calls.append(b - a) or make(a, b)
        FeatureWindow(outs, lean._stream_strides(), band_mb=1e-6).move(0, HW[0])
    assert len(calls) == -(-HW[0] // 4) and set(calls) == {1}


def test_one_core_on_the_whole_images_features_is_the_whole_path_bit_for_bit(lean):
    """The core's anchors, the RoIs shifted into the window and the boxes decoded on the scene
    are the whole path's: on its features, the very same detections and mask logits."""
    image, meta = _image(), _meta(HW, HW, HW)
    _stream(lean, tile_size=1024, feature_margin=64)
    with torch.no_grad():
        feats = lean._lean_extract_feat(image)
        proposals = lean._lean_rpn_predict(list(feats), _samples([meta]))
        expected = lean._lean_roi_predict(list(feats), proposals, [meta])[0]
        window = FeatureWindow([TensorRows(f) for f in feats], lean._stream_strides(), 64)
        window.move(0, HW[0])
        got = lean._core_detections(window, ((0, HW[0]), (0, HW[1])), meta)
    _whole(lean)
    assert len(expected) > 3
    for key in ('bboxes', 'scores', 'labels', 'mask_logits'):
        assert torch.equal(got[key], expected[key]), key


def _whole_window(model, feats):
    window = FeatureWindow([TensorRows(f) for f in feats], model._stream_strides(), 64)
    window.move(0, HW[0])
    return window


def _core_proposals_from_stock(model, feats, core, meta):
    """Stock's RPN on the whole maps (``RPNHead.forward``, ``grid_priors``), its scores, deltas
    and anchors cut to the cells whose anchor centres lie in ``core``, then its decoding + NMS."""
    rpn = model.rpn_head
    cls_scores, bbox_preds = rpn(tuple(feats))
    sizes = [c.shape[-2:] for c in cls_scores]
    priors = rpn.prior_generator.grid_priors(sizes, device=feats[0].device)
    (y0, y1), (x0, x1) = core
    cut_cls, cut_reg, cut_priors = [], [], []
    for cls, reg, anchors, (h, w) in zip(cls_scores, bbox_preds, priors, sizes):
        centres = anchors.view(h, w, -1, 4)[:, :, 0]
        cx, cy = (centres[..., 0] + centres[..., 2]) / 2, (centres[..., 1] + centres[..., 3]) / 2
        rows = ((cy[:, 0] >= y0) & (cy[:, 0] < y1)).nonzero()[:, 0]
        cols = ((cx[0] >= x0) & (cx[0] < x1)).nonzero()[:, 0]
        r, c = slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1)
        cut_cls.append(cls[0][:, r, c])
        cut_reg.append(reg[0][:, r, c])
        cut_priors.append(anchors.view(h, w, -1, 4)[r, c].reshape(-1, 4))
    return rpn._predict_by_feat_single(cut_cls, cut_reg, [None] * len(sizes), cut_priors, meta,
                                       rpn.test_cfg)


# A band so small that a core's RPN runs row by row and its RoI heads box by box
PIECES_OF_ONE = 1e-4
CORES = [((0, 64), (0, 64)), ((64, 128), (192, 256)), ((192, 200), (256, 328)),
         ((128, 192), (64, 128))]


@pytest.mark.parametrize('core', CORES)
def test_a_cores_proposals_are_stocks_from_the_anchors_in_the_core(lean, core):
    """The RPN over a core in pieces of one row (a tiny band), against stock's on the whole
    maps."""
    image, meta = _image(), _meta(HW, HW, HW)
    _stream(lean, tile_size=64, feature_margin=64, band_mb=PIECES_OF_ONE)
    with torch.no_grad():
        feats = lean._lean_extract_feat(image)
        expected = _core_proposals_from_stock(lean, feats, core, meta)
        got = lean._core_proposals(_whole_window(lean, feats), core, meta)
    _whole(lean)
    assert len(got) > 10
    assert torch.allclose(got.bboxes, expected.bboxes, atol=1e-5)
    assert torch.allclose(got.scores, expected.scores, atol=1e-6)


@pytest.mark.parametrize('core', CORES)
def test_a_cores_rois_read_the_scenes_features_through_its_window(lean, core):
    """The RoI heads of a core, on RoIs shifted into its window, against stock's
    ``predict_bbox`` and mask forward on the whole maps with the same proposals: the window
    reaches the farthest box (a margin of 192 px here). The heads take one box at a time (a
    tiny band)."""
    image, meta = _image(), _meta(HW, HW, HW)
    _stream(lean, tile_size=64, feature_margin=192, band_mb=PIECES_OF_ONE)
    head = lean.roi_head
    with torch.no_grad():
        feats = lean._lean_extract_feat(image)
        window = _whole_window(lean, feats)
        proposals = lean._core_proposals(window, core, meta)
        expected = head.predict_bbox(tuple(feats), [meta], [proposals], head.test_cfg)[0]
        masks = head._mask_forward(tuple(feats), bbox2roi([expected.bboxes]))['mask_preds']
        got = lean._core_roi(window, core, proposals, meta)
    _whole(lean)
    assert len(got) == len(expected) >= 2
    assert torch.equal(got.labels, expected.labels)
    assert torch.allclose(got.bboxes, expected.bboxes, atol=1e-4)
    assert torch.allclose(got.mask_logits, masks[torch.arange(len(got)), got.labels], atol=1e-4)


@pytest.mark.parametrize('core', [c for c in CORES if c[0][0] >= 128])
def test_a_moved_windows_rois_read_the_scenes_features_over_the_whole_width(lean, core):
    """A window moved down the scene (its top 64 or 128 px below the scene's), and RoIs inside
    its rows reaching sideways far past the core and the margin, some across the whole scene:
    the RoI heads of the core, shifted by the window's top, against stock on the whole maps."""
    image, meta = _image(), _meta(HW, HW, HW)
    _stream(lean, tile_size=64, feature_margin=64)
    head = lean.roi_head
    head.test_cfg.score_thr = 0.0  # every class of every RoI
    (y0, y1), (x0, x1) = core
    with torch.no_grad():
        feats = lean._lean_extract_feat(image)
        window = FeatureWindow([TensorRows(f) for f in feats], lean._stream_strides(), 64)
        window.move(*det_stream.window_rows(core[0], 64, HW[0]))
        assert window.top > 0
        # inside the rows held, a cell of the coarsest RoI level below the window's top edge
        top = window.top + 32
        boxes = torch.tensor([[0., top, HW[1], top + 40], [max(0, x0 - 150), y0, x1 + 150, y1],
                              [x0, top + 10, HW[1] - 5, HW[0] - 2]])
        proposals = InstanceData(bboxes=boxes, scores=torch.ones(3))
        expected = head.predict_bbox(tuple(feats), [meta], [proposals], head.test_cfg)[0]
        masks = head._mask_forward(tuple(feats), bbox2roi([expected.bboxes]))['mask_preds']
        got = lean._core_roi(window, core, proposals, meta)
    _whole(lean)
    head.test_cfg.score_thr = 0.3
    assert len(got) == len(expected) >= 3
    assert torch.equal(got.labels, expected.labels)
    assert torch.allclose(got.bboxes, expected.bboxes, atol=1e-4)
    assert torch.allclose(got.mask_logits, masks[torch.arange(len(got)), got.labels], atol=1e-4)


def test_one_core_covering_the_image_detects_as_the_whole_image(lean):
    """Through predict: the issue's criterion, the differences being the features' rounding."""
    image, metas = _image(), [_meta(HW, HW, HW)]
    whole = _predict(_whole(lean), image, metas)[0].pred_instances
    stream = _predict(_stream(lean, tile_size=1024), image, metas)[0].pred_instances
    _whole(lean)
    assert len(whole) == len(stream) > 3
    assert torch.equal(whole.labels, stream.labels)
    assert (whole.bboxes - stream.bboxes).abs().max() <= 0.01
    assert (whole.scores - stream.scores).abs().max() <= 1e-4
    inter = (whole.masks & stream.masks).flatten(1).sum(1)
    union = (whole.masks | stream.masks).flatten(1).sum(1).clamp(min=1)
    assert (inter / union).min() >= 0.99


def test_cores_each_read_the_scenes_features_and_merge_by_the_whole_images_nms(lean):
    """Cores of 64 px and no margin beyond the RPN's cell: every core's detections, computed
    here on the whole forward's features, through the NMS across cores, are the stream's."""
    image, meta = _image(1), _meta(HW, HW, HW)
    _stream(lean, tile_size=64, feature_margin=64)
    with torch.no_grad():
        got = lean.stream_detections(image, meta)
        feats = lean._lean_extract_feat(image)
        window = FeatureWindow([TensorRows(f) for f in feats], lean._stream_strides(), 64)
        merge = det_stream.CoreRowMerge(lean.roi_head.test_cfg.nms, 64)
        rows_of_cores = det_stream.core_edges(HW[0], 64)
        expected = []
        for i, rows in enumerate(rows_of_cores):
            window.move(*det_stream.window_rows(rows, 64, HW[0]))
            row = [lean._core_detections(window, (rows, cols), meta)
                   for cols in det_stream.core_edges(HW[1], 64)]
            next_top = rows_of_cores[i + 1][0] if i + 1 < len(rows_of_cores) else None
            expected.append(merge.add_row(InstanceData.cat(row), next_top))
    _whole(lean)
    expected = InstanceData.cat(expected)
    expected = expected[expected.scores.argsort(descending=True, stable=True)]
    assert len(got) == len(expected) > 10
    assert torch.equal(got.labels, expected.labels)
    assert (got.bboxes - expected.bboxes).abs().max() < 1e-3
    iou = bbox_overlaps(got.bboxes, got.bboxes)
    same = (got.labels[:, None] == got.labels[None]) & ~torch.eye(len(got), dtype=torch.bool)
    assert not (iou[same] > lean.roi_head.test_cfg.nms.iou_threshold).any()


def _planted(box, scores):
    """A core's detections: one object's box (whole, crossing the cores) with ``scores``."""
    n = len(scores)
    return InstanceData(bboxes=torch.tensor([box] * n), scores=torch.tensor(scores),
                        labels=torch.zeros(n, dtype=torch.long),
                        mask_logits=torch.zeros(n, 28, 28))


def test_an_object_straddling_four_cores_is_reported_once_whole(lean, monkeypatch):
    """Four cores meet at (128, 64); each one's anchors find the object that covers the meeting
    point, whole (its RoIs read the scene's features): the merge keeps the best one, once, with
    its whole box."""
    box = [70., 20., 190., 110.]
    scores = {(0, 64): 0.6, (0, 128): 0.9, (64, 64): 0.7, (64, 128): 0.8}

    def core_detections(window, core, meta):
        (y0, _), (x0, _) = core
        score = scores.get((y0, x0))
        return _planted(box, [score] if score else [])

    monkeypatch.setattr(lean, '_core_detections', core_detections)
    _stream(lean, tile_size=64, feature_margin=64)
    got = lean.stream_detections(_image(), _meta(HW, HW, HW))
    _whole(lean)
    assert len(got) == 1 and got.bboxes.tolist() == [box] and got.scores.tolist() == [
        pytest.approx(0.9)]


def test_stream_instances_reads_rows_as_the_pipeline_and_pastes_only_the_box(lean):
    """``stream_instances`` on uint8 BGR rows gives predict's detections on the preprocessed
    image, and each mask pasted in its box equals stock's pasted mask there, empty elsewhere."""
    rng = np.random.RandomState(0)
    img = rng.randint(0, 256, HW + (3, ), np.uint8)
    _stream(lean, tile_size=128)
    pre = lean.data_preprocessor
    image = (torch.from_numpy(img).permute(2, 0, 1)[None, [2, 1, 0]].float() - pre.mean) / pre.std
    meta = _meta(HW, HW, HW)
    expected = _predict(lean, image, [meta])[0].pred_instances
    got = InstanceData.cat(list(lean.stream_instances(lambda a, b: img[a:b], HW)))
    _whole(lean)
    got = got[got.scores.argsort(descending=True, stable=True)]
    assert len(got) == len(expected) > 3
    assert torch.equal(got.labels, expected.labels)
    assert torch.allclose(got.bboxes, expected.bboxes, atol=1e-3)
    for (mask, x0, y0), full in zip(paste_in_box(got.mask_logits, got.bboxes, HW),
                                    expected.masks):
        h, w = mask.shape
        assert torch.equal(mask, full[y0:y0 + h, x0:x0 + w])
        assert full.sum() == mask.sum()  # nothing outside the box


@pytest.mark.parametrize('change, reason', [
    (lambda m: setattr(m.neck, 'add_extra_convs', 'on_input'), 'adds levels by max pooling'),
    (lambda m: setattr(m.backbone.fpn1, '1', torch.nn.GroupNorm(4, 32)),
     'backbone.fpn1.1 is a GroupNorm'),
])
def test_stream_is_refused_before_any_work_with_the_part_named(change, reason):
    model = _pair()[1]
    change(model)
    with pytest.raises(ValueError, match=f"mode='stream' needs .*{reason}.*use mode='tiles'"):
        _predict(_stream(model, tile_size=128), _image(), [_meta(HW, HW, HW)])


def test_token_maps_on_disk_give_the_same_detections_and_leave_no_file(lean, tmp_path):
    image, meta = _image(), _meta(HW, HW, HW)
    _stream(lean, tile_size=128)
    with torch.no_grad():
        in_memory = lean.stream_detections(image, meta)
    _stream(lean, tile_size=128, token_maps='disk', token_dir=str(tmp_path))
    folder = lean._token_folder(HW, 'stream')
    with torch.no_grad():
        on_disk = lean.stream_detections(image, meta, folder)
    lean.test_cfg.pop('token_dir')
    _whole(lean)
    assert folder == str(tmp_path) and os.listdir(tmp_path) == []
    assert len(in_memory) > 3
    for key in ('bboxes', 'scores', 'labels', 'mask_logits'):
        assert torch.equal(in_memory[key], on_disk[key]), key


def _column_windows_of(model, image, cores, margin, per_window, folder=None):
    """Each window over a band of core columns, for each row of cores, as the stream makes
    them (token maps in ``folder`` if given), with the band's core columns."""
    with torch.no_grad(), TokenMaps(torch.device('cpu'), folder) as maps:
        trunk = model.backbone.stream_trunk(lambda a, b: image[:, :, a:b], HW, maps, 1)
        core_cols = det_stream.core_edges(HW[1], cores)
        bands = det_stream.column_windows(core_cols, per_window, margin, HW[1])
        assert len(bands) == -(-len(core_cols) // per_window) > 1
        for rows in det_stream.core_edges(HW[0], cores):
            for band in bands:
                window = model._window(trunk, HW, band)
                window.move(*det_stream.window_rows(rows, margin, HW[0]))
                yield window, [core_cols[j] for j in band.cores]


@pytest.mark.parametrize('cores, margin, per_window, on_disk', [
    (64, 64, 1, False), (64, 128, 2, False), (128, 64, 1, True)])
def test_windows_over_bands_of_columns_hold_the_whole_images_features(lean, tmp_path, cores,
                                                                      margin, per_window,
                                                                      on_disk):
    """Each band's window, made from its columns of the token maps alone, holds the whole
    forward's features over its cores and ``margin`` each side, at every level."""
    image = _image()
    with torch.no_grad():
        whole = lean._lean_extract_feat(image)
    _stream(lean, tile_size=cores, feature_margin=margin)
    windows = 0
    for window, core_cols in _column_windows_of(lean, image, cores, margin, per_window,
                                                str(tmp_path) if on_disk else None):
        windows += 1
        x0, x1 = max(0, core_cols[0][0] - margin), min(HW[1], core_cols[-1][1] + margin)
        assert window.left <= x0 and window.left % det_stream.ALIGN == 0
        for level, full in enumerate(whole):
            stride = lean._stream_strides()[level]
            rows = det_stream.cells(window.top, window.bottom, stride, full.shape[2])
            cols = det_stream.cells(x0, x1, stride, full.shape[3])
            held = window.crop(level, rows, cols)
            assert window.cells_hw(level)[0] == full.shape[2]
            assert held.shape == full[:, :, rows[0]:rows[1], cols[0]:cols[1]].shape
            assert (held - full[:, :, rows[0]:rows[1], cols[0]:cols[1]]).abs().max() < FEATURE_TOL
    _whole(lean)
    assert windows > 2


def test_a_budget_below_whole_width_windows_picks_the_widest_bands_that_fit(
        lean, tmp_path, monkeypatch):
    """With a budget that the whole-width windows exceed, ``stream_instances`` runs windows of
    the most core columns whose plan fits (measured against plans asked for by window_width),
    maps on disk, and finds what whole-width windows find: the same boxes and mask logits."""
    hw = (128, 640)  # a wide strip: 10 core columns
    img = np.random.RandomState(1).randint(0, 256, hw + (3, ), np.uint8)
    disk = {}
    for cores in (None, 1, 2, 3):
        _stream(lean, tile_size=64, feature_margin=64, window_width=cores and 64 * cores)
        disk[cores] = lean._stream_plans(hw)[1].estimate_mb
    assert disk[1] < disk[2] < disk[3] < disk[None]
    _stream(lean, tile_size=64, feature_margin=64, window_width=None, token_dir=str(tmp_path))
    whole_width = InstanceData.cat(list(lean.stream_instances(lambda a, b: img[a:b], hw)))
    made, make = [], lean._window
    monkeypatch.setattr(lean, '_window', lambda *args: made.append(args[-1]) or make(*args))
    banded = InstanceData.cat(list(lean.stream_instances(lambda a, b: img[a:b], hw,
                                                         max_memory=disk[2] + 0.01)))
    plan = lean.last_memory_plan
    lean.test_cfg.pop('token_dir')
    _whole(lean)
    assert (plan.name, plan.window_cores) == ('stream-disk', 2) and '5 bands' in plan.detail
    # two rows of cores, each with 5 bands of 2 cores (128 px) and 128 px each side at most
    assert len(made) == 10 and max(band.right - band.left for band in made) == 384
    assert len(banded) == len(whole_width) > 10
    assert torch.equal(banded.labels, whole_width.labels)
    assert (banded.bboxes - whole_width.bboxes).abs().max() < 1e-3
    assert (banded.mask_logits - whole_width.mask_logits).abs().max() < 1e-3
