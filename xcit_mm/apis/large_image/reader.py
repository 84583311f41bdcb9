# Copyright (c) xcit_mm contributors. All rights reserved.
"""Windows of rows of a large image, as the model reads them. ``tifffile`` is imported inside
the functions, not by ``import xcit_mm``."""
import contextlib
import functools
import math
import os.path as osp
from typing import Callable, List, Optional

import numpy as np

from .errors import LargeImageError

# GeoTIFF and GDAL tags that place a raster on the ground; copied from the input to the labels
# (a label pixel covers the input pixel of the same row and column).
GEO_TAGS = {33550: 'ModelPixelScale', 33922: 'ModelTiepoint', 34264: 'ModelTransformation',
            34735: 'GeoKeyDirectory', 34736: 'GeoDoubleParams', 34737: 'GeoAsciiParams',
            42112: 'GDAL_METADATA'}
GDAL_NODATA = 42113
_TIFF_MAGIC = (b'II*\x00', b'MM\x00*', b'II+\x00', b'MM\x00+')


class _Source(contextlib.AbstractContextManager):
    """Rows of an image, bands in R, G, B(, ...) order: ``height``, ``width``, ``bands``,
    ``dtype``; subclasses read a checked window in ``_read``."""

    geotags: List[tuple] = []
    nodata: Optional[float] = None

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start < stop <= self.height:
            raise ValueError(f'rows [{start}, {stop}) are not inside the image\'s '
                             f'{self.height} rows')
        return self._read(start, stop)

    def close(self) -> None:
        pass

    def __exit__(self, *exc):
        self.close()


class _ArraySource(_Source):
    """A file mmcv reads (PNG, JPEG, ...), held whole, its bands turned to RGB order."""

    def __init__(self, path: str):
        import mmcv
        img = mmcv.imread(path, flag='unchanged')
        if img is None:
            raise LargeImageError(f'not an image: {path} (neither a TIFF nor a format '
                                  'mmcv / OpenCV reads)')
        if img.ndim == 3 and img.shape[2] == 3 and img.dtype == np.uint8:
            img = mmcv.imread(path, flag='color')  # as mmseg's LoadImageFromFile: EXIF rotation
        if img.ndim == 2:
            img = img[:, :, None]
        if img.shape[2] >= 3:  # OpenCV's BGR(A) to R, G, B(, A)
            img = np.concatenate([img[:, :, 2::-1], img[:, :, 3:]], axis=2)
        self.img = np.ascontiguousarray(img)
        self.height, self.width, self.bands = img.shape
        self.dtype = img.dtype

    def _read(self, start: int, stop: int) -> np.ndarray:
        return self.img[start:stop]


class _TiffSource(_Source):
    """A TIFF read by windows of rows, decoding only the tiles (or strips) a window touches; the
    last decoded tile rows are kept, since consecutive bands with their halos share them."""

    def __init__(self, path: str):
        import tifffile
        self.path = path
        self.tif = None
        try:
            self.tif = tifffile.TiffFile(path)
            self.pages = self._image_pages(self.tif.series[0])
        except Exception as e:  # tifffile's many ways of meeting a broken header
            self.close()
            if isinstance(e, LargeImageError):
                raise
            raise LargeImageError(f'corrupt or truncated TIFF: {path} ({e})') from None
        page = self.pages[0]
        self.height, self.width = int(page.imagelength), int(page.imagewidth)
        self.dtype = np.dtype(page.dtype)
        self.bands = sum(int(p.samplesperpixel) for p in self.pages)
        self.geotags = [(tag.code, tag.dtype, tag.count, tag.value, True)
                        for tag in map(page.tags.get, GEO_TAGS) if tag]
        nodata = page.tags.valueof(GDAL_NODATA)
        if nodata is not None:
            try:
                self.nodata = float(str(nodata).strip().strip('\x00'))
            except ValueError:
                raise LargeImageError(f'{path}: GDAL_NODATA tag {nodata!r} is not a '
                                      'number') from None
        self._tile_row = functools.lru_cache(maxsize=4 * len(self.pages))(self._decode_tile_row)

    def _image_pages(self, series) -> list:
        """The pages of level 0 of the first image: one page, or one per channel (OME-TIFF's C
        axis); layouts read wrongly or truncated files are refused."""
        from tifffile import PHOTOMETRIC
        pages = [page.aspage() for page in series.pages]
        axes = ''.join(a for a, n in zip(series.axes, series.shape) if n > 1 or a in 'YX')
        if axes in ('YX', 'YXS', 'SYX') and pages:
            pages = pages[:1]
        elif not (axes == 'CYX' and len(pages) == series.shape[series.axes.index('C')]):
            raise LargeImageError(
                f'{self.path}: image axes {series.axes} {tuple(series.shape)}: this tool reads '
                'one 2-D image (Y, X and samples or channels); extract it first, e.g. '
                'tifffile.imwrite of one plane')
        for page in pages:
            if page.imagedepth > 1:
                raise LargeImageError(f'{self.path}: a volumetric (3-D tiled) TIFF; extract one '
                                      'plane first')
            photometric = page.photometric
            if photometric in (PHOTOMETRIC.PALETTE, PHOTOMETRIC.MINISWHITE,
                               PHOTOMETRIC.SEPARATED):
                raise LargeImageError(
                    f'{self.path}: photometric {photometric.name} (palette, inverted grey or '
                    'CMYK) is not read; convert it to RGB first, e.g. gdal_translate -expand '
                    'rgb for a palette')
            if (photometric == PHOTOMETRIC.YCBCR and page.compression != 7
                    and tuple(page.subsampling or (1, 1)) != (1, 1)):
                raise LargeImageError(f'{self.path}: subsampled YCbCr without JPEG is not read; '
                                      'convert it to RGB first')
            size = self.tif.filehandle.size
            for i, (offset, count) in enumerate(zip(page.dataoffsets, page.databytecounts)):
                if count and offset + count > size:
                    raise LargeImageError(
                        f'truncated TIFF: {self.path}: {"tile" if page.is_tiled else "strip"} '
                        f'{i} ends at byte {offset + count}, the file has {size} bytes; copy or '
                        'download it again')
        return pages

    def _decode_tile_row(self, p: int, ty: int) -> np.ndarray:
        """Rows of segment row ``ty`` of page ``p``, all columns and samples."""
        page = self.pages[p]
        rows = page.chunks[0]  # of a tile or a strip
        planes = int(page.samplesperpixel) if page.planarconfig == 2 else 1
        # segments are stored plane by plane, each plane row by row
        wanted = np.arange(len(page.dataoffsets)).reshape(planes, -(-self.height // rows), -1)
        wanted = wanted[:, ty].ravel().tolist()
        out = np.zeros((min(rows, self.height - ty * rows), self.width, page.samplesperpixel),
                       self.dtype)
        for data, index in self.tif.filehandle.read_segments(
                [page.dataoffsets[i] for i in wanted], [page.databytecounts[i] for i in wanted],
                wanted, sort=False):
            if data is None:  # a sparse file's empty tile: GDAL reads it as zeros
                continue
            try:
                segment, (plane, _, _, x, _), _ = page.decode(data, index,
                                                              jpegtables=page.jpegtables)
            except Exception as e:
                kind = 'tile' if page.is_tiled else 'strip'
                raise LargeImageError(f'corrupt TIFF: {self.path}: {kind} {index} does not '
                                      f'decode ({type(e).__name__}: {e})') from None
            # (rows, columns, samples) inside the image; a planar page's segment holds the one
            # sample of its plane, else all of them
            segment = segment[0, :len(out), :self.width - x]
            out[:, x:x + segment.shape[1], plane:plane + segment.shape[2]] = segment
        return out

    def _read(self, start: int, stop: int) -> np.ndarray:
        parts = []
        for p, page in enumerate(self.pages):
            th = page.chunks[0]
            bands = [self._tile_row(p, ty)[max(start - ty * th, 0):stop - ty * th]
                     for ty in range(start // th, (stop - 1) // th + 1)]
            parts.append(np.concatenate(bands, axis=0) if len(bands) > 1 else bands[0])
        return np.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]

    def close(self) -> None:
        if self.tif is not None:
            self.tif.close()
            self.tif = None


def open_image(path: str) -> _Source:
    """Windows of rows of the image at ``path``: a TIFF by tiles or strips, any other file
    whole through ``mmcv.imread``."""
    if not osp.isfile(path):
        raise LargeImageError(f'image not found: {path}')
    with open(path, 'rb') as f:
        tiff = f.read(4) in _TIFF_MAGIC
    return _TiffSource(path) if tiff else _ArraySource(path)


def model_rows(source: _Source, channels: int = 3, rgb_from: Optional[str] = None,
               scale_16bit: Optional[float] = None) -> Callable[[int, int], np.ndarray]:
    """``read_rows(start, stop)``: ``channels`` uint8 bands in BGR order, as the pipeline reads an
    ordinary image. Other inputs would be normalised wrongly without an error, so they need
    the caller's ``rgb_from`` (``'gray'``, ``'first3'``) or ``scale_16bit`` (the value of 255)."""
    name = getattr(source, 'path', 'the image')
    bands, dtype = source.bands, source.dtype
    if dtype == np.uint16:
        if scale_16bit is None:
            raise LargeImageError(
                f'{name} is 16-bit; the config\'s preprocessing expects 8-bit values (0-255): '
                'pass --scale-16bit to map 0-65535 to 0-255, or --scale-16bit MAX for data '
                'that stops at MAX (e.g. 4095 for 12 bits)')
        if not scale_16bit > 0:
            raise LargeImageError(f'--scale-16bit must be positive, got {scale_16bit}')
    elif dtype != np.uint8:
        raise LargeImageError(f'{name} has {dtype} pixels; the config\'s preprocessing expects '
                              '8-bit values (0-255): convert it first, e.g. gdal_translate -ot '
                              'Byte -scale')
    elif scale_16bit is not None:
        raise LargeImageError(f'--scale-16bit was given but {name} is already 8-bit; drop it')
    if channels != 3:
        if bands != channels or rgb_from:
            raise LargeImageError(f'{name} has {bands} band(s); the config\'s preprocessing '
                                  f'expects {channels}: convert it first')
        select = list(range(bands))
    elif bands == 3:
        if rgb_from not in (None, 'first3'):
            raise LargeImageError(f'{name} has 3 bands (RGB), as the config\'s preprocessing '
                                  f'expects: --rgb-from {rgb_from} does not apply; drop it')
        select = [2, 1, 0]
    else:
        fix, select = ('gray', [0, 0, 0]) if bands < 3 else ('first3', [2, 1, 0])
        if rgb_from != fix:
            doing = 'band 1 repeated as R, G and B' if bands < 3 else 'bands 1-3 as R, G, B'
            what = {1: 'grey', 2: 'grey + alpha', 4: 'RGBA or RGB + near-infrared'}.get(
                bands, 'multispectral')
            raise LargeImageError(
                f'{name} has {bands} band(s) ({what}); the config\'s preprocessing expects 3 '
                f'(RGB): pass --rgb-from {fix} to use {doing}'
                + (f' (--rgb-from {rgb_from} does not apply)' if rgb_from else ''))

    def read_rows(start: int, stop: int) -> np.ndarray:
        rows = source.read_rows(start, stop)[:, :, select]
        if rows.dtype == np.uint16:
            rows = np.clip(np.rint(rows * (255.0 / scale_16bit)), 0, 255).astype(np.uint8)
        return np.ascontiguousarray(rows)

    return read_rows


def nodata_rows(source: _Source) -> Optional[Callable[[int, int], np.ndarray]]:
    """``mask(start, stop)`` of the pixels whose every band is the input's GDAL nodata value (the
    labels get their own: the input's, often 0, is a class id), or None without one."""
    value = source.nodata
    if value is None:
        return None

    def mask(start: int, stop: int) -> np.ndarray:
        rows = source.read_rows(start, stop)
        return (np.isnan(rows) if math.isnan(value) else rows == value).all(axis=2)

    return mask
