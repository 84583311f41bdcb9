"""The 24 paper configs: they load, build, match the paper's sizes and recipes, and run.

Models are built with ``init_cfg=None`` for the backbone (no download of ImageNet weights) on the
``meta`` device where only shapes matter (parameter counts, head widths), which keeps building all
24 models, M24 included, to a few seconds.
"""
import collections
import copy
import functools
import glob
import math
import os.path as osp
import re
import textwrap

import pytest
import torch
from mmengine.config import Config
from mmengine.model import revert_sync_batchnorm
from mmengine.registry import DefaultScope, init_default_scope

import xcit_mm  # noqa: F401  (registers XCiTBackbone)
from xcit_reference import OfficialAdapter

CONFIG_DIR = osp.join(osp.dirname(osp.dirname(osp.abspath(__file__))), 'configs')
ARCHS = ('t12', 's12', 's24', 'm24')
PATCHES = (16, 8)
EMBED_DIMS = {'t12': 192, 's12': 384, 's24': 384, 'm24': 512}
OFFICIAL_NAMES = {'t12': 'tiny_12', 's12': 'small_12', 's24': 'small_24', 'm24': 'medium_24'}
DROP_PATH = {'t12': 0.0, 's12': 0.05, 's24': 0.1, 'm24': 0.15}
SEM_FPN_DROP_PATH = dict(DROP_PATH, m24=0.2)
SEM_FPN_WIDTH = {'t12': 192, 's12': 384, 's24': 384, 'm24': 512}

# Paper Table 5: parameters of the whole Mask R-CNN, in millions, as printed.
PAPER_PARAMS_M = {
    ('t12', 16): 26.1, ('t12', 8): 25.8, ('s12', 16): 44.3, ('s12', 8): 43.1,
    ('s24', 16): 65.8, ('s24', 8): 64.5, ('m24', 16): 101.1, ('m24', 8): 98.9,
}
# The expected parameter counts are not written down: they are assembled from upstream parts (see
# _upstream_parts): mmpretrain's XCiT of each size, as its own configs define it, less the
# classification-only parameters; the official dense adapter (tests/xcit_reference.py); the
# necks / heads that mmdet's / mmseg's own registries build from the config's model dict.
MMPRETRAIN_NAMES = {'t12': 'tiny-12', 's12': 'small-12', 's24': 'small-24', 'm24': 'medium-24'}
# Top-level parameters of mmpretrain's XCiT that only the ImageNet classifier has (the CLS token,
# the class-attention layers, the final norm; the linear head is another module); the official
# detection / segmentation backbone has none of them.
CLASSIFIER_ONLY = {'cls_token', 'ca_layers', 'norm'}
# The modules that mmdet's TwoStageDetector / mmseg's EncoderDecoder build besides the backbone.
HEAD_PARTS = {'mask_rcnn': {'neck', 'rpn_head', 'roi_head'}, 'sem_fpn': {'neck', 'decode_head'},
              'upernet': {'decode_head', 'auxiliary_head'}}


def _cfg_path(task, arch, patch):
    name = {'mask_rcnn': f'mask_rcnn_xcit_{arch}_p{patch}_3x_coco.py',
            'sem_fpn': f'sem_fpn_xcit_{arch}_p{patch}_80k_ade20k.py',
            'upernet': f'upernet_xcit_{arch}_p{patch}_160k_ade20k.py'}[task]
    return osp.join(CONFIG_DIR, name)


ALL = [(task, arch, patch) for task in ('mask_rcnn', 'sem_fpn', 'upernet') for arch in ARCHS
       for patch in PATCHES]


@functools.lru_cache(maxsize=None)
def _load_cached(task, arch, patch):
    return Config.fromfile(_cfg_path(task, arch, patch))


def _load(task, arch, patch):
    """Each config is parsed once per session (resolving ``mmdet::``/``mmseg::`` bases makes
    mmengine read every upstream metafile, ~0.5 s per base); callers get their own copy."""
    return copy.deepcopy(_load_cached(task, arch, patch))


def _build(cfg, device='meta'):
    """Build ``cfg.model`` in its scope without pretrained weights."""
    init_default_scope(cfg.default_scope)
    from mmengine.registry import MODELS
    model_cfg = cfg.model.copy()
    model_cfg.backbone.init_cfg = None
    with torch.device(device):
        return MODELS.build(model_cfg)


def test_exactly_the_paper_configs_exist():
    found = sorted(osp.basename(p) for p in glob.glob(osp.join(CONFIG_DIR, '*.py')))
    expected = sorted(osp.basename(_cfg_path(*key)) for key in ALL)
    assert set(expected) <= set(found), sorted(set(expected) - set(found))


@pytest.mark.parametrize('task,arch,patch', ALL)
def test_config_recipe(task, arch, patch):
    cfg = _load(task, arch, patch)
    # Stock hooks only: the plugin is imported, the training extras are not switched on.
    assert cfg.custom_imports == dict(imports=['xcit_mm'], allow_failed_imports=False)
    assert not any('training_extras' in str(h['type']) for h in cfg.get('custom_hooks', []))
    assert cfg.default_hooks.checkpoint.type == 'CheckpointHook' and 'runner_type' not in cfg
    backbone = cfg.model.backbone
    assert backbone.type == 'XCiTBackbone'
    assert (backbone.arch, backbone.patch_size) == (arch, patch)
    expected_dpr = SEM_FPN_DROP_PATH[arch] if task == 'sem_fpn' else DROP_PATH[arch]
    assert backbone.drop_path_rate == expected_dpr
    assert backbone.norm_cfg == dict(type='SyncBN', requires_grad=True)
    assert backbone.init_cfg == dict(
        type='Pretrained',
        checkpoint=('https://dl.fbaipublicfiles.com/xcit/'
                    f'xcit_{OFFICIAL_NAMES[arch]}_p{patch}_384_dist.pth'))
    assert 'depth' not in backbone and 'pretrained' not in backbone  # ResNet leftovers deleted
    assert cfg.train_dataloader.batch_size == 2
    assert cfg.auto_scale_lr == dict(enable=False, base_batch_size=16)
    optim = cfg.optim_wrapper
    assert optim.optimizer.type == 'AdamW'
    assert set(optim.optimizer) == {'type', 'lr', 'betas', 'weight_decay'}  # no SGD momentum
    # The released rule, nothing else: no decay for names containing 'norm'.
    assert optim.paramwise_cfg == dict(custom_keys={'norm': dict(decay_mult=0.0)})
    D = EMBED_DIMS[arch]
    if task == 'mask_rcnn':
        assert cfg.default_scope == 'mmdet'
        assert (optim.optimizer.lr, optim.optimizer.weight_decay) == (1e-4, 0.05)
        assert cfg.train_cfg.max_epochs == 36
        warmup, steps = cfg.param_scheduler
        assert (warmup.type, warmup.end, warmup.by_epoch) == ('LinearLR', 501, False)
        assert (steps.type, steps.milestones, steps.end) == ('MultiStepLR', [27, 33], 36)
        assert cfg.model.neck.in_channels == [D] * 4
        assert cfg.model.neck.out_channels == 256 and cfg.model.neck.num_outs == 5
        assert cfg.model.roi_head.bbox_roi_extractor.featmap_strides == [4, 8, 16, 32]
        train = cfg.train_dataloader.dataset
        assert train.data_root == 'data/coco/'
        assert [t.type for t in train.pipeline][2:4] == ['RandomFlip', 'RandomChoice']
        small, crop = train.pipeline[3].transforms
        assert [s[0] for s in small[0].scales] == list(range(480, 801, 32))
        assert [t.type for t in crop] == ['RandomChoiceResize', 'RandomCrop', 'RandomChoiceResize']
        assert crop[1].crop_size == (384, 600)
        assert cfg.test_dataloader.dataset.pipeline[1].scale == (1333, 800)
        assert cfg.val_evaluator.type == 'CocoMetric'
        assert cfg.val_evaluator.metric == ['bbox', 'segm']
        assert cfg.val_evaluator.ann_file == 'data/coco/annotations/instances_val2017.json'
    else:
        assert cfg.default_scope == 'mmseg'
        assert (optim.optimizer.lr, optim.optimizer.weight_decay) == (6e-5, 0.01)
        iters = 80000 if task == 'sem_fpn' else 160000
        assert cfg.train_cfg.max_iters == iters
        warmup, poly = cfg.param_scheduler
        assert (warmup.type, warmup.begin, warmup.end) == ('LinearLR', 0, 1501)
        assert (poly.type, poly.power, poly.eta_min, poly.begin, poly.end) == (
            'PolyLR', 1.0, 0.0, 0, iters + 1)
        assert cfg.model.pretrained is None
        assert cfg.model.data_preprocessor.size == (512, 512)
        assert cfg.model.data_preprocessor.type == 'SegDataPreProcessor'  # upstream kept
        assert cfg.model.test_cfg == {}  # no mode: the lean segmentor chooses (whole if it fits)
        assert cfg.train_dataloader.dataset.data_root == 'data/ade/ADEChallengeData2016'
        crop = [t for t in cfg.train_dataloader.dataset.pipeline if t.type == 'RandomCrop'][0]
        assert crop.crop_size == (512, 512) and crop.cat_max_ratio == 0.75
        assert cfg.test_dataloader.dataset.pipeline[1].scale == (2048, 512)
        assert cfg.test_evaluator.type == 'IoUMetric'
        assert cfg.test_evaluator.iou_metrics == ['mIoU']


def _count(module):
    return sum(p.numel() for p in module.parameters())


def _shapes(params):
    return collections.Counter(tuple(p.shape) for p in params)


@functools.lru_cache(maxsize=None)
def _mmpretrain_metafile():
    """{config path: {parameter counts}} from mmpretrain's published XCiT metafile."""
    import mmpretrain
    import yaml
    path = osp.join(osp.dirname(mmpretrain.__file__), '.mim', 'configs', 'xcit', 'metafile.yml')
    with open(path) as f:
        models = yaml.safe_load(f)['Models']
    published = collections.defaultdict(set)
    for m in models:
        published[m['Config']].add(m['Metadata']['Parameters'])
    return published


_UPSTREAM_TRUNKS = {}


def _upstream_trunk(mmpretrain_xcit, arch, patch):
    """(embed_dims, parameter shapes) of the trunk of the dense XCiT of this size from mmpretrain
    alone: its ImageNet classifier built from its own config (the arch numbers embed_dims / depth
    / num_heads of mmpretrain's config, not xcit_mm's table), less the classification-only
    parameters."""
    if (arch, patch) not in _UPSTREAM_TRUNKS:
        import mmpretrain
        from mmpretrain.registry import MODELS
        rel = f'configs/xcit/xcit-{MMPRETRAIN_NAMES[arch]}-p{patch}_8xb128_in1k-384px.py'
        cfg = Config.fromfile(osp.join(osp.dirname(mmpretrain.__file__), '.mim', rel))
        assert (cfg.model.backbone.patch_size, cfg.model.backbone.depth) == (patch, int(arch[1:]))
        with DefaultScope.overwrite_default_scope('mmpretrain'), torch.device('meta'):
            classifier = MODELS.build(cfg.model)
        # It is the classifier mmpretrain publishes (the metafile's count for this config) ...
        assert _mmpretrain_metafile()[rel] == {_count(classifier)}
        trunk = classifier.backbone
        assert type(trunk) is mmpretrain_xcit
        # ... and only its CLS token, class attention and final norm are left out.
        params = dict(trunk.named_parameters())
        assert CLASSIFIER_ONLY <= {name.split('.')[0] for name in params}
        kept = [p for name, p in params.items() if name.split('.')[0] not in CLASSIFIER_ONLY]
        _UPSTREAM_TRUNKS[(arch, patch)] = (cfg.model.backbone.embed_dims, _shapes(kept))
    return _UPSTREAM_TRUNKS[(arch, patch)]


def _trunk_widths(task, D):
    """The head widths that follow from the trunk's width D, as released: the FPN / UperNet heads
    read D-channel maps, and the semantic FPN is D wide (official sem_fpn configs)."""
    return {'mask_rcnn': {'neck.in_channels': [D] * 4},
            'sem_fpn': {'neck.in_channels': [D] * 4, 'neck.out_channels': D,
                        'decode_head.in_channels': [D] * 4},
            'upernet': {'decode_head.in_channels': [D] * 4,
                        'auxiliary_head.in_channels': D}}[task]


def _upstream_heads(cfg, task, D):
    """{name: module} of the necks / heads built by mmdet's / mmseg's own registries, on the meta
    device, from cfg.model without its backbone, with the widths that follow from D (so a wrong
    width in a config shows), and with the arguments TwoStageDetector adds."""
    cfg = copy.deepcopy(cfg)
    cfg.merge_from_dict({f'model.{k}': v for k, v in _trunk_widths(task, D).items()})
    model = cfg.model
    not_modules = {'type', 'backbone', 'data_preprocessor', 'train_cfg', 'test_cfg', 'pretrained',
                   'init_cfg', '_scope_'}
    parts = {k: v for k, v in model.items() if k not in not_modules and v is not None}
    assert set(parts) == HEAD_PARTS[task]
    if task == 'mask_rcnn':
        from mmdet.registry import MODELS
        parts['rpn_head'].update(train_cfg=model.train_cfg.rpn, test_cfg=model.test_cfg.rpn,
                                 num_classes=1)
        parts['roi_head'].update(train_cfg=model.train_cfg.rcnn, test_cfg=model.test_cfg.rcnn)
    else:
        from mmseg.registry import MODELS
    with DefaultScope.overwrite_default_scope(cfg.default_scope), torch.device('meta'):
        return {k: (torch.nn.ModuleList([MODELS.build(c) for c in v]) if isinstance(v, list)
                    else MODELS.build(v)) for k, v in parts.items()}


_UPSTREAM_COUNTS = {}


def _upstream_parts(mmpretrain_xcit, task, arch, patch):
    """Parameter shapes of the expected backbone (upstream trunk + official adapter) and the
    parameter counts of the upstream necks / heads of a paper config."""
    if (task, arch, patch) not in _UPSTREAM_COUNTS:
        D, trunk = _upstream_trunk(mmpretrain_xcit, arch, patch)
        with torch.device('meta'):
            adapter = OfficialAdapter(D, patch)  # BatchNorm2d for SyncBN: the same parameters
        backbone = trunk + _shapes(adapter.parameters())
        heads = {k: _count(v) for k, v in _upstream_heads(_load(task, arch, patch), task,
                                                          D).items()}
        _UPSTREAM_COUNTS[(task, arch, patch)] = (D, backbone, heads)
    return _UPSTREAM_COUNTS[(task, arch, patch)]


def _total(backbone_shapes, heads):
    return sum(math.prod(s) * n for s, n in backbone_shapes.items()) + sum(heads.values())


@pytest.mark.parametrize('task,arch,patch', ALL)
def test_parameter_count_is_upstream_trunk_adapter_and_heads(task, arch, patch, mmpretrain_xcit):
    """The model a paper config builds has exactly the parameters of the upstream parts: the
    backbone those of mmpretrain's trunk (without the classifier) + the official adapter, shape for
    shape; neck and heads those of mmdet's / mmseg's own modules at the released widths."""
    D, backbone_shapes, heads = _upstream_parts(mmpretrain_xcit, task, arch, patch)
    assert D == EMBED_DIMS[arch]
    model = _build(_load(task, arch, patch))
    assert _shapes(model.backbone.parameters()) == backbone_shapes
    assert _count(model.backbone) == _total(backbone_shapes, {})
    assert {name: _count(getattr(model, name)) for name in heads} == heads
    assert _count(model) == _total(backbone_shapes, heads)
    assert model.backbone.out_channels == [D] * 4
    if task == 'mask_rcnn':
        assert model.roi_head.bbox_head.num_classes == 80


def _documented_mask_rcnn_counts():
    """{(arch, patch): (paper column, "built here" column)} of docs/configs.md's Mask R-CNN
    table."""
    with open(osp.join(osp.dirname(CONFIG_DIR), 'docs', 'configs.md')) as f:
        rows = re.findall(r'^\| `configs/mask_rcnn_xcit_(\w\d+)_p(\d+)_3x_coco\.py` \| [^|]+ \| '
                          r'([\d.]+)M \| ([\d,]+) \|', f.read(), re.M)
    return {(a, int(p)): (float(m), int(n.replace(',', ''))) for a, p, m, n in rows}


@pytest.mark.parametrize('arch,patch', [(a, p) for a in ARCHS for p in PATCHES])
def test_mask_rcnn_parameter_count_matches_paper(arch, patch, mmpretrain_xcit):
    """The upstream count (which the built model equals, test above) is the paper's Table 5 value
    truncated to 0.1M, and the exact number docs/configs.md lists."""
    _, backbone_shapes, heads = _upstream_parts(mmpretrain_xcit, 'mask_rcnn', arch, patch)
    count = _total(backbone_shapes, heads)
    assert math.floor(count / 1e5) / 10 == PAPER_PARAMS_M[(arch, patch)]
    assert _documented_mask_rcnn_counts()[(arch, patch)] == (PAPER_PARAMS_M[(arch, patch)], count)


@pytest.mark.parametrize('task,arch,patch',
                         [k for k in ALL if k[0] in ('sem_fpn', 'upernet')])
def test_segmentor_heads_use_official_dims(task, arch, patch):
    model = _build(_load(task, arch, patch))
    D = EMBED_DIMS[arch]
    head = model.decode_head
    assert head.num_classes == 150
    assert head.conv_seg.out_channels == 150
    assert head.in_index == [0, 1, 2, 3]
    if task == 'sem_fpn':
        width = SEM_FPN_WIDTH[arch]
        assert [c.conv.in_channels for c in model.neck.lateral_convs] == [D] * 4
        assert [c.conv.out_channels for c in model.neck.fpn_convs] == [width] * 4
        assert head.in_channels == [width] * 4
        assert head.channels == 128
        assert head.feature_strides == [4, 8, 16, 32]
        assert not model.with_auxiliary_head
    else:
        assert not model.with_neck
        assert head.in_channels == [D] * 4
        assert head.channels == 512
        assert head.psp_modules.pool_scales == (1, 2, 3, 6)
        aux = model.auxiliary_head
        assert (aux.in_channels, aux.in_index, aux.channels) == (D, 2, 256)
        assert aux.num_classes == 150 and aux.conv_seg.out_channels == 150
        assert aux.loss_decode.loss_weight == 0.4


IMAGENET_URL = re.compile(r'https://dl\.fbaipublicfiles\.com/xcit/'
                          r'xcit_(tiny|small|medium)_(12|24)_p(8|16)_384_dist\.pth')
ARCH_OF_URL = {('tiny', '12'): 't12', ('small', '12'): 's12', ('small', '24'): 's24',
               ('medium', '24'): 'm24'}


@pytest.mark.parametrize('task,arch,patch', ALL)
def test_imagenet_init_is_the_released_384_distilled_file(task, arch, patch):
    """Each config starts from the 384-px distilled weights of its own arch and patch size, as the
    official READMEs' training commands; the 224-px file is one documented override away."""
    cfg = _load(task, arch, patch)
    url = cfg.model.backbone.init_cfg.checkpoint
    match = IMAGENET_URL.fullmatch(url)
    assert match, url
    name, depth, url_patch = match.groups()
    assert (ARCH_OF_URL[(name, depth)], int(url_patch)) == (arch, patch)
    with open(_cfg_path(task, arch, patch)) as f:
        text = f.read()
    url_224 = url.replace('_384_dist.pth', '_224.pth')
    assert f'--cfg-options\n# model.backbone.init_cfg.checkpoint={url_224}`' in text


def _small(task, arch='s12', patch=16):
    """A paper config with a 4-layer, 64-d trunk (same module and parameter names)."""
    cfg = _load(task, arch, patch)
    cfg.model.backbone.arch = dict(embed_dims=64, depth=4, num_heads=4)  # replaces the name
    small = {}
    if task == 'mask_rcnn':
        small['model.neck.in_channels'] = [64] * 4
    elif task == 'sem_fpn':
        small.update({'model.neck.in_channels': [64] * 4, 'model.neck.out_channels': 64,
                      'model.decode_head.in_channels': [64] * 4})
    else:
        small.update({'model.decode_head.in_channels': [64] * 4,
                      'model.auxiliary_head.in_channels': 64})
    cfg.merge_from_dict(small)
    return cfg


def _weight_decays(cfg):
    """{parameter name: weight decay} of the optimizer mmengine builds from cfg.optim_wrapper."""
    from mmengine.optim import build_optim_wrapper
    model = _build(cfg)
    init_default_scope(cfg.default_scope)
    wrapper = build_optim_wrapper(model, cfg.optim_wrapper)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {}
    for group in wrapper.optimizer.param_groups:
        for p in group['params']:
            assert names[id(p)] not in decay
            decay[names[id(p)]] = group['weight_decay']
    assert set(decay) == set(names.values())  # every parameter exactly once
    return decay


@pytest.mark.parametrize('task', ['mask_rcnn', 'sem_fpn', 'upernet'])
def test_weight_decay_is_the_released_rule(task):
    """As the released configs: no decay exactly for names containing 'norm', else the config's
    weight decay (the XCA temperature, gammas, biases and the BatchNorms named `bn` included)."""
    cfg = _small(task)
    wd = cfg.optim_wrapper.optimizer.weight_decay
    assert wd == (0.05 if task == 'mask_rcnn' else 0.01)
    decay = _weight_decays(cfg)
    for name, value in decay.items():
        assert value == (0.0 if 'norm' in name else wd), name
    for name in ['backbone.layers.0.attn.temperature', 'backbone.layers.0.gamma1',
                 'backbone.layers.3.gamma3', 'backbone.layers.0.lpi.bn.weight',
                 'backbone.layers.0.lpi.bn.bias', 'backbone.layers.0.attn.qkv.bias',
                 'backbone.layers.0.ffn.fc2.bias', 'backbone.patch_embed.proj.0.bn.weight',
                 'backbone.pos_embed.proj.bias', 'backbone.fpn1.1.weight',
                 'backbone.fpn1.0.bias', 'backbone.layers.0.attn.qkv.weight']:
        assert decay[name] == wd, name
    for name in ['backbone.layers.0.norm1.weight', 'backbone.layers.0.norm1.bias',
                 'backbone.layers.3.norm2.weight', 'backbone.layers.2.norm3.bias']:
        assert decay[name] == 0.0, name
    assert sum('norm' in n for n in decay) == 4 * 3 * 2  # the trunk's LayerNorms, nothing else
    if task != 'mask_rcnn':  # the heads' ConvModule BatchNorms are named `bn`: decayed
        bns = [n for n in decay if n.startswith('decode_head.') and '.bn.' in n]
        assert bns and all(decay[n] == wd for n in bns)


def _docs_opt_in_snippet():
    with open(osp.join(osp.dirname(CONFIG_DIR), 'docs', 'configs.md')) as f:
        text = f.read()
    blocks = re.findall(r'```python\n(.*?)```', text, re.S)
    block = [b for b in blocks if '_no_decay_norm_scale.py' in b]
    assert len(block) == 1
    namespace = {}
    exec(textwrap.dedent(block[0]).replace('_base_ = ', '_unused = '), namespace)
    return namespace['optim_wrapper']


@pytest.mark.parametrize('task', ['mask_rcnn', 'upernet'])
def test_documented_opt_in_also_exempts_batchnorms_temperature_and_gammas(task):
    """The opt-in of docs/configs.md (the rule these configs had before following the release):
    also no decay for every BatchNorm (by type), the XCA temperature and the layer-scale gammas."""
    cfg = _small(task)
    cfg.merge_from_dict({'optim_wrapper': _docs_opt_in_snippet()})
    wd = cfg.optim_wrapper.optimizer.weight_decay
    model = _build(cfg)
    norms = {f'{m}.{p}' for m, mod in model.named_modules()
             if isinstance(mod, (torch.nn.LayerNorm, torch.nn.modules.batchnorm._BatchNorm))
             for p in ('weight', 'bias')}
    decay = _weight_decays(cfg)
    exempt = {n for n in decay if n in norms or n.endswith('.temperature') or
              re.search(r'\.gamma[123]$', n)}
    assert len([n for n in exempt if n.endswith('temperature')]) == 4
    assert len([n for n in exempt if 'gamma' in n]) == 12
    assert 'backbone.layers.0.lpi.bn.weight' in exempt and 'backbone.fpn1.1.bias' in exempt
    for name, value in decay.items():
        assert value == (0.0 if name in exempt else wd), name


def _lr_factors(cfg, iters):
    """lr / base lr at iterations 0..iters-1 under cfg.param_scheduler (iteration-based ones)."""
    from mmengine.registry import PARAM_SCHEDULERS
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedulers = [PARAM_SCHEDULERS.build(dict(s, optimizer=optimizer))
                  for s in copy.deepcopy(cfg.param_scheduler) if not s.get('by_epoch', True)]
    factors = []
    for _ in range(iters):
        factors.append(optimizer.param_groups[0]['lr'])
        for scheduler in schedulers:
            scheduler.step()
    return factors


@pytest.mark.filterwarnings('ignore:Detected call of')
@pytest.mark.parametrize('task', ['sem_fpn', 'upernet'])
def test_ade_schedule_equals_released_mmcv_poly_with_linear_warmup(task):
    """mmcv 1.x `policy='poly', power=1, min_lr=0, warmup='linear', warmup_iters=1500,
    warmup_ratio=1e-6`: lr(t) = (1 - t/T) * (1e-6 + (1 - 1e-6) * t/1500) for t < 1500, else
    (1 - t/T), over the T iterations of the run."""
    cfg = _load(task, 't12', 16)
    T = cfg.train_cfg.max_iters
    factors = _lr_factors(cfg, T)
    for t, got in enumerate(factors):
        poly = 1 - t / T
        expected = poly * (1e-6 + (1 - 1e-6) * t / 1500) if t < 1500 else poly
        assert got == pytest.approx(expected, rel=1e-9), t


@pytest.mark.filterwarnings('ignore:Detected call of')
def test_detection_warmup_equals_released_mmcv_linear_warmup():
    cfg = _load('mask_rcnn', 't12', 16)
    for t, got in enumerate(_lr_factors(cfg, 600)):
        expected = 0.001 + 0.999 * t / 500 if t < 500 else 1.0
        assert got == pytest.approx(expected, rel=1e-12), t
    steps = [s for s in cfg.param_scheduler if s.get('by_epoch', True)]
    assert len(steps) == 1 and steps[0].milestones == [27, 33] and steps[0].gamma == 0.1


def test_small_detector_trains_one_step_and_predicts():
    """The paper detector config with a small trunk (``_small``: the sizes are tested above, on
    the meta device) trains a step: losses, gradients for every backbone parameter; and
    predicts."""
    from mmdet.testing import demo_mm_inputs
    cfg = _small('mask_rcnn', 't12', 16)
    # Fewer proposals / sampled RoIs keep the CPU step to a few seconds; the path is the same.
    cfg.model.train_cfg.rpn_proposal.max_per_img = 100
    cfg.model.train_cfg.rcnn.sampler.num = 64
    # Construction-time initialisation is enough for a smoke test (init_weights() only adds
    # seconds of logging).
    model = revert_sync_batchnorm(_build(cfg, device='cpu'))
    data = demo_mm_inputs(batch_size=1, image_shapes=(3, 96, 128), num_items=[2],
                          num_classes=80, with_mask=True)
    data = model.data_preprocessor(data, True)
    losses = model(**data, mode='loss')
    total, log_vars = model.parse_losses(losses)  # what the Runner optimises
    assert torch.isfinite(total) and log_vars['loss_mask'] > 0
    total.backward()
    assert all(p.grad is not None for p in model.backbone.parameters() if p.requires_grad)
    model.eval()
    with torch.no_grad():
        data = model.data_preprocessor(
            demo_mm_inputs(batch_size=1, image_shapes=(3, 96, 128), num_classes=80), False)
        results = model(**data, mode='predict')
    assert results[0].pred_instances.bboxes.shape[-1] == 4


def test_small_segmentor_trains_one_step_and_predicts():
    """As the detector's: the paper Semantic FPN config with a small trunk."""
    from mmengine.structures import PixelData
    from mmseg.structures import SegDataSample
    cfg = _small('sem_fpn', 't12', 16)
    assert cfg.model.data_preprocessor.size == (512, 512)
    # Keep the step cheap: no padding to the 512x512 training crop for this tiny batch.
    cfg.model.data_preprocessor.size = None
    cfg.model.data_preprocessor.size_divisor = 32
    model = revert_sync_batchnorm(_build(cfg, device='cpu'))
    h, w = 64, 96
    samples = []
    for _ in range(2):
        sample = SegDataSample(metainfo=dict(img_shape=(h, w), ori_shape=(h, w), pad_shape=(h, w)))
        sample.gt_sem_seg = PixelData(data=torch.randint(0, 150, (1, h, w)))
        samples.append(sample)
    data = dict(inputs=[torch.randint(0, 255, (3, h, w), dtype=torch.uint8) for _ in range(2)],
                data_samples=samples)
    data = model.data_preprocessor(data, True)
    losses = model(**data, mode='loss')
    loss = losses['decode.loss_ce']
    assert torch.isfinite(loss)
    loss.backward()
    model.eval()
    with torch.no_grad():
        pred = model.predict(data['inputs'][:1], data['data_samples'][:1])
    assert pred[0].pred_sem_seg.data.shape == (1, h, w)
