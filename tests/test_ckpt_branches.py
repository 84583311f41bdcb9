"""Branches of the checkpoint code (xcit_mm/models/utils) that the layout tests do not reach.

* ckpt_convert: a DDP ``module.`` prefix; the adapter as xcit_mm 0.1 saved it (a bare
  ``ConvTranspose2d``: ``fpn2.weight`` for p16, ``fpn1.weight`` for p8); a ``prefix`` that
  matches no key; the state dict of another backbone (ResNet, Swin, ViT / DeiT), named as such.
* checkpoint_io: a failed download (HTTP 404, connection refused, a body cut short, an error
  page served as the file) names the URL; in a distributed job local rank 0 downloads while
  the other ranks of the machine wait at a barrier, which rank 0 reaches even when it fails.

Expected key names are written out by hand here; tensors are random, so a value that loads
equal came from the file. A stride adapter that is only partly present is an error:
tests/test_released_models.py::test_loading_a_whole_model_is_strict covers it (the pre-hook's
check is the same for a backbone and for a whole model).
"""
import http.server
import importlib.util
import os
import os.path as osp
import re
import socket
import threading
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
from mmengine.runner import load_checkpoint, load_state_dict

from xcit_mm import XCiTBackbone
from xcit_mm.models.utils import (CheckpointError, LayoutError, check_checkpoint,
                                  convert_backbone_state_dict, convert_model_state_dict,
                                  load_checkpoint_file)
from xcit_mm.models.utils.ckpt_load import load_backbone_checkpoint

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
ARCH = dict(embed_dims=64, depth=4, num_heads=4)


def _backbone(patch_size=16, seed=0):
    """A small XCiTBackbone whose every tensor is random (so no fresh init can match it)."""
    torch.manual_seed(seed)
    model = XCiTBackbone(arch=ARCH, patch_size=patch_size, out_indices=(0, 1, 2, 3))
    with torch.no_grad():
        for value in model.state_dict().values():
            if value.is_floating_point():
                value.normal_()
    return model


def assert_same_state(model, expected):
    state = model.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


class _Detector(nn.Module):
    """Just enough of a detector: the backbone plus one neck tensor."""

    def __init__(self, patch_size=16):
        super().__init__()
        self.backbone = XCiTBackbone(arch=ARCH, patch_size=patch_size, out_indices=(0, 1, 2, 3))
        self.neck = nn.Conv2d(64, 8, 1, bias=False)


def _converter():
    """tools/model_converters/convert_checkpoint.py as a module (its main() in this process)."""
    path = osp.join(ROOT, 'tools', 'model_converters', 'convert_checkpoint.py')
    spec = importlib.util.spec_from_file_location('xcit_convert_checkpoint_cli', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- DDP prefix
def test_ddp_prefix_is_stripped_by_the_converter_and_the_loaders(tmp_path):
    """A file saved from a DistributedDataParallel model has every key under ``module.``."""
    src = _backbone()
    own = src.state_dict()
    ddp = OrderedDict(('module.' + k, v) for k, v in own.items())
    converted, info = convert_backbone_state_dict(ddp)
    assert list(converted) == list(own) and info['layout'] == 'xcit_mm'
    assert info['outside'] == []
    # a whole DDP detector: module.backbone.* taken, module.neck.* reported as outside
    neck = torch.randn(8, 64, 1, 1)
    det = OrderedDict([('module.backbone.' + k, v) for k, v in own.items()] +
                      [('module.neck.weight', neck)])
    converted, info = convert_backbone_state_dict(det)
    assert list(converted) == list(own) and info['outside'] == ['neck.weight']
    whole, info = convert_model_state_dict(det)
    assert list(whole) == ['backbone.' + k for k in own] + ['neck.weight']
    assert info['layout'] == 'xcit_mm'
    # the loaders: a backbone init from the file; a whole model through mmengine's
    # load_checkpoint (its revise_keys strip module., then the hooks convert the backbone)
    path = str(tmp_path / 'ddp.pth')
    torch.save({'state_dict': ddp}, path)
    dst = XCiTBackbone(arch=ARCH, out_indices=(0, 1, 2, 3),
                       init_cfg=dict(type='Pretrained', checkpoint=path))
    dst.init_weights()
    assert_same_state(dst, own)
    whole_path = str(tmp_path / 'ddp_detector.pth')
    torch.save({'state_dict': det}, whole_path)
    model = _Detector()
    load_checkpoint(model, whole_path, map_location='cpu', strict=True)
    assert model.backbone.last_load_report['layout'] == 'xcit_mm'
    assert_same_state(model.backbone, own)
    assert torch.equal(model.neck.weight, neck)


# ----------------------------------------------------------------------------- xcit_mm 0.1 files
# xcit_mm 0.1 stored the adapter's single transposed conv bare; the official layout (and
# XCiTBackbone since) wraps it in an nn.Sequential. Names by hand, per patch size.
OLD_ADAPTER_NAMES = {
    16: {'fpn2.0.weight': 'fpn2.weight', 'fpn2.0.bias': 'fpn2.bias'},
    8: {'fpn1.0.weight': 'fpn1.weight', 'fpn1.0.bias': 'fpn1.bias'},
}


@pytest.mark.parametrize('patch_size', [16, 8])
def test_adapter_keys_of_xcit_mm_0_1_files_load(tmp_path, patch_size):
    src = _backbone(patch_size)
    own = src.state_dict()
    renames = OLD_ADAPTER_NAMES[patch_size]
    assert set(renames) <= set(own)  # the names this test expects of today's backbone
    old = OrderedDict((renames.get(k, k), v) for k, v in own.items())
    for new_name, old_name in renames.items():
        assert old_name in old and new_name not in old
    path = str(tmp_path / 'xcit_mm_0.1.pth')
    torch.save({'state_dict': old}, path)
    dst = XCiTBackbone(arch=ARCH, patch_size=patch_size, out_indices=(0, 1, 2, 3))
    report = load_backbone_checkpoint(dst, path)
    assert report['layout'] == 'xcit_mm' and report['adapter_fresh'] == []
    assert_same_state(dst, own)  # the old adapter conv loaded, not left at its initialisation
    # the same keys inside a whole detector (mmengine's backbone.* prefix)
    model = _Detector(patch_size)
    state = OrderedDict(('backbone.' + k, v) for k, v in old.items())
    state['neck.weight'] = torch.randn(8, 64, 1, 1)
    load_state_dict(model, state, strict=True)  # mmengine's, as load_checkpoint calls it
    assert_same_state(model.backbone, own)


# ----------------------------------------------------------------------------- prefix
def test_a_prefix_matching_no_key_is_an_error_naming_the_keys(tmp_path):
    src = _backbone()
    own = src.state_dict()
    first = next(iter(own))
    assert first == 'patch_embed.proj.0.conv.weight'
    with pytest.raises(LayoutError) as info:
        convert_backbone_state_dict(own, prefix='model.')
    assert (f"No key starts with prefix 'model.'; first keys: ['{first}'"
            in str(info.value)), str(info.value)
    path = str(tmp_path / 'bare.pth')
    torch.save({'state_dict': own}, path)
    dst = XCiTBackbone(arch=ARCH, out_indices=(0, 1, 2, 3))
    before = OrderedDict((k, v.clone()) for k, v in dst.state_dict().items())
    with pytest.raises(CheckpointError) as info:
        load_backbone_checkpoint(dst, path, prefix='model.')
    assert (f"{path}: no key starts with prefix 'model.'; first keys: ['{first}'"
            in str(info.value)), str(info.value)
    assert_same_state(dst, before)  # nothing loaded
    dst = XCiTBackbone(arch=ARCH, out_indices=(0, 1, 2, 3),
                       init_cfg=dict(type='Pretrained', checkpoint=path, prefix='model.'))
    with pytest.raises(CheckpointError, match=r"no key starts with prefix 'model\.'"):
        dst.init_weights()
    out = str(tmp_path / 'out.pth')
    with pytest.raises(SystemExit) as info:
        _converter().main([path, out, '--prefix', 'model.'])
    assert "error: No key starts with prefix 'model.'" in str(info.value.code)
    assert not osp.exists(out)


# ----------------------------------------------------------------------------- other backbones
def _zeros(*shape):
    return torch.zeros(*shape)


# State dicts of other backbones, keys written by hand in each library's names.
FOREIGN = {
    'a ResNet': OrderedDict([  # torchvision / mmdet ResNet-50
        ('conv1.weight', _zeros(64, 3, 7, 7)), ('bn1.weight', _zeros(64)),
        ('layer1.0.conv1.weight', _zeros(64, 64, 1, 1)), ('layer1.0.bn1.weight', _zeros(64)),
        ('layer4.2.conv3.weight', _zeros(2048, 512, 1, 1)), ('fc.weight', _zeros(1000, 2048))]),
    'a Swin Transformer': OrderedDict([  # mmdet's SwinTransformer
        ('patch_embed.projection.weight', _zeros(96, 3, 4, 4)),
        ('stages.0.blocks.0.norm1.weight', _zeros(96)),
        ('stages.0.blocks.0.attn.w_msa.relative_position_bias_table', _zeros(169, 3)),
        ('stages.0.blocks.0.attn.w_msa.qkv.weight', _zeros(288, 96))]),
    'a ViT / DeiT': OrderedDict([  # mmpretrain's VisionTransformer
        ('cls_token', _zeros(1, 1, 64)), ('pos_embed', _zeros(1, 197, 64)),
        ('patch_embed.projection.weight', _zeros(64, 3, 16, 16)),
        ('layers.0.ln1.weight', _zeros(64)), ('layers.0.attn.qkv.weight', _zeros(192, 64)),
        ('layers.0.ffn.layers.0.0.weight', _zeros(256, 64))]),
    'a timm DeiT': OrderedDict([  # timm's / facebookresearch/deit's VisionTransformer
        ('cls_token', _zeros(1, 1, 64)), ('pos_embed', _zeros(1, 197, 64)),
        ('patch_embed.proj.weight', _zeros(64, 3, 16, 16)),
        ('blocks.0.norm1.weight', _zeros(64)), ('blocks.0.attn.qkv.weight', _zeros(192, 64)),
        ('blocks.0.attn.proj.weight', _zeros(64, 64)), ('blocks.0.mlp.fc1.weight', _zeros(256, 64)),
        ('norm.weight', _zeros(64)), ('head.weight', _zeros(1000, 64))]),
}
NAMED_AS = {'a timm DeiT': 'a ViT / DeiT'}


@pytest.mark.parametrize('kind', sorted(FOREIGN))
def test_another_backbone_is_named_not_converted(tmp_path, kind):
    """The converter refuses the file (no XCiT layout), the loaders name the backbone it holds,
    the converter tool writes nothing. A DeiT in timm's names shares the ``blocks.*`` root with
    official XCiT files: it must not pass for an XCiT of another size."""
    state = FOREIGN[kind]
    first = next(iter(state))
    with pytest.raises(LayoutError) as info:
        convert_backbone_state_dict(state)
    message = str(info.value)
    assert 'Unrecognised checkpoint layout' in message and 'Is this an XCiT checkpoint?' in message
    assert f"First keys: ['{first}'" in message
    path = str(tmp_path / 'other.pth')
    torch.save({'state_dict': state}, path)
    with pytest.raises(CheckpointError) as info:
        load_backbone_checkpoint(XCiTBackbone(arch=ARCH, out_indices=(0, 1, 2, 3)), path)
    assert (f'{path}: The weights given to XCiTBackbone are not XCiT weights: these are the '
            f'weights of {NAMED_AS.get(kind, kind)} backbone, not XCiT. Use a checkpoint of an '
            f'XCiT model, or a config with the backbone this file was trained with'
            in str(info.value)), str(info.value)
    out = str(tmp_path / 'out.pth')
    with pytest.raises(SystemExit) as info:
        _converter().main([path, out])
    assert 'error: Unrecognised checkpoint layout' in str(info.value.code)
    assert not osp.exists(out)


# ----------------------------------------------------------------------------- downloads
def _checkpoint_bytes(tmp_path):
    path = str(tmp_path / 'source.pth')
    torch.save({'state_dict': OrderedDict(w=torch.arange(300.))}, path)
    return open(path, 'rb').read()


class _Server(http.server.BaseHTTPRequestHandler):
    """/good.pth: the file; /short.pth: its first half under the full Content-Length (the
    connection closes early); /page.pth: an HTML error page with status 200; anything else 404."""
    body = b''

    def log_message(self, *args):
        pass

    def do_GET(self):
        name = self.path.rsplit('/', 1)[-1]
        if name not in ('good.pth', 'short.pth', 'page.pth'):
            self.send_error(404)
            return
        body = b'<html><title>Quota exceeded</title></html>' if name == 'page.pth' else self.body
        self.send_response(200)
        self.send_header('Content-Length', str(len(body)))
        self.end_headers()
        self.wfile.write(body[:len(body) // 2] if name == 'short.pth' else body)
        self.close_connection = True


@pytest.fixture
def server(tmp_path, monkeypatch):
    """``(base URL, file bytes, hub cache dir)`` of a local HTTP server; TORCH_HOME in tmp."""
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch_home'))
    data = _checkpoint_bytes(tmp_path)
    handler = type('Handler', (_Server, ), dict(body=data))
    httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05, ), daemon=True)
    thread.start()
    yield (f'http://127.0.0.1:{httpd.server_address[1]}/ckpts', data,
           str(tmp_path / 'torch_home' / 'hub' / 'checkpoints'))
    httpd.shutdown()
    httpd.server_close()


def _refused_url():
    sock = socket.socket()
    sock.bind(('127.0.0.1', 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there any more
    return f'http://127.0.0.1:{port}/ckpts/good.pth'


def test_a_good_url_is_cached_and_read(server):
    base, data, cache = server
    loaded = load_checkpoint_file(f'{base}/good.pth')
    assert torch.equal(loaded['state_dict']['w'], torch.arange(300.))
    assert open(osp.join(cache, 'good.pth'), 'rb').read() == data


@pytest.mark.parametrize('reader', [load_checkpoint_file, check_checkpoint])
def test_a_failed_download_names_the_url(server, reader):
    base, _, cache = server
    for url, cause, detail in ((f'{base}/missing.pth', 'HTTPError', 'HTTP Error 404: Not Found'),
                               (_refused_url(), 'URLError', 'Connection refused')):
        with pytest.raises(CheckpointError) as info:
            reader(url)
        message = str(info.value)
        assert f'Cannot download checkpoint {url}: {cause}: ' in message, message
        assert detail in message, message
        assert 'download it yourself and pass the local file' in message
        assert not osp.exists(osp.join(cache, url.rsplit('/', 1)[-1]))  # nothing cached


@pytest.mark.parametrize('reader', [load_checkpoint_file, check_checkpoint])
def test_a_download_cut_short_or_an_error_page_names_the_url_and_the_cached_copy(
        server, reader):
    """urllib saves a body cut short without complaint, and a server may answer 200 with an
    error page: the cached copy would be read again by every later run, so the message names
    the URL, the cached file and that it must be deleted."""
    base, data, cache = server
    for name, problem in (('short.pth', 'is truncated or corrupt'),
                          ('page.pth', "is not a PyTorch checkpoint (it starts with '<html>")):
        url = f'{base}/{name}'
        cached = osp.join(cache, name)
        with pytest.raises(CheckpointError) as info:
            reader(url)
        message = str(info.value)
        assert url in message and problem in message, message
        assert f'delete {cached}' in message, message
        assert osp.isfile(cached)  # what the message tells to delete exists
    assert os.path.getsize(osp.join(cache, 'short.pth')) == len(data) // 2


# ----------------------------------------------------------------------------- LOCAL_RANK
@pytest.fixture
def fake_dist(monkeypatch, tmp_path):
    """A 2-process job simulated in this process: the download and mmengine's barrier are
    recorded in ``events``. ``state['rank0_writes']``: the barrier returns once "local rank 0"
    has written the file (what a real barrier waits for on the other ranks)."""
    import mmengine.dist
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch_home'))
    good = _checkpoint_bytes(tmp_path)
    events = []
    state = dict(rank0_writes=None, fail=False)

    def download(url, dst, *args, **kwargs):
        events.append('download')
        if state['fail']:
            import urllib.error
            raise urllib.error.URLError('[Errno 111] Connection refused')
        with open(dst, 'wb') as f:
            f.write(good)

    def barrier(*args, **kwargs):
        events.append('barrier')
        if state['rank0_writes']:
            with open(state['rank0_writes'], 'wb') as f:
                f.write(good)

    monkeypatch.setattr(torch.hub, 'download_url_to_file', download)
    monkeypatch.setattr(mmengine.dist, 'barrier', barrier)
    monkeypatch.setattr(mmengine.dist, 'get_world_size', lambda *args, **kwargs: 2)
    return events, state, str(tmp_path / 'torch_home' / 'hub' / 'checkpoints')


URL = 'http://example.invalid/xcit/xcit_tiny_12_p16_224.pth'


def _read_weights(reader=load_checkpoint_file):
    result = reader(URL)
    if isinstance(result, str):  # check_checkpoint returns the local copy
        result = torch.load(result, weights_only=True)
    return result['state_dict']['w']


@pytest.mark.parametrize('reader', [load_checkpoint_file, check_checkpoint])
def test_local_rank_0_downloads_then_meets_the_barrier(fake_dist, monkeypatch, reader):
    events, _, cache = fake_dist
    monkeypatch.setenv('LOCAL_RANK', '0')
    assert torch.equal(_read_weights(reader), torch.arange(300.))
    assert events == ['download', 'barrier']
    # cached: no second download, but the barrier still (the other ranks call it too)
    events.clear()
    assert torch.equal(_read_weights(reader), torch.arange(300.))
    assert events == ['barrier'] and os.listdir(cache) == ['xcit_tiny_12_p16_224.pth']


@pytest.mark.parametrize('reader', [load_checkpoint_file, check_checkpoint])
def test_other_local_ranks_wait_at_the_barrier_then_read(fake_dist, monkeypatch, reader):
    """Rank 1 never downloads: the file appears only when the barrier returns (rank 0 wrote
    it), so reading it proves the read comes after the barrier."""
    events, state, cache = fake_dist
    monkeypatch.setenv('LOCAL_RANK', '1')
    state['rank0_writes'] = osp.join(cache, 'xcit_tiny_12_p16_224.pth')
    os.makedirs(cache)
    assert torch.equal(_read_weights(reader), torch.arange(300.))
    assert events == ['barrier']


def test_a_failed_download_on_rank_0_still_meets_the_barrier(fake_dist, monkeypatch):
    """Rank 0 raising before the barrier would leave the other ranks of the machine waiting
    there (a hang until the process group times out): it meets the barrier, then raises."""
    events, state, _ = fake_dist
    monkeypatch.setenv('LOCAL_RANK', '0')
    state['fail'] = True
    with pytest.raises(CheckpointError, match=rf'Cannot download checkpoint {re.escape(URL)}: '
                                              r'URLError: .*Connection refused'):
        load_checkpoint_file(URL)
    assert events == ['download', 'barrier']


def test_other_ranks_name_the_url_when_rank_0_failed(fake_dist, monkeypatch):
    """After the barrier the file is not there: the error names the URL and where rank 0
    should have put it, not a bare FileNotFoundError."""
    events, _, cache = fake_dist
    monkeypatch.setenv('LOCAL_RANK', '1')
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(URL)
    message = str(info.value)
    assert f'Cannot download checkpoint {URL}: local rank 0' in message, message
    assert osp.join(cache, 'xcit_tiny_12_p16_224.pth') in message
    assert events == ['barrier']


def test_without_a_process_group_every_process_downloads_itself(fake_dist, monkeypatch):
    """LOCAL_RANK set by a launcher but no process group (``--launcher none``): nobody would
    download for this process, so it does, and meets no barrier."""
    import mmengine.dist
    events, _, _ = fake_dist
    monkeypatch.setattr(mmengine.dist, 'get_world_size', lambda *args, **kwargs: 1)
    monkeypatch.setenv('LOCAL_RANK', '1')
    assert torch.equal(_read_weights(), torch.arange(300.))
    assert events == ['download']
