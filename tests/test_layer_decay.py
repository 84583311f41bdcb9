"""Layer-wise lr decay for XCiT (XCiTLayerDecayOptimizerConstructor, LayerDecayLrHook).

Models are the layer-decay configs (configs/*_ld.py, which inherit the paper configs) with a
32-d trunk of 12 or 24 layers and BN for SyncBN. Expected learning rates and weight decays are
computed here from each parameter's NAME by the documented rule, never taken from the
constructor:

    depth = 0 (backbone.patch_embed.*, backbone.pos_embed.*) | i + 1 (backbone.layers.{i}.*)
            | L + 1 (anything else)
    lr = optimizer.lr x decay_rate ** (L + 1 - depth)
    weight decay = 0 for names containing 'norm' (the paper configs' custom_keys), else the
                   optimizer's weight_decay
"""
import copy
import functools
import logging
import os.path as osp
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from mmengine.config import Config
from mmengine.hooks import Hook
from mmengine.logging import MessageHub, MMLogger
from mmengine.optim import OptimWrapperDict, build_optim_wrapper
from mmengine.registry import MODELS, init_default_scope

import xcit_mm  # noqa: F401  (registers the backbone, constructor and hook)
from xcit_mm.engine import LayerDecayLrHook, XCiTLayerDecayOptimizerConstructor

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
LD_CONFIG = {
    'mask_rcnn': 'configs/mask_rcnn_xcit_s12_p8_3x_coco_ld.py',
    'upernet': 'configs/upernet_xcit_s12_p16_160k_ade20k_ld.py',
}
SCOPE = {'mask_rcnn': 'mmdet', 'upernet': 'mmseg'}
D = 32


@functools.lru_cache(maxsize=None)
def _load_cached(family):
    return Config.fromfile(osp.join(REPO, LD_CONFIG[family]))


def small_cfg(family, depth, frozen_stages=-1):
    """The layer-decay config of ``family`` with a 32-d trunk of ``depth`` layers."""
    cfg = copy.deepcopy(_load_cached(family))
    cfg.model.backbone.update(arch=dict(embed_dims=D, depth=depth, num_heads=4),
                              norm_cfg=dict(type='BN', requires_grad=True), init_cfg=None,
                              frozen_stages=frozen_stages)
    if family == 'upernet':
        cfg.model.decode_head.update(in_channels=[D] * 4, channels=32,
                                     norm_cfg=dict(type='BN', requires_grad=True))
        cfg.model.auxiliary_head.update(in_channels=D, channels=16,
                                        norm_cfg=dict(type='BN', requires_grad=True))
        cfg.model.data_preprocessor.size = (64, 64)
    else:
        cfg.model.neck.in_channels = [D] * 4
    return cfg


def build_model(cfg):
    init_default_scope(cfg.default_scope)
    return MODELS.build(cfg.model)


def expected_depth(name, num_layers):
    match = re.match(r'backbone\.layers\.(\d+)\.', name)
    if match:
        return int(match.group(1)) + 1
    if name.startswith(('backbone.patch_embed.', 'backbone.pos_embed.')):
        return 0
    return num_layers + 1


def expected_lr(name, cfg, num_layers):
    optimizer = cfg.optim_wrapper.optimizer
    rate = cfg.optim_wrapper.paramwise_cfg.decay_rate
    return optimizer.lr * rate**(num_layers + 1 - expected_depth(name, num_layers))


def expected_wd(name, cfg):
    return 0.0 if 'norm' in name else cfg.optim_wrapper.optimizer.weight_decay


def groups_by_name(model, wrapper):
    """{parameter name: its param group}; each parameter in at most one group."""
    names = {id(p): n for n, p in model.named_parameters()}
    found = {}
    for group in wrapper.optimizer.param_groups:
        for p in group['params']:
            assert names[id(p)] not in found, names[id(p)]
            found[names[id(p)]] = group
    return found


class _Records(logging.Handler):

    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize('depth', [12, 24])
@pytest.mark.parametrize('family', ['mask_rcnn', 'upernet'])
def test_every_parameter_gets_the_rule_of_its_name(family, depth):
    cfg = small_cfg(family, depth, frozen_stages=2)
    assert cfg.optim_wrapper.constructor == 'XCiTLayerDecayOptimizerConstructor'
    assert cfg.optim_wrapper.paramwise_cfg == dict(
        custom_keys={'norm': dict(decay_mult=0.0)}, decay_rate=0.75)  # the paper's wd rule kept
    model = build_model(cfg)
    logger = MMLogger.get_current_instance()
    records = _Records()
    logger.addHandler(records)
    try:
        wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    finally:
        logger.removeHandler(records)
    groups = groups_by_name(model, wrapper)

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert set(groups) == trainable  # every trainable parameter once, no frozen one
    # frozen_stages=2: the embeddings and layers 0 and 1, nothing else
    assert frozen and all(expected_depth(n, depth) <= 2 for n in frozen)
    assert {n for n in trainable if expected_depth(n, depth) <= 2} == set()
    assert 'backbone.layers.2.attn.qkv.weight' in trainable

    for name, group in groups.items():
        assert group['lr'] == pytest.approx(expected_lr(name, cfg, depth), rel=1e-12), name
        assert group['weight_decay'] == expected_wd(name, cfg), name
        assert group['layer_depth'] == expected_depth(name, depth), name
    # spot checks of the rule itself, written out
    lr = cfg.optim_wrapper.optimizer.lr
    last = f'backbone.layers.{depth - 1}.ffn.fc1.weight'
    assert groups[last]['lr'] == pytest.approx(lr * 0.75)
    assert groups['backbone.layers.2.norm1.weight']['lr'] == pytest.approx(lr * 0.75**(depth - 2))
    assert groups['backbone.layers.2.norm1.weight']['weight_decay'] == 0.0
    assert groups['backbone.fpn1.0.weight']['lr'] == lr
    head = 'roi_head.bbox_head.fc_cls.weight' if family == 'mask_rcnn' else \
        'decode_head.conv_seg.weight'
    assert groups[head]['lr'] == lr

    # The first group is a head group: mmengine logs lr[0] of get_lr().
    first = wrapper.optimizer.param_groups[0]
    assert first['layer_depth'] == depth + 1 and first['lr'] == lr
    assert wrapper.get_lr()['lr'][0] == lr
    assert any(p is groups[head]['params'][0] for p in first['params'])
    # Groups are merged per (depth, options) and ordered from the head down.
    depths = [g['layer_depth'] for g in wrapper.optimizer.param_groups]
    assert depths == sorted(depths, reverse=True)
    # decay / no decay for each trainable layer; one group after the trunk (no 'norm' names)
    assert len(depths) == 2 * (depth - 2) + 1

    # One table of the groups, and no per-parameter lines (which state lrs before decay).
    tables = [m for m in records.messages if m.startswith('XCiTLayerDecayOptimizerConstructor:')]
    assert len(tables) == 1
    table = tables[0].splitlines()
    assert f'decay_rate=0.75, {depth} XCiT layers' in table[0]
    assert f'{len(frozen)} frozen tensors' in table[0]
    assert table[1].split()[:4] == ['group', 'depth', 'part', 'lr']
    assert len(table) == 2 + len(depths)
    assert table[2].split()[:2] == ['0', str(depth + 1)]
    assert not any(m.startswith('paramwise_options') for m in records.messages)


def test_other_paramwise_rules_still_apply_and_head_group_without_lr_mult_comes_first():
    """bias_decay_mult and a custom lr_mult from the config apply as with mmengine's default
    constructor; layer decay multiplies on top; the logged lr stays the head's plain lr."""
    cfg = small_cfg('mask_rcnn', 12)
    cfg.optim_wrapper.paramwise_cfg = dict(
        decay_rate=0.5, bias_decay_mult=0.0,
        custom_keys={'norm': dict(decay_mult=0.0), 'backbone.fpn': dict(lr_mult=10.0),
                     'layers.4.ffn': dict(lr_mult=2.0)})
    model = build_model(cfg)
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    groups = groups_by_name(model, wrapper)
    assert set(groups) == {n for n, _ in model.named_parameters()}
    lr, wd = cfg.optim_wrapper.optimizer.lr, cfg.optim_wrapper.optimizer.weight_decay
    for name, group in groups.items():
        mult = 10.0 if 'backbone.fpn' in name else 2.0 if 'layers.4.ffn' in name else 1.0
        assert group['lr'] == pytest.approx(
            lr * mult * 0.5**(13 - expected_depth(name, 12)), rel=1e-12), name
        custom = 'backbone.fpn' in name or 'layers.4.ffn' in name
        no_decay = 'norm' in name or (name.endswith('.bias') and not custom)
        assert group['weight_decay'] == (0.0 if no_decay else wd), name
    # backbone.fpn1.0.weight is the first head parameter, but its group has lr_mult.
    assert wrapper.optimizer.param_groups[0]['lr'] == lr
    assert wrapper.optimizer.param_groups[0]['layer_depth'] == 13

    # LayerDecayLrHook records each depth's plain lr (depths 5 and 13 also have lr_mult groups),
    # under the wrapper's name in an OptimWrapperDict; nothing and a warning without depths.
    hub = MessageHub.get_instance('test_layer_decay_hook')
    for optim_wrapper, prefix in ((wrapper, ''), (OptimWrapperDict(det=wrapper), 'det.')):
        runner = SimpleNamespace(optim_wrapper=optim_wrapper, message_hub=hub)
        LayerDecayLrHook().before_train_iter(runner, 0)
        for d in range(14):
            assert hub.get_scalar(f'train/{prefix}depth_{d}_lr').current() == pytest.approx(
                lr * 0.5**(13 - d), rel=1e-12), (prefix, d)
    plain = build_optim_wrapper(nn.Linear(2, 2), dict(optimizer=dict(type='SGD', lr=0.1)))
    runner = SimpleNamespace(optim_wrapper=plain, message_hub=MessageHub.get_instance('plain'))
    logger, records = MMLogger.get_current_instance(), _Records()
    logger.addHandler(records)
    try:
        LayerDecayLrHook().before_train(runner)
        LayerDecayLrHook().before_train_iter(runner, 0)
    finally:
        logger.removeHandler(records)
    assert [m for m in records.messages if 'no param group has a layer depth' in m]
    assert not runner.message_hub.log_scalars


@pytest.mark.parametrize('paramwise_cfg,error,pattern', [
    (dict(decay_rat=0.75), KeyError, r"unknown paramwise_cfg key\(s\) \['decay_rat'\].*"
                                     r"valid keys: \[.*'custom_keys'.*'decay_rate'"),
    (dict(decay_rate=0.75, norm_decay_mul=0.0), KeyError, r"\['norm_decay_mul'\].*norm_decay_mult"),
    (dict(decay_rate=0.75, num_layers=12), KeyError, r'num_layers.*read from the model'),
    (dict(custom_keys={}), KeyError, r'needs `decay_rate`'),
    (None, KeyError, r'needs `decay_rate`'),
    (dict(decay_rate=1.5), ValueError, r'decay_rate must be a number in \(0, 1\], got 1.5'),
    (dict(decay_rate=0), ValueError, r'decay_rate must be'),
])
def test_paramwise_cfg_mistakes_are_errors(paramwise_cfg, error, pattern):
    cfg = dict(constructor='XCiTLayerDecayOptimizerConstructor',
               optimizer=dict(type='AdamW', lr=1e-4, weight_decay=0.05))
    if paramwise_cfg is not None:
        cfg['paramwise_cfg'] = paramwise_cfg
    with pytest.raises(error, match=pattern):
        build_optim_wrapper(nn.Linear(2, 2), cfg)


def test_model_without_xcit_backbone_is_an_error():
    constructor = XCiTLayerDecayOptimizerConstructor(
        dict(optimizer=dict(type='AdamW', lr=1e-4, weight_decay=0.05)), dict(decay_rate=0.75))
    with pytest.raises(ValueError, match=r'\(Sequential\) contains no XCiTBackbone'):
        constructor(nn.Sequential(nn.Linear(2, 2)))


def test_backbone_parameter_without_a_depth_rule_is_an_error():
    cfg = small_cfg('upernet', 12)
    model = build_model(cfg)
    model.backbone.cls_token = nn.Parameter(torch.zeros(1, 1, D))
    with pytest.raises(ValueError, match=r"backbone parameter 'backbone.cls_token'"):
        build_optim_wrapper(model, cfg.optim_wrapper)


class _SegSamples(torch.utils.data.Dataset):
    """Random 64x64 images with random 150-class masks, already packed for mmseg."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        from mmengine.structures import PixelData
        from mmseg.structures import SegDataSample
        generator = torch.Generator().manual_seed(index)
        image = torch.randint(0, 256, (3, 64, 64), generator=generator, dtype=torch.uint8)
        sample = SegDataSample(metainfo=dict(img_shape=(64, 64), ori_shape=(64, 64)))
        sample.gt_sem_seg = PixelData(
            data=torch.randint(0, 150, (1, 64, 64), generator=generator))
        return dict(inputs=image, data_samples=sample)


class _CheckLoggedLr(Hook):
    """After RuntimeInfoHook and LayerDecayLrHook: what is in the message hub, per iteration."""

    priority = 'LOWEST'

    def __init__(self, head_name, names_by_depth):
        self.head_name = head_name
        self.names_by_depth = names_by_depth
        self.seen = []

    def before_train_iter(self, runner, batch_idx, data_batch=None):
        hub = runner.message_hub
        names = {id(p): n for n, p in runner.model.named_parameters()}
        lr_of = {names[id(p)]: g['lr'] for g in runner.optim_wrapper.optimizer.param_groups
                 for p in g['params']}
        logged = hub.get_scalar('train/lr').current()
        # mmengine 0.10 also logs base_lr (optimizer.lr under the schedule) for several groups
        assert hub.get_scalar('train/base_lr').current() == logged
        per_depth = {d: hub.get_scalar(f'train/depth_{d}_lr').current()
                     for d in self.names_by_depth}
        self.seen.append((logged, lr_of[self.head_name], per_depth,
                          {d: lr_of[n] for d, n in self.names_by_depth.items()},
                          sum(lr_of.values()) / len(lr_of)))


def test_training_logs_the_head_lr_and_every_depth(tmp_path):
    from mmengine.dataset import pseudo_collate
    from mmengine.runner import Runner
    cfg = small_cfg('upernet', 12)
    names_by_depth = {0: 'backbone.patch_embed.proj.0.conv.weight',
                      **{i + 1: f'backbone.layers.{i}.attn.qkv.weight' for i in range(12)},
                      13: 'auxiliary_head.conv_seg.weight'}
    check = _CheckLoggedLr('decode_head.conv_seg.weight', names_by_depth)
    runner = Runner(
        model=cfg.model,
        work_dir=str(tmp_path),
        experiment_name='ld',
        train_dataloader=dict(dataset=_SegSamples(), batch_size=2, num_workers=0,
                              sampler=dict(type='DefaultSampler', shuffle=False),
                              collate_fn=pseudo_collate),
        train_cfg=dict(by_epoch=False, max_iters=3),
        optim_wrapper=cfg.optim_wrapper,
        # lr changes every iteration: the check sees the values of that iteration
        param_scheduler=dict(type='LinearLR', start_factor=0.25, by_epoch=False, begin=0, end=3),
        custom_hooks=cfg.custom_hooks + [check],
        default_hooks=dict(logger=dict(type='LoggerHook', interval=1), checkpoint=None),
        log_processor=dict(by_epoch=False),
        default_scope='mmseg')
    assert any(isinstance(h, LayerDecayLrHook) for h in runner.hooks)
    runner.train()

    assert len(check.seen) == 3
    lr = cfg.optim_wrapper.optimizer.lr
    for it, (logged, head_lr, per_depth, lr_by_depth, mean) in enumerate(check.seen):
        factor = 0.25 + 0.75 * it / 2
        assert logged == head_lr == pytest.approx(lr * factor, rel=1e-9)
        assert logged != pytest.approx(mean)  # never the mean over groups
        assert per_depth == lr_by_depth
        for d, value in per_depth.items():
            assert value == pytest.approx(lr * factor * 0.75**(13 - d), rel=1e-9), d
    log = ''.join(p.read_text() for p in tmp_path.rglob('*.log'))
    assert 'XCiTLayerDecayOptimizerConstructor: decay_rate=0.75, 12 XCiT layers' in log
    lines = [line for line in log.splitlines() if 'Iter(train) [3/3]' in line]
    assert len(lines) == 1
    assert f' lr: {lr:.4e} ' in lines[0]
    assert f'depth_0_lr: {lr * 0.75**13:.4e}' in lines[0]
    assert f'depth_12_lr: {lr * 0.75:.4e}' in lines[0]
