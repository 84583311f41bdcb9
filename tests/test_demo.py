# Copyright (c) xcit_mm contributors. All rights reserved.
"""Tests of demo/image_demo.py and xcit_mm.apis on the shapes configs with random-init weights.

No training: each shapes model is built from its config, its random-init weights are saved with
mmengine's ``save_checkpoint`` and the demo runs on generated images.
"""
import glob
import os.path as osp

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


@pytest.fixture(scope='module')
def demo(demo_tool):
    """demo/image_demo.py."""
    return demo_tool


def _shapes_config(scope):
    """The first configs/shapes/*.py whose default_scope is ``scope``."""
    from mmengine.config import Config
    for path in sorted(glob.glob(osp.join(ROOT, 'configs', 'shapes', '*.py'))):
        if Config.fromfile(path).get('default_scope') == scope:
            return path
    raise AssertionError(f'no configs/shapes/*.py with default_scope={scope!r}')


def _save_random_checkpoint(config, path, with_meta, seed=0):
    """Build the config's model (random init) and save it as an mmengine checkpoint."""
    from mmengine.config import Config
    from mmengine.registry import MODELS, init_default_scope
    from mmengine.runner import save_checkpoint

    import xcit_mm  # noqa: F401
    from xcit_mm.datasets import CLASSES
    cfg = Config.fromfile(config)
    init_default_scope(cfg.default_scope)
    if 'init_cfg' in cfg.model.backbone:
        cfg.model.backbone.init_cfg = None
    torch.manual_seed(seed)
    model = MODELS.build(cfg.model)
    model.init_weights()
    ckpt = {'state_dict': model.state_dict()}
    if with_meta:
        ckpt['meta'] = dict(epoch=1, dataset_meta=dict(classes=CLASSES))
    save_checkpoint(ckpt, str(path))
    return str(path)


def _write_image(path, h, w, seed):
    """A shapes-like picture: a gradient with a few flat discs and squares."""
    rng = np.random.RandomState(seed)
    yy, xx = np.mgrid[:h, :w]
    img = np.stack([yy * 200 // h, xx * 200 // w, np.full((h, w), 90)], -1).astype(np.uint8)
    for _ in range(3):
        cy, cx, r = rng.randint(10, h - 10), rng.randint(10, w - 10), rng.randint(6, 20)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 < r * r] = rng.randint(0, 256, 3)
        img[max(0, cy - r):cy, max(0, cx - r):cx] = rng.randint(0, 256, 3)
    Image.fromarray(img).save(path)
    return img


@pytest.fixture(scope='module')
def det_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('det')
    config = _shapes_config('mmdet')
    return config, _save_random_checkpoint(config, tmp / 'det.pth', with_meta=True)


@pytest.fixture(scope='module')
def seg_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp('seg')
    config = _shapes_config('mmseg')
    # No meta: class names must then come from the config's dataset metainfo.
    return config, _save_random_checkpoint(config, tmp / 'seg.pth', with_meta=False)


def test_detector_folder_and_files(tmp_path, det_setup, capsys, demo):
    config, ckpt = det_setup
    folder = tmp_path / 'imgs'
    folder.mkdir()
    a = _write_image(folder / 'a.png', 120, 150, 0)
    b = _write_image(folder / 'b.jpg', 97, 131, 1)
    (folder / 'notes.txt').write_text('not an image')  # ignored inside folders
    c = _write_image(tmp_path / 'a.png', 64, 200, 2)  # same stem as folder/a.png
    out = tmp_path / 'out'
    rc = demo.main([str(folder), str(tmp_path / 'a.png'), config, ckpt, '--out-dir', str(out),
                    '--device', 'cpu', '--score-thr', '0.0'])
    assert rc == 0
    assert 'skipped 1 non-image' in capsys.readouterr().err
    for name, src in (('a.png', a), ('b.png', b), ('a_1.png', c)):
        png = np.asarray(Image.open(out / name).convert('RGB'))
        assert png.shape == src.shape, name  # same H x W as the input
    # score-thr 0 on a random detector: boxes / masks are drawn over the image
    assert not np.array_equal(np.asarray(Image.open(out / 'a.png').convert('RGB')), a)
    # nothing reaches the threshold: the user is told, and the plain image is still written
    assert demo.main([str(tmp_path / 'a.png'), config, ckpt, '--out-dir', str(tmp_path / 'o2'),
                      '--score-thr', '1.0']) == 0
    assert 'no detection reached --score-thr 1.0' in capsys.readouterr().err
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / 'o2' / 'a.png')), c)


def test_segmentor_and_class_names(tmp_path, seg_setup, demo):
    from xcit_mm.apis import config_task, init_model
    from xcit_mm.datasets import CLASSES
    config, ckpt = seg_setup
    model = init_model(config, ckpt, device='cpu')
    assert config_task(model.cfg) == 'seg'
    assert tuple(model.dataset_meta['classes'])[-len(CLASSES):] == CLASSES
    # the weights are those of the file (strict load), not a fresh init
    saved = torch.load(ckpt, weights_only=True)['state_dict']
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, saved[key], msg=key)
    src = _write_image(tmp_path / 'x.jpg', 101, 77, 3)
    out = tmp_path / 'out'
    assert demo.main([str(tmp_path / 'x.jpg'), config, ckpt, '--out-dir', str(out),
                      '--device', 'cpu', '--no-progress']) == 0
    png = np.asarray(Image.open(out / 'x.png').convert('RGB'))
    assert png.shape == (101, 77, 3)
    assert not np.array_equal(png, src)  # the label map is overlaid


def test_unreadable_images_are_reported(tmp_path, seg_setup, capsys, demo):
    config, ckpt = seg_setup
    folder = tmp_path / 'imgs'
    folder.mkdir()
    _write_image(folder / 'good.png', 64, 64, 4)
    (folder / 'broken.jpg').write_bytes(b'\x00\x01 not a jpeg')
    empty = tmp_path / 'empty.png'
    empty.write_bytes(b'')
    out = tmp_path / 'out'
    rc = demo.main([str(folder), str(empty), config, ckpt, '--out-dir', str(out)])
    err = capsys.readouterr().err
    assert rc == 1
    assert 'broken.jpg' in err and 'empty.png' in err and '2 input(s) could not be read' in err
    assert (out / 'good.png').exists()  # the readable image was still drawn
    assert not (out / 'broken.png').exists()


def test_argument_errors(tmp_path, seg_setup, capsys, demo):
    config, ckpt = seg_setup
    # a missing input is reported before any model is built
    assert demo.main([str(tmp_path / 'missing.jpg'), config, ckpt, '--out-dir',
                      str(tmp_path)]) == 2
    assert 'missing.jpg' in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main([config, ckpt, '--out-dir', str(tmp_path)])  # no IMAGE
    with pytest.raises(SystemExit):
        demo.main([str(tmp_path), ckpt, config, '--out-dir', str(tmp_path)])  # swapped
    assert 'swapped' in capsys.readouterr().err
    _write_image(tmp_path / 'i.png', 40, 40, 5)
    missing_cfg = str(tmp_path / 'nope' / 'cfg.py')
    assert demo.main([str(tmp_path / 'i.png'), missing_cfg, ckpt, '--out-dir',
                      str(tmp_path / 'o')]) == 2
    assert capsys.readouterr().err.strip() == f'error: config not found: {missing_cfg!r}'


# ------------------------------------------------------------------------ checkpoints (16.4)
class _Payload:
    """Unpickling this runs code (creates ``marker``): it must never happen."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def _bad_checkpoint(kind, tmp_path, good):
    """A file at ``tmp_path/<kind>.pth``: truncated, with pickled code, or an HTML page."""
    path = tmp_path / f'{kind}.pth'
    if kind == 'truncated':
        data = open(good, 'rb').read()
        path.write_bytes(data[:len(data) // 2])
    elif kind == 'pickled':
        state = torch.load(good, weights_only=True)
        state['hook'] = _Payload(str(tmp_path / 'pwned'))
        torch.save(state, path)
    else:
        path.write_text('<!DOCTYPE html>\n<html><head><title>404 Not Found</title></head>'
                        '<body>The requested URL was not found.</body></html>\n')
    return str(path)


@pytest.fixture
def no_model_build(monkeypatch):
    """Building a detector or segmentor fails the test: errors must come before it."""
    import mmdet.apis
    import mmseg.apis

    def built(*args, **kwargs):
        raise AssertionError('the model was built before the checkpoint was checked')

    monkeypatch.setattr(mmdet.apis, 'init_detector', built)
    monkeypatch.setattr(mmseg.apis, 'init_model', built)


@pytest.mark.parametrize('kind, expected', [
    ('truncated', 'is truncated or corrupt'),
    ('pickled', 'Refusing to load checkpoint'),
    ('html', "is not a PyTorch checkpoint (it starts with '<!DOCTYPE ht"),
])
def test_bad_checkpoint_is_one_error_line_exit_2_before_the_model(
        kind, expected, tmp_path, seg_setup, capsys, demo, no_model_build):
    config, good = seg_setup
    bad = _bad_checkpoint(kind, tmp_path, good)
    _write_image(tmp_path / 'i.png', 48, 48, 6)
    rc = demo.main([str(tmp_path / 'i.png'), config, bad, '--out-dir', str(tmp_path / 'o'),
                    '--no-progress'])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith('error: ') and bad in lines[0] and expected in lines[0]
    assert '\x1b' not in err and 'Traceback' not in err
    assert not (tmp_path / 'pwned').exists()  # the pickled payload never ran
    assert not (tmp_path / 'o').exists()  # nothing was drawn


def test_url_checkpoint_is_read_by_the_safe_reader(tmp_path, seg_setup, capsys, demo,
                                                   monkeypatch):
    """A URL is downloaded into the hub cache and read with weights_only like a local file:
    a good one draws, one with pickled code is refused and never run."""
    import shutil
    config, good = seg_setup
    evil = _bad_checkpoint('pickled', tmp_path, good)
    served = {'http://example.invalid/ckpts/good_seg.pth': good,
              'http://example.invalid/ckpts/evil_seg.pth': evil}
    monkeypatch.setattr(torch.hub, 'get_dir', lambda: str(tmp_path / 'hub'))
    monkeypatch.setattr(torch.hub, 'download_url_to_file',
                        lambda url, dst, **kw: shutil.copyfile(served[url], dst))
    _write_image(tmp_path / 'i.png', 48, 48, 7)
    assert demo.main([str(tmp_path / 'i.png'), config, 'http://example.invalid/ckpts/'
                      'good_seg.pth', '--out-dir', str(tmp_path / 'o'), '--no-progress']) == 0
    assert (tmp_path / 'o' / 'i.png').exists()
    assert (tmp_path / 'hub' / 'checkpoints' / 'good_seg.pth').exists()
    capsys.readouterr()
    assert demo.main([str(tmp_path / 'i.png'), config, 'http://example.invalid/ckpts/'
                      'evil_seg.pth', '--out-dir', str(tmp_path / 'o2')]) == 2
    err = capsys.readouterr().err
    assert err.startswith('error: Refusing to load checkpoint') and 'evil_seg.pth' in err
    assert not (tmp_path / 'pwned').exists()


def test_checkpoint_of_another_model_is_an_error(tmp_path, seg_setup, capsys, demo):
    """Loading is strict: no weight left at its random init without an error naming keys."""
    config, good = seg_setup
    _write_image(tmp_path / 'i.png', 40, 40, 5)
    other = tmp_path / 'other.pth'
    torch.save({'state_dict': {'foo.weight': torch.zeros(1)}}, other)
    assert demo.main([str(tmp_path / 'i.png'), config, str(other), '--out-dir',
                      str(tmp_path / 'o')]) == 2
    err = capsys.readouterr().err
    assert str(other) in err and 'no weights for its XCiTBackbone' in err and 'foo.weight' in err
    # a checkpoint without its decode head: the head would silently stay random
    state = torch.load(good, weights_only=True)
    state['state_dict'] = {k: v for k, v in state['state_dict'].items()
                           if not k.startswith('decode_head.conv_seg')}
    headless = tmp_path / 'headless.pth'
    torch.save(state, headless)
    assert demo.main([str(tmp_path / 'i.png'), config, str(headless), '--out-dir',
                      str(tmp_path / 'o')]) == 2
    err = capsys.readouterr().err
    assert 'model weights are not in the file' in err and 'decode_head.conv_seg.weight' in err
