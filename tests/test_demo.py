# Copyright (c) xcit_mm contributors. All rights reserved.
"""Tests of demo/image_demo.py: mmdet's demo command line, the config's model type picking
``DetInferencer`` or ``MMSegInferencer``, on the shapes configs with random-init weights.

No training: each shapes model is built from its config, its random-init weights are saved with
mmengine's ``save_checkpoint`` and the demo runs on generated images. What upstream's inferencers
lack and ``import xcit_mm`` adds on every load (a checkpoint of another task or model, or an
unsafe / broken file, is an error, never a silently random model) is checked here through the
demo: one ``error: ...`` line, exit status 2, nothing drawn.
"""
import json
import os
import os.path as osp
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DEMO = osp.join(ROOT, 'demo', 'image_demo.py')
DET_CFG = osp.join(ROOT, 'configs', 'shapes', 'mask_rcnn_xcit_shapes_coco.py')
SEG_CFG = osp.join(ROOT, 'configs', 'shapes', 'sem_fpn_xcit_shapes_ade.py')


@pytest.fixture(scope='module')
def demo(demo_tool):
    """demo/image_demo.py."""
    return demo_tool


def _save_random_checkpoint(config, path, with_meta, seed=0):
    """Build the config's model (random init) and save it as an mmengine checkpoint."""
    from mmengine.config import Config
    from mmengine.registry import MODELS, init_default_scope
    from mmengine.runner import save_checkpoint

    import xcit_mm  # noqa: F401
    cfg = Config.fromfile(config)
    init_default_scope(cfg.default_scope)
    if 'init_cfg' in cfg.model.backbone:
        cfg.model.backbone.init_cfg = None
    torch.manual_seed(seed)
    model = MODELS.build(cfg.model)
    model.init_weights()
    ckpt = {'state_dict': model.state_dict()}
    if with_meta:
        ckpt['meta'] = dict(epoch=1, dataset_meta=dict(classes=cfg.metainfo['classes']))
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
def det_ckpt(tmp_path_factory):
    return _save_random_checkpoint(DET_CFG, tmp_path_factory.mktemp('det') / 'det.pth', True)


@pytest.fixture(scope='module')
def seg_ckpt(tmp_path_factory):
    # No meta: MMSegInferencer then draws with Cityscapes' names and palette (upstream's choice).
    return _save_random_checkpoint(SEG_CFG, tmp_path_factory.mktemp('seg') / 'seg.pth', False)


def _one_error_line(capsys):
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith('error: '), err
    assert 'Traceback' not in err and '\x1b' not in err
    return lines[0]


# ---------------------------------------------------------------------------- both tasks
def test_detector_draws_images_and_writes_predictions(tmp_path, det_ckpt, demo, capsys):
    folder = tmp_path / 'imgs'
    folder.mkdir()
    a = _write_image(folder / 'a.png', 120, 150, 0)
    b = _write_image(folder / 'b.png', 97, 131, 1)
    (folder / 'notes.txt').write_text('not an image')  # DetInferencer lists image files only
    out = tmp_path / 'out'
    assert demo.main([str(folder), DET_CFG, '--weights', det_ckpt, '--out-dir', str(out),
                      '--device', 'cpu', '--pred-score-thr', '0.0']) == 0
    assert f'results have been saved at {out}' in capsys.readouterr().out
    for name, src in (('a', a), ('b', b)):
        drawn = np.asarray(Image.open(out / 'vis' / f'{name}.png').convert('RGB'))
        assert drawn.shape == src.shape, name  # same H x W as the input
        assert not np.array_equal(drawn, src), name  # boxes / masks are drawn over the image
        with open(out / 'preds' / f'{name}.json') as f:
            pred = json.load(f)
        assert len(pred['scores']) == len(pred['bboxes']) == len(pred['labels']) > 0
        assert set(pred['labels']) <= {0, 1, 2}  # the config's 3 classes
    assert sorted(os.listdir(out / 'vis')) == ['a.png', 'b.png']


def test_segmentor_draws_images_and_writes_label_maps(tmp_path, seg_ckpt, demo):
    src = _write_image(tmp_path / 'x.png', 101, 77, 3)
    out = tmp_path / 'out'
    assert demo.main([str(tmp_path / 'x.png'), SEG_CFG, '--weights', seg_ckpt, '--out-dir',
                      str(out), '--device', 'cpu']) == 0
    drawn = np.asarray(Image.open(out / 'vis' / 'x.png').convert('RGB'))
    assert drawn.shape == (101, 77, 3)
    assert not np.array_equal(drawn, src)  # the label map is overlaid
    label_map = np.asarray(Image.open(out / 'pred' / '00000000_pred.png'))
    assert label_map.shape == (101, 77) and label_map.max() < 4  # the config's 4 classes


@pytest.mark.parametrize('config, inferencer', [(DET_CFG, 'DetInferencer'),
                                                (SEG_CFG, 'MMSegInferencer')], ids=['det', 'seg'])
def test_the_config_picks_the_inferencer_which_holds_the_files_weights(
        config, inferencer, det_ckpt, seg_ckpt, demo):
    from mmdet.apis import DetInferencer
    from mmseg.apis import MMSegInferencer
    expected = {'DetInferencer': DetInferencer, 'MMSegInferencer': MMSegInferencer}[inferencer]
    ckpt = det_ckpt if config == DET_CFG else seg_ckpt
    built = demo.build_inferencer(config, ckpt, device='cpu')
    assert type(built) is expected
    saved = torch.load(ckpt, weights_only=True)['state_dict']
    own = built.model.state_dict()
    assert set(own) == set(saved)
    for key, value in own.items():
        torch.testing.assert_close(value, saved[key], msg=key)


# ---------------------------------------------------------------------------- bad input
def test_missing_or_wrong_arguments_are_one_error_line(tmp_path, det_ckpt, demo, capsys):
    _write_image(tmp_path / 'i.png', 40, 40, 5)
    image, out = str(tmp_path / 'i.png'), str(tmp_path / 'o')
    missing = str(tmp_path / 'missing.jpg')
    assert demo.main([missing, DET_CFG, '--out-dir', out]) == 2
    assert _one_error_line(capsys) == f'error: input not found: {missing!r}'
    missing_cfg = str(tmp_path / 'nope' / 'cfg.py')
    assert demo.main([image, missing_cfg, '--out-dir', out]) == 2
    assert _one_error_line(capsys) == f'error: config not found: {missing_cfg!r}'
    assert demo.main([image, det_ckpt, '--out-dir', out]) == 2  # a checkpoint as CONFIG
    assert 'is not a config file; give a checkpoint with --weights' in _one_error_line(capsys)
    classifier = tmp_path / 'classifier.py'
    classifier.write_text("default_scope = 'mmpretrain'\nmodel = dict(type='ImageClassifier')\n")
    assert demo.main([image, str(classifier), '--out-dir', out]) == 2
    assert "'ImageClassifier' (default_scope is 'mmpretrain') is neither an mmdet detector " \
        'nor an mmseg segmentor' in _one_error_line(capsys)
    assert not osp.exists(out)
    with pytest.raises(SystemExit):
        demo.main([image])  # no CONFIG


# ---------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize('config, other, task', [(DET_CFG, 'seg', 'segmentor'),
                                                 (SEG_CFG, 'det', 'detector')],
                         ids=['det_config', 'seg_config'])
def test_checkpoint_of_the_other_task_is_one_error_line(config, other, task, tmp_path, det_ckpt,
                                                        seg_ckpt, demo, capsys):
    _write_image(tmp_path / 'i.png', 48, 48, 6)
    ckpt = seg_ckpt if other == 'seg' else det_ckpt
    assert demo.main([str(tmp_path / 'i.png'), config, '--weights', ckpt, '--out-dir',
                      str(tmp_path / 'o')]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f'error: The checkpoint is a {task} checkpoint'), line
    assert f'use the config of the model the file was saved from (the {task} config' in line
    assert not (tmp_path / 'o').exists()  # nothing was drawn


def test_checkpoint_of_the_other_task_in_a_real_process(tmp_path, det_ckpt, seg_ckpt):
    """The command itself, as a user runs it: stderr is the one line, no traceback."""
    _write_image(tmp_path / 'i.png', 48, 48, 7)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES='', OMP_NUM_THREADS='1')
    proc = subprocess.run([sys.executable, DEMO, str(tmp_path / 'i.png'), DET_CFG, '--weights',
                           seg_ckpt, '--out-dir', str(tmp_path / 'o')], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr
    assert proc.stderr.startswith('error: The checkpoint is a segmentor checkpoint')
    assert not (tmp_path / 'o').exists()


def test_checkpoint_of_another_model_is_an_error(tmp_path, demo, capsys):
    """The backbone never stays at its random initialisation without an error naming keys."""
    _write_image(tmp_path / 'i.png', 40, 40, 5)
    other = tmp_path / 'other.pth'
    torch.save({'state_dict': {'foo.weight': torch.zeros(1)}}, other)
    assert demo.main([str(tmp_path / 'i.png'), SEG_CFG, '--weights', str(other), '--out-dir',
                      str(tmp_path / 'o')]) == 2
    line = _one_error_line(capsys)
    assert 'no weights for its XCiTBackbone' in line and 'foo.weight' in line


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


@pytest.mark.parametrize('kind, expected', [
    ('truncated', 'is truncated or corrupt'),
    ('pickled', 'Refusing to load checkpoint'),
    ('html', "is not a PyTorch checkpoint (it starts with '<!DOCTYPE ht"),
])
def test_bad_checkpoint_is_one_error_line(kind, expected, tmp_path, seg_ckpt, capsys, demo):
    bad = _bad_checkpoint(kind, tmp_path, seg_ckpt)
    _write_image(tmp_path / 'i.png', 48, 48, 6)
    assert demo.main([str(tmp_path / 'i.png'), SEG_CFG, '--weights', bad, '--out-dir',
                      str(tmp_path / 'o')]) == 2
    line = _one_error_line(capsys)
    assert bad in line and expected in line
    assert not (tmp_path / 'pwned').exists()  # the pickled payload never ran
    assert not (tmp_path / 'o').exists()  # nothing was drawn


def test_url_checkpoint_is_read_by_the_safe_reader(tmp_path, seg_ckpt, capsys, demo,
                                                   monkeypatch):
    """A URL is downloaded into the hub cache and read with weights_only like a local file:
    a good one draws, one with pickled code is refused and never run."""
    import shutil
    evil = _bad_checkpoint('pickled', tmp_path, seg_ckpt)
    served = {'http://example.invalid/ckpts/good_seg.pth': seg_ckpt,
              'http://example.invalid/ckpts/evil_seg.pth': evil}
    monkeypatch.setattr(torch.hub, 'get_dir', lambda: str(tmp_path / 'hub'))
    monkeypatch.setattr(torch.hub, 'download_url_to_file',
                        lambda url, dst, **kw: shutil.copyfile(served[url], dst))
    _write_image(tmp_path / 'i.png', 48, 48, 7)
    assert demo.main([str(tmp_path / 'i.png'), SEG_CFG, '--weights', 'http://example.invalid/'
                      'ckpts/good_seg.pth', '--out-dir', str(tmp_path / 'o')]) == 0
    assert (tmp_path / 'o' / 'vis' / 'i.png').exists()
    assert (tmp_path / 'hub' / 'checkpoints' / 'good_seg.pth').exists()
    capsys.readouterr()
    assert demo.main([str(tmp_path / 'i.png'), SEG_CFG, '--weights', 'http://example.invalid/'
                      'ckpts/evil_seg.pth', '--out-dir', str(tmp_path / 'o2')]) == 2
    line = _one_error_line(capsys)
    assert line.startswith('error: Refusing to load checkpoint') and 'evil_seg.pth' in line
    assert not (tmp_path / 'pwned').exists()
