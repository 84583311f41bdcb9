# Copyright (c) xcit_mm contributors. All rights reserved.
"""The labels as polygons (GeoPackage, FlatGeobuf or GeoJSON), made band by band as the stream
gives the labels, so that the label raster never exists whole.

Each band is polygonised by GDAL (``rasterio.features.shapes``, 4-connected, as ``gdal_polygonize``
does by default) in pixel coordinates. A polygon that does not reach the band's last row is
complete and is written at once. One that reaches it stays open: when the next band comes, the
open polygons and the new band's polygons that meet across the seam (the same class in the pixels
directly above and below it) are grouped, and a group is joined into one polygon (a shapely union
of its pieces, exact in pixel coordinates) once no piece of it reaches the latest seam. So an
object spanning many bands is one polygon, with its holes, as polygonising the whole raster gives.
``rasterio``, ``shapely`` and ``pyogrio`` are imported inside the functions, not by
``import xcit_mm``."""
import os
import os.path as osp
import shutil
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import LargeImageError, check_output, sync_to_disk

# Output formats by file extension: GDAL's OGR driver of each.
VECTOR_DRIVERS = {'.gpkg': 'GPKG', '.fgb': 'FlatGeobuf', '.geojson': 'GeoJSON'}
_FIELDS = ['class_id', 'class_name', 'area']
_FLUSH_BYTES = 16 << 20  # complete polygons are written once their WKB passes this size
_SLICE_PIXELS = 1 << 18  # pixels polygonised at once (a band is cut into slices of rows)
_COPY_BATCH = 4096  # polygons per batch in the copy to FlatGeobuf or GeoJSON
_FULL_BYTES = 1 << 20  # a write failing with less free space than this failed on a full disk


def check_vector_output(path: str) -> str:
    """Fail before any work on a polygon file that cannot be written; return its OGR driver."""
    driver = VECTOR_DRIVERS.get(osp.splitext(path)[1].lower())
    if driver is None:
        raise LargeImageError(f'--vector {path}: unknown polygon format; end the name with '
                              f'{", ".join(VECTOR_DRIVERS)} (GeoPackage, FlatGeobuf, GeoJSON)')
    check_output(path, '--vector')
    return driver


def raise_if_full(path: str, error: Exception, option: str = '--vector') -> None:
    """A write that failed on a full disk as one error naming it. GDAL reports a full disk in
    words that vary by driver (SQLite's 'database or disk is full', 'Cannot write feature'), so
    the free space of the folder tells."""
    if shutil.disk_usage(osp.dirname(osp.abspath(path))).free < _FULL_BYTES:
        raise LargeImageError(f'no space left on the device while writing {path} ({error}); '
                              f'free space there or choose another {option}') from None


def queued_columns(pending: dict, class_names, value: str):
    """The features queued between writes (``pending``: lists of arrays under 'wkb',
    'class_id' and ``value``) as one WKB array and their columns: class id, class name and
    ``value``."""
    joined = {k: np.concatenate(v) if v else np.zeros(0, object if k == 'wkb' else float)
              for k, v in pending.items()}
    class_ids = joined['class_id'].astype(np.int32)
    names = np.array(class_names, dtype=object)[class_ids]
    return joined['wkb'], [class_ids, names, joined[value]]


def append_features(store: str, layer: str, wkb, columns: list, field_names: Sequence[str],
                    geometry_type: str, crs_wkt: Optional[str], append: bool,
                    option: str = '--vector') -> None:
    """Features (their WKB geometries and field columns) written to ``layer`` of the GeoPackage
    ``store`` (``append=False``: the layer created); a full disk is one error naming ``option``.
    No CRS is meant where the image is not georeferenced: pyogrio's warning about it is hushed."""
    import pyogrio.raw
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings('ignore', "'crs' was not provided")
            pyogrio.raw.write(store, wkb, columns, field_names, layer=layer, driver='GPKG',
                              geometry_type=geometry_type, crs=crs_wkt, append=append)
    except (OSError, RuntimeError) as e:  # pyogrio's errors are RuntimeErrors
        raise_if_full(store, e, option)
        raise


def copy_layer(store: str, made: str, layer: str, driver: str, geometry_type: str,
               crs_wkt: Optional[str], option: str = '--vector') -> None:
    """The GeoPackage ``store``'s ``layer`` copied to ``made`` in ``driver``'s format, by batches
    (GDAL's Arrow streams): FlatGeobuf and GeoJSON cannot be appended to in place."""
    import pyogrio.raw
    try:
        with pyogrio.raw.open_arrow(store, layer=layer, batch_size=_COPY_BATCH) as (
                meta, stream), warnings.catch_warnings():
            warnings.filterwarnings('ignore', "'crs' was not provided")
            pyogrio.raw.write_arrow(stream, made, layer=layer, driver=driver,
                                    geometry_name=meta['geometry_name'],
                                    geometry_type=geometry_type, crs=crs_wkt)
    except (OSError, RuntimeError) as e:
        raise_if_full(made, e, option)
        raise


def remove_vector_files(*names: str) -> None:
    """Remove these files if they exist, with SQLite's files beside a GeoPackage."""
    for name in set(names):
        for side in ('', '-journal', '-wal', '-shm'):
            if osp.exists(name + side):
                os.remove(name + side)


def _runs(labels: np.ndarray, valid: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Runs of equal valid labels along one row: each pixel's run index, and each run's first
    column."""
    change = np.ones(len(labels), bool)
    change[1:] = (labels[1:] != labels[:-1]) | (valid[1:] != valid[:-1])
    return np.cumsum(change) - 1, np.flatnonzero(change)


def _connected(n: int, pairs: np.ndarray) -> np.ndarray:
    """The component (a representative node) of each of ``n`` nodes joined by ``pairs``."""
    parent = np.arange(n)

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for a, b in pairs:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[rb] = ra
    return np.array([root(i) for i in range(n)], dtype=np.int64)


def _polygon_parts(geoms: np.ndarray, class_ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The polygons in ``geoms`` (multipolygons and collections split into their polygons, any
    part without area dropped), with the class of each."""
    import shapely
    while True:
        kind = shapely.get_type_id(geoms)
        multi = (kind == shapely.GeometryType.MULTIPOLYGON) | (
            kind == shapely.GeometryType.GEOMETRYCOLLECTION)
        if not multi.any():
            break
        parts, index = shapely.get_parts(geoms[multi], return_index=True)
        geoms = np.concatenate([geoms[~multi], parts])
        class_ids = np.concatenate([class_ids[~multi], class_ids[multi][index]])
    keep = (kind == shapely.GeometryType.POLYGON) & ~shapely.is_empty(geoms)
    return geoms[keep], class_ids[keep]


class PolygonWriter:
    """Label bands, top to bottom, to polygons with fields ``class_id``, ``class_name`` and
    ``area``, in the scene's CRS; use as a context manager (an exception leaves no file)::

        with PolygonWriter('labels.gpkg', class_names, crs=src.crs, transform=src.transform) as pw:
            for start, stop, labels in bands:
                pw.add_band(start, labels, nodata_mask=...)

    ``crs`` is anything rasterio's ``CRS.from_user_input`` takes (None for an image that is not
    georeferenced: the polygons are then in pixel coordinates, column and row, y down);
    ``transform`` maps (column, row) to the CRS (rasterio's ``Affine`` or its six numbers a, b, c,
    d, e, f; None for the identity). Pixels equal to ``nodata`` or set in a band's
    ``nodata_mask`` get no polygon. With ``height``, closing before that many rows is an error.
    ``area`` is the written polygon's area in the CRS's units (square metres in a projected CRS,
    square degrees in a geographic one, pixels without a CRS). ``min_area`` drops the polygons
    whose region is smaller (the area before simplifying, in the same units; a dropped polygon
    leaves a hole in its neighbour, it is not merged into it). ``simplify`` is a tolerance in
    the CRS's units for GEOS's topology-preserving simplification, applied to each polygon on
    its own (neighbours may then overlap or part slightly along their shared edge).

    What is held beyond one band: the last band's last row, the open polygons (those reaching
    the latest seam; one spanning the whole scene is held until its last row) and up to 16 MB of
    complete polygons between writes. The polygons go to a GeoPackage beside the output
    (appended to as they complete: GDAL's GPKG driver appends in place); a .fgb or .geojson is
    made from it at the end, streamed by batches through GDAL's Arrow interface, because GDAL's
    FlatGeobuf driver cannot append and its GeoJSON driver rewrites the whole file from memory
    on every update. The file appears under its name only when complete.

    A .geojson in a projected CRS names it in GeoJSON 2008's ``crs`` member, which GDAL and QGIS
    read (RFC 7946 allows only WGS84 longitude / latitude). Without a CRS, GDAL takes a .geojson
    to be in WGS84, while pathology tools such as QuPath read its coordinates as pixels.
    """

    def __init__(self, path: str, class_names: Sequence[str], crs=None, transform=None,
                 nodata: Optional[int] = None, min_area: float = 0.0, simplify: float = 0.0,
                 height: Optional[int] = None, layer: Optional[str] = None):
        from rasterio.crs import CRS
        from rasterio.transform import Affine
        self.driver = check_vector_output(path)
        if not min_area >= 0:
            raise LargeImageError(f'--min-area {min_area}: give an area of 0 or more (in the '
                                  "CRS's units, square metres for a projected CRS)")
        if not simplify >= 0:
            raise LargeImageError(f'--simplify {simplify}: give a tolerance of 0 or more (in '
                                  "the CRS's units, metres for a projected CRS)")
        self.path = path
        self.class_names = list(class_names)
        self.crs_wkt = CRS.from_user_input(crs).to_wkt() if crs is not None else None
        self.transform = Affine.identity() if transform is None else Affine(*tuple(transform)[:6])
        self.nodata = nodata
        self.height = height
        self.min_area = float(min_area)
        self.simplify = float(simplify)
        ext = osp.splitext(path)[1]
        self.layer = layer or osp.basename(path)[:-len(ext)]
        self._store = path + '.partial.gpkg'  # polygons as they complete
        self._made = path + '.partial' + ext if self.driver != 'GPKG' else self._store
        self._rows = 0  # rows received
        self._width = None
        self._seam = None  # the last row received: labels, valid, open group of each pixel
        self._open: List[Tuple[int, list]] = []  # open groups: class id, pieces
        self._pending: Dict[str, list] = {'wkb': [], 'class_id': [], 'area': []}
        self._pending_bytes = 0
        self._closed = False
        self._remove_temporaries()  # a killed run's leftovers
        self._write(append=False)  # the layer, so that a file that cannot be made fails now

    # ---------------------------------------------------------------- bands in

    def add_band(self, start: int, labels, nodata_mask: Optional[np.ndarray] = None) -> None:
        """Polygonise rows ``start`` to ``start + len(labels)`` of the label raster (a (rows, W)
        integer array or tensor, the rows after those already given); ``nodata_mask``, the
        same shape, is True where a pixel has no data. The band is polygonised by slices of
        rows of a quarter megapixel at most: GDAL's polygons reach Python as lists of vertex
        tuples, many times the size of the pixels for fragmented labels, so slices bound them
        whatever the band's height or the image's width."""
        labels, valid = self._checked(start, labels, nodata_mask)
        rows = max(1, _SLICE_PIXELS // labels.shape[1])
        for top in range(0, len(labels), rows):
            self._add_slice(start + top, labels[top:top + rows], valid[top:top + rows])

    def _add_slice(self, start: int, labels: np.ndarray, valid: np.ndarray) -> None:
        """Polygonise a checked slice of rows and join its polygons to the open ones above."""
        import shapely
        pieces, piece_class = self._polygonise(labels, valid, start)
        tree = shapely.STRtree(pieces)
        top = self._row_pieces(tree, labels[0], valid[0], start)
        bottom = top if len(labels) == 1 else self._row_pieces(tree, labels[-1], valid[-1],
                                                               start + len(labels) - 1)

        # group the open polygons (nodes 0..n_open-1) with the pieces that meet them across the
        # seam (nodes n_open + piece index): the same class directly above and below
        n_open = len(self._open)
        pairs = np.zeros((0, 2), np.int64)
        if self._seam is not None:
            seam_labels, seam_valid, seam_group = self._seam
            meet = np.flatnonzero(seam_valid & valid[0] & (seam_labels == labels[0]))
            pairs = np.unique(np.stack([seam_group[meet], n_open + top[meet]], 1), axis=0)
        component = _connected(n_open + len(pieces), pairs)
        groups: Dict[int, Tuple[int, list]] = {}
        for node, comp in enumerate(component):
            class_id, members = (self._open[node] if node < n_open else
                                 (piece_class[node - n_open], [pieces[node - n_open]]))
            groups.setdefault(int(comp), (class_id, []))[1].extend(members)

        # groups reaching the band's last row stay open; the others are complete
        open_comps = np.unique(component[n_open + bottom[valid[-1]]])
        self._open = [groups.pop(int(c)) for c in open_comps]
        group_of_pixel = np.full(self._width, -1, np.int64)
        group_of_pixel[valid[-1]] = np.searchsorted(open_comps,
                                                    component[n_open + bottom[valid[-1]]])
        self._seam = (labels[-1].copy(), valid[-1].copy(), group_of_pixel)
        self._rows = start + len(labels)
        self._complete(list(groups.values()))

    def _checked(self, start: int, labels, nodata_mask) -> Tuple[np.ndarray, np.ndarray]:
        """The band as an array of a type GDAL polygonises, and its pixels with data; one error
        for a band out of order, of another width, or with a class that has no name."""
        if self._closed:
            raise RuntimeError('PolygonWriter.add_band after close')
        if hasattr(labels, 'cpu'):  # a torch tensor
            labels = labels.cpu().numpy()
        labels = np.asarray(labels)
        if labels.ndim != 2 or not len(labels) or start != self._rows:
            raise RuntimeError(f'label band of shape {labels.shape} at row {start}: expected '
                               f'one or more rows of the raster, starting at row {self._rows}')
        if self._width is None:
            self._width = labels.shape[1]
        if labels.shape[1] != self._width or not np.issubdtype(labels.dtype, np.integer):
            raise RuntimeError(f'label band of shape {labels.shape} and type {labels.dtype}: '
                               f'expected {self._width} columns of integer class ids')
        if labels.dtype not in (np.uint8, np.uint16, np.int16, np.int32):  # types GDAL takes
            labels = labels.astype(np.int32)
        valid = np.ones(labels.shape, bool)
        if nodata_mask is not None:
            nodata_mask = np.asarray(nodata_mask, bool)
            if nodata_mask.shape != labels.shape:
                raise RuntimeError(f'nodata mask of shape {nodata_mask.shape} for a label band '
                                   f'of shape {labels.shape}')
            valid &= ~nodata_mask
        if self.nodata is not None:
            valid &= labels != self.nodata
        if valid.any():
            low, high = labels[valid].min(), labels[valid].max()
            if low < 0 or high >= len(self.class_names):
                raise ValueError(f'class ids {low} to {high} in rows [{start}, '
                                 f'{start + len(labels)}), but {len(self.class_names)} class '
                                 'names')
        return labels, valid

    @staticmethod
    def _polygonise(labels: np.ndarray, valid: np.ndarray, start: int) -> Tuple[list, list]:
        """GDAL's polygons of the band's regions of data, in pixel coordinates of the whole
        raster (column, row), and the class of each."""
        import shapely
        from rasterio.features import shapes
        from rasterio.transform import Affine
        # all rings' vertices in one array, made into shapely's rings and polygons at once
        # (shapely's shape() checks each vertex in Python)
        vertices, ring_sizes, rings_per_piece, piece_class = [], [], [], []
        for geom, value in shapes(labels, mask=valid, connectivity=4,
                                  transform=Affine.translation(0, start)):
            rings_per_piece.append(len(geom['coordinates']))
            for ring in geom['coordinates']:
                ring_sizes.append(len(ring))
                vertices.extend(ring)
            piece_class.append(int(value))
        if not piece_class:
            return [], []
        rings = shapely.linearrings(np.array(vertices, dtype=np.float64),
                                    indices=np.repeat(np.arange(len(ring_sizes)), ring_sizes))
        pieces = shapely.polygons(rings, indices=np.repeat(np.arange(len(rings_per_piece)),
                                                           rings_per_piece))
        return list(pieces), piece_class

    @staticmethod
    def _row_pieces(tree, labels: np.ndarray, valid: np.ndarray, y: int) -> np.ndarray:
        """The index in ``tree`` of the piece holding each pixel of row ``y`` (-1: no data),
        found from the centre of the first pixel of each run of equal labels."""
        import shapely
        run_of_pixel, run_start = _runs(labels, valid)
        run_piece = np.full(len(run_start), -1, np.int64)
        runs = np.flatnonzero(valid[run_start])
        if len(runs):
            centres = shapely.points(run_start[runs] + 0.5, np.full(len(runs), y + 0.5))
            run_index, piece = tree.query(centres, predicate='intersects')
            if len(run_index) != len(runs) or np.any(np.bincount(run_index) != 1):
                raise RuntimeError(f'row {y}: a run of labels is not in exactly one polygon')
            run_piece[runs[run_index]] = piece
        return run_piece[run_of_pixel]

    # ---------------------------------------------------------------- polygons out

    def _complete(self, groups: List[Tuple[int, list]]) -> None:
        """Join each group's pieces, place them in the CRS, drop and simplify, and queue them
        for writing."""
        import shapely
        if not groups:
            return
        class_ids = np.array([class_id for class_id, _ in groups], np.int32)
        geoms = np.empty(len(groups), dtype=object)
        # pieces joined; simplifying by 0 drops the vertices the seams left on straight edges
        geoms[:] = [members[0] if len(members) == 1 else
                    shapely.simplify(shapely.union_all(members), 0)
                    for _, members in groups]
        a, b, c, d, e, f = tuple(self.transform)[:6]
        if (a, b, c, d, e, f) != (1, 0, 0, 0, 1, 0):
            matrix, offset = np.array([[a, b], [d, e]]).T, np.array([c, f])
            geoms = shapely.transform(geoms, lambda xy: xy @ matrix + offset)
        geoms, class_ids = self._valid(geoms, class_ids)
        if self.min_area > 0:
            keep = shapely.area(geoms) >= self.min_area
            geoms, class_ids = geoms[keep], class_ids[keep]
        if self.simplify > 0:
            geoms = shapely.simplify(geoms, self.simplify, preserve_topology=True)
            geoms, class_ids = self._valid(geoms, class_ids)
        if not len(geoms):
            return
        wkb = shapely.to_wkb(geoms)
        self._pending['wkb'].append(wkb)
        self._pending['class_id'].append(class_ids)
        self._pending['area'].append(shapely.area(geoms))
        self._pending_bytes += sum(len(w) for w in wkb)
        if self._pending_bytes >= _FLUSH_BYTES:
            self._write(append=True)

    @staticmethod
    def _valid(geoms: np.ndarray, class_ids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """The geometries made valid (GEOS's make_valid on any that are not), as polygons."""
        import shapely
        invalid = ~shapely.is_valid(geoms)
        if invalid.any():
            geoms = geoms.copy()
            geoms[invalid] = shapely.make_valid(geoms[invalid])
        return _polygon_parts(geoms, class_ids)

    def _write(self, append: bool) -> None:
        """Append the queued polygons to the GeoPackage (``append=False``: create its layer)."""
        wkb, columns = queued_columns(self._pending, self.class_names, 'area')
        append_features(self._store, self.layer, wkb, columns, _FIELDS, 'Polygon', self.crs_wkt,
                        append)
        self._pending = {'wkb': [], 'class_id': [], 'area': []}
        self._pending_bytes = 0

    # ---------------------------------------------------------------- finishing

    def close(self) -> None:
        """Complete the open polygons, write the file and give it its name."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.height is not None and self._rows != self.height:
                raise RuntimeError(f'the label bands stopped at row {self._rows} of '
                                   f'{self.height}')
            open_groups, self._open, self._seam = self._open, [], None
            self._complete(open_groups)
            self._write(append=True)
            if self.driver != 'GPKG':
                copy_layer(self._store, self._made, self.layer, self.driver, 'Polygon',
                           self.crs_wkt)
            sync_to_disk(self._made)  # on disk before it gets its name
            os.replace(self._made, self.path)
        finally:
            self._remove_temporaries()

    def abort(self) -> None:
        """Stop without a file."""
        self._closed = True
        self._open, self._seam = [], None
        self._remove_temporaries()

    def _remove_temporaries(self) -> None:
        remove_vector_files(self._store, self._made)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.close()
        else:
            self.abort()
