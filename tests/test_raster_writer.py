# Copyright (c) xcit_mm contributors. All rights reserved.
"""xcit_mm.apis.large_image.write_label_rasters: the labels (and the confidence) written band by
band as Cloud-Optimized GeoTIFFs, checked by what GDAL reads back (rasterio, GDAL's VRT copy,
rio-cogeo's validator): every pixel up to the edges of sizes that are not whole tiles, overviews
by mode (classes) and average (confidence), the palette and class names, the input's
georeferencing and none of its band metadata, and no file left after any failure."""
import os
import re
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch

TILE = 256


def _labels(h, w, num_classes, seed=1):
    return np.random.RandomState(seed).randint(0, num_classes, (h, w))


def _bands(labels, band, confidence=None):
    """The stream's bands: ``(start, stop, labels)`` top to bottom, as torch tensors (as the
    engine gives them), with the confidence as a 4th item when given."""
    for y in range(0, len(labels), band):
        rows = (y, min(y + band, len(labels)), torch.from_numpy(labels[y:y + band]))
        yield rows if confidence is None else rows + (torch.from_numpy(confidence[y:y + band]),)


def _input(path, h, w, **options):
    """A reflectance-like input written by GDAL: 3 bands of uint16 with scale 1e-4, offset -0.1,
    band names, statistics and dataset metadata (as Sentinel-2 L2A and Landsat products carry),
    UTM 33N at 0.5 m."""
    import rasterio
    from affine import Affine
    profile = dict(driver='GTiff', height=h, width=w, count=3, dtype='uint16', nodata=0,
                   crs='EPSG:32633', transform=Affine(0.5, 0.0, 500000.0, 0.0, -0.5, 4100000.0))
    profile.update(options)
    with rasterio.open(path, 'w', **profile) as dst:
        dst.write(np.full((3, h, w), 1000, np.uint16))
        dst.scales, dst.offsets = (1e-4,) * 3, (-0.1,) * 3
        dst.descriptions = ('Red', 'Green', 'Blue')
        dst.update_tags(PROCESSING_LEVEL='Level-2A', SPACECRAFT='Sentinel-2B')
        for band in (1, 2, 3):
            dst.update_tags(band, STATISTICS_MEAN='1000', STATISTICS_MAXIMUM='1000',
                            STATISTICS_MINIMUM='1000', STATISTICS_STDDEV='0', WAVELENGTH='665')
    return str(path)


def _georeferencing(path):
    """What the reader hands the writer: rasterio's CRS (of the transform, or of the GCPs),
    transform and GCPs of the input."""
    import rasterio
    with rasterio.open(path) as src:
        gcps, gcps_crs = src.gcps
        return dict(crs=src.crs or gcps_crs, transform=src.transform, gcps=gcps)


@pytest.mark.parametrize('num_classes,band,hw', [(150, 37, (530, 300)), (300, 256, (257, 513)),
                                                 (7, 1, (40, 20))])
def test_labels_are_a_cog_exact_to_every_edge(tmp_path, capfd, num_classes, band, hw):
    """Bands of any height, out of step with the tiles, at sizes that are not whole tiles: a
    valid COG (tiled, deflate without predictor, overviews) whose every pixel, those of the
    edge tiles included, is the label given (nodata where the mask says), uint8 up to 255
    classes and uint16 above, with the palette as its colour table and the input's place; the
    confidence, when asked for, the same way on the same grid (nodata 0). Nothing on stderr."""
    import rasterio
    from rio_cogeo.cogeo import cog_validate

    from xcit_mm.apis.large_image import write_label_rasters
    h, w = hw
    labels = _labels(h, w, num_classes)
    confidence = np.random.RandomState(3).randint(0, 256, (h, w)).astype(np.uint8)
    palette = np.random.RandomState(2).randint(0, 256, (num_classes, 3)).tolist()
    mask = np.zeros((h, w), bool)
    mask[h // 3:h // 2, w - 3:] = True  # reaching the right edge
    mask[-1, :5] = True  # and the last row
    scene = _input(tmp_path / 'scene.tif', h, w)
    out, confidence_out = str(tmp_path / 'labels.tif'), str(tmp_path / 'confidence.tif')
    with_confidence = num_classes == 150
    seen = []
    write_label_rasters(out, _bands(labels, band, confidence if with_confidence else None),
                        hw, num_classes, palette=palette, nodata_mask=lambda a, b: mask[a:b],
                        confidence_out=confidence_out if with_confidence else None, tile=TILE,
                        on_rows=seen.append, **_georeferencing(scene))
    assert seen == list(range(band, h, band)) + [h]
    assert capfd.readouterr().err == ''  # GDAL had nothing to say
    assert sorted(os.listdir(tmp_path)) == sorted(
        ['scene.tif', 'labels.tif'] + ['confidence.tif'] * with_confidence)
    dtype = np.uint8 if num_classes <= 255 else np.uint16
    expected = labels.astype(dtype)
    expected[mask] = np.iinfo(dtype).max
    expected_confidence = np.maximum(confidence, 1)  # 0 is nodata
    expected_confidence[mask] = 0
    for path, values, nodata in [(out, expected, np.iinfo(dtype).max)] + [
            (confidence_out, expected_confidence, 0)] * with_confidence:
        assert cog_validate(path, strict=True)[0], cog_validate(path)
        with rasterio.open(path) as dst, rasterio.open(scene) as src:
            assert (dst.crs, dst.transform, dst.shape) == (src.crs, src.transform, src.shape)
            assert dst.dtypes[0] == values.dtype.name and dst.nodata == nodata
            assert dst.block_shapes == [(TILE, TILE)] and dst.compression.name == 'deflate'
            factors, factor = [], 2  # GDAL's COG: halved until the image fits one tile
            while max(h, w) // (factor // 2) > TILE:
                factors, factor = factors + [factor], factor * 2
            assert dst.overviews(1) == factors
            np.testing.assert_array_equal(dst.read(1), values, err_msg=path)
            if path == out:
                assert 'PREDICTOR' not in dst.tags(ns='IMAGE_STRUCTURE')
                assert dst.colorinterp[0].name == 'palette'
                colormap = dst.colormap(1)
                assert [colormap[i][:3] for i in range(num_classes)] == [
                    tuple(rgb) for rgb in palette]


def _majority_blocks(block_classes, minority, rng):
    """2 x 2 blocks of pixels, 3 of the block's class and 1 of ``minority`` at a random corner,
    so that mode and nearest decimation give different overviews."""
    h, w = block_classes.shape
    pixels = np.repeat(np.repeat(block_classes, 2, axis=0), 2, axis=1)
    corner = rng.randint(0, 4, (h, w))
    ys, xs = np.mgrid[0:h, 0:w]
    pixels[2 * ys + corner // 2, 2 * xs + corner % 2] = minority
    return pixels


def test_overviews_by_mode_and_by_average(tmp_path):
    """The labels' first overview holds each 2 x 2 block's most frequent class (nodata where
    the block is all nodata), the confidence's the mean of its valid pixels: what GDAL gives
    a viewer zoomed out."""
    import rasterio

    from xcit_mm.apis.large_image import write_label_rasters
    rng = np.random.RandomState(0)
    tile, h, w = 128, 256, 200
    block_classes = rng.randint(0, 5, (h // 2, w // 2))
    labels = _majority_blocks(block_classes, 6, rng)
    mask = np.zeros((h, w), bool)
    mask[:8, :8] = True  # 4 x 4 blocks of nodata
    confidence = (np.repeat(np.repeat(rng.randint(1, 60, (h // 2, w // 2)), 2, 0), 2, 1) * 4
                  + np.tile([[0, 1], [2, 3]], (h // 2, w // 2)) * 2).astype(np.uint8)
    out, confidence_out = str(tmp_path / 'labels.tif'), str(tmp_path / 'confidence.tif')
    write_label_rasters(out, _bands(labels, 17, confidence), (h, w), 7,
                        nodata_mask=lambda a, b: mask[a:b], confidence_out=confidence_out,
                        tile=tile)
    expected = block_classes.astype(np.uint8)
    expected[:4, :4] = 255
    blocks = confidence.reshape(h // 2, 2, w // 2, 2).transpose(0, 2, 1, 3).reshape(h // 2,
                                                                                    w // 2, 4)
    expected_mean = blocks.mean(axis=2).astype(np.uint8)  # each block's values mean to a whole
    expected_mean[:4, :4] = 0
    for path, values in ((out, expected), (confidence_out, expected_mean)):
        with rasterio.open(path) as dst:
            assert dst.overviews(1) == [2]
        with rasterio.open(path, overview_level=0) as overview:
            np.testing.assert_array_equal(overview.read(1), values, err_msg=path)


def _gdal_class_names(path, tmp_path):
    """The category names and raster attribute table rows as GDAL reads them: GDAL's VRT copy of
    the file states both in its XML."""
    import rasterio.shutil
    vrt = str(tmp_path / 'gdal_view.vrt')
    rasterio.shutil.copy(path, vrt, driver='VRT')
    band = ET.parse(vrt).getroot().find('VRTRasterBand')
    os.remove(vrt)
    names = [c.text for c in band.iter('Category')]
    table = band.find('GDALRasterAttributeTable')
    if table is None:
        return names, None
    columns = [f.findtext('Name') for f in table.iter('FieldDefn')]
    # GDAL's field usages (GFU_*), by which QGIS finds the value, name and colour columns
    usages = {f.findtext('Name'): int(f.findtext('Usage')) for f in table.iter('FieldDefn')}
    assert usages == dict(Value=5, Class_Name=2, Red=6, Green=7, Blue=8, Alpha=9)
    rows = [dict(zip(columns, (f.text for f in row.iter('F')))) for row in table.iter('Row')]
    return names, rows


def test_class_names_that_gdal_reads(tmp_path):
    """The class names reach GDAL (and QGIS) as the band's category names and as a thematic
    raster attribute table with each class's value, name and colour; a run without names
    removes the sidecar of the file it replaces, whose names would no longer be its own."""
    from xcit_mm.apis.large_image import write_label_rasters
    names = ['water', 'road & rail', 'forêt', 'bare <soil>']
    palette = [[0, 0, 255], [128, 128, 128], [0, 100, 0], [200, 180, 120]]
    labels = _labels(30, 20, 4)
    out = str(tmp_path / 'labels.tif')
    write_label_rasters(out, _bands(labels, 8), (30, 20), 4, palette=palette,
                        class_names=names, tile=128)
    assert sorted(os.listdir(tmp_path)) == ['labels.tif', 'labels.tif.aux.xml']
    categories, table = _gdal_class_names(out, tmp_path)
    assert categories == names
    assert table == [dict(Value=str(i), Class_Name=name, Red=str(r), Green=str(g), Blue=str(b),
                          Alpha='255') for i, (name, (r, g, b)) in enumerate(zip(names, palette))]
    write_label_rasters(out, _bands(labels, 8), (30, 20), 4, palette=palette, tile=128)
    assert os.listdir(tmp_path) == ['labels.tif']
    assert _gdal_class_names(out, tmp_path) == ([], None)


@pytest.mark.parametrize('options,words', [
    (dict(class_names=['a', 'b']), '2 class names for 4 classes'),
    (dict(palette=[[0, 0, 0]] * 3), 'a palette of 3 colours for 4 classes'),
    (dict(tile=100), "tile 100: GDAL's COG tiles are a multiple of 16, at least 128"),
    (dict(confidence_out='{out}'), 'the confidence and the labels would both be {out}'),
])
def test_arguments_that_cannot_make_the_files_are_refused(tmp_path, options, words):
    """Class names or colours that do not match the classes, tiles GDAL's COG driver does not
    take, or one path for both files: an error before any file is made."""
    from xcit_mm.apis.large_image import write_label_rasters
    out = str(tmp_path / 'labels.tif')
    options = {k: v.format(out=out) if isinstance(v, str) else v for k, v in options.items()}
    with pytest.raises(ValueError, match=re.escape(words.format(out=out))):
        write_label_rasters(out, _bands(_labels(30, 20, 4), 8), (30, 20), 4, **options)
    assert os.listdir(tmp_path) == []


def test_only_the_georeferencing_of_the_input(tmp_path):
    """Bug 1: a reflectance input's band scale, offset, names, statistics and metadata stay
    out of the labels and the confidence (QGIS would show class 3 as -0.0997); its CRS and
    transform, or its ground control points, are what GDAL reads from both."""
    import rasterio
    from rasterio.control import GroundControlPoint

    from xcit_mm.apis.large_image import write_label_rasters
    h, w = 40, 30
    labels = _labels(h, w, 7)
    confidence = np.full((h, w), 200, np.uint8)
    gcps = [GroundControlPoint(0, 0, 500000.0, 4100000.0, 0.0),
            GroundControlPoint(0, w, 500015.0, 4100000.0, 0.0),
            GroundControlPoint(h, 0, 500000.0, 4099980.0, 0.0)]
    for kind in ('transform', 'gcps'):
        scene = _input(tmp_path / f'{kind}.tif', h, w,
                       **(dict(transform=None, gcps=gcps) if kind == 'gcps' else {}))
        out, confidence_out = str(tmp_path / f'l_{kind}.tif'), str(tmp_path / f'c_{kind}.tif')
        write_label_rasters(out, _bands(labels, 16, confidence), (h, w), 7,
                            confidence_out=confidence_out, tile=128, **_georeferencing(scene))
        with rasterio.open(scene) as src:
            assert src.scales[0] == 1e-4 and src.descriptions[0] == 'Red'  # the input has them
            for path, description in ((out, 'class'), (confidence_out, 'confidence')):
                with rasterio.open(path) as dst:
                    assert _place(dst) == _place(src)
                    assert (dst.scales, dst.offsets) == ((1.0,), (0.0,))
                    assert dst.descriptions == (description,)
                    assert dst.tags(1) == {}
                    assert dst.tags() == {'AREA_OR_POINT': 'Area'}  # GDAL's own default


def _place(dataset):
    """Where GDAL puts a dataset: its CRS, transform, and GCPs (as tuples: rasterio's GCPs
    compare by identity) with their CRS."""
    gcps, gcps_crs = dataset.gcps
    return (dataset.crs, dataset.transform, gcps_crs,
            [(p.row, p.col, p.x, p.y, p.z) for p in gcps])


def _full_disk(path):
    """``path`` a link to /dev/full, where every write fails with ENOSPC, as on a full disk."""
    os.symlink('/dev/full', path)


@pytest.mark.parametrize('kind,error,words', [
    ('skip', RuntimeError, r'out of order: rows \[12, 40\) after row 10'),
    ('repeat', RuntimeError, r'out of order: rows \[5, 40\) after row 10'),
    ('past_the_end', RuntimeError, r'out of order: rows \[40, 45\) after row 40'),
    ('empty', RuntimeError, r'out of order: rows \[16, 10\) after row 16'),
    ('short', RuntimeError, 'stopped at row 10 of 40'),
    ('wrong_height', RuntimeError, r'band \[0, 10\) has shape \(9, 30\), expected \(10, 30\)'),
    ('no_confidence', RuntimeError, r'label band \[0, 10\) has 3 items; expected \(start, stop, '
     r'labels, confidence\)'),
    ('float_confidence', RuntimeError, r'confidence band \[0, 10\) is float32 \(10, 30\), '
     r'expected uint8 \(10, 30\)'),
    ('model_fails', RuntimeError, 'the model failed'),
    ('interrupted', KeyboardInterrupt, ''),
    ('disk_full_tiles', ValueError, 'no space left on the device while writing {out} and {conf}'),
    ('disk_full_cog', ValueError, 'no space left on the device while writing {out} and {conf}'),
])
def test_a_failure_leaves_no_file(tmp_path, capfd, kind, error, words):
    """Bands that skip, repeat, pass or stop short of the image's rows or have the wrong shape
    are an error naming the rows; those, a model failing mid-way, Ctrl-C and a full disk (one
    line naming the files, nothing else on stderr) leave no file, partial or temporary."""
    from xcit_mm.apis.large_image import LargeImageError, write_label_rasters
    labels = np.ones((50, 30), np.int64)
    confidence = np.full((50, 30), 9, np.uint8)
    out, conf = str(tmp_path / 'labels.tif'), str(tmp_path / 'confidence.tif')
    spans = {'skip': [(0, 10), (12, 40)], 'repeat': [(0, 10), (5, 40)],
             'past_the_end': [(0, 40), (40, 45)], 'empty': [(0, 16), (16, 10)],
             'short': [(0, 10)], 'wrong_height': [(0, 10, 9)]}.get(kind, [(0, 10), (10, 40)])

    def stream():
        for start, stop, *height in spans:
            rows = labels[start:start + (height[0] if height else stop - start)]
            if kind == 'model_fails' and start:
                raise RuntimeError('the model failed')
            if kind == 'interrupted' and start:
                raise KeyboardInterrupt
            if kind == 'no_confidence':
                yield start, stop, rows
            else:
                yield start, stop, rows, (confidence[start:stop].astype(np.float32)
                                          if kind == 'float_confidence' else confidence[start:stop])

    if kind == 'disk_full_tiles':
        _full_disk(out + '.tiles.partial')
    if kind == 'disk_full_cog':
        _full_disk(out + '.partial')
    with pytest.raises(error, match=re.escape(words.format(out=out, conf=conf))
                       if kind.startswith('disk') else words) as raised:
        write_label_rasters(out, stream(), (40, 30), 7, confidence_out=conf, tile=128)
    assert os.listdir(tmp_path) == []
    if kind.startswith('disk'):
        assert isinstance(raised.value, LargeImageError) and '\n' not in str(raised.value)
        assert capfd.readouterr().err == ''  # GDAL's own lines held back
