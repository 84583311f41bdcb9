# Copyright (c) xcit_mm contributors. All rights reserved.
"""The label files, written band by band as the stream gives the labels:
``write_label_rasters``, Cloud-Optimized GeoTIFFs of the labels and the confidence, for GDAL and
QGIS."""
import contextlib
import errno
import os
import os.path as osp
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from .errors import LargeImageError, sync_to_disk


def _checked_bands(bands: Iterable[tuple], hw: Tuple[int, int], with_confidence: bool = False
                   ) -> Iterator[Tuple[int, int, np.ndarray, Optional[np.ndarray]]]:
    """``(start, stop, labels, confidence)`` as numpy arrays from the stream's bands, each band
    checked to follow the last one and to have the image's width, so that a caller's mistake is
    an error naming the rows, never a shifted or short label file."""
    height, width = hw
    y = 0  # first image row not yet received
    for band in bands:
        start, stop, labels, *rest = band
        if start != y or not start < stop <= height:
            raise RuntimeError(f'label bands out of order: rows [{start}, {stop}) after row {y}')
        labels = as_numpy(labels)
        if labels.shape != (stop - start, width):
            raise RuntimeError(f'label band [{start}, {stop}) has shape {labels.shape}, '
                               f'expected {(stop - start, width)}')
        confidence = as_numpy(rest[0]) if rest else None
        if with_confidence != (confidence is not None):
            raise RuntimeError(
                f'label band [{start}, {stop}) has {len(band)} items; expected '
                + ('(start, stop, labels, confidence) with a confidence path' if with_confidence
                   else '(start, stop, labels): give a confidence path to write its 4th'))
        if confidence is not None and (confidence.shape != labels.shape
                                       or confidence.dtype != np.uint8):
            raise RuntimeError(f'confidence band [{start}, {stop}) is {confidence.dtype} '
                               f'{confidence.shape}, expected uint8 {labels.shape}')
        y = stop
        yield start, stop, labels, confidence
    if y != height:
        raise RuntimeError(f'the label bands stopped at row {y} of {height}')


def as_numpy(values) -> np.ndarray:
    """A tensor (on any device) or an array-like as a numpy array: the stream's bands are
    tensors, a caller's may be arrays."""
    return values.detach().cpu().numpy() if hasattr(values, 'detach') else np.asarray(values)


@dataclass
class _Raster:
    """One output COG and the files it is made through, all in the output's folder: a tiled
    GeoTIFF written by windows of whole tile rows (``tiles``), then GDAL's COG driver copying
    it into ``partial`` with its overviews (the driver's own ``.ovr.tmp`` files beside it), a
    PAM sidecar for the class names, and the rename of ``partial`` to ``path``."""
    path: str
    dtype: np.dtype
    nodata: int
    resampling: str  # GDAL's overview resampling
    predictor: str  # the COG driver's PREDICTOR
    description: str
    dataset: object = None
    rows: Optional[np.ndarray] = None  # rows of the tile row being filled
    filled: int = 0  # how many of them
    top: int = 0  # image row of rows[0]

    @property
    def partial(self) -> str:
        return self.path + '.partial'

    @property
    def tiles(self) -> str:
        return self.path + '.tiles.partial'

    def temporaries(self) -> List[str]:
        """Every file this raster may leave behind before its rename."""
        partial, tiles = self.partial, self.tiles
        return [tiles, tiles + '.aux.xml', partial + '.ovr.tmp', partial + '.msk.ovr.tmp',
                partial + '.aux.xml', partial]


class _GdalOutput:
    """GDAL's libtiff prints its I/O errors (``_tiffWriteProc: No space left on device.``)
    straight to the process's stderr, outside rasterio's exceptions: the C-level stderr goes to
    a temporary file around each GDAL call, so that a full disk is recognised by its message and
    told in one line, and anything else GDAL prints is passed on (never lost)."""

    def __init__(self):
        self.text = ''

    @contextlib.contextmanager
    def __call__(self):
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile() as capture:
            os.dup2(capture.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                capture.seek(0)
                self.text += capture.read().decode(errors='replace')

    def pass_on(self) -> None:
        if self.text:
            sys.stderr.write(self.text)
            self.text = ''

    def disk_full(self, error: BaseException) -> bool:
        full = os.strerror(errno.ENOSPC)
        return ((isinstance(error, OSError) and error.errno == errno.ENOSPC)
                or full in self.text or full in str(error))


def _open_tiles(raster: _Raster, hw: Tuple[int, int], tile: int, crs, transform, gcps,
                colormap: Optional[dict]) -> None:
    """The tiled GeoTIFF that the bands are written into: the georeferencing given and nothing
    else of the input's (no band metadata, scales, offsets or statistics)."""
    import rasterio
    from affine import Affine
    from rasterio.crs import CRS
    height, width = hw
    profile = dict(driver='GTiff', height=height, width=width, count=1, dtype=raster.dtype.name,
                   nodata=raster.nodata, tiled=True, blockxsize=tile, blockysize=tile,
                   compress='deflate', zlevel=1, bigtiff='IF_SAFER')
    if crs is not None and not gcps:
        profile['crs'] = crs
    if transform is not None and not gcps and (crs is not None or transform != Affine.identity()):
        profile['transform'] = transform
    with warnings.catch_warnings():  # a slide or a photo has no georeferencing: no warning
        warnings.simplefilter('ignore', rasterio.errors.NotGeoreferencedWarning)
        raster.dataset = rasterio.open(raster.tiles, 'w', **profile)
    if gcps:  # GCPs may come without a CRS (pixels to an unnamed grid)
        raster.dataset.gcps = (list(gcps), crs if crs is not None else CRS())
    raster.dataset.set_band_description(1, raster.description)
    if colormap:
        raster.dataset.write_colormap(1, colormap)
    raster.rows = np.empty((tile, width), raster.dtype)


def _add_rows(raster: _Raster, rows: np.ndarray, last: bool) -> None:
    """Rows into the tile row being filled; each whole tile row (and the last, short one) is
    written as one window, so that GDAL writes each tile once and whole."""
    from rasterio.windows import Window
    tile, width = raster.rows.shape
    while len(rows) or (last and raster.filled):
        n = min(tile - raster.filled, len(rows))
        raster.rows[raster.filled:raster.filled + n] = rows[:n]
        raster.filled += n
        rows = rows[n:]
        if raster.filled == tile or (last and not len(rows)):
            raster.dataset.write(raster.rows[None, :raster.filled],
                                 window=Window(0, raster.top, width, raster.filled))
            raster.top += raster.filled
            raster.filled = 0


def _to_cog(raster: _Raster, tile: int) -> None:
    """GDAL's COG driver: the tiles copied with internal overviews (halving until one tile
    holds the image) after the full-resolution image, in the COG layout."""
    import rasterio.shutil
    rasterio.shutil.copy(raster.tiles, raster.partial, driver='COG', BLOCKSIZE=tile,
                         COMPRESS='DEFLATE', PREDICTOR=raster.predictor, BIGTIFF='IF_SAFER',
                         OVERVIEWS='AUTO', OVERVIEW_RESAMPLING=raster.resampling)
    os.remove(raster.tiles)


def _class_sidecar(path: str, class_names: Sequence[str], palette) -> None:
    """GDAL's PAM sidecar (``path + '.aux.xml'``) naming the classes for GDAL and QGIS: the
    band's category names, and a thematic raster attribute table (value, name, colour) that
    QGIS (3.30 and later) turns into a paletted renderer with the class names as its legend."""
    import xml.etree.ElementTree as ET
    root = ET.Element('PAMDataset')
    band = ET.SubElement(root, 'PAMRasterBand', band='1')
    categories = ET.SubElement(band, 'CategoryNames')
    for name in class_names:
        ET.SubElement(categories, 'Category').text = str(name)
    table = ET.SubElement(band, 'GDALRasterAttributeTable', tableType='thematic')
    # GDAL's field types (0 integer, 2 string) and usages (5 MinMax, 2 Name, 6-9 Red-Alpha)
    fields = [('Value', 0, 5), ('Class_Name', 2, 2)]
    if palette is not None:
        fields += [('Red', 0, 6), ('Green', 0, 7), ('Blue', 0, 8), ('Alpha', 0, 9)]
    for index, (name, kind, usage) in enumerate(fields):
        field = ET.SubElement(table, 'FieldDefn', index=str(index))
        ET.SubElement(field, 'Name').text = name
        ET.SubElement(field, 'Type').text = str(kind)
        ET.SubElement(field, 'Usage').text = str(usage)
    for value, name in enumerate(class_names):
        row = ET.SubElement(table, 'Row', index=str(value))
        cells = [value, name]
        if palette is not None:
            cells += [*(int(c) for c in palette[value][:3]), 255]
        for cell in cells:
            ET.SubElement(row, 'F').text = str(cell)
    ET.ElementTree(root).write(path, encoding='UTF-8', xml_declaration=False)


def write_label_rasters(out: str, bands: Iterable[tuple], hw: Tuple[int, int], num_classes: int,
                        *, palette=None, class_names: Optional[Sequence[str]] = None,
                        crs=None, transform=None, gcps: Sequence = (),
                        nodata_mask: Optional[Callable[[int, int], np.ndarray]] = None,
                        confidence_out: Optional[str] = None, tile: int = 512,
                        cache_mb: int = 16, on_rows: Optional[Callable[[int], None]] = None
                        ) -> None:
    """Label bands ``(start, stop, labels)``, top to bottom, into ``out`` as a Cloud-Optimized
    GeoTIFF that GDAL and QGIS open as a class map; with ``confidence_out``, the bands are
    ``(start, stop, labels, confidence)`` and the confidence (uint8) goes to a second COG.

    Labels are uint8 up to 255 classes and uint16 above, the type's largest value being nodata
    where ``nodata_mask(start, stop)`` is True; the palette is the colour table and
    ``class_names`` (one per class) go to a PAM sidecar ``out + '.aux.xml'``. The confidence's
    nodata is 0 (a valid 0, a top-1 probability below 1/510, is written as 1). Both files carry
    the georeferencing given (``crs`` with ``transform``, or ``gcps``) and nothing else of the
    input's, e.g. no band scale, offset, names or statistics.

    The overviews are made by mode for the labels (each coarser pixel the most frequent class
    of the pixels it covers, nodata left out: thin classes stay visible when zoomed out, where
    nearest would keep one pixel of each block) and by average for the confidence. Memory stays
    bounded: one tile row per raster here, and GDAL's block cache at ``cache_mb`` MB while it
    writes and makes the overviews. Every file is written under a ``.partial`` name in the
    output's folder, fsync'd, then renamed (the labels last), so that an error, Ctrl-C or a
    full disk leaves no file behind."""
    import rasterio
    if num_classes > 65535:
        raise LargeImageError(f'{num_classes} classes do not fit a 16-bit label file')
    if tile < 128 or tile % 16:
        raise ValueError(f'tile {tile}: GDAL\'s COG tiles are a multiple of 16, at least 128')
    if class_names is not None and len(class_names) != num_classes:
        raise ValueError(f'{len(class_names)} class names for {num_classes} classes')
    if palette is not None and len(palette) < num_classes:
        raise ValueError(f'a palette of {len(palette)} colours for {num_classes} classes')
    if confidence_out is not None and osp.abspath(confidence_out) == osp.abspath(out):
        raise LargeImageError(f'the confidence and the labels would both be {out}; give the '
                              'confidence another path')
    dtype = np.dtype(np.uint8 if num_classes <= 255 else np.uint16)  # 255 stays free for nodata
    labels = _Raster(out, dtype, int(np.iinfo(dtype).max), 'MODE', 'NO', 'class')
    confidence = None if confidence_out is None else _Raster(
        confidence_out, np.dtype(np.uint8), 0, 'AVERAGE', 'STANDARD', 'confidence')
    rasters = [r for r in (confidence, labels) if r is not None]  # the labels renamed last
    colormap = None
    if palette is not None:
        colormap = {i: tuple(int(c) for c in rgb[:3]) + (255,)
                    for i, rgb in enumerate(palette[:num_classes])}
    gdal = _GdalOutput()
    done, renamed = False, []
    try:
        with rasterio.Env(GDAL_CACHEMAX=cache_mb * 2**20):  # bytes, as rasterio passes it on
            with gdal():
                for raster in rasters:
                    _open_tiles(raster, hw, tile, crs, transform, gcps,
                                colormap if raster is labels else None)
            for start, stop, rows, probability in _checked_bands(bands, hw, confidence is not None):
                rows = rows.astype(dtype)
                invalid = None if nodata_mask is None else nodata_mask(start, stop)
                if invalid is not None:
                    rows[invalid] = labels.nodata
                last = stop == hw[0]
                with gdal():
                    _add_rows(labels, rows, last)
                    if confidence is not None:
                        probability = np.maximum(probability, 1)
                        if invalid is not None:
                            probability[invalid] = confidence.nodata
                        _add_rows(confidence, probability, last)
                if on_rows is not None:
                    on_rows(stop)
            with gdal():
                for raster in rasters:
                    raster.dataset.close()
                    raster.rows = None  # the tile row's memory back before the COG copy
                for raster in rasters:
                    _to_cog(raster, tile)
        for raster in rasters:
            sidecar = raster.partial + '.aux.xml'
            if raster is labels and class_names is not None:
                _class_sidecar(sidecar, class_names, palette)
            for path in (raster.partial, sidecar):
                if osp.exists(path):
                    sync_to_disk(path)
        for raster in rasters:
            sidecar = raster.partial + '.aux.xml'
            if osp.exists(sidecar):
                os.replace(sidecar, raster.path + '.aux.xml')
                renamed.append(raster.path + '.aux.xml')
            elif osp.exists(raster.path + '.aux.xml'):  # the sidecar of the file replaced
                os.remove(raster.path + '.aux.xml')
            os.replace(raster.partial, raster.path)
            renamed.append(raster.path)
        sync_to_disk(osp.dirname(osp.abspath(out)))
        done = True
        gdal.pass_on()
    except Exception as e:  # GDAL's errors through rasterio are of many classes
        if gdal.disk_full(e):
            paths = ' and '.join(r.path for r in rasters[::-1])
            raise LargeImageError(f'no space left on the device while writing {paths}; free '
                                  'space there or choose another --out') from None
        gdal.pass_on()
        raise
    finally:
        for raster in rasters:
            if raster.dataset is not None and not raster.dataset.closed:
                with contextlib.suppress(Exception), gdal():  # the error is on its way
                    raster.dataset.close()
        if hasattr(bands, 'close'):  # an unfinished engine generator cleans up now, not at GC
            bands.close()
        if not done:  # what a failed run made, renamed or not
            for path in renamed + [p for r in rasters for p in r.temporaries()]:
                if osp.lexists(path):
                    os.remove(path)
