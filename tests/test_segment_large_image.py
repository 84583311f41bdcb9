# Copyright (c) xcit_mm contributors. All rights reserved.
"""tools/segment_large_image.py and xcit_mm.apis.large_image's reader: windows of rows read from
rasters of every layout GDAL (or tifffile) reads equal their whole read; the tool's labels are
the whole-image labels of the same model, placed by GDAL over the input, with the confidence and
polygons of the same run; every bad input or output is one line and leaves no file. (The COG
writer: tests/test_raster_writer.py; the polygons alone: tests/test_polygons.py.)

The model is a small XCiT Semantic FPN built from the paper's ADE20k config (random weights,
150 classes); the images are 200 x 300 so the file stays fast. The expected labels come from
mmseg's ``inference_model`` on the same pixels (full resolution: the test Resize removed).
"""
import errno
import importlib.util
import os
import os.path as osp
import sys

import numpy as np
import pytest
import torch
from recording_bar import recording_bar

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
UTM = dict(crs='EPSG:32633', transform='Affine(0.5, 0.0, 500000.0, 0.0, -0.5, 4100000.0)')


def _affine():
    from affine import Affine
    return Affine(0.5, 0.0, 500000.0, 0.0, -0.5, 4100000.0)


def _write(path, img, **profile):
    """``img`` (rows, columns, bands) written by rasterio (GDAL) with ``profile``."""
    import rasterio
    profile = dict(height=img.shape[0], width=img.shape[1], count=img.shape[2],
                   dtype=img.dtype.name, **profile)
    profile.setdefault('driver', 'GTiff')
    with rasterio.open(path, 'w', **profile) as dst:
        dst.write(img.transpose(2, 0, 1))
    return str(path)


def _vrt(folder, scene, nodata=0, name='mosaic.vrt'):
    """``scene`` cut into four GeoTIFF quarters, each with its own geotransform, and a VRT
    written by hand (gdalbuildvrt is not installed) that places them as one scene."""
    h, w, bands = scene.shape
    t = _affine()
    dtype = {'uint8': 'Byte', 'uint16': 'UInt16'}[scene.dtype.name]
    sources = {b: [] for b in range(1, bands + 1)}
    for y0, y1 in ((0, h // 2), (h // 2, h)):
        for x0, x1 in ((0, w // 2), (w // 2, w)):
            name_q = f'quarter_{y0}_{x0}.tif'
            _write(folder / name_q, scene[y0:y1, x0:x1], crs='EPSG:32633', nodata=nodata,
                   transform=t @ t.translation(x0, y0), tiled=True, blockxsize=32,
                   blockysize=32, compress='deflate')
            for b in sources:
                rect = f'xSize="{x1 - x0}" ySize="{y1 - y0}"'
                sources[b].append(
                    f'<SimpleSource><SourceFilename relativeToVRT="1">{name_q}</SourceFilename>'
                    f'<SourceBand>{b}</SourceBand><SrcRect xOff="0" yOff="0" {rect}/>'
                    f'<DstRect xOff="{x0}" yOff="{y0}" {rect}/></SimpleSource>')
    xml = [f'<VRTDataset rasterXSize="{w}" rasterYSize="{h}"><SRS>EPSG:32633</SRS>',
           f'<GeoTransform>{t.c}, {t.a}, {t.b}, {t.f}, {t.d}, {t.e}</GeoTransform>']
    for b, srcs in sources.items():
        xml.append(f'<VRTRasterBand dataType="{dtype}" band="{b}">'
                   f'<NoDataValue>{nodata}</NoDataValue>{"".join(srcs)}</VRTRasterBand>')
    xml.append('</VRTDataset>')
    (folder / name).write_text('\n'.join(xml))
    return str(folder / name)


def _reader_file(kind, folder):
    """(path, whole read (rows, columns, bands) by the library that reads the file) for one kind
    of file; GDAL's (rasterio's) read for all but the OME-TIFF."""
    import rasterio
    import tifffile
    img = _image()
    planes = np.ascontiguousarray(img.transpose(2, 0, 1))
    path = folder / f'{kind}.tif'
    tiled = dict(tiled=True, blockxsize=64, blockysize=64, compress='deflate')
    if kind == 'ome_channels':  # channels as pages: GDAL would read the first page only
        tifffile.imwrite(path, planes, ome=True, metadata={'axes': 'CYX'}, tile=(64, 64),
                         compression='zlib')
        return str(path), tifffile.imread(path).transpose(1, 2, 0)
    if kind in ('striped', 'bigtiff_lzw_tiles', 'planar_tiles', 'gray_16bit_strips'):
        tifffile.imwrite(path, **{  # TIFFs that tifffile wrote, in its layouts
            'striped': dict(data=img, rowsperstrip=7, photometric='rgb'),
            'bigtiff_lzw_tiles': dict(data=img, bigtiff=True, tile=(32, 48), compression='lzw',
                                      photometric='rgb'),
            'planar_tiles': dict(data=planes, tile=(64, 64), compression='zlib',
                                 photometric='rgb', planarconfig='separate'),
            'gray_16bit_strips': dict(data=img[:, :, 0].astype(np.uint16) * 257,
                                      rowsperstrip=9)}[kind])
    elif kind == 'jpeg_tiles':
        _write(path, img, photometric='ycbcr', tiled=True, blockxsize=64, blockysize=64,
               compress='jpeg')
    elif kind == 'geotiff_16bit_4band_nodata':  # a reflectance product's layout
        _write(path, _image(bands=4, dtype=np.uint16), crs='EPSG:32633', transform=_affine(),
               nodata=0, **tiled)
    elif kind == 'geotiff_gcps':
        from rasterio.control import GroundControlPoint
        gcps = [GroundControlPoint(r, c, 500000 + c, 4100000 - r) for r, c in
                ((0, 0), (0, W), (H, 0), (H, W))]
        _write(path, img, **tiled)
        with rasterio.open(path, 'r+') as dst:
            dst.gcps = (gcps, 'EPSG:32633')
    elif kind in ('internal_mask', 'msk_file'):  # GDAL's mask band, in the file or beside it
        with rasterio.Env(GDAL_TIFF_INTERNAL_MASK=kind == 'internal_mask'):
            _write(path, img, crs='EPSG:32633', transform=_affine(), **tiled)
            with rasterio.open(path, 'r+') as dst:
                mask = np.full((H, W), 255, np.uint8)
                mask[150:, 200:] = 0
                dst.write_mask(mask)
    elif kind == 'rgba_png_world':  # georeferencing from a world file (.wld) and .aux.xml (CRS)
        rgba = np.concatenate([img, np.full((H, W, 1), 255, np.uint8)], axis=2)
        rgba[:40, :60, 3] = 0
        path = _write(folder / 'rgba.png', rgba, driver='PNG', crs='EPSG:32633',
                      transform=_affine(), WORLDFILE='YES')
    elif kind == 'jpeg_aux_xml':  # an ordinary JPEG, georeferenced by GDAL's .aux.xml
        path = _write(folder / 'photo.jpg', img, driver='JPEG')
        t = _affine()
        (folder / 'photo.jpg.aux.xml').write_text(
            f'<PAMDataset><SRS>EPSG:32633</SRS><GeoTransform>{t.c}, {t.a}, {t.b}, {t.f}, '
            f'{t.d}, {t.e}</GeoTransform></PAMDataset>')
    elif kind == 'jpeg2000':
        if 'JP2OpenJPEG' not in rasterio.drivers.raster_driver_extensions().values():
            pytest.skip('the bundled GDAL has no JPEG2000 driver (JP2OpenJPEG)')
        path = _write(folder / 'scene.jp2', _image(dtype=np.uint16), driver='JP2OpenJPEG',
                      crs='EPSG:32633', transform=_affine(), nodata=0, REVERSIBLE='YES',
                      QUALITY=100, BLOCKXSIZE=128, BLOCKYSIZE=128)
    elif kind == 'vrt_of_four':
        path = _vrt(folder, img)
    elif kind == 'geotiff_in_a_zip':  # through GDAL's /vsizip/, as archives are delivered
        import zipfile
        _write(path, img, crs='EPSG:32633', transform=_affine(), **tiled)
        with zipfile.ZipFile(folder / 'delivery.zip', 'w') as archive:
            archive.write(path, 'scene/scene.tif')
        os.remove(path)
        path = f'/vsizip/{folder}/delivery.zip/scene/scene.tif'
    else:
        raise AssertionError(kind)
    with rasterio.open(path) as src:
        return str(path), src.read().transpose(1, 2, 0)


GDAL_FILES = ['striped', 'bigtiff_lzw_tiles', 'planar_tiles', 'gray_16bit_strips', 'jpeg_tiles',
              'geotiff_16bit_4band_nodata', 'geotiff_gcps', 'internal_mask', 'msk_file',
              'rgba_png_world', 'jpeg_aux_xml', 'jpeg2000', 'vrt_of_four', 'geotiff_in_a_zip']


@pytest.mark.parametrize('kind', GDAL_FILES + ['ome_channels'])
def test_windows_of_rows_equal_the_whole_read(tmp_path, kind):
    """Any window of rows, within and across blocks, equals the whole read of those rows by the
    library that reads the file (GDAL, or tifffile for OME-TIFF); the georeferencing, the valid
    pixels (nodata, alpha, mask band or .msk file) and the files read are GDAL's."""
    import rasterio

    from xcit_mm.apis.large_image import open_image
    path, whole = _reader_file(kind, tmp_path)
    with open_image(path) as source:
        assert (source.height, source.width, source.bands) == whole.shape
        assert source.dtype == whole.dtype
        for start, stop in WINDOWS + WINDOWS[::-1]:
            np.testing.assert_array_equal(source.read_rows(start, stop), whole[start:stop])
        np.testing.assert_array_equal(source.read_rows(3, 9, [source.bands, 1]),
                                      whole[3:9, :, [source.bands - 1, 0]])
        for start, stop in ((-1, 5), (5, 5), (190, H + 1)):
            with pytest.raises(ValueError, match=rf'rows \[{start}, {stop}\) are not inside'):
                source.read_rows(start, stop)
        if kind == 'ome_channels':
            assert (source.crs, source.transform, source.gcps) == (None, None, [])
            assert not source.has_mask() and source.files == [path]
            return
        with rasterio.open(path) as src:
            gcps, gcp_crs = src.gcps
            assert source.crs == (src.crs or gcp_crs)
            places = [(g.row, g.col, g.x, g.y) for g in gcps]
            assert [(g.row, g.col, g.x, g.y) for g in source.gcps] == places
            assert bool(gcps) == (kind == 'geotiff_gcps')
            if gcps or kind in ('striped', 'bigtiff_lzw_tiles', 'planar_tiles',
                                'gray_16bit_strips', 'jpeg_tiles'):
                assert source.transform is None  # no geotransform (GCPs place it)
            else:
                assert source.crs == 'EPSG:32633' and source.transform == _affine()
            assert source.nodata == src.nodatavals
            assert sorted(source.files) == sorted(map(osp.abspath, src.files))
            masked = kind in ('geotiff_16bit_4band_nodata', 'internal_mask', 'msk_file',
                              'rgba_png_world', 'jpeg2000', 'vrt_of_four')
            assert source.has_mask() == masked
            for start, stop in WINDOWS:
                expected = src.dataset_mask(window=((start, stop), (0, W))) > 0
                np.testing.assert_array_equal(source.valid_rows(start, stop), expected)
            assert not source.valid_rows(0, H).all() if masked else True
    assert source.dataset is None  # the file is closed when the block ends
    if kind == 'vrt_of_four':  # the four files in their places
        np.testing.assert_array_equal(whole, _image())
        assert len(source.files) == 5


def test_rows_for_the_model(tmp_path):
    """The model's rows: the chosen bands (1-based, in the model's R, G, B order) as uint8 in
    mmcv.imread's BGR order, scaled MIN -> 0, MAX -> 255 per band or for all, and the valid
    pixels of the chosen bands, where GDAL's nodata or alpha say; an ordinary PNG gives what
    mmcv.imread gives."""
    import mmcv
    import rasterio

    from xcit_mm.apis.large_image import model_rows, open_image

    def scaled(band, low, high):
        return np.clip(np.rint((band.astype(np.float64) - low) * 255 / (high - low)), 0, 255)

    s2, s2_whole = _reader_file('geotiff_16bit_4band_nodata', tmp_path)
    png, rgba = _reader_file('rgba_png_world', tmp_path)
    u16 = _write(tmp_path / 'u16.tif', _image().astype(np.uint16) * 16)
    gray = _write(tmp_path / 'gray.tif', _image()[:, :, :1])
    f32 = _image(bands=3).astype(np.float32) / 255
    f32[5, 7] = np.nan
    f32 = _write(tmp_path / 'f32.tif', f32)
    with rasterio.open(f32) as src:
        f32_whole = src.read().transpose(1, 2, 0)
    img = _image()
    per_band = [0, 3000, 100, 2000, 0, 4000]  # R = band 4, G = band 3, B = band 2
    cases = [
        (s2, dict(bands=[4, 3, 2], scale=per_band), np.stack(
            [scaled(s2_whole[:, :, 1], 0, 4000), scaled(s2_whole[:, :, 2], 100, 2000),
             scaled(s2_whole[:, :, 3], 0, 3000)], axis=2), True),
        (s2, dict(rgb_from='first3', scale=[0, 40000]),
         scaled(s2_whole[:, :, 2::-1], 0, 40000), True),
        (png, {}, rgba[:, :, 2::-1], True),  # 3 colour bands and GDAL's alpha band
        (png, dict(rgb_from='first3'), rgba[:, :, 2::-1], True),  # the alpha stays the mask
        (png, dict(bands=[1, 1, 1]), rgba[:, :, [0, 0, 0]], True),
        (u16, dict(scale_16bit=4080.0), img[:, :, 2::-1], False),
        (gray, dict(rgb_from='gray'), img[:, :, [0, 0, 0]], False),
        (f32, dict(scale=[0, 1]), np.nan_to_num(scaled(f32_whole[:, :, ::-1], 0, 1)), False),
    ]
    for path, options, expected, masked in cases:
        with open_image(path) as source, rasterio.open(path) as src:
            rows = model_rows(source, **options)
            got = rows(60, 130)
            assert got.dtype == np.uint8 and got.flags.c_contiguous
            np.testing.assert_array_equal(got, expected[60:130], err_msg=f'{path} {options}')
            assert (rows.valid_rows is not None) == masked, (path, options)
            if masked:
                chosen = sorted(set(rows.bands))
                valid = src.read_masks(chosen, window=((0, 80), (0, W))).any(axis=0)
                np.testing.assert_array_equal(rows.valid_rows(0, 80), valid)
                assert not valid.all()
    rgb = str(tmp_path / 'rgb.png')
    mmcv.imwrite(img[:, :, 2::-1].copy(), rgb)  # written from BGR: the file holds img's RGB
    with open_image(rgb) as source:
        np.testing.assert_array_equal(model_rows(source)(0, H), mmcv.imread(rgb))


@pytest.mark.parametrize('bands,dtype,options,words', [
    (3, np.uint8, dict(rgb_from='gray'), "has 3 colour bands (RGB), as the config's "
     'preprocessing expects: --rgb-from gray does not apply; drop it'),
    (1, np.uint8, {}, "has 1 band(s) (grey); the config's preprocessing expects 3 (RGB): pass "
     '--rgb-from gray to use band 1 repeated as R, G and B, or --bands R G B'),
    (2, np.uint8, dict(rgb_from='first3'), 'has 2 band(s) (grey + alpha); the config\'s '
     'preprocessing expects 3 (RGB): pass --rgb-from gray to use band 1 repeated as R, G and B, '
     'or --bands R G B to choose them (--rgb-from first3 does not apply)'),
    (5, np.uint8, {}, "has 5 band(s) (multispectral); the config's preprocessing expects 3 "
     '(RGB): pass --rgb-from first3 to use bands 1-3 as R, G, B'),
    (4, np.uint16, dict(bands=[4, 0, 5]), '--bands 0 5: in.tif has 4 band(s), numbered 1-4'),
    (4, np.uint8, dict(bands=[4, 3]), "--bands names 2 band(s); the config's preprocessing "
     'expects 3 (R, G, B)'),
    (4, np.uint8, dict(bands=[1, 2, 3], rgb_from='first3'), '--bands and --rgb-from first3 both'),
    (3, np.uint8, dict(scale_16bit=4095.0), 'was given but in.tif is uint8, not 16-bit: drop it'),
    (3, np.float32, dict(scale_16bit=4095.0), 'in.tif is float32, not 16-bit: drop it, or use '
     '--scale MIN MAX'),
    (3, np.uint16, dict(scale_16bit=0.0), '--scale-16bit must be positive, got 0.0'),
    (3, np.uint16, {}, 'in.tif has uint16 pixels; the config\'s preprocessing expects 8-bit '
     'values (0-255): pass --scale MIN MAX'),
    (3, np.float32, {}, 'has float32 pixels; the config\'s preprocessing expects 8-bit values '
     '(0-255): pass --scale MIN MAX'),
    (3, np.uint16, dict(scale=[0, 1, 2, 3]), '--scale takes MIN MAX once for all bands or once '
     'per selected band (6 numbers for 3 bands); got 4'),
    (3, np.uint16, dict(scale=[0, 10, 5, 5, 0, 1]), '--scale 5 5: MIN must be below MAX'),
    (3, np.uint16, dict(scale=[0, 9], scale_16bit=9.0), '--scale and --scale-16bit both'),
    (3, np.uint8, dict(channels=1), "has 3 band(s); the config's preprocessing expects 1: "
     'choose them with --bands'),
    (1, np.uint8, dict(channels=1, rgb_from='gray'), 'has 1 band(s); the config\'s '
     'preprocessing expects 1'),
])
def test_rows_the_model_would_misread_are_refused(bands, dtype, options, words):
    """Inputs the config's normalisation would take wrongly without a word, and band or scale
    choices that do not fit the file: each is a LargeImageError naming the option that fixes
    it (or the conversion to make)."""
    from types import SimpleNamespace

    from xcit_mm.apis.large_image import LargeImageError, model_rows
    source = SimpleNamespace(bands=bands, dtype=np.dtype(dtype), path='in.tif', alpha_bands=(),
                             has_mask=lambda bands: False)
    with pytest.raises(LargeImageError) as error:
        model_rows(source, **options)
    assert words in str(error.value)
    gray = np.arange(12, dtype=np.uint8).reshape(2, 6, 1)  # a one-channel config takes it as is
    source = SimpleNamespace(bands=1, dtype=gray.dtype, read_rows=lambda start, stop, b: gray,
                             alpha_bands=(), has_mask=lambda bands: False)
    np.testing.assert_array_equal(model_rows(source, channels=1)(0, 2), gray)


READ_TWICE = '''
import json
import rasterio, tifffile  # imported before the base: not part of the reader's growth
from xcit_mm.apis.large_image import open_image
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2 ** 20
base = rss(); peak = 0
with open_image(PATH, max_memory=32) as source:
    for _ in range(2):  # bands of rows with a halo above, as the stream reads them, twice
        for start in range(0, source.height, 100):
            rows = source.read_rows(max(0, start - 16), min(source.height, start + 100))
            del rows
            peak = max(peak, rss() - base)
    print(json.dumps(dict(growth_mb=peak, cache_mb=source.memory_mb)))
'''


def test_the_reader_holds_a_bounded_share_of_the_budget(tmp_path):
    """Reading a file several times larger than the reader's share of the budget, top to bottom
    twice, never holds it whole: GDAL's block cache (measured as the resident set of a fresh
    process) and tifffile's decoded tile rows (traced) stay within the share."""
    from fresh_process import run_fresh

    from xcit_mm.apis.large_image import open_image
    size = 4096  # 48 MB of 3 uint8 bands, 6 x the share of a 32 MB budget
    wave = (np.sin(np.arange(size) / 37.0) * 60).astype(np.int16)
    img = (wave[:, None] + wave[None, ::-1] + 127).astype(np.uint8)
    img = np.repeat(img[:, :, None], 3, axis=2)
    path = _write(tmp_path / 'large.tif', img, tiled=True, blockxsize=256, blockysize=256,
                  compress='deflate')
    report = run_fresh(READ_TWICE.replace('PATH', repr(path)))
    assert report['cache_mb'] == 8.0  # a quarter of 32 MB
    assert report['growth_mb'] < img.nbytes / 2 ** 20 / 2, report

    import tifffile
    import tracemalloc
    ome = str(tmp_path / 'large.ome.tif')
    tifffile.imwrite(ome, img[:2048].transpose(2, 0, 1), ome=True, metadata={'axes': 'CYX'},
                     tile=(256, 256), compression='zlib')
    tracemalloc.start()
    try:
        with open_image(ome, max_memory=16) as source:  # 4 MB: 4 tile rows of the 3 channels
            for _ in range(2):
                for start in range(0, 2048, 100):
                    rows = source.read_rows(max(0, start - 16), min(2048, start + 100))
                    del rows
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2048 * size * 3 / 2, peak  # the image is 24 MB


# -- the tool --------------------------------------------------------------------------------

def test_vrt_mosaic_with_a_collar_through_the_tool(tool, tiny, tmp_path):
    """A VRT of four 16-bit 4-band GeoTIFFs with a nodata collar, read as one scene with
    ``--bands 3 2 1 --scale 0 65535``: the labels are placed by GDAL (rasterio) exactly over the
    mosaic, nodata wherever GDAL's mask of the mosaic is, and elsewhere the model's stream of
    the pixels and valid pixels that GDAL reads (the whole mosaic, scaled here), on >= 99.99% of
    pixels."""
    import rasterio
    config, checkpoint, model = tiny
    scene = _image(bands=4, dtype=np.uint16)
    scene[:, :90] = 0  # the collar, beside the black corner
    (tmp_path / 'tiles').mkdir()
    vrt = _vrt(tmp_path / 'tiles', scene)
    out = str(tmp_path / 'labels.tif')
    assert tool.main([config, checkpoint, vrt, '--out', out, '--bands', '3', '2', '1',
                      '--scale', '0', '65535', '--cfg-options', 'model.test_cfg.mode=stream',
                      'model.test_cfg.band_mb=1']) == 0  # bands of a few rows
    assert sorted(os.listdir(tmp_path)) == ['labels.tif', 'labels.tif.aux.xml', 'tiles']
    with rasterio.open(out) as dst, rasterio.open(vrt) as src:
        assert (dst.transform, dst.crs, dst.shape) == (src.transform, src.crs, src.shape)
        assert dst.nodata == 255
        labels = dst.read(1)
        valid = src.dataset_mask() > 0
        pixels = src.read([1, 2, 3]).transpose(1, 2, 0)  # B, G, R: bands 3, 2, 1 as R, G, B
    assert valid.mean() == pytest.approx(0.7)  # the 90 columns of the collar
    assert (labels[~valid] == 255).all()
    pixels = np.clip(np.rint(pixels / 257), 0, 255).astype(np.uint8)
    stream = model.stream_labels(lambda a, b: pixels[a:b], (H, W),
                                 valid_rows=lambda a, b: valid[a:b])
    expected = np.concatenate([band.numpy() for _, _, band in stream])
    assert (labels[valid] == expected[valid]).mean() >= 0.9999
    assert len(np.unique(expected[valid])) > 1


def _whole_path(model, img):
    """The labels and the full-resolution logits (classes, H, W) of the whole image through
    mmseg's inference_model, test_cfg mode 'whole' (stock's path) keeping the logits."""
    from mmseg.apis import inference_model
    saved = model.test_cfg
    model.test_cfg = dict(mode='whole', keep_seg_logits=True)
    try:
        result = inference_model(model, np.ascontiguousarray(img[:, :, ::-1]))
    finally:
        model.test_cfg = saved
    return result.pred_sem_seg.data[0].numpy(), result.seg_logits.data


def test_labels_confidence_and_polygons_of_one_run(tool, tiny, tmp_path, monkeypatch):
    """The labels, ``--confidence`` and ``--vector`` from one pass of the stream, for a GeoTIFF
    with a reflectance product's band metadata (scale 1e-4, offset -0.1, band names,
    statistics) and a 30% nodata collar, run with ``--include-nodata-tokens`` (the collar in
    XCA's sums, as in the whole image). The labels of the valid pixels are those of the whole
    image through mmseg's inference_model (>= 99.99%), in a tiled deflate uint8 COG with the
    ADE20k palette, nodata in the collar, placed by GDAL over the input and carrying none of its
    band metadata (bug 1: QGIS showed class 3 as -0.0997). The confidence is round(255 x the
    top softmax probability) within 1, on the labels' grid, 0 in the collar. The polygons, in
    the scene's CRS and burnt back by GDAL, are the label file exactly: each valid pixel in one
    polygon of its class, named as the dataset names it, none in the collar. The progress bar
    counts the trunk's token rows x layers, then the label rows."""
    import pyogrio.raw
    import rasterio
    import shapely
    from mmseg.datasets import ADE20KDataset
    from rasterio.crs import CRS
    from rasterio.enums import MergeAlg
    from rasterio.features import rasterize
    config, checkpoint, model = tiny
    img = _image()
    img[:, :90] = 0  # the collar (nodata 0), beside the black corner
    scene = _geotiff(tmp_path / 'scene.tif', img)
    with rasterio.open(scene, 'r+') as src:
        src.scales, src.offsets = (1e-4, ) * 3, (-0.1, ) * 3
        src.descriptions = ('Red', 'Green', 'Blue')
        for band in (1, 2, 3):
            src.update_tags(band, STATISTICS_MEAN=0.05, STATISTICS_MAXIMUM=0.2)
    out, confidence_out, vector = (str(tmp_path / name) for name in
                                   ('labels.tif', 'confidence.tif', 'labels.gpkg'))
    records = []
    monkeypatch.setattr('tqdm.tqdm', recording_bar(records))
    assert tool.main([config, checkpoint, scene, '--out', out, '--confidence', confidence_out,
                      '--vector', vector, '--include-nodata-tokens']) == 0
    assert sorted(os.listdir(tmp_path)) == ['confidence.tif', 'labels.gpkg', 'labels.tif',
                                            'labels.tif.aux.xml', 'scene.tif']
    with rasterio.open(scene) as src, rasterio.open(out) as dst, \
            rasterio.open(confidence_out) as conf:
        valid = src.dataset_mask() > 0
        assert src.scales[0] == 1e-4 and src.descriptions[0] == 'Red'  # as GDAL reads them
        for raster in (dst, conf):
            assert (raster.crs, raster.transform, raster.shape) == (src.crs, src.transform,
                                                                    src.shape)
            assert raster.scales == (1.0, ) and raster.offsets == (0.0, )
            assert raster.descriptions[0] != 'Red' and 'STATISTICS_MEAN' not in raster.tags(1)
            assert raster.compression.name == 'deflate' and raster.profile['tiled']
            assert raster.block_shapes == [(512, 512)] and raster.dtypes == ('uint8', )
        assert dst.colorinterp[0].name == 'palette' and dst.nodata == 255
        palette = ADE20KDataset.METAINFO['palette']
        assert [dst.colormap(1)[i][:3] for i in range(150)] == [tuple(p) for p in palette]
        assert conf.nodata == 0
        labels, confidence, transform = dst.read(1), conf.read(1), src.transform
    assert valid.mean() == pytest.approx(0.7)
    expected, logits = _whole_path(model, img)
    top = torch.softmax(logits.double(), dim=0).max(dim=0).values
    expected_confidence = np.maximum(torch.round(255 * top).numpy(), 1)  # 0 is nodata
    assert (labels[~valid] == 255).all() and (confidence[~valid] == 0).all()
    assert (labels[valid] == expected[valid]).mean() >= 0.9999
    agree = valid & (labels == expected)
    difference = np.abs(confidence[agree].astype(int) - expected_confidence[agree])
    assert difference.max() <= 1 and confidence[valid].std() > 5, difference.max()

    meta, _, wkb, fields = pyogrio.raw.read(vector)
    fields = dict(zip(meta['fields'], fields))
    assert CRS.from_user_input(meta['crs']) == CRS.from_epsg(32633)
    geoms, class_ids = shapely.from_wkb(wkb), fields['class_id']
    assert shapely.is_valid(geoms).all() and len(np.unique(class_ids)) > 1
    names = ADE20KDataset.METAINFO['classes']
    assert list(fields['class_name']) == [names[i] for i in class_ids]
    burnt = rasterize(zip(geoms, class_ids.tolist()), out_shape=(H, W), transform=transform,
                      fill=255, dtype='uint8')
    np.testing.assert_array_equal(burnt, labels)
    cover = rasterize(((g, 1) for g in geoms), out_shape=(H, W), transform=transform,
                      merge_alg=MergeAlg.add, dtype='uint8')
    np.testing.assert_array_equal(cover, valid)  # once each, none in the collar

    layers, token_rows = 4, -(-H // 16)  # the tiny model's trunk, 16 px patches
    stages = [(desc, unit, total) for desc, unit, _, total in records if total]
    assert sorted(set(stages), key=stages.index) == [
        ('scene.tif (200 x 300): trunk (token rows x layers)', 'row-layer', layers * token_rows),
        ('scene.tif (200 x 300): labels', 'row', H),
        ('scene.tif (200 x 300): writing the overviews', 'row', H)]
    for stage, total in (('trunk', layers * token_rows), ('labels', H)):
        counts = [n for desc, _, n, _ in records if stage in desc]
        assert counts == sorted(counts) and counts[-1] == total


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
        return path, [], ['not an image GDAL reads', path]
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
            # named as such, before any work
            return path, [], ['error: truncated TIFF: ', 'download it again']
        _corrupt_tile(path)
        return path, [], [path, 'cannot be read', 'gdalinfo -checksum']
    if kind in ('1_band', '2_band', '4_band', 'gray_flag_on_4_band'):
        bands = {'1_band': 1, '2_band': 2}.get(kind, 4)
        tifffile.imwrite(path, img[:, :, :bands], tile=(64, 64),
                         photometric='rgb' if bands == 4 else 'minisblack',
                         extrasamples=['unspecified'] if bands == 4 else None,
                         planarconfig='contig' if bands > 1 else None)
        fix = '--rgb-from first3' if bands == 4 else '--rgb-from gray'
        extra = ['--rgb-from', 'gray'] if kind == 'gray_flag_on_4_band' else []
        return path, extra, [f'has {bands} band', fix]
    if kind == 'band_out_of_range':
        _write(path, img)
        return path, ['--bands', '4', '3', '7'], ['--bands 7', 'has 4 band(s), numbered 1-4']
    if kind == '16_bit':
        tifffile.imwrite(path, img[:, :, :3].astype(np.uint16), tile=(64, 64), photometric='rgb')
        return path, [], ['uint16', '--scale MIN MAX', '--scale-16bit']
    if kind == 'float_without_scale':
        _write(path, img[:, :, :3].astype(np.float32))
        return path, [], ['float32', '--scale MIN MAX']
    if kind == 'one_strip_over_the_budget':  # a 600 x 600 x 3 strip (1 MB): more than 2 MB / 4
        yy, xx = np.mgrid[0:600, 0:600]
        tifffile.imwrite(path, np.repeat((yy + xx).astype(np.uint8)[:, :, None], 3, axis=2),
                         compression='zlib', rowsperstrip=600, photometric='rgb')
        return path, ['--max-memory', '2'], [path, 'gdal_translate -co TILED=YES',
                                             'raise --max-memory']
    if kind == 'vector_of_a_scene_placed_by_gcps':
        from rasterio.control import GroundControlPoint
        gcps = [GroundControlPoint(r, c, 500000 + c, 4100000 - r) for r, c in
                ((0, 0), (0, W), (H, 0), (H, W))]
        _write(path, img[:, :, :3], gcps=gcps, crs='EPSG:32633')
        return path, ['--vector', str(tmp_path / 'labels.gpkg')], [
            'placed by ground control points', 'gdalwarp', 'drop --vector']
    _write(path, img[:, :, :3], crs='EPSG:32633', transform=_affine())
    if kind == 'confidence_is_the_out':
        return path, ['--confidence', str(tmp_path / 'labels.tif')], [
            '--confidence', 'is the path of --out', 'choose another --confidence']
    if kind == 'confidence_is_the_input':
        return path, ['--confidence', path], ['--confidence', 'is a file the input reads']
    if kind == 'confidence_folder_missing':
        return path, ['--confidence', str(tmp_path / 'no' / 'c.tif')], [
            'output folder does not exist', 'another --confidence']
    if kind == 'vector_format_unknown':
        return path, ['--vector', str(tmp_path / 'labels.shp')], [
            'unknown polygon format', '.gpkg, .fgb, .geojson']
    if kind == 'geo_package_missing':  # installed without setup.py's geo extra
        monkeypatch.setitem(sys.modules, 'pyogrio', None)  # its import fails
        return path, ['--vector', str(tmp_path / 'labels.gpkg')], [
            'pyogrio is not installed; pip install xcit_mm[geo]']
    if kind == 'min_area_without_vector':
        return path, ['--min-area', '5'], ['--min-area applies to the polygons', '--vector']
    if kind == 'polygons_fail_last':  # after the rasters got their names: none is left
        from xcit_mm.apis.large_image import polygons

        def fails(*args):
            assert {'labels.tif', 'confidence.tif'} <= set(os.listdir(tmp_path))
            raise RuntimeError('Cannot write feature')
        monkeypatch.setattr(polygons, 'copy_layer', fails)
        return path, ['--confidence', str(tmp_path / 'confidence.tif'), '--vector',
                      str(tmp_path / 'labels.fgb')], ['Cannot write feature']
    if kind == 'output_folder_missing':
        return path, ['--out', str(tmp_path / 'no' / 'labels.tif')], ['output folder does not']
    if kind == 'out_is_the_input':
        return path, ['--out', path], ['is a file the input reads', 'choose another --out']
    if kind == 'out_is_the_input_by_a_link':
        os.symlink(path, tmp_path / 'link.tif')
        return path, ['--out', str(tmp_path / 'link.tif')], ['is a file the input reads']
    if kind == 'out_is_a_vrt_source':
        (tmp_path / 'tiles').mkdir()
        vrt = _vrt(tmp_path / 'tiles', img[:, :, :3])
        monkeypatch.chdir(tmp_path)  # a relative path to one of the mosaic's files
        return vrt, ['--out', osp.join('tiles', '..', 'tiles', 'quarter_100_150.tif')], [
            'is a file the input reads']
    if kind == 'cfg_options_applied':  # --cfg-options reaches the config: a model that can't stream
        return path, ['--cfg-options', 'model.type=EncoderDecoder'], [
            "EncoderDecoder cannot stream", "model.type='LeanEncoderDecoder'"]
    if kind == 'disk_full':  # the disk fills as the label file is written
        from xcit_mm.apis.large_image import writer

        def full(raster, rows, last):
            assert any('.partial' in name for name in os.listdir(tmp_path))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(writer, '_add_rows', full)  # the polygons' file begun too
        return path, ['--confidence', str(tmp_path / 'confidence.tif'), '--vector',
                      str(tmp_path / 'labels.gpkg')], ['no space left', 'labels.tif']
    if kind == 'budget_below_the_reader':
        return path, ['--max-memory', '1'], ['--max-memory 1 MB does not cover the reader and '
                                             'the writers (reader 1, writer 114 MB)', 'raise it']
    if kind == 'budget_below_minimum':  # what the reader and writers leave: the stream's error
        return path, ['--max-memory', '300'], [
            'no way to run within max_memory=', "model's share of --max-memory 300 MB: the "
            'reader and the writers hold reader 64, writer 114 MB']
    if kind == 'interrupted':
        from xcit_mm.apis.large_image import reader

        def interrupt(self, start, stop, bands=None):  # Ctrl-C as the stream reads, output begun
            assert any('.partial' in name for name in os.listdir(tmp_path))
            raise KeyboardInterrupt
        monkeypatch.setattr(reader._Source, 'read_rows', interrupt)
        return path, [], ['interrupted']
    raise AssertionError(kind)


BEFORE_THE_MODEL = ['not_an_image', 'missing', 'broken_header', 'truncated', '1_band', '2_band',
                    '4_band', 'gray_flag_on_4_band', 'band_out_of_range', '16_bit',
                    'float_without_scale', 'one_strip_over_the_budget', 'output_folder_missing',
                    'out_is_the_input', 'out_is_the_input_by_a_link', 'out_is_a_vrt_source',
                    'confidence_is_the_out', 'confidence_is_the_input',
                    'confidence_folder_missing', 'vector_format_unknown',
                    'min_area_without_vector', 'vector_of_a_scene_placed_by_gcps',
                    'geo_package_missing', 'budget_below_the_reader']
DURING_THE_STREAM = ['cfg_options_applied', 'corrupt_tile', 'disk_full', 'budget_below_minimum',
                     'interrupted', 'polygons_fail_last']


@pytest.mark.parametrize('kind', BEFORE_THE_MODEL + DURING_THE_STREAM)
def test_bad_input_is_one_line_and_no_file(tool, tiny, tmp_path, monkeypatch, capsys, kind):
    """One ``error:`` line naming the problem (and the option or step that fixes it), a non-zero
    exit status, no output or partial file, and the input untouched."""
    config, checkpoint, _ = tiny
    image, extra, words = _bad_input(kind, tmp_path, monkeypatch)
    out = str(tmp_path / 'labels.tif')
    before = {name: osp.getsize(osp.join(root, name)) for root, _, names in os.walk(tmp_path)
              for name in names}
    status = tool.main([config, checkpoint, image, '--out', out] + extra)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status != 0 and len(lines) == 1 and lines[0].startswith('error: '), err
    assert 'Traceback' not in err
    for word in words:
        assert word in lines[0], lines[0]
    after = {name: osp.getsize(osp.join(root, name)) for root, _, names in os.walk(tmp_path)
             for name in names}
    assert after == before  # no labels.tif, no labels.tif.partial, the inputs as they were
