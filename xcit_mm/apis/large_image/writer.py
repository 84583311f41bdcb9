# Copyright (c) xcit_mm contributors. All rights reserved.
"""The label file, written band by band as the stream gives the labels."""
import errno
import os
import os.path as osp
from typing import Callable, Iterable, Iterator, Optional, Sequence, Tuple

import numpy as np

from .errors import LargeImageError
from .reader import GDAL_NODATA


def _tiles(bands: Iterable[Tuple[int, int, object]], hw: Tuple[int, int], dtype: np.dtype,
           tile: int, nodata_mask: Optional[Callable[[int, int], np.ndarray]],
           on_rows: Optional[Callable[[int], None]]) -> Iterator[np.ndarray]:
    """Tiles in file order from label bands in row order, one row of tiles buffered; the parts
    of edge tiles past the image are zeros."""
    height, width = hw
    pending = np.zeros((0, width), dtype)  # rows received, not yet in a tile row
    y = 0  # first image row not yet received
    for start, stop, labels in bands:
        if start != y or not start < stop <= height:
            raise RuntimeError(f'label bands out of order: rows [{start}, {stop}) after row {y}')
        labels = labels.numpy() if hasattr(labels, 'numpy') else np.asarray(labels)
        if labels.shape != (stop - start, width):
            raise RuntimeError(f'label band [{start}, {stop}) has shape {labels.shape}, '
                               f'expected {(stop - start, width)}')
        labels = labels.astype(dtype)
        if nodata_mask is not None:
            labels[nodata_mask(start, stop)] = np.iinfo(dtype).max
        y = stop
        if on_rows is not None:
            on_rows(y)
        pending = np.concatenate([pending, labels])
        while len(pending) >= tile or (y == height and len(pending)):
            row = np.zeros((tile, -(-width // tile) * tile), dtype)  # zeros past the edges
            row[:min(tile, len(pending)), :width] = pending[:tile]
            pending = pending[tile:]
            for x in range(0, width, tile):
                yield row[:, x:x + tile].copy()
    if y != height:
        raise RuntimeError(f'the label bands stopped at row {y} of {height}')


def write_labels(out: str, bands: Iterable[Tuple[int, int, object]], hw: Tuple[int, int],
                 num_classes: int, palette=None, geotags: Sequence[tuple] = (),
                 nodata_mask: Optional[Callable[[int, int], np.ndarray]] = None,
                 tile: int = 256, on_rows: Optional[Callable[[int], None]] = None) -> None:
    """Label bands ``(start, stop, labels)``, top to bottom, into a deflate-tiled BigTIFF (uint8
    up to 255 classes, uint16 above; ``nodata_mask``'s pixels the dtype's largest value), written
    as ``out + '.partial'`` and renamed once complete, so a failed run leaves no file."""
    import tifffile
    if num_classes > 65535:
        raise LargeImageError(f'{num_classes} classes do not fit a 16-bit label file')
    # uint8 up to 255 classes: 255 stays free for nodata
    dtype = np.dtype(np.uint8 if num_classes <= 255 else np.uint16)
    cmap = None
    if palette:  # the TIFF ColorMap: 16-bit RGB, 2**bits entries, those past the palette black
        cmap = np.zeros((3, 2 ** (8 * dtype.itemsize)), np.uint16)
        rgb = np.asarray(palette, np.uint16)[:cmap.shape[1]]
        cmap[:, :len(rgb)] = rgb.T * 257
    extratags = list(geotags)
    if nodata_mask is not None:
        extratags.append((GDAL_NODATA, 's', 0, str(np.iinfo(dtype).max), True))
    partial = out + '.partial'
    tiles = _tiles(bands, hw, dtype, tile, nodata_mask, on_rows)
    try:
        with tifffile.TiffWriter(partial, bigtiff=True) as tw:
            # tifffile closes the iterator it is given: a generator expression, so that `tiles`
            # stays open for the line after
            tw.write((t for t in tiles), shape=tuple(hw), dtype=dtype, tile=(tile, tile),
                     compression='zlib', colormap=cmap, extratags=extratags, metadata=None,
                     photometric='palette' if cmap is not None else 'minisblack')
        next(tiles, None)  # the bands run to their end: _tiles refuses any past the last row
        os.replace(partial, out)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise LargeImageError(f'no space left on the device while writing {partial}; free '
                                  'space there or choose another --out') from None
        raise
    finally:
        tiles.close()
        if hasattr(bands, 'close'):  # an unfinished engine generator cleans up now, not at GC
            bands.close()
        if osp.exists(partial):  # not renamed: the run failed
            os.remove(partial)
