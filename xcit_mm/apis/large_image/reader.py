# Copyright (c) xcit_mm contributors. All rights reserved.
"""Windows of rows of a large image, as the model reads them, and the pixels that hold data.

Which library reads which file (:func:`open_image`):

- **GDAL, through rasterio**, for every raster GDAL reads: GeoTIFF, BigTIFF, COG, JPEG2000, VRT
  mosaics (many files as one scene), PNG / JPEG with world files, georeferencing from
  ``.aux.xml``. GDAL decides what the file means (its georeferencing, band order, nodata, alpha
  and mask bands), as it does for QGIS, so the labels land where the user sees the input.
- **tifffile**, at level 0, for OME-TIFF, whole-slide and microscopy TIFFs (SVS, NDPI, SCN,
  ImageJ, LSM, ...) and any TIFF whose image is split over several pages: GDAL reads such a
  file's first page as the image (one channel of an OME-TIFF), and cannot decode the JPEG
  stripes of NDPI slides.

Neither decodes the whole image: a read touches only the blocks (tiles, strips, scanlines) of its
rows, and the blocks kept for the next read are bounded in bytes (GDAL's block cache, set while
the file is open; tifffile's decoded tile rows), a share of ``max_memory`` that ``memory_mb``
states so that the caller can leave it out of the model's budget. A file whose single block row
does not fit that share (a TIFF stored as one strip) is refused with the command that re-tiles
it. rasterio and tifffile are imported inside the functions, not by ``import xcit_mm``.
"""
import collections
import contextlib
import os.path as osp
import warnings
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np

from .errors import LargeImageError

_TIFF_MAGIC = (b'II*\x00', b'MM\x00*', b'II+\x00', b'MM\x00+')
# tifffile's flags of the microscopy and slide TIFFs it reads and GDAL does not read as one image
_TIFFFILE_KINDS = ('ome', 'svs', 'ndpi', 'scn', 'bif', 'philips', 'qpi', 'imagej', 'lsm', 'stk',
                   'fluoview', 'mmstack', 'ndtiff', 'micromanager', 'metaseries', 'nih', 'sis',
                   'scanimage', 'eer', 'mdgel')
MB = 2 ** 20
# The reader's share of a budget and its cache without one (MB); its cache is at least
# LEAST_CACHE_MB where the share allows, since the blocks GDAL decodes may be larger than the
# file says: a VRT reports its own blocks, not those of the files it reads.
BUDGET_SHARE, CACHE_WITHOUT_BUDGET_MB, LEAST_CACHE_MB = 0.25, 512.0, 64.0


def cache_mb_for(block_row_bytes: int, max_memory: Optional[float], path: str) -> float:
    """The reader's cache: two block rows (a band's rows and the halo rows above it that the next
    band reads again), within a quarter of ``max_memory``; a block row that does not fit is
    refused, since it would be decoded whole outside the budget."""
    cap = CACHE_WITHOUT_BUDGET_MB if max_memory is None else BUDGET_SHARE * max_memory
    row_mb = block_row_bytes / MB
    if row_mb > cap:
        where = (f"a quarter of --max-memory {max_memory:g} MB" if max_memory is not None
                 else f'{cap:g} MB')
        raise LargeImageError(
            f'{path}: one row of its blocks (tiles or strips) takes {row_mb:.1f} MB, more than '
            f'the reader may hold ({where}); re-tile it first, e.g. gdal_translate -co TILED=YES '
            '-co COMPRESS=DEFLATE -co BIGTIFF=IF_SAFER IN OUT.tif'
            + (', or raise --max-memory' if max_memory is not None else ''))
    return min(cap, max(2 * row_mb, LEAST_CACHE_MB))


class _Source(contextlib.AbstractContextManager):
    """Rows of an image in the file's band order: ``height``, ``width``, ``bands``, ``dtype``;
    where it lies: ``crs``, ``transform`` (rasterio's Affine, None without one), ``gcps`` (GDAL's
    ground control points, may be empty); ``nodata``, per band (None where a band has none);
    ``alpha_bands`` (1-based); ``memory_mb``, the most its cache holds; ``files``, the paths it
    reads. Subclasses read a checked window in ``_read`` and its valid pixels in ``_valid``."""

    crs = None
    transform = None
    gcps: List = []
    alpha_bands: Tuple[int, ...] = ()

    def read_rows(self, start: int, stop: int,
                  bands: Optional[Sequence[int]] = None) -> np.ndarray:
        """Rows ``start..stop-1`` as (rows, width, bands) of the 1-based ``bands`` (default all)."""
        return self._read(start, stop, self._check(start, stop, bands))

    def has_mask(self, bands: Optional[Sequence[int]] = None) -> bool:
        """Whether any of ``bands`` (default all) has pixels without data (nodata, alpha or a
        mask band)."""
        return False

    def valid_rows(self, start: int, stop: int,
                   bands: Optional[Sequence[int]] = None) -> np.ndarray:
        """(rows, width) bool: True where a pixel holds data in at least one of ``bands``
        (default all), as GDAL's masks say (a nodata value, an alpha band, a mask band or
        ``.msk`` file). An alpha band is the mask of the others, not a band of data itself."""
        bands = self._check(start, stop, bands)
        if not self.has_mask(bands):
            return np.ones((stop - start, self.width), bool)
        return self._valid(start, stop, self._data_bands(bands))

    def _data_bands(self, bands: Sequence[int]) -> List[int]:
        return [b for b in bands if b not in self.alpha_bands] or list(bands)

    def _check(self, start: int, stop: int, bands: Optional[Sequence[int]]) -> List[int]:
        if not 0 <= start < stop <= self.height:
            raise ValueError(f'rows [{start}, {stop}) are not inside the image\'s '
                             f'{self.height} rows')
        bands = list(range(1, self.bands + 1)) if bands is None else [int(b) for b in bands]
        if not bands or not all(1 <= b <= self.bands for b in bands):
            raise ValueError(f'bands {bands} are not among the image\'s bands 1-{self.bands}')
        return bands

    def close(self) -> None:
        pass

    def __exit__(self, *exc):
        self.close()


class _GdalSource(_Source):
    """Any raster GDAL reads, by windows of rows through rasterio; GDAL's block cache is bounded
    to ``memory_mb`` while the file is open."""

    def __init__(self, path: str, max_memory: Optional[float], tiff: bool = False,
                 note: str = ''):
        import rasterio
        from rasterio.errors import NotGeoreferencedWarning, RasterioIOError
        self.path = path
        self.dataset = self.env = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter('ignore', NotGeoreferencedWarning)
                self.dataset = rasterio.open(path)
        except RasterioIOError as e:
            kind = 'corrupt or truncated TIFF' if tiff else 'not an image GDAL reads'
            raise LargeImageError(f'{kind}: {path} ({e}{note})') from None
        ds = self.dataset
        try:
            self.height, self.width, self.bands = ds.height, ds.width, ds.count
            if not self.bands:
                raise LargeImageError(f'{path}: no raster bands (GDAL reads it as '
                                      f'{ds.driver}: a vector or container file?)')
            if len(set(ds.dtypes)) > 1:
                raise LargeImageError(f'{path}: bands of different pixel types {ds.dtypes}; '
                                      'convert it first, e.g. gdal_translate -ot UInt16')
            self.dtype = np.dtype(ds.dtypes[0])
            self.nodata = tuple(ds.nodatavals)
            self.files = [osp.abspath(f) for f in ds.files]
            gcps, gcp_crs = ds.gcps
            self.gcps = list(gcps)
            self.crs = ds.crs or (gcp_crs if gcps else None)
            # rasterio gives the identity (and a warning) for a file without a geotransform
            self.transform = None if ds.transform.is_identity else ds.transform
            self.alpha_bands = tuple(i + 1 for i, c in enumerate(ds.colorinterp)
                                     if c.name == 'alpha')
            item = self.dtype.itemsize
            # a window reads one row of blocks in every band; pixel-interleaved blocks hold all
            # the bands, band-interleaved ones one each
            block_row = sum(h * -(-self.width // w) * w * item for h, w in ds.block_shapes)
            self.memory_mb = cache_mb_for(block_row, max_memory, path)
            # in bytes (GDAL reads a number above 100000 as bytes, below as MB)
            self.env = rasterio.Env(GDAL_CACHEMAX=max(100_001, int(self.memory_mb * MB)))
            self.env.__enter__()
        except BaseException:
            self.close()
            raise

    def _window(self, start, stop):
        from rasterio.windows import Window
        return Window(0, start, self.width, stop - start)

    def _gdal(self, what: str, start: int, stop: int, read: Callable[[], np.ndarray]):
        from rasterio.errors import RasterioError
        try:
            return read()
        except RasterioError as e:
            raise LargeImageError(
                f'{self.path}: rows {start}-{stop - 1} cannot be read ({what}: {e}); the file '
                'may be corrupt or truncated: check it with gdalinfo -checksum, copy it again'
            ) from None

    def _read(self, start, stop, bands):
        rows = self._gdal('pixels', start, stop, lambda: self.dataset.read(
            bands, window=self._window(start, stop)))
        return np.ascontiguousarray(rows.transpose(1, 2, 0))

    def has_mask(self, bands=None):
        flags = self.dataset.mask_flag_enums
        bands = self._data_bands(range(1, self.bands + 1) if bands is None else bands)
        return any([f.name for f in flags[b - 1]] != ['all_valid'] for b in bands)

    def _valid(self, start, stop, bands):
        masks = self._gdal('masks', start, stop, lambda: self.dataset.read_masks(
            bands, window=self._window(start, stop)))
        return masks.any(axis=0)

    def close(self) -> None:
        if self.env is not None:
            self.env.__exit__()
            self.env = None
        if self.dataset is not None:
            self.dataset.close()
            self.dataset = None


class _TiffSource(_Source):
    """A microscopy or slide TIFF read by tifffile, decoding only the tiles (or strips) a window
    touches; the decoded tile rows that consecutive bands with their halos share are kept, up to
    ``memory_mb``. Such files carry no GDAL georeferencing or masks."""

    def __init__(self, tif, path: str, max_memory: Optional[float]):
        self.path, self.tif = path, tif
        self.files = [osp.abspath(path)]
        self.nodata = ()
        try:
            self.pages = self._image_pages(self.tif.series[0])
            page = self.pages[0]
            self.height, self.width = int(page.imagelength), int(page.imagewidth)
            self.dtype = np.dtype(page.dtype)
            self.bands = sum(int(p.samplesperpixel) for p in self.pages)
            self.nodata = (None, ) * self.bands
            tile_row = sum(p.chunks[0] * self.width * p.samplesperpixel for p in self.pages)
            self.memory_mb = cache_mb_for(tile_row * self.dtype.itemsize, max_memory, path)
        except BaseException as e:
            self.close()
            if isinstance(e, (LargeImageError, KeyboardInterrupt)):
                raise
            raise LargeImageError(f'corrupt or truncated TIFF: {path} ({e})') from None
        self._cache = collections.OrderedDict()  # (page, tile row) -> decoded rows, oldest first

    def _image_pages(self, series) -> list:
        """The pages of level 0 of the first image: one page, or one per channel (OME-TIFF's C
        axis); layouts read wrongly are refused."""
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
                    'CMYK) is not read; convert it to RGB first')
            if (photometric == PHOTOMETRIC.YCBCR and page.compression != 7
                    and tuple(page.subsampling or (1, 1)) != (1, 1)):
                raise LargeImageError(f'{self.path}: subsampled YCbCr without JPEG is not read; '
                                      'convert it to RGB first')
            check_segments(page, self.tif.filehandle.size, self.path)
        return pages

    def _tile_row(self, p: int, ty: int) -> np.ndarray:
        """Rows of segment row ``ty`` of page ``p``, all columns and samples, from the cache or
        decoded; the oldest rows leave the cache once it passes ``memory_mb``."""
        key = (p, ty)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        rows = self._decode_tile_row(p, ty)
        self._cache[key] = rows
        while sum(r.nbytes for r in self._cache.values()) > self.memory_mb * MB:
            self._cache.popitem(last=False)
        return rows

    def _decode_tile_row(self, p: int, ty: int) -> np.ndarray:
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

    def _read(self, start, stop, bands):
        parts = []
        for p, page in enumerate(self.pages):
            th = page.chunks[0]
            rows = [self._tile_row(p, ty)[max(start - ty * th, 0):stop - ty * th]
                    for ty in range(start // th, (stop - 1) // th + 1)]
            parts.append(np.concatenate(rows, axis=0) if len(rows) > 1 else rows[0])
        rows = np.concatenate(parts, axis=2) if len(parts) > 1 else parts[0]
        return rows[:, :, [b - 1 for b in bands]]  # a copy: the cached rows stay as decoded

    def close(self) -> None:
        if self.tif is not None:
            self.tif.close()
            self.tif = None


def check_segments(page, size: int, path: str) -> None:
    """Refuse before any work a TIFF page whose tiles or strips pass the end of the file."""
    for i, (offset, count) in enumerate(zip(page.dataoffsets, page.databytecounts)):
        if count and offset + count > size:
            raise LargeImageError(
                f'truncated TIFF: {path}: {"tile" if page.is_tiled else "strip"} {i} ends at '
                f'byte {offset + count}, the file has {size} bytes; copy or download it again')


def _tifffile_reads(tif) -> bool:
    """Whether tifffile reads this TIFF (a microscopy or slide kind, or an image over several
    pages), not GDAL."""
    if any(getattr(tif, 'is_' + kind, False) for kind in _TIFFFILE_KINDS):
        return True
    return len(tif.series) > 0 and len(tif.series[0].pages) > 1


def open_image(path: str, max_memory: Optional[float] = None) -> _Source:
    """Windows of rows of the image at ``path`` (see the module's docstring for which library
    reads which file), its cache within a quarter of ``max_memory`` (MB)."""
    if path.startswith('/vsi'):  # GDAL's virtual file systems: /vsizip/, /vsicurl/, ...
        return _GdalSource(path, max_memory)
    if not osp.isfile(path):
        raise LargeImageError(f'image not found: {path}')
    with open(path, 'rb') as f:
        tiff = f.read(4) in _TIFF_MAGIC
    if not tiff:
        return _GdalSource(path, max_memory)
    import tifffile
    try:
        tif = tifffile.TiffFile(path)
    except Exception as e:  # tifffile's many ways of meeting a broken header: GDAL says
        return _GdalSource(path, max_memory, tiff=True, note=f'; tifffile: {e}')
    try:
        if _tifffile_reads(tif):
            return _TiffSource(tif, path, max_memory)
        check_segments(tif.pages.first, tif.filehandle.size, path)
    except LargeImageError:
        tif.close()
        raise
    except Exception as e:  # a header tifffile does not follow: GDAL says
        tif.close()
        return _GdalSource(path, max_memory, tiff=True,
                           note=f'; tifffile: {type(e).__name__}: {e}')
    tif.close()
    return _GdalSource(path, max_memory, tiff=True)


class ModelRows:
    """``read_rows(start, stop)`` for ``LeanEncoderDecoder.stream_labels`` (called as the object
    itself): the selected bands as uint8, in BGR order for a 3-channel config (as mmcv reads an
    ordinary image); ``valid_rows`` (None when no selected band has a mask), ``bands`` (1-based,
    in the model's R, G, B order) and ``scale`` ((MIN, MAX) per band, or None)."""

    def __init__(self, source: _Source, bands: List[int], scale, valid: bool, bgr: bool):
        self.source, self.bands, self.scale = source, bands, scale
        order = slice(None, None, -1) if bgr else slice(None)
        self._read_bands = bands[order]
        if scale is not None:  # as float32 arrays over the bands in the order read
            self._low, self._high = (np.asarray(v, np.float32)[order] for v in zip(*scale))
        self.valid_rows = self._valid_rows if valid else None

    def __call__(self, start: int, stop: int) -> np.ndarray:
        rows = self.source.read_rows(start, stop, self._read_bands)
        if self.scale is None:
            return np.ascontiguousarray(rows)
        scaled = (rows.astype(np.float32) - self._low) * (np.float32(255) /
                                                          (self._high - self._low))
        np.nan_to_num(scaled, copy=False, nan=0.0)  # a float band's NaN (usually masked too)
        return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)

    def _valid_rows(self, start: int, stop: int) -> np.ndarray:
        return self.source.valid_rows(start, stop, sorted(set(self.bands)))


def _band_choice(source: _Source, channels: int, bands: Optional[Sequence[int]],
                 rgb_from: Optional[str], name: str) -> List[int]:
    """The 1-based bands the model gets, in its R, G, B order, checked."""
    count = source.bands
    if bands is not None:
        if rgb_from:
            raise LargeImageError(f'--bands and --rgb-from {rgb_from} both choose the bands; '
                                  'give one of them')
        bands = [int(b) for b in bands]
        wrong = [b for b in bands if not 1 <= b <= count]
        if wrong:
            raise LargeImageError(f'--bands {" ".join(map(str, wrong))}: {name} has {count} '
                                  f'band(s), numbered 1-{count} as GDAL numbers them')
        if len(bands) != channels:
            raise LargeImageError(f'--bands names {len(bands)} band(s); the config\'s '
                                  f'preprocessing expects {channels}'
                                  + (' (R, G, B)' if channels == 3 else ''))
        return bands
    colour = [b for b in range(1, count + 1) if b not in source.alpha_bands]
    if channels != 3:
        if count != channels or rgb_from:
            raise LargeImageError(f'{name} has {count} band(s); the config\'s preprocessing '
                                  f'expects {channels}: choose them with --bands, or convert '
                                  'it first')
        return list(range(1, count + 1))
    if count == 3 or (len(colour) == 3 and rgb_from in (None, 'first3')):
        if rgb_from not in (None, 'first3'):
            raise LargeImageError(f'{name} has 3 colour bands (RGB), as the config\'s '
                                  f'preprocessing expects: --rgb-from {rgb_from} does not '
                                  'apply; drop it')
        return colour if len(colour) == 3 else [1, 2, 3]
    fix, chosen = ('gray', [1, 1, 1]) if count < 3 else ('first3', [1, 2, 3])
    if rgb_from != fix:
        doing = 'band 1 repeated as R, G and B' if count < 3 else 'bands 1-3 as R, G, B'
        what = {1: 'grey', 2: 'grey + alpha', 4: 'RGBA or RGB + near-infrared'}.get(
            count, 'multispectral')
        raise LargeImageError(
            f'{name} has {count} band(s) ({what}); the config\'s preprocessing expects 3 '
            f'(RGB): pass --rgb-from {fix} to use {doing}, or --bands R G B to choose them'
            + (f' (--rgb-from {rgb_from} does not apply)' if rgb_from else ''))
    return chosen


def _scaling(dtype: np.dtype, bands: List[int], scale: Optional[Sequence[float]],
             scale_16bit: Optional[float], name: str):
    """(MIN, MAX) per selected band, or None for 8-bit input taken as it is."""
    if scale_16bit is not None:
        if scale is not None:
            raise LargeImageError('--scale and --scale-16bit both scale the bands; give one')
        if dtype != np.uint16:
            raise LargeImageError(f'--scale-16bit was given but {name} is {dtype.name}, not '
                                  '16-bit: drop it' + (', or use --scale MIN MAX'
                                                       if dtype != np.uint8 else ''))
        if not scale_16bit > 0:
            raise LargeImageError(f'--scale-16bit must be positive, got {scale_16bit}')
        scale = (0.0, scale_16bit)
    if scale is None:
        if dtype == np.uint8:
            return None
        hint = (' (or --scale-16bit for 0-65535, --scale-16bit MAX for data that stops at MAX, '
                'e.g. 4095 for 12 bits)' if dtype == np.uint16 else '')
        raise LargeImageError(
            f'{name} has {dtype.name} pixels; the config\'s preprocessing expects 8-bit values '
            '(0-255): pass --scale MIN MAX to map MIN to 0 and MAX to 255 (one pair for all '
            f'bands or one per band, e.g. --scale 0 3000 for reflectances){hint}')
    scale = [float(v) for v in scale]
    if len(scale) not in (2, 2 * len(bands)):
        raise LargeImageError(f'--scale takes MIN MAX once for all bands or once per selected '
                              f'band ({2 * len(bands)} numbers for {len(bands)} bands); got '
                              f'{len(scale)}')
    pairs = [tuple(scale[i:i + 2]) for i in range(0, len(scale), 2)]
    pairs = pairs * len(bands) if len(pairs) == 1 else pairs
    bad = [p for p in pairs if not (np.isfinite(p).all() and p[0] < p[1])]
    if bad:
        raise LargeImageError(f'--scale {bad[0][0]:g} {bad[0][1]:g}: MIN must be below MAX, both '
                              'finite numbers')
    return pairs


def model_rows(source: _Source, channels: int = 3, bands: Optional[Sequence[int]] = None,
               scale: Optional[Sequence[float]] = None, rgb_from: Optional[str] = None,
               scale_16bit: Optional[float] = None) -> ModelRows:
    """The model's rows of ``source``: ``bands`` (1-based, GDAL's order; the model's R, G, B) or
    the shortcut ``rgb_from`` (``'first3'``: bands 1, 2, 3; ``'gray'``: band 1 three times);
    without either, a 3-band file, or 3 colour bands and GDAL's alpha band. Pixels other than
    8-bit need ``scale``: MIN -> 0, MAX -> 255, linear and clipped, one pair for all bands or one
    per band (``scale_16bit``: 0 -> 0, MAX -> 255). Other inputs would be normalised wrongly
    without an error, so they are refused, naming the option."""
    name = getattr(source, 'path', 'the image')
    chosen = _band_choice(source, channels, bands, rgb_from, name)
    pairs = _scaling(np.dtype(source.dtype), chosen, scale, scale_16bit, name)
    valid = source.has_mask(sorted(set(chosen)))
    return ModelRows(source, chosen, pairs, valid, bgr=channels == 3)
