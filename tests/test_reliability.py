"""Reliability of long runs (issue 5): bad input, untrusted checkpoints, interrupted training,
distributed runs and mixed precision, on the built-in shapes data (CPU only).

Every training here is a few iterations of a tiny XCiT (32 channels, 4 layers) on 8 generated
64-pixel images, derived from the shapes configs (``configs/shapes/``) and, through them, from the
paper configs (SyncBN, AdamW, reliability hooks). Runs that must be separate processes (SIGKILL,
torchrun) are subprocesses with timeouts; the others call the tools' ``main`` in-process.
See docs/reliability.md for what each test establishes.
"""
import functools
import glob
import http.server
import json
import os
import os.path as osp
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

from xcit_mm.engine import (RELIABILITY_HOOKS, CheckFiniteLossHook, CPUAmpOptimWrapper,
                            NonFiniteLossError, RandomStateHook, ensure_reliability_hooks)
from xcit_mm.utils import (AnnotationFormatError, CheckpointError, check_annotation_formats,
                           check_checkpoint, coco_annotation_problem, load_checkpoint_file)

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
CONFIGS = osp.join(REPO, 'configs')
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore')
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason='CPU code path')


def _base(task: str) -> str:
    """The shapes config of ``task`` (fallback while it does not exist: its paper parent)."""
    pattern = {'det': 'mask_rcnn_*coco*.py', 'seg': '*ade*.py'}[task]
    for path in sorted(glob.glob(osp.join(CONFIGS, 'shapes', pattern))):
        try:
            Config.fromfile(path)
            return path
        except Exception:  # a config still being written
            continue
    return osp.join(CONFIGS, {'det': 'mask_rcnn_xcit_t12_p16_3x_coco.py',
                              'seg': 'sem_fpn_xcit_t12_p16_80k_ade20k.py'}[task])


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
    neck=dict(in_channels=[32] * 4, out_channels=32),
    rpn_head=dict(in_channels=32, feat_channels=32),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=32, roi_layer=dict(sampling_ratio=2)),
        bbox_head=dict(in_channels=32, fc_out_channels=64, num_classes=3),
        mask_roi_extractor=dict(out_channels=32, roi_layer=dict(sampling_ratio=2)),
        mask_head=dict(in_channels=32, conv_out_channels=32, num_convs=1, num_classes=3)),
    train_cfg=dict(rpn_proposal=dict(nms_pre=200, max_per_img=50),
                   rcnn=dict(sampler=dict(num=64))),
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
                 extra='', validate=True):
    """Write a tiny training config for ``task`` ('det' / 'seg') and return its path.

    The data (8 train / 5 val images of 64 px) is generated once per module by the
    ``shapes_data`` fixture and shared by all tests.
    """
    root = _data_root(task)
    text = {'det': _DET, 'seg': _SEG}[task].format(base=_base(task), root=root) + _COMMON.format(
        iters=iters, ckpt=ckpt, val_interval=val_interval or iters, lr=lr, extra=extra)
    if not validate:  # no validation during training (saves the evaluation's time)
        text += 'val_cfg = None\nval_dataloader = None\nval_evaluator = None\n'
    # mmengine keys its global Visualizer / MessageHub instances by name: unique names keep
    # in-process runs of this module from writing into each other's logs.
    unique = f'{name or task}_{tmp_path.name}'[-60:].replace('-', '_').replace('.', '_')
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
    from xcit_mm.datasets import generate_shapes
    base = tmp_path_factory.mktemp('shapes')
    for task, layout in (('det', 'coco'), ('seg', 'ade')):
        root = str(base / f'shapes_{layout}')
        generate_shapes(root, task=layout, num_train=8, num_val=5, image_size=64, seed=0)
        _DATA_ROOTS[task] = root
    yield
    _DATA_ROOTS.clear()


@pytest.fixture(scope='module', autouse=True)
def one_thread():
    """In-process runs use one thread, as the subprocesses do (OMP_NUM_THREADS=1): on a shared
    2-core machine, two OpenMP threads make bfloat16 kernels up to 100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    proc = subprocess.run(cmd, cwd=str(cwd), capture_output=True, text=True, timeout=timeout,
                          env=env or ENV)
    return proc, proc.stdout + proc.stderr


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
    # The three shared bases of the 24 paper configs (tests/test_configs.py checks the leaves;
    # the shapes configs inherit from them).
    for path in glob.glob(osp.join(CONFIGS, '_base_', 'xcit_*.py')):
        config = Config.fromfile(path)
        assert 'xcit_mm' in config.custom_imports.imports, path
        assert [h['type'] for h in config.custom_hooks] == list(RELIABILITY_HOOKS), path
    # A config without them gets them from tools/train.py, once.
    cfg = Config(dict(custom_hooks=[dict(type='EMAHook'), dict(type='RandomStateHook')]))
    assert ensure_reliability_hooks(cfg) == ['CheckFiniteLossHook']
    assert [h['type'] for h in cfg.custom_hooks] == [
        'EMAHook', 'RandomStateHook', 'CheckFiniteLossHook']
    assert ensure_reliability_hooks(cfg) == []


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


@pytest.mark.parametrize('task', ['det', 'seg'])
def test_diverging_training_stops_at_the_first_nan_iteration(tmp_path, train_tool, task):
    """A real run whose learning rate blows the weights up stops at the first non-finite loss,
    names that iteration, and writes no checkpoint of the diverged weights."""
    cfg = _tiny_config(tmp_path, task, iters=4, ckpt=1, lr=1e30, validate=False)
    work_dir = tmp_path / 'work'
    with pytest.raises(SystemExit) as info:
        train_tool.main([cfg, '--work-dir', str(work_dir)])
    message = _exit_message(info)
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
    """mmengine loads http(s) checkpoints with torch.hub.load_state_dict_from_url, which
    unpickles with weights_only=False: the file's code runs. The tools download it into the
    hub cache, check it with weights_only=True, and give the Runner the local copy."""
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
        # The hazard is real: the way mmengine loads URLs runs the payload.
        from mmengine.runner.checkpoint import CheckpointLoader
        CheckpointLoader.load_checkpoint(f'{url}/evil.pth', map_location='cpu')
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
@CPU_ONLY
def test_sigkilled_training_resumes_identically(tmp_path):
    """Kill -9 a run right after its first checkpoint; --resume continues with exactly the
    per-iteration losses of an uninterrupted run (drop path, RPN/RoI sampling, random flips and
    the sampler all continue where they were)."""
    # Validation after every checkpoint: it must not disturb the training random stream.
    cfg = _tiny_config(tmp_path, 'det', iters=6, ckpt=2, val_interval=2)
    train = [sys.executable, osp.join(REPO, 'tools', 'train.py'), cfg]
    reference, log = _run(train + ['--work-dir', str(tmp_path / 'ref')], tmp_path)
    assert reference.returncode == 0, log[-3000:]
    expected = _losses(tmp_path / 'ref')[0]
    assert sorted(expected) == list(range(1, 7))

    work_dir = tmp_path / 'killed'
    proc = subprocess.Popen(train + ['--work-dir', str(work_dir)], cwd=str(tmp_path), env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        marker = work_dir / 'last_checkpoint'
        # Non-empty: mmengine creates the marker, then writes the path into it.
        while not (marker.exists() and marker.read_text().strip()):
            assert proc.poll() is None and time.time() < deadline, 'no checkpoint was written'
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL  # killed mid-run, not finished
    finally:
        if proc.poll() is None:
            proc.kill()
    resumed_from = int((work_dir / 'last_checkpoint').read_text().strip()
                       .rsplit('iter_', 1)[1].split('.')[0])
    assert resumed_from < 6

    resumed, log = _run(train + ['--work-dir', str(work_dir), '--resume'], tmp_path)
    assert resumed.returncode == 0, log[-3000:]
    assert f'Load checkpoint from {work_dir / f"iter_{resumed_from}.pth"}' in log
    after = _losses(work_dir)[-1]
    assert sorted(after) == list(range(resumed_from + 1, 7))
    assert after == {i: expected[i] for i in after}  # bit-identical


def test_epoch_based_resume_is_identical(tmp_path, train_tool):
    """The paper's Mask R-CNN configs train by epochs: resuming from an epoch checkpoint (with
    validation after every epoch) repeats the uninterrupted run's losses exactly too."""
    ref, resumed = (_tiny_config(tmp_path, 'det', name=name, extra='\n'.join([
        "train_cfg = dict(_delete_=True, type='EpochBasedTrainLoop', max_epochs=2, "
        "val_interval=1)",
        "default_hooks = dict(logger=dict(interval=1), checkpoint=dict(by_epoch=True, "
        "interval=1, max_keep_ckpts=-1))",
        "log_processor = dict(by_epoch=True, window_size=1)"])) for name in ('ref', 'resumed'))
    train_tool.main([ref, '--work-dir', str(tmp_path / 'ref')])
    expected = _losses(tmp_path / 'ref')[0]
    assert len(expected) == 8  # 2 epochs x 4 iterations
    train_tool.main([resumed, '--work-dir', str(tmp_path / 'resumed'), '--resume',
                     str(tmp_path / 'ref' / 'epoch_1.pth')])
    after = _losses(tmp_path / 'resumed')[0]
    assert sorted(after) == [5, 6, 7, 8]
    assert after == {i: expected[i] for i in after}


# ============================================================================ 4. distributed
def _metrics(work_dir):
    """The metrics dict tools/test.py wrote (mmengine dumps it to <work_dir>/<time>/<time>.json)."""
    files = glob.glob(osp.join(str(work_dir), '*', '*.json'))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return {k: v for k, v in json.load(f).items() if k not in ('data_time', 'time')}


@CPU_ONLY
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_dist_train_and_dist_test_on_two_cpu_processes(tmp_path, task, test_tool):
    """tools/dist_train.sh CONFIG 2 trains with gloo (SyncBN kept in the config), rank 0 alone
    writes checkpoints and logs; tools/dist_test.sh gathers both ranks' predictions of the 5
    test images (one rank pads) into the metric of a single-process evaluation."""
    cfg = _tiny_config(tmp_path, task, iters=2, ckpt=2, validate=False)
    work_dir = tmp_path / 'train'
    env = dict(ENV, PORT=str(_free_port()))
    proc, log = _run(['bash', osp.join(REPO, 'tools', 'dist_train.sh'), cfg, '2',
                      '--work-dir', str(work_dir)], tmp_path, env=env)
    assert proc.returncode == 0, log[-4000:]
    assert "dist_cfg=dict(backend='gloo')" in log and 'Distributed training: True' in log
    assert "type='CPUDistributedDataParallel'" in log
    entries = os.listdir(work_dir)
    runs = [d for d in entries if osp.isdir(work_dir / d)]
    assert len(runs) == 1  # one run directory (rank 0's timestamp)
    assert sorted(set(entries) - set(runs)) == sorted(
        [osp.basename(cfg), 'iter_2.pth', 'last_checkpoint'])
    assert len(glob.glob(str(work_dir / runs[0] / '*.log'))) == 1  # rank 0's log only
    checkpoint = str(work_dir / 'iter_2.pth')
    check_checkpoint(checkpoint, kind='resume')  # complete, written once
    rng = load_checkpoint_file(checkpoint)['rng_state']  # both ranks' random states
    assert rng['world_size'] == 2 and len(rng['states']) == 2

    env = dict(ENV, PORT=str(_free_port()))
    proc, log = _run(['bash', osp.join(REPO, 'tools', 'dist_test.sh'), cfg, checkpoint, '2',
                      '--work-dir', str(tmp_path / 'dist_test'),
                      '--out', str(tmp_path / 'dist.pkl')], tmp_path, env=env)
    assert proc.returncode == 0, log[-4000:]
    test_tool.main([cfg, checkpoint, '--work-dir', str(tmp_path / 'single_test'),
                    '--out', str(tmp_path / 'single.pkl')])
    distributed, single = _metrics(tmp_path / 'dist_test'), _metrics(tmp_path / 'single_test')
    key = 'coco/bbox_mAP' if task == 'det' else 'mIoU'
    assert key in single
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


@CPU_ONLY
def test_tools_free_the_ddp_model_before_destroying_the_group(tmp_path, monkeypatch, train_tool,
                                                              test_tool, live_ddp_at_destroy):
    """tools/train.py and tools/test.py with --launcher pytorch (one gloo process, in this
    process): when the process group is destroyed, no DistributedDataParallel is alive any more.
    A DDP freed after the group joins gloo's threads with the GIL held and can hang the rank."""
    cfg = _tiny_config(tmp_path, 'det', iters=2, ckpt=2, validate=False)
    monkeypatch.setenv('MASTER_PORT', str(_free_port()))
    train_tool.main([cfg, '--launcher', 'pytorch', '--work-dir', str(tmp_path / 'train')])
    monkeypatch.setenv('MASTER_PORT', str(_free_port()))
    test_tool.main([cfg, str(tmp_path / 'train' / 'iter_2.pth'), '--launcher', 'pytorch',
                    '--work-dir', str(tmp_path / 'test')])
    assert live_ddp_at_destroy == [0, 0]  # one destroy per tool, no DDP left at either
    assert 'coco/bbox_mAP' in _metrics(tmp_path / 'test')


@HOOKS.register_module(name='_CrashHook', force=True)
class _CrashHook(Hook):
    """Test probe: a bug that strikes in the middle of training."""

    def after_train_iter(self, runner, batch_idx, data_batch=None, outputs=None):
        raise RuntimeError('crash in iteration 1')


@CPU_ONLY
@pytest.mark.parametrize('failure', ['crash', 'nan'])
def test_a_crashing_rank_frees_its_ddp_before_the_group_is_destroyed(tmp_path, monkeypatch,
                                                                     train_tool, failure,
                                                                     live_ddp_at_destroy):
    """A distributed run that fails (a bug in a hook; a NaN loss, which the tool turns into a
    SystemExit): the error reaches the user, and still no DDP model is alive when the process
    group is destroyed (the traceback's frames would otherwise keep the Runner)."""
    if failure == 'crash':
        cfg = _tiny_config(tmp_path, 'det', iters=2, ckpt=2, validate=False,
                           extra="custom_hooks = [dict(type='_CrashHook')]")
        expected, message = RuntimeError, 'crash in iteration 1'
    else:
        cfg = _tiny_config(tmp_path, 'det', iters=2, ckpt=2, validate=False, lr=1e30)
        expected, message = SystemExit, 'loss became NaN or infinite'
    monkeypatch.setenv('MASTER_PORT', str(_free_port()))
    with pytest.raises(expected) as excinfo:
        train_tool.main([cfg, '--launcher', 'pytorch', '--work-dir', str(tmp_path / 'train')])
    assert message in str(excinfo.value)
    assert live_ddp_at_destroy == [0]
    if failure == 'crash':
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
def test_slurm_train_and_slurm_test_on_two_cpu_tasks(tmp_path, test_tool):
    """tools/slurm_train.sh / slurm_test.sh hand srun the partition, job name and task counts,
    and the tools take rank, world size and master address from slurm's variables (via
    ``scontrol show hostname``): 2 tasks train with gloo, and the test metric of the gathered
    predictions equals that of one process. srun and scontrol are stand-ins (no cluster here)."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    for name, text in (('srun', _FAKE_SRUN.format(python=sys.executable)),
                       ('scontrol', _FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    record = tmp_path / 'srun.json'
    env = dict(ENV, PATH=f'{bin_dir}:{ENV["PATH"]}', FAKE_SRUN_RECORD=str(record), GPUS='2',
               GPUS_PER_NODE='2', CPUS_PER_TASK='1', MASTER_PORT=str(_free_port()))
    for key in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR'):
        env.pop(key, None)
    cfg = _tiny_config(tmp_path, 'det', iters=2, ckpt=2, validate=False)
    work_dir = tmp_path / 'train'
    proc, log = _run(['bash', osp.join(REPO, 'tools', 'slurm_train.sh'), 'gpu_part', 'xcit_job',
                      cfg, str(work_dir)], tmp_path, env=env)
    assert proc.returncode == 0, log[-4000:]
    assert json.loads(record.read_text()) == {
        '-p': 'gpu_part', '--job-name': 'xcit_job', '--gres': 'gpu:2', '--ntasks': '2',
        '--ntasks-per-node': '2', '--cpus-per-task': '1', '--kill-on-bad-exit': '1'}
    assert 'Distributed training: True' in log and "launcher = 'slurm'" in log
    checkpoint = str(work_dir / 'iter_2.pth')
    rng = load_checkpoint_file(checkpoint)['rng_state']
    assert rng['world_size'] == 2

    env['MASTER_PORT'] = str(_free_port())
    proc, log = _run(['bash', osp.join(REPO, 'tools', 'slurm_test.sh'), 'gpu_part', 'xcit_eval',
                      cfg, checkpoint, '--work-dir', str(tmp_path / 'slurm_test')], tmp_path,
                     env=env)
    assert proc.returncode == 0, log[-4000:]
    assert json.loads(record.read_text())['--job-name'] == 'xcit_eval'
    test_tool.main([cfg, checkpoint, '--work-dir', str(tmp_path / 'single_test')])
    assert _metrics(tmp_path / 'slurm_test') == _metrics(tmp_path / 'single_test')


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


# ============================================================================ 5. mixed precision
_DTYPES = []


@HOOKS.register_module(name='_AmpProbeHook', force=True)
class _AmpProbeHook(Hook):
    """Test probe: records, per training forward, the dtype of XCA's qkv projection (autocast)
    and of its channel attention (float32 by design)."""

    def before_train(self, runner):
        model = runner.model.module if hasattr(runner.model, 'module') else runner.model
        xca = model.backbone.layers[0].attn
        xca.qkv.register_forward_hook(
            lambda m, i, o: _DTYPES.append(('qkv', o.dtype)) if m.training else None)
        xca.probe.register_forward_hook(
            lambda m, i, o: _DTYPES.append(('attn', i[2].dtype)) if xca.training else None)


@CPU_ONLY
@pytest.mark.parametrize('task', ['det', 'seg'])
def test_amp_on_cpu_trains_in_bfloat16_with_finite_losses(tmp_path, train_tool, task):
    _DTYPES.clear()
    cfg = _tiny_config(tmp_path, task, iters=3, ckpt=3, validate=False,
                       extra="custom_hooks = [dict(type='_AmpProbeHook')]")
    work_dir = tmp_path / 'work'
    train_tool.main([cfg, '--amp', '--work-dir', str(work_dir)])
    dumped = Config.fromfile(str(work_dir / osp.basename(cfg)))
    assert dumped.optim_wrapper.type == 'CPUAmpOptimWrapper'
    losses = _losses(work_dir)[0]
    assert sorted(losses) == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values()), losses
    assert ('qkv', torch.bfloat16) in _DTYPES  # the backbone ran under autocast
    assert {d for name, d in _DTYPES if name == 'attn'} == {torch.float32}  # XCA kept float32
    assert torch.isfinite(torch.stack([v.float().flatten()[:1] for v in load_checkpoint_file(
        str(work_dir / 'iter_3.pth'))['state_dict'].values()
        if v.is_floating_point()])).all()


def test_amp_config_conversion_without_gpu(train_tool, monkeypatch):
    """A config that itself asks for AmpOptimWrapper runs with bfloat16 CPU autocast here."""
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
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
