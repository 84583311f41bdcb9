"""The streamed XCiT trunk (``XCiTBackbone.stream_trunk``) against references built without it.

The model is the reference of tests/xcit_reference.py (mmpretrain's XCiT trunk) with every
parameter randomised (``test_gradients.build_pair``: LayerNorm weights and biases, Linear biases,
layer scales gamma1 / gamma2 / gamma3 per channel, temperatures per head, LPI BatchNorm
statistics), loaded into ``XCiTBackbone`` through the project's converter. The stream and the whole
forward share the layer's pieces (``XCiTLayer``), so the stream is compared with mmpretrain's
forward, not only with ``forward_trunk``: a parameter mixed up in a shared piece (norm3 read as
norm1, gamma3 as gamma2, the temperature ignored or its heads reversed) shows there.

Sums over bands add in another order, so values agree up to float rounding: measured below 2e-6
on maps up to 4 on this CPU (AMD EPYC); the tolerance is 2e-5.
"""
import copy
import os

import pytest
import torch
import torch.nn.functional as F

from test_gradients import build_pair
from xcit_mm.models.backbones.xcit import XCiTLayer
from xcit_mm.models.inference.row_stream import TokenMaps

TOLERANCE = dict(rtol=2e-5, atol=2e-5)
_PAIRS = {}


def _pair(mmpretrain_xcit, patch_size):
    """(mmpretrain reference, XCiTBackbone with its weights), both in eval, built once."""
    if patch_size not in _PAIRS:
        reference, backbone = build_pair(mmpretrain_xcit, patch_size, torch.float32)
        _PAIRS[patch_size] = reference.eval(), backbone.eval()
    return _PAIRS[patch_size]


def _stream(backbone, x, band_mb, folder=None, valid_pixels=None):
    """The streamed trunk maps of the image ``x`` (1, 3, H, W), as (1, D, h, w) tensors."""
    with TokenMaps('cpu', folder) as maps, torch.no_grad():
        trunk = backbone.stream_trunk(lambda a, b: x[:, :, a:b], tuple(x.shape[2:]), maps,
                                      band_mb, valid_pixels=valid_pixels)
        return [m.rows(0, m.height).clone() for m in trunk]


def _reference_trunk(reference, x, patch_size):
    """mmpretrain's trunk maps of ``x`` zero-padded bottom and right to the patch grid."""
    H, W = x.shape[2:]
    with torch.no_grad():
        return list(reference.trunk(F.pad(x, (0, -W % patch_size, 0, -H % patch_size))))


@pytest.mark.parametrize('patch_size', [16, 8])
@pytest.mark.parametrize('folder', [None, 'disk'], ids=['memory', 'disk'])
def test_streamed_trunk_equals_the_reference_trunk(mmpretrain_xcit, patch_size, folder,
                                                   tmp_path):
    """Randomised parameters; bands of 2 token rows (LPI's context rows come from the band
    before), of 3 rows, and one band for the whole grid; an image whose sides are not multiples
    of the patch; token maps in memory and on disk (their folder removed afterwards)."""
    reference, backbone = _pair(mmpretrain_xcit, patch_size)
    x = torch.randn(1, 3, 99, 145, generator=torch.Generator().manual_seed(1))
    expected = _reference_trunk(reference, x, patch_size)
    with torch.no_grad():
        for got, want in zip(backbone.forward_trunk(x), expected):
            torch.testing.assert_close(got, want, **TOLERANCE)
    grid_row_mb = 16 * 64 * 145 // patch_size / 2**20  # one token row's FFN hidden layer
    for band_mb in (1e-6, 3 * grid_row_mb, 100):
        got = _stream(backbone, x, band_mb, tmp_path if folder else None)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, **TOLERANCE)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------------------------ autocast
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
def test_streamed_trunk_under_autocast_sums_in_float32(mmpretrain_xcit, dtype):
    """Under autocast, XCA's sums and mixing stay float32 in the stream as in the whole forward.
    q and k biased by 16: q k^T ~ 256 a token, ~25,000 a band of 16 token rows, ~98,000 the
    strip's 384 tokens, past fp16's largest value (65504). The streamed trunk has no NaN and
    equals the whole forward under the same autocast up to the rounding of the other ops in that
    dtype (measured on this CPU: largest difference 3e-4 fp16, 7e-4 bf16; mean below 3e-7).
    Sums made in the autocast dtype give NaN under fp16 and, under bf16, a mean difference above
    3e-5: every token's attention moves."""
    backbone = copy.deepcopy(_pair(mmpretrain_xcit, 8)[1])
    C = backbone.embed_dims
    with torch.no_grad():
        for layer in backbone.layers:
            layer.attn.qkv.bias[:2 * C] += 16.
    x = torch.randn(1, 3, 512, 48, generator=torch.Generator().manual_seed(2))
    band_mb = 16 * 16 * C * 6 / 2**20  # 16 token rows of the FFN's hidden layer
    with torch.autocast('cpu', dtype=dtype), torch.no_grad():
        expected = [t.float() for t in backbone.forward_trunk(x)]
        got = _stream(backbone, x, band_mb)
    for g, e in zip(got, expected):
        assert not g.isnan().any()
        assert (g - e).abs().mean() < 5e-6
        torch.testing.assert_close(g, e, rtol=0, atol=2e-3)


# ------------------------------------------------------------------------------------ masks
def _valid_tokens(valid, patch_size):
    """Plain torch: a token is valid when its zero-padded patch holds a valid pixel."""
    H, W = valid.shape
    padded = F.pad(valid.float(), (0, -W % patch_size, 0, -H % patch_size))[None, None]
    return F.max_pool2d(padded, patch_size)[0, 0] > 0


def test_masked_sums_are_the_sums_over_the_valid_tokens(mmpretrain_xcit, monkeypatch):
    """Each layer's XCA sums over the tokens whose patch holds a valid pixel, computed here from
    the layer's input map by the definition (norm1, qkv, per-head q^T k and squared column
    norms); the mask is read band by band, never whole."""
    patch_size = 8
    backbone = _pair(mmpretrain_xcit, patch_size)[1]
    H, W = 101, 90
    x = torch.randn(1, 3, H, W, generator=torch.Generator().manual_seed(3))
    valid = torch.zeros(H, W, dtype=torch.bool)
    valid[13:70, 21:77] = True  # not on the patch grid
    valid[90, 5] = valid[3, 88] = True  # lone pixels make their tokens valid
    inputs, sums, reads = [], [], []

    def spy(layer, token_map, band_rows, layer_sums, then=(), real=XCiTLayer.forward_streamed):
        inputs.append((layer, token_map.read(0, token_map.height).clone()))
        sums.append([s.clone() for s in layer_sums])
        return real(layer, token_map, band_rows, layer_sums, then)

    def valid_pixels(a, b):
        reads.append((a, b))
        return valid[a:b]

    monkeypatch.setattr(XCiTLayer, 'forward_streamed', spy)
    _stream(backbone, x, 1e-3, valid_pixels=valid_pixels)
    assert max(b - a for a, b in reads) < H and sorted(reads)[0][0] == 0
    assert sorted(reads)[-1][1] == H
    tokens_valid = _valid_tokens(valid, patch_size).flatten()
    assert 0 < tokens_valid.sum() < tokens_valid.numel()
    h = backbone.num_heads
    for (layer, tokens), (qk, q_sq, k_sq) in zip(inputs, sums):
        t = tokens.reshape(-1, backbone.embed_dims)[tokens_valid].double()
        C = t.shape[1]
        y = F.layer_norm(t, (C, ), layer.norm1.weight.double(), layer.norm1.bias.double(),
                         layer.norm1.eps)
        qkv = y @ layer.attn.qkv.weight.double().t() + layer.attn.qkv.bias.double()
        q, k, _ = qkv.split(C, 1)
        q, k = (m.view(-1, h, C // h).transpose(0, 1) for m in (q, k))  # (h, n, d)
        scale = float(q.abs().max() * k.abs().max() * len(t))
        torch.testing.assert_close(qk[0].double(), q.transpose(1, 2) @ k, rtol=1e-5,
                                   atol=1e-6 * scale)
        torch.testing.assert_close(q_sq[0].double(), (q * q).sum(1), rtol=1e-5, atol=0)
        torch.testing.assert_close(k_sq[0].double(), (k * k).sum(1), rtol=1e-5, atol=0)
    assert len(inputs) == len(backbone.layers)


def test_valid_pixels_of_the_wrong_shape_are_named(mmpretrain_xcit):
    backbone = _pair(mmpretrain_xcit, 8)[1]
    x = torch.zeros(1, 3, 64, 64)
    with pytest.raises(ValueError, match=r'valid_pixels\(0, \d+\) must give a bool tensor of '
                                         r'shape \(\d+, 64\)'):
        _stream(backbone, x, 1e-3, valid_pixels=lambda a, b: torch.ones(b - a, 63, dtype=bool))


def test_a_masked_collar_leaves_far_tokens_as_the_cropped_scene(mmpretrain_xcit):
    """A scene with a nodata collar (zeros, 45% of the tokens), masked, against its valid part
    cropped: on the tokens beyond the stem's (1 token) and LPI's (2 per layer) reach of the
    collar, the trunk maps agree up to the change that the tokens near the collar make in the
    sums (measured below 4e-4 on maps up to 8, p8 and p16). Collar tokens left in the sums move
    them by 8e-3 to 3e-2; without the mask (its sums and position code), by 0.2 or more."""
    patch_size = p = 8
    backbone = _pair(mmpretrain_xcit, patch_size)[1]
    top, left, rows, cols, bottom, right = 6, 5, 28, 30, 4, 5  # in tokens
    scene = torch.randn(1, 3, (top + rows + bottom) * p, (left + cols + right) * p,
                        generator=torch.Generator().manual_seed(4)) * 3
    valid = torch.zeros(scene.shape[2:], dtype=torch.bool)
    valid[top * p:(top + rows) * p, left * p:(left + cols) * p] = True
    crop = scene[:, :, top * p:(top + rows) * p, left * p:(left + cols) * p].clone()
    scene[:, :, ~valid] = 0.
    with torch.no_grad():
        expected = backbone.forward_trunk(crop)
    masked = _stream(backbone, scene, 0.5, valid_pixels=lambda a, b: valid[a:b])
    unmasked = _stream(backbone, scene, 0.5)
    for i, (want, got, plain) in enumerate(zip(expected, masked, unmasked)):
        m = 1 + 2 * (i + 1)  # the stem's and the first i + 1 layers' LPI reach
        want = want[:, :, m:rows - m, m:cols - m]
        far = (slice(None), slice(None), slice(top + m, top + rows - m),
               slice(left + m, left + cols - m))
        torch.testing.assert_close(got[far], want, rtol=0, atol=1e-3)
        assert (plain[far] - want).abs().max() > 0.1
