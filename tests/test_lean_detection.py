"""LeanMaskRCNN against mmdet's stock MaskRCNN on the same weights.

Every expected value comes from upstream mmdet: the stock ``MaskRCNN.predict`` (or
``inference_detector``) of a model built from the same config with the same state dict. Boxes,
labels, scores and masks must be identical (``torch.equal``). Small XCiTs (2 layers, 32 channels)
and small heads keep the file fast; ``score_thr=0`` keeps ``max_per_img`` detections, so the
masks cover most of the image and every pasting path is exercised.
"""
import copy

import numpy as np
import pytest
import torch
from mmengine.config import Config, ConfigDict
from mmengine.registry import init_default_scope

import xcit_mm  # noqa: E402,F401  (registers XCiTBackbone and LeanMaskRCNN)
from mmdet.registry import MODELS  # noqa: E402
from mmdet.structures import DetDataSample  # noqa: E402


NORM = dict(type='BN', requires_grad=True)
BACKBONE = dict(type='XCiTBackbone', arch=dict(embed_dims=32, depth=2, num_heads=4),
                patch_size=16, out_indices=(0, 0, 1, 1), norm_cfg=NORM, init_cfg=None)
MAX_DETS = 50


def _model_cfg() -> ConfigDict:
    """mmdet's own Mask R-CNN base model with a small XCiT and narrow heads."""
    init_default_scope('mmdet')
    cfg = Config.fromfile('configs/mask_rcnn_xcit_t12_p16_3x_coco.py').model
    cfg.backbone = ConfigDict(BACKBONE)
    cfg.neck.update(in_channels=[32] * 4, out_channels=32)
    cfg.rpn_head.update(in_channels=32, feat_channels=32)
    roi = cfg.roi_head
    roi.bbox_roi_extractor.out_channels = 32
    roi.mask_roi_extractor.out_channels = 32
    roi.bbox_head.update(in_channels=32, fc_out_channels=64, num_classes=10)
    roi.mask_head.update(in_channels=32, conv_out_channels=32, num_classes=10)
    cfg.test_cfg.rcnn.update(score_thr=0.0, max_per_img=MAX_DETS)
    return cfg


def _pair(**test_cfg):
    """(stock MaskRCNN, LeanMaskRCNN) with the same random weights, in eval."""
    cfg = _model_cfg()
    cfg.test_cfg.update(test_cfg)
    torch.manual_seed(0)
    stock = MODELS.build(dict(cfg, type='MaskRCNN'))
    stock.init_weights()
    with torch.no_grad():  # non-trivial BN statistics; sharper mask logits (masks not all 0/1)
        for m in stock.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        stock.roi_head.mask_head.conv_logits.weight.normal_(0, 0.5)
    lean = MODELS.build(dict(cfg, type='LeanMaskRCNN'))
    lean.load_state_dict(stock.state_dict())
    return stock.eval(), lean.eval()


@pytest.fixture(scope='module')
def pair():
    """One (stock, lean) pair for the tests that only predict (eval, no_grad: left unchanged)."""
    return _pair()


def _samples(metas):
    return [DetDataSample(metainfo=dict(meta)) for meta in metas]


def _meta(batch_hw, img_hw, ori_hw):
    """Meta of an image resized from ``ori_hw`` to ``img_hw``, padded into ``batch_hw``."""
    (h, w), (oh, ow) = img_hw, ori_hw
    return dict(img_shape=(h, w), ori_shape=(oh, ow), pad_shape=tuple(batch_hw),
                batch_input_shape=tuple(batch_hw), scale_factor=(w / ow, h / oh))


def _predict(model, inputs, metas, rescale=True):
    with torch.no_grad():
        return model.predict(inputs, _samples(metas), rescale=rescale)


def _assert_same(stock_out, lean_out):
    assert len(stock_out) == len(lean_out)
    for s, lean in zip(stock_out, lean_out):
        s, lean = s.pred_instances, lean.pred_instances
        assert len(s) > 0
        for key in ('bboxes', 'labels', 'scores', 'masks'):
            assert s[key].dtype == lean[key].dtype and s[key].shape == lean[key].shape, key
            assert torch.equal(s[key], lean[key]), f'{key} differ'


# (batch input H, W; image H, W inside it; original H, W): full resolution, odd sizes, both
# aspect ratios, padding, and a test Resize (original of another size: rescale=True scales
# boxes back and pastes masks at the original size)
SIZES = [((64, 64), (64, 64), (64, 64)), ((97, 131), (97, 131), (97, 131)),
         ((160, 64), (150, 48), (517, 151)), ((64, 224), (45, 200), (211, 941)),
         ((128, 128), (113, 127), (57, 61))]


@pytest.mark.parametrize('batch_hw,img_hw,ori_hw', SIZES)
def test_detections_equal_stock(pair, batch_hw, img_hw, ori_hw):
    stock, lean = pair
    torch.manual_seed(1)
    inputs = torch.randn(1, 3, *batch_hw)
    metas = [_meta(batch_hw, img_hw, ori_hw)]
    stock_out = _predict(stock, inputs, metas)
    assert len(stock_out[0].pred_instances) == MAX_DETS
    assert stock_out[0].pred_instances.masks.shape[1:] == ori_hw
    _assert_same(stock_out, _predict(lean, inputs, metas))


def test_padded_batch_of_two_and_no_rescale(pair):
    stock, lean = pair
    torch.manual_seed(2)
    inputs = torch.randn(2, 3, 96, 128)
    metas = [_meta((96, 128), (96, 120), (192, 240)), _meta((96, 128), (81, 128), (81, 128))]
    _assert_same(_predict(stock, inputs, metas), _predict(lean, inputs, metas))
    _assert_same(_predict(stock, inputs, metas, rescale=False),
                 _predict(lean, inputs, metas, rescale=False))


def test_precomputed_proposals_are_stocks_whole_and_refused_by_tiles(pair):
    from mmengine.structures import InstanceData
    stock, lean = pair
    inputs = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(4))
    boxes = torch.tensor([[4., 4., 40., 30.], [10., 20., 90., 60.], [0., 0., 96., 64.]])

    def samples():
        out = _samples([_meta((64, 96), (64, 96), (64, 96))])
        out[0].proposals = InstanceData(bboxes=boxes.clone())
        return out

    with torch.no_grad():
        _assert_same(stock.predict(inputs, samples()), lean.predict(inputs, samples()))
        lean.test_cfg['mode'] = 'tiles'
        try:
            with pytest.raises(ValueError, match=r"precomputed proposals \(data_samples"
                               r"\.proposals\) need mode='whole'"):
                lean.predict(inputs, samples())
        finally:
            lean.test_cfg.pop('mode')


def test_why_not_allows_every_lean_path_on_stock_parts_and_names_the_known_ones(pair):
    lean = pair[1]
    assert [lean.why_not(path) for path in ('fpn', 'rpn', 'roi', 'stream')] == [None] * 4
    with pytest.raises(ValueError, match=r"^LeanMaskRCNN: unknown lean path 'bands'; known: "
                       r"fpn, rpn, roi, stream$"):
        lean.why_not('bands')  # the band path went into the stream


@pytest.mark.parametrize('mode', ['whole', 'tiles'])
def test_band_mb_outside_the_stream_is_refused_naming_the_stream(mode):
    """``band_mb`` is the stream's band size (the whole path's bands went into the stream): with
    mode='whole' or 'tiles' building the model is an error naming mode='stream', not bands
    silently ignored; with mode='stream' or 'auto' the stream's bands take it."""
    cfg = _model_cfg()
    cfg.test_cfg.update(mode=mode, band_mb=64)
    with pytest.raises(ValueError, match=r"^LeanMaskRCNN: test_cfg \['band_mb'\] only apply to "
                       r"mode='stream' or mode='auto', but mode is '" + mode + "'"):
        MODELS.build(dict(cfg, type='LeanMaskRCNN'))
    for reads in (dict(mode='stream'), dict(mode='auto', max_memory=10**5)):
        cfg.test_cfg.update(reads)
        assert MODELS.build(dict(cfg, type='LeanMaskRCNN')).test_settings.band_mb == 64.0


def test_features_equal_stock_and_top_down_in_blocks(pair, monkeypatch):
    """The data-flow-order backbone + FPN gives ``extract_feat``'s maps bit for bit, also with
    top-down bands of a few rows (band edges inside the odd-sized maps)."""
    from xcit_mm.models.inference import fpn_data_flow
    stock, lean = pair
    add = fpn_data_flow.add_top_down_
    monkeypatch.setattr(fpn_data_flow, 'add_top_down_',
                        lambda lat, top, cfg: add(lat, top, cfg, band_mb=3 * 4 * 256 / 2**20))
    inputs = torch.randn(1, 3, 99, 145, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = stock.extract_feat(inputs)
        got = lean._lean_extract_feat(inputs)
    assert len(got) == len(expected) == 5
    for e, g in zip(expected, got):
        assert torch.equal(e, g)


def test_lean_false_and_autograd_are_stock():
    """``test_cfg.lean=False`` and a ``predict`` under autograd run stock ``predict``."""
    stock, lean = _pair()
    inputs = torch.randn(1, 3, 64, 96, generator=torch.Generator().manual_seed(5))
    metas = [_meta((64, 96), (64, 96), (64, 96))]
    expected = _predict(stock, inputs, metas)
    calls = []
    lean._lean_extract_feat = lambda *a: calls.append(1)  # must not run
    with torch.enable_grad():
        _assert_same(expected, [r.detach() for r in lean.predict(inputs, _samples(metas))])
    lean.test_cfg['lean'] = False
    _assert_same(expected, _predict(lean, inputs, metas))
    assert not calls


def test_inference_detector_equals_stock(pair):
    """mmdet's own door: ``init_detector`` + ``inference_detector`` on a config (test Resize to
    another size than the image's, so the results are rescaled to the original)."""
    from mmdet.apis import inference_detector, init_detector
    cfg = Config.fromfile('configs/mask_rcnn_xcit_t12_p16_3x_coco.py')
    cfg.model = _model_cfg()
    cfg.test_dataloader.dataset.pipeline = [
        dict(type='LoadImageFromFile'), dict(type='Resize', scale=(96, 64), keep_ratio=True),
        dict(type='PackDetInputs', meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape',
                                              'scale_factor'))]
    stock_cfg = copy.deepcopy(cfg)
    stock_cfg.model.type = 'MaskRCNN'
    cfg.model.type = 'LeanMaskRCNN'
    stock, lean = pair
    models = []
    for c, weights in ((stock_cfg, stock), (cfg, lean)):
        model = init_detector(c, device='cpu')
        model.load_state_dict(weights.state_dict())
        models.append(model)
    assert type(models[1]).__name__ == 'LeanMaskRCNN'
    img = np.random.RandomState(6).randint(0, 255, (75, 133, 3), np.uint8)
    s, lean = (inference_detector(m, img) for m in models)
    assert s.pred_instances.masks.shape[1:] == (75, 133)
    _assert_same([s], [lean])


@pytest.mark.parametrize('package, change, extra_levels, reason', [
    ('mmdet', dict(), True, None),
    ('mmdet', dict(num_outs=5), True, None),  # the fifth level by max pooling, as FPN makes it
    ('mmdet', dict(num_outs=5, add_extra_convs='on_input'), True, 'by max pooling'),
    ('mmdet', dict(start_level=1, num_outs=3), True, 'on every backbone level'),
    ('mmdet', dict(end_level=2, num_outs=3), True, 'on every backbone level'),
    ('mmseg', dict(), False, None),
    ('mmseg', dict(num_outs=5), False, 'adds no levels'),
    ('mmseg', dict(start_level=1, num_outs=3), False, 'on every backbone level'),
])
def test_one_fpn_check_for_both_models(package, change, extra_levels, reason):
    """``why_not_data_flow_fpn``: the FPNs ``fpn_in_data_flow_order`` computes as stock does (the
    detector's data-flow and stream checks, the segmentor's Semantic FPN and stream)."""
    import importlib
    from xcit_mm.models.inference.fpn_data_flow import why_not_data_flow_fpn
    fpn_type = importlib.import_module(f'{package}.models.necks').FPN
    neck = fpn_type(**dict(dict(in_channels=[8, 8, 8, 8], out_channels=8, num_outs=4), **change))
    why = why_not_data_flow_fpn(neck, fpn_type, extra_levels)
    assert why is None if reason is None else reason in why
    other = importlib.import_module(f"{'mmseg' if package == 'mmdet' else 'mmdet'}.models.necks")
    assert why_not_data_flow_fpn(neck, other.FPN, extra_levels).startswith('the neck must be')
