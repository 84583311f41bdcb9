"""Training checkpoints of any config that imports xcit_mm open in every door; pickled code in none.

mmengine 0.10 pickles its message hub (``HistoryBuffer`` objects holding numpy arrays) into every
training checkpoint, and torch >= 2.6 refuses such files by default. The files here are written
the way users write them, without ``configs/_base_/training_extras.py`` (so without
``PortableCheckpointHook``, which would store plain data instead):

- the detector: the config README's "Using the backbone" snippet gives (mmdet's Mask R-CNN base,
  ``XCiTBackbone`` with patch size 16), trained 2 iterations by mmdet's own ``tools/train.py``,
  the script ``mim train mmdet`` runs;
- the segmentor: mmseg's Semantic FPN config with the same ``XCiTBackbone``, trained 2
  iterations by our ``tools/train.py``.

The backbone is a small ``arch=dict(...)`` (README's other form of ``arch``), the neck and heads
as wide as it: what a checkpoint pickles besides its tensors does not depend on the model's
size; only the time to write, copy and read the files does.

Each file exists as written (numpy 1 pickles name ``numpy.core.multiarray``), renamed the way
numpy 2 writes it (``numpy._core.multiarray``), and with one more entry whose unpickling would
create a directory. Expected weights and metadata come from the files themselves, read back with
``weights_only=False`` only where the test wrote them.
"""
import glob
import os
import os.path as osp
import re
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import run_as_main, unique_visualizer, upstream_tool

from released_files import small_model_cfg
from work_dir_files import evaluation_metrics, newest_run_log

from shapes_world import generate_shapes
from xcit_mm.models.utils import CheckpointError

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS='1', PYTHONWARNINGS='ignore', CUDA_VISIBLE_DEVICES='')
CLASSES = ('circle', 'square', 'triangle')
NUMPY_NAMES = {'numpy1': b'numpy.core.multiarray\n', 'numpy2': b'numpy._core.multiarray\n'}

SMALL_ARCH = dict(embed_dims=64, depth=4, num_heads=4)

# What README's "Using the backbone" tells a user to write, on mmdet's own Mask R-CNN config
# (neck and heads narrowed to the small trunk's width, as the module docstring says).
DET_CONFIG = '''
_base_ = ['mmdet::mask_rcnn/mask-rcnn_r50_fpn_1x_coco.py']
custom_imports = dict(imports=['xcit_mm'], allow_failed_imports=False)
model = dict(
    backbone=dict(_delete_=True, type='XCiTBackbone', arch={arch}, patch_size=16, init_cfg=None),
    neck=dict(in_channels=[64] * 4, out_channels=64),
    rpn_head=dict(in_channels=64, feat_channels=64),
    roi_head=dict(
        bbox_roi_extractor=dict(out_channels=64), mask_roi_extractor=dict(out_channels=64),
        bbox_head=dict(in_channels=64, fc_out_channels=128, num_classes=3),
        mask_head=dict(in_channels=64, conv_out_channels=64, num_classes=3)))
data_root = '{root}/'
metainfo = dict(classes={classes})
train_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo,
                 ann_file='annotations/instances_train.json', data_prefix=dict(img='train/'),
                 pipeline=[dict(type='LoadImageFromFile'),
                           dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
                           dict(type='Resize', scale=(64, 64), keep_ratio=True),
                           dict(type='PackDetInputs')]))
test_dataloader = dict(
    batch_size=2, num_workers=0, persistent_workers=False,
    dataset=dict(data_root=data_root, metainfo=metainfo,
                 ann_file='annotations/instances_val.json', data_prefix=dict(img='val/'),
                 pipeline=[dict(type='LoadImageFromFile'),
                           dict(type='Resize', scale=(64, 64), keep_ratio=True),
                           dict(type='LoadAnnotations', with_bbox=True, with_mask=True),
                           dict(type='PackDetInputs', meta_keys=(
                               'img_id', 'img_path', 'ori_shape', 'img_shape', 'scale_factor'))]))
test_evaluator = dict(ann_file=data_root + 'annotations/instances_val.json')
train_cfg = dict(_delete_=True, type='IterBasedTrainLoop', max_iters=2)
val_cfg = None
val_dataloader = None
val_evaluator = None
param_scheduler = []
optim_wrapper = dict(optimizer=dict(lr=0.001))
default_hooks = dict(checkpoint=dict(by_epoch=False, interval=2), logger=dict(interval=1))
log_processor = dict(by_epoch=False)
'''

# mmseg's own Semantic FPN config with the backbone swapped and narrowed the same way.
SEG_CONFIG = '''
_base_ = ['mmseg::sem_fpn/fpn_r50_4xb4-160k_ade20k-512x512.py']
custom_imports = dict(imports=['xcit_mm'], allow_failed_imports=False)
norm_cfg = dict(type='BN', requires_grad=True)
model = dict(
    data_preprocessor=dict(size=(64, 64)),
    pretrained=None,  # mmseg's base sets its ResNet's ImageNet weights here
    backbone=dict(_delete_=True, type='XCiTBackbone', arch={arch}, patch_size=16, init_cfg=None),
    neck=dict(in_channels=[64] * 4, out_channels=64),
    decode_head=dict(in_channels=[64] * 4, channels=64, num_classes=3, norm_cfg=norm_cfg))
data_root = '{root}/'
_data = dict(type='BaseSegDataset', img_suffix='.jpg', seg_map_suffix='.png',
             reduce_zero_label=True, data_root=data_root, metainfo=dict(classes={classes}),
             pipeline=[dict(type='LoadImageFromFile'),
                       dict(type='LoadAnnotations', reduce_zero_label=True),
                       dict(type='PackSegInputs')])
_loader = dict(num_workers=0, persistent_workers=False)
train_dataloader = dict(batch_size=2, **_loader, dataset=dict(
    _delete_=True, **_data,
    data_prefix=dict(img_path='images/training', seg_map_path='annotations/training')))
test_dataloader = dict(batch_size=1, **_loader, dataset=dict(
    _delete_=True, **_data,
    data_prefix=dict(img_path='images/validation', seg_map_path='annotations/validation')))
train_cfg = dict(max_iters=2, val_interval=100)
val_cfg = None
val_dataloader = None
val_evaluator = None
param_scheduler = []
default_hooks = dict(checkpoint=dict(by_epoch=False, interval=2), logger=dict(interval=1))
'''


def _run(tool: str, *args, ok: bool = True) -> str:
    proc = subprocess.run([sys.executable, tool, *args], cwd=REPO, env=ENV, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    assert (proc.returncode == 0) == ok, proc.stdout[-4000:]
    return proc.stdout


def _last_checkpoint(work_dir) -> str:
    with open(osp.join(work_dir, 'last_checkpoint')) as f:
        return f.read().strip()


def _pickle_bytes(path: str) -> bytes:
    with zipfile.ZipFile(path) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith('/data.pkl')))


def _as_numpy2(path: str, out: str) -> str:
    """The file with its numpy GLOBALs renamed as numpy 2 writes them (same zip layout)."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(out, 'w', zipfile.ZIP_STORED) as dest:
        for info in source.infolist():
            data = source.read(info.filename)
            if info.filename.endswith('/data.pkl'):
                assert NUMPY_NAMES['numpy1'] in data, 'no numpy array pickled: nothing to test'
                data = data.replace(NUMPY_NAMES['numpy1'], NUMPY_NAMES['numpy2'])
            dest.writestr(info, data)
    return out


class Payload:
    """Unpickling this creates ``path``: code a checkpoint must never get to run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path, ))


def _with_payload(path: str, out: str, marker: str) -> str:
    checkpoint = torch.load(path, map_location='cpu', weights_only=False)  # a file we wrote
    checkpoint['meta']['note'] = Payload(marker)
    torch.save(checkpoint, out)
    return out


def _files(root, cfg: str, checkpoint: str) -> dict:
    return dict(cfg=cfg, numpy1=checkpoint,
                numpy2=_as_numpy2(checkpoint, str(root / 'numpy2.pth')),
                evil=_with_payload(checkpoint, str(root / 'evil.pth'), str(root / 'pwned')),
                marker=str(root / 'pwned'))


@pytest.fixture(scope='module')
def det_files(build_once):
    def train(root):
        generate_shapes(str(root / 'coco'), task='coco', num_train=4, num_val=2, image_size=64)
        cfg = root / 'mask_rcnn_readme_snippet.py'
        cfg.write_text(DET_CONFIG.format(root=root / 'coco', classes=CLASSES, arch=SMALL_ARCH))
        work_dir = str(root / 'train')
        run_as_main(upstream_tool('mmdet', 'train'), str(cfg), '--work-dir', work_dir,
                    '--cfg-options', unique_visualizer('det_train'))
        return _files(root, str(cfg), _last_checkpoint(work_dir))
    return build_once('det_doors', train)


@pytest.fixture(scope='module')
def seg_files(build_once, train_tool):
    def train(root):
        generate_shapes(str(root / 'ade'), task='ade', num_train=4, num_val=2, image_size=64)
        cfg = root / 'sem_fpn_mmseg_base.py'
        cfg.write_text(SEG_CONFIG.format(root=root / 'ade', classes=CLASSES, arch=SMALL_ARCH))
        work_dir = str(root / 'train')
        train_tool.main([str(cfg), '--work-dir', work_dir, '--cfg-options',
                         unique_visualizer('seg_train')])
        return dict(_files(root, str(cfg), _last_checkpoint(work_dir)), work_dir=work_dir)
    return build_once('seg_doors', train)


def test_the_files_hold_mmengines_pickled_training_state(det_files, seg_files):
    """Else every test below would prove nothing: HistoryBuffers and numpy arrays, pickled under
    numpy 1's names, renamed to numpy 2's, and the payload."""
    for files in (det_files, seg_files):
        data = _pickle_bytes(files['numpy1'])
        assert b'mmengine.logging.history_buffer\nHistoryBuffer\n' in data
        assert NUMPY_NAMES['numpy1'] + b'_reconstruct\n' in data
        renamed = _pickle_bytes(files['numpy2'])
        assert NUMPY_NAMES['numpy2'] + b'_reconstruct\n' in renamed
        assert NUMPY_NAMES['numpy1'] not in renamed
        assert b'posix\nmkdir\n' in _pickle_bytes(files['evil'])


def _expected(path: str) -> dict:
    return torch.load(path, map_location='cpu', weights_only=False)  # files this module wrote


def _assert_loaded(model, path: str) -> None:
    expected = _expected(path)
    own = model.state_dict()
    for key, value in expected['state_dict'].items():
        assert torch.equal(own[key], value), key
    assert tuple(model.dataset_meta['classes']) == CLASSES


def _open(door: str, cfg: str, path: str):
    """The model a user of ``door`` gets for ``path``."""
    if door == 'init_detector':
        from mmdet.apis import init_detector
        return init_detector(cfg, path, device='cpu')
    if door == 'DetInferencer':
        from mmdet.apis import DetInferencer
        return DetInferencer(model=cfg, weights=path, device='cpu', show_progress=False).model
    if door == 'init_model':
        from mmseg.apis import init_model
        return init_model(cfg, path, device='cpu')
    from mmseg.apis import MMSegInferencer
    assert door == 'MMSegInferencer', door
    return MMSegInferencer(model=cfg, weights=path, device='cpu').model


PYTHON_DOORS = [('det', 'init_detector'), ('det', 'DetInferencer'), ('seg', 'init_model'),
                ('seg', 'MMSegInferencer')]


@pytest.mark.parametrize('task,door,numpy', [
    (task, door, numpy) for (task, door), numpy in zip(PYTHON_DOORS, ['numpy1', 'numpy2'] * 2)])
def test_training_checkpoint_opens_in_the_upstream_apis(det_files, seg_files, task, door, numpy):
    """Each door once; the files as numpy 1 and numpy 2 write them, each in both tasks."""
    files = det_files if task == 'det' else seg_files
    _assert_loaded(_open(door, files['cfg'], files[numpy]), files['numpy1'])


def test_detector_checkpoint_evaluates_with_our_test_tool(det_files, test_tool, tmp_path):
    """``tools/test.py`` sets ``load_from``: the door a fine-tuning config uses too."""
    work_dir = str(tmp_path / 'test')
    test_tool.main([det_files['cfg'], det_files['numpy1'], '--work-dir', work_dir,
                    '--cfg-options', unique_visualizer('det_test')])
    assert 'coco/bbox_mAP_50' in evaluation_metrics(work_dir)


def test_detector_checkpoint_evaluates_with_mmdets_test_tool(det_files, tmp_path):
    """mmdet's own ``tools/test.py``, with ``--show-dir`` drawing every held-out image."""
    run_as_main(upstream_tool('mmdet', 'test'), det_files['cfg'], det_files['numpy1'],
                '--work-dir', str(tmp_path / 'test'), '--show-dir', str(tmp_path / 'show'),
                '--cfg-options', unique_visualizer('det_mmdet_test'))
    assert 'coco/bbox_mAP_50' in evaluation_metrics(tmp_path / 'test')
    drawn = glob.glob(str(tmp_path / '**' / 'show' / '*.jpg'), recursive=True) + glob.glob(
        str(tmp_path / '**' / 'show' / '*.png'), recursive=True)
    assert len(drawn) == 2, drawn  # every held-out image of the tiny world


def test_segmentor_checkpoint_evaluates_with_mmsegs_test_tool(seg_files, tmp_path):
    """mmseg's own ``tools/test.py`` with ``--show-dir``; and mmdet's log analysis (as
    ``tools/install.sh`` installs it: it imports seaborn) plots the run's loss curve."""
    show_dir = tmp_path / 'show'
    run_as_main(upstream_tool('mmseg', 'test'), seg_files['cfg'], seg_files['numpy2'],
                '--work-dir', str(tmp_path / 'test'), '--show-dir', str(show_dir),
                '--cfg-options', 'default_hooks.visualization.interval=1',  # base: every 50th
                unique_visualizer('seg_mmseg_test'))
    assert re.search(r'mIoU: [\d.]+', newest_run_log(tmp_path / 'test'))
    drawn = glob.glob(str(show_dir / '**' / '*.png'), recursive=True)
    assert len(drawn) == 2, drawn  # every held-out image of the tiny world
    log = glob.glob(osp.join(seg_files['work_dir'], '*', 'vis_data', '2*.json'))[0]
    curve = str(tmp_path / 'loss.png')
    run_as_main(upstream_tool('mmdet', osp.join('analysis_tools', 'analyze_logs')), 'plot_curve',
                log, '--keys', 'loss', '--out', curve)
    assert osp.getsize(curve) > 0


def _loss_history(path: str):
    hub = torch.load(path, map_location='cpu')['message_hub']  # torch's default weights_only
    return list(hub['log_scalars']['train/loss']._log_history)


def test_detector_resumes_with_mmdets_train_tool(det_files, tmp_path):
    """The resumed run continues the file's iteration count and message hub."""
    work_dir = str(tmp_path / 'resumed')
    run_as_main(upstream_tool('mmdet', 'train'), det_files['cfg'], '--work-dir', work_dir,
                '--resume', det_files['numpy2'], '--cfg-options', 'train_cfg.max_iters=3',
                unique_visualizer('det_resume'))
    resumed = _last_checkpoint(work_dir)
    assert osp.basename(resumed) == 'iter_3.pth'
    before = _loss_history(det_files['numpy1'])
    after = _loss_history(resumed)
    assert len(before) == 2 and after[:2] == before and len(after) == 3


def test_segmentor_resumes_with_our_train_tool(seg_files, train_tool, tmp_path):
    work_dir = str(tmp_path / 'resumed')
    train_tool.main([seg_files['cfg'], '--work-dir', work_dir, '--resume', seg_files['numpy2'],
                     '--cfg-options', 'train_cfg.max_iters=3', unique_visualizer('seg_resume')])
    resumed = _last_checkpoint(work_dir)
    assert osp.basename(resumed) == 'iter_3.pth'
    before = _loss_history(seg_files['numpy1'])
    assert len(before) == 2 and _loss_history(resumed)[:2] == before


# ------------------------------------------------------------------------------ pickled code
REFUSED = (r'Refusing to load (--resume )?checkpoint .*evil\.pth.*it asks to import '
           r'posix\.mkdir.*Nothing from the file was executed')


@pytest.mark.parametrize('task,door', PYTHON_DOORS + [('det', 'load_checkpoint')])
def test_pickled_code_is_refused_in_the_upstream_apis(det_files, seg_files, task, door):
    files = det_files if task == 'det' else seg_files
    with pytest.raises(CheckpointError, match=REFUSED):
        if door == 'load_checkpoint':
            from mmengine.runner import load_checkpoint
            load_checkpoint(torch.nn.Linear(1, 1), files['evil'])
        else:
            _open(door, files['cfg'], files['evil'])
    assert not osp.exists(files['marker'])


def test_pickled_code_is_refused_by_mmdets_test_tool_in_one_line(det_files, tmp_path):
    out = _run(upstream_tool('mmdet', 'test'), det_files['cfg'], det_files['evil'],
               '--work-dir', str(tmp_path / 'test'), ok=False)
    assert 'Traceback' not in out, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith('error: ') and re.search(REFUSED, last), out[-3000:]
    assert not osp.exists(det_files['marker'])


@pytest.mark.parametrize('tool', ['test', 'resume'])
def test_pickled_code_is_refused_by_our_tools(seg_files, train_tool, test_tool, tmp_path, tool):
    with pytest.raises(SystemExit, match='error: ' + REFUSED):
        if tool == 'test':
            test_tool.main([seg_files['cfg'], seg_files['evil'], '--work-dir', str(tmp_path)])
        else:
            train_tool.main([seg_files['cfg'], '--resume', seg_files['evil'], '--work-dir',
                             str(tmp_path)])
    assert not osp.exists(seg_files['marker'])


def test_a_checkpoint_of_the_other_task_is_one_line_from_the_test_tools(
        det_files, seg_files, test_tool, tmp_path):
    """A segmentor's training checkpoint given to a detector config: the load path every door
    takes (the backbone's load hook) names the other task in a ``CheckpointError``, through our
    ``tools/test.py`` as through mmdet's ``init_detector``. Uncaught, a ``CheckpointError`` ends
    any tool in that one line (the excepthook ``import xcit_mm`` installs; mmdet's
    ``tools/test.py`` shows it in the pickled-code test below)."""
    other_task = re.escape('is a segmentor checkpoint (decode_head.')
    with pytest.raises(CheckpointError, match=other_task):
        test_tool.main([det_files['cfg'], seg_files['numpy1'], '--work-dir', str(tmp_path)])
    with pytest.raises(CheckpointError, match=other_task):
        _open('init_detector', det_files['cfg'], seg_files['numpy1'])


@pytest.mark.parametrize('task', ['det', 'seg'])
def test_a_file_without_head_weights_is_refused_not_a_random_head(task, tmp_path):
    """Backbone weights alone (as a classifier's file holds them, under ``backbone.``) given as a
    whole model's checkpoint: the door names the head the file lacks, instead of a model whose
    head stays random. A whole model's own file loads. (The paper config, narrower: the keys,
    not the sizes, decide.)"""
    import xcit_mm  # noqa: F401  (the door's custom_imports)
    from mmdet.apis import init_detector
    from mmseg.apis import init_model
    family, init, head = {'det': ('mask_rcnn', init_detector, 'rpn_head'),
                          'seg': ('sem_fpn', init_model, 'decode_head')}[task]
    config = small_model_cfg(family, 16)
    model = init(config, None, device='cpu')
    whole, headless = str(tmp_path / 'whole.pth'), str(tmp_path / 'backbone_only.pth')
    torch.save({'state_dict': model.state_dict(), 'meta': {}}, whole)
    torch.save({'state_dict': {k: v for k, v in model.state_dict().items()
                               if k.startswith('backbone.')}, 'meta': {}}, headless)
    init(config, whole, device='cpu')
    with pytest.raises(CheckpointError, match=rf'has no weights for {head} .* randomly '
                                              r'initialised.*model\.backbone\.init_cfg'):
        init(config, headless, device='cpu')
