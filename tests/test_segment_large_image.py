# Copyright (c) xcit_mm contributors. All rights reserved.
"""tools/segment_large_image.py and xcit_mm.apis.large_image: windows of rows read from TIFF
files of every layout equal tifffile's whole read; the label file written by tiles is what
GDAL (rasterio) places over the input, with the palette; the tool's labels are the whole-image
labels of the same model; every bad input is one line and leaves no file.

The model is a small XCiT Semantic FPN built from the paper's ADE20k config (random weights,
150 classes); the images are 200 x 300 so the file stays fast. The expected labels come from
mmseg's ``inference_model`` on the same pixels (full resolution: the test Resize removed).
"""
import errno
import importlib.util
import os
import os.path as osp

import numpy as np
import pytest
import torch

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))
H, W = 200, 300


@pytest.fixture(scope='module')
def tool():
    """tools/segment_large_image.py as a module."""
    spec = importlib.util.spec_from_file_location(
        'xcit_mm_tool_segment_large_image', osp.join(ROOT, 'tools', 'segment_large_image.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
    """(config path, checkpoint path, model): the paper Sem-FPN S12/16 ADE20k config with a
    4-layer 64-channel XCiT, random weights with a spread classifier, the test Resize removed
    (full resolution, as the tool runs); the checkpoint has no meta, so the palette is the
    config dataset's."""
    from mmengine.config import Config
    from mmseg.apis import init_model
    folder = tmp_path_factory.mktemp('tiny_model')
    cfg = Config.fromfile(osp.join(ROOT, 'configs', 'sem_fpn_xcit_s12_p16_80k_ade20k.py'))
    cfg.model.backbone.arch = dict(embed_dims=64, depth=4, num_heads=4)
    cfg.model.backbone.init_cfg = None
    cfg.model.neck.in_channels = [64] * 4
    cfg.model.neck.out_channels = 32
    cfg.model.decode_head.in_channels = [32] * 4
    cfg.model.decode_head.channels = 16
    cfg.test_pipeline = [t for t in cfg.test_pipeline if t.type != 'Resize']
    cfg.test_dataloader.dataset.pipeline = cfg.test_pipeline
    config = str(folder / 'tiny.py')
    cfg.dump(config)
    torch.manual_seed(0)
    model = init_model(cfg, device='cpu')
    with torch.no_grad():
        model.decode_head.conv_seg.weight.normal_(0, 0.3)
    checkpoint = str(folder / 'tiny.pth')
    torch.save({'state_dict': model.state_dict()}, checkpoint)
    return config, checkpoint, model


def _image(bands=3, dtype=np.uint8, seed=0):
    """Random pixels with smooth structure (so the labels are not noise) and a black corner."""
    rs = np.random.RandomState(seed)
    yy, xx = np.mgrid[0:H, 0:W]
    img = np.stack([(np.sin(yy / (9 + 4 * c) + xx / (13 + 3 * c)) * 100 + 127
                     + rs.randint(-20, 20, (H, W))) for c in range(bands)], axis=2)
    img = np.clip(img, 1, 255).astype(np.uint8)
    img[:40, :60] = 0
    if dtype == np.uint16:
        return img.astype(np.uint16) * 257
    return img


def _geotiff(path, img, **options):
    """A tiled deflate GeoTIFF (UTM 33N, 0.5 m pixels, nodata 0) written by rasterio (GDAL)."""
    import rasterio
    from affine import Affine
    profile = dict(driver='GTiff', height=img.shape[0], width=img.shape[1], count=img.shape[2],
                   dtype=img.dtype.name, crs='EPSG:32633', nodata=0,
                   transform=Affine(0.5, 0.0, 500000.0, 0.0, -0.5, 4100000.0), tiled=True,
                   blockxsize=64, blockysize=64, compress='deflate')
    profile.update(options)
    with rasterio.open(path, 'w', **profile) as dst:
        dst.write(img.transpose(2, 0, 1))
    return str(path)


# -- the reader ------------------------------------------------------------------------------

WINDOWS = [(0, H), (0, 1), (5, 77), (63, 65), (64, 128), (199, 200), (100, 180), (0, 64)]


def _tiff(path, layout):
    import tifffile
    img = _image()
    planes = np.ascontiguousarray(img.transpose(2, 0, 1))
    options = {
        'striped': dict(data=img, rowsperstrip=7, photometric='rgb'),
        'bigtiff_lzw_tiles': dict(data=img, bigtiff=True, tile=(32, 48), compression='lzw',
                                  photometric='rgb'),
        'deflate_tiles': dict(data=img, tile=(64, 64), compression='zlib', photometric='rgb'),
        'jpeg_tiles': dict(data=img, tile=(64, 64), compression='jpeg', photometric='rgb'),
        'planar_tiles': dict(data=planes, tile=(64, 64), compression='zlib', photometric='rgb',
                             planarconfig='separate'),
        'ome_channels': dict(data=planes, ome=True, metadata={'axes': 'CYX'}, tile=(64, 64),
                             compression='zlib'),
        'gray_16bit_strips': dict(data=img[:, :, 0].astype(np.uint16) * 257, rowsperstrip=9),
    }[layout]
    tifffile.imwrite(path, options.pop('data'), **options)
    whole = tifffile.imread(path)
    if whole.ndim == 2:
        whole = whole[:, :, None]
    elif whole.shape[0] == 3 and whole.shape[2] != 3:
        whole = whole.transpose(1, 2, 0)
    return whole


@pytest.mark.parametrize('layout', ['striped', 'bigtiff_lzw_tiles', 'deflate_tiles', 'jpeg_tiles',
                                    'planar_tiles', 'ome_channels', 'gray_16bit_strips'])
def test_windows_of_rows_equal_the_whole_read(tmp_path, layout):
    """Any window of rows, within and across tiles or strips, is tifffile's whole read of those
    rows (repeated windows come from the decoded-tile cache and must stay equal)."""
    from xcit_mm.apis.large_image import open_image
    path = str(tmp_path / f'{layout}.tif')
    whole = _tiff(path, layout)
    with open_image(path) as source:
        assert (source.height, source.width, source.bands) == (H, W, whole.shape[2])
        assert source.dtype == whole.dtype
        for start, stop in WINDOWS + WINDOWS[::-1]:
            np.testing.assert_array_equal(source.read_rows(start, stop), whole[start:stop])
        for start, stop in ((-1, 5), (5, 5), (190, H + 1)):
            with pytest.raises(ValueError, match=rf'rows \[{start}, {stop}\) are not inside'):
                source.read_rows(start, stop)
    assert source.tif is None  # the file is closed when the block ends


def test_rows_for_the_model(tmp_path):
    """The model's rows are BGR uint8 (mmcv.imread's order) from an RGB TIFF, and the chosen
    conversions: grey repeated, bands 1-3 of four, 16 bits scaled to MAX -> 255."""
    import mmcv
    import tifffile

    from xcit_mm.apis.large_image import model_rows, open_image
    img = _image(bands=4)
    cases = {'rgb.tif': (img[:, :, :3], {}, img[:, :, 2::-1]),
             'rgbn.tif': (img, dict(rgb_from='first3'), img[:, :, 2::-1]),
             'gray.tif': (img[:, :, :1], dict(rgb_from='gray'), img[:, :, [0, 0, 0]]),
             'u16.tif': (img[:, :, :3].astype(np.uint16) * 16, dict(scale_16bit=4080.0),
                         img[:, :, 2::-1])}
    for name, (data, options, expected) in cases.items():
        tifffile.imwrite(tmp_path / name, data, tile=(64, 64), photometric=(
            'minisblack' if data.shape[2] == 1 else 'rgb'), extrasamples=(
                ['unspecified'] if data.shape[2] == 4 else None))
        with open_image(str(tmp_path / name)) as source:
            rows = model_rows(source, **options)(60, 130)
        assert rows.dtype == np.uint8
        np.testing.assert_array_equal(rows, expected[60:130], err_msg=name)
    png = str(tmp_path / 'rgb.png')
    mmcv.imwrite(img[:, :, 2::-1].copy(), png)  # written from BGR: the file holds img's RGB
    with open_image(png) as source:
        np.testing.assert_array_equal(model_rows(source)(0, H), mmcv.imread(png))


@pytest.mark.parametrize('bands,dtype,options,words', [
    (3, np.uint8, dict(rgb_from='gray'), "has 3 bands (RGB), as the config's preprocessing "
     'expects: --rgb-from gray does not apply; drop it'),
    (1, np.uint8, {}, "has 1 band(s) (grey); the config's preprocessing expects 3 (RGB): pass "
     '--rgb-from gray to use band 1 repeated as R, G and B'),
    (2, np.uint8, dict(rgb_from='first3'), 'has 2 band(s) (grey + alpha); the config\'s '
     'preprocessing expects 3 (RGB): pass --rgb-from gray to use band 1 repeated as R, G and B '
     '(--rgb-from first3 does not apply)'),
    (5, np.uint8, {}, "has 5 band(s) (multispectral); the config's preprocessing expects 3 "
     '(RGB): pass --rgb-from first3 to use bands 1-3 as R, G, B'),
    (3, np.uint8, dict(scale_16bit=4095.0), 'was given but in.tif is already 8-bit; drop it'),
    (3, np.uint16, dict(scale_16bit=0.0), '--scale-16bit must be positive, got 0.0'),
    (3, np.float32, {}, 'has float32 pixels; the config\'s preprocessing expects 8-bit'),
    (3, np.uint8, dict(channels=1), "has 3 band(s); the config's preprocessing expects 1: "
     'convert it first'),
    (1, np.uint8, dict(channels=1, rgb_from='gray'), 'has 1 band(s); the config\'s '
     'preprocessing expects 1: convert it first'),
])
def test_rows_the_model_would_misread_are_refused(bands, dtype, options, words):
    """Inputs the config's normalisation would take wrongly without a word: each is a
    LargeImageError naming the flag that fixes it (or the conversion to make)."""
    from types import SimpleNamespace

    from xcit_mm.apis.large_image import LargeImageError, model_rows
    source = SimpleNamespace(bands=bands, dtype=np.dtype(dtype), path='in.tif')
    with pytest.raises(LargeImageError) as error:
        model_rows(source, **options)
    assert words in str(error.value)
    gray = np.arange(12, dtype=np.uint8).reshape(2, 6, 1)  # a one-channel config takes it as is
    source = SimpleNamespace(bands=1, dtype=gray.dtype, read_rows=lambda start, stop: gray)
    np.testing.assert_array_equal(model_rows(source, channels=1)(0, 2), gray)


# -- the writer ------------------------------------------------------------------------------

@pytest.mark.parametrize('num_classes,band', [(150, 37), (300, 256), (7, 1)])
def test_label_file_by_bands(tmp_path, num_classes, band):
    """Bands of any height, out of step with the 256-row tiles, give the labels exactly, as
    uint8 up to 255 classes and uint16 above, with the palette as the colour map, the input's
    georeferencing tags, nodata where the mask says, and zeros where the edge tiles pass the
    image."""
    import rasterio
    import tifffile

    from xcit_mm.apis.large_image import open_image, write_labels
    h, w = 530, 300
    labels = np.random.RandomState(1).randint(0, num_classes, (h, w))
    palette = np.random.RandomState(2).randint(0, 256, (num_classes, 3)).tolist()
    geo = _geotiff(tmp_path / 'geo.tif', np.zeros((h, w, 1), np.uint8))
    with open_image(geo) as source:
        geotags = source.geotags
    mask = np.zeros((h, w), bool)
    mask[100:300, 7] = True
    out = str(tmp_path / 'labels.tif')
    seen = []
    bands = ((y, min(y + band, h), torch.from_numpy(labels[y:y + band]))
             for y in range(0, h, band))
    write_labels(out, bands, (h, w), num_classes, palette, geotags,
                 lambda a, b: mask[a:b], on_rows=seen.append)
    assert sorted(os.listdir(tmp_path)) == ['geo.tif', 'labels.tif']
    assert seen[-1] == h
    dtype = np.uint8 if num_classes <= 255 else np.uint16
    expected = labels.astype(dtype)
    expected[mask] = np.iinfo(dtype).max
    padded = np.zeros((768, 512), dtype)  # 3 x 2 whole tiles
    padded[:h, :w] = expected
    with tifffile.TiffFile(out) as tif:
        page = tif.pages[0]
        assert tif.is_bigtiff and page.is_tiled and (page.tilelength, page.tilewidth) == (256, 256)
        assert page.compression == 8 and page.photometric == 3  # ADOBE_DEFLATE, PALETTE
        np.testing.assert_array_equal(page.colormap[:, :num_classes].T,
                                      np.asarray(palette) * 257)
        tiles = [(tile, y, x) for tile, (_, _, y, x, _), _ in page.segments()]
    assert len(tiles) == 6
    for tile, y, x in tiles:  # as stored, with what lies past the image's edges
        np.testing.assert_array_equal(tile.reshape(256, 256), padded[y:y + 256, x:x + 256])
    with rasterio.open(out) as dst, rasterio.open(geo) as src:
        assert dst.dtypes[0] == np.dtype(dtype).name
        assert (dst.transform, dst.crs, dst.shape) == (src.transform, src.crs, src.shape)
        assert dst.nodata == np.iinfo(dtype).max
        got = dst.read(1)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize('bands,message', [
    ([(0, 10), (12, 40)], r'out of order: rows \[12, 40\) after row 10'),
    ([(0, 10), (5, 40)], r'out of order: rows \[5, 40\) after row 10'),
    ([(0, 40), (40, 45)], r'out of order: rows \[40, 45\) after row 40'),
    ([(0, 16), (16, 10)], r'out of order: rows \[16, 10\) after row 16'),
    ([(0, 10)], 'stopped at row 10 of 40'),
    ([(0, 10, 9)], r'band \[0, 10\) has shape \(9, 30\), expected \(10, 30\)'),
])
def test_label_bands_out_of_order_are_an_error_and_no_file(tmp_path, bands, message):
    """Bands that skip, repeat, pass or stop short of the image's rows, or have the wrong
    height, are an error naming the rows, and leave no file."""
    from xcit_mm.apis.large_image import write_labels
    labels = np.ones((50, 30), np.int64)

    def stream():
        for start, stop, *rows in bands:  # rows: a wrong band height
            yield start, stop, labels[start:start + (rows[0] if rows else stop - start)]

    with pytest.raises(RuntimeError, match=message):
        write_labels(str(tmp_path / 'labels.tif'), stream(), (40, 30), 7, tile=16)
    assert os.listdir(tmp_path) == []


# -- the tool --------------------------------------------------------------------------------

def test_geotiff_through_the_tool(tool, tiny, tmp_path, capsys):
    """A tiled GeoTIFF in, labels out: placed by rasterio exactly over the input, tiled deflate
    uint8 with the ADE20k palette, the input's nodata pixels marked, and elsewhere the labels of
    the whole image through inference_model on >= 99.99% of pixels."""
    import rasterio
    import tifffile
    from mmseg.apis import inference_model
    from mmseg.datasets import ADE20KDataset
    config, checkpoint, model = tiny
    img = _image()
    geo = _geotiff(tmp_path / 'scene.tif', img)
    out = str(tmp_path / 'labels.tif')
    assert tool.main([config, checkpoint, geo, '--out', out]) == 0
    assert sorted(os.listdir(tmp_path)) == ['labels.tif', 'scene.tif']
    with rasterio.open(out) as dst, rasterio.open(geo) as src:
        assert (dst.transform, dst.crs, dst.shape) == (src.transform, src.crs, src.shape)
        assert dst.dtypes == ('uint8',) and dst.compression.name == 'deflate'
        assert dst.block_shapes == [(256, 256)] and dst.profile['tiled']
        assert dst.colorinterp[0].name == 'palette' and dst.nodata == 255
        palette = ADE20KDataset.METAINFO['palette']
        assert [dst.colormap(1)[i][:3] for i in range(150)] == [tuple(p) for p in palette]
        labels = dst.read(1)
    with tifffile.TiffFile(out) as tif:
        assert tif.is_bigtiff
    expected = inference_model(model, np.ascontiguousarray(img[:, :, ::-1]))
    expected = expected.pred_sem_seg.data[0].numpy()
    nodata = (img == 0).all(axis=2)
    assert (labels[nodata] == 255).all()
    assert (labels[~nodata] == expected[~nodata]).mean() >= 0.9999
    assert len(np.unique(expected)) > 1


def _corrupt_tile(path, index=5):
    """Garbage in the middle of one deflate tile's bytes."""
    import tifffile
    with tifffile.TiffFile(path) as tif:
        page = tif.pages[0]
        offset, count = page.dataoffsets[index], page.databytecounts[index]
    with open(path, 'r+b') as f:
        f.seek(offset + 2)
        f.write(bytes(range(256))[:count - 4])


def _bad_input(kind, tmp_path, monkeypatch):
    """(image path, extra arguments, words the error line must hold) of one bad input."""
    import tifffile
    img = _image(bands=4)
    path = str(tmp_path / 'in.tif')
    if kind == 'not_an_image':
        path = str(tmp_path / 'notes.png')
        with open(path, 'w') as f:
            f.write('not pixels\n')
        return path, [], ['not an image', path]
    if kind == 'missing':
        return str(tmp_path / 'nowhere.tif'), [], ['image not found']
    if kind == 'broken_header':  # TIFF's magic, then bytes that are no header
        with open(path, 'wb') as f:
            f.write(b'II*\x00' + bytes(range(256)) * 4)
        return path, [], ['corrupt or truncated TIFF', path]
    if kind in ('truncated', 'corrupt_tile'):
        tifffile.imwrite(path, img[:, :, :3], tile=(64, 64), compression='zlib',
                         photometric='rgb')
        if kind == 'truncated':
            with open(path, 'r+b') as f:
                f.truncate(os.path.getsize(path) // 2)
            # named as such, not wrapped as a broken header
            return path, [], ['error: truncated TIFF: ', 'download it again']
        _corrupt_tile(path)
        return path, [], ['corrupt TIFF', 'tile 5']
    if kind in ('1_band', '2_band', '4_band', 'gray_flag_on_4_band'):
        bands = {'1_band': 1, '2_band': 2}.get(kind, 4)
        tifffile.imwrite(path, img[:, :, :bands], tile=(64, 64),
                         photometric='rgb' if bands == 4 else 'minisblack',
                         extrasamples=['unspecified'] if bands == 4 else None,
                         planarconfig='contig' if bands > 1 else None)
        fix = '--rgb-from first3' if bands == 4 else '--rgb-from gray'
        extra = ['--rgb-from', 'gray'] if kind == 'gray_flag_on_4_band' else []
        return path, extra, [f'has {bands} band', fix]
    if kind == '16_bit':
        tifffile.imwrite(path, img[:, :, :3].astype(np.uint16), tile=(64, 64), photometric='rgb')
        return path, [], ['16-bit', '--scale-16bit']
    tifffile.imwrite(path, img[:, :, :3], tile=(64, 64), photometric='rgb')
    if kind == 'output_folder_missing':
        return path, ['--out', str(tmp_path / 'no' / 'labels.tif')], ['output folder does not']
    if kind == 'disk_full':
        write = tifffile.FileHandle.write

        def full(self, data):
            if str(self.name).endswith('.partial') and self.tell() > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write(self, data)
        monkeypatch.setattr(tifffile.FileHandle, 'write', full)
        return path, [], ['no space left']
    if kind == 'budget_below_minimum':
        return path, ['--max-memory', '0.001'], ['max_memory']
    if kind == 'interrupted':
        from xcit_mm.apis import large_image

        def interrupt(self, start, stop):  # Ctrl-C while the stream reads, the output begun
            assert any(name.endswith('.partial') for name in os.listdir(tmp_path))
            raise KeyboardInterrupt
        monkeypatch.setattr(large_image._TiffSource, 'read_rows', interrupt)
        return path, [], ['interrupted']
    raise AssertionError(kind)


BEFORE_THE_MODEL = ['not_an_image', 'missing', 'broken_header', 'truncated', '1_band', '2_band',
                    '4_band', 'gray_flag_on_4_band', '16_bit', 'output_folder_missing']
DURING_THE_STREAM = ['corrupt_tile', 'disk_full', 'budget_below_minimum', 'interrupted']


@pytest.mark.parametrize('kind', BEFORE_THE_MODEL + DURING_THE_STREAM)
def test_bad_input_is_one_line_and_no_file(tool, tiny, tmp_path, monkeypatch, capsys, kind):
    """One ``error:`` line naming the problem (and the flag or step that fixes it), a non-zero
    exit status, and neither the output nor its partial file."""
    config, checkpoint, _ = tiny
    image, extra, words = _bad_input(kind, tmp_path, monkeypatch)
    out = str(tmp_path / 'labels.tif')
    before = set(os.listdir(tmp_path))
    status = tool.main([config, checkpoint, image, '--out', out] + extra)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status != 0 and len(lines) == 1 and lines[0].startswith('error: '), err
    assert 'Traceback' not in err
    for word in words:
        assert word in lines[0], lines[0]
    assert set(os.listdir(tmp_path)) == before  # no labels.tif, no labels.tif.partial
