"""LeanEncoderDecoder against mmseg's stock EncoderDecoder on the same weights.

Every expected value comes from upstream mmseg: the stock ``EncoderDecoder.predict`` of a model
built from the same config with the same state dict. Labels must be identical, logits (when kept)
equal. Small XCiTs (2 layers, 32 channels) keep the file fast; 150 classes and a small chunk
budget make the post-processing run over many class chunks; the most frequent winning class of a
probe image is copied to a class of another chunk, so the pixels it wins are exact ties that only
the first-index rule resolves as argmax does.
"""
import copy

import numpy as np
import pytest
import torch
from mmengine.config import ConfigDict
from mmengine.registry import init_default_scope

import xcit_mm  # noqa: E402,F401  (registers XCiTBackbone and LeanEncoderDecoder)
from mmseg.registry import MODELS  # noqa: E402
from mmseg.structures import SegDataSample  # noqa: E402

NUM_CLASSES = 150
NORM = dict(type='BN', requires_grad=True)
BACKBONE = dict(type='XCiTBackbone', arch=dict(embed_dims=32, depth=2, num_heads=4),
                patch_size=16, out_indices=(0, 0, 1, 1), norm_cfg=NORM, init_cfg=None)
LOSS = dict(type='CrossEntropyLoss', use_sigmoid=False, loss_weight=1.0)
SEM_FPN = dict(
    neck=dict(type='FPN', in_channels=[32] * 4, out_channels=24, num_outs=4),
    decode_head=dict(type='FPNHead', in_channels=[24] * 4, in_index=[0, 1, 2, 3],
                     feature_strides=[4, 8, 16, 32], channels=16, dropout_ratio=0.1,
                     num_classes=NUM_CLASSES, norm_cfg=NORM, align_corners=False,
                     loss_decode=LOSS))
UPERNET = dict(
    decode_head=dict(type='UPerHead', in_channels=[32] * 4, in_index=[0, 1, 2, 3],
                     pool_scales=(1, 2, 3, 6), channels=16, dropout_ratio=0.1,
                     num_classes=NUM_CLASSES, norm_cfg=NORM, align_corners=False,
                     loss_decode=LOSS),
    auxiliary_head=dict(type='FCNHead', in_channels=32, in_index=2, channels=16, num_convs=1,
                        concat_input=False, dropout_ratio=0.1, num_classes=NUM_CLASSES,
                        norm_cfg=NORM, align_corners=False, loss_decode=LOSS))


def spread_statistics_and_logits(model):
    """Non-trivial BN statistics and classifier logits of order 1, drawn from torch's stream."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        model.decode_head.conv_seg.weight.normal_(0, 0.3)
        model.decode_head.conv_seg.bias.normal_(0, 0.3)


def _pair(heads, channels_last=False, num_classes=NUM_CLASSES, **test_cfg):
    """(stock EncoderDecoder, LeanEncoderDecoder) with the same random weights, in eval."""
    init_default_scope('mmseg')
    cfg = dict(type='EncoderDecoder', backbone=dict(BACKBONE, out_channels_last=channels_last),
               **copy.deepcopy(heads), test_cfg=ConfigDict(mode='whole', **test_cfg))
    cfg['decode_head']['num_classes'] = num_classes
    if num_classes == 1:
        cfg['decode_head'].update(out_channels=1, threshold=0.3,
                                  loss_decode=dict(LOSS, use_sigmoid=True))
    torch.manual_seed(0)
    stock = MODELS.build(cfg)
    stock.init_weights()
    spread_statistics_and_logits(stock)
    with torch.no_grad():
        conv_seg = stock.decode_head.conv_seg
        if num_classes > 1:  # copy the most frequent winner of a probe image to a far class
            stock.eval()
            gen = torch.Generator().manual_seed(9)
            probe = stock.predict(torch.randn(1, 3, 64, 96, generator=gen))
            winner = int(probe[0].pred_sem_seg.data.flatten().mode().values)
            twin = num_classes - 1 if winner < num_classes // 2 else 0
            conv_seg.weight[twin] = conv_seg.weight[winner]
            conv_seg.bias[twin] = conv_seg.bias[winner]
    lean = MODELS.build(dict(cfg, type='LeanEncoderDecoder'))
    lean.load_state_dict(stock.state_dict())
    return stock.eval(), lean.eval()


def _samples(metas):
    return [SegDataSample(metainfo=dict(meta)) for meta in metas]


def _predict(model, inputs, metas):
    with torch.no_grad():
        return model.predict(inputs, None if metas is None else _samples(metas))


def _assert_same(stock_out, lean_out, logits=True):
    assert len(stock_out) == len(lean_out)
    for s, l in zip(stock_out, lean_out):
        assert s.pred_sem_seg.data.dtype == l.pred_sem_seg.data.dtype
        assert torch.equal(s.pred_sem_seg.data, l.pred_sem_seg.data), \
            f'{int((s.pred_sem_seg.data != l.pred_sem_seg.data).sum())} labels differ'
        if logits:
            torch.testing.assert_close(l.seg_logits.data, s.seg_logits.data, rtol=0, atol=0)


def _meta(img_hw, ori_hw, pad=(0, 0, 0, 0), flip=None):
    H, W = img_hw
    meta = dict(ori_shape=tuple(ori_hw), img_shape=(H - pad[2] - pad[3], W - pad[0] - pad[1]),
                pad_shape=(H, W), padding_size=list(pad))
    if flip:
        meta.update(flip=True, flip_direction=flip)
    return meta


# (network input H, W; original H, W): full resolution (same), the test Resize (ori larger),
# odd sizes and both aspect ratios
SIZES = [((64, 64), (64, 64)), ((97, 131), (97, 131)), ((160, 48), (517, 151)),
         ((45, 200), (211, 941)), ((96, 96), (387, 389))]


@pytest.mark.parametrize('heads', [SEM_FPN, UPERNET], ids=['sem_fpn', 'upernet'])
@pytest.mark.parametrize('img_hw,ori_hw', SIZES)
def test_labels_and_logits_equal_stock(heads, img_hw, ori_hw):
    stock, lean = _pair(heads, lean_chunk_mb=0.01, keep_seg_logits=True)
    torch.manual_seed(1)
    inputs = torch.randn(1, 3, *img_hw)
    metas = [_meta(img_hw, ori_hw)]
    _assert_same(_predict(stock, inputs, metas), _predict(lean, inputs, metas))


@pytest.mark.parametrize('channels_last', [False, True], ids=['nchw', 'channels_last'])
def test_batch_padding_flip_and_layout(channels_last):
    """Two images of different original sizes in one padded batch, one flipped each way."""
    stock, lean = _pair(SEM_FPN, channels_last=channels_last, lean_chunk_mb=0.05,
                        keep_seg_logits=True)
    torch.manual_seed(2)
    inputs = torch.randn(2, 3, 112, 144)
    metas = [_meta((112, 144), (301, 397), pad=(0, 9, 0, 13), flip='horizontal'),
             _meta((112, 144), (90, 150), pad=(0, 0, 0, 5), flip='vertical')]
    _assert_same(_predict(stock, inputs, metas), _predict(lean, inputs, metas))


def test_without_data_samples_and_without_logits():
    """``data_samples=None`` (labels at the input size); by default no full-size logits."""
    stock, lean = _pair(SEM_FPN, lean_chunk_mb=0.01, keep_seg_logits=True)
    torch.manual_seed(3)
    inputs = torch.randn(1, 3, 81, 70)
    _assert_same(_predict(stock, inputs, None), _predict(lean, inputs, None))
    lean.test_cfg.keep_seg_logits = False
    out = _predict(lean, inputs, [_meta((81, 70), (160, 140))])[0]
    assert 'seg_logits' not in out and out.pred_sem_seg.shape == (160, 140)


def test_binary_head_threshold():
    stock, lean = _pair(SEM_FPN, num_classes=1, keep_seg_logits=True)
    torch.manual_seed(4)
    inputs = torch.randn(1, 3, 65, 99)
    metas = [_meta((65, 99), (130, 198))]
    _assert_same(_predict(stock, inputs, metas), _predict(lean, inputs, metas))


def test_chunk_width_rule():
    """A multiple of 8, at least 8 (24 channels-last), at most all classes, at the largest
    image's planes (and the windows' map): ``lean_chunk_mb`` over 4 bytes a pixel."""
    _, lean = _pair(SEM_FPN)

    def width(budget_mb, head_hw, channels_last=False, metas=(None, ), batch_map=0):
        lean.test_cfg.lean_chunk_mb = budget_mb
        return lean._chunk_width(head_hw, list(metas), channels_last, batch_map)

    assert [width(0.01, (100, 100)), width(0.01, (100, 100), True), width(1000, (10, 10)),
            width(256, (1024, 1024))] == [8, 24, NUM_CLASSES, 64]
    two = [dict(ori_shape=(512, 1024)), dict(ori_shape=(1024, 1024))]
    assert width(256, (8, 8), metas=two) == 64  # 2**20 pixels, not 2**19 (128)
    assert width(256, (512, 1024), batch_map=2**19) == 64


@pytest.mark.parametrize('top_hw,lat_hw',
                         [((6, 7), (12, 14)), ((5, 7), (9, 13)), ((4, 4), (11, 3))])
@pytest.mark.parametrize('channels_last', [False, True])
def test_top_down_sum_in_bands_is_fpns(top_hw, lat_hw, channels_last):
    """The FPN top-down sum, added in bands of one or a few rows: the bits of mmseg's ``FPN``
    (``lateral + resize(top, size=..., mode='nearest')``), also for sizes that are no multiple."""
    from mmseg.models.utils import resize

    from xcit_mm.models.inference.fpn_data_flow import add_top_down_
    generator = torch.Generator().manual_seed(0)
    top = torch.randn(2, 3, *top_hw, generator=generator)
    lat = torch.randn(2, 3, *lat_hw, generator=generator)
    if channels_last:
        top, lat = (x.contiguous(memory_format=torch.channels_last) for x in (top, lat))
    expected = lat + resize(top, size=lat.shape[2:], mode='nearest')
    for band_mb in (1e-9, 1e-3):  # one row per band; three rows or so per band
        got = add_top_down_(lat.clone(), top, dict(mode='nearest'), band_mb=band_mb)
        assert torch.equal(got, expected)


def test_inference_model_door_paper_pipeline_and_full_resolution():
    """mmseg.apis.inference_model on the shapes config (our paper Sem-FPN base underneath: the
    lean segmentor is its default), with its test Resize and without it (full resolution)."""
    from mmengine.config import Config
    from mmseg.apis import inference_model, init_model
    cfg = Config.fromfile('configs/shapes/sem_fpn_xcit_shapes_ade.py')
    assert cfg.model.type == 'LeanEncoderDecoder'
    lean = init_model(cfg, device='cpu')
    stock_cfg = copy.deepcopy(cfg)
    stock_cfg.model.type = 'EncoderDecoder'
    stock_cfg.model.test_cfg = dict(mode='whole')  # stock reads test_cfg.mode
    stock = init_model(stock_cfg, device='cpu')
    torch.manual_seed(5)
    with torch.no_grad():  # random weights with varied labels: spread the classifier
        lean.decode_head.conv_seg.weight.normal_(0, 0.01)
    stock.load_state_dict(lean.state_dict())
    img = np.random.RandomState(0).randint(0, 255, (333, 517, 3), dtype=np.uint8)
    for pipeline in (cfg.test_pipeline, [t for t in cfg.test_pipeline if t.type != 'Resize']):
        lean.cfg.test_pipeline = stock.cfg.test_pipeline = pipeline
        stock_out, lean_out = inference_model(stock, img), inference_model(lean, img)
        assert lean_out.pred_sem_seg.shape == (333, 517)
        assert torch.equal(stock_out.pred_sem_seg.data, lean_out.pred_sem_seg.data)
        assert len(torch.unique(lean_out.pred_sem_seg.data)) > 1
