# Copyright (c) xcit_mm contributors. All rights reserved.
"""Tests of tools/visualize_xca.py: capture shapes, input dependence, PNG size, errors."""
import math
import os.path as osp

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY = dict(embed_dims=64, depth=4, num_heads=4)
TINY_OUT = (0, 1, 2, 3)


@pytest.fixture(scope='module')
def tiny_backbone():
    from xcit_mm import XCiTBackbone
    torch.manual_seed(0)
    backbone = XCiTBackbone(arch=TINY, patch_size=16, out_indices=TINY_OUT)
    backbone.init_weights()
    return backbone.eval()


@pytest.fixture(scope='module')
def vx(xca_tool):
    """tools/visualize_xca.py (short name: it is used on almost every line)."""
    return xca_tool


def _tensor(vx, img):
    return vx.to_tensor(img, vx.IMAGENET_MEAN, vx.IMAGENET_STD, rgb=True)


def test_capture_shapes_odd_image_size(tiny_backbone, vx):
    """The capture dict has the documented shapes for an image that is no multiple of 16."""
    img = vx.resize_longer_side(vx.load_image('chelsea')[0], 131)
    h, w = img.shape[:2]
    assert (h, w) == (87, 131)  # 300x451 -> longer side 131
    hp, wp = math.ceil(h / 16), math.ceil(w / 16)
    heads, d = TINY['num_heads'], TINY['embed_dims'] // TINY['num_heads']
    with torch.no_grad(), tiny_backbone.capture_xca([1, -1]) as rec:
        tiny_backbone.forward_trunk(_tensor(vx, img))
    assert sorted(rec) == [1, 3]
    for layer in (1, 3):
        assert rec[layer]['grid'] == (hp, wp)
        assert rec[layer]['q'].shape == (1, heads, d, hp * wp)
        assert rec[layer]['k'].shape == (1, heads, d, hp * wp)
        assert rec[layer]['attn'].shape == (1, heads, d, d)
        # q-hat / k-hat are unit vectors along the tokens; attention rows are distributions.
        torch.testing.assert_close(rec[layer]['q'].norm(dim=-1), torch.ones(1, heads, d))
        torch.testing.assert_close(rec[layer]['attn'].sum(-1), torch.ones(1, heads, d))
    maps = vx.xca_maps(tiny_backbone, _tensor(vx, img), [1, 3])
    assert maps[3]['q_norm'].shape == (heads, hp, wp)
    assert maps[3]['k_norm'].shape == (heads, hp, wp)
    assert maps[3]['attn'].shape == (heads, d, d)
    # sum over tokens of |q-hat_n|^2 = sum over channels of 1 = d
    np.testing.assert_allclose((maps[3]['q_norm'] ** 2).sum(axis=(1, 2)), d, rtol=1e-4)


def test_maps_change_with_input(tiny_backbone, vx):
    """Two different photos give different norm maps; the same photo gives the same maps."""
    a = vx.resize_longer_side(vx.load_image('grace_hopper')[0], 96)
    b = vx.resize_longer_side(vx.load_image('astronaut')[0], 96)
    b = np.ascontiguousarray(b[:a.shape[0], :a.shape[1]])
    ma = vx.xca_maps(tiny_backbone, _tensor(vx, a), [0, 3])
    mb = vx.xca_maps(tiny_backbone, _tensor(vx, b), [0, 3])
    ma2 = vx.xca_maps(tiny_backbone, _tensor(vx, a), [0, 3])
    for layer in (0, 3):
        assert ma[layer]['q_norm'].shape == mb[layer]['q_norm'].shape
        for key in ('q_norm', 'k_norm', 'attn'):
            assert not np.allclose(ma[layer][key], mb[layer][key], atol=1e-4), (layer, key)
            np.testing.assert_allclose(ma[layer][key], ma2[layer][key], rtol=1e-5, atol=1e-6)


def test_cli_writes_grid_of_defined_size(tmp_path, capsys, vx):
    out = tmp_path / 'sub' / 'xca.png'
    rc = vx.main(['coffee', 'random', '--arch', 'n12', '--layers', '0', '-1', '--size', '80',
                  '--cell', '64', '--out', str(out)])
    assert rc == 0
    width, height = vx.figure_size(num_layers=2, num_heads=4, cell=64)
    assert (width, height) == (vx.LEFT_PX + 64 * 5, vx.TOP_PX + 64 * 6)
    png = Image.open(out)
    assert png.size == (width, height)
    arr = np.asarray(png.convert('RGB'))
    assert arr.std() > 10  # something was drawn
    assert f'{width}x{height}' in capsys.readouterr().out


def test_checkpoint_is_loaded(tmp_path, tiny_backbone, vx):
    """A checkpoint (mmengine layout, backbone. prefix) gives the maps of the saved model."""
    from mmengine.runner import save_checkpoint
    state = {f'backbone.{k}': v for k, v in tiny_backbone.state_dict().items()}
    ckpt = str(tmp_path / 'det.pth')
    save_checkpoint({'state_dict': state, 'meta': dict(epoch=1)}, ckpt)
    loaded, pre = vx.build_backbone(ckpt, arch=TINY, patch_size=16)
    assert pre['rgb'] and tuple(pre['mean']) == vx.IMAGENET_MEAN
    img = vx.load_image('chelsea')[0][:64, :80]
    ref = vx.xca_maps(tiny_backbone, _tensor(vx, img), [2])
    got = vx.xca_maps(loaded, _tensor(vx, img), [2])
    np.testing.assert_allclose(got[2]['q_norm'], ref[2]['q_norm'], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2]['attn'], ref[2]['attn'], rtol=1e-5, atol=1e-6)
    # A different random init gives different maps: the checkpoint really was used.
    other, _ = vx.build_backbone('random', arch=TINY, patch_size=16)
    assert not np.allclose(vx.xca_maps(other, _tensor(vx, img), [2])[2]['q_norm'],
                           ref[2]['q_norm'], atol=1e-4)


def test_config_model(tmp_path, vx):
    """A config gives its backbone (SyncBN made BN) and its data_preprocessor statistics."""
    cfg = tmp_path / 'cfg.py'
    cfg.write_text(
        "model = dict(type='EncoderDecoder',\n"
        "    data_preprocessor=dict(mean=[1., 2., 3.], std=[4., 5., 6.], bgr_to_rgb=True),\n"
        f"    backbone=dict(type='XCiTBackbone', arch={TINY!r}, patch_size=8,\n"
        f"                  out_indices={TINY_OUT!r}, norm_cfg=dict(type='SyncBN')))\n")
    backbone, pre = vx.build_backbone(str(cfg))
    assert backbone.patch_size == 8 and backbone.num_layers == 4
    assert not any('SyncBatchNorm' in type(m).__name__ for m in backbone.modules())
    assert pre == dict(mean=(1., 2., 3.), std=(4., 5., 6.), rgb=True)
    maps = vx.xca_maps(backbone, torch.randn(1, 3, 40, 56), [3])
    assert maps[3]['grid'] == (5, 7)

    cfg.write_text(cfg.read_text().replace(
        "norm_cfg=dict(type='SyncBN')",
        "init_cfg=dict(type='Pretrained', checkpoint='missing/xcit.pth')"))
    with pytest.raises(FileNotFoundError, match='--checkpoint'):
        vx.build_backbone(str(cfg))


def test_bad_inputs(tmp_path, capsys, vx):
    bad = tmp_path / 'broken.jpg'
    bad.write_bytes(b'this is not a jpeg')
    with pytest.raises(ValueError, match='broken.jpg'):
        vx.load_image(str(bad))
    assert vx.main([str(bad), 'random', '--arch', 'n12', '--out',
                    str(tmp_path / 'x.png')]) == 2
    assert 'broken.jpg' in capsys.readouterr().err
    assert not (tmp_path / 'x.png').exists()
    with pytest.raises(FileNotFoundError, match='nope.png'):
        vx.load_image(str(tmp_path / 'nope.png'))
    with pytest.raises(ValueError, match='out of range'):
        vx.resolve_layers([12], 12)
    assert vx.resolve_layers(None, 12) == [0, 5, 11]
    assert vx.resolve_layers([-1, 0], 24) == [23, 0]
