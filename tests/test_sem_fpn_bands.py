"""Whole-image Semantic FPN with its large maps in bands of rows (``test_cfg.band_mb``).

Expected values come from upstream mmseg on the same weights: ``FPNHead.forward(FPN.forward(
backbone(x)))`` and the stock ``EncoderDecoder.predict`` labels; the row pieces against mmseg's
own ``Upsample`` and ``resize``. The network equals stock up to float rounding (a conv of another
size may sum in another order), the upsampling and the post-processing rows bit for bit.
"""
import json

import pytest
import torch
from mmcv.cnn import ConvModule

import xcit_mm  # noqa: F401  (registers XCiTBackbone and LeanEncoderDecoder)
import xcit_mm.models.segmentors.lean_encoder_decoder as lean_module
from fresh_process import run_fresh
from mmseg.models.utils import Upsample, resize
from test_lean_segmentation import SEM_FPN, UPERNET, _meta, _pair, _predict
from xcit_mm.models.inference.sem_fpn_bands import labels_in_row_bands, up2_rows


@pytest.mark.parametrize('height', [1, 2, 7, 16])
def test_upsampled_rows_are_mmsegs_upsample_bit_for_bit(height):
    x = torch.randn(2, 5, height, 9, generator=torch.Generator().manual_seed(height))
    whole = Upsample(scale_factor=2, mode='bilinear', align_corners=False)(x)
    for start in range(2 * height):
        for stop in range(start + 1, 2 * height + 1):
            assert torch.equal(up2_rows(x, start, stop), whole[:, :, start:stop]), (start, stop)


@pytest.mark.parametrize('factor,crop', [(4, (0, 0, 0, 0)), (4, (3, 5, 2, 7)), (3, (1, 0, 0, 4))])
@pytest.mark.parametrize('band_mb', [1e-4, 0.01, 100])
def test_banded_labels_are_the_stock_resize_crop_and_argmax(factor, crop, band_mb):
    """Ties included: two classes share their logits, the earlier index must win."""
    logits = torch.randn(1, 6, 11, 13, generator=torch.Generator().manual_seed(factor))
    logits[:, 4] = logits[:, 1]
    size = (11 * factor, 13 * factor)
    top, bottom, left, right = crop
    full = resize(logits, size=size, mode='bilinear', align_corners=False)
    expected = full[:, :, top:size[0] - bottom, left:size[1] - right].argmax(dim=1)
    got = labels_in_row_bands(logits, size, crop, band_mb)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def _banded_pair(**test_cfg):
    stock, lean = _pair(SEM_FPN, **test_cfg)
    return stock, lean


@pytest.mark.parametrize('img_hw', [(128, 256), (99, 145)])
def test_network_in_bands_is_stocks_up_to_rounding(img_hw, monkeypatch):
    stock, lean = _banded_pair(band_mb=0.02)
    calls = []
    real = lean_module.semantic_fpn_in_bands
    monkeypatch.setattr(lean_module, 'semantic_fpn_in_bands',
                        lambda *a: calls.append(a[-1]) or real(*a))
    x = torch.randn(1, 3, *img_hw, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = stock.decode_head.forward(stock.extract_feat(x))
        got = lean._network_forward(x)
    assert calls == [0.02]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('img_hw,ori_hw,flip', [
    ((128, 192), (128, 192), None),  # full resolution: labels in bands of rows
    ((96, 96), (387, 389), None),  # the test Resize: class chunks after the banded network
    ((128, 192), (128, 192), 'horizontal'),  # flip: class chunks
])
def test_predict_labels_equal_stock(img_hw, ori_hw, flip, monkeypatch):
    stock, lean = _banded_pair(band_mb=0.05)
    banded = []
    real = lean_module.labels_in_row_bands
    monkeypatch.setattr(lean_module, 'labels_in_row_bands',
                        lambda *a: banded.append(a[1]) or real(*a))
    x = torch.randn(2, 3, *img_hw, generator=torch.Generator().manual_seed(4))
    metas = [_meta(img_hw, ori_hw, flip=flip)] * 2
    expected = _predict(stock, x, metas)
    got = _predict(lean, x, metas)
    assert len(banded) == (2 if ori_hw == img_hw and not flip else 0)
    for s, g in zip(expected, got):
        assert torch.equal(s.pred_sem_seg.data, g.pred_sem_seg.data), \
            f'{int((s.pred_sem_seg.data != g.pred_sem_seg.data).sum())} labels differ'
        assert 'seg_logits' not in g


@pytest.mark.parametrize('heads,test_cfg,message', [
    (SEM_FPN, dict(band_mb=0), 'must be a positive number of MB'),
    (SEM_FPN, dict(band_mb=True), 'must be a positive number of MB'),
    (SEM_FPN, dict(band_mb='8'), 'must be a positive number of MB'),
    (SEM_FPN, dict(band_mb=8, mode='slide', crop_size=(64, 64), stride=(48, 48)),
     "applies to mode='whole'"),
    (SEM_FPN, dict(band_mb=8, lean=False), 'needs the lean predict'),
    (UPERNET, dict(band_mb=8), 'runs Semantic FPN .* only, not NoneType \\+ UPerHead'),
])
def test_band_mb_where_it_does_not_apply_is_an_error(heads, test_cfg, message):
    _, lean = _pair(heads)
    lean.test_cfg.update(test_cfg)
    with pytest.raises(ValueError, match=f'test_cfg.band_mb.*{message}'):
        _predict(lean, torch.randn(1, 3, 64, 64), None)


def test_a_head_that_cannot_run_in_bands_is_an_error():
    _, lean = _pair(SEM_FPN, band_mb=8)
    conv = lean.decode_head.scale_heads[0][0]
    lean.decode_head.scale_heads[0][0] = ConvModule(
        conv.in_channels, conv.out_channels, 3, padding=1,
        norm_cfg=dict(type='GN', num_groups=2)).eval()
    with pytest.raises(ValueError, match="band_mb: the head's stride-4 branch must be one "
                       'size-keeping stride-1 conv with BN or no norm; remove test_cfg.band_mb'):
        _predict(lean, torch.randn(1, 3, 64, 64), None)


CHILD = r'''
import json, torch
from mmengine.registry import init_default_scope
from mmengine.config import ConfigDict
import xcit_mm  # noqa
from mmseg.registry import MODELS
from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
init_default_scope('mmseg')
torch.manual_seed(0)
cfg = dict(
    type='LeanEncoderDecoder',
    backbone=dict(type='XCiTBackbone', arch=dict(embed_dims=64, depth=2, num_heads=4),
                  patch_size=16, out_indices=(0, 0, 1, 1), init_cfg=None),
    neck=dict(type='FPN', in_channels=[64] * 4, out_channels=64, num_outs=4),
    decode_head=dict(type='FPNHead', in_channels=[64] * 4, in_index=[0, 1, 2, 3],
                     feature_strides=[4, 8, 16, 32], channels=64, num_classes=4,
                     align_corners=False,
                     loss_decode=dict(type='CrossEntropyLoss', loss_weight=1.0)))
report = dict(unit_mb=64 * 128 * 256 * 4 / 2**20)  # one stride-4 map of the 512 x 1024 image
x = torch.randn(1, 3, 512, 1024)
for band_mb in (None, 1):
    model = MODELS.build(dict(cfg, test_cfg=ConfigDict(mode='whole', band_mb=band_mb))).eval()
    with torch.no_grad():
        model.predict(torch.randn(1, 3, 64, 64))  # warm-up: oneDNN's primitives
        report[str(band_mb)] = measure_peak_growth_mb(lambda: model.predict(x))
        stem = model.backbone.patch_embed
        report[f'stem {band_mb}'] = measure_peak_growth_mb(
            lambda: stem(x, None if band_mb is None else 2))
print(json.dumps(report))
'''


def test_banded_whole_image_peak_is_a_fraction_of_the_whole_maps():
    """A fresh process (malloc returning freed memory at once), 512 x 1024, 4 classes: whole
    maps hold several stride-4 maps of 64 channels (one unit, 8 MB) at once (measured: 4.2
    units); in bands of 1 MB only the labels (int64, 0.5 unit), the stride-8 maps (FPN output,
    lateral sum, three head branches: 0.25 unit each) and the stride-4 logits are whole
    (measured: 1.9 units). The conv stem alone: whole, its input's channels-last copy and
    two stride-2 maps of 8 channels (0.75 unit, 0.5 each); in bands of 2 token rows, a few
    rows of them (measured: 1.7 and 0.3 units)."""
    report = run_fresh(CHILD)
    print(json.dumps(report))
    unit = report['unit_mb']
    assert report['1'] < 2.5 * unit, report
    assert report['1'] < 0.6 * report['None'], report
    assert report['stem 1'] < min(0.5 * unit, report['stem None'] / 4), report
