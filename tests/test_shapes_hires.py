"""The high-resolution shapes world (task='cityscapes'), its config and its job's plumbing.

* the world is deterministic, in the Cityscapes layout, one shape per image wholly inside it,
  its fill a flat grey independent of its class, the class in the scene's hues only;
* ShapesCityscapesDataset generates it on first use and reads it with mmseg's LoadAnnotations;
* configs/shapes/sem_fpn_xcit_shapes_cityscapes.py trains (tools/train.py, one step on a tiny
  world and crop) and tools/test.py evaluates its checkpoint whole-image (in bands of rows) and
  with the sliding window (both give an mIoU; each really runs its path);
* tools/analysis_tools/shapes_hires_job.py reads the metrics and per-class IoU off test logs.
"""
import os.path as osp
import sys

import numpy as np
import pytest
from PIL import Image

from shapes_world import generate_shapes, load_samples
from shapes_world.shapes import _image_rng, draw_hires_image

from work_dir_files import evaluation_metrics, file_digests

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIG = osp.join(ROOT, 'configs', 'shapes', 'sem_fpn_xcit_shapes_cityscapes.py')
TINY = dict(task='cityscapes', num_train=2, num_val=2, image_size=(128, 256), seed=5,
            objects_per_image=(1, 1), size_range=(0.28, 0.41))


@pytest.fixture(scope='module')
def world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('hires') / 'cs')
    generate_shapes(root, **TINY)
    return root


def test_world_is_deterministic_in_cityscapes_layout(world, tmp_path):
    files = file_digests(world)
    for split in ('train', 'val'):
        for i in (1, 2):
            stem = f'shapes_{split}_{i:06d}'
            assert f'leftImg8bit/{split}/shapes/{stem}_leftImg8bit.png' in files
            assert f'gtFine/{split}/shapes/{stem}_gtFine_labelTrainIds.png' in files
    again = str(tmp_path / 'again')
    generate_shapes(again, **TINY)
    assert file_digests(again) == files
    other = str(tmp_path / 'other')
    generate_shapes(other, **dict(TINY, seed=6))
    assert all(file_digests(other)[p] != files[p] for p in files if p.endswith('_leftImg8bit.png'))


def _hue(rgb) -> float:
    import colorsys
    return colorsys.rgb_to_hsv(*(np.asarray(rgb, dtype=float) / 255))[0]


def _hue_distance(a: float, b: float) -> float:
    return min(abs(a - b), 1 - abs(a - b))


def test_one_big_grey_shape_inside_the_scene_of_its_class(world):
    from scipy.ndimage import binary_erosion
    from shapes_world.shapes import SCENE_HUES
    for img, label, _ in load_samples(world, 'train', 2) + load_samples(world, 'val', 2):
        assert img.shape == (128, 256, 3) and label.dtype == np.uint8
        classes = set(np.unique(label)) - {0}
        assert len(classes) == 1 and classes <= {1, 2, 3}
        inside = label > 0
        assert inside.sum() > 0.15 * 128 * 128  # big: radius >= 0.28 of the height
        ys, xs = np.nonzero(inside)  # wholly inside: no shape pixel on the border
        assert ys.min() > 0 and xs.min() > 0 and ys.max() < 127 and xs.max() < 255
        # the fill a flat grey (faint shading only), the scene striped in its class's hue
        interior = img[binary_erosion(inside, iterations=2)].astype(int)
        assert np.ptp(interior, axis=1).max() <= 1 and interior.std(axis=0).max() < 12
        cls = int(label.max())
        assert img[~inside].astype(float).std(axis=0).max() > 12
        assert _hue_distance(_hue(img[~inside].mean(axis=0)), SCENE_HUES[cls - 1]) < 0.1


def test_the_scene_tells_the_class_and_the_fill_does_not():
    """Over many draws: each class's scenes keep its hue, the three hues far apart; the fill
    greys of the three classes have about the same mean."""
    from shapes_world.shapes import SCENE_HUES
    fills = {1: [], 2: [], 3: []}
    for i in range(45):
        img, label, n = draw_hires_image(_image_rng(0, 'train', i), (64, 128))
        assert n == 1
        cls = int(label.max())
        fills[cls].append(img[label == cls].mean())
        hues = [_hue_distance(_hue(img[label == 0].mean(axis=0)), h) for h in SCENE_HUES]
        assert int(np.argmin(hues)) == cls - 1 and min(hues) < 0.1
    means = [np.mean(v) for v in fills.values() if v]
    assert len(means) == 3 and np.ptp(means) < 60  # uniform greys 40-215: +-51 for one draw


def test_dataset_generates_and_reads_it(tmp_path):
    """ShapesCityscapesDataset generates the world at an empty data_root; LoadAnnotations reads
    the label maps as written (0 background, 1..3 circle, square, triangle)."""
    from mmseg.registry import DATASETS
    from mmseg.utils import register_all_modules
    import shapes_world.shapes_seg  # noqa: F401 (registers the datasets)
    register_all_modules()
    root = str(tmp_path / 'first_use')
    dataset = DATASETS.build(dict(
        type='ShapesCityscapesDataset', data_root=root, shapes_world=TINY,
        data_prefix=dict(img_path='leftImg8bit/val', seg_map_path='gtFine/val'),
        pipeline=[dict(type='LoadImageFromFile'),
                  dict(type='LoadAnnotations', reduce_zero_label=False)]))
    assert osp.isfile(osp.join(root, 'shapes_world.json'))
    assert len(dataset) == 2
    assert dataset.metainfo['classes'] == ('background', 'circle', 'square', 'triangle')
    for i in range(len(dataset)):
        item = dataset[i]
        assert item['img'].shape == (128, 256, 3)
        assert np.array_equal(item['gt_seg_map'], np.asarray(Image.open(item['seg_map_path'])))


# ------------------------------------------------------------------------------------------------
# the config through tools/train.py and tools/test.py (whole and slide)
# ------------------------------------------------------------------------------------------------
def _tiny_options(root):
    opts = [f'shapes_world.root={root}', 'shapes_world.num_train=2', 'shapes_world.num_val=2',
            'shapes_world.image_size=(128,256)', 'shapes_world.seed=5',
            'shapes_world.progress=False']
    for loader in ('train_dataloader', 'val_dataloader', 'test_dataloader'):
        opts.append(f'{loader}.dataset.data_root={root}')
    return opts


@pytest.fixture(scope='module')
def one_step(world, tmp_path_factory, train_tool):
    """tools/train.py: one training step of the config on the tiny world, 64x64 crops."""
    work = str(tmp_path_factory.mktemp('hires_work'))
    train_tool.main([CONFIG, '--work-dir', work, '--cfg-options'] + _tiny_options(world) + [
        'train_dataloader.dataset.pipeline.2.scale=(256,128)',
        'train_dataloader.dataset.pipeline.3.crop_size=(64,64)',
        'model.data_preprocessor.size=(64,64)', 'train_cfg.max_iters=1',
        'train_cfg.val_begin=2', 'default_hooks.checkpoint.interval=1',
        'default_hooks.logger.interval=1', 'log_processor.window_size=1'])
    return osp.join(work, 'iter_1.pth')


def test_config_trains_one_step(one_step):
    import torch
    state = torch.load(one_step, map_location='cpu', weights_only=False)
    assert state['meta']['iter'] == 1
    assert any(k.startswith('backbone.') for k in state['state_dict'])


@pytest.mark.parametrize('mode', ['whole', 'slide'])
def test_whole_and_slide_evaluation(mode, one_step, world, tmp_path, test_tool, monkeypatch):
    # the lean sliding window: labels bit-identical to mmseg's slide_inference
    # (tests/test_segmentation_memory_budget.py), without its full-size map
    # whole: the image streamed (tests/test_stream.py)
    import xcit_mm.models.segmentors.lean_encoder_decoder as lean_module
    calls = dict(slide=[], whole=[])
    for key, name in (('slide', '_slide_predict'), ('whole', '_stream_predict')):
        real = getattr(lean_module.LeanEncoderDecoder, name)
        monkeypatch.setattr(lean_module.LeanEncoderDecoder, name,
                            lambda self, *a, real=real, key=key, **k:
                            calls[key].append(1) or real(self, *a, **k))
    opts = _tiny_options(world)
    if mode == 'slide':
        opts += ['model.test_cfg.mode=slide', 'model.test_cfg.band_mb=None',
                 'model.test_cfg.crop_size=(64,64)', 'model.test_cfg.stride=(48,48)']
    test_tool.main([CONFIG, one_step, '--work-dir', str(tmp_path), '--cfg-options'] + opts)
    metrics = evaluation_metrics(tmp_path)
    assert 0 <= metrics['mIoU'] <= 100
    assert calls == (dict(slide=[1, 1], whole=[]) if mode == 'slide'  # one call per val image
                     else dict(slide=[], whole=[1, 1]))


def test_job_reads_test_logs(monkeypatch, tmp_path):
    sys.path.insert(0, osp.join(ROOT, 'tools', 'analysis_tools'))
    try:
        import shapes_hires_job as job
    finally:
        sys.path.pop(0)
    log = ('+------------+-------+-------+\n|   Class    |  IoU  |  Acc  |\n'
           '| background | 91.5 | 97.0 |\n|   circle   | 40.25 | 50.0 |\n'
           '| triangle | nan | nan |\n'
           '11/24 - mmengine - INFO - Iter(test) [10/10]    aAcc: 90.1  mIoU: 44.4  mAcc: 55.5\n')
    seen = []
    monkeypatch.setattr(job, 'run', lambda args, path, env: seen.append((args, env)) or (
        12.5, 900.0, log))
    r = job.evaluate('cfg.py', 'ck.pth', str(tmp_path / 'e'), job.SLIDE)
    assert r == dict(aAcc=90.1, mIoU=44.4, mAcc=55.5, wall_seconds=12.5, peak_rss_mib=900.0,
                     class_IoU=dict(background=91.5, circle=40.25))
    args, env = seen[0]
    assert args[-4:] == ['model.test_cfg.mode=slide', 'model.test_cfg.band_mb=None',
                         'model.test_cfg.crop_size=(256,256)', 'model.test_cfg.stride=(192,192)']
    assert env['MALLOC_MMAP_THRESHOLD_'] == '65536'  # the RSS follows the live tensors
    assert job.STOCK_SLIDE == ['model.type=EncoderDecoder'] + job.SLIDE


def test_docs_quote_the_committed_artifacts():
    """docs/shapes.md quotes the job's and the curve's artifacts; the job meets its floor."""
    import json
    with open(osp.join(ROOT, 'docs', 'shapes.md')) as f:
        doc = f.read()
    with open(osp.join(ROOT, 'docs', 'results', 'shapes_hires_sem_fpn.json')) as f:
        job = json.load(f)
    for run in job['runs']:
        row = next(line for line in doc.splitlines() if line.startswith(f'| {run["seed"]} |'))
        for mode in ('whole', 'slide'):
            assert f'| {run[mode]["mIoU"]:.2f} |' in row, (mode, row)
        assert f'| {run["whole_minus_slide_mIoU"]:+.2f} |' in row, row
        # the floors in docs/shapes.md
        assert run['whole']['mIoU'] >= 95 and run['whole_minus_slide_mIoU'] >= 8, run
        assert run['stock_slide']['mIoU'] == run['slide']['mIoU']
    # the verdict says what the artifact says
    summary = job['summary']
    wins = summary['whole_beats_slide_by_more_than_seed_spread']
    assert ('Whole-image inference beats the sliding window' in doc) is wins
    assert summary['whole_peak_rss_below_slide'] and summary['whole_faster_than_slide']
    with open(osp.join(ROOT, 'docs', 'results', 'shapes_hires_resolution_curve.json')) as f:
        curve = json.load(f)
    row = next(line for line in doc.splitlines() if line.startswith('| mIoU |'))
    assert row == '| mIoU | ' + ' | '.join(f'{p["mIoU"]:.2f}' for p in curve['points']) + ' |'
    assert osp.isfile(osp.join(ROOT, 'docs', 'results', 'shapes_hires_resolution_curve.png'))
    assert len(doc.encode()) <= 12000
