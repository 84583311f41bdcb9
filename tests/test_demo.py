# Copyright (c) xcit_mm contributors. All rights reserved.
"""Tests of tools/demo.py on the shapes configs with random-init checkpoints.

No training: each shapes model is built from its config, its random-init weights are saved with
mmengine's ``save_checkpoint`` and the demo runs on generated images.
"""
import glob
import os.path as osp

import numpy as np
import pytest
from PIL import Image

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


@pytest.fixture(scope='module')
def demo(demo_tool):
    """tools/demo.py."""
    return demo_tool


def _shapes_config(scope):
    """The first configs/shapes/*.py whose default_scope is ``scope``."""
    from mmengine.config import Config
    for path in sorted(glob.glob(osp.join(ROOT, 'configs', 'shapes', '*.py'))):
        if Config.fromfile(path).get('default_scope') == scope:
            return path
    raise AssertionError(f'no configs/shapes/*.py with default_scope={scope!r}')


def _save_random_checkpoint(config, path, with_meta):
    """Build the config's model (random init) and save it as an mmengine checkpoint."""
    import torch
    from mmengine.config import Config
    from mmengine.registry import MODELS, init_default_scope
    from mmengine.runner import save_checkpoint

    import xcit_mm  # noqa: F401
    from xcit_mm.datasets import CLASSES
    cfg = Config.fromfile(config)
    init_default_scope(cfg.default_scope)
    if 'init_cfg' in cfg.model.backbone:
        cfg.model.backbone.init_cfg = None
    torch.manual_seed(0)
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
    from xcit_mm.datasets import CLASSES
    config, ckpt = seg_setup
    model, task = demo.init_model(config, ckpt, device='cpu')
    assert task == 'seg'
    assert tuple(model.dataset_meta['classes'])[-len(CLASSES):] == CLASSES
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
    other = tmp_path / 'other.pth'
    import torch
    torch.save({'state_dict': {'foo.weight': torch.zeros(1)}}, other)
    _write_image(tmp_path / 'i.png', 40, 40, 5)
    assert demo.main([str(tmp_path / 'i.png'), config, str(other), '--out-dir',
                      str(tmp_path / 'o')]) == 2
    assert 'no weights for this model' in capsys.readouterr().err
