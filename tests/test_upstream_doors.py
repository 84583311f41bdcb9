"""Released XCiT files load exactly, or fail with a named cause, through every upstream door.

:class:`~xcit_mm.models.backbones.XCiTBackbone` converts the published layouts in PyTorch's
state-dict load hooks, so the loaders users actually call need no conversion step:

* detector: ``mmdet.apis.init_detector``, ``mmdet.apis.DetInferencer``;
* segmentor: ``mmseg.apis.init_model``, ``mmseg.apis.MMSegInferencer``;
* both: ``mmengine.runner.load_checkpoint`` (non-strict: it would only warn) and plain
  ``model.load_state_dict(..., strict=False / True)``.

Released files (official trunk names under ``backbone.``, adapter as ``nn.Sequential``, mmcv 1.x
meta) come from :func:`test_released_models.released_file`; expected backbone levels come from
the independent reference (mmpretrain's trunk + the official adapter structure), expected neck /
head tensors from the file itself. Files that do not fit (another XCiT size, another patch
size, the other task, a Swin backbone, no backbone, a DDP prefix) must raise an error naming
the cause at every door, never leave the backbone silently at its random initialisation.
"""
import copy
import re
from collections import OrderedDict

import pytest
import torch
from released_files import D, DEPTH, HEADS, _scope, build, released_file
from xcit_reference import OfficialDenseXCiT, mmpretrain_trunk

from xcit_mm.models.utils import CheckpointError

FAMILIES = {'mask_rcnn': 16, 'sem_fpn': 8}  # the file each family's doors are checked with
DOORS = ['api', 'inferencer', 'load_checkpoint', 'load_state_dict', 'load_state_dict_strict']
TOL = dict(rtol=1e-5, atol=1e-5)


def _other(family):
    return 'sem_fpn' if family == 'mask_rcnn' else 'mask_rcnn'


def _resave(path, **meta):
    """Add meta entries to a file (real mmseg 0.x files carry PALETTE next to CLASSES, which
    ``mmseg.apis.init_model`` reads unconditionally)."""
    checkpoint = torch.load(path)
    checkpoint['meta'].update(meta)
    torch.save(checkpoint, path)


@pytest.fixture(scope='module')
def files(mmpretrain_xcit, tmp_path_factory):
    """Released files, built once: ``{(family, patch_size): (path, official, heads, cfg)}``.

    Both families in both patch sizes: the p16 segmentor / p8 detector files are the
    wrong-patch-size and wrong-task files of the other models.
    """
    out = {}
    for family in FAMILIES:
        for patch_size in (8, 16):
            root = tmp_path_factory.mktemp(f'{family}_p{patch_size}')
            path, official, heads, cfg = released_file(mmpretrain_xcit, family, patch_size, root)
            if family == 'sem_fpn':
                _resave(path, PALETTE=[[0, 0, 0], [255, 255, 255]])
            out[family, patch_size] = (path, official, heads, cfg)
    return out


@pytest.fixture(scope='module')
def image():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(1, 3, 96, 128, generator=generator)


def load_through(door, family, cfg, path):
    """A model of ``cfg`` with ``path`` loaded the way a user of ``door`` would."""
    cfg = copy.deepcopy(cfg)  # the upstream APIs edit the config they are given
    if door == 'api':
        if family == 'mask_rcnn':
            from mmdet.apis import init_detector
            return init_detector(cfg, path, device='cpu')
        from mmseg.apis import init_model
        return init_model(cfg, path, device='cpu')
    if door == 'inferencer':
        if family == 'mask_rcnn':
            from mmdet.apis import DetInferencer
            return DetInferencer(model=cfg, weights=path, device='cpu',
                                 show_progress=False).model
        from mmseg.apis import MMSegInferencer
        return MMSegInferencer(model=cfg, weights=path, device='cpu').model
    model = build(cfg.model, _scope(family))
    if door == 'load_checkpoint':
        from mmengine.runner import load_checkpoint
        load_checkpoint(model, path, map_location='cpu')
    else:
        state_dict = torch.load(path, map_location='cpu')['state_dict']
        model.load_state_dict(state_dict, strict=door == 'load_state_dict_strict')
    return model


def backbone_levels(model, x):
    model.eval()
    with torch.no_grad():
        return model.backbone(x)


def assert_matches_file(model, official, heads, x):
    """Four backbone levels equal the reference's; neck and head tensors equal the file's."""
    with torch.no_grad():
        expected = official(x)
    got = backbone_levels(model, x)
    assert len(got) == len(expected) == 4
    for level, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape, (level, g.shape, e.shape)
        torch.testing.assert_close(g, e, **TOL, msg=lambda m, level=level: f'level {level}: {m}')
    own = model.state_dict()
    for key, value in heads.items():
        assert torch.equal(own[key], value), key


# ----------------------------------------------------------------------------- released files
@pytest.mark.parametrize('door', DOORS)
@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_released_file_loads_exactly_through(files, image, family, door):
    path, official, heads, cfg = files[family, FAMILIES[family]]
    model = load_through(door, family, cfg, path)
    assert_matches_file(model, official, heads, image)
    assert model.backbone.last_load_report['layout'] == 'official'


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_resaved_model_round_trips_through_load_checkpoint(files, image, family, tmp_path):
    """``model.state_dict()`` (xcit_mm layout) saved and loaded back: identical outputs."""
    from mmengine.runner import load_checkpoint
    path, official, heads, cfg = files[family, FAMILIES[family]]
    first = load_through('load_checkpoint', family, cfg, path)
    resaved = str(tmp_path / 'resaved.pth')
    torch.save({'meta': {}, 'state_dict': first.state_dict()}, resaved)
    assert any(k.startswith('backbone.layers.') for k in torch.load(resaved)['state_dict'])
    second = build(cfg.model, _scope(family))
    load_checkpoint(second, resaved, map_location='cpu')
    for a, b in zip(backbone_levels(first, image), backbone_levels(second, image)):
        assert torch.equal(a, b)
    second_state = second.state_dict()
    for key, value in first.state_dict().items():
        assert torch.equal(second_state[key], value), key
    assert_matches_file(second, official, heads, image)
    assert second.backbone.last_load_report['layout'] == 'xcit_mm'


@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_ddp_file_loads_through_load_checkpoint(files, image, family, tmp_path):
    """mmengine's ``load_checkpoint`` strips the DDP ``module.`` prefix before the hooks."""
    path, official, heads, cfg = files[family, FAMILIES[family]]
    ddp = str(tmp_path / 'ddp.pth')
    torch.save({'state_dict': OrderedDict(
        ('module.' + k, v) for k, v in torch.load(path)['state_dict'].items())}, ddp)
    model = load_through('load_checkpoint', family, cfg, ddp)
    assert_matches_file(model, official, heads, image)


# ----------------------------------------------------------------------------- wrong files
def _swap_backbone(path, backbone_state, out):
    """The file at ``path`` with its ``backbone.*`` tensors replaced by ``backbone_state``."""
    checkpoint = torch.load(path)
    state = OrderedDict(('backbone.' + k, v) for k, v in backbone_state.items())
    state.update((k, v) for k, v in checkpoint['state_dict'].items()
                 if not k.startswith('backbone.'))
    checkpoint['state_dict'] = state
    torch.save(checkpoint, out)
    return out


def _other_xcit(mmpretrain_xcit, patch_size, dims, depth):
    out_indices = tuple(range(depth - 4, depth))
    trunk = mmpretrain_trunk(mmpretrain_xcit, patch_size, dims, depth, HEADS, out_indices)
    return OfficialDenseXCiT(trunk, dims, patch_size).released_state_dict()


def _swin_state():
    from mmdet.models.backbones import SwinTransformer
    torch.manual_seed(0)
    swin = SwinTransformer(embed_dims=32, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1))
    return swin.state_dict()


# (case, pattern the message must match), per family; the family's own patch size is FAMILIES
WRONG = {
    'mask_rcnn': {
        'wider_xcit': r'wrong shape.*look like embed_dims=32.*backbone has embed_dims=64',
        'deeper_xcit': r'do not exist in XCiTBackbone.*look like embed_dims=64, depth=6.*'
                       r'backbone has embed_dims=64, depth=4',
        'patch_size': r'wrong shape.*look like .*patch_size=8 while .*patch_size=16',
        'other_task': r'is a segmentor checkpoint \(decode_head\.',
        'swin': r'not XCiT weights: these are the weights of a Swin Transformer backbone',
        'no_backbone': r'has no weights for its XCiTBackbone',
    },
    'sem_fpn': {
        'wider_xcit': r'wrong shape.*look like embed_dims=32.*backbone has embed_dims=64',
        'deeper_xcit': r'do not exist in XCiTBackbone.*look like embed_dims=64, depth=6.*'
                       r'backbone has embed_dims=64, depth=4',
        'patch_size': r'wrong shape.*look like .*patch_size=16 while .*patch_size=8',
        'other_task': r'is a detector checkpoint \((rpn|roi)_head\.',
        'swin': r'not XCiT weights: these are the weights of a Swin Transformer backbone',
        'no_backbone': r'has no weights for its XCiTBackbone',
    },
}


@pytest.fixture(scope='module')
def wrong_files(mmpretrain_xcit, files, tmp_path_factory):
    """``{(family, case): path}``: files that do not fit ``family``'s model (of FAMILIES' patch
    size), each with that model's neck and heads unless the case is the other task."""
    root = tmp_path_factory.mktemp('wrong')
    swin = _swin_state()
    out = {}
    for family, patch_size in FAMILIES.items():
        own = files[family, patch_size][0]
        prefix = str(root / f'{family}_')
        out[family, 'wider_xcit'] = _swap_backbone(
            own, _other_xcit(mmpretrain_xcit, patch_size, D // 2, DEPTH), prefix + 'wide.pth')
        out[family, 'deeper_xcit'] = _swap_backbone(
            own, _other_xcit(mmpretrain_xcit, patch_size, D, DEPTH + 2), prefix + 'deep.pth')
        other_p = 24 - patch_size
        out[family, 'patch_size'] = files[family, other_p][0]
        out[family, 'other_task'] = files[_other(family), patch_size][0]
        out[family, 'swin'] = _swap_backbone(own, swin, prefix + 'swin.pth')
        heads = OrderedDict((k, v) for k, v in torch.load(own)['state_dict'].items()
                            if not k.startswith('backbone.'))
        out[family, 'no_backbone'] = prefix + 'no_backbone.pth'
        torch.save({'meta': torch.load(own)['meta'], 'state_dict': heads},
                   out[family, 'no_backbone'])
    return out


def assert_named_error(info, pattern):
    """The error names the cause and is the CheckpointError itself: no upstream door (mmdet /
    mmseg APIs, inferencers, mmengine) wraps it or turns it into a warning."""
    error = info.value
    message = str(error)
    assert re.search(pattern, message, re.S), f'{type(error).__name__}: {message[:2000]}'
    assert type(error) is CheckpointError, type(error)


def _each_door_in_turn(family_cases):
    """(family, door, case...) with the doors taken in turn: every door goes through the same
    load hooks, so each case is tested once per family and each door several times."""
    return [(*fc, DOORS[i % len(DOORS)]) for i, fc in enumerate(family_cases)]


WRONG_CASES = ['wider_xcit', 'deeper_xcit', 'patch_size', 'other_task', 'swin', 'no_backbone']


@pytest.mark.parametrize('family,case,door', _each_door_in_turn(
    [(family, case) for family in sorted(FAMILIES) for case in WRONG_CASES]))
def test_wrong_file_is_a_named_error_through(files, wrong_files, family, door, case):
    cfg = files[family, FAMILIES[family]][3]
    with pytest.raises(RuntimeError) as info:
        load_through(door, family, cfg, wrong_files[family, case])
    assert_named_error(info, WRONG[family][case])


@pytest.mark.parametrize('strict', [False, True])
@pytest.mark.parametrize('family', sorted(FAMILIES))
def test_ddp_prefixed_state_dict_is_a_named_error_in_load_state_dict(files, family, strict):
    """Plain ``load_state_dict`` does not strip ``module.``: the error says so."""
    path, _, _, cfg = files[family, FAMILIES[family]]
    state = OrderedDict(('module.' + k, v) for k, v in torch.load(path)['state_dict'].items())
    model = build(cfg.model, _scope(family))
    before = model.backbone.layers[0].attn.qkv.weight.clone()
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(state, strict=strict)
    assert_named_error(info, r'no weights for its XCiTBackbone.*DDP prefix "module\."')
    assert torch.equal(model.backbone.layers[0].attn.qkv.weight, before)


@pytest.mark.parametrize('family,door', _each_door_in_turn(
    [(family, ) for _ in DOORS for family in sorted(FAMILIES)][:len(DOORS)]))
def test_other_task_file_of_the_other_patch_size_is_a_named_error_through(
        files, family, door):
    """The released detector file (p16) into the released segmentor's model (p8) and the
    reverse: the error names the other task, the cause to fix, not the patch size that the
    file's backbone happens to have (the model is loaded before its backbone, so the heads it
    lacks are known when the backbone's pre-hook runs)."""
    cfg = files[family, FAMILIES[family]][3]
    other = _other(family)
    path = files[other, FAMILIES[other]][0]
    with pytest.raises(RuntimeError) as info:
        load_through(door, family, cfg, path)
    task = 'segmentor' if other == 'sem_fpn' else 'detector'
    assert_named_error(info, rf'is a {task} checkpoint \((decode|rpn|roi)_head\.')
