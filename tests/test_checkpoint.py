"""Published-weight loading: every layout matches mmpretrain's XCiT port; bad files fail clearly.

The reference is mmpretrain's port (``mmpretrain.models.backbones.xcit.XCiT``) with random weights
and randomised BN statistics; its state dict is written to disk in each layout found in the wild,
with key names mapped by hand here (independently of ``xcit_mm.models.utils.ckpt_convert``).
"""
import os
import shutil
import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

from xcit_reference import mmpretrain_trunk, to_official

from xcit_mm import XCiTBackbone
from xcit_mm.models.utils import LayoutError, convert_backbone_state_dict as convert_state_dict
from xcit_mm.models.utils.ckpt_load import load_backbone_checkpoint as load_pretrained
from xcit_mm.models.utils.checkpoint_io import (CheckpointError, extract_state_dict,
                                                load_checkpoint_file as read_checkpoint)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = dict(embed_dims=64, depth=4, num_heads=4)
OUT_INDICES = (0, 1, 2, 3)


def _mmpretrain_model(mmpretrain_xcit, patch_size, embed_dims=64, depth=4):
    return mmpretrain_trunk(mmpretrain_xcit, patch_size, embed_dims=embed_dims, depth=depth,
                            out_indices=OUT_INDICES[:depth])


def write_layout(layout, model, path, patch_size):
    sd = model.state_dict()
    if layout == 'mmpretrain':
        obj = {'meta': {'epoch': 300}, 'state_dict': OrderedDict(
            [('backbone.' + k, v) for k, v in sd.items()] +
            [('head.fc.weight', torch.zeros(1000, 64)), ('head.fc.bias', torch.zeros(1000))])}
    elif layout == 'official':
        obj = {'model': to_official(sd), 'epoch': 400}
    elif layout == 'timm':
        obj = OrderedDict((k.replace('pos_embeder.', 'pos_embed.'), v)
                          for k, v in to_official(sd).items())
    else:
        raise ValueError(layout)
    torch.save(obj, path)


def reference_features(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize('patch_size', [8, 16])
@pytest.mark.parametrize('layout', ['official', 'timm', 'mmpretrain'])
def test_published_layouts_match_mmpretrain_port(mmpretrain_xcit, tmp_path, layout, patch_size):
    ref = _mmpretrain_model(mmpretrain_xcit, patch_size)
    path = str(tmp_path / f'{layout}.pth')
    write_layout(layout, ref, path, patch_size)
    model = XCiTBackbone(arch=ARCH, patch_size=patch_size, out_indices=OUT_INDICES,
                         init_cfg=dict(type='Pretrained', checkpoint=path))
    model.init_weights()
    model.eval()
    x = torch.randn(2, 3, 64, 96)
    expected = reference_features(ref, x)
    with torch.no_grad():
        got = model.forward_trunk(x)
    assert len(got) == len(expected) == 4
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    # and the dense outputs are built on exactly those features
    with torch.no_grad():
        outs = model(x)
    torch.testing.assert_close(outs[2 if patch_size == 16 else 1], expected[2 if patch_size == 16
                                                                            else 1])


def test_own_and_mmengine_checkpoints_round_trip(mmpretrain_xcit, tmp_path):
    """xcit_mm's layout: a bare state dict and an mmengine detector checkpoint (backbone.*)."""
    ref = _mmpretrain_model(mmpretrain_xcit, 16)
    src = str(tmp_path / 'official.pth')
    write_layout('official', ref, src, 16)
    model = XCiTBackbone(arch=ARCH, out_indices=OUT_INDICES,
                         init_cfg=dict(type='Pretrained', checkpoint=src))
    model.init_weights()
    # a whole detector checkpoint as mmengine's Runner writes it (plain tensors + meta)
    detector = {'meta': {'epoch': 3, 'iter': 10},
                'state_dict': OrderedDict([('backbone.' + k, v)
                                           for k, v in model.state_dict().items()] +
                                          [('neck.lateral_convs.0.conv.weight',
                                            torch.zeros(8, 64, 1, 1))])}
    det_path = str(tmp_path / 'epoch_3.pth')
    torch.save(detector, det_path)
    again = XCiTBackbone(arch=ARCH, out_indices=OUT_INDICES,
                         init_cfg=dict(type='Pretrained', checkpoint=det_path))
    again.init_weights()
    x = torch.randn(1, 3, 64, 64)
    model.eval()
    again.eval()
    with torch.no_grad():
        for a, b in zip(model(x), again(x)):  # adapter included: loaded, not re-initialised
            torch.testing.assert_close(a, b)
    converted, info = convert_state_dict(extract_state_dict(torch.load(det_path)))
    assert info['layout'] == 'xcit_mm' and info['outside'] == ['neck.lateral_convs.0.conv.weight']


def test_converter_cli_round_trip(mmpretrain_xcit, tmp_path, capsys):
    """The converter's ``main`` refuses a wrong arch (its exit message; the exit of a process is
    test_an_html_page_saved_as_pth_is_named_as_such's), converts, and converts its own output
    again to the same file."""
    from conftest import _load_tool
    ref = _mmpretrain_model(mmpretrain_xcit, 8)
    src, dst, dst2 = (str(tmp_path / n) for n in ('official.pth', 'conv.pth', 'conv2.pth'))
    write_layout('official', ref, src, 8)
    converter = _load_tool('tools/model_converters/convert_checkpoint.py')
    # n12 is the wrong arch for this tiny checkpoint: the CLI must say so and write nothing
    with pytest.raises(SystemExit) as info:
        converter.main([src, dst, '--arch', 'n12', '--patch-size', '8'])
    assert str(info.value.code).startswith('error: ') and 'embed_dims=64' in info.value.code
    assert not os.path.exists(dst)
    converter.main([src, dst])
    out = capsys.readouterr().out
    assert 'official layout' in out and 'classification-only' in out
    converter.main([dst, dst2])
    first = torch.load(dst, weights_only=True)['state_dict']
    second = torch.load(dst2, weights_only=True)['state_dict']
    assert list(first) == list(second)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not any(k.startswith(('cls_', 'head', 'norm.')) for k in first)
    model = XCiTBackbone(arch=ARCH, patch_size=8, out_indices=OUT_INDICES,
                         init_cfg=dict(type='Pretrained', checkpoint=dst)).eval()
    model.init_weights()
    x = torch.randn(1, 3, 48, 40)
    with torch.no_grad():
        for g, e in zip(model.forward_trunk(x), ref(x)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)

    # --full-model: the official backbone under backbone. beside a neck and a head; what it
    # prints is counted here on the file it read and the file it wrote
    official = torch.load(src, weights_only=True)['model']
    others = OrderedDict([('neck.fpn_convs.0.conv.weight', torch.randn(64, 64, 3, 3)),
                          ('decode_head.conv_seg.bias', torch.randn(5))])
    whole = OrderedDict(('backbone.' + k, v) for k, v in official.items())
    whole.update(others)
    src_whole, dst_whole = str(tmp_path / 'whole.pth'), str(tmp_path / 'whole_conv.pth')
    torch.save({'state_dict': whole}, src_whole)
    capsys.readouterr()  # what the conversions above printed
    converter.main([src_whole, dst_whole, '--full-model'])
    out = capsys.readouterr().out
    written = torch.load(dst_whole, weights_only=True)['state_dict']
    backbone = {k: v for k, v in written.items() if k.startswith('backbone.')}
    assert [k for k in written if k not in backbone] == list(others)
    assert all(torch.equal(written[k], v) for k, v in others.items())
    classifier_roots = ('cls_token', 'cls_attn_blocks.', 'norm.', 'head.')
    classifier = [k for k in official if k.startswith(classifier_roots)]
    values = sum(v.numel() for k, v in backbone.items() if 'num_batches' not in k)
    assert f'official layout, {len(whole)} tensors' in out
    assert f'kept      {len(backbone)} backbone tensors ({values / 1e6:.2f}M values)' in out
    assert f'kept      {len(others)} neck/head tensors unchanged' in out
    assert f'dropped   {len(classifier)} classification-only keys' in out
    assert len(backbone) == len(first) and classifier


def detect_layout(state_dict):
    return convert_state_dict(state_dict, prefix='')[1]['layout']


def test_detect_layout():
    lpi = {'blocks.0.local_mp.conv1.weight': 0}
    assert detect_layout({'blocks.0.attn.qkv.weight': 0, 'pos_embeder.x': 0, **lpi}) == 'official'
    assert detect_layout({'blocks.0.attn.qkv.weight': 0, 'pos_embed.x': 0, **lpi}) == 'timm'
    with pytest.raises(LayoutError, match='Unrecognised'):  # a timm ViT / DeiT: no LPI
        detect_layout({'blocks.0.attn.qkv.weight': 0, 'pos_embed': 0})
    assert detect_layout({'xca_layers.0.attn.qkv.weight': 0}) == 'mmpretrain'
    assert detect_layout({'layers.0.lpi.conv1.weight': 0}) == 'xcit_mm'
    with pytest.raises(LayoutError, match='Unrecognised checkpoint layout'):
        detect_layout({'conv1.weight': 0, 'fc.weight': 0})


# ------------------------------------------------------------------------- mismatches
@pytest.fixture
def official_s12_like(tmp_path, mmpretrain_xcit):
    ref = _mmpretrain_model(mmpretrain_xcit, 16, embed_dims=96, depth=4)
    path = str(tmp_path / 'other.pth')
    write_layout('official', ref, path, 16)
    return path


def test_wrong_width_names_shapes_and_cause(official_s12_like):
    model = XCiTBackbone(arch=ARCH, out_indices=OUT_INDICES)
    with pytest.raises(CheckpointError, match=r'wrong shape.*embed_dims=96.*embed_dims=64'):
        load_pretrained(model, official_s12_like)


def test_wrong_patch_size_and_depth(mmpretrain_xcit, tmp_path):
    ref = _mmpretrain_model(mmpretrain_xcit, 8)
    path = str(tmp_path / 'p8.pth')
    write_layout('official', ref, path, 8)
    model = XCiTBackbone(arch=ARCH, patch_size=16, out_indices=OUT_INDICES)
    with pytest.raises(CheckpointError, match=r'patch_size=8 .*patch_size=16'):
        load_pretrained(model, path)
    deeper = XCiTBackbone(arch=dict(ARCH, depth=6), patch_size=8, out_indices=(0, 1, 2, 5))
    with pytest.raises(CheckpointError, match=r'trunk weights are missing.*'
                                              r'layers\.4\..*depth=4'):
        load_pretrained(deeper, path)


def test_missing_trunk_key_is_an_error(mmpretrain_xcit, tmp_path):
    ref = _mmpretrain_model(mmpretrain_xcit, 16)
    sd = to_official(ref.state_dict())
    del sd['blocks.2.attn.temperature']
    path = str(tmp_path / 'partial.pth')
    torch.save({'model': sd}, path)
    model = XCiTBackbone(arch=ARCH, out_indices=OUT_INDICES)
    with pytest.raises(CheckpointError, match=r"1 trunk weights.*layers\.2\.attn\.temperature"):
        load_pretrained(model, path)


def test_checkpoint_matching_nothing_is_an_error(tmp_path):
    path = str(tmp_path / 'resnet.pth')
    torch.save({'state_dict': {'conv1.weight': torch.zeros(1)}}, path)
    with pytest.raises(CheckpointError, match='are not XCiT weights: none of the published XCiT '
                                              r"layouts matches; first keys \['conv1.weight'\]"):
        load_pretrained(XCiTBackbone(arch=ARCH, out_indices=OUT_INDICES), path)
    with pytest.raises(CheckpointError, match=r"not found: .*nope\.pth"):
        load_pretrained(XCiTBackbone(arch=ARCH, out_indices=OUT_INDICES),
                        str(tmp_path / 'nope.pth'))


# ------------------------------------------------------------------------- unsafe files
class _Payload:
    """Unpickling this runs code: it must never happen under the default settings."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, 'w'))


def test_pickled_code_is_refused_and_never_run(tmp_path):
    marker = tmp_path / 'pwned'
    path = str(tmp_path / 'evil.pth')
    with open(path, 'wb') as f:
        torch.save({'state_dict': {'x': torch.zeros(1)}, 'hook': _Payload(str(marker))}, f)
    with pytest.raises(CheckpointError, match=r'Refusing to load .*evil\.pth.*weights_only'
                                              r'=False'):
        read_checkpoint(path)
    model = XCiTBackbone(arch=ARCH, out_indices=OUT_INDICES,
                         init_cfg=dict(type='Pretrained', checkpoint=path))
    with pytest.raises(CheckpointError, match='Refusing to load'):
        model.init_weights()
    assert not marker.exists()


def test_trusted_full_checkpoint_opt_in(mmpretrain_xcit, tmp_path):
    """A checkpoint with non-tensor objects loads only with the explicit opt-in."""
    ref = _mmpretrain_model(mmpretrain_xcit, 16)
    path = str(tmp_path / 'full.pth')
    torch.save({'model': to_official(ref.state_dict()),
                'args': _Namespace(lr=1e-3)}, path)
    model = XCiTBackbone(arch=ARCH, out_indices=OUT_INDICES)
    with pytest.raises(CheckpointError, match='Refusing to load'):
        load_pretrained(model, path)
    report = load_pretrained(model, path, weights_only=False)
    assert report['layout'] == 'official' and report['adapter_fresh'] == ['fpn1', 'fpn2']


class _Namespace:
    """Stands for argparse.Namespace in official files: harmless, but not a tensor."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_truncated_file_names_the_file(tmp_path):
    path = str(tmp_path / 'truncated.pth')
    torch.save({'state_dict': {'layers.0.lpi.conv1.weight': torch.zeros(1000)}}, path)
    data = open(path, 'rb').read()
    with open(path, 'wb') as f:
        f.write(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated\.pth.*truncated or corrupt"):
        read_checkpoint(path)
    garbage = str(tmp_path / 'garbage.pth')
    with open(garbage, 'wb') as f:
        f.write(b'not a checkpoint at all')
    with pytest.raises(CheckpointError, match='garbage.pth'):
        read_checkpoint(garbage)


# ------------------------------------------------------------------------- mmengine's own files
def test_official_file_with_training_args_loads(mmpretrain_xcit, tmp_path):
    """DeiT-style files keep an argparse.Namespace next to the weights: harmless, allowed."""
    import argparse
    ref = _mmpretrain_model(mmpretrain_xcit, 16)
    path = str(tmp_path / 'xcit_official_with_args.pth')
    torch.save({'model': to_official(ref.state_dict()), 'epoch': 399,
                'args': argparse.Namespace(model='xcit_tiny', lr=5e-4)}, path)
    report = load_pretrained(XCiTBackbone(arch=ARCH, out_indices=OUT_INDICES), path)
    assert report['layout'] == 'official'


# ------------------------------------------------------------------------- numpy 1 / numpy 2
@pytest.mark.parametrize('module', ['numpy.core.multiarray', 'numpy._core.multiarray'])
def test_training_checkpoints_load_under_either_numpy_major_version(tmp_path, module):
    """numpy 2 pickles arrays as numpy._core.multiarray._reconstruct, numpy 1 as
    numpy.core.multiarray._reconstruct: a file written under one must load under the other."""
    import numpy as np
    from mmengine.logging import MessageHub
    hub = MessageHub.get_instance(f'xcit_mm_numpy_{module}')
    hub.update_scalar('train/loss', 0.5)
    hub.update_info('seed_array', np.arange(3, dtype=np.float32))
    written = str(tmp_path / 'native.pth')
    # torch's legacy format is a plain pickle stream: its GLOBAL opcodes can be renamed in place
    torch.save({'meta': {'iter': 1, 'epoch': 0}, 'state_dict': {'w': torch.ones(2)},
                'message_hub': hub.state_dict()}, written, _use_new_zipfile_serialization=False)
    data = open(written, 'rb').read()
    names = [b'cnumpy.core.multiarray\n', b'cnumpy._core.multiarray\n']
    present = [n for n in names if n in data]
    assert present, 'the checkpoint pickles no numpy array: the test would prove nothing'
    data = data.replace(present[0], b'c' + module.encode() + b'\n')
    assert (b'c' + module.encode() + b'\n') in data
    path = str(tmp_path / 'renamed.pth')
    open(path, 'wb').write(data)
    loaded = read_checkpoint(path)
    restored = MessageHub.get_instance(f'xcit_mm_numpy_{module}_restored')
    restored.load_state_dict(loaded['message_hub'])
    np.testing.assert_array_equal(restored.get_info('seed_array'), np.arange(3))
    assert restored.get_scalar('train/loss').current() == 0.5


def test_an_html_page_saved_as_pth_is_named_as_such(tmp_path):
    """A failed download: 'not a PyTorch checkpoint', with its first bytes, even with --trust."""
    page = tmp_path / 'xcit_small_12_p16_384_dist.pth'
    page.write_text('<html><head><title>403 Forbidden</title></head></html>')
    for weights_only in (True, False):
        with pytest.raises(CheckpointError, match=r"xcit_small_12_p16_384_dist\.pth .*not a "
                                                  r"PyTorch checkpoint \(it starts with '<html"):
            read_checkpoint(str(page), weights_only=weights_only)
    text = tmp_path / 'six.pth'
    text.write_text('hello\n')
    res = subprocess.run([sys.executable, os.path.join(ROOT, 'tools', 'model_converters',
                                                       'convert_checkpoint.py'),
                          str(text), str(tmp_path / 'out.pth'), '--trust'],
                         capture_output=True, text=True)
    assert res.returncode == 1 and 'Traceback' not in res.stderr, res.stderr
    assert "six.pth (6 bytes) is not a PyTorch checkpoint (it starts with 'hello'" in res.stderr


def test_converter_rejects_an_unknown_arch_with_the_choices(capsys):
    from conftest import _load_tool
    converter = _load_tool('tools/model_converters/convert_checkpoint.py')
    with pytest.raises(SystemExit) as info:  # argparse's exit: status 2, its message on stderr
        converter.main(['a.pth', 'b.pth', '--arch', 'tiny12'])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "invalid choice: 'tiny12'" in err and "'s12'" in err


@pytest.mark.parametrize('zip_format', [True, False])
def test_every_truncation_is_reported_as_truncated(tmp_path, zip_format):
    """Cut a small checkpoint at every byte, i.e. keep its first n bytes for every n from 0 to
    its size - 1: always the 'truncated or corrupt' message naming the file and the size it was
    cut to, never a raw traceback nor the advice for pickled code (a name cut short by the
    truncation is not a request to import something); cut to 0 bytes, the file is empty."""
    full = str(tmp_path / 'full.pth')
    torch.save({'meta': {'iter': 2}, 'state_dict': OrderedDict(w=torch.arange(40.))}, full,
               _use_new_zipfile_serialization=zip_format)
    data = open(full, 'rb').read()
    assert data.startswith(b'PK\x03\x04' if zip_format else b'\x80')  # the format asked for
    assert len(data) < 2500  # small: ~0.2 ms a read, so every byte costs well under a second
    cut = str(tmp_path / 'cut.pth')
    shutil.copyfile(full, cut)
    # Shrinking the file in place: rewriting it from length 0 would make ext4 flush it to disk at
    # every close (auto_da_alloc), some ms a cut.
    for n in range(len(data) - 1, 0, -1):
        os.truncate(cut, n)
        with pytest.raises(CheckpointError) as info:
            read_checkpoint(cut)
        message = str(info.value)
        assert f'cut.pth ({n} bytes): the file is truncated or corrupt' in message, (n, message)
        assert 'Refusing' not in message and '--trust' not in message, (n, message)
    assert os.path.getsize(cut) == 1  # the loop ran down to the first byte
    os.truncate(cut, 0)
    with pytest.raises(CheckpointError, match=r'cut\.pth \(0 bytes\) is not a PyTorch checkpoint '
                                              r'\(it is empty\)'):
        read_checkpoint(cut)
