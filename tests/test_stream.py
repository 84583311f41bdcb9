"""The whole image streamed (``LeanEncoderDecoder`` ``test_cfg.mode='stream'``).

Expected values come from the whole-tensor paths, each tested elsewhere against upstream code:
``XCiTBackbone.forward_trunk`` (the official structure, tests/test_xcit_backbone.py) for the
streamed trunk, the lean whole forward and labels (stock mmseg's, tests/test_lean_segmentation.py)
for the logits and labels. Sums over bands add in another order and a convolution of another
size may sum in another order, so values agree up to float rounding: measured here below 1e-5 for
maps of order 1 (the tolerance 1e-4 leaves room for other CPUs' kernels), labels on at least
99.99% of pixels (they are equal on every image here).
"""
import copy
import errno
import os
import re

import pytest
import torch
from mmcv.cnn import ConvModule
from mmengine.config import ConfigDict
from mmengine.registry import init_default_scope
from mmseg.models.data_preprocessor import SegDataPreProcessor
from mmseg.models.decode_heads import FPNHead

import xcit_mm  # noqa: F401  (registers XCiTBackbone and LeanEncoderDecoder)
from mmseg.registry import MODELS
from test_lean_segmentation import (BACKBONE, SEM_FPN, UPERNET, _meta, _predict,
                                    spread_statistics_and_logits)
from xcit_mm.models.inference.row_stream import (MB, Combine, Local, Resize, RowMap, TensorRows,
                                                 TokenMaps, materialize, module_rows, stream_rows)
from xcit_mm.models.inference.seg_stream import (PyramidPooling, labels_rows, logits_rows,
                                                 valid_cells_of)

TOLERANCE = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(autouse=True)
def _temporary_folders_on_a_disk(monkeypatch):
    """The token folders here (under the temporary folder) count as on a disk, also where the
    temporary folder is a tmpfs, which token maps refuse (tested with a table of its own)."""
    from xcit_mm.models.inference import row_stream
    monkeypatch.setattr(row_stream, '_read_mounts', lambda: '/dev/root / ext4 rw 0 0\n')


def _model(heads, patch_size=16, backbone_cfg=(), **test_cfg):
    init_default_scope('mmseg')
    torch.manual_seed(patch_size)
    cfg = dict(type='LeanEncoderDecoder',
               backbone=dict(BACKBONE, patch_size=patch_size, **dict(backbone_cfg)),
               **copy.deepcopy(heads), test_cfg=ConfigDict(mode='stream', **test_cfg))
    model = MODELS.build(cfg)
    model.init_weights()
    spread_statistics_and_logits(model)
    return model.eval()


def _levels(model, trunk, img_hw):
    return [model.backbone.level_rows(m, i, img_hw) for i, m in enumerate(trunk)]


SIZES = [(128, 192), (97, 131), (45, 200), (160, 48)]


@pytest.mark.parametrize('heads', [SEM_FPN, UPERNET], ids=['sem_fpn', 'upernet'])
@pytest.mark.parametrize('patch_size', [16, 8])
def test_stream_logits_and_labels_equal_the_whole_forward(heads, patch_size):
    """Odd sizes and both aspect ratios; many bands and one."""
    model = _model(heads, patch_size)
    for img_hw in SIZES:
        x = torch.randn(1, 3, *img_hw, generator=torch.Generator().manual_seed(sum(img_hw)))
        with torch.no_grad():
            whole = model._network_forward(x)
            model.test_cfg = ConfigDict(mode='whole')
            expected = _predict(model, x, None)[0].pred_sem_seg.data
        for band_mb in (1e-3, 100):
            model.test_cfg = ConfigDict(mode='stream', band_mb=band_mb)
            with TokenMaps('cpu') as maps, torch.no_grad():
                trunk = model.backbone.stream_trunk(lambda a, b: x[:, :, a:b], img_hw, maps,
                                                    band_mb)
                logits = materialize(logits_rows(_levels(model, trunk, img_hw),
                                                 getattr(model, 'neck', None), model.decode_head),
                                     band_mb)
            torch.testing.assert_close(logits, whole, **TOLERANCE)
            got = _predict(model, x, None)[0].pred_sem_seg.data
            assert got.shape == expected.shape
            assert (got != expected).sum() <= 1e-4 * got.numel(), (img_hw, band_mb)


def test_each_row_is_made_once_and_only_maps_read_again_keep_rows(monkeypatch):
    """The engine's time and memory over many bands: no map makes a row twice (the rows it keeps
    cover every consumer's context) but the full-resolution logits, once per chunk of 8 of the
    150 classes, and a map read once a row keeps none, so the full-resolution logits of a band
    are not held while the next band is made."""
    model, img_hw = _model(SEM_FPN), (97, 131)
    made = {}
    for cls in (Local, Combine, Resize):
        def spy(self, start, stop, real=cls._make):
            made[self] = made.get(self, 0) + stop - start
            return real(self, start, stop)
        monkeypatch.setattr(cls, '_make', spy)
    x = torch.randn(1, 3, *img_hw, generator=torch.Generator().manual_seed(3))
    with TokenMaps('cpu') as maps, torch.no_grad():
        trunk = model.backbone.stream_trunk(lambda a, b: x[:, :, a:b], img_hw, maps, 1e-3)
        logits = logits_rows(_levels(model, trunk, img_hw), model.neck, model.decode_head)
        labels = labels_rows(logits, img_hw, (0, 0, 0, 0), img_hw, False, False, 8)
        bands = [stop - start for start, stop, _ in stream_rows(labels, 1e-3)]
    assert len(bands) > 4
    full_resolution = [m for m in made if (m.height, m.width) == img_hw]
    assert full_resolution and all(made[m] == 19 * m.height for m in full_resolution)
    assert all(m._rows is None for m in full_resolution)
    assert {m: made[m] for m in made if made[m] > m.height and m not in full_resolution} == {}
    assert any(m._rows is not None for m in made)


def test_bands_follow_the_bytes_of_a_row_of_every_map():
    """After a first row, a band has ``band_mb`` over the bytes of one output row: the band's own
    row and the rows every map makes for it, a map twice as tall making two (by hand: 8
    channels x 8 columns x 4 bytes for the pool, twice; 8 x 16 x 4 for the doubled map, twice);
    one row where a row costs more than ``band_mb`` (a very wide image)."""
    x = torch.randn(1, 4, 200, 16, generator=torch.Generator().manual_seed(4))
    doubled = Local(lambda t: torch.cat([t, t], 1), TensorRows(x))
    pooled = module_rows(torch.nn.MaxPool2d(2, 2, ceil_mode=True), doubled)
    per_row = 2 * 8 * 8 * 4 + 2 * 8 * 16 * 4
    bands = list(stream_rows(pooled, 30 * per_row / MB))
    assert [stop - start for start, stop, _ in bands] == [1, 30, 30, 30, 9]
    expected = torch.nn.functional.max_pool2d(torch.cat([x, x], 1), 2)
    torch.testing.assert_close(torch.cat([band for _, _, band in bands], 2), expected)
    assert {stop - start for start, stop, _ in stream_rows(pooled, per_row / 2 / MB)} == {1}


def test_token_rows_read_from_disk_count_in_a_band(tmp_path):
    """Rows of a token map read from disk are new memory, which a band counts as it counts the
    rows a map makes: UperNet's pooling pass over the coarsest level of p8 reads 16 times its
    bytes in token rows (at 16384 px, 2.1 GB in one 128 MB band). By hand: a max pool of 4 reads
    4 token rows of 16 columns x 8 channels x 4 bytes an output row, beside its own row (4
    columns, 8 channels) twice. In memory the token rows are views of the map and count
    nothing."""
    tokens = torch.randn(64, 16, 8, generator=torch.Generator().manual_seed(5))
    per_row = 2 * 4 * 8 * 4 + 4 * 16 * 8 * 4
    expected = torch.nn.functional.max_pool2d(tokens.permute(2, 0, 1)[None], 4)
    for folder, sizes in ((str(tmp_path), [1, 4, 4, 4, 3]), (None, [1, 15])):
        with TokenMaps('cpu', folder) as maps:
            token_map = maps.new(tokens.shape)
            token_map.write(0, tokens)
            pooled = module_rows(torch.nn.MaxPool2d(4, 4), token_map)
            bands = list(stream_rows(pooled, 4 * per_row / MB))
        assert [stop - start for start, stop, _ in bands] == sizes, folder
        torch.testing.assert_close(torch.cat([band for _, _, band in bands], 2), expected)


@pytest.mark.parametrize('kwargs', [dict(size=(23, 10)), dict(scale_factor=(2.5, 1.7)),
                                    dict(scale_factor=(1.5, 3), recompute_scale_factor=True)])
def test_nearest_resize_by_rows_is_the_calls_copy(kwargs):
    """A nearest ``Resize`` in bands copies the pixels ``F.interpolate`` copies: sizes and scale
    factors other per axis (each axis taking its own)."""
    x = torch.randn(1, 2, 9, 6, generator=torch.Generator().manual_seed(5))
    expected = torch.nn.functional.interpolate(x, mode='nearest', **kwargs)
    resized = Resize(TensorRows(x), expected.shape[2:], 'nearest', interpolate_kwargs=kwargs)
    bands = [resized.rows(start, start + 4) for start in range(0, resized.height, 4)]
    assert torch.equal(torch.cat(bands, 2), expected)


@pytest.mark.parametrize('read_once', [False, True], ids=['kept', 'read_once'])
@pytest.mark.parametrize('factor', [2, 4, 8])
def test_a_bilinear_resize_by_a_factor_calls_once_a_source_row(factor, read_once):
    """The FPN's and UperNet's resizes to stride 4, asked a row at a time (as bands of a wide
    image are): each call also gives the rows up to its last source row, so a source row of
    ``x`` costs one call, not ``factor``, also in a map read once; equal to the whole call up to
    float rounding (at a factor of 8 the call on a band's rows rounds a few values otherwise)."""
    x = torch.randn(1, 3, 11, 7, generator=torch.Generator().manual_seed(factor))
    size = (factor * x.shape[2], factor * x.shape[3])
    expected = torch.nn.functional.interpolate(x, size=size, mode='bilinear')
    resized = Resize(TensorRows(x), size, 'bilinear', False)
    resized.keeps = not read_once
    calls, make = [], resized._make
    resized._make = lambda start, stop: calls.append(start) or make(start, stop)
    bands = [resized.rows(row, row + 1) for row in range(resized.height)]
    torch.testing.assert_close(torch.cat(bands, 2), expected, rtol=1e-6, atol=1e-6)
    assert len(calls) <= x.shape[2]


def test_a_conv_by_rows_makes_only_the_rows_asked_for():
    """A 3x3 ConvModule (BN, ReLU) a row at a time: its conv gets the row and a row of context
    each side (zeros beyond the map, its padding) and makes that one row, not three (two cut
    away); equal to the module on the whole map."""
    conv = ConvModule(4, 5, 3, padding=1, norm_cfg=dict(type='BN')).eval()
    conv.bn.running_mean.uniform_(-1, 1)
    conv.bn.running_var.uniform_(0.5, 2)
    x = torch.randn(1, 4, 9, 6, generator=torch.Generator().manual_seed(6))
    rows_made = []
    conv.conv.register_forward_hook(lambda module, args, out: rows_made.append(out.shape[2]))
    with torch.no_grad():
        expected = conv(x)
        rows_made.clear()
        by_rows = module_rows(conv, TensorRows(x))
        bands = [by_rows.rows(row, row + 1) for row in range(x.shape[2])]
    assert rows_made == [1] * x.shape[2]
    torch.testing.assert_close(torch.cat(bands, 2), expected, rtol=1e-6, atol=1e-6)


def test_predict_through_the_test_resize_and_padding_equals_whole():
    """The head's resize to the padded input, the padding crop and the resize to the original
    shape (a test Resize), as stock's post-processing does them."""
    model = _model(SEM_FPN, band_mb=0.01)
    x = torch.randn(2, 3, 128, 160, generator=torch.Generator().manual_seed(2))
    metas = [_meta((128, 160), (387, 389), pad=(0, 9, 0, 11)), _meta((128, 160), (128, 160))]
    got = _predict(model, x, metas)
    model.test_cfg = ConfigDict(mode='whole')
    expected = _predict(model, x, metas)
    for g, e in zip(got, expected):
        assert g.pred_sem_seg.data.shape == e.pred_sem_seg.data.shape
        got, want = g.pred_sem_seg.data, e.pred_sem_seg.data
        assert (got != want).sum() <= 1e-4 * got.numel()


def test_stream_labels_reads_rows_and_cleans_its_folder_on_error(tmp_path):
    """``stream_labels`` (the large-image tool's door) reads only the rows it asks for, equals
    the model's own predict on the normalised image, tells ``progress`` the trunk's token rows x
    layers then the label rows, and removes its token folder when the consumer stops on an error
    or Ctrl-C (a ``progress`` without ``stage`` told the same counts)."""
    import numpy as np
    model = _model(SEM_FPN, band_mb=0.05)
    model.data_preprocessor = SegDataPreProcessor(mean=[123.675, 116.28, 103.53],
                                                  std=[58.395, 57.12, 57.375], bgr_to_rgb=True)
    img = np.random.RandomState(0).randint(0, 255, (150, 230, 3), dtype=np.uint8)
    asked = []
    reader = lambda a, b: asked.append((a, b)) or img[a:b]  # noqa: E731
    model.train()  # stream_labels runs in eval mode, then restores the mode it found
    calls = []
    out = torch.cat([labels for _, _, labels in model.stream_labels(
        reader, (150, 230), max_memory=10**6, token_dir=str(tmp_path),
        progress=lambda done, total, stage: calls.append((stage, done, total)))])
    assert model.training
    # 2 layers over 10 token rows, then the 150 label rows, each stage from 0 to its total
    trunk = [call for call in calls if call[0] == 'trunk']
    labelled = [call for call in calls if call[0] == 'labels']
    assert calls == trunk + labelled and trunk == [('trunk', 0, 20), ('trunk', 10, 20),
                                                   ('trunk', 20, 20)]
    dones = [done for _, done, total in labelled if total == 150]
    assert len(dones) == len(labelled) > 2 and dones == sorted(dones), labelled
    assert dones[0] == 0 and dones[-1] == 150
    model.eval()
    assert max(b - a for a, b in asked) < 150 and asked[0][0] == 0 and asked[-1][1] == 150
    inputs = model.data_preprocessor(dict(inputs=[torch.from_numpy(img).permute(2, 0, 1)]),
                                     False)['inputs']
    with torch.no_grad():
        expected = model.predict(inputs)[0].pred_sem_seg.data[0]
    assert (out != expected).sum() <= 1e-4 * out.numel()
    for stop in (RuntimeError('consumer failed'), KeyboardInterrupt()):
        model.test_cfg.token_maps = 'disk'

        def progress(done, total, stop=stop):
            assert os.listdir(tmp_path) and done < total
            raise stop

        with pytest.raises(type(stop)):
            list(model.stream_labels(reader, (150, 230), token_dir=str(tmp_path),
                                     progress=progress))
        assert os.listdir(tmp_path) == []


def test_disk_token_maps_default_to_the_temporary_folder(tmp_path, monkeypatch):
    """token_maps='disk' without token_dir: files in a fresh folder under the temporary folder,
    removed afterwards; the maps are not in memory."""
    import tempfile
    from xcit_mm.models.inference import row_stream
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    made = []
    real = row_stream.TokenMap.__init__

    def spy(self, shape, device, folder=None):
        made.append(folder)
        real(self, shape, device, folder)

    monkeypatch.setattr(row_stream.TokenMap, '__init__', spy)
    _predict(_model(SEM_FPN, token_maps='disk'), torch.randn(1, 3, 64, 64), None)
    assert made and all(f is not None and f.startswith(str(tmp_path)) for f in made), made
    assert os.listdir(tmp_path) == []


def test_a_full_disk_names_the_token_dir(tmp_path, monkeypatch):
    model = _model(SEM_FPN, token_maps='disk', token_dir=str(tmp_path))

    def full(*args):
        raise OSError(errno.ENOSPC, 'No space left on device')

    monkeypatch.setattr(os, 'pwrite', full)
    with pytest.raises(OSError, match=f'no space left in {tmp_path}.*token_dir'):
        _predict(model, torch.randn(1, 3, 64, 64), None)
    assert os.listdir(tmp_path) == []


def test_a_budget_below_the_streams_minimum_names_it():
    import numpy as np
    model = _model(SEM_FPN)
    img = np.zeros((64, 64, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r'stream-disk .*: (\d+) MB.* at least \1'):
        list(model.stream_labels(lambda a, b: img[a:b], (64, 64), max_memory=10))


@pytest.mark.parametrize('change,message', [
    (dict(keep_seg_logits=True), 'keeps no full-size logits'),
    (dict(token_maps='ssd'), "token_maps must be 'memory' or 'disk'"),
    (dict(mode='whole', band_mb=8), r"\['band_mb'\] only apply to mode='stream'"),
    (dict(mode='slide', token_maps='disk', crop_size=(64, 64), stride=(48, 48)),
     r"\['token_maps'\] only apply to mode='stream'"),
    (dict(band_mb=0), 'must be a positive number of MB'),
])
def test_stream_settings_it_cannot_use_are_errors(change, message):
    model = _model(SEM_FPN)
    model.test_cfg.update(change)
    with pytest.raises(ValueError, match=message):
        _predict(model, torch.randn(1, 3, 64, 64), None)


def test_a_part_that_cannot_run_by_rows_is_named():
    model = _model(SEM_FPN)
    conv = model.decode_head.scale_heads[0][0]
    model.decode_head.scale_heads[0][0] = ConvModule(
        conv.in_channels, conv.out_channels, 3, padding=1,
        norm_cfg=dict(type='GN', num_groups=2)).eval()
    with pytest.raises(ValueError, match="mode='stream' cannot run: a part of the neck or head: "
                       'ConvModule: its GroupNorm normalises over the whole map'):
        _predict(model, torch.randn(1, 3, 64, 64), None)


class _HeadOfItsOwn(FPNHead):
    def predict(self, *args, **kwargs):  # not mmseg's forward + resize: no lean resize
        return super().predict(*args, **kwargs)


PART_CHANGES = {
    'own_predict': (lambda m: setattr(m.decode_head, '__class__', _HeadOfItsOwn),
                    "_HeadOfItsOwn overrides the decode head's predict"),
    'levels_out_of_order': (lambda m: setattr(m.decode_head, 'in_index', [1, 0, 2, 3]),
                            r'FPNHead must read the levels 0\.\.n-1 in order'),
    'other_neck': (lambda m: setattr(m, 'neck', torch.nn.Identity()),
                   r'it runs Semantic FPN \(mmseg FPN \+ FPNHead\) or UperNet \(UPerHead, no '
                   r'neck\), not Identity \+ FPNHead'),
    'one_channel': (lambda m: setattr(m.decode_head, 'out_channels', 1),
                    r'a one-channel \(sigmoid\) head is thresholded'),
}


@pytest.mark.parametrize('change', PART_CHANGES)
def test_each_part_the_stream_cannot_run_is_named(change):
    """The one check of the parts (``why_not``) names each reason, in predict and in
    ``stream_labels``; 'auto' names a head whose own predict it cannot estimate."""
    import numpy as np
    model = _model(SEM_FPN)
    make, reason = PART_CHANGES[change]
    make(model)
    with pytest.raises(ValueError, match="mode='stream' cannot run: " + reason):
        _predict(model, torch.randn(1, 3, 64, 64), None)
    img = np.zeros((64, 64, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match='stream_labels: cannot stream: ' + reason):
        list(model.stream_labels(lambda a, b: img[a:b], (64, 64)))
    if change == 'own_predict':
        model.test_cfg = ConfigDict(mode='auto', max_memory=1000,
                                    memory_model=dict(base_mb=1, mb_per_mpix=1))
        with pytest.raises(ValueError, match="'auto' estimates memory only for mmseg's decode "
                           'head predict; ' + reason):
            _predict(model, torch.randn(1, 3, 64, 64), None)
    model = _model(SEM_FPN)
    model.test_cfg = ConfigDict(mode='whole', lean=False)
    with pytest.raises(ValueError, match='cannot stream: it needs the lean predict'):
        list(model.stream_labels(lambda a, b: img[a:b], (64, 64)))


def test_the_band_follows_each_call_not_the_last_budget(monkeypatch):
    """A budget shrinks the bands of that call only: the next call without one runs the
    default bands (the plan carries its band; nothing is left on the model)."""
    import xcit_mm.models.segmentors.lean_encoder_decoder as lean_module
    bands = []
    real = lean_module.stream_rows
    monkeypatch.setattr(lean_module, 'stream_rows',
                        lambda node, band_mb: bands.append(band_mb) or real(node, band_mb))
    model = _model(SEM_FPN)
    x = torch.randn(1, 3, 64, 64)
    model.test_cfg.max_memory = 200
    _predict(model, x, None)
    model.test_cfg.pop('max_memory')
    _predict(model, x, None)
    *_, budgeted, default = bands  # the label stage's measurement (_label_floor) comes first
    assert budgeted < lean_module.STREAM_BAND_MB['cpu'] == default, bands


def test_a_ranks_default_bands_shrink_with_its_share_of_the_rows():
    """A rank of a sharded stream that makes a share of the image's token rows gets that share
    of the default bands (not below the minimum), so that its memory beyond the token maps
    shrinks with its share too; a band_mb set is kept as given."""
    import xcit_mm.models.segmentors.lean_encoder_decoder as lean_module
    model = _model(SEM_FPN)
    model.test_cfg = ConfigDict(mode='stream')
    rows = 64  # token rows of the image
    hw = (rows * model.backbone.patch_size, 256)
    default = lean_module.STREAM_BAND_MB['cpu']
    for token_rows, band in ((None, default), (rows, default), (rows // 2, default / 2),
                             (rows // 16, lean_module.MIN_STREAM_BAND_MB)):
        plans = model._stream_plans(hw, held_mb=0, token_rows=token_rows)
        assert [plan.band_mb for plan in plans] == [band, band], token_rows
    model.test_cfg = ConfigDict(mode='stream', band_mb=100)
    assert model._stream_plans(hw, held_mb=0, token_rows=rows // 2)[0].band_mb == 100


def test_the_unbudgeted_stream_keeps_its_token_maps_in_memory(monkeypatch, tmp_path):
    """Without ``max_memory`` the token maps stay in memory unless ``token_maps='disk'``."""
    import xcit_mm.models.segmentors.lean_encoder_decoder as lean_module
    folders, real = [], lean_module.TokenMaps
    monkeypatch.setattr(lean_module, 'TokenMaps',
                        lambda device, folder: folders.append(folder) or real(device, folder))
    model = _model(SEM_FPN, token_dir=str(tmp_path))
    x = torch.randn(1, 3, 64, 64)
    _predict(model, x, None)
    model.test_cfg.token_maps = 'disk'
    _predict(model, x, None)
    assert folders == [None, str(tmp_path)]


class _Requests(RowMap):
    """A map's rows passed on, each request's row count recorded."""

    def __init__(self, source):
        super().__init__(source.height, source.width)
        self.source, self.sizes = source, []

    def rows(self, start, stop):
        self.sizes.append(min(stop, self.height) - max(0, start))
        return self.source.rows(start, stop)


def test_upernet_pools_its_coarsest_level_by_bands():
    """UperNet's pyramid pooling reads the stride-32 level a band at a time, never whole, and
    still gives the whole forward's logits: a tall level (40 rows, 2 columns) whose adaptive
    pool bins overlap (40 rows in 3 and 6 bins, 2 columns in 3 and 6)."""
    model, img_hw = _model(UPERNET), (1280, 64)
    x = torch.randn(1, 3, *img_hw, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        whole = model._network_forward(x)
    with TokenMaps('cpu') as maps, torch.no_grad():
        trunk = model.backbone.stream_trunk(lambda a, b: x[:, :, a:b], img_hw, maps, 1e-3)
        levels = _levels(model, trunk, img_hw)
        levels[-1] = top = _Requests(levels[-1])
        logits = materialize(logits_rows(levels, None, model.decode_head, 1e-3), 1e-3)
    torch.testing.assert_close(logits, whole, **TOLERANCE)
    assert top.height == 40 and top.sizes and max(top.sizes) <= 12, top.sizes


NORMS = {'GN': dict(type='GN', num_groups=4), 'LN': dict(type='LN')}


def _norm_in(part, norm):
    """A model with the norm ``norm`` in one part the stream runs on bands of rows, and the
    module name the refusal must give: built with it (the stem, the first met), or given it."""
    from mmcv.cnn import build_norm_layer
    if part == 'stem':
        model = _model(SEM_FPN, backbone_cfg=dict(norm_cfg=NORMS[norm]))
        return model, 'backbone.patch_embed.proj.0.' + norm.lower()
    model = _model(SEM_FPN)
    layer = build_norm_layer(NORMS[norm], 32)[1] if norm in NORMS else torch.nn.BatchNorm2d(
        32, track_running_stats=False)
    if part == 'lpi':
        model.backbone.layers[1].lpi.bn = layer
        return model, 'backbone.layers.1.lpi.bn'
    model.backbone.fpn1[1] = layer
    return model, 'backbone.fpn1.1'


@pytest.mark.parametrize('part,norm', [('stem', 'GN'), ('stem', 'LN'), ('lpi', 'GN'),
                                       ('lpi', 'LN'), ('lpi', 'BN without running statistics'),
                                       ('adapter', 'GN'), ('adapter', 'LN')])
def test_a_norm_over_the_map_in_the_trunk_is_refused_before_any_work(part, norm):
    """A norm that is not per pixel, in the stem, an LPI or the adapter, would normalise each band
    over its own rows: refused, naming the module and the fix, before the image is read (and
    predict's stream before the trunk starts)."""
    import numpy as np
    model, name = _norm_in(part, norm)
    kind = {'GN': 'GroupNorm', 'LN': 'LayerNorm'}.get(norm, 'BatchNorm2d without running')
    message = f"{re.escape(name)} is a {kind}.*norm_cfg=dict\\(type='BN'\\)"
    read = []
    img = np.zeros((64, 64, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match='stream_labels: cannot stream: ' + message):
        model.stream_labels(lambda a, b: read.append((a, b)) or img[a:b], (64, 64))
    assert read == []
    with pytest.raises(ValueError, match="mode='stream' cannot run: " + message):
        model.backbone.stream_trunk = None  # predict must refuse before reaching the trunk
        _predict(model, torch.randn(1, 3, 64, 64), None)


def test_stream_labels_confidence_and_ties_across_class_chunks():
    """``stream_labels(confidence=True)`` over chunks of 8 of 150 classes: labels those of stock's
    whole predict, a class tied with a later twin (equal classifier rows, in another chunk)
    winning as in argmax; the confidence round(255 x the top softmax probability) of stock's
    full-size logits, within one level everywhere."""
    import numpy as np
    from test_lean_segmentation import _pair
    stock, lean = _pair(SEM_FPN)
    lean.test_cfg = ConfigDict(mode='stream', band_mb=0.05)
    assert lean._stream_class_chunk(131, 0.05) == 8
    lean.data_preprocessor = SegDataPreProcessor(mean=[123.675, 116.28, 103.53],
                                                 std=[58.395, 57.12, 57.375], bgr_to_rgb=True)
    img = np.random.RandomState(7).randint(0, 255, (97, 131, 3), dtype=np.uint8)
    bands = list(lean.stream_labels(lambda a, b: img[a:b], (97, 131), confidence=True))
    labels = torch.cat([band[2] for band in bands])
    confidence = torch.cat([band[3] for band in bands])
    assert labels.dtype == torch.long and confidence.dtype == torch.uint8
    inputs = lean.data_preprocessor(dict(inputs=[torch.from_numpy(img).permute(2, 0, 1)]),
                                    False)['inputs']
    with torch.no_grad():
        expected = stock.predict(inputs)[0]
    want = expected.pred_sem_seg.data[0]
    weight = stock.decode_head.conv_seg.weight.flatten(1)
    twins = torch.nonzero((weight[:, None] == weight[None]).all(-1).triu(1))
    low, high = [int(c) for c in twins[0]]
    assert high - low >= 8 and (want == low).sum() > 0 and (want == high).sum() == 0
    assert (labels != want).sum() <= 1e-4 * labels.numel()
    top = torch.softmax(expected.seg_logits.data, dim=0).max(dim=0).values
    difference = (confidence.float() - torch.round(255 * top)).abs()
    assert difference.max() <= 1 and confidence.float().std() > 5, difference.max()


def _never_read(a, b):
    raise AssertionError('the image was read')


def test_a_token_folder_in_memory_is_refused_unless_a_budget_counts_it(tmp_path, monkeypatch):
    """Token maps on disk in a tmpfs folder (by /proc/mounts, its octal escapes read: a folder
    with a space) are in memory, unseen by the budget: refused before the image is read, naming
    token_dir and the MB the maps need, unless the budget counted them (token_maps='disk' under
    a budget that fits them in memory)."""
    from xcit_mm.models.inference import row_stream
    folder = tmp_path / 'in memory'
    folder.mkdir()
    escaped = str(folder).replace(' ', '\\040')
    mounts = f'/dev/vda / ext4 rw 0 0\ntmpfs {escaped} tmpfs rw 0 0\n'
    monkeypatch.setattr(row_stream, '_read_mounts', lambda: mounts)
    model = _model(SEM_FPN, token_maps='disk')
    # 2 token maps (after layers 1 and 2) of 256 x 256 tokens x 32 channels x 4 bytes: 16 MB
    refusal = (f"token_dir '{folder}' is on a tmpfs.*set test_cfg.token_dir / --token-dir to a "
               'folder on a disk with 16 MB free')
    with pytest.raises(ValueError, match=refusal):
        model.stream_labels(_never_read, (4096, 4096), token_dir=str(folder))
    model.test_cfg.pop('token_maps')  # a budget that fits the maps on disk only: not counted
    in_memory = model._stream_plans((4096, 4096), held_mb=0, budget_mb=1)[0]  # smallest bands
    with pytest.raises(ValueError, match=refusal):
        model.stream_labels(_never_read, (4096, 4096), max_memory=in_memory.estimate_mb - 1,
                            token_dir=str(folder))
    assert model.last_memory_plan.name == 'stream-disk'
    assert row_stream.file_system_type(str(tmp_path)) == 'ext4'
    x = torch.randn(1, 3, 64, 64)
    model.test_cfg.update(token_maps='disk', token_dir=str(folder), max_memory=10**6)
    _predict(model, x, None)  # counted: runs
    assert model.last_memory_plan.name == 'stream' and os.listdir(folder) == []


def test_a_token_folder_without_room_is_refused(tmp_path, monkeypatch):
    """Free space below the token maps' size: refused before the image is read."""
    from types import SimpleNamespace

    from xcit_mm.models.inference import row_stream
    monkeypatch.setattr(row_stream.os, 'statvfs',
                        lambda path: SimpleNamespace(f_bavail=6, f_frsize=2**18))
    model = _model(SEM_FPN, token_maps='disk')
    with pytest.raises(ValueError, match=f"token_dir '{tmp_path}' has 2 MB free but the token "
                       'maps need 4 MB: set test_cfg.token_dir / --token-dir to a folder with '
                       'room'):
        model.stream_labels(_never_read, (2048, 2048), token_dir=str(tmp_path))
    model.stream_labels(_never_read, (1024, 1024), token_dir=str(tmp_path))  # 1 MB: room


def test_a_nodata_collar_leaves_the_labels_of_the_valid_part_alone():
    """A scene whose valid part (on the stride-32 grid) has a collar of zeros around it, 39% of
    the raster: with ``valid_rows`` and ``mask_xca``, the labels of the valid part away from the
    collar (beyond what the stem, the LPIs and the head's convs read) are those of the valid part
    segmented alone; with ``mask_xca=False`` the collar's tokens enter XCA's sums and change
    them. ``valid_rows`` not of bool is refused, naming it, as is a mask for a backbone that
    cannot leave tokens out."""
    import numpy as np
    model = _model(SEM_FPN)
    model.data_preprocessor = SegDataPreProcessor(mean=[123.675, 116.28, 103.53],
                                                  std=[58.395, 57.12, 57.375], bgr_to_rgb=True)
    gen = torch.Generator().manual_seed(8)
    field = torch.nn.functional.interpolate(torch.rand(1, 3, 12, 13, generator=gen),
                                            size=(384, 416), mode='bicubic')
    valid = (field.clamp(0, 1) * 254 + 1).byte()[0].permute(1, 2, 0).numpy()
    scene = np.zeros((512, 512, 3), np.uint8)
    scene[64:448, 64:480] = valid
    mask = scene.any(2)

    def labels(img, **kwargs):
        return torch.cat([band[2] for band in model.stream_labels(lambda a, b: img[a:b],
                                                                  img.shape[:2], **kwargs)])

    alone = labels(valid)
    reach = (1 + 2 * 2) * 16 + 64  # px: the stem, 2 LPIs, the head's convs up to stride 32
    inner = (slice(reach, 384 - reach), slice(reach, 416 - reach))
    agree = {}
    for mask_xca in (True, False):
        got = labels(scene, valid_rows=lambda a, b: mask[a:b], mask_xca=mask_xca)
        agree[mask_xca] = float((got[64:448, 64:480] == alone)[inner].float().mean())
    assert agree[True] >= 0.999 and agree[False] < 0.99, agree
    with pytest.raises(ValueError, match=r'valid_rows\(0, \d+\) must give a bool array'):
        labels(scene, valid_rows=lambda a, b: mask[a:b].astype(np.uint8))
    model.backbone.stream_trunk = lambda read_pixels, image_hw, maps, band_mb, progress: None
    with pytest.raises(ValueError, match='cannot leave masked tokens out of its attention: pass '
                       'mask_xca=False'):
        model.stream_labels(_never_read, (512, 512), valid_rows=lambda a, b: mask[a:b])


def test_the_pyramid_pooling_of_a_scene_with_a_collar_averages_its_cells_with_data():
    """UperNet's pooling with ``valid_cells`` (as ``stream_labels`` gives it with a mask and
    ``mask_xca``), over many bands: each pool is the average of the cells with data (torch's
    adaptive average pool of the masked map over that of the mask), zeros where a bin has none,
    through the branch's conv as stock runs it. The cells come from the pixels as XCA's tokens
    do: a cell with any valid pixel holds data."""
    model = _model(UPERNET)
    ppm = model.decode_head.psp_modules
    x = torch.randn(1, ppm.in_channels, 13, 11, generator=torch.Generator().manual_seed(3))
    pixels = torch.zeros(13 * 32 - 20, 11 * 32 - 5, dtype=torch.bool)  # the last cells partial
    pixels[5 * 32 - 1:, 4 * 32:] = True  # row 4's last pixel row valid: row 4 holds data
    valid = valid_cells_of(lambda a, b: pixels[a:b], tuple(pixels.shape), 32)
    assert valid(0, 13)[4:, 4:].all() and not valid(0, 13)[:4].any()
    assert not valid(0, 13)[:, :4].any()
    pooling = PyramidPooling(TensorRows(x), ppm, band_mb=0.001, valid_cells=valid)
    mask = valid(0, 13)[None, None].float()
    with torch.no_grad():
        for i, (scale, branch) in enumerate(zip(ppm.pool_scales, ppm)):
            count = torch.nn.functional.adaptive_avg_pool2d(mask, scale)
            mean = torch.nn.functional.adaptive_avg_pool2d(x * mask, scale) / count.clamp(1e-9)
            if scale == 6:
                assert (count == 0).any()  # bins of the collar alone: zeros
            torch.testing.assert_close(pooling.pooled(i), branch[1:](mean * (count > 0)),
                                       rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('heads', [SEM_FPN, UPERNET], ids=['sem_fpn', 'upernet'])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
def test_labels_under_autocast_equal_the_whole_paths_under_the_same_autocast(heads, dtype):
    """Issue 55's goal on labels, not only on trunk maps: predict under ``torch.autocast`` (as
    mmengine's ``TestLoop(fp16=True)`` runs it), streamed in many bands, against the whole path
    under the same autocast. q and k are biased so that XCA's sums over the image's 192 tokens
    pass fp16's largest value (65504): summed in fp16 they would be inf / NaN. At least 99.9% of
    the labels agree, or, where the autocast dtype alone moves more labels of this random model
    than that (the whole path under autocast against it in float32: 99.75% for UperNet under
    fp16), at least as many as the whole path keeps."""
    model = _model(heads, 16, band_mb=0.01)
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.attn.qkv.bias[:2 * model.backbone.embed_dims] += 32.  # ~1000 a token
    x = torch.randn(1, 3, 256, 192, generator=torch.Generator().manual_seed(5))
    model.test_cfg = ConfigDict(mode='whole')
    in_float32 = _predict(model, x, None)[0].pred_sem_seg.data
    with torch.autocast('cpu', dtype=dtype):
        expected = _predict(model, x, None)[0].pred_sem_seg.data
        model.test_cfg = ConfigDict(mode='stream', band_mb=0.01)
        got = _predict(model, x, None)[0].pred_sem_seg.data
    autocast_agreement = (expected == in_float32).float().mean()
    assert (got == expected).float().mean() >= min(0.999, autocast_agreement)
