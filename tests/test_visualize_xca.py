# Copyright (c) xcit_mm contributors. All rights reserved.
"""Tests of xcit_mm.visualization.xca and tools/analysis_tools/visualize_xca.py: capture
shapes, input dependence, PNG size and title, checkpoints, errors."""
import math
import os.path as osp

import numpy as np
import pytest
import torch
from PIL import Image

from xcit_mm.apis import error_line, init_backbone
from xcit_mm.visualization import xca as vx

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
TINY = dict(embed_dims=64, depth=4, num_heads=4)
TINY_OUT = (0, 1, 2, 3)
# ImageNet's mean and std in 0-255 RGB, mmdet's and mmseg's defaults
IMAGENET_MEAN = (123.675, 116.28, 103.53)
IMAGENET_STD = (58.395, 57.12, 57.375)


@pytest.fixture(scope='module')
def tiny_backbone():
    from xcit_mm import XCiTBackbone
    torch.manual_seed(0)
    backbone = XCiTBackbone(arch=TINY, patch_size=16, out_indices=TINY_OUT)
    backbone.init_weights()
    return backbone.eval()


@pytest.fixture(scope='module')
def cli(xca_tool):
    """tools/analysis_tools/visualize_xca.py."""
    return xca_tool


def _tensor(img):
    return vx.to_tensor(img, IMAGENET_MEAN, IMAGENET_STD, rgb=True)


def test_capture_shapes_odd_image_size(tiny_backbone):
    """The capture dict has the documented shapes for an image that is no multiple of 16."""
    img = vx.resize_longer_side(vx.load_image('chelsea')[0], 131)
    h, w = img.shape[:2]
    assert (h, w) == (87, 131)  # 300x451 -> longer side 131
    hp, wp = math.ceil(h / 16), math.ceil(w / 16)
    heads, d = TINY['num_heads'], TINY['embed_dims'] // TINY['num_heads']
    with torch.no_grad(), tiny_backbone.capture_xca([1, -1]) as rec:
        tiny_backbone.forward_trunk(_tensor(img))
    assert sorted(rec) == [1, 3]
    for layer in (1, 3):
        assert rec[layer]['grid'] == (hp, wp)
        assert rec[layer]['q'].shape == (1, heads, d, hp * wp)
        assert rec[layer]['k'].shape == (1, heads, d, hp * wp)
        assert rec[layer]['attn'].shape == (1, heads, d, d)
        # q-hat / k-hat are unit vectors along the tokens; attention rows are distributions.
        torch.testing.assert_close(rec[layer]['q'].norm(dim=-1), torch.ones(1, heads, d))
        torch.testing.assert_close(rec[layer]['attn'].sum(-1), torch.ones(1, heads, d))
    maps = vx.xca_maps(tiny_backbone, _tensor(img), [1, 3])
    assert maps[3]['q_norm'].shape == (heads, hp, wp)
    assert maps[3]['k_norm'].shape == (heads, hp, wp)
    assert maps[3]['attn'].shape == (heads, d, d)
    # sum over tokens of |q-hat_n|^2 = sum over channels of 1 = d
    np.testing.assert_allclose((maps[3]['q_norm'] ** 2).sum(axis=(1, 2)), d, rtol=1e-4)


def test_maps_change_with_input(tiny_backbone):
    """Two different photos give different norm maps; the same photo gives the same maps."""
    a = vx.resize_longer_side(vx.load_image('grace_hopper')[0], 96)
    b = vx.resize_longer_side(vx.load_image('astronaut')[0], 96)
    b = np.ascontiguousarray(b[:a.shape[0], :a.shape[1]])
    ma = vx.xca_maps(tiny_backbone, _tensor(a), [0, 3])
    mb = vx.xca_maps(tiny_backbone, _tensor(b), [0, 3])
    ma2 = vx.xca_maps(tiny_backbone, _tensor(a), [0, 3])
    for layer in (0, 3):
        assert ma[layer]['q_norm'].shape == mb[layer]['q_norm'].shape
        for key in ('q_norm', 'k_norm', 'attn'):
            assert not np.allclose(ma[layer][key], mb[layer][key], atol=1e-4), (layer, key)
            np.testing.assert_allclose(ma[layer][key], ma2[layer][key], rtol=1e-5, atol=1e-6)


def test_cli_writes_grid_of_defined_size(tmp_path, capsys, cli):
    out = tmp_path / 'sub' / 'xca.png'
    rc = cli.main(['coffee', 'random', '--arch', 'n12', '--layers', '0', '-1', '--size', '80',
                   '--cell', '64', '--out', str(out)])
    assert rc == 0
    # docs/visualisation.md: 110 + cell * (1 + heads) wide, 70 + cell * 3 * layers high
    width, height = 110 + 64 * (1 + 4), 70 + 64 * 3 * 2
    png = Image.open(out)
    assert png.size == (width, height)
    arr = np.asarray(png.convert('RGB'))
    assert arr.std() > 10  # something was drawn
    assert f'({width} px wide, {height} px high)' in capsys.readouterr().out


def test_title_gives_image_and_patch_grid_both_as_hxw(tmp_path, capsys, cli):
    """16.7: the image was printed W x H and the grid H x W; both are H x W now, and say so."""
    out = tmp_path / 'xca.png'
    assert cli.main(['chelsea', 'random', '--arch', 'n12', '--layers', '0', '--size', '131',
                     '--cell', '48', '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    # chelsea resized: 87 rows x 131 columns -> a 6 x 9 grid of 16 px patches (H x W)
    expected = ('XCA of random-init n12/16 on chelsea: image 87x131 px, patch grid 6x9 '
                '(both HxW)')
    assert Image.open(out).info['Title'] == expected  # the title drawn in the figure
    assert expected in printed
    assert '131x87' not in printed and '9x6' not in printed
    fig = vx.visualize_xca('chelsea', 'random', str(tmp_path / 'b.png'), arch='n12',
                           layers=[0], size=131, cell=48)
    assert fig.image_hw == (87, 131) and fig.grid_hw == (6, 9) and fig.title == expected
    assert fig.maps[0]['q_norm'].shape == (4, 6, 9)


def test_wrong_arch_is_an_argparse_error_with_the_choices(tmp_path, capsys, cli):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(['coffee', 'random', '--arch', 'x99', '--out', str(tmp_path / 'x.png')])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --arch: invalid choice: 'x99'" in err
    for arch in ('n12', 't12', 't24', 's12', 's24', 'm24', 'l24'):
        assert repr(arch) in err
    assert not (tmp_path / 'x.png').exists()


def test_missing_config_is_named(tmp_path, capsys, cli):
    missing = str(tmp_path / 'no' / 'cfg.py')
    assert cli.main(['coffee', missing, '--out', str(tmp_path / 'x.png')]) == 2
    assert capsys.readouterr().err == f'error: config not found: {missing!r}\n'


def test_checkpoint_is_loaded(tmp_path, tiny_backbone):
    """An mmengine training checkpoint (backbone. prefix, message hub with HistoryBuffers and
    numpy values) is accepted and gives the maps of the saved model."""
    from mmengine.logging import MessageHub
    from mmengine.runner import save_checkpoint
    hub = MessageHub.get_instance('xcit_mm_test_vis_hub')
    hub.update_scalar('train/loss', np.float64(0.5))
    hub.update_info('iter', 3)
    state = {f'backbone.{k}': v for k, v in tiny_backbone.state_dict().items()}
    ckpt = str(tmp_path / 'iter_3.pth')
    save_checkpoint({'state_dict': state, 'meta': dict(epoch=1, iter=3),
                     'message_hub': hub.state_dict()}, ckpt)
    loaded, pre = init_backbone(ckpt, arch=TINY, patch_size=16)
    assert pre['rgb'] and tuple(pre['mean']) == IMAGENET_MEAN
    img = vx.load_image('chelsea')[0][:64, :80]
    ref = vx.xca_maps(tiny_backbone, _tensor(img), [2])
    got = vx.xca_maps(loaded, _tensor(img), [2])
    np.testing.assert_allclose(got[2]['q_norm'], ref[2]['q_norm'], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2]['attn'], ref[2]['attn'], rtol=1e-5, atol=1e-6)
    # every tensor the saved model's: the checkpoint really was used
    saved = tiny_backbone.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items())


def test_config_model(tmp_path):
    """A config gives its backbone (SyncBN made BN) and its data_preprocessor statistics."""
    from xcit_mm.models.utils.checkpoint_io import CheckpointError
    cfg = tmp_path / 'cfg.py'
    cfg.write_text(
        "model = dict(type='EncoderDecoder',\n"
        "    data_preprocessor=dict(mean=[1., 2., 3.], std=[4., 5., 6.], bgr_to_rgb=True),\n"
        f"    backbone=dict(type='XCiTBackbone', arch={TINY!r}, patch_size=8,\n"
        f"                  out_indices={TINY_OUT!r}, norm_cfg=dict(type='SyncBN')))\n")
    backbone, pre = init_backbone(str(cfg))
    assert backbone.patch_size == 8 and backbone.num_layers == 4
    assert not any('SyncBatchNorm' in type(m).__name__ for m in backbone.modules())
    assert pre == dict(mean=(1., 2., 3.), std=(4., 5., 6.), rgb=True)
    maps = vx.xca_maps(backbone, torch.randn(1, 3, 40, 56), [3])
    assert maps[3]['grid'] == (5, 7)

    cfg.write_text(cfg.read_text().replace(
        "norm_cfg=dict(type='SyncBN')",
        "init_cfg=dict(type='Pretrained', checkpoint='missing/xcit.pth')"))
    with pytest.raises(CheckpointError, match=r'missing/xcit\.pth.*--checkpoint PATH'):
        init_backbone(str(cfg))
    # --checkpoint replaces the config's init_cfg
    torch.save({'state_dict': backbone.state_dict()}, tmp_path / 'bb.pth')
    loaded, _ = init_backbone(str(cfg), checkpoint=str(tmp_path / 'bb.pth'))
    saved = backbone.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in loaded.state_dict().items())


# ------------------------------------------------------------------------ checkpoints (16.7)
class _Payload:
    """Unpickling this runs code (creates ``marker``): it must never happen."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


class _Fraction:
    """A harmless, non-tensor object: torch's refusal of it carries ANSI bold codes."""

    def __reduce__(self):
        import fractions
        return (fractions.Fraction, (1, 3))


@pytest.fixture
def no_backbone_build(monkeypatch):
    """Building an XCiTBackbone fails the test: checkpoint errors must come before it."""
    import xcit_mm
    import xcit_mm.models

    def built(*args, **kwargs):
        raise AssertionError('the backbone was built before the checkpoint was checked')

    for module in (xcit_mm, xcit_mm.models):
        monkeypatch.setattr(module, 'XCiTBackbone', built)


@pytest.mark.parametrize('kind, expected', [
    ('pickled_code', 'Refusing to load checkpoint'),
    ('pickled_object', 'Refusing to load checkpoint'),
    ('truncated', 'is truncated or corrupt'),
    ('html', 'is not a PyTorch checkpoint'),
])
def test_bad_checkpoint_is_one_clean_error_line(kind, expected, tmp_path, tiny_backbone, capsys,
                                                cli, no_backbone_build):
    """No ANSI codes, one line naming the file, exit 2, before the backbone is built; the
    refusal does not claim that mmengine training checkpoints are refused (they load: see
    test_checkpoint_is_loaded)."""
    path = tmp_path / f'{kind}.pth'
    state = {'state_dict': {f'backbone.{k}': v for k, v in tiny_backbone.state_dict().items()}}
    if kind == 'pickled_code':
        torch.save(dict(state, hook=_Payload(str(tmp_path / 'pwned'))), path)
    elif kind == 'pickled_object':
        torch.save(dict(state, extra=_Fraction()), path)
        with pytest.raises(Exception, match='\x1b\\['):  # what torch itself would say
            torch.load(path, weights_only=True)
    elif kind == 'truncated':
        torch.save(state, path)
        path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
    else:
        path.write_text('<html><body><h1>403 Forbidden</h1></body></html>\n')
    rc = cli.main(['coffee', str(path), '--arch', 'n12', '--size', '64',
                   '--out', str(tmp_path / 'x.png')])
    err = capsys.readouterr().err
    assert rc == 2
    assert '\x1b' not in err
    assert len(err.splitlines()) == 1 and err.startswith('error: '), err
    assert str(path) in err and expected in err
    assert 'training checkpoints (optimizer, message hub) are like this' not in err
    assert not (tmp_path / 'pwned').exists() and not (tmp_path / 'x.png').exists()


def test_error_line_strips_escape_codes_and_newlines():
    msg = error_line(RuntimeError('Weights only load failed. \x1b[1mdo those steps only if '
                                  'you trust the source\x1b[0m.\n\t(1) re-run\n'))
    assert msg == 'error: Weights only load failed. do those steps only if you trust the ' \
                  'source. (1) re-run'


def test_bad_inputs(tmp_path, capsys, cli):
    bad = tmp_path / 'broken.jpg'
    bad.write_bytes(b'this is not a jpeg')
    with pytest.raises(ValueError, match='broken.jpg'):
        vx.load_image(str(bad))
    assert cli.main([str(bad), 'random', '--arch', 'n12', '--out',
                     str(tmp_path / 'x.png')]) == 2
    assert 'broken.jpg' in capsys.readouterr().err
    assert not (tmp_path / 'x.png').exists()
    with pytest.raises(FileNotFoundError, match='nope.png'):
        vx.load_image(str(tmp_path / 'nope.png'))
    with pytest.raises(ValueError, match='out of range'):
        vx.resolve_layers([12], 12)
    assert vx.resolve_layers(None, 12) == [0, 5, 11]
    assert vx.resolve_layers([-1, 0], 24) == [23, 0]
    assert vx.resolve_layers([1, -11, 3, -1], 12) == [1, 3, 11]  # each layer once, in order
    with pytest.raises(SystemExit):
        cli.main(['coffee', 'random', '--cell', '16', '--out', str(tmp_path / 'x.png')])
    assert '--cell must be at least 32 px' in capsys.readouterr().err
