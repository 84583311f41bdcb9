"""Released COCO / ADE20k XCiT models load exactly, strictly and without a conversion step.

The files are built in the exact layouts of the official detection/ and semantic_segmentation/
code (mmdet 2.11 Mask R-CNN, mmseg 0.11 Semantic FPN and UperNet): the backbone under
``backbone.`` with the official trunk names and the adapter as ``nn.Sequential`` modules (with
its SyncBN buffers), and mmdet's / mmseg's neck and head names. Expected values come from
``tests/xcit_reference.py`` (mmpretrain's trunk + plain ``torch.nn`` adapter in the official
structure) and from upstream neck / head modules built separately, never from ``XCiTBackbone``.
"""
from collections import OrderedDict

import pytest
import torch
from mmengine.config import Config
from mmengine.runner import load_checkpoint, load_state_dict
from released_files import RELEASED_HEAD_KEYS, _scope, build, released_file, small_model_cfg
from xcit_reference import OfficialDenseXCiT, mmpretrain_trunk

from xcit_mm.models.utils.checkpoint_io import CheckpointError


def test_released_layouts_are_the_official_ones(mmpretrain_xcit, tmp_path):
    """The files built here really have the released key names (adapter, SyncBN buffers...)."""
    for family, patch_size in (('mask_rcnn', 16), ('sem_fpn', 8), ('upernet', 16)):
        path, _, heads, _ = released_file(mmpretrain_xcit, family, patch_size, tmp_path)
        keys = set(torch.load(path)['state_dict'])
        assert set(RELEASED_HEAD_KEYS[family]) <= keys, family
        adapter = {'backbone.fpn1.0.weight', 'backbone.fpn1.1.running_var',
                   'backbone.fpn1.1.num_batches_tracked', 'backbone.fpn1.3.bias',
                   'backbone.fpn2.0.weight'} if patch_size == 16 else {'backbone.fpn1.0.weight'}
        assert adapter <= keys
        assert not any(k.startswith(('backbone.fpn3', 'backbone.fpn4')) for k in keys)
        assert 'backbone.blocks.3.local_mp.bn.running_mean' in keys
        assert 'backbone.pos_embeder.token_projection.weight' in keys


@pytest.mark.parametrize('patch_size', [8, 16])
@pytest.mark.parametrize('family', ['mask_rcnn', 'sem_fpn', 'upernet'])
def test_released_model_equals_the_official_structure(mmpretrain_xcit, tmp_path, family,
                                                      patch_size):
    """All four backbone levels equal the official construction; neck and heads carry the file's
    tensors; the model's outputs equal upstream neck / heads run on the official levels. Loaded
    through mmengine's ``load_checkpoint`` (the door of ``load_from`` and the upstream APIs),
    strict: any key of the model or the file left unmatched would raise."""
    path, official, heads, cfg = released_file(mmpretrain_xcit, family, patch_size, tmp_path)
    model = build(cfg.model, _scope(family))
    checkpoint = load_checkpoint(model, path, map_location='cpu', strict=True)
    assert model.backbone.last_load_report['layout'] == 'official'
    assert checkpoint['meta']['epoch'] == 36
    model.eval()
    own = model.state_dict()
    for key, value in heads.items():
        assert torch.equal(own[key], value), key
    x = torch.randn(2, 3, 96, 128)
    with torch.no_grad():
        expected = official(x)
        got = model.backbone(x)
        for level, (g, e) in enumerate(zip(got, expected)):
            assert g.shape == e.shape, level
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5, msg=f'level {level}')
        # the rest of the model on top of the official levels, with separately built modules
        if 'neck' in cfg.model:
            neck = build(cfg.model.neck, _scope(family))
            neck.load_state_dict({k[5:]: v for k, v in heads.items() if k.startswith('neck.')})
            feats = neck.eval()(expected)
        else:  # UperNet: the head reads the backbone levels
            feats = expected
        for g, e in zip(model.extract_feat(x), feats):  # the levels' ulps through the neck
            _close(g, e)
        if family == 'mask_rcnn':
            rpn = build(cfg.model.rpn_head, 'mmdet')
            rpn.load_state_dict({k[9:]: v for k, v in heads.items()
                                 if k.startswith('rpn_head.')})
            for g, e in zip(model.rpn_head(feats), rpn(feats)):
                for gl, el in zip(g, e):
                    _close(gl, el)
        else:
            head_cfg = dict(cfg.model.decode_head)
            decode = build(head_cfg, 'mmseg')
            decode.load_state_dict({k[12:]: v for k, v in heads.items()
                                    if k.startswith('decode_head.')})
            decode.eval()
            _close(model._forward(x), decode(feats))


def _close(got, expected):
    """float32 rounding, relative to the map's scale (random heads amplify the inputs' ulps)."""
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5 * max(scale, 1.0))


def test_loading_a_whole_model_is_strict(mmpretrain_xcit, tmp_path):
    """Wrong patch size, wrong task, a missing or an extra tensor: an error naming keys and cause,
    never a model left partly random. Through mmengine's ``load_checkpoint``, non-strict as the
    upstream APIs call it: the backbone's load hooks refuse the file, not mmengine's warning."""
    path16, _, _, cfg16 = released_file(mmpretrain_xcit, 'mask_rcnn', 16, tmp_path)
    det8 = build(small_model_cfg('mask_rcnn', 8).model, 'mmdet')
    with pytest.raises(CheckpointError, match=r'wrong shape.*patch_size=16.*patch_size=8'):
        load_checkpoint(det8, path16, map_location='cpu')
    seg = build(small_model_cfg('sem_fpn', 16).model, 'mmseg')
    with pytest.raises(CheckpointError, match='detector checkpoint'):
        load_checkpoint(seg, path16, map_location='cpu')
    checkpoint = torch.load(path16)
    for change, pattern in (('drop', r'only part of the stride adapter.*fpn2\.0\.weight'),
                            ('extra', r'1 keys do not exist in XCiTBackbone.*fpn5\.weight')):
        state = OrderedDict(checkpoint['state_dict'])
        if change == 'drop':
            del state['backbone.fpn2.0.weight']
        else:
            state['backbone.fpn5.weight'] = torch.zeros(1)
        bad = str(tmp_path / f'{change}.pth')
        torch.save({'state_dict': state}, bad)
        det16 = build(cfg16.model, 'mmdet')
        before = det16.backbone.fpn1[0].weight.clone()
        with pytest.raises(CheckpointError, match=pattern):
            load_checkpoint(det16, bad, map_location='cpu')
        assert torch.equal(det16.backbone.fpn1[0].weight, before)  # nothing half-loaded


# Paper Table 1 (embed_dims, depth, heads): an outside source for the sizes of every arch.
PAPER_ARCHS = {'n12': (128, 12, 4), 't12': (192, 12, 4), 't24': (192, 24, 4),
               's12': (384, 12, 8), 's24': (384, 24, 8), 'm24': (512, 24, 8),
               'l24': (768, 24, 16)}


# Where the size matters to loading and values: 12 against 24 layers (the levels' layers, the
# layer-scale init), both patch sizes (stem and adapter layouts), 4 heads. Every arch's widths,
# depths, heads and levels against Table 1: test_xcit_backbone.py (shapes only, on the meta
# device), so only the smallest arch of each depth is built here.
@pytest.mark.parametrize('patch_size', [8, 16])
@pytest.mark.parametrize('arch', ['n12', 't24'])
def test_every_published_depth_equals_the_official_structure(mmpretrain_xcit, arch, patch_size):
    """For a 12- and a 24-layer arch and both patch sizes, the backbone of a released file
    (official keys, adapter included) loads strictly and gives the four levels of the official
    structure."""
    from xcit_mm import XCiTBackbone
    dims, depth, heads = PAPER_ARCHS[arch]
    out_indices = (depth // 3 - 1, depth // 2 - 1, 2 * depth // 3 - 1, depth - 1)
    trunk = mmpretrain_trunk(mmpretrain_xcit, patch_size, dims, depth, heads, out_indices)
    official = OfficialDenseXCiT(trunk, dims, patch_size)
    released = OrderedDict(('backbone.' + k, v)
                           for k, v in official.released_state_dict().items())
    holder = torch.nn.Module()
    holder.backbone = XCiTBackbone(arch=arch, patch_size=patch_size)
    load_state_dict(holder, released, strict=True)  # what load_checkpoint runs on the file's dict
    assert holder.backbone.last_load_report['layout'] == 'official'
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        for got, want in zip(holder.backbone.eval()(x), official(x)):
            _close(got, want)


# ----------------------------------------------------------------------------- through the tools
@pytest.fixture(scope='module')
def shapes_roots(tmp_path_factory):
    from shapes_world import generate_shapes
    base = tmp_path_factory.mktemp('released_data')
    roots = {}
    for task in ('coco', 'ade'):
        roots[task] = str(base / f'shapes_{task}')
        generate_shapes(roots[task], task=task, num_train=2, num_val=3, image_size=64, seed=0)
    return roots


def _at_64_px(pipeline):
    """``pipeline`` with every image size set to the shapes images' own 64 px (the paper's test
    scale would upscale them to 800 / 512 px and only slow the run down)."""
    for transform in pipeline:
        for key in ('scale', 'crop_size'):
            if key in transform:
                transform[key] = (64, 64)
    return pipeline


def _tool_config(family, patch_size, roots, tmp_path):
    """The paper config of ``family`` with the small model, evaluating on the shapes data in
    its COCO / ADE20k layout, at 64 px, written out as a config file."""
    cfg = small_model_cfg(family, patch_size)
    _at_64_px(cfg.test_dataloader.dataset.pipeline)
    _at_64_px(cfg.train_dataloader.dataset.pipeline)
    if family == 'mask_rcnn':
        root = roots['coco'] + '/'
        cfg.model.roi_head.bbox_head.num_classes = 3
        cfg.model.roi_head.mask_head.num_classes = 3
        cfg.test_dataloader.dataset.update(
            data_root=root, metainfo=dict(classes=('circle', 'square', 'triangle')),
            ann_file='annotations/instances_val.json', data_prefix=dict(img='val/'))
        cfg.test_evaluator.ann_file = root + 'annotations/instances_val.json'
    else:  # ADE20KDataset reads the shapes world's ADE20k layout as it is
        cfg.model.data_preprocessor.size = (64, 64)
        cfg.test_dataloader.dataset.data_root = roots['ade']
        cfg.train_dataloader.dataset.data_root = roots['ade']
    cfg.val_dataloader = cfg.test_dataloader
    cfg.val_evaluator = cfg.test_evaluator
    path = str(tmp_path / f'{family}_p{patch_size}_small.py')
    cfg.dump(path)
    return path, Config.fromfile(path)


# one detector and one segmentor through tools/test.py (the UperNet files' loading and values
# are tested above, test_released_model_equals_the_official_structure[upernet-*])
@pytest.mark.parametrize('family,patch_size', [('mask_rcnn', 16), ('sem_fpn', 8)])
def test_tools_test_evaluates_a_released_file_as_downloaded(
        mmpretrain_xcit, tmp_path, family, patch_size, shapes_roots, test_tool):
    """``tools/test.py CONFIG RELEASED.pth``: no conversion step, the metric comes out."""
    config, cfg = _tool_config(family, patch_size, shapes_roots, tmp_path)
    path, _, _, _ = released_file(mmpretrain_xcit, family, patch_size, tmp_path, cfg=cfg)
    work_dir = tmp_path / 'work'
    test_tool.main([config, path, '--work-dir', str(work_dir)])
    logs = ''.join(p.read_text() for p in work_dir.rglob('*.log'))
    assert '(official layout, converted in memory)' in logs, logs[-2000:]
    metric = 'coco/bbox_mAP' if family == 'mask_rcnn' else 'mIoU'
    assert metric in logs


def test_load_from_a_released_file_in_training(mmpretrain_xcit, tmp_path, shapes_roots,
                                               train_tool):
    """``load_from`` in training reads the released layout the same way (strict, in memory)."""
    config, cfg = _tool_config('sem_fpn', 16, shapes_roots, tmp_path)
    path, _, _, _ = released_file(mmpretrain_xcit, 'sem_fpn', 16, tmp_path, cfg=cfg)
    work_dir = tmp_path / 'train'
    train_tool.main([config, '--work-dir', str(work_dir), '--cfg-options', f'load_from={path}',
                     'train_cfg.max_iters=1', 'train_cfg.val_interval=10',
                     'train_dataloader.batch_size=1', 'train_dataloader.num_workers=0',
                     'train_dataloader.persistent_workers=False',
                     'default_hooks.checkpoint.interval=10'])
    logs = ''.join(p.read_text() for p in work_dir.rglob('*.log'))
    assert '(official layout, converted in memory)' in logs
    assert (work_dir / 'iter_1.pth').is_file()  # it trained from there
