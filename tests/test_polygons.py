# Copyright (c) xcit_mm contributors. All rights reserved.
"""xcit_mm.apis.large_image.polygons: label bands polygonised one at a time and merged across
their seams equal GDAL's polygons of the whole raster (``rasterio.features.shapes``), read back
through pyogrio (GDAL's OGR) from GeoPackage, FlatGeobuf and GeoJSON with the scene's CRS and
fields; ``min_area`` and ``simplify`` as documented; the band loop holds bands, never the raster
(tracemalloc); bad input is refused before a file exists."""
import collections
import functools
import os
import tracemalloc

import numpy as np
import pytest

CRS = 'EPSG:32633'
NAMES = [f'class {i}' for i in range(16)]
NODATA = 255
PIXEL_AREA = 100.0  # 10 m pixels


def _transform():
    from rasterio.transform import from_origin
    return from_origin(500000, 4600000, 10, 10)  # UTM 33N, 10 m pixels


@functools.lru_cache(maxsize=None)
def _scene(h: int, w: int):
    """(labels, nodata mask): ten classes of smooth blobs with holes and islands, and shapes
    whose seams matter: a frame (class 10) over most rows with one hole, a U (class 11) whose
    arms meet only at its bottom, a staircase (class 12) of pixels that touch only at corners
    (4-connected: one polygon each), a checkerboard (13, 14) across a seam, a column of nodata
    values and a disc of masked pixels."""
    rng = np.random.default_rng(0)
    y, x = np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32)
    field = sum(np.outer(np.cos(y * fy + py), np.sin(x * fx + px))
                for fx, fy, px, py in rng.uniform([.004, .004, 0, 0], [.04, .04, 6.3, 6.3],
                                                  (6, 4)))
    labels = np.digitize(field, np.quantile(field, np.linspace(0, 1, 11)[1:-1])).astype(np.uint8)
    blobs = labels.copy()
    k = max(2, w // 64)  # stroke width
    top, bottom = h // 16, h - h // 16
    labels[top:bottom, w // 8:w // 4] = 10
    inside = np.s_[top + k:bottom - k, w // 8 + k:w // 4 - k]
    labels[inside] = blobs[inside]
    left = 5 * w // 16
    labels[h // 8:3 * h // 4, left:left + k] = 11
    labels[h // 8:3 * h // 4, left + 3 * k:left + 4 * k] = 11
    labels[3 * h // 4 - k:3 * h // 4, left:left + 4 * k] = 11
    steps = np.arange(min(h, w) // 3)
    labels[h // 10 + steps, w // 2 + steps % (w // 4)] = 12
    checker = (np.add.outer(np.arange(40), np.arange(16)) % 2).astype(np.uint8)
    labels[h // 3 - 20:h // 3 + 20, 3 * w // 4:3 * w // 4 + 16] = 13 + checker
    labels[:, -max(3, w // 50):] = NODATA
    mask = (y[:, None] - 0.7 * h) ** 2 + (x - 0.6 * w) ** 2 < (h / 6) ** 2
    return labels, mask


def _whole(labels, mask):
    """GDAL's polygons of the whole raster in the scene's CRS: (geometries, class ids)."""
    import shapely
    from rasterio.features import shapes
    pairs = list(shapes(labels, mask=~mask & (labels != NODATA), connectivity=4,
                        transform=_transform()))
    return [shapely.geometry.shape(g) for g, _ in pairs], [int(v) for _, v in pairs]


def _write(path, labels, mask, band_rows, **kwargs):
    from xcit_mm.apis.large_image.polygons import PolygonWriter
    with PolygonWriter(str(path), NAMES, crs=CRS, transform=_transform(), nodata=NODATA,
                       **kwargs) as writer:
        for start in range(0, len(labels), band_rows):
            writer.add_band(start, labels[start:start + band_rows],
                            nodata_mask=mask[start:start + band_rows])


def _read(path):
    """(geometries, fields by name) of the file, through pyogrio."""
    import pyogrio.raw
    import shapely
    meta, _, wkb, values = pyogrio.raw.read(str(path))
    return shapely.from_wkb(wkb), dict(zip(meta['fields'], values))


def _by_class(geoms, class_ids):
    out = {}
    for geom, class_id in zip(geoms, class_ids):
        out.setdefault(int(class_id), []).append(geom)
    return out


def _in_order(geoms, class_ids):
    """Polygons and class ids sorted by class, area and bounds, so that equal sets pair up."""
    import shapely
    geoms = np.asarray(geoms, dtype=object)
    bounds = shapely.bounds(geoms)
    order = np.lexsort((*bounds.T[::-1], shapely.area(geoms), class_ids))
    return geoms[order], np.asarray(class_ids)[order]


@pytest.mark.parametrize('hw, band_rows', [((2048, 2048), 333), ((300, 512), 1),
                                           ((300, 512), 7), ((300, 512), 64)])
def test_bands_equal_the_whole_raster(tmp_path, hw, band_rows):
    """The polygons of bands of 1, 7, 64 and 333 rows (none dividing the height) equal the
    whole raster's: the same classes, as many polygons of each (an object across many bands is
    one polygon, pixels meeting only at a corner across a seam are two), per class a
    symmetric-difference area within 1e-6 of the scene's, and the same vertices; all valid; the
    frame keeps its hole; no polygon where there is no data."""
    import shapely
    labels, mask = _scene(*hw)
    _write(tmp_path / 'labels.gpkg', labels, mask, band_rows)
    geoms, fields = _read(tmp_path / 'labels.gpkg')
    assert shapely.is_valid(geoms).all()
    ours, our_ids = _in_order(geoms, fields['class_id'])
    theirs, their_ids = _in_order(*_whole(labels, mask))
    np.testing.assert_array_equal(our_ids, their_ids)  # as many polygons of each class
    # each polygon against its match (the per class sums bound the classes' differences), and
    # vertex for vertex once normalised: no vertex left where a seam crossed a straight edge
    same = shapely.equals_exact(shapely.normalize(ours), shapely.normalize(theirs))
    difference = np.zeros(len(ours))
    difference[~same] = shapely.area(shapely.symmetric_difference(ours[~same], theirs[~same]))
    for class_id in np.unique(their_ids):
        assert difference[their_ids == class_id].sum() <= 1e-6 * labels.size * PIXEL_AREA
    assert same.all()
    (frame,) = ours[our_ids == 10]
    assert len(frame.interiors) == 1
    assert frame.area == np.sum((labels == 10) & ~mask) * PIXEL_AREA


@pytest.mark.parametrize('ext', ['gpkg', 'fgb', 'geojson'])
def test_formats_crs_and_fields(tmp_path, ext):
    """Each format opens in GDAL with the scene's CRS, one Polygon per region, fields class_id,
    class_name (the class's name) and area (the polygon's in square metres; per class the
    pixels' area); only the file is left beside it; an error inside the writer leaves none."""
    import pyogrio
    import shapely
    labels, mask = _scene(60, 80)
    path = tmp_path / f'labels.{ext}'
    _write(path, labels, mask, 16)
    info = pyogrio.read_info(str(path))
    assert info['crs'] == CRS
    assert info['geometry_type'] == 'Polygon'
    assert list(info['fields']) == ['class_id', 'class_name', 'area']
    geoms, fields = _read(path)
    assert len(geoms) == len(_whole(labels, mask)[0])
    assert [NAMES[i] for i in fields['class_id']] == list(fields['class_name'])
    np.testing.assert_allclose(fields['area'], shapely.area(geoms), rtol=1e-12)
    for class_id in np.unique(fields['class_id']):
        assert fields['area'][fields['class_id'] == class_id].sum() == pytest.approx(
            np.sum((labels == class_id) & ~mask) * PIXEL_AREA, rel=1e-12)
    assert os.listdir(tmp_path) == [path.name]

    failed = tmp_path / f'failed.{ext}'
    with pytest.raises(KeyboardInterrupt):
        from xcit_mm.apis.large_image.polygons import PolygonWriter
        with PolygonWriter(str(failed), NAMES, crs=CRS) as writer:
            writer.add_band(0, np.zeros((16, 80), np.uint8))
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == [path.name]


def test_min_area_and_simplify(tmp_path):
    """``min_area`` keeps exactly GDAL's polygons of that area or more; ``simplify`` gives
    valid polygons with fewer vertices: GEOS's simplification, in metres, of each whole polygon
    (not of its pieces in each band), its area field its own area."""
    import shapely
    labels, mask = _scene(300, 512)
    labels = labels.copy()
    rng = np.random.default_rng(1)
    labels[rng.integers(0, 300, 400), rng.integers(0, 400, 400)] = 15  # specks of 1-2 pixels
    min_area = 3 * PIXEL_AREA
    _write(tmp_path / 'kept.gpkg', labels, mask, 40, min_area=min_area)
    geoms, fields = _read(tmp_path / 'kept.gpkg')
    assert shapely.area(geoms).min() >= min_area
    whole, whole_ids = _whole(labels, mask)
    large = shapely.area(whole) >= min_area
    assert (~large).sum() > 400  # the specks and the staircase's pixels
    expected = _by_class([g for g, k in zip(whole, large) if k],
                         [c for c, k in zip(whole_ids, large) if k])
    ours = _by_class(geoms, fields['class_id'])
    assert {c: len(g) for c, g in ours.items()} == {c: len(g) for c, g in expected.items()}

    tolerance = 15.0  # metres: 1.5 pixels
    _write(tmp_path / 'simple.gpkg', labels, mask, 40, min_area=min_area, simplify=tolerance)
    simple, simple_fields = _read(tmp_path / 'simple.gpkg')
    assert len(simple) == len(geoms)
    assert shapely.is_valid(simple).all()
    assert shapely.get_num_coordinates(simple).sum() < 0.8 * shapely.get_num_coordinates(
        geoms).sum()
    expected = shapely.simplify(geoms, tolerance, preserve_topology=True)  # whole polygons
    assert shapely.equals_exact(shapely.normalize(simple), shapely.normalize(expected)).all()
    np.testing.assert_allclose(simple_fields['area'], shapely.area(simple), rtol=1e-12)


def test_band_loop_holds_bands_not_the_raster(tmp_path):
    """A 4096 x 2048 raster of int64 labels (64 MB; as an argmax gives them) that exists only
    as bands of 64 rows made on demand: the traced peak (numpy's arrays and Python's objects,
    tracemalloc; not GDAL's or GEOS's own memory) stays below an eighth of the raster, and the
    polygons cover every pixel."""
    import pyogrio.raw
    import rasterio.crs  # noqa: F401  imported before tracing: their modules are not the loop's
    import rasterio.features  # noqa: F401
    import shapely  # noqa: F401
    from xcit_mm.apis.large_image.polygons import PolygonWriter
    h, w, rows = 4096, 2048, 64

    def band(start):  # blocks 100 columns wide and 300 rows high, across the bands' seams
        yy, xx = np.mgrid[start:start + rows, 0:w]
        return (xx // 100 + yy // 300) % 16

    tracemalloc.start()
    try:
        with PolygonWriter(str(tmp_path / 'labels.fgb'), NAMES) as writer:
            for start in range(0, h, rows):
                writer.add_band(start, band(start))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < h * w * 8 / 8
    _, _, _, (_, _, area) = pyogrio.raw.read(str(tmp_path / 'labels.fgb'), read_geometry=False)
    assert area.sum() == h * w  # pixel units: no CRS


def test_refusals(tmp_path):
    """Bad input is one error naming the problem, and leaves no file."""
    from xcit_mm.apis.large_image.errors import LargeImageError
    from xcit_mm.apis.large_image.polygons import PolygonWriter
    with pytest.raises(LargeImageError, match=r'\.gpkg, \.fgb, \.geojson'):
        PolygonWriter(str(tmp_path / 'labels.shp'), NAMES)
    with pytest.raises(LargeImageError, match='--min-area'):
        PolygonWriter(str(tmp_path / 'labels.gpkg'), NAMES, min_area=-1)
    with pytest.raises(LargeImageError, match='folder does not exist: .*missing; .* --vector'):
        PolygonWriter(str(tmp_path / 'missing' / 'labels.gpkg'), NAMES)
    labels = np.zeros((4, 5), np.uint8)
    with pytest.raises(RuntimeError, match='starting at row 4'):
        with PolygonWriter(str(tmp_path / 'labels.gpkg'), NAMES) as writer:
            writer.add_band(0, labels)
            writer.add_band(5, labels)
    with pytest.raises(ValueError, match='class ids 0 to 16 .* 16 class names'):
        with PolygonWriter(str(tmp_path / 'labels.gpkg'), NAMES) as writer:
            writer.add_band(0, labels + np.arange(5, dtype=np.uint8) * 4)
    with pytest.raises(RuntimeError, match='stopped at row 4 of 9'):
        with PolygonWriter(str(tmp_path / 'labels.gpkg'), NAMES, height=9) as writer:
            writer.add_band(0, labels)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize('ext, failing', [('gpkg', 'write'), ('fgb', 'write_arrow')])
def test_full_disk(tmp_path, monkeypatch, ext, failing):
    """A write that fails on a full disk (GDAL's words vary by driver), as the polygons are
    appended to the GeoPackage or copied to FlatGeobuf, is one error naming it and leaves no
    file; the same failure with space left is GDAL's own error."""
    import pyogrio.errors
    import pyogrio.raw
    from xcit_mm.apis.large_image import polygons
    from xcit_mm.apis.large_image.errors import LargeImageError
    labels, mask = _scene(60, 80)
    write = getattr(pyogrio.raw, failing)

    def fail(*args, append=False, **kwargs):
        if append or failing == 'write_arrow':  # not the GeoPackage's creation
            raise pyogrio.errors.FeatureError('failed to execute insert : database or disk is '
                                              'full')
        return write(*args, append=append, **kwargs)
    monkeypatch.setattr(pyogrio.raw, failing, fail)
    for free, error in [(0, LargeImageError), (10 << 30, pyogrio.errors.FeatureError)]:
        monkeypatch.setattr(polygons.shutil, 'disk_usage',
                            lambda folder: collections.namedtuple('usage', 'free')(free))
        with pytest.raises(error, match='no space left on the device .* database or disk'
                           if free == 0 else '^failed to execute insert'):
            _write(tmp_path / f'labels.{ext}', labels, mask, 16)
        assert os.listdir(tmp_path) == []
