"""Our configs on mmdet's / mmseg's own tools (what ``mim train`` / ``mim test`` run), and the
checkpoints they write in the upstream inference APIs.

A checkpoint trained with one tool tests with the other: the detector is trained by mmdet's
``tools/train.py`` (shipped inside the installed package) on a fresh data root, which the shapes
dataset generates on first use, and tested by ours; the segmentor is trained by ours and tested by
mmseg's. Both checkpoints open in the upstream APIs under torch's ``weights_only`` loading, with
the class names of the data they were trained on (``dataset_meta``), not COCO's or Cityscapes'.
"""
import os
import os.path as osp
import re
import subprocess
import sys

import pytest
import torch
from test_reliability import ENV, _tiny_config, shapes_data  # noqa: F401  (module fixture)

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
SHAPES_CLASSES = ('circle', 'square', 'triangle')


def _upstream_tool(package: str, name: str) -> str:
    module = __import__(package)
    path = osp.join(osp.dirname(module.__file__), '.mim', 'tools', f'{name}.py')
    assert osp.isfile(path), f'{package} ships no {name}.py at {path}'
    return path


def _run(tool: str, *args) -> str:
    proc = subprocess.run([sys.executable, tool, *args], cwd=REPO, env=ENV, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def _last_checkpoint(work_dir) -> str:
    with open(osp.join(work_dir, 'last_checkpoint')) as f:
        path = f.read().strip()
    assert osp.isfile(path), path
    return path


def _check_checkpoint_is_portable(path: str) -> None:
    checkpoint = torch.load(path, map_location='cpu', weights_only=True)  # torch's default
    assert tuple(checkpoint['meta']['dataset_meta']['classes']) == SHAPES_CLASSES


def test_detector_trained_by_mmdet_tools_tests_with_ours_and_opens_upstream(tmp_path):
    from mmdet.apis import DetInferencer, init_detector
    fresh = tmp_path / 'fresh_coco'  # nothing there: the dataset generates it on first use
    cfg = _tiny_config(tmp_path, 'det', iters=2, ckpt=2, validate=False, extra=(
        f"train_dataloader['dataset'].update(data_root='{fresh}/', shapes_world=dict("
        f"task='coco', num_train=8, num_val=5, image_size=64, seed=0))"))
    work_dir = str(tmp_path / 'work')
    log = _run(_upstream_tool('mmdet', 'train'), cfg, '--work-dir', work_dir)
    assert osp.isfile(fresh / 'annotations' / 'instances_train.json'), log[-2000:]
    checkpoint = _last_checkpoint(work_dir)
    _check_checkpoint_is_portable(checkpoint)
    out = _run(osp.join(REPO, 'tools', 'test.py'), cfg, checkpoint, '--work-dir',
               str(tmp_path / 'test'))
    assert re.search(r'coco/bbox_mAP_50: [\d.]+', out), out[-2000:]
    detector = init_detector(cfg, checkpoint, device='cpu')
    assert tuple(detector.dataset_meta['classes']) == SHAPES_CLASSES
    inferencer = DetInferencer(model=cfg, weights=checkpoint, device='cpu', show_progress=False)
    assert tuple(inferencer.model.dataset_meta['classes']) == SHAPES_CLASSES
    for key, value in detector.state_dict().items():
        assert torch.equal(value, inferencer.model.state_dict()[key]), key


def test_segmentor_trained_by_our_tools_tests_with_mmsegs_and_opens_upstream(tmp_path):
    from mmseg.apis import MMSegInferencer, init_model
    cfg = _tiny_config(tmp_path, 'seg', iters=2, ckpt=2, validate=False)
    work_dir = str(tmp_path / 'work')
    _run(osp.join(REPO, 'tools', 'train.py'), cfg, '--work-dir', work_dir)
    checkpoint = _last_checkpoint(work_dir)
    _check_checkpoint_is_portable(checkpoint)
    out = _run(_upstream_tool('mmseg', 'test'), cfg, checkpoint, '--work-dir',
               str(tmp_path / 'test'))
    assert re.search(r'mIoU: [\d.]+', out), out[-2000:]
    segmentor = init_model(cfg, checkpoint, device='cpu')
    assert tuple(segmentor.dataset_meta['classes']) == SHAPES_CLASSES
    inferencer = MMSegInferencer(model=cfg, weights=checkpoint, device='cpu')
    assert tuple(inferencer.model.dataset_meta['classes']) == SHAPES_CLASSES


def test_converted_full_model_file_keeps_dataset_meta(tmp_path):
    """tools/model_converters/convert_checkpoint.py --full-model keeps the source's meta."""
    src = str(tmp_path / 'src.pth')
    torch.save({'state_dict': {'backbone.layers.0.lpi.conv1.weight': torch.zeros(1),
                               'neck.x': torch.zeros(1)},
                'meta': dict(dataset_meta=dict(classes=SHAPES_CLASSES), epoch=3)}, src)
    dst = str(tmp_path / 'dst.pth')
    _run(osp.join(REPO, 'tools', 'model_converters', 'convert_checkpoint.py'), src, dst,
         '--full-model')
    meta = torch.load(dst, weights_only=True)['meta']
    assert tuple(meta['dataset_meta']['classes']) == SHAPES_CLASSES and meta['epoch'] == 3
