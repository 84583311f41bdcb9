"""The Cityscapes recipes (configs/{sem_fpn,upernet}_xcit_s12_p{16,8}_80k_cityscapes.py): recipes
without released weights, not from the paper. Each config builds, follows the XCiT ADE20k recipe
where it applies (optimizer, the released 'norm' decay rule, warm-up + poly, ImageNet init) on
mmseg's Cityscapes data and 80k schedule, runs one training step on a tiny synthetic batch, and a
missing or unconverted data/cityscapes/ ends in one `error:` message that says what to do.

Helpers (model building without ImageNet weights, per-parameter weight decay, lr factors) are those
of tests/test_configs.py.
"""
import copy
import functools
import os.path as osp

import pytest
import torch
from mmengine.config import Config
from mmengine.model import revert_sync_batchnorm
from mmengine.registry import init_default_scope

import xcit_mm  # noqa: F401  (registers XCiTBackbone and the lean segmentors)
from test_configs import _build, _lr_factors, _weight_decays

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
TASKS = ('sem_fpn', 'upernet')
ALL = [(task, patch) for task in TASKS for patch in (16, 8)]
D = 384  # XCiT-S12
NUM_CLASSES = 19


def _path(task, patch):
    return osp.join(REPO, 'configs', f'{task}_xcit_s12_p{patch}_80k_cityscapes.py')


@functools.lru_cache(maxsize=None)
def _load_cached(task, patch):
    return Config.fromfile(_path(task, patch))


def _load(task, patch):
    return copy.deepcopy(_load_cached(task, patch))


@pytest.mark.parametrize('task,patch', ALL)
def test_recipe(task, patch):
    cfg = _load(task, patch)
    with open(_path(task, patch)) as f:
        header = f.read().split('_base_', 1)[0]
    assert 'recipe without released weights' in header and '.pth' not in header
    assert cfg.default_scope == 'mmseg'
    assert cfg.custom_imports == dict(imports=['xcit_mm'], allow_failed_imports=False)
    model = cfg.model
    assert model.type == 'LeanEncoderDecoder' and model.pretrained is None
    assert model.test_cfg == {}  # no mode: the lean segmentor chooses (whole if it fits)
    backbone = model.backbone
    assert (backbone.type, backbone.arch, backbone.patch_size) == ('XCiTBackbone', 's12', patch)
    assert backbone.drop_path_rate == 0.05  # as the ADE20k S12 configs
    assert backbone.norm_cfg == dict(type='SyncBN', requires_grad=True)
    assert 'depth' not in backbone and 'pretrained' not in backbone  # ResNet leftovers deleted
    assert backbone.init_cfg == dict(
        type='Pretrained',
        checkpoint=f'https://dl.fbaipublicfiles.com/xcit/xcit_small_12_p{patch}_384_dist.pth')
    heads = [model.decode_head] + ([model.auxiliary_head] if task == 'upernet' else [])
    assert [h.num_classes for h in heads] == [NUM_CLASSES] * len(heads)
    # Optimizer and schedule: the ADE20k recipe's, over mmseg's 80k iterations.
    optim = cfg.optim_wrapper
    assert optim.type == 'OptimWrapper' and optim.clip_grad is None
    assert optim.optimizer == dict(type='AdamW', lr=6e-5, betas=(0.9, 0.999), weight_decay=0.01)
    assert optim.paramwise_cfg == dict(custom_keys={'norm': dict(decay_mult=0.0)})
    assert cfg.train_cfg.type == 'IterBasedTrainLoop' and cfg.train_cfg.max_iters == 80000
    warmup, poly = cfg.param_scheduler
    assert (warmup.type, warmup.start_factor, warmup.begin, warmup.end) == (
        'LinearLR', 1e-6, 0, 1501)
    assert (poly.type, poly.power, poly.eta_min, poly.begin, poly.end) == (
        'PolyLR', 1.0, 0.0, 0, 80001)
    # mmseg's Cityscapes data: 512x1024 crops, whole-image test at 2048x1024, 2 images per GPU on
    # 4 GPUs as mmseg's Cityscapes configs.
    assert cfg.crop_size == (512, 1024) and model.data_preprocessor.size == (512, 1024)
    train = cfg.train_dataloader.dataset
    assert (train.type, train.data_root) == ('CityscapesDataset', 'data/cityscapes/')
    crop = [t for t in train.pipeline if t.type == 'RandomCrop'][0]
    assert crop.crop_size == (512, 1024)
    resize = cfg.test_dataloader.dataset.pipeline[1]
    assert (resize.type, resize.scale, resize.keep_ratio) == ('Resize', (2048, 1024), True)
    assert cfg.train_dataloader.batch_size == 2
    assert cfg.auto_scale_lr == dict(enable=False, base_batch_size=8)
    assert (cfg.test_evaluator.type, cfg.test_evaluator.iou_metrics) == ('IoUMetric', ['mIoU'])


@pytest.mark.parametrize('task,patch', ALL)
def test_builds_with_the_s12_widths(task, patch):
    model = _build(_load(task, patch))
    assert type(model).__name__ == 'LeanEncoderDecoder'
    assert model.backbone.out_channels == [D] * 4
    head = model.decode_head
    assert head.num_classes == NUM_CLASSES and head.conv_seg.out_channels == NUM_CLASSES
    if task == 'sem_fpn':
        assert [c.conv.in_channels for c in model.neck.lateral_convs] == [D] * 4
        assert [c.conv.out_channels for c in model.neck.fpn_convs] == [D] * 4
        assert head.in_channels == [D] * 4 and head.channels == 128
    else:
        assert not model.with_neck
        assert head.in_channels == [D] * 4 and head.channels == 512
        aux = model.auxiliary_head
        assert (aux.in_channels, aux.in_index, aux.channels) == (D, 2, 256)
        assert aux.conv_seg.out_channels == NUM_CLASSES and aux.loss_decode.loss_weight == 0.4


def _small(task, patch):
    """The config with a 4-layer, 64-d trunk (same module and parameter names)."""
    cfg = _load(task, patch)
    cfg.model.backbone.arch = dict(embed_dims=64, depth=4, num_heads=4)
    cfg.merge_from_dict({'model.neck.in_channels': [64] * 4, 'model.neck.out_channels': 64,
                         'model.decode_head.in_channels': [64] * 4} if task == 'sem_fpn' else
                        {'model.decode_head.in_channels': [64] * 4,
                         'model.auxiliary_head.in_channels': 64})
    return cfg


@pytest.mark.parametrize('task,patch', ALL)
def test_weight_decay_is_the_released_rule(task, patch):
    decay = _weight_decays(_small(task, patch))
    for name, value in decay.items():
        assert value == (0.0 if 'norm' in name else 0.01), name
    assert sum('norm' in n for n in decay) == 4 * 3 * 2  # the trunk's LayerNorms, nothing else
    assert decay['backbone.layers.0.attn.temperature'] == 0.01
    assert decay['backbone.layers.0.lpi.bn.weight'] == 0.01


def test_schedule_is_the_ade_warmup_and_poly_over_80k():
    cfg = _load('upernet', 16)
    T = cfg.train_cfg.max_iters
    for t, got in enumerate(_lr_factors(cfg, T)):
        poly = 1 - t / T
        expected = poly * (1e-6 + (1 - 1e-6) * t / 1500) if t < 1500 else poly
        assert got == pytest.approx(expected, rel=1e-9), t


@pytest.mark.parametrize('task,patch', ALL)
def test_one_training_step_and_whole_image_prediction(task, patch):
    from mmengine.optim import build_optim_wrapper
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    torch.manual_seed(0)
    cfg = _small(task, patch)
    # A small crop instead of 512x1024 keeps the CPU step short; the padding path is the same.
    cfg.model.data_preprocessor.size = (64, 128)
    # the whole image as named: the configs' default would first calibrate its memory line
    # (three forwards up to 896²), which test_segmentation_memory_budget.py covers
    cfg.model.test_cfg = dict(mode='whole')
    model = revert_sync_batchnorm(_build(cfg, device='cpu'))
    init_default_scope(cfg.default_scope)
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    h, w = 48, 112
    samples = []
    for _ in range(2):
        sample = SegDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w)))
        labels = torch.randint(0, NUM_CLASSES, (1, h, w))
        labels[:, :4] = 255  # ignored pixels, as Cityscapes' void
        sample.gt_sem_seg = PixelData(data=labels)
        samples.append(sample)
    data = dict(inputs=[torch.randint(0, 255, (3, h, w), dtype=torch.uint8) for _ in range(2)],
                data_samples=samples)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    log_vars = model.train_step(data, wrapper)  # what the Runner's training loop calls
    assert torch.isfinite(log_vars['loss']) and log_vars['decode.loss_ce'] > 0
    assert ('aux.loss_ce' in log_vars) == (task == 'upernet')
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert any(n.startswith('backbone.layers.') for n in changed)
    assert any(n.startswith('decode_head.conv_seg') for n in changed)
    model.eval()
    with torch.no_grad():
        batch = model.data_preprocessor(dict(inputs=data['inputs'][:1],
                                             data_samples=data['data_samples'][:1]), False)
        pred = model.predict(batch['inputs'], batch['data_samples'])
    assert pred[0].pred_sem_seg.data.shape == (1, h, w)
    assert int(pred[0].pred_sem_seg.data.max()) < NUM_CLASSES


def _train_cli(cwd, train_tool, monkeypatch):
    """The message ``tools/train.py CONFIG`` ends with, run in ``cwd`` (in this process: the
    real command line's exit status and single error line are test_tools.py's
    ``test_cli_reports_missing_ade_data``)."""
    monkeypatch.chdir(cwd)
    with pytest.raises(SystemExit) as info:
        train_tool.main([_path('sem_fpn', 16)])
    message = str(info.value.code)
    assert message.startswith('error: ') and '\nerror:' not in message, message
    assert message.rstrip().endswith('val_dataloader.dataset.data_root=/path/to/cityscapes/')
    return message


CITYSCAPES_STEPS = ('https://www.cityscapes-dataset.com/', 'leftImg8bit_trainvaltest.zip',
                    'gtFine_trainvaltest.zip',
                    'leftImg8bit/train/<city>/*_leftImg8bit.png',
                    'gtFine/val/<city>/*_gtFine_labelTrainIds.png',
                    'pip install cityscapesscripts',
                    'tools/dataset_converters/cityscapes.py data/cityscapes --nproc 8')


def test_missing_cityscapes_ends_in_the_download_and_layout(tmp_path, train_tool, monkeypatch):
    message = _train_cli(tmp_path, train_tool, monkeypatch)
    assert message.startswith('error: Dataset not found for ')
    for sub in ('leftImg8bit/train', 'gtFine/train', 'leftImg8bit/val', 'gtFine/val'):
        assert f'{tmp_path}/data/cityscapes/{sub}   [' in message
    for step in CITYSCAPES_STEPS:
        assert step in message, step
    assert not (tmp_path / 'work_dirs').exists()  # nothing was built


def test_cityscapes_without_train_id_label_maps_says_to_convert(tmp_path, train_tool,
                                                                monkeypatch):
    root = tmp_path / 'data' / 'cityscapes'
    for split in ('train', 'val'):
        (root / 'leftImg8bit' / split / 'aachen').mkdir(parents=True)
        (root / 'leftImg8bit' / split / 'aachen' / f'a_{split}_leftImg8bit.png').touch()
        (root / 'gtFine' / split / 'aachen').mkdir(parents=True)
        (root / 'gtFine' / split / 'aachen' / f'a_{split}_gtFine_polygons.json').touch()
    (root / 'gtFine' / 'val' / 'aachen' / 'a_val_gtFine_labelTrainIds.png').touch()
    message = _train_cli(tmp_path, train_tool, monkeypatch)
    lines = message.splitlines()
    label_lines = [line for line in lines if 'no label maps' in line]
    # train has none; val has one and passes; the images are there.
    assert label_lines == [f'    no label maps *_gtFine_labelTrainIds.png (run the conversion '
                           f'below): {root}/gtFine/train   [train_dataloader]']
    assert not any('image directory' in line for line in lines)
    for step in CITYSCAPES_STEPS:
        assert step in message, step

    # Converted: the check passes.
    from training_extras import check_data
    (root / 'gtFine' / 'train' / 'aachen' / 'a_train_gtFine_labelTrainIds.png').touch()
    cfg = _load('sem_fpn', 16)
    cfg.merge_from_dict({f'{k}_dataloader.dataset.data_root': str(root) for k in ('train', 'val')})
    check_data(cfg, splits=('train', 'val'))
