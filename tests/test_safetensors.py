"""XCiT weights from safetensors files and Hugging Face Hub names, through every door, offline.

- timm's published files: mmpretrain's XCiT port (N12/16) with random weights
  (tests/xcit_reference.py), in timm's names (classifier keys, ``pos_embed.``, class attention's
  q/k/v), saved as timm saves ``model.safetensors`` and, the same tensors, as ``.pth``;
- the Hub: a cache laid out as huggingface_hub lays one out (``refs/main``,
  ``snapshots/<commit>/<file>`` linked to ``blobs/<sha256>``), read by huggingface_hub itself
  with ``HF_HUB_OFFLINE=1``; its online errors come from huggingface_hub's own download code
  answered by a mocked Hub (``X-Error-Code`` headers as the Hub sends them), never the network;
- whole models: a small Mask R-CNN and the shapes Semantic FPN, whose ``.pth`` (with
  ``dataset_meta``) the converter turns into safetensors.

Every level, tensor and ``dataset_meta`` loaded from safetensors or a Hub name must equal the one
loaded from the same weights in ``.pth``; each door is opened once.
"""
import contextlib
import copy
import hashlib
import importlib.util
import io
import json
import os
import os.path as osp
import pickle
import runpy
import sys
import time
from collections import OrderedDict
from typing import Tuple

import pytest
import torch
from conftest import upstream_tool
from mmengine.config import Config
from released_files import build, small_model_cfg
from safetensors.torch import save_file
from work_dir_files import evaluation_metrics
from xcit_reference import mmpretrain_trunk, to_official

from shapes_world import generate_shapes
from xcit_mm import XCiTBackbone
from xcit_mm.models.utils import CheckpointError, load_checkpoint_file

REPO = osp.dirname(osp.dirname(osp.abspath(__file__)))
TIMM_REPO = 'timm/xcit_nano_12_p16_224.fb_in1k'
RESNET_REPO = 'timm/resnet18.a1_in1k'
DET_REPO = 'xcit-mm/mask-rcnn-xcit-small'
SEG_REPO = 'xcit-mm/sem-fpn-xcit-shapes'
SEG_CONFIG = osp.join(REPO, 'configs', 'shapes', 'sem_fpn_xcit_shapes_ade.py')
CLASSES = ('background', 'circle', 'square', 'triangle')
PALETTE = [[0, 0, 0], [220, 20, 60], [0, 130, 255], [20, 200, 60]]
WORLD = dict(task='ade', num_train=1, num_val=2, image_size=64, seed=0, progress=False)


def _commit(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()


def add_to_cache(cache, repo_id: str, files: dict) -> str:
    """``files`` ({name: bytes}) as huggingface_hub caches them after downloading ``repo_id``
    at its main branch; returns the commit."""
    commit = _commit(repo_id)
    repo = cache / ('models--' + repo_id.replace('/', '--'))
    for name, data in files.items():
        blob = repo / 'blobs' / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = repo / 'snapshots' / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(osp.relpath(blob, link.parent))
    (repo / 'refs').mkdir(exist_ok=True)
    (repo / 'refs' / 'main').write_text(commit)
    return commit


def _bytes(path) -> bytes:
    with open(path, 'rb') as f:
        return f.read()


def _load_script(relpath: str):
    spec = importlib.util.spec_from_file_location(
        'safetensors_test_' + osp.basename(relpath)[:-3], osp.join(REPO, relpath))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- files and cache
@pytest.fixture(scope='module')
def timm_files(mmpretrain_xcit, tmp_path_factory):
    """The same N12/16 ImageNet weights in timm's layout as ``.pth`` and as safetensors."""
    root = tmp_path_factory.mktemp('timm')
    trunk = mmpretrain_trunk(mmpretrain_xcit, 16, 128, 12, 4, out_indices=(3, 5, 7, 11))
    state = OrderedDict((k.replace('pos_embeder.', 'pos_embed.'), v.contiguous())
                        for k, v in to_official(trunk.state_dict()).items())
    assert 'cls_attn_blocks.0.attn.q.weight' in state and 'pos_embed.token_projection.bias' in state
    pth, st = str(root / 'pytorch_model.bin'), str(root / 'model.safetensors')
    torch.save(state, pth)
    save_file(state, st, metadata={'format': 'pt'})  # as timm writes model.safetensors
    return dict(pth=pth, safetensors=st)


@pytest.fixture(scope='module')
def hub(timm_files, tmp_path_factory):
    """The Hub cache: timm's XCiT N12 repository and, as something that is not XCiT, a ResNet."""
    cache = tmp_path_factory.mktemp('hf_cache')
    timm_config = dict(architecture='xcit_nano_12_p16_224', num_classes=1000, num_features=128,
                       pretrained_cfg=dict(tag='fb_in1k'))
    commit = add_to_cache(cache, TIMM_REPO, {
        'model.safetensors': _bytes(timm_files['safetensors']),
        'config.json': json.dumps(timm_config).encode()})
    torch.manual_seed(0)
    resnet = OrderedDict([('conv1.weight', torch.randn(64, 3, 7, 7)),
                          ('bn1.weight', torch.ones(64)),
                          ('layer1.0.conv1.weight', torch.randn(64, 64, 3, 3)),
                          ('fc.weight', torch.randn(1000, 512))])
    resnet_file = str(cache / 'resnet.safetensors')
    save_file(resnet, resnet_file, metadata={'format': 'pt'})
    add_to_cache(cache, RESNET_REPO, {
        'model.safetensors': _bytes(resnet_file),
        'config.json': json.dumps(dict(architecture='resnet18', num_classes=1000)).encode()})
    return dict(cache=cache, commit=commit)


@pytest.fixture
def offline_hub(hub, monkeypatch):
    """``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1`` (huggingface_hub reads both when imported)."""
    from huggingface_hub import constants
    monkeypatch.setenv('HF_HUB_CACHE', str(hub['cache']))
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    monkeypatch.setattr(constants, 'HF_HUB_CACHE', str(hub['cache']))
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', True)
    return hub


def test_the_cache_is_laid_out_as_huggingface_hub_reads_it(offline_hub):
    from huggingface_hub import hf_hub_download
    cache, commit = offline_hub['cache'], offline_hub['commit']
    snapshot = cache / f'models--timm--xcit_nano_12_p16_224.fb_in1k/snapshots/{commit}'
    for revision in (None, 'main', commit):
        path = hf_hub_download(TIMM_REPO, 'model.safetensors', revision=revision)
        assert path == str(snapshot / 'model.safetensors'), path
    assert osp.realpath(path).startswith(str(cache / 'models--timm--xcit_nano_12_p16_224.fb_in1k'
                                             / 'blobs'))


# ----------------------------------------------------------------------------- the backbone
def _pretrained(checkpoint) -> XCiTBackbone:
    torch.manual_seed(0)  # the same fresh stride adapter each time (ImageNet files have none)
    model = XCiTBackbone(arch='n12', patch_size=16,
                         init_cfg=dict(type='Pretrained', checkpoint=checkpoint))
    model.init_weights()
    return model.eval()


def _levels(model, x):
    with torch.no_grad():
        return model(x)


def test_backbone_from_safetensors_and_hub_names_equals_the_pth(timm_files, offline_hub):
    """init_cfg: the four levels from timm's safetensors file and from its Hub name (at the main
    branch and at a commit) equal those from the same weights in .pth."""
    x = torch.randn(1, 3, 64, 80, generator=torch.Generator().manual_seed(0))
    reference = _pretrained(timm_files['pth'])
    expected = _levels(reference, x)
    assert reference.last_load_report['layout'] == 'timm'
    for checkpoint in (timm_files['safetensors'], f'hf-hub:{TIMM_REPO}',
                       f'hf-hub:{TIMM_REPO}@{offline_hub["commit"]}'):
        model = _pretrained(checkpoint)
        report = model.last_load_report  # safetensors lists keys by name, not as saved
        assert dict(report, classifier=sorted(report['classifier'])) == dict(
            reference.last_load_report, classifier=sorted(reference.last_load_report['classifier']))
        got = _levels(model, x)
        assert len(got) == 4
        for level, (g, e) in enumerate(zip(got, expected)):
            assert torch.equal(g, e), (checkpoint, level)


def test_nothing_is_unpickled_on_the_safetensors_path(timm_files, offline_hub, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError('unpickling on the safetensors path')

    for owner, name in ((torch, 'load'), (pickle, 'load'), (pickle, 'loads'),
                        (pickle, 'Unpickler')):
        monkeypatch.setattr(owner, name, refuse)
    from mmengine.runner import load_checkpoint
    for checkpoint in (timm_files['safetensors'], f'hf-hub:{TIMM_REPO}'):
        assert load_checkpoint_file(checkpoint)['state_dict']
        load_checkpoint(XCiTBackbone(arch='n12'), checkpoint)  # mmengine's door
    with pytest.raises(AssertionError, match='unpickling'):  # the patch does catch a .pth
        load_checkpoint_file(timm_files['pth'])


def test_save_safetensors_writes_numpy_and_tensor_meta_as_json_and_leaves_out_the_rest(tmp_path):
    """numpy and torch values become JSON lists / numbers; an object JSON cannot hold is named."""
    import numpy as np

    from xcit_mm.models.utils.checkpoint_io import save_safetensors
    out = str(tmp_path / 'meta.safetensors')
    weight = torch.arange(4.)
    meta = dict(epoch=3, loss=np.float64(0.25), hist=np.array([1, 2]), t=torch.tensor([1.5]),
                hook=object())
    # the same storage twice: written as a copy (safetensors refuses shared tensors)
    assert save_safetensors({'w': weight, 'v': weight}, out, meta) == ['hook']
    loaded = load_checkpoint_file(out)
    assert loaded['meta'] == dict(epoch=3, loss=0.25, hist=[1, 2], t=[1.5])
    assert torch.equal(loaded['state_dict']['v'], weight)
    # another writer's metadata that is not JSON is read as the text it is
    save_file({'w': weight}, out, metadata={'format': 'pt', 'note': 'fine-tuned', 'n': '2'})
    assert load_checkpoint_file(out)['meta'] == dict(note='fine-tuned', n=2)


# ----------------------------------------------------------------------------- errors
def _one_line(info) -> str:
    message = str(info.value)
    assert '\n' not in message, message
    return message


def test_every_truncation_of_a_safetensors_file_is_named(tmp_path):
    full = str(tmp_path / 'full.safetensors')
    save_file({'w': torch.arange(40.)}, full, metadata={'format': 'pt'})
    data = _bytes(full)
    cut = str(tmp_path / 'cut.safetensors')
    with open(cut, 'wb') as f:
        f.write(data)
    for n in range(len(data) - 1, -1, -1):
        os.truncate(cut, n)
        with pytest.raises(CheckpointError) as info:
            load_checkpoint_file(cut)
        assert (f'cut.safetensors ({n} bytes): the safetensors file is truncated or corrupt'
                in _one_line(info)), n
    with open(cut, 'wb') as f:
        f.write(data.replace(b'"dtype"', b'"dtypo"'))
    with pytest.raises(CheckpointError, match=r'\(\d+ bytes\): the safetensors file is truncated'):
        load_checkpoint_file(cut)


def test_an_html_page_saved_as_safetensors_is_named_as_such(tmp_path):
    page = tmp_path / 'model.safetensors'
    page.write_text('<!DOCTYPE html><html><body>Too many requests</body></html>')
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(str(page))
    assert ("model.safetensors (58 bytes) is not a safetensors file (it starts with "
            "'<!DOCTYPE ht'...). A failed download" in _one_line(info))


def test_not_cached_while_offline_names_the_cache_and_hf_hub_offline(offline_hub):
    cache = str(offline_hub['cache'])
    for name, at in (('hf-hub:timm/xcit_tiny_12_p16_224.fb_in1k', ''),
                     (f'hf-hub:{TIMM_REPO}@v2', " at revision 'v2'")):
        with pytest.raises(CheckpointError) as info:
            _pretrained(name)
        message = _one_line(info)
        assert f'model.safetensors of {name[7:].split("@")[0]}{at} is not in the Hugging Face ' \
               f'cache ({cache}) and HF_HUB_OFFLINE is set. Download it once' in message, message


def test_a_repository_that_is_not_xcit_is_named(offline_hub):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(f'hf-hub:{RESNET_REPO}')
    assert (f"hf-hub:{RESNET_REPO} is not an XCiT model: its config.json names the architecture "
            f"'resnet18', its weights look like a ResNet. Use the Hub name of an XCiT model"
            in _one_line(info))
    # without a config.json, or with one that is not a JSON object, the weights alone tell
    resnet = _bytes(str(offline_hub['cache'] / 'resnet.safetensors'))
    for repo, files in (('someone/resnet-no-config', {}),
                        ('someone/resnet-list-config', {'config.json': b'["resnet18"]'})):
        add_to_cache(offline_hub['cache'], repo, dict(files, **{'model.safetensors': resnet}))
        with pytest.raises(CheckpointError) as info:
            load_checkpoint_file(f'hf-hub:{repo}')
        assert (f'hf-hub:{repo} is not an XCiT model: its weights look like a ResNet. Use the '
                in _one_line(info))
    with pytest.raises(CheckpointError, match='is not a Hugging Face Hub name: write '
                                              'hf-hub:OWNER/NAME or hf-hub:OWNER/NAME@REVISION'):
        load_checkpoint_file('hf-hub:xcit_small_12_p16_384')


def test_a_cut_hub_file_names_the_cached_repository_to_delete(offline_hub, timm_files):
    add_to_cache(offline_hub['cache'], 'someone/cut-xcit',
                 {'model.safetensors': _bytes(timm_files['safetensors'])[:1000]})
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file('hf-hub:someone/cut-xcit')
    message = _one_line(info)
    assert 'checkpoint hf-hub:someone/cut-xcit, cached at ' in message, message
    assert 'the safetensors file is truncated or corrupt' in message, message
    folder = offline_hub['cache'] / 'models--someone--cut-xcit'
    assert f'The Hub file is cached: delete {folder} and run again' in message, message


@pytest.fixture
def mocked_hub(hub, monkeypatch):
    """huggingface_hub online, every request answered here as the Hub answers it."""
    import httpx2
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils._http import default_client_factory
    codes = {'no-such-repo': (404, 'RepoNotFound'), 'gated': (403, 'GatedRepo'),
             'no-such-revision': (404, 'RevisionNotFound'), 'no-file': (404, 'EntryNotFound')}

    def answer(request):
        for word, (status, code) in codes.items():
            if word in str(request.url):
                return httpx2.Response(status, headers={'X-Error-Code': code}, request=request)
        if 'behind-a-proxy' in str(request.url):
            raise httpx2.ProxyError('407 Proxy Authentication Required', request=request)
        raise httpx2.ConnectError('no network', request=request)

    monkeypatch.setattr(constants, 'HF_HUB_CACHE', str(hub['cache']))
    monkeypatch.setattr(constants, 'HF_HUB_OFFLINE', False)
    monkeypatch.setattr(time, 'sleep', lambda seconds: None)  # its retries' back-off
    huggingface_hub.set_client_factory(lambda: httpx2.Client(
        transport=httpx2.MockTransport(answer), follow_redirects=True))
    yield
    huggingface_hub.set_client_factory(default_client_factory)


@pytest.mark.parametrize('name,message', [
    ('hf-hub:someone/no-such-repo', 'no repository someone/no-such-repo on the Hugging Face Hub '
                                    '(or it is private). Check the name'),
    ('hf-hub:someone/gated', 'someone/gated is a gated repository. Accept its terms at '
                             'https://huggingface.co/someone/gated, then log in'),
    (f'hf-hub:{TIMM_REPO}@no-such-revision', f"the repository {TIMM_REPO} has no revision "
                                             f"'no-such-revision' (a branch, tag or commit)"),
    ('hf-hub:someone/no-file', 'someone/no-file has no model.safetensors. xcit_mm reads only '
                               'safetensors weights from the Hub'),
    ('hf-hub:someone/unreachable', 'is not in the Hugging Face cache ({cache}) and the Hub could '
                                   'not be reached (ConnectError). Download it once'),
    ('hf-hub:someone/behind-a-proxy', 'cannot download model.safetensors of someone/behind-a-proxy '
                                      'from the Hugging Face Hub (ProxyError: 407 Proxy '
                                      'Authentication Required). Check the network'),
])
def test_hub_errors_name_the_fix(mocked_hub, hub, name, message):
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(name)
    assert message.format(cache=hub['cache']) in _one_line(info)


# ----------------------------------------------------------------------------- whole models
def _converted(converter, pth, out) -> Tuple[str, str]:
    """The file written and what the converter printed."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        converter.main([pth, out, '--full-model', '--format', 'safetensors'])
    return out, printed.getvalue()


@pytest.fixture(scope='module')
def converter():
    return _load_script('tools/model_converters/convert_checkpoint.py')


@pytest.fixture(scope='module')
def det_files(hub, converter, tmp_path_factory):
    """A small Mask R-CNN's weights and dataset_meta as .pth, as safetensors written by the
    converter, and that file as the Hub repository DET_REPO."""
    root = tmp_path_factory.mktemp('det')
    cfg = small_model_cfg('mask_rcnn', 16)
    torch.manual_seed(1)
    state = build(cfg.model, 'mmdet').state_dict()
    pth = str(root / 'mask_rcnn.pth')
    torch.save({'state_dict': state, 'meta': {'dataset_meta': dict(classes=CLASSES[1:],
                                                                   palette=PALETTE[1:])}}, pth)
    st, printed = _converted(converter, pth, str(root / 'mask_rcnn.safetensors'))
    add_to_cache(hub['cache'], DET_REPO, {'model.safetensors': _bytes(st)})
    return dict(cfg=cfg, state=state, pth=pth, safetensors=st, printed=printed)


@pytest.fixture(scope='module')
def seg_files(hub, converter, tmp_path_factory):
    """The shapes Semantic FPN's weights, files as det_files', and a 2-image shapes world."""
    root = tmp_path_factory.mktemp('seg')
    cfg = Config.fromfile(SEG_CONFIG)
    torch.manual_seed(2)
    state = build(cfg.model, 'mmseg').state_dict()
    pth = str(root / 'sem_fpn.pth')
    torch.save({'state_dict': state, 'meta': {'dataset_meta': dict(classes=CLASSES,
                                                                   palette=PALETTE)}}, pth)
    st, _ = _converted(converter, pth, str(root / 'sem_fpn.safetensors'))
    add_to_cache(hub['cache'], SEG_REPO, {'model.safetensors': _bytes(st)})
    world = str(root / 'shapes_ade')
    generate_shapes(world, **{k: v for k, v in WORLD.items() if k != 'progress'})
    return dict(cfg=cfg, state=state, pth=pth, safetensors=st, world=world)


def _assert_same_model(model, state):
    own = model['state'] if isinstance(model, dict) else model.state_dict()
    assert set(own) == set(state)
    for key, value in state.items():
        assert torch.equal(own[key], value), key


def _assert_dataset_meta(model, classes):
    assert model.dataset_meta['classes'] == list(classes), model.dataset_meta


def test_converter_writes_the_layout_and_meta_as_safetensors(det_files):
    from safetensors import safe_open
    with safe_open(det_files['safetensors'], framework='pt') as f:
        metadata = f.metadata()
    assert metadata['format'] == 'pt' and json.loads(metadata['layout']) == 'xcit_mm'
    assert json.loads(metadata['source']) == 'mask_rcnn.pth'
    assert json.loads(metadata['dataset_meta']) == dict(classes=list(CLASSES[1:]),
                                                        palette=PALETTE[1:])
    checkpoint = load_checkpoint_file(det_files['safetensors'])
    assert checkpoint['meta']['dataset_meta']['classes'] == list(CLASSES[1:])
    assert set(checkpoint['state_dict']) == set(det_files['state'])
    backbone = sum(k.startswith('backbone.') for k in det_files['state'])
    assert f'kept      {backbone} backbone tensors' in det_files['printed']
    heads = len(det_files['state']) - backbone
    assert f'kept      {heads} neck/head tensors unchanged' in det_files['printed']


def test_converter_reads_a_hub_name(offline_hub, converter, timm_files, tmp_path, capsys):
    """hf-hub: source, backbone kept in xcit_mm's layout, written as safetensors: the same
    backbone as the .pth."""
    out = str(tmp_path / 'xcit_n12_p16.safetensors')
    converter.main([f'hf-hub:{TIMM_REPO}', out, '--arch', 'n12'])
    assert 'timm layout' in capsys.readouterr().out
    assert load_checkpoint_file(out)['meta'] == dict(source=f'hf-hub:{TIMM_REPO}', layout='timm')
    x = torch.randn(1, 3, 48, 64, generator=torch.Generator().manual_seed(1))
    for g, e in zip(_levels(_pretrained(out), x), _levels(_pretrained(timm_files['pth']), x)):
        assert torch.equal(g, e)


def test_init_detector_reads_a_hub_name(offline_hub, det_files):
    from mmdet.apis import init_detector
    model = init_detector(copy.deepcopy(det_files['cfg']), f'hf-hub:{DET_REPO}', device='cpu')
    _assert_same_model(model, det_files['state'])
    _assert_dataset_meta(model, CLASSES[1:])


def test_det_inferencer_reads_a_safetensors_file(det_files):
    from mmdet.apis import DetInferencer
    model = DetInferencer(model=copy.deepcopy(det_files['cfg']), weights=det_files['safetensors'],
                          device='cpu', show_progress=False).model
    _assert_same_model(model, det_files['state'])
    _assert_dataset_meta(model, CLASSES[1:])


def test_init_model_reads_a_safetensors_file(seg_files):
    from mmseg.apis import init_model
    model = init_model(copy.deepcopy(seg_files['cfg']), seg_files['safetensors'], device='cpu')
    _assert_same_model(model, seg_files['state'])
    _assert_dataset_meta(model, CLASSES)


def test_mmseg_inferencer_reads_a_hub_name(offline_hub, seg_files):
    from mmseg.apis import MMSegInferencer
    model = MMSegInferencer(model=copy.deepcopy(seg_files['cfg']), weights=f'hf-hub:{SEG_REPO}',
                            device='cpu').model
    _assert_same_model(model, seg_files['state'])
    _assert_dataset_meta(model, CLASSES)


def _test_options(world, name):
    return (['--cfg-options', f'visualizer.name=vis_{name}_{time.time_ns()}',
             f'test_dataloader.dataset.data_root={world}', 'test_dataloader.batch_size=2',
             'test_dataloader.dataset.pipeline.1.scale=(64,64)',
             'model.data_preprocessor.size=(64,64)', f'shapes_world.root={world}'] +
            [f'shapes_world.{k}={v}' for k, v in WORLD.items()])


@pytest.fixture
def loaded_by_runner(monkeypatch):
    """The state dict of the model a Runner loaded its ``load_from`` into."""
    from mmengine.runner import Runner
    loaded = {}
    original = Runner.load_checkpoint

    def load_checkpoint(self, filename, *args, **kwargs):
        result = original(self, filename, *args, **kwargs)
        loaded.update(filename=filename, state=self.model.state_dict())
        return result

    monkeypatch.setattr(Runner, 'load_checkpoint', load_checkpoint)
    return loaded


def test_our_test_tool_reads_a_hub_name(offline_hub, seg_files, test_tool, loaded_by_runner,
                                        tmp_path):
    """tools/test.py puts the checked file in ``load_from``, which the Runner reads."""
    work_dir = str(tmp_path / 'ours')
    test_tool.main([SEG_CONFIG, f'hf-hub:{SEG_REPO}', '--work-dir', work_dir] +
                   _test_options(seg_files['world'], 'ours'))
    assert loaded_by_runner['filename'].endswith('/model.safetensors')
    _assert_same_model(loaded_by_runner, seg_files['state'])
    assert 'mIoU' in evaluation_metrics(work_dir)


def test_mmsegs_test_tool_reads_a_safetensors_file(seg_files, loaded_by_runner, tmp_path,
                                                   monkeypatch):
    """mmseg's own tools/test.py (as ``mim test mmseg`` runs it), in this process."""
    tool = upstream_tool('mmseg', 'test')
    work_dir = str(tmp_path / 'mmseg')
    monkeypatch.setenv('LOCAL_RANK', '0')
    monkeypatch.setattr(sys, 'argv', [tool, SEG_CONFIG, seg_files['safetensors'], '--work-dir',
                                      work_dir] + _test_options(seg_files['world'], 'mmseg'))
    runpy.run_path(tool, run_name='__main__')
    assert loaded_by_runner['filename'] == seg_files['safetensors']
    _assert_same_model(loaded_by_runner, seg_files['state'])
    assert 'mIoU' in evaluation_metrics(work_dir)


def test_our_test_tool_reports_an_uncached_hub_name_in_one_line(offline_hub, test_tool):
    with pytest.raises(SystemExit) as info:
        test_tool.main([SEG_CONFIG, 'hf-hub:xcit-mm/not-downloaded'])
    message = str(info.value.code)
    assert message.startswith('error: checkpoint hf-hub:xcit-mm/not-downloaded: model.safetensors')
    assert 'HF_HUB_OFFLINE is set' in message and '\n' not in message
