"""LeanEncoderDecoder's UperNet network (``xcit_mm/models/inference/fpn_data_flow.py``) against
mmseg's stock ``UPerHead.forward`` / ``EncoderDecoder.predict`` on the same weights.

Every expected value comes from upstream mmseg on a model built from the same config with the
same state dict: the logits of the lean network must be stock's bit for bit (``torch.equal``, and
the same strides), labels identical. The models are our UperNet configs (mmseg's UperNet base:
pool scales 1, 2, 3, 6, no neck) on a small XCiT (2 layers, 32 channels), with a 64-channel head
(one test keeps the configs' 512) so that the file stays fast; random weights with non-trivial
BN statistics and a spread classifier. The memory test runs in a fresh process.
"""
import copy
import json

import pytest
import torch
from mmengine.config import Config, ConfigDict
from mmengine.registry import init_default_scope

import xcit_mm  # noqa: F401  (registers XCiTBackbone and LeanEncoderDecoder)
from fresh_process import run_fresh
from mmseg.models.decode_heads import UPerHead
from mmseg.registry import MODELS
from mmseg.structures import SegDataSample
from test_lean_segmentation import _meta, spread_statistics_and_logits

ADE = 'configs/upernet_xcit_s12_p16_160k_ade20k.py'
CITYSCAPES = 'configs/upernet_xcit_s12_p16_80k_cityscapes.py'
SMALL_ARCH = dict(embed_dims=32, depth=2, num_heads=4)
BN = dict(type='BN', requires_grad=True)


def _config_model(path, channels_last=False, channels=None):
    """The config's model dict on a small XCiT (BN for one process, no pretrained weights)."""
    model = copy.deepcopy(Config.fromfile(path).model)
    model.backbone.update(arch=SMALL_ARCH, out_indices=(0, 0, 1, 1), init_cfg=None,
                          norm_cfg=BN, out_channels_last=channels_last)
    model.decode_head.update(in_channels=[32] * 4, norm_cfg=BN)
    model.auxiliary_head.update(in_channels=32, norm_cfg=BN)
    if channels is not None:
        model.decode_head.channels = channels
    model.data_preprocessor = None
    model.test_cfg = ConfigDict(mode='whole')
    return model


def _pair(path, channels_last=False, channels=None, **test_cfg):
    """(stock EncoderDecoder, LeanEncoderDecoder) of the config with the same random weights."""
    init_default_scope('mmseg')
    cfg = _config_model(path, channels_last, channels)
    cfg.test_cfg.update(test_cfg)
    torch.manual_seed(0)
    stock = MODELS.build(dict(cfg, type='EncoderDecoder'))
    stock.init_weights()
    spread_statistics_and_logits(stock)
    lean = MODELS.build(dict(cfg, type='LeanEncoderDecoder'))
    lean.load_state_dict(stock.state_dict())
    return stock.eval(), lean.eval()


@pytest.fixture(scope='module')
def ade_models():
    """The ADE20k config's models in both layouts, with a 64-channel head (fast)."""
    return {layout: _pair(ADE, channels_last=layout == 'channels_last', channels=64)
            for layout in ('nchw', 'channels_last')}


def _stock_network(model, x):
    with torch.no_grad():
        return model.decode_head.forward(model.extract_feat(x))


class _Spy:
    """Records the lean path: calls of the data-flow function, and every ``torch.cat`` output's
    channel count (stock concatenates the four FPN outputs, 4 x channels)."""

    def __init__(self, monkeypatch):
        from xcit_mm.models.inference import fpn_data_flow
        self.lean_calls, self.cat_channels = 0, []
        real_flow, real_cat = fpn_data_flow.uper_head_in_data_flow_order, torch.cat

        def flow(*args, **kwargs):
            self.lean_calls += 1
            return real_flow(*args, **kwargs)

        def cat(tensors, *args, **kwargs):
            out = real_cat(tensors, *args, **kwargs)
            if out.device.type != 'meta' and out.dim() == 4:
                self.cat_channels.append(out.shape[1])
            return out

        import xcit_mm.models.segmentors.lean_encoder_decoder as led
        monkeypatch.setattr(led, 'uper_head_in_data_flow_order', flow)
        monkeypatch.setattr(torch, 'cat', cat)


# (H, W, layout): odd sizes in both aspect ratios, a side at the backbone's minimum (32)
CASES = [(97, 130, 'nchw'), (97, 130, 'channels_last'), (200, 45, 'channels_last'),
         (32, 77, 'nchw')]


@pytest.mark.parametrize('h,w,layout', CASES, ids=[f'{h}x{w}-{lay}' for h, w, lay in CASES])
def test_network_logits_are_stocks_bit_for_bit(ade_models, h, w, layout, monkeypatch):
    stock, lean = ade_models[layout]
    torch.manual_seed(h * 1000 + w)
    x = torch.randn(2, 3, h, w)
    expected = _stock_network(stock, x)
    spy = _Spy(monkeypatch)
    with torch.no_grad():
        got = lean._network_forward(x)
    assert spy.lean_calls == 1
    channels = lean.decode_head.channels
    assert 4 * channels not in spy.cat_channels, spy.cat_channels  # only the PSP's cat ran
    assert got.stride() == expected.stride()
    assert torch.equal(got, expected)


def test_config_head_of_512_channels_is_stocks(monkeypatch):
    """The Cityscapes config's own head (512 channels, 19 classes), an odd size, batch 2.
    Every ``configs/upernet_xcit_*.py`` inherits this head from mmseg's UperNet base (no neck),
    as the ADE20k one above."""
    stock, lean = _pair(CITYSCAPES)
    assert lean.decode_head.channels == 512 and lean.why_not('network') is None
    torch.manual_seed(7)
    x = torch.randn(2, 3, 45, 77)
    expected = _stock_network(stock, x)
    spy = _Spy(monkeypatch)
    with torch.no_grad():
        got = lean._network_forward(x)
    assert spy.lean_calls == 1 and 2048 not in spy.cat_channels
    assert got.stride() == expected.stride() and torch.equal(got, expected)


def test_other_heads_and_subclasses_run_stock(ade_models):
    """A UPerHead subclass, a head reading other levels, or a neck: not taken for stock's."""
    _, lean = ade_models['nchw']
    lean = copy.deepcopy(lean)
    assert lean.why_not('network') is None

    class MyUPerHead(UPerHead):
        pass

    head = lean.decode_head
    head.__class__ = MyUPerHead
    assert lean.why_not('network').endswith('not NoneType + MyUPerHead')
    head.__class__ = UPerHead
    head.in_index = [1, 2, 3, 0]
    assert lean.why_not('network') == 'UPerHead must read the levels 0..n-1 in order (in_index)'
    head.in_index = [0, 1, 2, 3]
    lean.neck = torch.nn.Identity()  # a neck between backbone and head: stock's path
    assert lean.with_neck and lean.why_not('network').endswith('not Identity + UPerHead')
    with pytest.raises(ValueError, match="unknown lean path 'networks'; known: network, resize"):
        lean.why_not('networks')


def test_predict_labels_and_logits_equal_stock(ade_models):
    """A padded batch of two (one flipped, one resized), through both ``predict``s."""
    stock, lean = ade_models['channels_last']
    lean.test_cfg.update(keep_seg_logits=True)
    torch.manual_seed(3)
    x = torch.randn(2, 3, 97, 130)
    metas = [_meta((97, 130), (120, 151), pad=(0, 7, 0, 5), flip='horizontal'),
             _meta((97, 130), (97, 130))]
    with torch.no_grad():
        want = stock.predict(x, [SegDataSample(metainfo=dict(m)) for m in metas])
        got = lean.predict(x, [SegDataSample(metainfo=dict(m)) for m in metas])
    for s, g in zip(want, got):
        assert torch.equal(s.pred_sem_seg.data, g.pred_sem_seg.data)
        assert torch.equal(s.seg_logits.data, g.seg_logits.data)


# (N, C, H, W) with ambiguous layouts too: size-1 batch, channel and spatial dims
SHAPES = [(2, 3, 5, 7), (1, 4, 6, 5), (2, 1, 5, 7), (1, 3, 1, 1), (2, 5, 1, 4), (1, 2, 3, 1)]
LAYOUTS = [torch.contiguous_format, torch.channels_last]


def test_layout_rules_are_torchs():
    """The ported layout rules against torch's own ops: the memory format ``F.interpolate``
    allocates, the shape and strides of ``torch.cat`` of every pair of layouts, and
    ``add_as_stock``'s sum (bits and strides of ``a + b``, also on a slice)."""
    from mmseg.models.utils import resize

    from xcit_mm.models.inference.fpn_data_flow import (add_as_stock, empty_for_cat,
                                                        resized_channels_last,
                                                        suggests_channels_last)
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        xs = [torch.randn(shape, generator=gen).contiguous(memory_format=f) for f in LAYOUTS]
        xs.append(torch.randn(shape[0], shape[1] + 2, *shape[2:], generator=gen)[:, 1:-1])
        for x in xs:
            up = resize(x, size=(9, 11), mode='bilinear', align_corners=False)
            channels_last = resized_channels_last(x, (9, 11))
            assert channels_last == suggests_channels_last(up.shape, up.stride())
            assert (up.stride() == up.contiguous(memory_format=torch.channels_last).stride()
                    if channels_last else up.is_contiguous())
            for y in xs:
                ref = torch.cat([x, y], 1)
                flags = [suggests_channels_last(t.shape, t.stride()) for t in (x, y)]
                buf = empty_for_cat([x.shape, y.shape], flags, 1, x)
                assert (buf.shape, buf.stride(), buf.dtype) == (ref.shape, ref.stride(), ref.dtype)
                x_own = x.clone()  # what add_as_stock's callers hold: a dense map of their own
                ref = x_own + y
                got = add_as_stock(x_own.clone(), y)
                assert got.stride() == ref.stride() and torch.equal(got, ref)


# The configs' UperNet (mmseg's base: pool scales 1, 2, 3, 6, BN, align_corners False, no neck)
# with a 64-channel XCiT and head, built from a dict (no config parsing in the child).
CHILD = r'''
import json, torch
import xcit_mm
from mmengine.registry import init_default_scope
from mmseg.registry import MODELS
from xcit_mm.models.utils.memory_budget import measure_peak_growth_mb
init_default_scope('mmseg')
bn = dict(type='BN', requires_grad=True)
model = MODELS.build(dict(
    type='LeanEncoderDecoder', test_cfg=dict(mode='whole'),
    backbone=dict(type='XCiTBackbone', arch=dict(embed_dims=64, depth=1, num_heads=4),
                  out_indices=(0, 0, 0, 0), norm_cfg=bn),
    decode_head=dict(type='UPerHead', in_channels=[64] * 4, in_index=[0, 1, 2, 3],
                     pool_scales=(1, 2, 3, 6), channels=64, num_classes=150, norm_cfg=bn,
                     align_corners=False,
                     loss_decode=dict(type='CrossEntropyLoss', use_sigmoid=False)))).eval()
assert model.why_not('network') is None
x = torch.randn(1, 3, 512, 512)
report = dict(unit_mb=64 * 128 * 128 * 4 / 2**20)
with torch.no_grad():
    model._network_forward(x)  # warm-up: oneDNN's primitives of these shapes (~1 unit)
    report['lean'] = measure_peak_growth_mb(lambda: model._network_forward(x))
    report['stock'] = measure_peak_growth_mb(
        lambda: model.decode_head.forward(model.extract_feat(x)))
print(json.dumps(report))
'''


def test_lean_network_peak_is_below_stocks():
    """A fresh process (malloc returning freed memory at once): the network's peak growth at
    512 x 512, NCHW, 64-channel backbone and head (a stride-4 map of either: 4 MB, one unit).
    Both peak in ``fpn_bottleneck``'s conv: the 4-unit concatenation, as much again inside the
    conv (oneDNN), its 1-unit output. Stock also holds the stride-4 backbone map and lateral
    sum there (measured: 11.7 units); lean nothing else (9.1 units)."""
    report = run_fresh(CHILD)
    print(json.dumps(report))
    unit = report['unit_mb']
    assert report['lean'] < 9.5 * unit, report
    assert report['lean'] < report['stock'] - 2 * unit, report
