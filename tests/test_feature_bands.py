"""The stride-4 level made in bands of rows (``LeanMaskRCNN`` ``test_cfg.band_mb``).

Expected values come from the whole-tensor paths: ``XCiTBackbone.forward_level`` for a band's
rows, mmdet's ``FPN`` on ``XCiTBackbone``'s levels for the banded FPN, and mmdet's stock
``MaskRCNN.predict`` on the same weights for the detections. A band's convolutions have other
sizes than the whole map's, so values agree up to float rounding, not bit for bit. The memory the
bands save is measured in ``test_detection_memory_budget.py`` (one fresh process for two peaks).
"""
import os.path as osp
import sys

import pytest
import torch
from mmcv.cnn import ConvModule
from mmengine.registry import init_default_scope
from torch import nn

import xcit_mm  # noqa: F401  (registers XCiTBackbone and LeanMaskRCNN)
from mmdet.registry import MODELS
from xcit_mm.models.inference import row_stream
from xcit_mm.models.inference.fpn_data_flow import fpn_in_data_flow_order
from xcit_mm.models.inference.row_stream import FIRST_BAND_ROWS, TensorRows, conv_halo

sys.path.insert(0, osp.dirname(osp.abspath(__file__)))
from test_lean_detection import _meta, _pair, _predict  # noqa: E402


def _backbone(patch_size: int):
    init_default_scope('mmdet')
    torch.manual_seed(patch_size)
    backbone = MODELS.build(dict(type='XCiTBackbone', patch_size=patch_size,
                                 arch=dict(embed_dims=32, depth=2, num_heads=4),
                                 out_indices=(0, 0, 1, 1), init_cfg=None))
    with torch.no_grad():  # BN statistics that are not the identity
        for m in backbone.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    return backbone.eval()


@pytest.fixture
def count_bands(monkeypatch):
    """The row ranges asked of the backbone's bottom level (its crop to the level's size), as
    they are asked."""
    calls = []
    rows = row_stream.Crop.rows

    def counted(self, start, stop):
        calls.append((start, stop))
        return rows(self, start, stop)

    monkeypatch.setattr(row_stream.Crop, 'rows', counted)
    return calls


@pytest.mark.parametrize('patch_size', [16, 8])
def test_a_levels_rows_equal_those_of_the_whole_level(patch_size):
    """Every level (upsampled, identity, pooled), bands starting and ending anywhere, including
    the cropped last row of an image whose sides are not multiples of the patch size."""
    backbone = _backbone(patch_size)
    image_hw = (99, 145)
    with torch.no_grad():
        trunk = backbone.forward_trunk(torch.randn(1, 3, *image_hw))
        for level, feat in enumerate(trunk):
            whole = backbone.forward_level(feat, level, image_hw)
            height = whole.shape[2]
            for start, stop in [(0, 1), (1, min(6, height)), (height // 2, height),
                                (height - 1, height), (0, height)]:
                band = backbone.level_rows(TensorRows(feat), level, image_hw).rows(start, stop)
                assert band.shape == whole[:, :, start:stop].shape, (level, start, stop)
                torch.testing.assert_close(band, whole[:, :, start:stop], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('patch_size', [16, 8])
def test_fpn_with_a_banded_bottom_level_equals_mmdets_fpn(patch_size, count_bands):
    """Bands of a few rows (a band edge inside the nearest top-down upsampling and the FPN
    conv's context): level 0 equals mmdet's FPN up to rounding, levels 1-3 bit for bit."""
    backbone = _backbone(patch_size)
    neck = MODELS.build(dict(type='FPN', in_channels=[32] * 4, out_channels=24,
                             num_outs=4)).eval()
    inputs = torch.randn(1, 3, 99, 145, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = neck(backbone(inputs))
        got = fpn_in_data_flow_order(backbone, neck, inputs, band_mb=0.1)
    # 25 rows: a first band and one row of context below (the FPN conv's), then bands of several
    # rows (0.1 MB over the rows of every map), each making only the rows the one before had not
    # (the context is kept); rows in the wrong order within a band would show in the values
    assert count_bands[0] == (0, FIRST_BAND_ROWS + 1) and count_bands[-1][1] == 25
    assert len(count_bands) >= 3 and all(b - a >= 3 for a, b in count_bands[1:-1]), count_bands
    assert all(a[1] == b[0] for a, b in zip(count_bands, count_bands[1:])), count_bands
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)
    for e, g in zip(expected[1:], got[1:]):
        assert torch.equal(e, g)


def test_conv_halo_is_the_context_of_a_stride_one_same_size_conv():
    assert conv_halo(nn.Conv2d(4, 4, 1)) == 0
    assert conv_halo(nn.Conv2d(4, 4, 3, padding=1)) == 1
    assert conv_halo(nn.Conv2d(4, 4, 5, padding=2)) == 2
    assert conv_halo(nn.Conv2d(4, 4, 3, padding=2, dilation=2)) == 2
    assert conv_halo(ConvModule(4, 4, 3, padding=1, norm_cfg=dict(type='BN'))) == 1
    assert conv_halo(ConvModule(4, 4, 1, norm_cfg=dict(type='GN', num_groups=2))) is None
    for module in (nn.Conv2d(4, 4, 3, padding=1, stride=2), nn.Conv2d(4, 4, 3),
                   nn.Conv2d(4, 4, 3, padding='same'),
                   nn.Conv2d(4, 4, 3, padding=1, padding_mode='reflect'),
                   ConvModule(4, 4, 3, padding=1, padding_mode='reflect'), nn.Identity()):
        assert conv_halo(module) is None, module


@pytest.mark.parametrize('mode', ['whole', 'tiles'])
def test_banded_detections_equal_stocks(mode, count_bands, monkeypatch):
    """The stride-4 maps made in bands of several rows (FPN level 0, the RPN's scores and box
    deltas) equal stock's maps up to rounding, row for row; boxes, scores and masks of
    ``band_mb`` equal stock's up to rounding, labels exactly (a single tile covering the image is
    the whole image)."""
    extra = dict(tile_size=256, tile_overlap=32) if mode == 'tiles' else {}
    stock, banded = _pair(band_mb=0.2, mode=mode, **extra)
    calls, rpn_maps = [], []
    banded.rpn_head.rpn_conv.register_forward_pre_hook(lambda m, args: calls.append(1))
    predict_by_feat = banded.rpn_head.predict_by_feat

    def keep_maps(cls_scores, bbox_preds, **kwargs):  # the RPN's maps, then its proposals
        rpn_maps.append([*cls_scores, *bbox_preds])
        return predict_by_feat(cls_scores, bbox_preds, **kwargs)

    monkeypatch.setattr(banded.rpn_head, 'predict_by_feat', keep_maps)
    inputs = torch.randn(1, 3, 160, 224, generator=torch.Generator().manual_seed(1))
    metas = [_meta((160, 224), (160, 224), (320, 448))]
    expected = _predict(stock, inputs, metas)[0].pred_instances
    got = _predict(banded, inputs, metas)[0].pred_instances
    # level 0's 40 rows in bands of several rows: FPN level 0, then the RPN's map
    band_rows = [stop - start for start, stop in count_bands]
    assert len(band_rows) > 3 and max(band_rows) > 3, band_rows
    assert len(calls) > 3 + 4  # bands of level 0, then 4 levels whole
    with torch.no_grad():
        stock_feats = stock.extract_feat(inputs)
        banded_feats = banded._lean_extract_feat(inputs)
        cls_scores, bbox_preds = stock.rpn_head(stock_feats)
    stock_maps = [*stock_feats, *cls_scores, *bbox_preds]
    banded_maps = [*banded_feats, *rpn_maps[0]]
    assert len(banded_maps) == len(stock_maps) == 3 * 5
    for stock_map, banded_map in zip(stock_maps, banded_maps):
        torch.testing.assert_close(banded_map, stock_map, rtol=1e-5, atol=1e-5)
    assert len(expected) == len(got) > 0
    assert torch.equal(expected.labels, got.labels)
    torch.testing.assert_close(got.bboxes, expected.bboxes, rtol=0, atol=1e-3)
    torch.testing.assert_close(got.scores, expected.scores, rtol=0, atol=1e-5)
    assert (got.masks != expected.masks).float().mean() < 1e-3
    bands = len(count_bands)
    banded.train()  # BatchNorm in training mode normalises over the whole map: no bands
    with torch.no_grad():
        banded._lean_extract_feat(inputs)
    assert len(count_bands) == bands


@pytest.mark.parametrize('value', [0, -4, '64', True])
def test_a_bad_band_mb_is_an_error_naming_the_fix(value):
    from xcit_mm.models.inference.settings import DetectorSettings
    with pytest.raises(ValueError, match='band_mb must be a positive number of MB'):
        DetectorSettings.from_cfg(dict(band_mb=value))
    with pytest.raises(ValueError, match='does not combine with lean=False'):
        DetectorSettings.from_cfg(dict(band_mb=64, lean=False))
    assert DetectorSettings.from_cfg(dict(band_mb=64, mode='tiles')).band_mb == 64


@pytest.mark.parametrize('part, change, message', [
    ('neck', dict(num_outs=5, add_extra_convs='on_input'), 'the neck must be'),
    ('neck', dict(norm_cfg=dict(type='GN', num_groups=4)), 'its GroupNorm normalises over'),
    ('rpn_head', dict(num_convs=2), 'the RPN head must be'),
    ('backbone', dict(type='ResNet', depth=18, init_cfg=None),
     'the backbone ResNet cannot make its stride-4 level in bands'),
])
def test_parts_that_cannot_run_in_bands_are_an_error(part, change, message, monkeypatch):
    from test_lean_detection import _model_cfg
    cfg = _model_cfg()
    if part == 'backbone':
        cfg.backbone = dict(change)
        cfg.neck.in_channels = [64, 128, 256, 512]
    else:
        cfg[part].update(change)
    cfg.test_cfg.band_mb = 64
    with pytest.raises(ValueError, match=message) as error:
        MODELS.build(dict(cfg, type='LeanMaskRCNN'))
    assert 'remove band_mb' in str(error.value)
