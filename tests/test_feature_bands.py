"""XCiT's levels made by rows (``XCiTBackbone.level_rows``, which the stream's FPN reads) and the
context of a row-local conv (``conv_halo``).

Expected values come from the whole-tensor path, ``XCiTBackbone.forward_level``. A band's
convolutions have other sizes than the whole map's, so values agree up to float rounding, not bit
for bit. (``LeanMaskRCNN``'s whole-path bands, ``test_cfg.band_mb`` with mode='whole', went into
the stream: band_mb is now the stream's band size, tested in ``test_stream_detection.py``.)
"""
import pytest
import torch
from mmcv.cnn import ConvModule
from mmengine.registry import init_default_scope
from torch import nn

import xcit_mm  # noqa: F401  (registers XCiTBackbone)
from mmdet.registry import MODELS
from xcit_mm.models.inference.row_stream import TensorRows, conv_halo


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


@pytest.mark.parametrize('value', [0, -4, '64', True])
def test_a_bad_band_mb_is_an_error_naming_the_fix(value):
    """The stream's ``band_mb`` checked as it is read, the fix named."""
    from xcit_mm.models.inference.settings import DetectorSettings
    with pytest.raises(ValueError, match='band_mb must be a positive number of MB'):
        DetectorSettings.from_cfg(dict(band_mb=value, mode='stream'))
    assert DetectorSettings.from_cfg(dict(band_mb=64, mode='stream')).band_mb == 64
