"""Reliability of long runs (issues 5 and 15): bad input, untrusted checkpoints, interrupted
training (also with the paper configs' own dataloaders: persistent workers, random augmentations),
distributed runs, faults mid-run (a NaN or a dead or hung rank, a save killed half-way or a full
disk, an unreadable image) and mixed precision, on the built-in shapes data (CPU only).

Every training here is a few iterations of a tiny XCiT (32 channels, 4 layers) on 8 generated
64-pixel images, derived from the shapes configs (``configs/shapes/``) and, through them, from the
paper configs (SyncBN, AdamW, reliability hooks), or from the paper configs directly
(``_paper_config``). Runs that must be separate processes (SIGKILL, torchrun) are subprocesses with
timeouts, some with test probes imported by their config (``_PROBES``); the others call the tools'
``main`` in-process.
See docs/reliability.md for what each test establishes.
"""
import functools
import glob
import http.server
import json
import os
import os.path as osp
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.registry import HOOKS

from training_extras import (CheckFiniteLossHook, CPUAmpOptimWrapper, NonFiniteLossError,
                             RandomStateHook)
from xcit_mm.models.utils import CheckpointError, check_checkpoint, load_checkpoint_file
from training_extras import AnnotationFormatError, check_annotation_formats, coco_annotation_problem

from work_dir_files import evaluation_metrics, load_as_plain_torch, newest_run_log

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIGS = osp.join(REPO, 'configs')
# CPU runs also on a machine with a GPU: subprocesses see no CUDA device, in-process runs get the
# cpu_only fixture (conftest.py).
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore', CUDA_VISIBLE_DEVICES='')
CPU_ONLY = pytest.mark.usefixtures('cpu_only')


def _base(task: str) -> str:
    """The shapes config of ``task``, which every tiny config here inherits (an error in it
    fails the tests that use it)."""
    return osp.join(CONFIGS, 'shapes', {'det': 'mask_rcnn_xcit_shapes_coco.py',
                                        'seg': 'sem_fpn_xcit_shapes_ade.py'}[task])


_COMMON = '''
train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters={iters},
                 val_interval={val_interval})
val_cfg = dict(type='ValLoop')
test_cfg = dict(type='TestLoop')
param_scheduler = [dict(type='LinearLR', start_factor=0.1, by_epoch=False, begin=0, end={iters})]
optim_wrapper = dict(optimizer=dict(lr={lr}))
default_hooks = dict(logger=dict(interval=1),
                     checkpoint=dict(by_epoch=False, interval={ckpt}, max_keep_ckpts=-1))
log_processor = dict(by_epoch=False, window_size=1)
randomness = dict(seed=0, deterministic=True)
{extra}
'''

# The small Mask R-CNN neck and heads of every tiny detection config here (no braces: it is
# concatenated into str.format templates).
_TINY_DET_HEADS = '''
    neck=dict(in_channels=[32] * 4, out_channels=32),
    rpn_head=dict(in_channels=32, feat_channels=32),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=32, roi_layer=dict(sampling_ratio=2)),
        bbox_head=dict(in_channels=32, fc_out_channels=64, num_classes=3),
        mask_roi_extractor=dict(out_channels=32, roi_layer=dict(sampling_ratio=2)),
        mask_head=dict(in_channels=32, conv_out_channels=32, num_convs=1, num_classes=3)),
    train_cfg=dict(rpn_proposal=dict(nms_pre=200, max_per_img=50),
                   rcnn=dict(sampler=dict(num=64)))'''.lstrip('\n')

_DET = '''
_base_ = ['{base}']
data_root = '{root}/'
metainfo = dict(classes=('circle', 'square', 'triangle'),
                palette=[(220, 20, 60), (0, 130, 255), (20, 200, 60)])
shapes_world = dict(_delete_=True, root=data_root, task='coco', num_train=8, num_val=5,
                    image_size=64, seed=0)
model = dict(
    backbone=dict(arch=dict(_delete_=True, embed_dims=32, depth=4, num_heads=4), patch_size=16,
                  out_indices=(0, 1, 2, 3), drop_path_rate=0.1,
                  norm_cfg=dict(type='SyncBN', requires_grad=True), init_cfg=None),
''' + _TINY_DET_HEADS + ''',
    test_cfg=dict(rpn=dict(nms_pre=200, max_per_img=50), rcnn=dict(max_per_img=20)))
_train_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='Resize', scale=(64, 64), keep_ratio=True),
    dict(type='RandomFlip', prob=0.5),
    dict(type='PackDetInputs'),
]
_test_pipeline = [
    dict(type='LoadImageFromFile'),
    dict(type='Resize', scale=(64, 64), keep_ratio=True),
    dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
    dict(type='PackDetInputs',
         meta_keys=('img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor')),
]
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    sampler=dict(type='DefaultSampler', shuffle=True),
    dataset=dict(data_root=data_root, metainfo=metainfo,
                 ann_file='annotations/instances_train.json', data_prefix=dict(img='train/'),
                 pipeline=_train_pipeline))
val_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo,
                 ann_file='annotations/instances_val.json', data_prefix=dict(img='val/'),
                 pipeline=_test_pipeline))
test_dataloader = val_dataloader
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val.json')
test_evaluator = val_evaluator
'''

_SEG = '''
_base_ = ['{base}']
data_root = '{root}/'
metainfo = dict(classes=('circle', 'square', 'triangle'),
                palette=[(220, 20, 60), (0, 130, 255), (20, 200, 60)])
shapes_world = dict(_delete_=True, root=data_root, task='ade', num_train=8, num_val=5,
                    image_size=64, seed=0)
model = dict(
    data_preprocessor=dict(size=(64, 64)),
    backbone=dict(arch=dict(_delete_=True, embed_dims=32, depth=4, num_heads=4), patch_size=16,
                  out_indices=(0, 1, 2, 3), drop_path_rate=0.1,
                  norm_cfg=dict(type='SyncBN', requires_grad=True), init_cfg=None),
    neck=dict(in_channels=[32] * 4, out_channels=32),
    decode_head=dict(in_channels=[32] * 4, channels=16, num_classes=3))
_data = dict(type='BaseSegDataset', img_suffix='.jpg', seg_map_suffix='.png',
             reduce_zero_label=True, data_root=data_root, metainfo=metainfo,
             data_prefix=dict(img_path='images/training', seg_map_path='annotations/training'))
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    sampler=dict(type='InfiniteSampler', shuffle=True),
    dataset=dict(_delete_=True, **_data, pipeline=[
        dict(type='LoadImageFromFile'), dict(type='LoadAnnotations', reduce_zero_label=True),
        dict(type='RandomFlip', prob=0.5), dict(type='PackSegInputs')]))
val_dataloader = dict(
    batch_size=1, num_workers=0, persistent_workers=False,
    dataset=dict(_delete_=True, **dict(_data, data_prefix=dict(
        img_path='images/validation', seg_map_path='annotations/validation')),
        pipeline=[dict(type='LoadImageFromFile'),
                  dict(type='LoadAnnotations', reduce_zero_label=True),
                  dict(type='PackSegInputs')]))
test_dataloader = val_dataloader
val_evaluator = dict(_delete_=True, type='IoUMetric', iou_metrics=['mIoU'])
test_evaluator = val_evaluator
'''


def _tiny_config(tmp_path, task, name=None, iters=4, ckpt=2, val_interval=None, lr=1e-4,
                 extra='', validate=True, out_indices=(0, 1, 2, 3)):
    """Write a tiny training config for ``task`` ('det' / 'seg') and return its path.

    The data (8 train / 5 val images of 64 px) is generated once per module by the
    ``shapes_data`` fixture and shared by all tests.
    """
    root = _data_root(task)
    text = {'det': _DET, 'seg': _SEG}[task].format(base=_base(task), root=root) + _COMMON.format(
        iters=iters, ckpt=ckpt, val_interval=val_interval or iters, lr=lr, extra=extra)
    text = text.replace('out_indices=(0, 1, 2, 3)', f'out_indices={tuple(out_indices)}')
    if not validate:  # no validation during training (saves the evaluation's time)
        text += 'val_cfg = None\nval_dataloader = None\nval_evaluator = None\n'
    # mmengine keys its global Visualizer / MessageHub instances by name: unique names keep
    # in-process runs of this module from writing into each other's logs.
    unique = f'{name or task}_{tmp_path.name}'[-60:].replace('-', '_').replace('.', '_')
    text += f"visualizer = dict(name='vis_{unique}_{time.time_ns()}')\n"
    path = tmp_path / f'{unique}.py'
    path.write_text(text)
    return str(path)


# The paper configs themselves (their dataloaders: 2 persistent workers, the random
# augmentations, samplers, loops), with a tiny XCiT and the pipelines' image sizes divided by 8,
# and the training extras switched on by their one base, as a user would.
_EXTRAS = osp.join(CONFIGS, '_base_', 'training_extras.py')
_PAPER = {'det': osp.join(CONFIGS, 'mask_rcnn_xcit_t12_p16_3x_coco.py'),
          'seg': osp.join(CONFIGS, 'sem_fpn_xcit_t12_p16_80k_ade20k.py')}

_PAPER_DET = """
_base_ = ['{base}', '{extras}']
data_root = '{root}/'
metainfo = dict(classes=('circle', 'square', 'triangle'),
                palette=[(220, 20, 60), (0, 130, 255), (20, 200, 60)])
shapes_world = dict(root=data_root, task='coco', num_train=8, num_val=5, image_size=64,
                    seed=0)
model = dict(
    backbone=dict(arch=dict(_delete_=True, embed_dims=32, depth=4, num_heads=4),
                  out_indices=(0, 1, 2, 3), drop_path_rate=0.1, init_cfg=None),
""" + _TINY_DET_HEADS + """)
train_dataloader = dict(
    num_workers=2, persistent_workers=True,
    dataset=dict(data_root=data_root, metainfo=metainfo,
                 ann_file='annotations/instances_train.json', data_prefix=dict(img='train/'),
                 pipeline={pipeline}))
train_cfg = dict(max_epochs={epochs}, val_interval={val_interval})
default_hooks = dict(logger=dict(interval=1))
"""

_PAPER_SEG = """
_base_ = ['{base}', '{extras}']
data_root = '{root}/'
shapes_world = dict(root=data_root, task='ade', num_train=8, num_val=5, image_size=64,
                    seed=0)
model = dict(
    data_preprocessor=dict(size=(64, 64)),
    backbone=dict(arch=dict(_delete_=True, embed_dims=32, depth=4, num_heads=4),
                  out_indices=(0, 1, 2, 3), drop_path_rate=0.1, init_cfg=None),
    neck=dict(in_channels=[32] * 4, out_channels=32),
    decode_head=dict(in_channels=[32] * 4, channels=16))
train_dataloader = dict(
    num_workers=2, persistent_workers=True,
    dataset=dict(data_root=data_root, pipeline={pipeline}))
train_cfg = dict(max_iters={iters}, val_interval={val_interval})
default_hooks = dict(logger=dict(interval=1), checkpoint=dict(interval=2, max_keep_ckpts=-1))
"""

_PAPER_COMMON = """
log_processor = dict(window_size=1)
randomness = dict(seed=0, deterministic=True)
"""

_PAPER_NO_VALIDATION = """
val_cfg = None
val_dataloader = None
val_evaluator = None
"""

# Validation on the shapes world's held-out images, with the paper config's own val dataloader
# (and its test pipeline, shrunk): after every epoch (det) or every 2 iterations (seg).
_PAPER_VALIDATION = {
    'det': """
val_dataloader = dict(dataset=dict(
    data_root=data_root, metainfo=metainfo, ann_file='annotations/instances_val.json',
    data_prefix=dict(img='val/'), pipeline={pipeline}))
val_evaluator = dict(ann_file=data_root + 'annotations/instances_val.json')
""",
    'seg': """
val_dataloader = dict(dataset=dict(data_root=data_root, pipeline={pipeline}))
"""}


def _shrink(value, factor=8):
    """A pipeline with every image size (``scale``, ``scales``, ``crop_size``) divided by
    ``factor``; the transforms and their randomness are the config's."""
    def size(v):
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], (list, tuple)):
            return type(v)(size(x) for x in v)
        if isinstance(v, (list, tuple)):
            return tuple(max(1, int(round(x / factor))) for x in v)
        return v
    if isinstance(value, dict):
        return {k: size(v) if k in ('scale', 'scales', 'crop_size') else _shrink(v, factor)
                for k, v in value.items() if k != '_scope_'}
    if isinstance(value, (list, tuple)):
        return type(value)(_shrink(v, factor) for v in value)
    return value


def _paper_config(tmp_path, task, name=None, epochs=3, iters=6, extra='', validate=False):
    """A config that inherits the paper config of ``task`` itself (see ``_PAPER``), with
    validation on the shapes world's held-out images if ``validate``."""
    base = Config.fromfile(_PAPER[task])
    pipeline = _shrink(base.train_dataloader.dataset.pipeline)
    template = {'det': _PAPER_DET, 'seg': _PAPER_SEG}[task]
    val_interval = (1 if task == 'det' else 2) if validate else 1000
    text = template.format(base=_PAPER[task], extras=_EXTRAS, root=_data_root(task),
                           pipeline=repr(pipeline),
                           epochs=epochs, iters=iters, val_interval=val_interval) + _PAPER_COMMON
    if validate:
        text += _PAPER_VALIDATION[task].format(
            pipeline=repr(_shrink(base.val_dataloader.dataset.pipeline)))
    else:
        text += _PAPER_NO_VALIDATION
    text += extra + '\n'
    unique = f'paper_{name or task}_{tmp_path.name}'[-60:].replace('-', '_').replace('.', '_')
    text += f"visualizer = dict(name='vis_{unique}_{time.time_ns()}')\n"
    path = tmp_path / f'{unique}.py'
    path.write_text(text)
    return str(path)


_DATA_ROOTS = {}


def _data_root(task):
    return _DATA_ROOTS[task]


@pytest.fixture(scope='module', autouse=True)
def shapes_data(tmp_path_factory):
    """Generate the tiny shapes worlds once for the module (COCO and ADE20k layouts)."""
    from shapes_world import generate_shapes
    base = tmp_path_factory.mktemp('shapes')
    for task, layout in (('det', 'coco'), ('seg', 'ade')):
        root = str(base / f'shapes_{layout}')
        generate_shapes(root, task=layout, num_train=8, num_val=5, image_size=64, seed=0)
        _DATA_ROOTS[task] = root
    yield
    _DATA_ROOTS.clear()


# In-process runs use one thread, as the subprocesses do (OMP_NUM_THREADS=1): on a shared 2-core
# machine, two OpenMP threads make bfloat16 kernels up to 100x slower.
pytestmark = pytest.mark.usefixtures('one_torch_thread')


def _losses(work_dir):
    """{iteration: loss} from the scalars.json files of every run in ``work_dir``."""
    losses = {}
    for path in sorted(glob.glob(osp.join(str(work_dir), '*', 'vis_data', 'scalars.json'))):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if 'loss' in record:
                    losses.setdefault(path, {})[record['iter']] = record['loss']
    return list(losses.values())


def _free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def _run(cmd, cwd, timeout=240, env=None):
    """``cmd``'s completed process and its stdout + stderr. On a timeout its whole process group
    (a launcher's ranks and their dataloader workers too) is killed before the error is raised:
    a hung rank must not outlive the test."""
    proc = subprocess.Popen(cmd, cwd=str(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env or ENV, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), out + err


def _exit_message(excinfo) -> str:
    return str(excinfo.value.code)


# ============================================================================ 1. bad input
def test_reliability_hooks_in_both_scopes_and_all_configs():
    """The hooks build from the mmdet and the mmseg scope, and every config has them."""
    from mmdet.registry import HOOKS as DET_HOOKS
    from mmseg.registry import HOOKS as SEG_HOOKS
    for registry in (DET_HOOKS, SEG_HOOKS):
        assert isinstance(registry.build(dict(type='CheckFiniteLossHook')), CheckFiniteLossHook)
        assert isinstance(registry.build(dict(type='RandomStateHook')), RandomStateHook)
    # Every config runs on mmengine's own Runner; the quick-start jobs switch the extras on with
    # the one base (the 24 paper configs run on stock hooks: tests/test_configs.py).
    extras = ['training_extras.' + name for name in (
        'CheckFiniteLossHook', 'SampleSeedingHook', 'RandomStateHook', 'PortableCheckpointHook',
        'AtomicCheckpointHook', 'CompileFeatureExtractorHook')]
    jobs = glob.glob(osp.join(CONFIGS, 'shapes', '*.py'))
    assert len(jobs) >= 2, jobs
    for path in jobs + glob.glob(osp.join(CONFIGS, '*_ld.py')):
        config = Config.fromfile(path)
        assert 'runner_type' not in config, path
        types = [h['type'] for h in config.get('custom_hooks', [])]
        if path in jobs:
            assert types == extras, path
        else:  # the layer-decay variants of paper configs: stock hooks and the plugin's own
            assert types == ['LayerDecayLrHook'], path


def test_check_finite_loss_hook_names_iteration_terms_and_checkpoint(tmp_path):
    (tmp_path / 'last_checkpoint').write_text(str(tmp_path / 'iter_400.pth'))
    runner = SimpleNamespace(iter=411, max_iters=1000, epoch=0, work_dir=str(tmp_path),
                             train_loop=SimpleNamespace())
    hook = CheckFiniteLossHook()
    finite = dict(loss=torch.tensor(1.5), loss_cls=torch.tensor(1.0), acc=torch.tensor(50.))
    hook.after_train_iter(runner, 0, outputs=finite)  # no error
    bad = dict(loss=torch.tensor(float('nan')), loss_cls=torch.tensor(0.7),
               loss_bbox=torch.tensor(float('inf')), acc=torch.tensor(float('nan')))
    with pytest.raises(NonFiniteLossError) as info:
        hook.after_train_iter(runner, 0, outputs=bad)
    message = str(info.value)
    assert info.value.iteration == 412 and 'iteration 412/1000' in message
    assert 'loss=nan' in message and 'loss_bbox=inf' in message
    assert 'loss_cls=' not in message and 'acc=' not in message  # finite / not a loss
    assert f'--resume {tmp_path / "iter_400.pth"}' in message
    assert 'clip_grad=dict(max_norm=1.0)' in message and 'load_from=' in message
    # interval: only every n-th iteration is checked
    CheckFiniteLossHook(interval=5).after_train_iter(runner, 0, outputs=bad)  # 412 % 5 != 0
    with pytest.raises(ValueError, match='positive int'):
        CheckFiniteLossHook(interval=0)


@CPU_ONLY
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_diverging_training_stops_at_the_first_nan_iteration(tmp_path, request, monkeypatch,
                                                             train_tool, task):
    """A real run whose learning rate blows the weights up stops at the first non-finite loss,
    names that iteration, and writes no checkpoint of the diverged weights.

    The detector's run is distributed (``--launcher pytorch``, a one-process gloo world): the
    tool turns the NaN into a SystemExit, and still no DDP model is alive when the process group
    is destroyed (see the crashing rank's test below)."""
    cfg = _tiny_config(tmp_path, task, iters=4, ckpt=1, lr=1e30, validate=False)
    work_dir = tmp_path / 'work'
    launcher = []
    if task == 'det':
        live_ddp_at_destroy = request.getfixturevalue('live_ddp_at_destroy')
        monkeypatch.setenv('MASTER_PORT', str(_free_port()))
        launcher = ['--launcher', 'pytorch']
    with pytest.raises(SystemExit) as info:
        train_tool.main([cfg, '--work-dir', str(work_dir), *launcher])
    message = _exit_message(info)
    if task == 'det':
        assert live_ddp_at_destroy == [0]
    assert 'Training stopped: the loss became NaN or infinite at iteration ' in message, message
    iteration = int(message.split('at iteration ')[1].split('/')[0])
    assert 2 <= iteration <= 4
    logged = _losses(work_dir)[0]
    assert sorted(logged) == list(range(1, iteration))  # every earlier iteration was finite
    assert all(v == v and abs(v) != float('inf') for v in logged.values())
    saved = sorted(glob.glob(str(work_dir / 'iter_*.pth')))
    assert saved == [str(work_dir / f'iter_{i}.pth') for i in range(1, iteration)]
    assert f'--resume {work_dir / f"iter_{iteration - 1}.pth"}' in message


def test_missing_checkpoints_are_reported_before_any_work(tmp_path, train_tool):
    cfg = _tiny_config(tmp_path, 'det')
    missing = str(tmp_path / 'nowhere' / 'ckpt.pth')
    work_dir = tmp_path / 'work'
    pretrained = _tiny_config(tmp_path, 'det', name='pretrained', extra=(
        f"model['backbone']['init_cfg'] = dict(_delete_=True, type='Pretrained', "
        f"checkpoint='{missing}')"))
    cases = [
        (cfg, ['--resume', missing], '--resume checkpoint not found'),
        (cfg, ['--cfg-options', f'load_from={missing}'], 'load_from checkpoint not found'),
        (pretrained, [], 'model.backbone.init_cfg.checkpoint not found'),
    ]
    for config, options, expected in cases:
        with pytest.raises(SystemExit) as info:
            train_tool.main([config, '--work-dir', str(work_dir), *options])
        message = _exit_message(info)
        assert expected in message and missing in message, message
        assert not work_dir.exists()  # nothing was built
    # init_cfg errors say which key to fix
    assert '--cfg-options model.backbone.init_cfg.checkpoint=PATH' in message


def _coco(**drop):
    data = dict(images=[dict(id=1, file_name='a.jpg', width=64, height=64)],
                annotations=[], categories=[dict(id=1, name='circle')])
    for key in drop:
        data.pop(key)
    return json.dumps(data)


@pytest.mark.parametrize('limit', [64 << 20, 0], ids=['parsed', 'streamed'])
def test_non_coco_annotation_files_are_named(tmp_path, limit):
    cases = {
        'list.json': ('[{"images": []}]', 'JSON list'),
        'no_images.json': (_coco(images=1), "no 'images'"),
        'no_cats.json': (_coco(categories=1, annotations=1), "no 'annotations', 'categories'"),
        'cut.json': (_coco()[:-10], 'not valid JSON' if limit else 'cut short'),
        'csv.json': ('file_name,x,y\n', 'not' if limit else 'not a JSON object'),
        'empty.json': ('', 'empty'),
    }
    for name, (text, expected) in cases.items():
        (tmp_path / name).write_text(text)
        problem = coco_annotation_problem(str(tmp_path / name), full_parse_limit=limit)
        assert problem is not None and expected in problem, (name, problem)
    (tmp_path / 'good.json').write_text(_coco())
    assert coco_annotation_problem(str(tmp_path / 'good.json'), full_parse_limit=limit) is None


def test_non_coco_annotation_file_stops_the_tools(tmp_path, train_tool):
    cfg = _tiny_config(tmp_path, 'det')
    bad = tmp_path / 'instances_val.json'
    bad.write_text('[{"file_name": "000001.jpg", "bbox": [0, 0, 4, 4]}]')
    with pytest.raises(SystemExit) as info:
        train_tool.main([cfg, '--work-dir', str(tmp_path / 'work'), '--cfg-options',
                         f'val_evaluator.ann_file={bad}'])
    message = _exit_message(info)
    assert f'Annotation file {bad} [val_evaluator.ann_file]' in message
    assert 'JSON list' in message and '"images", "annotations" and "categories"' in message
    config = Config.fromfile(cfg)
    config.train_dataloader.dataset.ann_file = str(bad)
    with pytest.raises(AnnotationFormatError) as info:
        check_annotation_formats(config, splits=('train', ))
    assert info.value.where == 'train_dataloader.dataset.ann_file'


# ============================================================================ 2. checkpoints
class _Payload:
    """Unpickling this object creates ``path`` (a directory): a harmless stand-in for code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path, )


def _weights():
    return {'backbone.w': torch.ones(2, 2), 'neck.b': torch.zeros(2)}


@pytest.fixture
def checkpoints(tmp_path):
    marker = str(tmp_path / 'code_was_executed')
    paths = SimpleNamespace(marker=marker)
    paths.evil = str(tmp_path / 'evil.pth')
    torch.save({'state_dict': _weights(), 'meta': {'iter': 2, 'epoch': 0},
                'extra': _Payload(marker)}, paths.evil)
    paths.weights = str(tmp_path / 'weights.pth')
    torch.save({'state_dict': _weights()}, paths.weights)
    paths.truncated = str(tmp_path / 'truncated.pth')
    with open(paths.weights, 'rb') as f:
        data = f.read()
    with open(paths.truncated, 'wb') as f:
        f.write(data[:len(data) // 2])
    paths.garbage = str(tmp_path / 'garbage.pth')
    with open(paths.garbage, 'wb') as f:
        f.write(b'<html>404 Not Found</html>')
    return paths


def test_checkpoints_with_pickled_code_are_refused_and_never_run(tmp_path, checkpoints,
                                                                 train_tool, test_tool):
    det = _tiny_config(tmp_path, 'det')
    calls = [
        (test_tool.main, [det, checkpoints.evil]),
        (train_tool.main, [det, '--resume', checkpoints.evil]),
        (train_tool.main, [det, '--cfg-options', f'load_from={checkpoints.evil}']),
    ]
    for main, argv in calls:
        with pytest.raises(SystemExit) as info:
            main(argv + ['--work-dir', str(tmp_path / 'work')])
        message = _exit_message(info)
        assert 'Refusing to load' in message and checkpoints.evil in message, message
        assert 'posix.mkdir' in message  # what the file asked to run
        assert 'convert_checkpoint.py' in message and '--trust' in message  # the way out
        assert not osp.exists(checkpoints.marker)
    assert not (tmp_path / 'work').exists()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_url_checkpoints_are_checked_before_mmengine_unpickles_them(tmp_path, checkpoints,
                                                                    test_tool, monkeypatch):
    """mmengine's own http(s) loader unpickles with torch.hub.load_state_dict_from_url's
    weights_only=False: the file's code runs. The tools download it into the hub cache, check
    it with weights_only=True, and give the Runner the local copy; with xcit_mm imported,
    mmengine's CheckpointLoader reads URLs through the same reader."""
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch_home'))
    server = http.server.ThreadingHTTPServer(
        ('127.0.0.1', 0), functools.partial(_QuietHandler, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f'http://127.0.0.1:{server.server_address[1]}'
        with pytest.raises(SystemExit) as info:
            test_tool.main([_tiny_config(tmp_path, 'det'), f'{url}/evil.pth',
                            '--work-dir', str(tmp_path / 'work')])
        assert 'Refusing to load' in _exit_message(info)
        assert not osp.exists(checkpoints.marker)
        # A safe URL comes back as its checked local copy in the hub cache.
        local = check_checkpoint(f'{url}/weights.pth')
        assert local == str(tmp_path / 'torch_home' / 'hub' / 'checkpoints' / 'weights.pth')
        # With xcit_mm imported, mmengine reads URLs through the same reader: refused too.
        from mmengine.runner.checkpoint import CheckpointLoader, load_from_http
        with pytest.raises(CheckpointError, match='Refusing to load'):
            CheckpointLoader.load_checkpoint(f'{url}/evil.pth', map_location='cpu')
        assert not osp.exists(checkpoints.marker)
        # The hazard is real: mmengine's own URL loader runs the payload.
        load_from_http(f'{url}/evil.pth', map_location='cpu')
        assert osp.isdir(checkpoints.marker)
    finally:
        server.shutdown()


def test_truncated_corrupt_or_wrong_kind_of_checkpoint(tmp_path, checkpoints, train_tool,
                                                       test_tool):
    det = _tiny_config(tmp_path, 'det')
    with pytest.raises(SystemExit) as info:
        test_tool.main([det, checkpoints.truncated, '--work-dir', str(tmp_path / 'work')])
    message = _exit_message(info)
    assert f'Cannot read checkpoint {checkpoints.truncated}' in message, message
    assert 'truncated or corrupt' in message
    with pytest.raises(SystemExit) as info:
        test_tool.main([det, checkpoints.garbage, '--work-dir', str(tmp_path / 'work')])
    message = _exit_message(info)
    assert f'checkpoint {checkpoints.garbage}' in message, message
    assert 'is not a PyTorch checkpoint' in message
    # --resume needs a training checkpoint, not bare weights
    with pytest.raises(SystemExit) as info:
        train_tool.main([det, '--resume', checkpoints.weights, '--work-dir', str(tmp_path / 'w')])
    assert 'is not a training checkpoint' in _exit_message(info)
    assert f'load_from={checkpoints.weights}' in _exit_message(info)
    # bare --resume: last_checkpoint names a file cut short -> the older checkpoints are listed
    work_dir = tmp_path / 'resume_work'
    work_dir.mkdir()
    older = work_dir / 'iter_2.pth'
    torch.save({'state_dict': _weights(), 'meta': {'iter': 2, 'epoch': 0}}, str(older))
    os.replace(checkpoints.truncated, str(work_dir / 'iter_4.pth'))
    (work_dir / 'last_checkpoint').write_text(str(work_dir / 'iter_4.pth'))
    with pytest.raises(SystemExit) as info:
        train_tool.main([det, '--resume', '--work-dir', str(work_dir)])
    message = _exit_message(info)
    assert f'Cannot read latest checkpoint (from {work_dir / "last_checkpoint"})' in message
    assert str(older) in message and 'resume from one with --resume PATH' in message
    with pytest.raises(CheckpointError, match='open-mmlab:// checkpoints'):
        check_checkpoint('open-mmlab://resnet50')


# ============================================================================ 3. SIGKILL + resume
def _kill_after_first_checkpoint(train, work_dir, cwd, timeout=180):
    """Start ``train`` (a command) in ``work_dir``, SIGKILL it as soon as ``last_checkpoint``
    names a checkpoint, and return that checkpoint's path."""
    proc = subprocess.Popen(train + ['--work-dir', str(work_dir)], cwd=str(cwd), env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + timeout
        marker = work_dir / 'last_checkpoint'
        while not (marker.exists() and marker.read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, 'no checkpoint was written'
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL  # killed mid-run, not finished
    finally:
        if proc.poll() is None:
            proc.kill()
    return marker.read_text().strip()


def _augmentations(dataloader_cfg, epochs, **overrides):
    """Per epoch, what the training dataloader built from ``dataloader_cfg`` (as SampleSeedingHook
    rebuilds it) delivers: per sample (image, flip, shape after
    resize / crop, a digest of the pixels)."""
    import hashlib

    from mmengine.runner import Runner

    from training_extras.sample_seeding import seeded_train_dataloader
    loader = Runner.build_dataloader(
        seeded_train_dataloader(dict(dataloader_cfg, **overrides), seed=0), seed=0)
    draws = []
    for epoch in epochs:
        loader.batch_sampler.sampler.set_epoch(epoch)  # as mmengine's DistSamplerSeedHook does
        drawn = []
        for batch in loader:
            for inputs, sample in zip(batch['inputs'], batch['data_samples']):
                drawn.append((osp.basename(sample.img_path), sample.flip_direction,
                              tuple(sample.img_shape),
                              hashlib.sha1(inputs.numpy().tobytes()).hexdigest()[:12]))
        draws.append(drawn)
    del loader  # shuts its workers down
    return draws


def test_every_epoch_draws_new_augmentations_whatever_the_workers(tmp_path):
    """The Mask R-CNN paper config's training dataloader (flip, multi-scale resize or resize +
    crop + resize; 2 persistent workers): every epoch draws new augmentations of each image; a
    new dataloader started in epoch 1 (a resumed run) delivers exactly what the uninterrupted one
    delivered in epoch 1; and 0 or 2 workers, persistent or not, deliver the same. Without the
    per-sample seeds (``sample_seeding=False``: mmengine's per-worker seeds) neither holds."""
    from mmengine.registry import init_default_scope
    init_default_scope('mmdet')
    config = Config.fromfile(_paper_config(tmp_path, 'det'))
    cfg = config.train_dataloader
    assert cfg.num_workers == 2 and cfg.persistent_workers
    first, second = _augmentations(cfg, [0, 1])
    by_image = [dict((d[0], d[1:]) for d in epoch) for epoch in (first, second)]
    assert by_image[0].keys() == by_image[1].keys() and len(by_image[0]) == 8
    changed = [name for name in by_image[0] if by_image[0][name] != by_image[1][name]]
    assert len(changed) == 8, changed  # each image is augmented anew (pixels differ)
    assert len({d[1:3] for d in first + second}) > 4  # flips and sizes vary
    # a resumed run: new workers, started in epoch 1
    assert _augmentations(cfg, [1]) == [second]
    # whatever the workers: none, or 2 re-created every epoch
    assert _augmentations(cfg, [0, 1], num_workers=0, persistent_workers=False) == [
        first, second]
    assert _augmentations(cfg, [0, 1], persistent_workers=False) == [first, second]

    # mmengine's seeding, for comparison: re-created workers repeat the first epoch's random
    # numbers (same flips and sizes, position by position, only the image order is shuffled) ...
    plain = dict(sample_seeding=False)
    epoch0, epoch1 = _augmentations(cfg, [0, 1], persistent_workers=False, **plain)
    assert [d[1:3] for d in epoch0] == [d[1:3] for d in epoch1]
    assert [d[0] for d in epoch0] != [d[0] for d in epoch1]
    # ... and persistent workers restarted in epoch 1 draw other numbers than the ones that ran
    # through epoch 0
    assert _augmentations(cfg, [1], **plain) != _augmentations(cfg, [0, 1], **plain)[1:]


def _kill_while_saving(train, work_dir, cwd, env, name):
    """Start ``train`` (a command whose config imports the probes) in ``work_dir`` and SIGKILL it
    half-way through writing checkpoint ``name`` (``_StallingSaveHook``)."""
    marker = work_dir.parent / f'saving_{name}'
    proc = subprocess.Popen(train + ['--work-dir', str(work_dir)], cwd=str(cwd), env=dict(
        env, STALL_SAVE=name, STALL_SAVE_MARKER=str(marker)), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        _wait_for(marker, [proc])
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()


@CPU_ONLY
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_paper_configs_resume_identically_with_persistent_workers(tmp_path, task, train_tool,
                                                                  probes):
    """The paper configs themselves (Mask R-CNN 3x: epoch-based, DefaultSampler +
    AspectRatioBatchSampler, flip + multi-scale resize / crop; Semantic FPN 80k: iteration-based,
    InfiniteSampler, random resize + crop + flip + photometric distortion), with their 2
    persistent dataloader workers and a validation after every checkpoint: a run killed with
    SIGKILL (``tools/train.py`` in a subprocess), continued with ``--resume``, repeats the losses
    of an uninterrupted run bit for bit: drop path, RPN / RoI sampling, the augmentations and the
    sampler all continue where they were, and the validations do not disturb the training's
    random stream. For the epoch-based loop this needs the per-sample seeds
    (``SampleKeyBatchSampler``): mmengine's workers restart from their first-epoch seeds. (The
    uninterrupted and the resumed run run in this process.)

    The detector's run is killed right after its first checkpoint. The segmentor's, with
    ``max_keep_ckpts=1``, half-way through writing its second, iter_4.pth: iter_2.pth is still
    there and complete, last_checkpoint names it, iter_4 exists only as an incomplete .tmp file;
    a bare --resume continues from iter_2.pth and removes the .tmp. (mmengine alone would have
    deleted iter_2.pth before writing iter_4.pth, left iter_4.pth cut short under its final name
    and a last_checkpoint naming a deleted file.)"""
    epochs, iters = 2, 4  # det: 2 epochs x 4 iterations; seg: 4 iterations, checkpoint every 2
    keep_one = "default_hooks['checkpoint']['max_keep_ckpts'] = 1" if task == 'seg' else ''
    ref, resumed = (_paper_config(tmp_path, task, name=f'{task}_{name}', epochs=epochs,
                                  iters=iters, validate=True, extra=keep_one)
                    for name in ('ref', 'resumed'))
    stall = (keep_one + '\n' + probes.imports
             + "custom_hooks = _base_.custom_hooks + [dict(type='_StallingSaveHook')]")
    killed = _paper_config(tmp_path, task, name=f'{task}_killed', epochs=epochs, iters=iters,
                           validate=True, extra=stall if task == 'seg' else '')
    total = epochs * 4 if task == 'det' else iters
    train_tool.main([ref, '--work-dir', str(tmp_path / 'ref')])
    log = newest_run_log(tmp_path / 'ref')
    assert "'num_workers': 2" in log or 'num_workers=2' in log
    metric = 'coco/bbox_mAP' if task == 'det' else 'mIoU'
    assert log.count(f'{metric}: ') == (epochs if task == 'det' else iters // 2)  # validations
    expected = _losses(tmp_path / 'ref')[0]
    assert sorted(expected) == list(range(1, total + 1))

    work_dir = tmp_path / 'killed'
    train = [sys.executable, osp.join(REPO, 'tools', 'train.py'), killed]
    if task == 'det':
        checkpoint = _kill_after_first_checkpoint(train, work_dir, tmp_path)
    else:
        _kill_while_saving(train, work_dir, tmp_path, probes.env, 'iter_4.pth')
        checkpoint = str(work_dir / 'iter_2.pth')
        assert _checkpoint_files(work_dir) == ['iter_2.pth', 'iter_4.pth.tmp', 'last_checkpoint']
        assert (work_dir / 'last_checkpoint').read_text() == checkpoint
        check_checkpoint(checkpoint, kind='resume')  # complete
        with pytest.raises(CheckpointError, match='truncated'):  # the interrupted one
            check_checkpoint(str(work_dir / 'iter_4.pth.tmp'), kind='resume')
    done = int(re.search(r'(\d+)\.pth$', checkpoint).group(1)) * (4 if task == 'det' else 1)
    assert done < total
    # resumed in this process, without the probe
    train_tool.main([resumed, '--work-dir', str(work_dir), '--resume'])
    log = newest_run_log(work_dir)
    assert f'Load checkpoint from {checkpoint}' in log
    after = _losses(work_dir)[-1]
    assert sorted(after) == list(range(done + 1, total + 1))
    assert after == {i: expected[i] for i in after}  # bit-identical
    if task == 'seg':
        assert f'Removed {work_dir / "iter_4.pth.tmp"}: an incomplete checkpoint' in log
        assert _checkpoint_files(work_dir) == ['iter_4.pth', 'last_checkpoint']  # keep 1
        assert (work_dir / 'last_checkpoint').read_text() == str(work_dir / 'iter_4.pth')


SHAPES_CLASSES = ('circle', 'square', 'triangle')


def _check_checkpoint_is_portable(path: str) -> None:
    """The training extras' checkpoints open under torch's default ``weights_only`` loading and
    carry the class names of the data they were trained on, not COCO's or ADE20k's."""
    checkpoint = load_as_plain_torch(path)
    assert tuple(checkpoint['meta']['dataset_meta']['classes']) == SHAPES_CLASSES


# ============================================================================ 4. distributed
@CPU_ONLY
def test_dist_train_and_dist_test_on_two_cpu_processes(tmp_path, test_tool):
    """tools/dist_train.sh CONFIG 2 trains a detector with gloo (SyncBN kept in the config), rank
    0 alone writes checkpoints and logs; tools/dist_test.sh gathers both ranks' predictions of
    the 5 test images (one rank pads) into the metric of a single-process evaluation. (The
    segmentor's distributed runs: the slurm test below.)

    The last of the 4 layers feeds no output (out_indices end at 2): DDP runs with mmengine's
    find_unused_parameters=False, which fails at the second iteration on a parameter that got no
    gradient in the first, unless the backbone leaves that layer out of training.

    Every gradient has its parameter's strides, so DDP's reducer does not warn "Grad strides do
    not match bucket view strides" (it did for the LPI depthwise convs: channels-last gradients
    of (D, 1, 3, 3) weights): the ranks' Python warnings are shown for this."""
    cfg = _tiny_config(tmp_path, 'det', iters=2, ckpt=2, validate=False,
                       out_indices=(0, 1, 1, 2))
    work_dir = tmp_path / 'train'
    env = dict(ENV, PORT=str(_free_port()), PYTHONWARNINGS='default')
    proc, log = _run(['bash', osp.join(REPO, 'tools', 'dist_train.sh'), cfg, '2',
                      '--work-dir', str(work_dir)], tmp_path, env=env)
    assert proc.returncode == 0, log[-4000:]
    assert 'Grad strides do not match' not in log
    assert "dist_cfg=dict(backend='gloo', timeout=1800)" in log  # the collective timeout
    assert 'Distributed training: True' in log
    assert "type='CPUDistributedDataParallel'" in log
    assert 'find_unused_parameters=True' not in log
    entries = os.listdir(work_dir)
    runs = [d for d in entries if osp.isdir(work_dir / d)]
    assert len(runs) == 1  # one run directory (rank 0's timestamp)
    assert sorted(set(entries) - set(runs)) == sorted(
        [osp.basename(cfg), 'iter_2.pth', 'last_checkpoint'])
    assert len(glob.glob(str(work_dir / runs[0] / '*.log'))) == 1  # rank 0's log only
    checkpoint = str(work_dir / 'iter_2.pth')
    check_checkpoint(checkpoint, kind='resume')  # complete, written once
    _check_checkpoint_is_portable(checkpoint)
    rng = load_checkpoint_file(checkpoint)['rng_state']  # both ranks' random states
    assert rng['world_size'] == 2 and len(rng['states']) == 2

    env = dict(ENV, PORT=str(_free_port()))
    proc, log = _run(['bash', osp.join(REPO, 'tools', 'dist_test.sh'), cfg, checkpoint, '2',
                      '--work-dir', str(tmp_path / 'dist_test'),
                      '--out', str(tmp_path / 'dist.pkl')], tmp_path, env=env)
    assert proc.returncode == 0, log[-4000:]
    test_tool.main([cfg, checkpoint, '--work-dir', str(tmp_path / 'single_test'),
                    '--out', str(tmp_path / 'single.pkl')])
    distributed = evaluation_metrics(tmp_path / 'dist_test')
    single = evaluation_metrics(tmp_path / 'single_test')
    assert 'coco/bbox_mAP' in single
    assert distributed == single
    # The gathered predictions are those of the single process: all 5 images, in order.
    import mmengine
    gathered, alone = (mmengine.load(str(tmp_path / f'{n}.pkl')) for n in ('dist', 'single'))
    assert [r['img_path'] for r in gathered] == [r['img_path'] for r in alone]
    assert len(alone) == 5
    _assert_close(gathered, alone)


@pytest.fixture
def live_ddp_at_destroy(monkeypatch):
    """A one-process gloo world for in-process ``--launcher pytorch`` runs (set MASTER_PORT per
    run), and the number of live DistributedDataParallel objects at every
    ``destroy_process_group`` call, as a list."""
    import gc

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    for key, value in dict(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0',
                           MASTER_ADDR='127.0.0.1').items():
        monkeypatch.setenv(key, value)
    counts = []
    destroy = dist.destroy_process_group

    def checked_destroy(*args, **kwargs):
        counts.append(sum(isinstance(obj, DistributedDataParallel) for obj in gc.get_objects()))
        return destroy(*args, **kwargs)

    monkeypatch.setattr(dist, 'destroy_process_group', checked_destroy)
    yield counts
    assert not dist.is_initialized()


@HOOKS.register_module(name='_CrashHook', force=True)
class _CrashHook(Hook):
    """Test probe: a bug that strikes in the middle of training."""

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        raise RuntimeError('crash in iteration 1')


@CPU_ONLY
def test_a_crashing_rank_frees_its_ddp_before_the_group_is_destroyed(tmp_path, monkeypatch,
                                                                     train_tool,
                                                                     live_ddp_at_destroy):
    """A distributed run that fails with a bug in a hook: the error reaches the user, and still
    no DDP model is alive when the process group is destroyed (the traceback's frames would
    otherwise keep the Runner). (A NaN loss, which the tool turns into a SystemExit: the
    detector's diverging run above.)"""
    cfg = _tiny_config(tmp_path, 'det', iters=2, ckpt=2, validate=False,
                       extra="custom_hooks = _base_.custom_hooks + [dict(type='_CrashHook')]")
    monkeypatch.setenv('MASTER_PORT', str(_free_port()))
    with pytest.raises(RuntimeError) as excinfo:
        train_tool.main([cfg, '--launcher', 'pytorch', '--work-dir', str(tmp_path / 'train')])
    assert 'crash in iteration 1' in str(excinfo.value)
    assert live_ddp_at_destroy == [0]
    assert any(entry.name == 'after_train_iter' for entry in excinfo.traceback)


# A stand-in for slurm's srun: it records its own arguments and starts --ntasks copies of the
# command with the variables a slurm step sets (one node). `scontrol show hostname` prints it.
_FAKE_SRUN = r"""#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
opts, i = {{}}, 0
while args[i].startswith('-'):
    if '=' in args[i]:
        key, value = args[i].split('=', 1)
        i += 1
    else:
        key, value = args[i], args[i + 1]
        i += 2
    opts[key] = value
with open(os.environ['FAKE_SRUN_RECORD'], 'w') as f:
    json.dump(opts, f)
ntasks = int(opts['--ntasks'])
procs = [subprocess.Popen(args[i:], env=dict(
    os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(ntasks),
    SLURM_NODELIST='fakenode')) for rank in range(ntasks)]
sys.exit(max(p.wait() for p in procs))
"""
_FAKE_SCONTROL = """#!/usr/bin/env bash
[ "$1 $2 $3" = "show hostname fakenode" ] && echo 127.0.0.1
"""


@CPU_ONLY
def test_slurm_train_and_slurm_test_on_two_cpu_tasks(tmp_path, probes):
    """tools/slurm_train.sh / slurm_test.sh hand srun the partition, job name and task counts,
    and the tools take rank, world size and master address from slurm's variables (via
    ``scontrol show hostname``): 2 tasks train a segmentor with gloo, 1 task tests it (the
    gathered metric of 2 ranks equals one process's: the detector's torchrun test above). srun
    and scontrol are stand-ins (no cluster here). As in the detector's torchrun test above, the
    last layer feeds no output.

    The same training is the fault of a NaN on one rank: its loss becomes NaN on rank 1 only, at
    iteration 3. Both ranks stop at iteration 3 with the message (naming rank 1's terms), none
    hangs (srun's stand-in waits for both tasks and stops neither), and no checkpoint of the
    diverged weights is written; the slurm test reads the last finite one."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('srun', _FAKE_SRUN.format(python=sys.executable)),
                       ('scontrol', _FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / 'srun.json'
    env = dict(probes.env, PATH=f'{bin_dir}:{ENV["PATH"]}', FAKE_SRUN_RECORD=str(record),
               GPUS='2', GPUS_PER_NODE='2', CPUS_PER_TASK='1', MASTER_PORT=str(_free_port()))
    for key in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR'):
        env.pop(key, None)
    cfg = _tiny_config(tmp_path, 'seg', iters=6, ckpt=2, validate=False,
                       out_indices=(0, 1, 1, 2), extra=probes.imports + (
                           "custom_hooks = _base_.custom_hooks + "
                           "[dict(type='_NaNOnRankHook', rank=1, iteration=3)]"))
    work_dir = tmp_path / 'train'
    start = time.time()
    proc, log = _run(['bash', osp.join(REPO, 'tools', 'slurm_train.sh'), 'gpu_part', 'xcit_job',
                      cfg, str(work_dir)], tmp_path, env=env, timeout=180)
    assert time.time() - start < 120  # no rank waits for the one that stopped
    assert proc.returncode != 0
    assert json.loads(record.read_text()) == {
        '-p': 'gpu_part', '--job-name': 'xcit_job', '--gres': 'gpu:2', '--ntasks': '2',
        '--ntasks-per-node': '2', '--cpus-per-task': '1', '--kill-on-bad-exit': '1'}
    assert 'Distributed training: True' in log and "launcher = 'slurm'" in log
    stopped = 'error: Training stopped: the loss became NaN or infinite at iteration 3/6.'
    assert log.count(stopped) == 2, log[-4000:]  # both ranks, at the same iteration
    message = log[log.index(stopped):].splitlines()[0]
    assert 'Non-finite loss terms: rank 1: decode.loss_ce=nan, loss=nan.' in message
    assert 'rank 0:' not in message  # rank 0's loss was finite
    assert f'--resume {work_dir / "iter_2.pth"}' in message
    assert sorted(f for f in os.listdir(work_dir) if f.endswith('.pth')) == ['iter_2.pth']
    assert sorted(_losses(work_dir)[0]) == [1, 2]
    checkpoint = str(work_dir / 'iter_2.pth')
    _check_checkpoint_is_portable(checkpoint)
    rng = load_checkpoint_file(checkpoint)['rng_state']
    assert rng['world_size'] == 2

    env.update(MASTER_PORT=str(_free_port()), GPUS='1', GPUS_PER_NODE='1')
    proc, log = _run(['bash', osp.join(REPO, 'tools', 'slurm_test.sh'), 'gpu_part', 'xcit_eval',
                      cfg, checkpoint, '--work-dir', str(tmp_path / 'slurm_test')], tmp_path,
                     env=env)
    assert proc.returncode == 0, log[-4000:]
    assert json.loads(record.read_text())['--job-name'] == 'xcit_eval'
    assert "launcher = 'slurm'" in log
    assert 'mIoU' in evaluation_metrics(tmp_path / 'slurm_test')


def _assert_close(a, b, where='results'):
    """Recursive comparison; tensors to 1e-4 (batches are composed differently per rank)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_close(a[key], b[key], f'{where}.{key}')
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_close(x, y, f'{where}[{i}]')
    elif isinstance(a, torch.Tensor) or hasattr(a, 'shape'):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        assert a.shape == b.shape, where
        assert torch.allclose(a.double(), b.double(), atol=1e-4), where
    else:
        assert a == b, where


# ============================================================================ 6. faults mid-run
# Test probes for runs in subprocesses: a module put on their PYTHONPATH and imported by the
# config (custom_imports). Each hook is inert unless its trigger is met.
_PROBES = '''
import os
import time

from mmengine.dist import get_rank
from mmengine.hooks import Hook
from mmengine.registry import HOOKS


@HOOKS.register_module(force=True)
class _MarkIterationHook(Hook):
    """Writes OUT_DIR/rank<R>.iter<N>, holding the pid, before training iteration N."""

    def __init__(self, out_dir):
        self.out_dir = out_dir

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        path = os.path.join(self.out_dir, f'rank{get_rank()}.iter{runner.iter + 1}')
        with open(path, 'w') as f:
            f.write(str(os.getpid()))


@HOOKS.register_module(force=True)
class _NaNOnRankHook(Hook):
    """Makes the backbone's features NaN on rank RANK at iteration ITERATION: a NaN loss there."""

    def __init__(self, rank, iteration):
        self.rank, self.iteration = rank, iteration

    def before_train(self, runner):
        model = runner.model.module if hasattr(runner.model, 'module') else runner.model

        def poison(module, inputs, outputs):
            if get_rank() == self.rank and runner.iter + 1 == self.iteration and module.training:
                return tuple(o * float('nan') for o in outputs)
        model.backbone.register_forward_hook(poison)


@HOOKS.register_module(force=True)
class _StallingSaveHook(Hook):
    """With $STALL_SAVE=NAME: the file write of checkpoint NAME (or NAME.tmp) writes half of the
    file, creates $STALL_SAVE_MARKER and then waits, to be killed half-way through the save."""

    def __init__(self):
        from mmengine.fileio.backends import LocalBackend
        put = LocalBackend.put

        def stalling_put(backend, obj, filepath):
            name = os.environ.get('STALL_SAVE')
            if name and os.path.basename(str(filepath)).startswith(name):
                with open(filepath, 'wb') as f:
                    f.write(obj[:len(obj) // 2])
                    f.flush()
                    os.fsync(f.fileno())
                open(os.environ['STALL_SAVE_MARKER'], 'w').close()
                time.sleep(600)
            return put(backend, obj, filepath)
        LocalBackend.put = stalling_put
'''


@pytest.fixture
def probes(tmp_path):
    """(environment with the probe module on PYTHONPATH, the config lines that import it)."""
    (tmp_path / '_reliability_probes.py').write_text(_PROBES)
    env = dict(ENV, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), REPO] + [p for p in [ENV.get('PYTHONPATH')] if p]))
    imports = ("custom_imports = dict(imports=['xcit_mm', '_reliability_probes'], "
               "allow_failed_imports=False)\n")
    return SimpleNamespace(env=env, imports=imports)


def _wait_for(path, procs, timeout=180):
    deadline = time.time() + timeout
    while not osp.exists(str(path)):
        assert all(p.poll() is None for p in procs), f'a process ended before {path} appeared'
        assert time.time() < deadline, f'{path} did not appear'
        time.sleep(0.02)


class _TwoRanks:
    """tools/train.py started as 2 gloo processes without a launcher (``--launcher pytorch``,
    the variables set by hand), training the Semantic FPN paper config (2 persistent dataloader
    workers each) with the collective timeout set to 10 s; each rank marks its iterations
    (``_MarkIterationHook``). ``exited`` holds rank 0's exit time, taken by a watching thread."""

    def __init__(self, tmp_path, probes):
        tmp_path.mkdir()
        self.marks = tmp_path / 'marks'
        self.marks.mkdir()
        cfg = _paper_config(tmp_path, 'seg', iters=400, extra=probes.imports + (
            f"custom_hooks = _base_.custom_hooks + [\n"
            f"    dict(type='_MarkIterationHook', out_dir='{self.marks}')]\n"
            "env_cfg = dict(dist_cfg=dict(timeout=10))"))
        train = [sys.executable, osp.join(REPO, 'tools', 'train.py'), cfg, '--launcher',
                 'pytorch', '--work-dir', str(tmp_path / 'work')]
        port = str(_free_port())
        self.log = open(tmp_path / 'rank0.txt', 'w+')
        self.procs = [subprocess.Popen(train, cwd=str(tmp_path), env=dict(
            probes.env, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE='2',
            MASTER_ADDR='127.0.0.1', MASTER_PORT=port), stdout=out, stderr=subprocess.STDOUT)
            for rank, out in ((0, self.log), (1, subprocess.DEVNULL))]
        self.victim = None
        self.exited = None
        threading.Thread(target=self._watch_rank0, daemon=True).start()

    def _watch_rank0(self):
        self.procs[0].wait()
        self.exited = time.time()

    def signal_rank1_at_iteration_3(self, signum) -> float:
        """Send ``signum`` to rank 1 once both ranks have begun iteration 3; the time sent."""
        _wait_for(self.marks / 'rank1.iter3', self.procs)
        _wait_for(self.marks / 'rank0.iter3', self.procs)
        self.victim = int((self.marks / 'rank1.iter3').read_text())
        sent = time.time()
        os.kill(self.victim, signum)
        return sent

    def rank0_log_after_exit(self, timeout=90) -> str:
        assert self.procs[0].wait(timeout=timeout) != 0
        while self.exited is None:  # the watching thread records the time it saw
            time.sleep(0.01)
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        if self.victim is not None:
            try:
                os.kill(self.victim, signal.SIGKILL)
            except OSError:
                pass
        for proc in self.procs:
            proc.wait()
        self.log.close()


@CPU_ONLY
def test_a_killed_or_hung_rank_stops_the_other_within_a_bounded_time(tmp_path, probes):
    """Two pairs of gloo processes (``_TwoRanks``: no launcher, persistent dataloader workers);
    at iteration 3, rank 1 of one pair is stopped with SIGSTOP (a hang), rank 1 of the other
    killed with SIGKILL. The second pair starts while the first pair's rank 0 waits out its
    collective timeout.

    - kill: rank 0 (started without a launcher that would clean up) stops within seconds with a
      message that another rank has stopped. Its dataloader workers die with it, so the
      connection closes at once (torch's orphaned workers would keep it open up to 5 s).
    - stop: rank 0 stops after the collective timeout, set here to 10 s
      (``env_cfg.dist_cfg.timeout``; default 1800 s), saying so.
    (Under ``tools/dist_train.sh``, torchrun itself stops the other ranks: torch's behaviour.)"""
    pairs = []
    try:
        pairs.append(_TwoRanks(tmp_path / 'stop', probes))
        stopped = pairs[0].signal_rank1_at_iteration_3(signal.SIGSTOP)
        pairs.append(_TwoRanks(tmp_path / 'kill', probes))
        killed = pairs[1].signal_rank1_at_iteration_3(signal.SIGKILL)
        kill_log = pairs[1].rank0_log_after_exit()
        stop_log = pairs[0].rank0_log_after_exit()
    finally:
        for pair in pairs:
            pair.stop()
    for log in (kill_log, stop_log):
        assert 'error: Distributed training stopped on rank 0 of 2 at iteration ' in log, \
            log[-3000:]
    assert 'another rank has stopped (killed, out of memory or crashed)' in kill_log
    assert pairs[1].exited - killed < 30, pairs[1].exited - killed  # the connection closes
    assert 'did not answer within the collective timeout (10 s' in stop_log
    assert 'env_cfg.dist_cfg.timeout=SECONDS' in stop_log
    assert 10 <= pairs[0].exited - stopped < 45, pairs[0].exited - stopped


def _checkpoint_files(work_dir):
    return sorted(f for f in os.listdir(work_dir) if not osp.isdir(osp.join(work_dir, f))
                  and not f.endswith('.py'))


def test_a_full_disk_during_a_save_is_named_and_keeps_the_earlier_checkpoints(
        tmp_path, train_tool, monkeypatch):
    """The write of iter_4.pth fails with ENOSPC after part of the file: the run stops with an
    error naming the file and the free space; iter_2.pth and last_checkpoint are intact (also
    with max_keep_ckpts=1), and no partial file is left."""
    import errno

    from mmengine.fileio.backends import LocalBackend
    cfg = _tiny_config(tmp_path, 'seg', iters=6, ckpt=2, validate=False,
                       extra="default_hooks['checkpoint']['max_keep_ckpts'] = 1")
    work_dir = tmp_path / 'work'
    put = LocalBackend.put

    def full_disk(backend, obj, filepath):
        if osp.basename(str(filepath)).startswith('iter_4.pth'):
            with open(filepath, 'wb') as f:
                f.write(obj[:len(obj) // 3])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filepath))
        return put(backend, obj, filepath)

    monkeypatch.setattr(LocalBackend, 'put', full_disk)
    with pytest.raises(SystemExit) as info:
        train_tool.main([cfg, '--work-dir', str(work_dir)])
    message = _exit_message(info)
    assert message.startswith(f'error: Cannot save checkpoint {work_dir / "iter_4.pth"}: the '
                              f'disk is full (OSError: [Errno {errno.ENOSPC}] No space left on '
                              f'device'), message
    assert re.search(rf'Free space on {re.escape(str(work_dir))}: [\d.]+ [KMGT]?B\.', message)
    assert f'The earlier checkpoints are intact ({work_dir / "iter_2.pth"})' in message
    assert f'last_checkpoint names {work_dir / "iter_2.pth"}' in message
    assert _checkpoint_files(work_dir) == ['iter_2.pth', 'last_checkpoint']
    assert (work_dir / 'last_checkpoint').read_text() == str(work_dir / 'iter_2.pth')
    check_checkpoint(str(work_dir / 'iter_2.pth'), kind='resume')
    assert sorted(_losses(work_dir)[0]) == [1, 2, 3, 4]


def test_last_checkpoint_is_replaced_atomically(tmp_path, monkeypatch):
    """A job killed while last_checkpoint is rewritten leaves the old content (the rename is
    the only step that changes it): here the rename itself fails."""
    from training_extras.hooks.safe_checkpoint_hook import write_text_atomically
    marker = tmp_path / 'last_checkpoint'
    write_text_atomically(str(marker), '/work/iter_2.pth')
    monkeypatch.setattr(os, 'replace', lambda *a: (_ for _ in ()).throw(OSError('killed')))
    with pytest.raises(OSError, match='killed'):
        write_text_atomically(str(marker), '/work/iter_4.pth')
    assert marker.read_text() == '/work/iter_2.pth'


@pytest.mark.parametrize('fault', ['missing', 'skipped'])
def test_a_bad_image_halfway_through_an_epoch_is_named(tmp_path, train_tool, fault):
    """The image at position 4 of the first epoch (the third batch; 2 dataloader workers) is
    deleted: training stops at that batch with an error naming the sample's index and file,
    instead of a traceback relayed from a worker. Replaced by bytes that are not an image, with
    ``SampleSeedingHook(on_bad_sample='skip')``: it is replaced by the next readable sample,
    logged and counted, and training completes. (Both faults reach the same error wrapper.)"""
    import shutil

    from mmengine.registry import init_default_scope
    root = tmp_path / 'data'
    shutil.copytree(_data_root('det'), str(root))
    cfg = _tiny_config(tmp_path, 'det', iters=4, ckpt=4, validate=False, extra=(
        "train_dataloader.update(num_workers=2, persistent_workers=True)"))
    init_default_scope('mmdet')
    order = [d[0] for d in _augmentations(Config.fromfile(cfg).train_dataloader, [0],
                                          num_workers=0, persistent_workers=False)[0]]
    victim = str(root / 'train' / order[4])
    if fault == 'missing':
        os.remove(victim)
    else:
        with open(victim, 'wb') as f:
            f.write(b'<html>not an image</html>')
    work_dir = tmp_path / 'work'
    argv = [cfg, '--work-dir', str(work_dir), '--cfg-options',
            f'train_dataloader.dataset.data_root={root}/']
    if fault == 'skipped':
        train_tool.main(argv + ["custom_hooks.1.on_bad_sample=skip"])
        assert sorted(_losses(work_dir)[0]) == [1, 2, 3, 4]
        log = newest_run_log(work_dir)
        assert re.search(rf'Skipped training sample \d+ \(img_path={re.escape(victim)}\) at '
                         rf'iteration 3: \w+', log), log[-3000:]
        assert '1 unreadable training sample(s) were skipped' in log
        return
    with pytest.raises(SystemExit) as info:
        train_tool.main(argv)
    message = _exit_message(info)
    assert re.match(rf'error: Cannot load training sample \d+ of ShapesCocoDataset '
                    rf'\(img_path={re.escape(victim)}\): ', message), message
    assert 'Traceback' not in message and 'worker process' not in message
    assert "SampleSeedingHook(on_bad_sample='skip')" in message
    if fault == 'missing':
        assert 'FileNotFoundError' in message
    assert sorted(_losses(work_dir)[0]) == [1, 2]  # stopped at the third batch


# ============================================================================ 5. mixed precision
_DTYPES = []


@HOOKS.register_module(name='_AmpProbeHook', force=True)
class _AmpProbeHook(Hook):
    """Test probe: records, per training forward, the dtype of XCA's qkv projection (bfloat16
    under autocast)."""

    def before_train(self, runner):
        model = runner.model.module if hasattr(runner.model, 'module') else runner.model
        xca = model.backbone.layers[0].attn
        xca.qkv.register_forward_hook(
            lambda m, i, o: _DTYPES.append(('qkv', o.dtype)) if m.training else None)


@CPU_ONLY
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_amp_on_cpu_trains_in_bfloat16_with_finite_losses(tmp_path, request, monkeypatch,
                                                          train_tool, test_tool, task):
    """``--amp`` on a CPU: bfloat16 autocast, finite losses and weights.

    The detector's run and a test of its checkpoint also run tools/train.py and tools/test.py
    with ``--launcher pytorch`` (one gloo process, in this process): when the process group is
    destroyed, no DistributedDataParallel is alive any more. A DDP freed after the group joins
    gloo's threads with the GIL held and can hang the rank."""
    _DTYPES.clear()
    cfg = _tiny_config(tmp_path, task, iters=3, ckpt=3, validate=False,
                       extra="custom_hooks = _base_.custom_hooks + [dict(type='_AmpProbeHook')]")
    work_dir = tmp_path / 'work'
    launcher = []
    if task == 'det':
        live_ddp_at_destroy = request.getfixturevalue('live_ddp_at_destroy')
        monkeypatch.setenv('MASTER_PORT', str(_free_port()))
        launcher = ['--launcher', 'pytorch']
    train_tool.main([cfg, '--amp', '--work-dir', str(work_dir), *launcher])
    if task == 'det':
        monkeypatch.setenv('MASTER_PORT', str(_free_port()))
        test_tool.main([cfg, str(work_dir / 'iter_3.pth'), '--launcher', 'pytorch',
                        '--work-dir', str(tmp_path / 'test')])
        assert live_ddp_at_destroy == [0, 0]  # one destroy per tool, no DDP left at either
        assert 'coco/bbox_mAP' in evaluation_metrics(tmp_path / 'test')
    dumped = Config.fromfile(str(work_dir / osp.basename(cfg)))
    assert dumped.optim_wrapper.type == 'CPUAmpOptimWrapper'
    losses = _losses(work_dir)[0]
    assert sorted(losses) == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values()), losses
    assert ('qkv', torch.bfloat16) in _DTYPES  # the backbone ran under autocast
    # (that XCA's float32 island matters is tested on gradients against a float64 reference in
    # tests/test_gradients.py; the dtype seen here would be float32 with or without it)
    assert torch.isfinite(torch.stack([v.float().flatten()[:1] for v in load_checkpoint_file(
        str(work_dir / 'iter_3.pth'))['state_dict'].values()
        if v.is_floating_point()])).all()


@CPU_ONLY
def test_amp_config_conversion_without_gpu(train_tool):
    """A config that itself asks for AmpOptimWrapper runs with bfloat16 CPU autocast here."""
    cfg = Config(dict(optim_wrapper=dict(type='AmpOptimWrapper', loss_scale='dynamic',
                                         optimizer=dict(type='AdamW', lr=1e-4))))
    assert train_tool.use_cpu_amp(cfg) is True
    assert cfg.optim_wrapper == dict(type='CPUAmpOptimWrapper', dtype='bfloat16',
                                     optimizer=dict(type='AdamW', lr=1e-4))
    cfg.optim_wrapper = dict(type='AmpOptimWrapper', dtype='float16', optimizer=dict())
    with pytest.raises(SystemExit, match='bfloat16'):
        train_tool.use_cpu_amp(cfg)
    assert train_tool.use_cpu_amp(Config(dict(optim_wrapper=dict(type='OptimWrapper')))) is False


def test_cpu_amp_wrapper_rejects_float16_and_models_without_the_modules():
    linear = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)
    with pytest.raises(ValueError, match='only supports bfloat16'):
        CPUAmpOptimWrapper(dtype='float16', optimizer=optimizer)
    wrapper = CPUAmpOptimWrapper(optimizer=optimizer)
    with pytest.raises(ValueError, match='autocast_modules=None'):
        with wrapper.optim_context(linear):
            pass
    whole = CPUAmpOptimWrapper(optimizer=optimizer, autocast_modules=None)
    with whole.optim_context(linear):
        assert linear(torch.ones(1, 2)).dtype == torch.bfloat16
    assert linear(torch.ones(1, 2)).dtype == torch.float32


# ============================================================================ converter
def test_converted_full_model_file_keeps_dataset_meta(tmp_path):
    """tools/model_converters/convert_checkpoint.py --full-model keeps the source's meta."""
    from conftest import _load_tool
    src = str(tmp_path / 'src.pth')
    torch.save({'state_dict': {'backbone.layers.0.lpi.conv1.weight': torch.zeros(1),
                               'neck.x': torch.zeros(1)},
                'meta': dict(dataset_meta=dict(classes=SHAPES_CLASSES), epoch=3)}, src)
    dst = str(tmp_path / 'dst.pth')
    _load_tool('tools/model_converters/convert_checkpoint.py').main([src, dst, '--full-model'])
    meta = torch.load(dst, weights_only=True)['meta']
    assert tuple(meta['dataset_meta']['classes']) == SHAPES_CLASSES and meta['epoch'] == 3
