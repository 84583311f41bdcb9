"""GatherRoIAlign / GatherRoIExtractor give mmcv's RoIAlign / mmdet's SingleRoIExtractor values.

The reference is upstream: ``mmcv.ops.RoIAlign`` (its CPU kernel) and mmdet's
``SingleRoIExtractor`` built from the same config. Compared: outputs and the feature maps'
gradients for a fixed random output weighting, in float64 (where only rounding may differ, so
1e-10 leaves room for nothing but bugs: a sampling point off by half a bin, a wrong border rule or
a missing 1/count) and float32, over the cases the kernel distinguishes: fixed and adaptive
sampling grids (``sampling_ratio`` 0, 1, 2), aligned and legacy boxes, RoIs partly or wholly
outside the map, sub-pixel RoIs, non-square outputs and several images in the batch.
"""
import pytest
import torch
from mmcv.ops import RoIAlign
from mmdet.models.roi_heads.roi_extractors import SingleRoIExtractor

from training_extras.roi_heads import GatherRoIAlign
from training_extras.roi_heads import GatherRoIExtractor


def random_rois(num, batch, height, width, stride, seed):
    """(num, 5) boxes in image pixels: some outside the map, some under one pixel wide."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, batch, (num, 1), generator=gen).double()
    corner = torch.rand(num, 2, generator=gen, dtype=torch.float64) * torch.tensor(
        [width, height], dtype=torch.float64) * stride * 1.3 - 2 * stride
    size = torch.rand(num, 2, generator=gen, dtype=torch.float64) * 12 * stride
    size[: num // 8] *= 0.02  # sub-pixel boxes
    return torch.cat([index, corner, corner + size], 1)


def run(layer, feat, rois, weighting):
    feat = feat.detach().clone().requires_grad_()
    out = layer(feat, rois)
    (out * weighting).sum().backward()
    return out.detach(), feat.grad


CASES = [  # (batch, channels, H, W, stride, num rois, output size)
    (2, 8, 20, 24, 4, 40, 7),
    (3, 5, 9, 13, 8, 30, (5, 3)),
    (1, 16, 40, 40, 4, 20, 14),
]


@pytest.mark.parametrize('dtype,tol', [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize('case', CASES)
@pytest.mark.parametrize('sampling_ratio', [0, 1, 2])
@pytest.mark.parametrize('aligned', [True, False])
def test_values_and_gradients_equal_mmcv(dtype, tol, case, sampling_ratio, aligned):
    batch, channels, height, width, stride, num, size = case
    gen = torch.Generator().manual_seed(num + height)
    feat = torch.randn(batch, channels, height, width, generator=gen, dtype=torch.float64)
    feat = feat.to(dtype)
    rois = random_rois(num, batch, height, width, stride, seed=height).to(dtype)
    args = (size, 1 / stride, sampling_ratio, 'avg', aligned)
    out_hw = (size, size) if isinstance(size, int) else size
    weighting = torch.randn(num, channels, *out_hw, generator=gen, dtype=torch.float64).to(dtype)
    ref_out, ref_grad = run(RoIAlign(*args), feat, rois, weighting)
    out, grad = run(GatherRoIAlign(*args), feat, rois, weighting)
    assert out.shape == ref_out.shape and out.dtype == dtype
    assert ref_out.abs().max() > 0.1 and ref_grad.abs().max() > 0.1  # not a vacuous comparison
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, ref_grad, rtol=tol, atol=tol)


def test_channels_last_map_reads_the_same_values():
    """The map is read through its strides: a channels-last map (what XCiTBackbone(...,
    out_channels_last=True) feeds the neck) gives mmcv's values for the NCHW map."""
    gen = torch.Generator().manual_seed(0)
    feat = torch.randn(2, 8, 20, 24, generator=gen, dtype=torch.float64)
    rois = random_rois(30, 2, 20, 24, 4, seed=1)
    weighting = torch.randn(30, 8, 7, 7, generator=gen, dtype=torch.float64)
    ref_out, ref_grad = run(RoIAlign(7, 0.25, 2), feat, rois, weighting)
    out, grad = run(GatherRoIAlign(7, 0.25, 2),
                    feat.contiguous(memory_format=torch.channels_last), rois, weighting)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_no_rois_and_dtypes():
    feat = torch.randn(2, 4, 10, 10, requires_grad=True)
    out = GatherRoIAlign(7, 0.25, 2)(feat, feat.new_zeros(0, 5))
    assert out.shape == (0, 4, 7, 7)
    rois = torch.tensor([[0., 2, 3, 30, 25], [1, 0, 0, 39, 39]])
    for dtype in (torch.bfloat16, torch.float16):  # mmcv's CPU kernel only takes float32
        half = feat.detach().to(dtype).requires_grad_()
        out = GatherRoIAlign(7, 0.25, 2)(half, rois)
        out.float().sum().backward()
        assert out.dtype == dtype and half.grad.dtype == dtype
        reference = RoIAlign(7, 0.25, 2)(half.detach().float(), rois)
        torch.testing.assert_close(out.float(), reference, rtol=0.05, atol=0.05)


@pytest.mark.parametrize('kwargs,message', [
    (dict(pool_mode='max'), "pool_mode='avg' only"),
    (dict(sampling_ratio=-1), 'sampling_ratio must be an int >= 0'),
    (dict(use_torchvision=True), 'does not call torchvision'),
])
def test_unsupported_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GatherRoIAlign(7, **kwargs)


def test_inverted_boxes_are_an_error():
    with pytest.raises(ValueError, match='x2 < x1 or y2 < y1'):
        GatherRoIAlign(7, 0.25, 2)(torch.randn(1, 4, 10, 10), torch.tensor([[0., 20, 5, 10, 30]]))


EXTRACTOR = dict(
    roi_layer=dict(type='RoIAlign', output_size=7, sampling_ratio=2),
    out_channels=6,
    featmap_strides=[4, 8, 16, 32])


@pytest.mark.parametrize('sampling_ratio', [0, 2])
def test_extractor_equals_mmdet_single_roi_extractor(sampling_ratio):
    """Same level mapping, same features, same gradients for every FPN level."""
    cfg = dict(EXTRACTOR, roi_layer=dict(EXTRACTOR['roi_layer'], sampling_ratio=sampling_ratio))
    gen = torch.Generator().manual_seed(3)
    feats = [torch.randn(2, 6, 64 // s, 48 // s, generator=gen, dtype=torch.float64)
             for s in (1, 2, 4, 8)]
    # boxes of every size, so that all four levels get RoIs (mmdet: scale thresholds 112/224/448)
    rois = torch.cat([random_rois(40, 2, 64, 48, 4, seed=5), torch.tensor(
        [[0., 0, 0, 190, 250], [1, 3, 4, 150, 100], [0, 10, 10, 300, 400], [1, 0, 0, 500, 480]],
        dtype=torch.float64)])
    results = []
    for extractor in (SingleRoIExtractor(**cfg), GatherRoIExtractor(**cfg)):
        inputs = [f.clone().requires_grad_() for f in feats]
        out = extractor(inputs, rois)
        weighting = torch.randn(out.shape, generator=torch.Generator().manual_seed(4),
                                dtype=torch.float64)
        (out * weighting).sum().backward()
        results.append((out.detach(), [f.grad for f in inputs]))
    (ref_out, ref_grads), (out, grads) = results
    levels = SingleRoIExtractor(**cfg).map_roi_levels(rois, 4)
    assert set(levels.tolist()) == {0, 1, 2, 3}
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    for grad, ref_grad in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-10)


def test_extractor_builds_from_an_mmdet_config_and_rejects_other_layers():
    from mmdet.registry import MODELS
    extractor = MODELS.build(dict(EXTRACTOR, type='GatherRoIExtractor'))
    assert isinstance(extractor, GatherRoIExtractor)
    assert all(isinstance(layer, GatherRoIAlign) for layer in extractor.roi_layers)
    assert [layer.spatial_scale for layer in extractor.roi_layers] == [1 / 4, 1 / 8, 1 / 16, 1 / 32]
    with pytest.raises(ValueError, match='RoIAlign only'):
        GatherRoIExtractor(**dict(EXTRACTOR, roi_layer=dict(type='RoIPool', output_size=7)))
