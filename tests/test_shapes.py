"""The built-in shapes world (shapes_world), tools/dataset_converters/make_shapes.py and the
shapes configs.

* the generator is deterministic (same arguments -> byte-identical files), held out, and refuses
  to overwrite foreign data;
* the COCO layout loads with pycocotools (masks inside boxes, areas consistent, visible masks
  disjoint) and with mmdet's CocoDataset; CocoMetric scores the ground truth as AP 1.0;
* the ADE20k layout has the right label values and reads with mmseg's BaseSegDataset, both with
  ADE20k's reduce_zero_label and as the shapes config reads it (background = class 0); IoUMetric
  scores the ground truth as mIoU 100;
* both shapes configs run end to end through the training scripts (the detector through mmdet's
  own tools/train.py, the segmentor through ours, in this process; a short run on a handful of
  images, whose data the dataset generates on first use) and our tools/test.py evaluates the
  saved checkpoint well above chance; the checkpoint opens under torch's ``weights_only``
  loading with the shapes classes (resuming: tests/test_reliability.py); the configs keep 2
  checkpoints.
"""
import glob
import os.path as osp
import re
import sys

import numpy as np
import pytest
from conftest import run_as_main, unique_visualizer, upstream_tool
from PIL import Image

from shapes_world import CLASSES, generate_shapes, load_samples, make_mosaic

from work_dir_files import (evaluation_metrics, file_digests, load_as_plain_torch,
                            newest_run_log)

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
DET_CONFIG = osp.join(ROOT, 'configs', 'shapes', 'mask_rcnn_xcit_shapes_coco.py')
SEG_CONFIG = osp.join(ROOT, 'configs', 'shapes', 'sem_fpn_xcit_shapes_ade.py')
SMALL = dict(num_train=6, num_val=3, image_size=64, seed=3)


@pytest.fixture(scope='module')
def coco_world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('shapes') / 'coco')
    generate_shapes(root, task='coco', **SMALL)
    return root


@pytest.fixture(scope='module')
def ade_world(tmp_path_factory):
    root = str(tmp_path_factory.mktemp('shapes') / 'ade')
    generate_shapes(root, task='ade', **SMALL)
    return root


# ------------------------------------------------------------------------------------------------
# generator
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('task', ['coco', 'ade'])
def test_deterministic(tmp_path, task, coco_world, ade_world):
    again = str(tmp_path / 'again')
    generate_shapes(again, task=task, **SMALL)
    reference = coco_world if task == 'coco' else ade_world
    assert file_digests(again) == file_digests(reference)
    other = str(tmp_path / 'other_seed')
    generate_shapes(other, task=task, **dict(SMALL, seed=4))
    ref, oth = file_digests(reference), file_digests(other)
    images = [p for p in ref if p.endswith('.jpg')]
    assert images and all(oth[p] != ref[p] for p in images)


def test_more_images_only_append(tmp_path, coco_world):
    """Each image has its own random stream: a bigger world starts with the same images."""
    bigger = str(tmp_path / 'bigger')
    generate_shapes(bigger, task='coco', **dict(SMALL, num_train=8))
    small, big = file_digests(coco_world), file_digests(bigger)
    for name in small:
        if name.startswith(('train', 'val')):
            assert big[name] == small[name], name
    assert osp.isfile(osp.join(bigger, 'train', '000008.jpg'))


def test_train_and_val_differ(coco_world):
    digest = file_digests(coco_world)
    assert digest['train/000001.jpg'] != digest['val/000001.jpg']


def test_existing_root(tmp_path, coco_world):
    # same arguments: nothing is regenerated, the summary is returned
    before = file_digests(coco_world)
    summary = generate_shapes(coco_world, task='coco', **SMALL)
    assert summary['train']['images'] == SMALL['num_train']
    assert file_digests(coco_world) == before
    # other arguments or foreign contents: refused unless overwrite=True
    with pytest.raises(FileExistsError, match='already exists'):
        generate_shapes(coco_world, task='coco', **dict(SMALL, seed=9))
    foreign = tmp_path / 'foreign'
    foreign.mkdir()
    (foreign / 'keep.txt').write_text('x')
    with pytest.raises(FileExistsError):
        generate_shapes(str(foreign), task='ade', **SMALL)
    generate_shapes(str(foreign), task='ade', overwrite=True, **SMALL)
    assert not (foreign / 'keep.txt').exists()
    assert not glob.glob(str(tmp_path / '*.tmp-*'))


@pytest.mark.parametrize('kwargs, match', [
    (dict(task='voc'), 'task'),
    (dict(image_size=16), 'at least 32'),
    (dict(image_size=(64, 64, 3)), 'image_size'),
    (dict(num_train=-1), 'num_train'),
    (dict(objects_per_image=(3, 2)), 'objects_per_image'),
    (dict(size_range=(0.2, 0.9)), 'size_range'),
])
def test_invalid_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_shapes(str(tmp_path / 'w'), **kwargs)
    assert not (tmp_path / 'w').exists()


# ------------------------------------------------------------------------------------------------
# COCO layout
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize('split', ['train', 'val'])
def test_coco_annotations(coco_world, split):
    from pycocotools import mask as mask_utils
    from pycocotools.coco import COCO
    coco = COCO(osp.join(coco_world, 'annotations', f'instances_{split}.json'))
    assert [c['name'] for c in coco.loadCats(coco.getCatIds())] == list(CLASSES)
    assert len(coco.getImgIds()) == SMALL[f'num_{split}']
    n_anns = 0
    for img_id in coco.getImgIds():
        info = coco.loadImgs(img_id)[0]
        image = Image.open(osp.join(coco_world, split, info['file_name']))
        assert image.size == (info['width'], info['height']) == (64, 64)
        assert image.mode == 'RGB'
        anns = coco.loadAnns(coco.getAnnIds(imgIds=img_id))
        assert anns, 'every image has at least one object'
        union = np.zeros((64, 64), dtype=int)
        for ann in anns:
            n_anns += 1
            assert ann['iscrowd'] == 0 and ann['category_id'] in (1, 2, 3)
            mask = coco.annToMask(ann).astype(bool)
            union += mask
            assert mask.any()
            assert ann['area'] == mask.sum() == mask_utils.area(ann['segmentation'])
            x, y, w, h = ann['bbox']
            ys, xs = np.nonzero(mask)
            assert (x, y, w, h) == (xs.min(), ys.min(), xs.max() - xs.min() + 1,
                                    ys.max() - ys.min() + 1)  # tight box, mask inside
            assert np.allclose(mask_utils.toBbox(ann['segmentation']), ann['bbox'])
        assert union.max() == 1, 'visible masks do not overlap'
    assert n_anns >= SMALL[f'num_{split}'] * 2


def test_mmdet_reads_coco_world(coco_world):
    """mmdet's CocoDataset + LoadAnnotations read it; CocoMetric gives the GT AP 1.0."""
    import torch
    from mmdet.evaluation import CocoMetric
    from mmdet.registry import DATASETS
    from mmdet.utils import register_all_modules
    register_all_modules()
    dataset = DATASETS.build(dict(
        type='CocoDataset', data_root=coco_world, ann_file='annotations/instances_val.json',
        data_prefix=dict(img='val/'), metainfo=dict(classes=CLASSES), test_mode=True,
        pipeline=[dict(type='LoadImageFromFile'),
                  dict(type='LoadAnnotations', with_bbox=True, with_mask=True)]))
    assert len(dataset) == SMALL['num_val']
    metric = CocoMetric(ann_file=osp.join(coco_world, 'annotations', 'instances_val.json'),
                        metric=['bbox', 'segm'])
    metric.dataset_meta = dataset.metainfo
    for i in range(len(dataset)):
        item = dataset[i]
        masks = item['gt_masks'].to_ndarray().astype(bool)
        assert masks.shape[1:] == (64, 64) and masks.any(axis=(1, 2)).all()
        boxes = item['gt_bboxes'].tensor.numpy()
        for mask, box in zip(masks, boxes):  # each mask lies inside its box
            ys, xs = np.nonzero(mask)
            assert xs.min() >= box[0] and xs.max() < box[2]
            assert ys.min() >= box[1] and ys.max() < box[3]
        n = len(boxes)
        metric.process({}, [dict(
            img_id=item['img_id'], ori_shape=item['ori_shape'],
            pred_instances=dict(
                bboxes=torch.from_numpy(boxes), scores=torch.ones(n),
                labels=torch.from_numpy(item['gt_bboxes_labels']).long(),
                masks=torch.from_numpy(masks)))])
    results = metric.evaluate(len(dataset))
    assert results['coco/bbox_mAP'] == pytest.approx(1.0)
    assert results['coco/segm_mAP'] == pytest.approx(1.0)


# ------------------------------------------------------------------------------------------------
# ADE20k layout
# ------------------------------------------------------------------------------------------------
def test_ade_label_maps(ade_world, coco_world):
    for split, sub in (('train', 'training'), ('val', 'validation')):
        images = sorted(glob.glob(osp.join(ade_world, 'images', sub, '*.jpg')))
        labels = sorted(glob.glob(osp.join(ade_world, 'annotations', sub, '*.png')))
        assert len(images) == len(labels) == SMALL[f'num_{split}']
        assert [osp.basename(p)[:-4] for p in images] == [osp.basename(p)[:-4] for p in labels]
        for label_path in labels:
            label = Image.open(label_path)
            assert label.mode == 'L' and label.size == (64, 64)
            values = set(np.unique(np.asarray(label)).tolist())
            assert 0 in values and values <= {0, 1, 2, 3} and len(values) >= 2
    # the same seed paints the same scenes in both layouts
    for (_, ade_label, _), (_, coco_label, _) in zip(load_samples(ade_world, 'val', 3),
                                                     load_samples(coco_world, 'val', 3)):
        assert np.array_equal(ade_label, coco_label)


def _ade_dataset(ade_world, reading):
    """The validation split read with ADE20k's convention or as the shapes config reads it."""
    from mmengine.config import Config
    if reading == 'ade':  # 0 = "other", ignored; 3 classes
        return dict(
            type='BaseSegDataset', data_root=ade_world, img_suffix='.jpg', seg_map_suffix='.png',
            reduce_zero_label=True, metainfo=dict(classes=CLASSES),
            data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation'),
            pipeline=[dict(type='LoadImageFromFile'),
                      dict(type='LoadAnnotations', reduce_zero_label=True)])
    dataset = Config.fromfile(SEG_CONFIG).val_dataloader.dataset.to_dict()
    dataset.update(data_root=ade_world, pipeline=[dict(type='LoadImageFromFile'),
                                                  dict(type='LoadAnnotations')])
    return dataset


@pytest.mark.parametrize('reading', ['ade', 'shapes_config'])
def test_mmseg_reads_ade_world(ade_world, reading):
    """mmseg's BaseSegDataset reads it, with ADE20k's convention (background ignored) and as the
    shapes config does (background = class 0); IoUMetric gives the ground truth mIoU 100."""
    import torch
    from mmseg.evaluation import IoUMetric
    from mmseg.registry import DATASETS
    from mmseg.utils import register_all_modules
    register_all_modules()
    dataset = DATASETS.build(_ade_dataset(ade_world, reading))
    assert len(dataset) == SMALL['num_val']
    num_classes = len(dataset.metainfo['classes'])
    assert num_classes == (3 if reading == 'ade' else 4)
    metric = IoUMetric(iou_metrics=['mIoU'])
    metric.dataset_meta = dataset.metainfo
    for i in range(len(dataset)):
        item = dataset[i]
        raw = np.asarray(Image.open(item['seg_map_path']))
        gt = item['gt_seg_map']
        if reading == 'ade':  # reduce_zero_label: background 0 -> 255 (ignored), k -> k - 1
            assert np.array_equal(gt == 255, raw == 0)
            assert np.array_equal(gt[raw > 0], raw[raw > 0] - 1)
        else:  # labels as written: 0 background, 1..3 circle, square, triangle
            assert dataset.metainfo['classes'] == ('background',) + CLASSES
            assert np.array_equal(gt, raw)
        gt_t = torch.from_numpy(gt.astype(np.int64))[None]
        metric.process({}, [dict(pred_sem_seg=dict(data=gt_t.clone().masked_fill(gt_t == 255, 0)),
                                 gt_sem_seg=dict(data=gt_t), img_path=item['img_path'])])
    results = metric.evaluate(len(dataset))
    assert results['mIoU'] == pytest.approx(100.0)


# ------------------------------------------------------------------------------------------------
# the CLI and the mosaic
# ------------------------------------------------------------------------------------------------
def _make_shapes_tool():
    """tools/dataset_converters/make_shapes.py as a module."""
    sys.path.insert(0, osp.join(ROOT, 'tools', 'dataset_converters'))
    try:
        import make_shapes
    finally:
        sys.path.pop(0)
    return make_shapes


def test_make_shapes_cli(tmp_path):
    make_shapes = _make_shapes_tool()
    root = str(tmp_path / 'cli')
    png = str(tmp_path / 'mosaic.png')
    summary = make_shapes.main([root, '--task', 'ade', '--num-train', '2', '--num-val', '2',
                                '--image-size', '48', '64', '--mosaic', png, '--mosaic-num', '2'])
    assert summary['image_size'] == [48, 64] and summary['val']['images'] == 2
    assert Image.open(png).size == (2 * 2 * (64 + 4), 2 * (2 * 48 + 4))  # 1 row, scale 2
    # --config reads the shapes_world dict; explicit flags override it
    summary = make_shapes.main(['--config', SEG_CONFIG, '--num-train', '1', '--num-val', '1',
                                str(tmp_path / 'from_config')])
    assert summary['task'] == 'ade' and summary['num_train'] == 1
    with pytest.raises(SystemExit):
        make_shapes.main(['--num-train', '1'])  # no root


def test_make_shapes_cli_names_its_overwrite_flag(tmp_path, capsys):
    """Other arguments for an existing world: the message names the CLI flag (--overwrite), not
    generate_shapes' keyword, and says what differs."""
    make_shapes = _make_shapes_tool()
    root = str(tmp_path / 'w')
    small = ['--task', 'coco', '--num-val', '1', '--image-size', '32']
    make_shapes.main([root, '--num-train', '1'] + small)
    with pytest.raises(SystemExit) as info:
        make_shapes.main([root, '--num-train', '2'] + small)
    message = str(info.value.code)
    assert message.startswith('error: ') and 'pass --overwrite' in message
    assert 'overwrite=True' not in message
    assert 'num_train=1 (wanted num_train=2)' in message
    summary = make_shapes.main([root, '--num-train', '2', '--overwrite'] + small)
    assert summary['train']['images'] == 2


@pytest.mark.parametrize('config', [DET_CONFIG, SEG_CONFIG])
def test_shapes_configs_keep_two_checkpoints(config, train_tool, monkeypatch):
    """The quick-start configs do not trigger tools/train.py's max_keep_ckpts=1 warning, also
    when checkpoints are written during the run (the reason to keep more than one)."""
    logged = []
    monkeypatch.setattr(train_tool, 'print_log', lambda msg, **kw: logged.append(msg))
    args = train_tool.parse_args([config, '--cfg-options', 'default_hooks.checkpoint.interval=100'])
    cfg = train_tool.build_cfg(args)
    train_tool.check_checkpoints(cfg, args)
    assert cfg.default_hooks.checkpoint.max_keep_ckpts >= 2
    assert not [m for m in logged if 'max_keep_ckpts' in m]


def test_mosaic_marks_instances(coco_world, tmp_path):
    samples = load_samples(coco_world, 'val', 2)
    canvas = make_mosaic(samples, str(tmp_path / 'm.png'), columns=2, scale=1)
    assert canvas.shape == (2 * 64 + 4, 2 * (64 + 4), 3)
    _, label, inst = samples[0]
    assert set(np.unique(inst[label == 0])) == {0}


# ------------------------------------------------------------------------------------------------
# end to end through tools/train.py and tools/test.py
# ------------------------------------------------------------------------------------------------
def _short_options(task, root, iters):
    """--cfg-options making a shapes config a short run on 4 images of 64 px that it can fit.

    Validation and test read the 4 *training* images: a short run from scratch stays at chance on
    held-out images (measured: mIoU 21 after 120 iterations on 32 images, chance ~18), but fits its
    own training images quickly, so the metric tells whether training, checkpointing and
    evaluation really work (labels, weights, metric), not only that a metric line is printed.
    """
    world = [f'shapes_world.root={root}', 'shapes_world.num_train=4', 'shapes_world.num_val=2',
             'shapes_world.image_size=64', 'shapes_world.progress=False']
    # the datasets' own copies, which generate the world on first use under mmdet's tool
    opts = world + [f'{loader}.dataset.{option}' for loader in (
        'train_dataloader', 'val_dataloader', 'test_dataloader') for option in world]
    opts += [
            f'train_dataloader.dataset.data_root={root}',
            f'val_dataloader.dataset.data_root={root}',
            f'test_dataloader.dataset.data_root={root}',
            # the base schedules' DefaultSampler makes mmengine sleep 2 s at every epoch end
            'train_dataloader.sampler.type=InfiniteSampler',
            'train_dataloader.batch_size=2', 'val_dataloader.batch_size=2',
            'test_dataloader.batch_size=2',
            f'train_cfg.max_iters={iters}', f'train_cfg.val_interval={iters}',
            'default_hooks.logger.interval=1', f'default_hooks.checkpoint.interval={iters}',
            'default_hooks.checkpoint.max_keep_ckpts=-1', 'log_processor.window_size=1']
    if task == 'coco':
        ann = osp.join(root, 'annotations', 'instances_train.json')
        opts += ['train_dataloader.dataset.pipeline.2.scale=(64,64)']  # not 160: the 64 px images
        for loader in ('val_dataloader', 'test_dataloader'):
            opts += [f'{loader}.dataset.ann_file={ann}', f'{loader}.dataset.data_prefix.img=train/',
                     f'{loader}.dataset.pipeline.1.scale=(64,64)']
        opts += [f'val_evaluator.ann_file={ann}', f'test_evaluator.ann_file={ann}',
                 # an untrained model must still output detections for CocoMetric to score
                 'model.test_cfg.rcnn.score_thr=0.0']
    else:
        opts += ['model.data_preprocessor.size=(64,64)']  # not padded to 160 px
        for loader in ('val_dataloader', 'test_dataloader'):
            opts += [f'{loader}.dataset.data_prefix.img_path=images/training',
                     f'{loader}.dataset.data_prefix.seg_map_path=annotations/training',
                     f'{loader}.dataset.pipeline.1.scale=(64,64)']
    return opts


# Iterations of the short run, and the lower bound of tools/test.py's metric on its 4 training
# images. Chance: box AP50 ~0 for an untrained detector; mIoU ~18-20 for a segmentor that paints
# (nearly) everything background: background IoU / 4 (measured on held-out images: 18.1-19.6).
# Measured (seed 0, one thread, AMD EPYC with AVX-512): box AP50 0.758 after 60 iterations (0.586
# after 100); mIoU 68.08 after 100 iterations (47.39 after 60: too close to its bound).
FIT_ITERS = {'coco': 60, 'ade': 100}
_FIT_METRIC = {'coco': ('coco/bbox_mAP_50', 0.3), 'ade': ('mIoU', 40.0)}


@pytest.mark.parametrize('task', ['coco', 'ade'])
def test_train_then_test_learns(tmp_path, task, train_tool, test_tool):
    """The training scripts train on generated data (the detector with mmdet's own
    ``tools/train.py``, the segmentor with ours, both in this process: the scripts started as
    commands are tested in tests/test_reliability.py and tests/test_checkpoint_doors.py); our
    tools/test.py evaluates its checkpoint: well above chance. (Resuming is tested against the
    uninterrupted run's losses in tests/test_reliability.py.)"""
    config = DET_CONFIG if task == 'coco' else SEG_CONFIG
    root = str(tmp_path / f'shapes_{task}')
    work = str(tmp_path / 'work')
    metric_key, lower_bound = _FIT_METRIC[task]
    iters = FIT_ITERS[task]

    # 1. a short run: the data is generated on first use, validation runs at the end
    options = _short_options(task, root, iters) + [unique_visualizer(f'shapes_{task}')]
    if task == 'coco':
        run_as_main(upstream_tool('mmdet', 'train'), config, '--work-dir', work, '--cfg-options',
                    *options)
    else:
        train_tool.main([config, '--work-dir', work, '--cfg-options', *options])
    out = newest_run_log(work)
    assert osp.isfile(osp.join(root, 'shapes_world.json'))
    assert re.search(rf'Iter\(train\) \[{iters}/{iters}\]', out)
    assert metric_key in out
    ckpt = osp.join(work, f'iter_{iters}.pth')
    assert osp.isfile(ckpt)
    meta = load_as_plain_torch(ckpt)['meta']  # as a process without xcit_mm reads it
    assert tuple(meta['dataset_meta']['classes'])[-3:] == CLASSES  # (ade: after background)

    # 2. tools/test.py evaluates the checkpoint: the model has learnt (well above chance)
    test_opts = [o for o in _short_options(task, root, iters)
                 if not o.startswith('train_cfg')]
    test_work = tmp_path / 'test'
    test_tool.main([config, ckpt, '--work-dir', str(test_work), '--cfg-options'] + test_opts)
    metrics = evaluation_metrics(test_work)
    print(f'{task}: {metric_key} = {metrics[metric_key]} after {iters} iterations')
    assert metrics[metric_key] >= lower_bound, metrics
    if task == 'coco':
        assert 'coco/segm_mAP' in metrics
